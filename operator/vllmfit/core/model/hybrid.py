"""Hybrid models: which layers attend, which carry a recurrent state (Mamba, Mamba2, short conv,
Gated DeltaNet, lightning linear attention), which have an MLP or MoE block, and the state's shape
and parameter count, read from a Hugging Face text config the way vLLM's model files read it.

Sources (vLLM 0.33, `vllm/model_executor/`):
- layer roles: `models/nemotron_h.py` (`hybrid_override_pattern`: M = Mamba2, * = attention,
  - = MLP, E = MoE), `models/granitemoehybrid.py` (`layer_types`), `models/jamba.py`
  (`attn_layer_period/offset`, `expert_layer_period/offset`), `models/falcon_h1.py` (every layer
  both), `models/qwen3_next.py`, `models/qwen3_5.py` (`layer_types`), `models/lfm2.py`,
  `models/lfm2_moe.py`, `models/minimax_text_01.py` (`attn_type_list`, removed after 0.23);
- state shapes: `layers/mamba/mamba_utils.py` `MambaStateShapeCalculator` (`mamba1_state_shape`,
  `mamba2_state_shape` with `extra_groups_for_head_shards`, `short_conv_state_shape`,
  `gated_delta_net_state_shape`, `linear_attention_state_shape`);
- mixer weights: the modules' parameter shapes (in_proj, conv1d, dt_bias, A_log, D, norm, out_proj).
Pure: dicts in, frozen dataclasses out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

ATTENTION_TYPES = {"full_attention": "full", "attention": "full", "global": "full", "full": "full",
                   "sliding_attention": "sliding", "sliding": "sliding", "local": "sliding",
                   "chunked_attention": "full"}
"""Layer type strings that mean one attention (KV-cache) layer."""

HYBRID_MODEL_TYPES = {"nemotron_h", "granitemoehybrid", "jamba", "falcon_h1", "qwen3_next", "qwen3_5_text",
                      "qwen3_5_moe_text", "lfm2", "lfm2_moe", "minimax_text_01", "minimax_m1"}
"""model_type values whose recurrent-state layers vllmfit sizes as vLLM does."""

_STATE_HINT_KEYS = ("ssm_state_size", "mamba_d_state", "linear_num_value_heads", "conv_L_cache", "mamba_n_heads",
                    "linear_attn_config", "state_size", "time_step_rank")


@dataclass(frozen=True)
class StateSpec:
    """The recurrent state of one layer, before TP sharding (vLLM's MambaStateShapeCalculator)."""

    kind: str  # "mamba1" | "mamba2" | "short_conv" | "gdn" | "linear"
    conv_kernel: int = 0  # K: the conv state keeps K - 1 positions
    conv_channels: int = 0  # channels of the conv state (mamba2: I, groups added per TP)
    groups: int = 0  # mamba2 G (B and C projections)
    heads: int = 0  # mamba2 H, gdn value heads Hv, linear-attention heads
    head_dim: int = 0  # mamba2 head dim, gdn dv, linear-attention head dim
    state_size: int = 0  # mamba N, gdn dk
    ssm_dtype: str = "auto"  # the config's explicit state dtype, or "auto"
    dtype_rule: str = ""  # "nemotron_h" | "qwen3_5": the model file overrides "auto" (see kv.state_dtypes)
    prefill_checkpoint_blocks: int = 0  # extra blocks per request in vLLM's "align" mode
    params: int = 0  # parameters of one mixer layer (replaces attention in that layer)

    def elements(self, tp: int) -> tuple[int, int]:
        """(conv state elements, temporal state elements) of one sequence on one TP rank."""
        if self.kind == "mamba1":
            return (self.conv_kernel - 1) * (self.conv_channels // tp), (self.conv_channels // tp) * self.state_size
        if self.kind == "mamba2":
            groups = self.groups if self.groups % tp == 0 else self.groups + (tp - self.groups)
            conv = (self.conv_kernel - 1) * ((self.conv_channels + 2 * groups * self.state_size) // tp)
            return conv, (self.heads // tp) * self.head_dim * self.state_size
        if self.kind == "short_conv":
            return (self.conv_kernel - 1) * (self.conv_channels // tp), 0
        if self.kind == "gdn":
            return (self.conv_kernel - 1) * (self.conv_channels // tp), (self.heads // tp) * self.head_dim * self.state_size
        if self.kind == "linear":
            return (self.heads // tp) * self.head_dim * self.head_dim, 0
        raise ValueError(self.kind)


@dataclass(frozen=True)
class LayerPlan:
    """Per layer: attention kind ("full", "sliding", "" = none), recurrent state, MLP kind."""

    attention: tuple[str, ...]
    state: tuple[bool, ...] = ()
    mlp: tuple[str, ...] = ()  # "dense" | "moe" | "" (none); () = the default rule
    spec: StateSpec | None = None
    unknown: tuple[str, ...] = ()  # layer types vllmfit does not model (named in a warning)
    gated_mlp: bool = True


def _i(cfg: dict[str, Any], *keys: str, default: int = 0) -> int:
    for k in keys:
        v = cfg.get(k)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return int(v)
    return default


def _mamba2(cfg: dict[str, Any], hidden: int, *, inter: int, groups: int, heads: int, head_dim: int, n: int,
            k: int, proj_bias: bool, conv_bias: bool, ssm_dtype: str = "auto", rule: str = "") -> StateSpec:
    conv_dim = inter + 2 * groups * n
    params = hidden * (2 * inter + 2 * groups * n + heads) + (2 * inter + 2 * groups * n + heads if proj_bias else 0)
    params += conv_dim * k + (conv_dim if conv_bias else 0) + 3 * heads + inter + inter * hidden
    params += hidden if proj_bias else 0
    return StateSpec("mamba2", k, inter, groups, heads, head_dim, n, ssm_dtype, rule, 1, params)


def _gdn(cfg: dict[str, Any], hidden: int) -> StateSpec:
    hk, hv = _i(cfg, "linear_num_key_heads"), _i(cfg, "linear_num_value_heads")
    dk, dv = _i(cfg, "linear_key_head_dim"), _i(cfg, "linear_value_head_dim")
    k = _i(cfg, "linear_conv_kernel_dim", default=4)
    key_dim, value_dim = hk * dk, hv * dv
    params = hidden * (2 * key_dim + 2 * value_dim) + hidden * 2 * hv + (2 * key_dim + value_dim) * k
    params += 2 * hv + dv + value_dim * hidden
    rule = "qwen3_5" if str(cfg.get("model_type", "")).startswith("qwen3_5") else ""
    dtype = str(cfg.get("mamba_ssm_dtype") or "auto")
    # the flashinfer GDN prefill backend (vLLM's default on SM90 and SM100) exports one checkpoint
    # block in align mode (layers/mamba/gdn/qwen_gdn_linear_attn.py); kv._gdn_checkpoints drops it
    # below SM90 (vLLM 0.33 oracle)
    return StateSpec("gdn", k, 2 * key_dim + value_dim, 0, hv, dv, dk, dtype, rule, 1, params)


def layer_plan(cfg: dict[str, Any], layers: int, hidden: int) -> LayerPlan:
    """The per-layer roles of a (text) config; model types without recurrent layers get attention
    everywhere except what `layer_types` says (sliding / full)."""
    mt = str(cfg.get("model_type", ""))
    raw = cfg.get("layer_types") if isinstance(cfg.get("layer_types"), list) else None
    moe = bool(_i(cfg, "num_local_experts", "n_routed_experts", "num_experts"))

    if mt == "nemotron_h":
        pattern = cfg.get("hybrid_override_pattern")
        if isinstance(cfg.get("layers_block_type"), list) and not isinstance(pattern, str):
            back = {"mamba": "M", "linear_attention": "M", "attention": "*", "full_attention": "*", "mlp": "-",
                    "moe": "E"}
            pattern = "".join(back.get(str(t), "?") for t in cfg["layers_block_type"])
        pattern = str(pattern or "")[:layers]
        unknown = tuple(sorted({c for c in pattern if c not in "M*-E"}))
        inter = _i(cfg, "mamba_num_heads", default=128) * _i(cfg, "mamba_head_dim", default=64)
        spec = _mamba2(cfg, hidden, inter=inter, groups=_i(cfg, "n_groups", default=8),
                       heads=_i(cfg, "mamba_num_heads", default=128), head_dim=_i(cfg, "mamba_head_dim", default=64),
                       n=_i(cfg, "ssm_state_size", default=128), k=_i(cfg, "conv_kernel", default=4),
                       proj_bias=bool(cfg.get("use_bias")), conv_bias=cfg.get("use_conv_bias", True) is not False,
                       ssm_dtype=str(cfg.get("mamba_ssm_cache_dtype") or "auto"), rule="nemotron_h")
        return LayerPlan(
            attention=tuple("full" if c == "*" else "" for c in pattern),
            state=tuple(c == "M" for c in pattern),
            mlp=tuple({"-": "dense", "E": "moe"}.get(c, "") for c in pattern),
            spec=spec, unknown=tuple(f"hybrid_override_pattern {c!r}" for c in unknown),
            gated_mlp=str(cfg.get("mlp_hidden_act", "relu2")) not in ("relu2",),
        )

    if mt in ("granitemoehybrid", "falcon_h1", "jamba"):
        if mt == "falcon_h1":
            kinds = ["both"] * layers
        elif mt == "jamba":
            period, offset = _i(cfg, "attn_layer_period", default=8), _i(cfg, "attn_layer_offset", default=4)
            kinds = ["attention" if i % period == offset else "mamba" for i in range(layers)]
        else:
            kinds = [str(t) for t in (raw or ["mamba"] * layers)]
        remap = {"linear_attention": "mamba", "full_attention": "attention"}
        kinds = [remap.get(t, t) for t in kinds]
        unknown = tuple(sorted({t for t in kinds if t not in ("mamba", "attention", "both")}))
        heads = _i(cfg, "mamba_n_heads", default=128)
        if mt == "jamba":
            inter = _i(cfg, "mamba_expand", default=2) * hidden
            n, k = _i(cfg, "mamba_d_state", default=16), _i(cfg, "mamba_d_conv", default=4)
            rank = cfg.get("mamba_dt_rank")
            r = math.ceil(hidden / 16) if rank in (None, "auto") else int(rank)
            params = hidden * 2 * inter + inter * k + inter + inter * (r + 2 * n) + r * inter + inter
            params += inter * n + inter + inter * hidden + r + 2 * n
            spec = StateSpec("mamba1", k, inter, 0, 0, 0, n, "auto", "", 0, params)
            ep, eo = _i(cfg, "expert_layer_period", default=2), _i(cfg, "expert_layer_offset", default=1)
            mlp = tuple("moe" if moe and i % ep == eo else "dense" for i in range(layers))
        else:
            inter = _i(cfg, "mamba_d_ssm") if mt == "falcon_h1" and cfg.get("mamba_d_ssm") else int(
                _i(cfg, "mamba_expand", default=2) * hidden)
            d_head = cfg.get("mamba_d_head")
            head_dim = inter // heads if d_head in (None, "auto") else int(d_head)
            spec = _mamba2(cfg, hidden, inter=inter, groups=_i(cfg, "mamba_n_groups", default=1), heads=heads,
                           head_dim=head_dim, n=_i(cfg, "mamba_d_state", default=256),
                           k=_i(cfg, "mamba_d_conv", default=4), proj_bias=bool(cfg.get("mamba_proj_bias")),
                           conv_bias=cfg.get("mamba_conv_bias", True) is not False)
            mlp = tuple("moe" if moe else "dense" for _ in range(layers))
        return LayerPlan(
            attention=tuple("full" if t in ("attention", "both") else "" for t in kinds),
            state=tuple(t in ("mamba", "both") for t in kinds),
            mlp=mlp, spec=spec, unknown=tuple(f"layer type {t!r}" for t in unknown),
        )

    if mt in ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"):
        if raw is None:
            interval = _i(cfg, "full_attention_interval", default=4)
            raw = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)]
        kinds = [str(t) for t in raw]
        unknown = tuple(sorted({t for t in kinds if t not in ("linear_attention", "full_attention")}))
        return LayerPlan(
            attention=tuple("full" if t == "full_attention" else "" for t in kinds),
            state=tuple(t == "linear_attention" for t in kinds),
            spec=_gdn(cfg, hidden), unknown=tuple(f"layer type {t!r}" for t in unknown),
        )

    if mt in ("lfm2", "lfm2_moe"):
        kinds = [str(t) for t in (raw or [])]
        if not kinds and isinstance(cfg.get("full_attn_idxs"), list):
            idx = set(cfg["full_attn_idxs"])
            kinds = ["full_attention" if i in idx else "conv" for i in range(layers)]
        unknown = tuple(sorted({t for t in kinds if t not in ("conv", "short_conv", "full_attention")}))
        d = hidden if mt == "lfm2_moe" else _i(cfg, "conv_dim", default=hidden)
        k = _i(cfg, "conv_L_cache", default=3)
        params = hidden * 3 * d + d * k + (d if cfg.get("conv_bias") else 0) + d * hidden
        spec = StateSpec("short_conv", k, d, 0, 0, 0, 0, "auto", "", 0, params)
        return LayerPlan(
            attention=tuple("full" if t == "full_attention" else "" for t in kinds),
            state=tuple(t in ("conv", "short_conv") for t in kinds),
            spec=spec, unknown=tuple(f"layer type {t!r}" for t in unknown),
        )

    if isinstance(cfg.get("attn_type_list"), list):  # MiniMax-Text-01 / M1: 0 = lightning (linear), 1 = softmax
        kinds = [int(t) for t in cfg["attn_type_list"]][:layers]
        heads = _i(cfg, "num_attention_heads")
        hd = _i(cfg, "head_dim", default=hidden // max(heads, 1))
        params = 4 * hidden * heads * hd + hidden * heads * hd + heads * hd  # qkv, out, output gate, norm
        spec = StateSpec("linear", 0, 0, 0, heads, hd, 0, "auto", "", 0, params)
        return LayerPlan(attention=tuple("full" if t == 1 else "" for t in kinds),
                         state=tuple(t == 0 for t in kinds), spec=spec)

    # attention-only models: layer_types name full / sliding layers; anything else is unknown
    unknown: tuple[str, ...] = ()
    attention: tuple[str, ...] = ()
    if raw is not None and len(raw) == layers:
        names = [str(t) for t in raw]
        unknown = tuple(f"layer type {t!r}" for t in sorted({t for t in names if t not in ATTENTION_TYPES}))
        attention = tuple(ATTENTION_TYPES.get(t, "full") for t in names)
    if isinstance(cfg.get("block_configs"), list) and not unknown:  # Nemotron-NAS: per-layer shapes
        unknown = (f"heterogeneous block_configs of model_type {mt!r} (layers differ in shape)",)
    hints = [k for k in _STATE_HINT_KEYS if cfg.get(k) is not None]
    if hints and not unknown and mt not in HYBRID_MODEL_TYPES:
        unknown = (f"recurrent-state layers of model_type {mt!r} (config has {hints[0]})",)
    return LayerPlan(attention=attention, unknown=unknown)
