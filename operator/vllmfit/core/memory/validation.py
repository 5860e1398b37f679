"""Which settings can run a model at all: parallelism, lengths, checkpoint quantization, dtype."""

from __future__ import annotations

from vllmfit.core import defaults
from vllmfit.core.memory.types import Settings
from vllmfit.core.memory.versions import OLDEST_ACCEPTED, requested_version
from vllmfit.core.modelarch import DTYPE_BYTES, ModelArch, check_tp

# --- Validation --------------------------------------------------------------------------------

_CHECKPOINT_COMPATIBLE = {
    None: {None, "fp8", "bitsandbytes"},  # an unquantized checkpoint can be quantized online
    "fp8": {None, "fp8", "compressed-tensors"},
    "int8": {None, "int8", "w8a8", "compressed-tensors", "bitsandbytes"},
    "int4": {None, "awq", "gptq", "w4a16", "compressed-tensors", "bitsandbytes"},
    "mxfp4": {None, "mxfp4"},
}


def validate(model: ModelArch, s: Settings) -> list[str]:
    """Why these settings cannot run this model (empty when they can). One line each, with the fix."""
    errors: list[str] = []
    if s.tp < 1 or s.pp < 1:
        errors.append("tensor and pipeline parallel sizes must be at least 1")
        return errors
    tp_error = check_tp(model, s.tp)
    if tp_error:
        errors.append(tp_error)
    if s.pp > model.num_layers:
        errors.append(f"pipeline parallel size {s.pp} exceeds the {model.num_layers} layers of {model.name}")
    if s.gpu_memory_utilization is not None and not 0 < s.gpu_memory_utilization <= 1:
        errors.append(f"gpu_memory_utilization {s.gpu_memory_utilization} must be in (0, 1]")
    if s.max_model_len is not None:
        if s.max_model_len < 1:
            errors.append(f"max_model_len {s.max_model_len} must be positive")
        elif s.max_model_len > model.max_model_len:
            errors.append(
                f"max_model_len {s.max_model_len} exceeds what {model.name} supports ({model.max_model_len}); "
                f"use at most {model.max_model_len}"
            )
    for name, value in (("max_num_seqs", s.max_num_seqs), ("max_num_batched_tokens", s.max_num_batched_tokens)):
        if value is not None and value < 1:
            errors.append(f"{name} {value} must be positive")
    seqs = s.max_num_seqs or defaults.DEFAULT_MAX_NUM_SEQS
    if s.max_num_batched_tokens is not None and 0 < s.max_num_batched_tokens < seqs:
        # vLLM SchedulerConfig: "max_num_batched_tokens (B) must be greater than or equal to max_num_seqs (S)."
        errors.append(
            f"max_num_batched_tokens {s.max_num_batched_tokens} is less than max_num_seqs {seqs}; vLLM refuses "
            f"to start: use at least {seqs}"
        )
    ckpt = model.quant.method if model.quant else None
    allowed = _CHECKPOINT_COMPATIBLE.get(ckpt, {None})
    if s.quantization not in allowed:
        have = f"is quantized as {ckpt}" if ckpt else "is not pre-quantized"
        ok = ", ".join(sorted(q for q in allowed if q)) or "none"
        errors.append(
            f"{model.name} {have}; --quantization {s.quantization} cannot load it (use: unset, or {ok})"
        )
    if s.strict and model.warnings:
        errors.append(f"{model.warnings[0]}; strict mode refuses models vllmfit cannot size exactly")
    requested = requested_version(s.vllm_version)
    if requested is not None and requested < OLDEST_ACCEPTED:
        errors.append(
            f"vLLM {requested[0]}.{requested[1]} predates the V1 engine as the only engine (0.10); vllmfit models "
            f"0.10 and later: use a newer image or set vllmVersion"
        )
    if s.dtype not in ("auto", *DTYPE_BYTES):
        errors.append(f"dtype {s.dtype!r} is not one of auto, bfloat16, float16, float32")
    return errors
