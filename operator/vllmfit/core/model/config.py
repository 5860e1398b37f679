"""A Hugging Face config.json -> `ModelArch`, the way vLLM reads it.

One parser serves the catalog (catalog/models.yaml holds verbatim config.json fields), the
CLI's --model-config, inline spec.modelConfig and configs fetched from the Hub. Pure: takes
dicts, returns a frozen `ModelArch`; raises `ModelConfigError` with a one-line message.
Every count is bounded by `vllmfit.core.limits`, so hostile values fail fast."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, fields, replace
from typing import Any

from vllmfit.core import limits
from vllmfit.core.model.facts import (
    DTYPE_BYTES,
    KNOWN_MODEL_TYPES,
    MLA_MODEL_TYPES,
    UNMODELLED_MODEL_TYPES,
    ModelArch,
    ModelConfigError,
    Quant,
    count_params,
)
from vllmfit.core.model.hfconfig import derive_max_len, text_config
from vllmfit.core.model.hybrid import LayerPlan, layer_plan

_KV_HEAD_KEYS = ("n_head_kv", "num_kv_heads", "num_key_value_heads", "multi_query_group_num", "num_attention_groups")


def _get(cfg: dict[str, Any], *keys: str, default: Any = None) -> Any:
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    return default


def _pos_int(cfg: dict[str, Any], key: str, value: Any, limit: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ModelConfigError(f"config.json field {key!r} must be a positive integer, got {_short(value)}")
    if limit is not None and value > limit:
        raise ModelConfigError(f"config.json field {key!r} is {value}, more than any real model ({limit} at most)")
    return value


def _count(value: Any, key: str, limit: int, default: int = 0) -> int:
    """An optional non-negative count field (None/0/absent -> default), bounded by `limit`
    (vllmfit.core.limits). Whole floats (4096.0) are accepted as vLLM's int() would."""
    if value is None or value is False:
        return default
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ModelConfigError(f"config.json field {key!r} must be a non-negative integer, got {_short(value)}")
    if value > limit:
        raise ModelConfigError(f"config.json field {key!r} is {value}, more than any real model ({limit} at most)")
    return value or default


def _factor(value: Any, key: str) -> float:
    """A scaling factor (rope factor, partial_rotary_factor): a finite positive number."""
    try:
        f = float(value)
    except (TypeError, ValueError):
        raise ModelConfigError(f"config.json field {key!r} must be a number, got {_short(value)}") from None
    if not math.isfinite(f) or f <= 0 or f > limits.MAX_CONTEXT:
        raise ModelConfigError(f"config.json field {key!r} must be a finite positive number, got {_short(value)}")
    return f


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _rope_cache_elems(cfg: dict[str, Any], rotary_dim: int) -> int:
    """Elements of vLLM's cos/sin caches: max positions x rotary dim, times the factor for
    linear/dynamic/yarn scaling (the cache covers the scaled range); Gemma 3 adds its local rope."""
    positions = _count(cfg.get("max_position_embeddings"), "max_position_embeddings", limits.MAX_CONTEXT)
    rope = cfg.get("rope_scaling") or {}
    factor = 1.0
    if isinstance(rope, dict) and (rope.get("rope_type") or rope.get("type")) in ("linear", "dynamic", "yarn"):
        factor = _factor(rope.get("factor") or 1.0, "rope_scaling.factor")
    total = int(positions * factor)
    if str(cfg.get("model_type", "")).startswith("gemma3"):
        total += positions  # sliding layers use a second, unscaled rope
    return total * rotary_dim


def _as_int(value: Any, default: int) -> int:
    if value is None:
        return default
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ModelConfigError(f"quantization_config value {value!r} is not an integer") from None


