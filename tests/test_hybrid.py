"""Hybrid state-space / linear-attention models sized the way vLLM sizes them, checked against hand
calculations from vLLM's code (file and function named at each number). Real configs from
tests/data/hf-configs; no network."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from vllmfit.core import memory
from vllmfit.core.memory.kv import kv_layout, state_page_bytes
from vllmfit.core.model.config import parse_hf_config
from vllmfit.core.placement.inputs import settings_from_spec
from vllmfit.core.spec.api import VLLMDeploymentSpec
from vllmfit.sources import catalog

DATA = Path(__file__).parent / "data" / "hf-configs"
V = memory.VllmVersion


def arch(stem: str):
    return parse_hf_config(json.loads((DATA / f"{stem}.json").read_text()), name=stem)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def test_nemotron_h_56b_state_page_block_size_and_groups():
    """Nemotron-H-56B-Base-8K, TP 1, bf16, FlashAttention, vLLM 0.33 and 0.21.
    - layers/mamba/mamba_utils.py MambaStateShapeCalculator.mamba2_state_shape:
      conv (K-1, I + 2 G N) = (3, 16384 + 2*8*256), temporal (H, hd, N) = (256, 64, 256)
    - models/config.py NemotronHForCausalLMConfig.update_mamba_ssm_cache_dtype: temporal in float32
      (no mamba_ssm_cache_dtype in this config; 0.21+ default)
    - platforms/interface.py Platform._align_hybrid_block_size: bs = 16 * ceil(page / (16 * 2*8*128*2))
    - v1/core/kv_cache_utils.py _get_kv_cache_groups_uniform_page_size: A = 10, M = 54, 54 >= 1.5 * 10
      -> g = 10: 1 attention group + ceil(54/10) = 6 state groups
    - v1/kv_cache_interface.py MambaSpec.max_memory_usage_bytes: 1 block per state group (mode none,
      0.21), 2 + 1 checkpoint block (mode align, 0.33 default with prefix caching)."""
    a = arch("nvidia__Nemotron-H-56B-Base-8K")
    conv = 3 * (16384 + 2 * 8 * 256) * 2
    temporal = 256 * 64 * 256 * 4
    s = memory.Settings(max_model_len=8192)
    assert state_page_bytes(a, s, V(0, 33)) == conv + temporal == 16_900_096
    attn_1tok = 2 * 8 * 128 * 2
    bs = 16 * cdiv(conv + temporal, 16 * attn_1tok)
    assert bs == 4128
    for version, per_state in ((V(0, 21), 1), (V(0, 33), 3)):
        lay = kv_layout(a, s, version)
        assert (lay.block_size, lay.full_groups, lay.state_groups) == (bs, 1, 6)
        assert lay.block_bytes == 10 * bs * attn_1tok == 169_082_880
        assert lay.blocks_per_request(8192, 8192) == cdiv(8192, bs) + 6 * per_state
        assert lay.bytes_per_token == 10 * attn_1tok  # 40,960: attention layers only


def test_nemotron_h_ssm_dtype_per_version():
    """0.11: no override (model dtype); 0.15: default "float16"; 0.21+: default "float32"
    (models/config.py NemotronHForCausalLMConfig in each wheel)."""
    a = arch("nvidia__Nemotron-H-56B-Base-8K")
    s = memory.Settings()
    conv = 3 * (16384 + 2 * 8 * 256) * 2
    assert state_page_bytes(a, s, V(0, 11)) == conv + 256 * 64 * 256 * 2
    assert state_page_bytes(a, s, V(0, 15)) == conv + 256 * 64 * 256 * 2
    assert state_page_bytes(a, s, V(0, 21)) == conv + 256 * 64 * 256 * 4


def test_qwen35_gdn_pages_align_mode_and_concurrency():
    """Qwen3.5-27B (text_config: 16 full + 48 linear_attention, kvh 4, head 256, Hk 16, Hv 48, dk = dv = 128,
    K 4, mamba_ssm_dtype float32).
    - mamba_utils.py gated_delta_net_state_shape: conv (3, 2*16*128 + 48*128), temporal (48, 128, 128)
    - 0.21 (mode none): a = 16 -> bs = 16 * ceil(3,207,168 / (16 * 4096)) = 784
    - 0.33 (align, flashinfer GDN prefill on SM90): a = lcm(16, 64) = 64 -> bs = 64 * ceil(.. / (64 * 4096)) = 832,
      blocks per state group 2 + 1 checkpoint (layers/mamba/gdn/qwen_gdn_linear_attn.py)
    - groups: A = 16, M = 48 -> g = 16: 1 + 3
    - "GPU KV cache size" from 0.21 = int(concurrency x L) (kv_cache_utils.py get_max_concurrency_for_kv_cache_config)."""
    a = arch("Qwen__Qwen3.5-27B")
    page = 3 * (2 * 16 * 128 + 48 * 128) * 2 + 48 * 128 * 128 * 4
    assert page == 3_207_168
    L = 262144
    s = memory.Settings(max_model_len=L)
    none = kv_layout(a, s, V(0, 21))
    assert (none.block_size, none.block_bytes) == (784, 16 * 784 * 4096)
    assert none.blocks_per_request(L, 8192) == cdiv(L, 784) + 3 == 338
    align = kv_layout(a, s, V(0, 33))
    assert (align.block_size, align.block_bytes) == (832, 16 * 832 * 4096)
    assert align.blocks_per_request(L, 8192) == cdiv(L, 832) + 3 * 3 == 325
    kv = 40 * 2**30
    blocks = kv // align.block_bytes
    tokens, conc = align.tokens(kv, L, 8192)
    # the logged capacity divides every block, the null block too (vLLM 0.33's
    # get_max_concurrency_for_kv_cache_config; tests/data/vllm-oracle/0.33.0.json)
    assert conc == pytest.approx(blocks / 325)
    assert tokens == int(blocks / 325 * L)


def test_hybrid_tp2_splits_state_and_pads_groups():
    """Nemotron-3-Nano-30B-A3B, TP 2: n_groups 8 % 2 == 0 so no extra groups
    (mamba_utils.py extra_groups_for_head_shards); conv (3, (4096 + 2*8*128)/2), temporal (64/2, 64, 128) fp32."""
    a = arch("nvidia__NVIDIA-Nemotron-3-Nano-30B-A3B-BF16")
    s = memory.Settings(tp=2)
    assert state_page_bytes(a, s, V(0, 33)) == 3 * (6144 // 2) * 2 + 32 * 64 * 128 * 4


def test_mamba2_groups_replicated_when_tp_exceeds_groups():
    from vllmfit.core.model.hybrid import StateSpec

    spec = StateSpec("mamba2", conv_kernel=4, conv_channels=8192, groups=1, heads=128, head_dim=64, state_size=128)
    # G=1, TP=4: extra_groups_for_head_shards gives 4 - 1 = 3 more groups -> conv channels (8192 + 2*4*128) / 4
    assert spec.elements(4) == (3 * ((8192 + 2 * 4 * 128) // 4), 32 * 64 * 128)


def test_hybrid_estimate_reports_state_and_is_consistent():
    a = arch("Qwen__Qwen3.5-27B")
    gpu = catalog.gpu("NVIDIA-H100-80GB-HBM3")
    est = memory.estimate(a, memory.Settings(max_model_len=32768, max_num_seqs=4, kv_concurrency=4), gpu)
    assert est.sizing.fits
    assert est.sizing.kv_bytes_per_token == 16 * 4096  # the issue's "about right" is attention only
    v = est.vllm
    assert v is not None and v.num_gpu_blocks > 0 and v.max_concurrency >= 4


def test_catalog_hybrids_are_sized_as_hybrids():
    for name in ("nvidia/Nemotron-H-56B-Base-8K", "Qwen/Qwen3.5-27B", "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16"):
        m = catalog.model(name)
        assert m.is_hybrid_state and not m.warnings, name


def test_strict_refuses_unknown_layer_types_and_warns_otherwise():
    cfg = json.loads((DATA / "Qwen__Qwen3-8B.json").read_text())
    cfg["layer_types"] = ["full_attention"] * 35 + ["hyena_filter"]
    model = parse_hf_config(cfg, name="odd")
    gpu = catalog.gpu("NVIDIA-H100-80GB-HBM3")
    est = memory.estimate(model, memory.Settings(max_model_len=8192), gpu)
    assert any("'hyena_filter'" in w for w in est.warnings)
    errors = memory.validate(model, memory.Settings(strict=True))
    assert errors and "'hyena_filter'" in errors[0] and "strict" in errors[0]


def test_cli_strict_is_one_line_exit_2(tmp_path):
    cfg = json.loads((DATA / "Qwen__Qwen3-8B.json").read_text())
    cfg["layer_types"] = ["full_attention"] * 35 + ["hyena_filter"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    args = [sys.executable, "-m", "vllmfit", "estimate", "--model-config", str(path), "--params", "8190735360",
            "--max-model-len", "8192"]
    ok = subprocess.run(args + ["-o", "json"], check=False, capture_output=True, text=True)
    assert ok.returncode == 0 and "hyena_filter" in ok.stdout
    refused = subprocess.run(args + ["--strict"], check=False, capture_output=True, text=True)
    assert refused.returncode == 2 and "hyena_filter" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1 and "Traceback" not in refused.stderr


def test_versions_before_v1_engine_are_refused_and_spec_version_overrides_the_tag():
    model = catalog.model("meta-llama/Llama-3.1-8B-Instruct")
    errors = memory.validate(model, memory.Settings(vllm_version="vllm/vllm-openai:v0.9.2"))
    assert errors and "0.9" in errors[0] and "V1" in errors[0]
    assert not memory.validate(model, memory.Settings(vllm_version="0.10.1"))
    spec = VLLMDeploymentSpec.model_validate({"model": "m", "image": "vllm/vllm-openai@sha256:" + "a" * 64,
                                               "vllmVersion": "0.21.1", "strict": True})
    s = settings_from_spec(spec)
    assert (memory.parse_version(s.vllm_version)[0].label, s.strict) == ("0.21", True)
    assert memory.parse_version(spec.image)[1]  # the digest alone names no version: warned


def test_estimate_json_and_table_describe_the_recurrent_state():
    from vllmfit.cli.estimate import estimate_json
    from vllmfit.cli.render.layout import hybrid_text

    a = arch("nvidia__Nemotron-H-56B-Base-8K")
    gpu = catalog.gpu("NVIDIA-H100-80GB-HBM3")
    est = memory.estimate(a, memory.Settings(tp=2, max_model_len=4096, max_num_seqs=2), gpu)
    st = estimate_json(est)["recurrent_state"]
    # TP 2: conv (3, (16384 + 2*8*256)/2) bf16 + temporal (256/2, 64, 256) fp32
    page = 3 * (20480 // 2) * 2 + 128 * 64 * 256 * 4
    assert st["state_page_bytes"] == page and st["block_size"] == 16 * cdiv(page, 16 * 2 * 4 * 128 * 2)
    assert (st["attention_groups"], st["state_groups"], st["state_blocks_per_request"]) == (1, 6, 3)
    assert st["state_bytes_per_request"] == 6 * 3 * 10 * st["block_size"] * 2 * 4 * 128 * 2
    assert "mamba2, 54 of 118 layers" in hybrid_text(est)
    low, high = estimate_json(est)["kv_cache_range_bytes"]
    assert low == est.sizing.footprint.kv_cache < high


def test_qwen3_next_from_class_defaults_matches_the_issue():
    """Qwen3-Next-80B-A3B's shapes are transformers' Qwen3NextConfig defaults (hidden 2048, 48 layers,
    full_attention_interval 4, kvh 2, head 256; GDN Hk 16, Hv 32, dk = dv = 128, K 4): a config giving only
    the model type and the MoE sizes is read with them. The issue's "about right" KV per token is
    12 full layers x 2 x 2 x 256 x 2 = 24,576; page = 3 x (2*16*128 + 32*128) x 2 + 32 x 128 x 128 x 2
    (bf16: no ssm dtype override for qwen3_next); bs none = 16 x ceil(page / (16 x 2048)) = 544,
    align = 64 x ceil(page / (64 x 2048)) = 576 (hybrid-rules worked example)."""
    cfg = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "num_experts": 512,
           "num_experts_per_tok": 10, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
           "max_position_embeddings": 262144}
    a = parse_hf_config(cfg, name="qwen3-next-shaped")
    assert (a.num_layers, a.num_state_layers, sum(1 for t in a.layer_types if t)) == (48, 36, 12)
    s = memory.Settings(max_model_len=262144)
    page = 3 * (2 * 16 * 128 + 32 * 128) * 2 + 32 * 128 * 128 * 2
    assert state_page_bytes(a, s, V(0, 33)) == page == 1_097_728
    none, align = kv_layout(a, s, V(0, 21)), kv_layout(a, s, V(0, 33))
    assert none.bytes_per_token == 24_576 and (none.block_size, align.block_size) == (544, 576)
    assert (none.full_groups, none.state_groups) == (1, 3)  # A = 12, M = 36 -> g = 12
    assert a.state is not None and a.state.params == 33_718_464  # one GDN layer (hybrid-rules §7, by hand)


def test_granite_hybrid_jamba_falcon_h1_and_lfm2_layer_roles():
    """Synthetic configs shaped like each family (not real checkpoints), checked against the model
    files' rules: Granite layer_types (granitemoehybrid.py), Jamba attn_layer_period/offset with Mamba1
    state (jamba.py; mamba1_state_shape: conv (K-1, I), ssm (I, N), no spec-decode term), Falcon-H1
    attention and Mamba2 in every layer (falcon_h1.py), LFM2 short conv (conv_L_cache - 1, conv_dim)."""
    granite = parse_hf_config({"model_type": "granitemoehybrid", "num_hidden_layers": 8, "hidden_size": 512,
                               "num_attention_heads": 8, "num_key_value_heads": 8, "mamba_n_heads": 8,
                               "mamba_d_head": 128, "mamba_d_state": 128, "mamba_expand": 2, "mamba_n_groups": 1,
                               "layer_types": ["mamba"] * 3 + ["attention"] + ["mamba"] * 3 + ["attention"],
                               "shared_intermediate_size": 1024, "max_position_embeddings": 4096,
                               "vocab_size": 49152}, name="g")
    assert granite.num_state_layers == 6 and granite.intermediate_size == 1024
    assert granite.state is not None and granite.state.elements(1) == (3 * (1024 + 2 * 128), 8 * 128 * 128)
    jamba = parse_hf_config({"model_type": "jamba", "num_hidden_layers": 16, "hidden_size": 1024,
                             "num_attention_heads": 8, "num_key_value_heads": 8, "intermediate_size": 2048,
                             "num_experts": 4, "num_experts_per_tok": 2}, name="j")
    assert [i for i, t in enumerate(jamba.layer_types) if t] == [4, 12]  # i % 8 == 4
    assert jamba.state is not None and jamba.state.elements(1) == (3 * 2048, 2048 * 16)
    assert jamba.mlp_kinds == tuple("moe" if i % 2 == 1 else "dense" for i in range(16))
    falcon = parse_hf_config({"model_type": "falcon_h1", "num_hidden_layers": 4, "hidden_size": 1024,
                              "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128,
                              "mamba_d_ssm": 1536, "mamba_n_heads": 24, "mamba_d_head": 64, "mamba_d_state": 128,
                              "intermediate_size": 2048}, name="f")
    assert falcon.num_state_layers == 4 and all(falcon.layer_types)
    lay = kv_layout(falcon, memory.Settings(), V(0, 33))
    assert (lay.full_groups, lay.state_groups) == (1, 1)  # A = M = 4 -> g = 4
    lfm = parse_hf_config({"model_type": "lfm2", "num_hidden_layers": 4, "hidden_size": 1024, "conv_dim": 1024,
                           "num_attention_heads": 16, "num_key_value_heads": 8, "intermediate_size": 4608,
                           "layer_types": ["conv", "conv", "full_attention", "conv"]}, name="l")
    assert lfm.max_model_len == 128000 and lfm.state is not None and lfm.state.elements(1) == (2 * 1024, 0)
    assert kv_layout(lfm, memory.Settings(), V(0, 33)).state_blocks == 2  # align: 2 + 0 checkpoint blocks
