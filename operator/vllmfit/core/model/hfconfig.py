"""Reading a Hugging Face config.json the way transformers and vLLM read it (pure: dicts in, dicts out).

- The language model's fields: vLLM's `get_hf_text_config` is transformers' `get_text_config()`,
  which returns the nested `text_config` (or `decoder` / `generator`) when there is one; InternVL-
  style checkpoints nest it as `llm_config` (vLLM reads those through its own config classes).
- Absent fields take the default of the config class that `model_type` selects, as transformers
  fills them in (`MODEL_TYPE_DEFAULTS`, from transformers 5.18.0 / 4.57.6 config classes).
- max_model_len: the minimum of the length keys present, `model_max_length` overriding, times the
  rope factor for scaling types that do not already state the scaled length, never for Gemma 3
  (vLLM 0.33 `derive_max_model_len_and_key` and `_get_and_verify_max_len`).
"""

from __future__ import annotations

from typing import Any

TEXT_CONFIG_KEYS = ("text_config", "llm_config", "language_config", "decoder", "generator")

# A nested text config without a model_type gets the text class of its parent (transformers'
# composite configs build it with that class: Gemma3Config -> Gemma3TextConfig, ...).
TEXT_MODEL_TYPE = {
    "gemma3": "gemma3_text",
    "gemma4": "gemma4_text",
    "llama4": "llama4_text",
    "qwen3_5": "qwen3_5_text",
    "qwen3_5_moe": "qwen3_5_moe_text",
    "qwen3_vl": "qwen3_vl_text",
    "qwen3_vl_moe": "qwen3_vl_moe_text",
}