def _parse_quant(cfg: dict[str, Any]) -> Quant | None:
    qc = cfg.get("quantization_config")
    if not isinstance(qc, dict):
        return None
    method = str(qc.get("quant_method", "")).lower()
    kv_fp8 = bool(qc.get("kv_cache_scheme"))
    if method == "fp8" or method == "fbgemm_fp8":
        block = qc.get("weight_block_size")
        block_n = _as_int(block[0], 0) if isinstance(block, list) and block else 0
        return Quant("fp8", 8, kv_fp8=kv_fp8, block_n=max(block_n, 0))
    if method in ("awq", "gptq", "awq_marlin", "gptq_marlin"):
        bits = _as_int(qc.get("bits", qc.get("w_bit")), 4)
        group = _as_int(qc.get("group_size", qc.get("q_group_size")), 128)
        return Quant("int4" if bits == 4 else "int8", bits, max(group, 0), kv_fp8=kv_fp8)
    if method == "mxfp4":
        return Quant("mxfp4", 4, 32, experts_only=True, kv_fp8=kv_fp8)
    if method in ("modelopt", "modelopt_fp4", "nvfp4"):
        # NVIDIA ModelOpt: quant_algo FP8 or NVFP4 (4-bit e2m1 + one fp8 scale per 16); a
        # MIXED_PRECISION checkpoint is taken as fp8 throughout (never fewer bytes than it has)
        algo = str(qc.get("quant_algo") or (qc.get("quantization") or {}).get("quant_algo") or "").upper()
        if "FP4" in algo and "MIXED" not in algo:
            return Quant("nvfp4", 4, 16, kv_fp8=kv_fp8)
        return Quant("fp8", 8, kv_fp8=kv_fp8, scheme="modelopt_mixed" if "MIXED" in algo else "")
    if method == "bitsandbytes":
        return Quant("int4" if qc.get("load_in_4bit") else "int8", 4 if qc.get("load_in_4bit") else 8, 64)
    if method == "compressed-tensors":
        groups = qc.get("config_groups") or {}
        for g in groups.values() if isinstance(groups, dict) else []:
            w = (g or {}).get("weights") or {}
            bits = int(w.get("num_bits", 8))
            wtype = str(w.get("type", "int"))
            if bits == 8 and wtype == "float":
                return Quant("fp8", 8, kv_fp8=kv_fp8)
            if bits == 8:
                return Quant("int8", 8, kv_fp8=kv_fp8)
            if bits == 4:
                return Quant("int4", 4, int(w.get("group_size") or 128), kv_fp8=kv_fp8)
        return Quant("fp8", 8, kv_fp8=kv_fp8)
    raise ModelConfigError(
        f"quantization_config.quant_method {method!r} is not modelled; use one of fp8, awq, gptq, mxfp4, "
        "compressed-tensors, bitsandbytes, modelopt"
    )


_POOLING_SUFFIXES = ("ForSequenceClassification", "ForTokenClassification", "Model", "ForEmbedding", "ForRewardModel")


def _is_pooling(arch: str, task: str | None) -> bool:
    if task in ("embed", "classify", "score", "pooling", "reward"):
        return True
    if task == "generate":
        return False
    return arch.endswith(_POOLING_SUFFIXES) and not arch.endswith(("ForCausalLM", "ForConditionalGeneration"))


def parse_hf_config(
    config: dict[str, Any],
    *,
    name: str,
    params: int | None = None,
    params_source: str = "catalog",
    task: str | None = None,
    source: str = "",
    aliases: tuple[str, ...] = (),
) -> ModelArch:
    """Turn a Hugging Face config.json (as a dict) into a ModelArch.

    `params` is the exact parameter count when known (catalog, safetensors index); otherwise it
    is computed from the architecture (`count_params`). Every count is bounded by
    vllmfit.core.limits; any malformed value raises ModelConfigError (one line), never another error.
    """
    try:
        return _parse(config, name=name, params=params, params_source=params_source, task=task, source=source,
                      aliases=aliases)
    except ModelConfigError:
        raise
    except (TypeError, ValueError, OverflowError, AttributeError, KeyError) as e:
        raise ModelConfigError(f"{name}: malformed config.json ({type(e).__name__}: {_short(str(e))})") from None


