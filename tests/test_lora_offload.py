"""spec.lora and spec.cpuOffload: the GPU bytes computed by hand from the tensor shapes in vLLM's code
(vllm/lora/layers/*.py create_lora_weights, vllm/lora/punica_wrapper, models/utils.py and
offloader/uva.py; see vllmfit/core/memory/lora.py), on real configs from tests/data/hf-configs."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from vllmfit import main as cli
from vllmfit.core import memory
from vllmfit.core.memory import Settings, SpecError
from vllmfit.core.memory.lora import lora_activation_bytes, lora_bytes
from vllmfit.core.memory.versions import parse_version
from vllmfit.core.model.config import parse_hf_config
from vllmfit.core.spec import api, extraargs
from vllmfit.operator.admission import verdict
from vllmfit.operator.rendering import builders
from vllmfit.sources import catalog

DATA = Path(__file__).parent / "data" / "hf-configs"
H100 = catalog.gpu("NVIDIA-H100-80GB-HBM3")
GIB = 1 << 30
UNLIMITED = 1 << 62


def model(stem: str):
    return parse_hf_config(json.loads((DATA / f"{stem}.json").read_text()), name=stem)


@pytest.fixture(scope="module")
def llama():
    return model("meta-llama__Meta-Llama-3.1-8B")  # h 4096, 32 heads, 8 KV heads, head 128, I 14336, 32 layers, vocab 128256


def punica(b: int = 8192, s: int = 1024, n: int = 4) -> int:
    # punica_base.py PunicaWrapperBase.__init__: 4 int64 tensors of max_num_batched_tokens, 3 of max_batches
    # punica_gpu.py: 2 x LoRAKernelMeta.make: 2 int32 of max_num_batched_tokens, int32 (n+1), (n+1), (n+2)
    return 4 * b * 8 + 3 * s * 8 + 2 * (2 * b * 4 + (2 * (n + 1) + (n + 2)) * 4)


def llama8b_slot_elements(tp: int, r: int, embeddings: bool = True) -> int:
    """One adapter slot of Llama-3.1-8B on one TP rank, term by term."""
    h, q, kv, i = 4096, 32 // tp * 128, max(1, 8 // tp) * 128, 14336 // tp
    qkv_a = 3 * r * h  # column_parallel_linear.py MergedQKVParallelLinearWithLoRA: 3 slices of lora_a (1, R, h)
    qkv_b = r * (q + kv + kv)  # lora_b (1, q_shard, R), (1, kv_shard, R) twice
    o = r * (32 * 128 // tp) + h * r  # row_parallel_linear.py: lora_a (1, R, in/tp), lora_b (1, h, R)
    gate_up = 2 * r * h + 2 * i * r  # MergedColumnParallelLinearWithLoRA: 2 x lora_a (1, R, h), 2 x lora_b (1, I/tp, R)
    down = r * i + h * r  # RowParallelLinearWithLoRA
    layers = 32 * (qkv_a + qkv_b + o + gate_up + down)
    embed = 128256 * r + h * r  # VocabParallelEmbeddingWithLoRA: lora_a (vocab, R), lora_b (1, h, R); not sharded
    logits = r * h + 128256 * r  # LogitsProcessorWithLoRA: lora_a (1, R, h), lora_b (1, vocab, R); not sharded
    return layers + ((embed + logits) if embeddings else 0)


# --- LoRA: hand calculations --------------------------------------------------------------------


@pytest.mark.parametrize(("tp", "rank", "expected"), [
    # 4 slots x elements x 2 B (lora_dtype auto = bfloat16) + punica metadata (417,920 B at B 8192, S 1024)
    (1, 16, 369_844_352),  # 46,178,304 elements per slot: 32 x 1,310,720 + 2 x 2,117,632
    (1, 64, 1_478_123_648),
    (2, 16, 260_792_448),  # row-parallel inputs and column-parallel outputs halve; embeddings do not
    (2, 64, 1_041_916_032),
])
def test_llama8b_lora_bytes_by_hand(llama, tp, rank, expected):
    hand = 4 * llama8b_slot_elements(tp, rank) * 2 + punica()
    assert hand == expected
    s = Settings(tp=tp, lora_max_loras=4, lora_max_rank=rank)
    assert lora_bytes(llama, s, parse_version("0.33")[0], 8192, 1024) == expected


def test_llama8b_rank16_x4_is_a_third_of_a_gib(llama):
    # the figure quoted in docs/memory-model.md: 369,844,352 B = 0.344 GiB at TP1, 0.243 GiB at TP2
    assert round(369_844_352 / GIB, 3) == 0.344 and round(260_792_448 / GIB, 3) == 0.243


def test_kv_heads_replicated_past_their_count(llama):
    # TP 16 > 8 KV heads: QKVParallelLinear keeps 1 KV head per rank (num_kv_head_replicas = 2)
    s = Settings(tp=16, lora_max_loras=1, lora_max_rank=8)
    assert memory.lora_bytes(llama, s, parse_version("0.33")[0], 8192, 256) == \
        llama8b_slot_elements(16, 8) * 2 + punica(8192, 256, 1)


def test_float32_model_dtype_doubles_the_slots(llama):
    s = Settings(lora_max_loras=2, lora_max_rank=16, dtype="float32")
    v = parse_version("0.33")[0]
    assert lora_bytes(llama, s, v, 2048, 256) == 2 * llama8b_slot_elements(1, 16) * 4 + punica(2048, 256, 2)
    # an explicit lora dtype wins over the model's
    assert lora_bytes(llama, replace(s, lora_dtype="bfloat16"), v, 2048, 256) == \
        2 * llama8b_slot_elements(1, 16) * 2 + punica(2048, 256, 2)


def test_embedding_lora_follows_the_model_class_per_version():
    v15, v21 = parse_version("0.15")[0], parse_version("0.21")[0]
    qwen2 = model("Qwen__Qwen2.5-7B")  # models/qwen2.py: no embedding_modules in any version read
    s = Settings(lora_max_loras=1, lora_max_rank=8)
    h, q, kv, i, r = 3584, 28 * 128, 4 * 128, 18944, 8
    per_layer = 3 * r * h + r * (q + 2 * kv) + r * q + h * r + 2 * r * h + 2 * i * r + r * i + h * r
    assert lora_bytes(qwen2, s, v21, 8192, 1024) == 28 * per_layer * 2 + punica(8192, 1024, 1)
    qwen3 = model("Qwen__Qwen3-8B")  # models/qwen3.py: embedding_modules from 0.17
    emb = 2 * (151936 * r + 4096 * r) * 2
    assert lora_bytes(qwen3, s, v21, 8192, 1024) - lora_bytes(qwen3, s, v15, 8192, 1024) == emb


def test_tied_embeddings_book_a_second_embedding_lora(llama):
    # qwen3.py 0.17-0.21 with tie_word_embeddings: lm_head = model.embed_tokens, so vLLM wraps that
    # module twice (embedding LoRA under both names) and adds the logits LoRA: 3 vocab-sized units
    v = parse_version("0.33")[0]
    s = Settings(lora_max_loras=1, lora_max_rank=16)
    tied = replace(llama, tie_word_embeddings=True)
    assert lora_bytes(tied, s, v, 8192, 1024) - lora_bytes(llama, s, v, 8192, 1024) == (128256 * 16 + 4096 * 16) * 2


def test_pipeline_stages_hold_half_the_layers_and_one_embedding(llama):
    v = parse_version("0.33")[0]
    s = Settings(pp=2, lora_max_loras=1, lora_max_rank=16)
    layers = llama8b_slot_elements(1, 16, embeddings=False) // 2
    assert lora_bytes(llama, s, v, 8192, 1024) == (layers + 128256 * 16 + 4096 * 16) * 2 + punica(8192, 1024, 1)


def test_footprint_books_slots_as_weights_and_graphs_twice(llama):
    base = memory.size(llama, Settings(max_model_len=8192), H100, UNLIMITED).footprint
    lora = memory.size(llama, Settings(max_model_len=8192, lora_max_loras=4), H100, UNLIMITED).footprint
    assert lora.lora == 369_844_352
    assert lora.weights == base.weights + 369_844_352  # vLLM loads them inside "Model loading took"
    assert lora.cuda_graphs == 2 * base.cuda_graphs  # cudagraph_specialize_lora: without and with LoRA
    v = parse_version("0.33")[0]
    forward, logits = lora_activation_bytes(llama, Settings(lora_max_loras=4), v, 8192, 1024)
    assert forward == 3 * 8192 * 16 * 4  # float32 qkv shrink buffer (3 slices, tokens, R)
    assert logits == 1024 * 16 * 4  # float32 logits shrink buffer (rows, R); no re-index copy at TP 1
    assert base.activation < lora.activation <= base.activation + forward + logits
    eager = memory.size(llama, Settings(max_model_len=8192, lora_max_loras=4, enforce_eager=True), H100, UNLIMITED)
    assert eager.footprint.cuda_graphs == 0


@pytest.mark.parametrize(("stem", "settings", "words"), [
    ("meta-llama__Meta-Llama-3.1-8B", {"vllm_version": "0.11"}, "vLLM 0.12 and later"),
    ("meta-llama__Meta-Llama-3.1-8B", {"lora_max_rank": 24}, "maxLoraRank 24"),
    ("meta-llama__Meta-Llama-3.1-8B", {"policy": "adr"}, "vllm memory policy"),
    ("mistralai__Mixtral-8x7B-v0.1", {}, "MoE experts"),
    ("deepseek-ai__DeepSeek-V3", {"tp": 8}, "MLA"),
    ("nvidia__Nemotron-H-56B-Base-8K", {}, "recurrent-state"),
    ("Qwen__Qwen3-VL-8B-Instruct", {}, "multimodal"),
    ("nvidia__Llama-3_3-Nemotron-Super-49B-v1", {}, "DeciLMForCausalLM"),
])
def test_lora_is_refused_where_the_rule_is_not_derived(stem, settings, words):
    m = model(stem)
    with pytest.raises(SpecError, match=words):
        memory.size(m, Settings(lora_max_loras=2, **settings), H100, UNLIMITED)


def test_vocabulary_limit_of_the_logits_lora(llama):
    big = replace(llama, vocab_size=258_049)
    with pytest.raises(SpecError, match="vocabulary of 258049"):
        memory.size(big, Settings(lora_max_loras=1, max_model_len=4096), H100, UNLIMITED)
    ok = replace(llama, vocab_size=258_048)  # the 0.17+ limit, inclusive
    assert memory.size(ok, Settings(lora_max_loras=1, max_model_len=4096), H100, UNLIMITED).fits
    with pytest.raises(SpecError, match="at most 257024"):  # 0.15's limit
        memory.size(ok, Settings(lora_max_loras=1, max_model_len=4096, vllm_version="0.15"), H100, UNLIMITED)


# --- CPU offload --------------------------------------------------------------------------------

LLAMA8_LAYER_BYTES = 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096) * 2
"""Decoder layers of Llama-3.1-8B in bf16 (q, o, k, v, gate, up, down, 2 norms): what make_layers can
offload; 13,959,168,000 B. The embeddings, lm_head and final norm stay on the GPU."""


def test_offload_takes_the_limit_off_the_weights(llama):
    assert LLAMA8_LAYER_BYTES == 13_959_168_000
    base = memory.size(llama, Settings(max_model_len=8192), H100, UNLIMITED).footprint
    off = memory.size(llama, Settings(max_model_len=8192, cpu_offload_bytes=10 * GIB), H100, UNLIMITED).footprint
    # maybe_offload_to_cpu moves whole parameters until >= 10 GiB left: the GPU keeps at most
    # weights - 10 GiB, so booking exactly that over-reserves by less than one parameter
    assert off.cpu_offloaded == 10 * GIB and off.weights == base.weights - 10 * GIB
    assert (off.activation, off.cuda_graphs) == (base.activation, base.cuda_graphs)  # UVA: no copies, same graphs


def test_offload_beyond_the_layers_stops_at_the_layers(llama):
    base = memory.size(llama, Settings(max_model_len=8192), H100, UNLIMITED).footprint
    off = memory.size(llama, Settings(max_model_len=8192, cpu_offload_bytes=100 * GIB), H100, UNLIMITED).footprint
    assert off.cpu_offloaded == LLAMA8_LAYER_BYTES
    # what stays: 2 x 128256 x 4096 x 2 B of embeddings and lm_head + the RoPE cache (131072 x 128 x 2 B)
    # + the final norm (4096 x 2 B)
    assert off.weights == base.weights - LLAMA8_LAYER_BYTES == 2 * 128256 * 4096 * 2 + 131072 * 128 * 2 + 4096 * 2


def test_offload_shards_per_rank(llama):
    off = memory.size(llama, Settings(tp=2, max_model_len=8192, cpu_offload_bytes=100 * GIB), H100, UNLIMITED)
    # each rank offloads from its own shard. vllmfit's weights shard the norms with the linear layers
    # (vLLM replicates them: 32 x 2 x 4096 x 2 B on every rank), so the cap it books is
    # (layers + final norm) / 2 - final norm = 6,979,579,904 B, 266,240 B under the rank's real layer
    # bytes (32 x 218,103,808 x 2 / 2 + 524,288 = 6,979,846,144): the GPU is booked slightly more, never less
    assert off.footprint.cpu_offloaded == (LLAMA8_LAYER_BYTES + 4096 * 2) // 2 - 4096 * 2 == 6_979_579_904
    assert 32 * (218_112_000 - 8192) * 2 // 2 + 32 * 2 * 4096 * 2 - 6_979_579_904 == 266_240


@pytest.mark.parametrize("nbytes", [10 * GIB, 3 * GIB // 2, 1, 123_456_789_012, 7 * GIB + 5])
def test_cpu_offload_flag_reads_back_as_the_same_bytes(nbytes):
    arg = memory.cpu_offload_arg(nbytes)
    gb = float(arg.removeprefix("--cpu-offload-gb="))
    assert int(gb * 1024**3) == nbytes  # vLLM: int(cpu_offload_gb * 1024**3)
    assert memory.cpu_offload_arg(10 * GIB) == "--cpu-offload-gb=10.0"


def test_offload_refused_before_021_with_several_kv_groups():
    gpt = model("openai__gpt-oss-20b")  # sliding + full attention: two KV cache groups
    s = Settings(cpu_offload_bytes=2 * GIB, max_model_len=8192)
    with pytest.raises(SpecError, match="several groups"):
        memory.size(gpt, replace(s, vllm_version="0.19"), H100, UNLIMITED)
    assert memory.size(gpt, replace(s, vllm_version="0.21"), H100, UNLIMITED).fits


def test_offload_fix_by_itself_makes_a_70b_fit_one_gpu():
    m = model("meta-llama__Meta-Llama-3.1-70B")  # 141 GB of bf16 weights
    s = Settings(max_model_len=4096)
    budget = memory.DEFAULT_POLICY.budget(H100.cuda_total_bytes)
    assert not memory.size(m, s, H100, budget).fits
    assert memory.size(m, replace(s, cpu_offload_bytes=80 * GIB), H100, budget).fits


# --- The spec, the pod, the CLI, extraArgs, the webhook --------------------------------------------


def spec(**kw) -> api.VLLMDeploymentSpec:
    return api.VLLMDeploymentSpec.model_validate({"model": "meta-llama/Llama-3.1-8B-Instruct", **kw})


def test_spec_to_pod_flags():
    flags = api.Flags(max_model_len=8192, max_num_seqs=256, gpu_memory_utilization=0.3,
                      kv_cache_memory_bytes=GIB, max_num_batched_tokens=8192)
    args = builders.vllm_args(spec(lora={"maxLoras": 4, "maxLoraRank": 64}, cpuOffload="1536Mi"), "m", flags)
    assert args[args.index("--enable-lora") + 1:args.index("--enable-lora") + 3] == ["--max-loras=4", "--max-lora-rank=64"]
    assert "--cpu-offload-gb=1.5" in args and not any(a.startswith("--lora-dtype") for a in args)
    args = builders.vllm_args(spec(lora={"loraDtype": "float16"}), "m", flags)
    assert {"--enable-lora", "--max-loras=1", "--max-lora-rank=16", "--lora-dtype=float16"} <= set(args)
    assert not any("lora" in a or "offload" in a for a in builders.vllm_args(spec(), "m", flags))


def test_spec_settings_and_validation():
    from vllmfit.core.placement.inputs import settings_from_spec

    s = settings_from_spec(spec(lora={"maxLoras": 8}, cpuOffload="10Gi"))
    assert (s.lora_max_loras, s.lora_max_rank, s.lora_dtype, s.cpu_offload_bytes) == (8, 16, "auto", 10 * GIB)
    assert settings_from_spec(spec()).lora_max_loras is None
    for bad in ({"lora": {"maxLoraRank": 24}}, {"lora": {"maxLoras": 0}}, {"cpuOffload": "lots"},
                {"lora": {"rank": 8}}):
        with pytest.raises(ValueError):
            spec(**bad)


def test_estimate_cli_json(capsys):
    code = cli.main(["estimate", "--model-config", str(DATA / "meta-llama__Meta-Llama-3.1-8B.json"),
                     "--lora-max-loras", "4", "--lora-max-rank", "16", "--cpu-offload", "10Gi",
                     "--max-model-len", "8192", "--output", "json"])
    d = json.loads(capsys.readouterr().out)
    assert code == 0 and d["per_gpu"]["lora_bytes"] == 369_844_352 and d["per_gpu"]["cpu_offload_bytes"] == 10 * GIB
    code = cli.main(["estimate", "--model-config", str(DATA / "meta-llama__Meta-Llama-3.1-8B.json"),
                     "--max-model-len", "8192", "--output", "json"])
    d = json.loads(capsys.readouterr().out)
    assert "lora_bytes" not in d["per_gpu"] and "cpu_offload_bytes" not in d["per_gpu"]  # goldens unchanged


@pytest.mark.parametrize(("argv", "words"), [
    (["--lora-max-rank", "24"], "--lora-max-rank 24"),  # the CLI speaks its flags (issue 24)
    (["--lora-max-loras", "0"], "--lora-max-loras must be a positive number"),
    (["--cpu-offload", "ten"], "--cpu-offload 'ten' is not a Kubernetes quantity"),
])
def test_estimate_cli_bad_input_is_one_line(capsys, argv, words):
    code = cli.main(["estimate", "--model-config", str(DATA / "meta-llama__Meta-Llama-3.1-8B.json"), *argv])
    err = capsys.readouterr().err
    assert code == 2 and words in err and "Traceback" not in err


@pytest.mark.parametrize(("args", "field"), [
    (["--enable-lora"], "spec.lora"),
    (["--max-loras=4"], "spec.lora.maxLoras"),
    (["--max-lora-rank", "64"], "spec.lora.maxLoraRank"),
    (["--lora-dtype", "float16"], "spec.lora.loraDtype"),
    (["--cpu-offload-gb", "10"], "spec.cpuOffload"),
    (["--cpu-offload=10"], "spec.cpuOffload"),  # a prefix of --cpu-offload-gb (and --cpu-offload-params)
])
def test_raw_flags_are_refused_naming_the_spec_field(args, field):
    messages = extraargs.messages(args)
    assert any(f"use {field}" in m for m in messages), messages


def test_adapter_loading_flags_pass_and_draft_models_stay_refused():
    assert extraargs.problems(["--lora-modules", "sql=/adapters/sql", "--max-cpu-loras", "16"]) == []
    assert extraargs.problems(["--swap-space", "4"]) == []  # host memory only (0.11-0.17), gone from 0.19
    [msg] = extraargs.messages(["--speculative-config", "{}"])
    assert "a second model vllmfit does not size" in msg
    assert extraargs.problems(["--offload-group-size", "4"]) and extraargs.problems(["--fully-sharded-loras"])


@pytest.mark.parametrize(("old", "new", "shrink"), [
    ({"lora": {"maxLoras": 8}}, {"lora": {"maxLoras": 4}}, True),
    ({"lora": {"maxLoras": 4, "maxLoraRank": 64}}, {"lora": {"maxLoras": 4, "maxLoraRank": 16}}, True),
    ({"lora": {}}, {}, True),  # LoRA removed
    ({}, {"lora": {}}, False),
    ({"lora": {"maxLoras": 4}}, {"lora": {"maxLoras": 8}}, False),
    ({"lora": {}}, {"lora": {"loraDtype": "float16"}}, False),
    ({"cpuOffload": "4Gi"}, {"cpuOffload": "8Gi"}, True),
    ({}, {"cpuOffload": "8Gi"}, True),
    ({"cpuOffload": "8Gi"}, {}, False),
])
def test_webhook_shrink(old, new, shrink):
    assert verdict.is_shrink(spec(**old), spec(**new)) is shrink
