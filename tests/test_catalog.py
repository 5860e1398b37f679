"""catalog/models.yaml and catalog/gpus.yaml: every entry loads through the real loader and is
internally consistent; parameter counts agree with the architecture (catches typos in either)."""

from __future__ import annotations

import pytest

from vllmfit.core.defaults import MIB
from vllmfit.core.model.facts import count_params
from vllmfit.sources import catalog

RAW_MODELS = catalog._load_yaml("models.yaml")
RAW_GPUS = catalog._load_yaml("gpus.yaml")
MODELS = catalog.models()
GPUS = catalog.gpus()

# Totals published by the model authors (safetensors index total_size / 2 for bf16).
PUBLISHED_PARAMS = {
    "meta-llama/Llama-3.1-8B-Instruct": 8_030_261_248,
    "meta-llama/Llama-3.1-70B-Instruct": 70_553_706_496,
    "Qwen/Qwen2.5-7B-Instruct": 7_615_616_512,
    "mistralai/Mistral-7B-Instruct-v0.1": 7_241_732_096,
}

# Models whose exact count is far from count_params() for a known reason: the expected
# params / count_params ratio (checked to 3%), and why.
COUNT_EXCEPTIONS = {
    "BAAI/bge-m3": (
        0.62,
        "BERT-style encoder (2-matrix GELU MLP with biases, position embeddings, no LM head), while "
        + "count_params assumes a gated 3-matrix MLP and an untied head",
    ),
    "BAAI/bge-reranker-v2-m3": (0.62, "same encoder as bge-m3 plus a 1M-parameter classifier head"),
}

# Every model in shared/calibration/model_configs.json (the measured vLLM runs).
CALIBRATION_MODELS = [
    "Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen3-0.6B", "Qwen/Qwen3-14B", "Qwen/Qwen3-30B-A3B",
    "Qwen/Qwen3-32B", "Qwen/Qwen3-8B", "RedHatAI/Llama-3.3-70B-Instruct-FP8-dynamic",
    "RedHatAI/Meta-Llama-3.1-8B-Instruct-quantized.w4a16",
    "RedHatAI/Meta-Llama-3.1-8B-Instruct-quantized.w8a8", "RedHatAI/Qwen2.5-7B-Instruct-fp8-dynamic",
    "RedHatAI/Qwen2.5-7B-Instruct-quantized.w8a8", "codellama/CodeLlama-7b-hf",
    "deepseek-ai/DeepSeek-V2-Lite-Chat", "google/gemma-2-9b-it", "google/gemma-3-12b-it", "google/gemma-7b",
    "ibm-granite/granite-3.1-8b-instruct", "meta-llama/Llama-3.1-8B-Instruct", "microsoft/phi-4",
    "mistralai/Mixtral-8x7B-Instruct-v0.1", "moonshotai/Kimi-VL-A3B-Instruct", "openai/gpt-oss-20b",
]

MODEL_FIELDS = {"name", "params", "params_source", "source", "config"}
GPU_FIELDS = {"product", "name", "aliases", "architecture", "memory_mib", "source"}


def _norm(s: str) -> str:
    return catalog._norm(s)


def _text_config(entry: dict) -> dict:
    cfg = entry["config"]
    return cfg["text_config"] if isinstance(cfg.get("text_config"), dict) else cfg


def test_catalog_sizes_and_coverage():
    assert len(RAW_MODELS) >= 45 and len(RAW_GPUS) >= 16
    assert not set(CALIBRATION_MODELS) - set(MODELS)
    assert {m.name for m in MODELS.values() if m.pooling} >= {
        "BAAI/bge-m3", "BAAI/bge-reranker-v2-m3", "Qwen/Qwen3-Embedding-0.6B", "intfloat/e5-mistral-7b-instruct"
    }


@pytest.mark.parametrize("raw, key", [(RAW_MODELS, "name"), (RAW_GPUS, "product")])
def test_names_and_aliases_are_unique(raw, key):
    names = [e[key] for e in raw]
    assert len(names) == len(set(names))
    # what catalog._aliases resolves: the full name, the part after "/", every alias
    owner: dict[str, str] = {}
    for e in raw:
        keys = {_norm(e[key]), _norm(e[key].split("/")[-1])} | {_norm(a) for a in e.get("aliases", ())}
        for k in keys:
            assert owner.setdefault(k, e[key]) == e[key], f"{k!r} names both {owner[k]} and {e[key]}"


@pytest.mark.parametrize("entry", RAW_MODELS, ids=lambda e: e["name"])
def test_model_entry(entry):
    assert MODEL_FIELDS <= set(entry), MODEL_FIELDS - set(entry)
    assert entry["source"].startswith("https://huggingface.co/") and entry["source"].endswith("config.json")
    assert isinstance(entry["params"], int) and entry["params"] > 0
    assert entry.get("task") in (None, "embed", "classify")
    m = MODELS[entry["name"]]
    cfg = _text_config(entry)
    assert m.params == entry["params"] and m.architecture == entry["config"]["architectures"][0]
    assert m.num_attention_heads % m.num_kv_heads == 0
    if "head_dim" not in cfg and not m.is_mla:
        assert m.head_dim * m.num_attention_heads == m.hidden_size
    if m.is_moe:
        assert 0 < m.num_experts_per_tok <= m.num_experts
        assert 0 < m.moe_intermediate_size and m.first_k_dense < m.num_layers
    if "kv_lora_rank" in cfg:
        assert m.is_mla and m.qk_rope_head_dim > 0 and m.head_dim == m.kv_lora_rank + m.qk_rope_head_dim
    if "layer_types" in cfg:
        assert len(cfg["layer_types"]) == m.num_layers
    assert len(m.layer_types) == m.num_layers
    if m.sliding_window:
        assert "sliding" in m.layer_types
    if "quantization_config" in entry["config"]:
        assert m.quant is not None
    assert m.pooling == (entry.get("task") is not None)
    assert m.max_model_len >= 512


@pytest.mark.parametrize("name", list(MODELS))
def test_params_match_the_architecture(name):
    m = MODELS[name]
    ratio = m.params / (count_params(m) + m.vision_params)
    expected, _why = COUNT_EXCEPTIONS.get(name, (1.0, ""))
    assert ratio == pytest.approx(expected, rel=0.03), f"params / count_params = {ratio:.4f}"


@pytest.mark.parametrize("name, params", PUBLISHED_PARAMS.items())
def test_published_totals(name, params):
    assert MODELS[name].params == params


@pytest.mark.parametrize("entry", RAW_GPUS, ids=lambda e: e["product"])
def test_gpu_entry(entry):
    assert GPU_FIELDS <= set(entry), GPU_FIELDS - set(entry)
    assert entry["product"] == entry["name"].replace(" ", "-")  # GFD's label is the NVML name, dashed
    g = GPUS[entry["product"]]
    assert 8 * 1024 <= entry["memory_mib"] <= 256 * 1024
    assert g.memory_bytes == entry["memory_mib"] * MIB
    assert 0.9 * g.memory_bytes < g.cuda_total_bytes < g.memory_bytes
    assert g.architecture in {"volta", "turing", "ampere", "ada-lovelace", "hopper", "blackwell"}
    for alias in (entry["product"], *entry["aliases"]):
        assert catalog.gpu(alias) is g