def _parse(
    config: dict[str, Any],
    *,
    name: str,
    params: int | None,
    params_source: str,
    task: str | None,
    source: str,
    aliases: tuple[str, ...],
) -> ModelArch:
    if not isinstance(config, dict):
        raise ModelConfigError(f"{name}: config.json must be a JSON object")
    if params is not None and not 0 < params <= limits.MAX_PARAMS:
        raise ModelConfigError(f"{name}: parameter count {params} must be in 1..{limits.MAX_PARAMS}")
    archs = config.get("architectures") or ["Unknown"]
    architecture = str(archs[0]) if isinstance(archs, list) and archs else "Unknown"
    vision = config.get("vision_config") if isinstance(config.get("vision_config"), dict) else None
    cfg, top_type, _ = text_config(config)  # nested text_config / llm_config, class defaults filled in
    model_type = str(cfg.get("model_type") or top_type)
    if model_type in UNMODELLED_MODEL_TYPES:
        raise ModelConfigError(f"{name}: model_type {model_type!r}: {UNMODELLED_MODEL_TYPES[model_type]}")

    # Every count is bounded (vllmfit.core.limits) before anything is sized or allocated from it.
    n_layers = _get(cfg, "num_hidden_layers", "n_layer", "num_layers")
    if n_layers is None and isinstance(cfg.get("layers_block_type"), list) and cfg["layers_block_type"]:
        # Nemotron-3 Ultra states its layers only as layers_block_type (vLLM's NemotronHConfig reads
        # num_hidden_layers as its length); issue 23 item 7
        n_layers = len(cfg["layers_block_type"])
    layers = _pos_int(cfg, "num_hidden_layers", n_layers, limits.MAX_LAYERS)
    hidden = _pos_int(cfg, "hidden_size", _get(cfg, "hidden_size", "n_embd", "d_model"), limits.MAX_HIDDEN_SIZE)
    heads = _pos_int(cfg, "num_attention_heads", _get(cfg, "num_attention_heads", "n_head"), limits.MAX_HEADS)
    kv_heads = _pos_int(cfg, "num_key_value_heads", _get(cfg, *_KV_HEAD_KEYS, default=heads), limits.MAX_HEADS)
    if heads % kv_heads:
        raise ModelConfigError(f"{name}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    vocab = _pos_int(cfg, "vocab_size", cfg.get("vocab_size"), limits.MAX_VOCAB)
    intermediate = _count(_get(cfg, "intermediate_size", "n_inner", "ffn_dim"), "intermediate_size",
                          limits.MAX_INTERMEDIATE_SIZE, 4 * hidden)
    if model_type == "granitemoehybrid" and not _get(cfg, "num_local_experts") and cfg.get("shared_intermediate_size"):
        # dense Granite-4.0-H: the only MLP is shared_mlp (models/granitemoehybrid.py)
        intermediate = _count(cfg["shared_intermediate_size"], "shared_intermediate_size",
                              limits.MAX_INTERMEDIATE_SIZE, intermediate)

    mla = model_type in MLA_MODEL_TYPES or top_type in MLA_MODEL_TYPES
    kv_lora = _count(cfg.get("kv_lora_rank"), "kv_lora_rank", limits.MAX_HEAD_DIM) if mla else 0
    rope_dim = _count(cfg.get("qk_rope_head_dim"), "qk_rope_head_dim", limits.MAX_HEAD_DIM)
    if kv_lora:
        head_dim = kv_lora + rope_dim
    elif isinstance(cfg.get("head_dim"), int) and cfg["head_dim"] > 0:
        head_dim = _count(cfg["head_dim"], "head_dim", limits.MAX_HEAD_DIM)
    elif isinstance(cfg.get("attention_head_dim"), int) and cfg["attention_head_dim"] > 0:  # older Nemotron-H
        head_dim = _count(cfg["attention_head_dim"], "attention_head_dim", limits.MAX_HEAD_DIM)
    elif isinstance(cfg.get("hidden_size_per_head"), int) and cfg["hidden_size_per_head"] > 0:
        head_dim = _count(cfg["hidden_size_per_head"], "hidden_size_per_head", limits.MAX_HEAD_DIM)
    else:
        if hidden % heads:
            raise ModelConfigError(f"{name}: hidden_size {hidden} is not divisible by num_attention_heads {heads}; set head_dim")
        head_dim = hidden // heads

    # Sliding window per layer (vllm-memory-accounting.md §5, §7)
    window = cfg.get("sliding_window")
    if cfg.get("use_sliding_window") is False:
        window = None
    window = int(window) if isinstance(window, int) and window > 0 else None
    plan: LayerPlan = layer_plan(cfg, layers, hidden)
    if plan.spec is not None:  # hybrid: attention only where the plan says
        types = tuple("full" if t else "" for t in plan.attention)
    elif plan.attention:
        types = plan.attention
        if window is None:
            types = tuple("full" for _ in types)
    elif isinstance(cfg.get("hybrid_layer_pattern"), list) and len(cfg["hybrid_layer_pattern"]) == layers:
        # MiMo-V2-Flash: 1 = sliding-window layer (window sliding_window_size), 0 = full attention
        # (vllm/model_executor/models/mimo_v2.py MiMoV2FlashDecoderLayer.is_swa_layer)
        types = tuple("sliding" if t == 1 else "full" for t in cfg["hybrid_layer_pattern"])
        swa = cfg.get("sliding_window_size", window)
        window = swa if isinstance(swa, int) and not isinstance(swa, bool) and swa > 0 else window
    elif window is not None and model_type in ("gemma2",):  # Gemma 2: alternate sliding/full, sliding first
        types = tuple("sliding" if i % 2 == 0 else "full" for i in range(layers))
    elif window is not None and model_type in ("gemma3", "gemma3_text"):
        pattern = _count(cfg.get("sliding_window_pattern"), "sliding_window_pattern", limits.MAX_LAYERS, 6)
        types = tuple("full" if (i + 1) % pattern == 0 else "sliding" for i in range(layers))
    elif window is not None:
        types = tuple("sliding" for _ in range(layers))  # all-layer sliding window (Mistral-7B v0.1)
    else:
        types = tuple("full" for _ in range(layers))

    num_experts = _count(_get(cfg, "num_local_experts", "n_routed_experts", "num_experts"), "num_experts",
                         limits.MAX_EXPERTS)
    moe_i = _count(cfg.get("moe_intermediate_size"), "moe_intermediate_size", limits.MAX_INTERMEDIATE_SIZE,
                   intermediate) if num_experts else 0
    first_dense = _count(cfg.get("first_k_dense_replace"), "first_k_dense_replace", layers) if num_experts else 0
    shared = _count(_get(cfg, "n_shared_experts", "num_shared_experts"), "n_shared_experts",
                    limits.MAX_EXPERTS) if num_experts else 0
    shared_size = _get(cfg, "shared_expert_intermediate_size", "moe_shared_expert_intermediate_size",
                       "shared_intermediate_size")
    if num_experts and shared_size and not shared:
        shared_i = _count(shared_size, "shared_expert_intermediate_size", limits.MAX_INTERMEDIATE_SIZE)
        shared = max(1, shared_i // max(moe_i, 1))
    if num_experts and model_type == "llama4_text" and not shared:
        shared = 1  # every Llama 4 MoE layer has one shared expert; the config has no field for it

    torch_dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or config.get("torch_dtype") or "bfloat16")
    if torch_dtype not in DTYPE_BYTES:
        torch_dtype = "bfloat16"
    tie = bool(cfg.get("tie_word_embeddings", config.get("tie_word_embeddings", False)))
    max_len = derive_max_len(cfg)
    if max_len is None:
        raise ModelConfigError(f"{name}: config.json has no max_position_embeddings and model_type {model_type!r} "
                               "has no default for it; add it")
    if max_len <= 0:
        raise ModelConfigError(f"{name}: context length {max_len} (max_position_embeddings with rope scaling) "
                               "must be positive")
    if max_len > limits.MAX_CONTEXT:
        raise ModelConfigError(f"{name}: context length {max_len} (max_position_embeddings with rope scaling) is "
                               f"more than any real model ({limits.MAX_CONTEXT} at most)")
    warnings = tuple(f"{name}: {u} is not modelled; the estimate may be wrong" for u in plan.unknown)
    if model_type not in KNOWN_MODEL_TYPES and not plan.unknown:
        warnings += ((f"{name}: model_type {model_type!r} is not among the architectures checked against vLLM's own "
                     "sizing (docs/oracle.md); sized as standard attention, the estimate may be wrong"),)
    arch = ModelArch(
        name=name,
        architecture=architecture,
        model_type=model_type,
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate,
        vocab_size=vocab,
        max_model_len=max_len,
        tie_word_embeddings=tie,
        torch_dtype=torch_dtype,
        params=0,
        params_source=params_source,
        layer_types=types,
        sliding_window=window,
        kv_lora_rank=kv_lora,
        qk_rope_head_dim=rope_dim if kv_lora else 0,
        q_lora_rank=_count(cfg.get("q_lora_rank"), "q_lora_rank", limits.MAX_HIDDEN_SIZE) if kv_lora else 0,
        qk_nope_head_dim=_count(cfg.get("qk_nope_head_dim"), "qk_nope_head_dim", limits.MAX_HEAD_DIM) if kv_lora else 0,
        v_head_dim=_count(cfg.get("v_head_dim"), "v_head_dim", limits.MAX_HEAD_DIM) if kv_lora else 0,
        num_experts=num_experts,
        num_experts_per_tok=_count(_get(cfg, "num_experts_per_tok", "moe_topk"), "num_experts_per_tok",
                                   num_experts) if num_experts else 0,
        moe_intermediate_size=moe_i,
        num_shared_experts=shared,
        moe_latent_size=_count(cfg.get("moe_latent_size"), "moe_latent_size", limits.MAX_HIDDEN_SIZE) if num_experts else 0,
        first_k_dense=first_dense,
        quant=_parse_quant(config) or _parse_quant(cfg),
        pooling=_is_pooling(architecture, task),
        attention_bias=bool(cfg.get("attention_bias") or model_type in ("qwen2", "qwen2_moe")),
        attn_output_gate=bool(cfg.get("attn_output_gate", model_type == "qwen3_next")),
        rope_cache_elems=_rope_cache_elems(cfg, rope_dim if kv_lora else int(
            head_dim * min(_factor(cfg.get("partial_rotary_factor") or 1, "partial_rotary_factor"), 1.0))),
        kv_head_dim_v=_count(cfg.get("v_head_dim"), "v_head_dim", limits.MAX_HEAD_DIM) if not kv_lora else 0,
        # Gemma 4: full-attention layers have num_global_key_value_heads x global_head_dim
        # (models/gemma4.py: the full layers' Attention(head_size=global_head_dim, num_kv_heads=...))
        full_num_kv_heads=_count(cfg.get("num_global_key_value_heads"), "num_global_key_value_heads",
                                 limits.MAX_HEADS) if cfg.get("global_head_dim") else 0,
        full_head_dim=_count(cfg.get("global_head_dim"), "global_head_dim", limits.MAX_HEAD_DIM),
        min_batched_tokens=_mm_prefix_min_batched(top_type, vision),
        swa_attention_sinks=bool(cfg.get("add_swa_attention_sink_bias")),
        swa_num_kv_heads=_count(cfg.get("swa_num_key_value_heads"), "swa_num_key_value_heads", limits.MAX_HEADS),
        swa_head_dim=_count(cfg.get("swa_head_dim"), "swa_head_dim", limits.MAX_HEAD_DIM),
        swa_head_dim_v=_count(cfg.get("swa_v_head_dim"), "swa_v_head_dim", limits.MAX_HEAD_DIM),
        # DeepSeek sparse attention: vLLM builds the indexer when the config has index_topk
        # (models/deepseek_v2.py); its key cache is index_head_dim (+ fp8 scales) per token and layer
        indexer_head_dim=_count(cfg.get("index_head_dim"), "index_head_dim", limits.MAX_HEAD_DIM)
        if kv_lora and cfg.get("index_topk") is not None else 0,
        source=source,
        aliases=aliases,
        state=plan.spec if plan.spec is not None and any(plan.state) else None,
        state_layers=plan.state if plan.spec is not None else (),
        mlp_kinds=plan.mlp,
        gated_mlp=plan.gated_mlp,
        warnings=warnings,
    )
    vision_params = _vision_params(vision) if vision else 0
    counted = count_params(arch) + vision_params
    return replace(arch, params=params or counted, params_source=params_source if params else "computed",
                    vision_params=vision_params)


GEMMA4_VIDEO_FRAME_TOKENS = 70 + 2 + 6
GEMMA4_VIDEO_MAX_FRAMES = 32
"""models/gemma4_mm.py get_mm_max_tokens_per_item: a video is at most _VIDEO_MAX_FRAMES (32) frames
of _VIDEO_MAX_SOFT_TOKENS (70) soft tokens + boi + eoi + ~6 timestamp tokens."""


def _mm_prefix_min_batched(top_type: str, vision: dict[str, Any] | None) -> int:
    """A multimodal prefix-LM model must fit its largest multimodal item in one batch: vLLM raises a
    defaulted max_num_batched_tokens to it (engine/arg_utils.py
    _set_default_max_num_seqs_and_batched_tokens_args, _get_min_mm_batched_tokens). Only Gemma 4
    states its per-item maximum without profiling: max(image default_output_length, video)."""
    if top_type != "gemma4" or not vision:
        return 0
    image = _count(vision.get("default_output_length"), "vision_config.default_output_length", limits.MAX_CONTEXT, 280)
    return max(image, GEMMA4_VIDEO_MAX_FRAMES * GEMMA4_VIDEO_FRAME_TOKENS)


def _vision_params(v: dict[str, Any]) -> int:
    """A ViT tower: per layer 4 h^2 (attention) + 2 h i (MLP) + norms; plus patch embedding."""
    h = _count(v.get("hidden_size"), "vision_config.hidden_size", limits.MAX_HIDDEN_SIZE)
    layers = _count(v.get("num_hidden_layers") or v.get("depth"), "vision_config.num_hidden_layers", limits.MAX_LAYERS)
    i = _count(v.get("intermediate_size"), "vision_config.intermediate_size", limits.MAX_INTERMEDIATE_SIZE, 4 * h)
    patch = _count(v.get("patch_size"), "vision_config.patch_size", limits.MAX_HEAD_DIM, 14)
    channels = _count(v.get("num_channels"), "vision_config.num_channels", limits.MAX_HEAD_DIM, 3)
    return layers * (4 * h * h + 4 * h + 2 * h * i + h + i + 4 * h) + channels * patch * patch * h + h


def params_from_index(index: dict[str, Any], config: dict[str, Any]) -> int | None:
    """Exact parameter count from a safetensors index: metadata.total_parameters when present,
    else total_size / bytes per element of the checkpoint dtype (unquantized checkpoints only)."""
    meta = index.get("metadata") or {}
    if isinstance(meta.get("total_parameters"), int) and meta["total_parameters"] > 0:
        return int(meta["total_parameters"])
    total = meta.get("total_size")
    cfg = text_config(config)[0]  # a nested text_config may carry the dtype or the quantization
    if not isinstance(total, int) or total <= 0 or config.get("quantization_config") or cfg.get("quantization_config"):
        return None
    dtype = str(config.get("torch_dtype") or config.get("dtype") or cfg.get("torch_dtype") or cfg.get("dtype")
                or "bfloat16")
    return total // DTYPE_BYTES.get(dtype, 2)


_NOT_SIZED = frozenset({"name", "aliases", "source", "params", "params_source", "max_model_len", "revision"})
"""ModelArch fields that name the model or are checked another way (the parameter count against the
safetensors index; the context is vllmfit's --max-model-len), left out of `sizing_digest`."""


def sizing_digest(arch: ModelArch) -> str:
    """The sha256 of every fact of `arch` the memory model sizes from: the same for the catalog's
    entry and for the config.json vLLM would load when they describe the same model, different when
    a config.json changes a shape, a dtype or a quantization (vllmfit.verify compares the two)."""
    facts = {f.name: getattr(arch, f.name) for f in fields(arch) if f.name not in _NOT_SIZED and not f.name.startswith("_")}
    facts = {k: asdict(v) if hasattr(v, "__dataclass_fields__") else v for k, v in facts.items()}
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()