# Defaults of the transformers config classes, for keys vLLM's memory depends on. Only what a
# real checkpoint may omit; a missing key with no default here stays missing (and is refused).
MODEL_TYPE_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"vocab_size": 32000, "max_position_embeddings": 2048, "tie_word_embeddings": False},
    "mistral": {"vocab_size": 32000, "num_key_value_heads": 8, "max_position_embeddings": 4096 * 32,
                "sliding_window": 4096},
    "mixtral": {"vocab_size": 32000, "num_key_value_heads": 8, "max_position_embeddings": 4096 * 32},
    "qwen2": {"vocab_size": 151936, "num_key_value_heads": 32, "max_position_embeddings": 32768},
    "qwen3": {"vocab_size": 151936, "num_key_value_heads": 32, "head_dim": 128, "max_position_embeddings": 32768},
    "qwen3_moe": {"vocab_size": 151936, "num_key_value_heads": 4, "head_dim": 128, "max_position_embeddings": 32768},
    "gemma2": {"vocab_size": 256000, "head_dim": 256, "max_position_embeddings": 8192, "sliding_window": 4096,
               "tie_word_embeddings": True},
    "gemma3_text": {"vocab_size": 262208, "hidden_size": 2304, "num_hidden_layers": 26, "num_attention_heads": 8,
                    "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 131072,
                    "sliding_window": 4096, "tie_word_embeddings": True},
    "gpt_oss": {"vocab_size": 201088, "hidden_size": 2880, "head_dim": 64, "num_attention_heads": 64,
                "num_key_value_heads": 8, "sliding_window": 128, "max_position_embeddings": 131072},
    "deepseek_v3": {"vocab_size": 129280, "max_position_embeddings": 4096},
    "llama4_text": {"vocab_size": 202048, "hidden_size": 5120, "num_hidden_layers": 48, "num_attention_heads": 40,
                    "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 4096 * 32},
    "qwen3_next": {"vocab_size": 151936, "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 16,
                   "num_key_value_heads": 2, "head_dim": 256, "max_position_embeddings": 32768,
                   "full_attention_interval": 4, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
                   "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32},
    "qwen3_5_text": {"vocab_size": 248320, "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 16,
                     "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 32768,
                     "full_attention_interval": 4, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
                     "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32},
    "qwen3_5_moe_text": {"vocab_size": 248320, "head_dim": 256, "max_position_embeddings": 32768,
                         "full_attention_interval": 4, "linear_conv_kernel_dim": 4},
    "nemotron_h": {"vocab_size": 131072, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                   "mamba_head_dim": 64, "max_position_embeddings": 4096, "conv_kernel": 4, "n_groups": 8,
                   "ssm_state_size": 128},
    "granitemoehybrid": {"vocab_size": 32000, "max_position_embeddings": 2048, "mamba_n_heads": 128,
                         "mamba_n_groups": 1, "mamba_d_state": 256, "mamba_d_conv": 4, "mamba_expand": 2},
    "falcon_h1": {"vocab_size": 128000, "num_key_value_heads": 8, "max_position_embeddings": 8192,
                  "mamba_d_ssm": 1024, "mamba_n_heads": 128, "mamba_n_groups": 1, "mamba_d_state": 256,
                  "mamba_d_conv": 4, "mamba_expand": 2},
    "jamba": {"vocab_size": 65536, "num_key_value_heads": 8, "max_position_embeddings": 262144,
              "attn_layer_period": 8, "attn_layer_offset": 4, "mamba_d_state": 16, "mamba_d_conv": 4,
              "mamba_expand": 2},
    "lfm2": {"vocab_size": 65536, "hidden_size": 2560, "num_attention_heads": 32, "num_key_value_heads": 8,
             "max_position_embeddings": 128000, "tie_word_embeddings": True, "conv_L_cache": 3},
}

# Rope types whose `factor` does NOT multiply max_position_embeddings: their configs already state
# the scaled length (vLLM 0.33 config/model.py `_get_and_verify_max_len`).
ROPE_NO_SCALE = {"su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling"}
MAX_LEN_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "max_target_positions",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)


def text_config(config: dict[str, Any]) -> tuple[dict[str, Any], str, tuple[str, ...]]:
    """The language model's fields with the class defaults filled in, the top-level model_type, and
    the keys filled from defaults.

    The nested text config inherits the top level's quantization_config, dtype and
    tie_word_embeddings when it does not set them (vLLM reads those from the top level)."""
    top_type = str(config.get("model_type", ""))
    cfg = config
    for key in TEXT_CONFIG_KEYS:
        nested = config.get(key)
        if isinstance(nested, dict):
            cfg = {**nested}
            for inherit in ("quantization_config", "torch_dtype", "dtype", "tie_word_embeddings"):
                if cfg.get(inherit) is None and config.get(inherit) is not None:
                    cfg[inherit] = config[inherit]
            break
    model_type = str(cfg.get("model_type") or TEXT_MODEL_TYPE.get(top_type, top_type))
    defaults = MODEL_TYPE_DEFAULTS.get(model_type) or MODEL_TYPE_DEFAULTS.get(top_type) or {}
    filled = {k: v for k, v in defaults.items() if k not in cfg}  # an explicit null stays null
    if filled:
        cfg = {**cfg, **filled}
    if cfg is config:
        cfg = {**config}
    cfg["model_type"] = model_type
    return cfg, top_type, tuple(sorted(filled))


def rope_parameter_sets(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """rope_scaling (transformers 4.x) or rope_parameters (5.x; one set, or one per layer type)."""
    out: list[dict[str, Any]] = []
    for key in ("rope_scaling", "rope_parameters"):
        value = cfg.get(key)
        if isinstance(value, dict):
            if all(isinstance(v, dict) for v in value.values()) and value:
                out.extend(v for v in value.values() if isinstance(v, dict))
            else:
                out.append(value)
    return out


def derive_max_len(cfg: dict[str, Any]) -> int | None:
    """The model's maximum context as vLLM derives it, or None when no length key is present."""
    lens = [cfg[k] for k in MAX_LEN_KEYS if isinstance(cfg.get(k), int) and not isinstance(cfg.get(k), bool)
            and cfg[k] > 0]
    if not lens:
        return None
    length: float = min(lens)
    if "gemma3" not in str(cfg.get("model_type", "")):
        for rope in rope_parameter_sets(cfg):
            rope_type = rope.get("rope_type") or rope.get("type") or ""
            factor = rope.get("factor")
            if isinstance(factor, (int, float)) and factor and rope_type not in ROPE_NO_SCALE:
                length *= float(factor)
    if isinstance(cfg.get("model_max_length"), int) and cfg["model_max_length"] > 0:
        length = cfg["model_max_length"]
    return int(length)
