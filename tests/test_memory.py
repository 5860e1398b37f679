"""The memory model against hand calculations written out here (ADR-0002 and vLLM's accounting)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllmfit.core import defaults, memory
from vllmfit.core.memory import Settings
from vllmfit.sources import catalog

GIB = 1 << 30
H100_T = 85_031_714_816  # cudaMemGetInfo total of an H100 80GB HBM3 (79.19 GiB in the calibration logs)
LLAMA8 = "meta-llama/Llama-3.1-8B-Instruct"
LLAMA8_PARAMS = 8_030_261_248  # published: safetensors total_size 16,060,522,496 B / 2
LLAMA8_EMB = 128_256 * 4_096  # vocab x hidden
ROPE = 131_072 * 128 * 2  # vLLM's cos/sin cache: max positions x head dim x 2 B, on every rank


@pytest.fixture(scope="module")
def llama():
    return catalog.model(LLAMA8)


@pytest.fixture(scope="module")
def h100():
    return catalog.gpu("H100-80GB")


# --- ADR-0002, exactly -----------------------------------------------------------------------


def test_budget_is_utilization_times_capacity_minus_reserve():
    # 0.90 x 85,031,714,816 = 76,528,543,334.4 -> 76,528,543,334; minus 2 GiB (2,147,483,648)
    assert memory.budget_bytes(H100_T) == 76_528_543_334 - 2_147_483_648 == 74_381_059_686
    assert defaults.UTILIZATION == 0.90 and defaults.RESERVE_BYTES == 2 * GIB and defaults.REPLICATION_OVERHEAD == 0.02


def test_adr_weights_with_replication(llama):
    # params x 2 B (bf16) / tp x 1.02
    assert memory.adr_weights_bytes(llama, Settings(tp=1, policy="adr")) == int(8_030_261_248 * 2 * 1.02)
    assert memory.adr_weights_bytes(llama, Settings(tp=2, policy="adr")) == int(8_030_261_248 * 2 / 2 * 1.02)
    # q8 = 1 byte, q4 = 0.5 byte per parameter
    assert memory.adr_weights_bytes(llama, Settings(quantization="fp8", policy="adr")) == int(8_030_261_248 * 1.02)


def test_adr_kv_bytes_per_token_gqa(llama):
    # headDim = 4096 / 32 = 128; 2 x 32 layers x 8 kv heads x 128 x 2 B / tp
    assert memory.adr_kv_bytes_per_token(llama, Settings(policy="adr")) == 2 * 32 * 8 * 128 * 2 == 131_072
    assert memory.adr_kv_bytes_per_token(llama, Settings(tp=2, policy="adr")) == 65_536
    assert memory.adr_kv_bytes_per_token(llama, Settings(kv_cache_dtype="fp8", policy="adr")) == 65_536


def test_adr_suggested_flags_from_budget_left(llama, h100):
    s = Settings(policy="adr", max_model_len=8192)  # max_num_seqs unset: ADR formula
    sz = memory.size(llama, s, h100, memory.budget_bytes(H100_T))
    weights = int(8_030_261_248 * 2 * 1.02)
    budget_left = 74_381_059_686 - weights
    assert sz.flags.max_num_seqs == budget_left // (131_072 * 8192)  # = 54
    s2 = Settings(policy="adr", max_num_seqs=16)  # max_model_len unset: ADR formula, block multiple
    sz2 = memory.size(llama, s2, h100, memory.budget_bytes(H100_T))
    assert sz2.flags.max_model_len == min(131_072, budget_left // (131_072 * 16) // 16 * 16)


# --- vLLM policy: weights ------------------------------------------------------------------------


def test_weights_bf16_is_params_times_two(llama):
    assert memory.weights_bytes(llama, Settings()) == LLAMA8_PARAMS * 2 + ROPE


def test_weights_tp2_shards_layers_and_vocab(llama):
    layers = LLAMA8_PARAMS - 2 * LLAMA8_EMB  # everything but embed_tokens and lm_head
    vocab_per_rank = math.ceil(128_256 / 128) * 64  # padded to 64 x tp rows, then split
    expected = layers * 2 // 2 + 2 * vocab_per_rank * 4096 * 2 + ROPE
    assert memory.weights_bytes(llama, Settings(tp=2)) == expected
    # calibration log (vLLM 0.19, H100, TP=2): "Model loading took 7.51 GiB"
    assert abs(expected / GIB - 7.51) < 0.05


def test_weights_fp8_online_keeps_embeddings_in_bf16(llama):
    expected = (LLAMA8_PARAMS - 2 * LLAMA8_EMB) * 1 + 2 * LLAMA8_EMB * 2 + ROPE
    assert memory.weights_bytes(llama, Settings(quantization="fp8")) == expected
    assert abs(expected / GIB - 8.49) < 0.05  # calibration log: 8.49 GiB


def test_weights_pp2_is_the_fuller_stage(llama):
    layers = LLAMA8_PARAMS - 2 * LLAMA8_EMB
    expected = layers * 2 * 16 // 32 + LLAMA8_EMB * 2 + ROPE  # 16 of 32 layers + one vocab table
    assert abs(memory.weights_bytes(llama, Settings(pp=2)) - expected) <= 1
    assert abs(expected / GIB - 7.51) < 0.05  # calibration log, PP=2


# --- vLLM policy: KV cache ---------------------------------------------------------------------


def test_kv_page_llama(llama):
    v, _ = memory.parse_version("0.33")
    lay = memory.kv_layout(llama, Settings(), v)
    # page = 2 x block 16 x kv heads 8 x head 128 x 2 B, per layer; 32 layers in one group
    assert lay.block_bytes == 32 * 2 * 16 * 8 * 128 * 2 == 2 * 1024 * 1024
    assert lay.bytes_per_token == 131_072
    # 8 requests of 8192 tokens: 8 x 512 blocks + the null block
    assert lay.bytes_for(8192, 8, 8192) == (8 * 512 + 1) * 2 * 1024 * 1024


def test_kv_heads_per_rank_is_at_least_one(llama):
    v, _ = memory.parse_version("0.33")
    # 8 KV heads over tp=16: max(1, 8 // 16) = 1 head per rank
    assert memory.kv_layout(llama, Settings(tp=16), v).bytes_per_token == 32 * 2 * 1 * 128 * 2


def test_kv_mla_is_not_divided_by_tp():
    ds = catalog.model("deepseek-ai/DeepSeek-V2-Lite-Chat")
    v, _ = memory.parse_version("0.33")
    # one latent of kv_lora_rank 512 + rope 64 = 576 elements x 2 B x 27 layers, on every rank
    assert memory.kv_layout(ds, Settings(), v).bytes_per_token == 576 * 2 * 27
    assert memory.kv_layout(ds, Settings(tp=2), v).bytes_per_token == 576 * 2 * 27


def test_kv_tokens_dense_equals_blocks_times_block_size(llama):
    # calibration: "Available KV cache memory: 58.11 GiB", 29,751 blocks, 476,016 tokens (vLLM 0.19)
    v, _ = memory.parse_version("0.19")
    lay = memory.kv_layout(llama, Settings(), v)
    tokens, _ = lay.tokens(29_751 * lay.block_bytes, 8192, 8192)
    assert tokens == 476_016


def test_sliding_window_saves_only_when_window_plus_batch_is_below_length():
    v, _ = memory.parse_version("0.19")
    gemma = catalog.model("google/gemma-2-9b-it")
    lay = memory.kv_layout(gemma, Settings(), v)
    # Gemma 2 at L=8192 with B=8192 (F >= 4097) saves nothing: both groups need ceil(8192/16)+... blocks
    full = lay.blocks_per_request(8192, 8192)
    assert full >= 2 * 512


# --- vLLM policy: sizing and flags -------------------------------------------------------------


def test_utilization_holds_the_requested_part(llama, h100):
    sz = memory.size(llama, Settings(max_model_len=8192, kv_concurrency=8), h100, memory.budget_bytes(H100_T))
    fp = sz.footprint
    u = sz.flags.gpu_memory_utilization
    requested = math.ceil(H100_T * u)
    # the measured KV margin (memory.margin, issue 13) is booked inside R too
    inside = fp.weights + fp.kv_cache + fp.activation + fp.non_torch + fp.cuda_graphs + fp.margin
    assert fp.margin == (23 + 79) * (1 << 30) // 100  # dense: KV residual band + CUDA-graph estimate band (0.33)
    assert requested >= inside  # vLLM's R holds everything but the CUDA context
    assert math.ceil(H100_T * (u - 0.0001)) < inside  # and u is the smallest 4-decimal value that does
    assert fp.total == fp.cuda_context + requested  # the footprint the ledger books
    assert fp.kv_cache == (8 * 512 + 1) * 2 * 1024 * 1024


def test_auto_context_shrinks_to_fit_and_warns(llama, h100):
    sz = memory.size(llama, Settings(kv_concurrency=8), h100, memory.budget_bytes(H100_T))
    assert sz.fits and sz.flags.max_model_len < 131_072 and sz.flags.max_model_len % 16 == 0
    assert sz.footprint.total <= memory.budget_bytes(H100_T)
    assert any("context reduced" in w for w in sz.warnings)


def test_explicit_context_is_never_reduced(llama, h100):
    sz = memory.size(llama, Settings(max_model_len=131_072, kv_concurrency=8), h100, memory.budget_bytes(H100_T))
    assert not sz.fits and sz.flags.max_model_len == 131_072 and sz.reasons


def test_estimate_misfit_lists_checked_fixes(h100):
    big = catalog.model("meta-llama/Llama-3.1-70B-Instruct")
    est = memory.estimate(big, Settings(max_model_len=32768, kv_concurrency=4), h100,
                          other_gpus=tuple(catalog.gpus().values()))
    assert not est.sizing.fits
    assert any(s.startswith("tensorParallelSize") for s in est.suggestions)
    fields = {"tensorParallelSize": ("tp", int), "maxModelLen": ("max_model_len", int),
              "kvCacheDtype": ("kv_cache_dtype", str), "quantization": ("quantization", str),
              "kvCache": ("kv_tokens", lambda v: int(v.strip("{}").split(": ")[1]))}
    for fix in est.suggestions:  # every fix re-checked independently ("k: v" or "k: v, k: v")
        pairs = [part.partition(": ") for part in fix.split(", ")]
        if all(k in fields for k, _, _ in pairs):
            s = replace(est.settings, **{fields[k][0]: fields[k][1](v) for k, _, v in pairs})
            if s.kv_tokens is not None:
                s = replace(s, kv_concurrency=None)
            assert memory.size(big, s, h100, memory.budget_bytes(H100_T)).fits, fix


def test_combined_fix_needs_fewer_gpus_than_tp_alone(h100):
    # 70B bf16 at 8k on H100s: tp=2 alone leaves ~65.7 GiB weights per GPU plus KV and overheads
    # (no fit), fp8 alone ~66 GiB on one GPU (no fit); tp=4 fits, and so does fp8 with tp=2
    big = catalog.model("meta-llama/Llama-3.1-70B-Instruct")
    est = memory.estimate(big, Settings(max_model_len=8192, kv_concurrency=8), h100)
    assert est.suggestions[-2:] == ("tensorParallelSize: 4", "tensorParallelSize: 2, quantization: fp8")
    assert memory.size(big, Settings(max_model_len=8192, kv_concurrency=8, tp=2, quantization="fp8"), h100,
                       memory.budget_bytes(H100_T)).fits


def test_pooling_model_is_sized_by_what_it_uses(h100):
    emb = catalog.model("BAAI/bge-m3")
    sz = memory.size(emb, Settings(), h100, memory.budget_bytes(H100_T))
    assert sz.fits and sz.footprint.total < 6 * GIB  # not 90% of the card
    assert sz.flags.gpu_memory_utilization < 0.1


def test_version_from_image_tag():
    v, w = memory.parse_version("vllm/vllm-openai:v0.11.0")
    assert (v.label, w) == ("0.11", None) and v.default_utilization == 0.90 and not v.graphs_in_budget
    v, w = memory.parse_version("vllm/vllm-openai:latest")
    assert v.label == "0.33" and "not a version" in w
    v, w = memory.parse_version("0.99")
    assert v.label == "0.33" and "newer" in w


def test_graphs_outside_budget_before_0_21(llama, h100):
    old = memory.size(llama, Settings(max_model_len=8192, vllm_version="0.19"), h100, 10**12)
    new = memory.size(llama, Settings(max_model_len=8192, vllm_version="0.33"), h100, 10**12)
    t = h100.cuda_total_bytes
    # 0.19: R holds no graphs, so the footprint is context + R + graph pool
    assert old.footprint.total == old.footprint.cuda_context + math.ceil(t * old.flags.gpu_memory_utilization) \
        + old.footprint.cuda_graphs
    assert new.footprint.total == new.footprint.cuda_context + math.ceil(t * new.flags.gpu_memory_utilization)


# --- properties ---------------------------------------------------------------------------------

MODELS = ["meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.1-70B-Instruct", "Qwen/Qwen2.5-7B-Instruct",
          "deepseek-ai/DeepSeek-V2-Lite-Chat", "mistralai/Mixtral-8x7B-Instruct-v0.1"]


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(MODELS), st.sampled_from([1, 2, 4, 8]), st.sampled_from([None, "fp8"]))
def test_more_tp_never_raises_per_gpu_weights(name, tp, quant):
    m = catalog.model(name)
    if memory.validate(m, Settings(tp=tp * 2)):
        return
    assert memory.weights_bytes(m, Settings(tp=tp * 2, quantization=quant)) <= memory.weights_bytes(
        m, Settings(tp=tp, quantization=quant))


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(MODELS), st.sampled_from([1, 2, 4]))
def test_fp8_kv_halves_kv_bytes_per_token(name, tp):
    m = catalog.model(name)
    v, _ = memory.parse_version("0.33")
    bf16 = memory.kv_layout(m, Settings(tp=tp, kv_cache_dtype="bfloat16"), v).bytes_per_token
    fp8 = memory.kv_layout(m, Settings(tp=tp, kv_cache_dtype="fp8"), v).bytes_per_token
    assert fp8 * 2 == bf16


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(MODELS), st.sampled_from([1024, 8192, 32768]), st.integers(1, 64),
       st.floats(16, 200), st.floats(1, 100))
def test_a_larger_gpu_never_turns_a_fit_into_a_misfit(name, length, seqs, gib, extra_gib):
    from vllmfit.core.model.facts import GpuType

    m = catalog.model(name)
    s = Settings(max_model_len=min(length, m.max_model_len), kv_concurrency=seqs)
    small = GpuType("a", "a", int(gib * GIB), int(gib * GIB))
    large = GpuType("b", "b", int((gib + extra_gib) * GIB), int((gib + extra_gib) * GIB))
    if memory.size(m, s, small, memory.budget_bytes(small.cuda_total_bytes)).fits:
        assert memory.size(m, s, large, memory.budget_bytes(large.cuda_total_bytes)).fits


def test_weights_quantized_vlm_keeps_the_vision_tower_in_bf16():
    """Issue 23: a quantized checkpoint's vision tower is stored unquantized (AutoAWQ, llm-compressor
    and modelopt leave it out) and vLLM quantizes only what the checkpoint stores quantized (AWQ's
    maybe_update_config: every layer stored as fp16/bf16 goes to modules_to_not_convert), so the
    tower costs 2 bytes per parameter, not AWQ's 0.5 + 2.5/128."""
    import json
    from pathlib import Path

    from vllmfit.core.model.config import parse_hf_config
    config = json.loads((Path(__file__).parent / "data/hf-configs/Qwen__Qwen3-VL-8B-Instruct.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True}
    vlm = parse_hf_config(config, name="Qwen3-VL-8B-AWQ")
    v = vlm.vision_params
    assert v > 400_000_000  # Qwen3-VL-8B's ViT: ~0.41 B parameters
    text_only = replace(vlm, params=vlm.params - v, vision_params=0)
    assert memory.weights_bytes(vlm, Settings()) - memory.weights_bytes(text_only, Settings()) == v * 2
    # online fp8 quantizes the tower's linear layers too (Fp8Config has no ignore list by default)
    fp8 = memory.weights_bytes(replace(vlm, quant=None), Settings(quantization="fp8"))
    fp8_text = memory.weights_bytes(replace(text_only, quant=None), Settings(quantization="fp8"))
    assert fp8 - fp8_text == v


def test_mxfp4_experts_padded_for_marlin_below_sm90():
    """Issue 23: below SM90 vLLM (0.11, 0.21, 0.33) runs MXFP4 experts with the Marlin MoE kernel
    and allocates them padded: hidden to a multiple of 256, the rank's intermediate to 128.
    gpt-oss-120b: 36 layers x 128 experts x 3 matrices of 2880 x 2880 become 3072 x 2944, at
    0.5 + 1/32 bytes per value: +5.13 GiB on an A100; none on an H100 (Triton)."""
    import json
    from pathlib import Path

    from vllmfit.core.memory.sizing import resolve
    from vllmfit.core.model.config import parse_hf_config
    gpt = parse_hf_config(json.loads((Path(__file__).parent / "data/hf-configs/openai__gpt-oss-120b.json")
                                     .read_text()), name="gpt-oss-120b")
    s = Settings(vllm_version="0.21.0")
    a100 = resolve(gpt, s, catalog.gpu("NVIDIA-A100-SXM4-80GB")).fixed.weights
    h100 = resolve(gpt, s, catalog.gpu("NVIDIA-H100-80GB-HBM3")).fixed.weights
    expected = 36 * 128 * 3 * (3072 * 2944 - 2880 * 2880) * 17 // 32
    assert a100 - h100 == expected == 5_504_827_392  # 5.13 GiB
    assert h100 == memory.weights_bytes(gpt, s)
    # TP 2: the rank's intermediate 1440 -> 1536, hidden 2880 -> 3072
    s2 = Settings(vllm_version="0.21.0", tp=2)
    a100_tp2 = resolve(gpt, s2, catalog.gpu("NVIDIA-A100-SXM4-80GB")).fixed.weights
    assert a100_tp2 - memory.weights_bytes(gpt, s2) == 36 * 128 * 3 * (3072 * 1536 - 2880 * 1440) * 17 // 32
