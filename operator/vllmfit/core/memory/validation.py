"""Which settings can run a model at all: parallelism, lengths, checkpoint quantization, dtype."""

from __future__ import annotations

from vllmfit.core import limits
from vllmfit.core.memory.types import Settings
from vllmfit.core.memory.versions import OLDEST_ACCEPTED, VllmVersion, requested_version
from vllmfit.core.model.facts import DTYPE_BYTES, GpuType, ModelArch, check_tp

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
    seqs = s.max_num_seqs or 0  # unset: vLLM's default is min(S_default, B), never above B
    if s.max_num_batched_tokens is not None and 0 < s.max_num_batched_tokens < seqs:
        # vLLM SchedulerConfig: "max_num_batched_tokens (B) must be greater than or equal to max_num_seqs (S)."
        errors.append(
            f"maxNumBatchedTokens {s.max_num_batched_tokens} is less than maxNumSeqs {seqs}; vLLM refuses "
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
    errors.extend(kv_request_errors(s, model.max_model_len))
    if s.dtype not in ("auto", *DTYPE_BYTES):
        errors.append(f"dtype {s.dtype!r} is not one of auto, bfloat16, float16, float32")
    return errors


# --- CPU offload (spec.cpuOffload -> --cpu-offload-gb) -----------------------------------------

MULTI_GROUP_OFFLOAD_FROM = 21
"""vLLM 0.11-0.19 `GPUModelRunner.may_reinitialize_input_batch` asserts "Cannot re-initialize the input
batch when CPU weight offloading is enabled" when the KV cache has more than one group (sliding-window
or recurrent-state hybrids); 0.21 dropped the assert."""


def cpu_offload_errors(model: ModelArch, s: Settings, version: VllmVersion, kv_groups: int) -> list[str]:
    """Why spec.cpuOffload cannot run (or be sized) here; `kv_groups`: the KV cache groups of the layout."""
    if not s.cpu_offload_bytes:
        return []
    if s.cpu_offload_bytes < 0 or s.cpu_offload_bytes > limits.MAX_CPU_OFFLOAD_BYTES:
        return [f"cpuOffload {s.cpu_offload_bytes} bytes must be between 0 and {limits.MAX_CPU_OFFLOAD_BYTES >> 50} PiB"]
    if s.policy != "vllm":
        return ["cpuOffload is sized by the vllm memory policy only; remove it or use the vllm policy"]
    if kv_groups > 1 and not version.at_least(MULTI_GROUP_OFFLOAD_FROM):
        return [(f"cpuOffload with {model.name} on vLLM {version.label}: vLLM refuses CPU weight offloading "
                 f"when the KV cache has several groups ({kv_groups}; fixed in 0.21); use a newer image or remove "
                 "cpuOffload")]
    return []


# --- The KV request ---------------------------------------------------------------------------


def kv_request_errors(s: Settings, model_max_len: int | None = None) -> list[str]:
    """Why the KV request (spec.kvCache / the CLI's --kv-cache-*) is contradictory or out of range."""
    errors: list[str] = []
    if s.kv_tokens is not None and s.kv_bytes is not None:
        errors.append(
            f"kvCache gives both tokens ({s.kv_tokens}) and memory ({s.kv_bytes} bytes); keep tokens (it means "
            f"the same on every GPU type and tensor-parallel size) and remove memory"
        )
    if s.kv_concurrency is not None and (s.kv_tokens is not None or s.kv_bytes is not None):
        which = "tokens" if s.kv_tokens is not None else "memory"
        errors.append(
            f"kvCache gives both concurrency ({s.kv_concurrency}) and {which}; keep one (concurrency x "
            f"typicalLength is a number of tokens)"
        )
    for name, value in (("tokens", s.kv_tokens), ("memory", s.kv_bytes), ("concurrency", s.kv_concurrency),
                        ("typicalLength", s.typical_len)):
        if value is not None and value < 1:
            errors.append(f"kvCache.{name} {value} must be positive")
    limit = s.max_model_len or model_max_len
    if s.typical_len is not None and limit is not None and s.typical_len > limit:
        errors.append(f"kvCache.typicalLength {s.typical_len} exceeds maxModelLen {limit}; use at most {limit}")
    return errors


# --- What the GPU can run (compute capability, from catalog/gpus.yaml) --------------------------

BF16_MIN_CC = (8, 0)
"""vLLM's CudaPlatform supports bfloat16 from compute capability 8.0; below it `dtype: auto` of a
bfloat16 checkpoint runs in float16 and an explicit bfloat16 is an error."""
FP8_MIN_CC = (8, 0)
"""Fp8Config.get_min_capability() is 80: Ampere (8.0-8.6) runs fp8 weights weight-only through the
FP8 Marlin kernel ("for GPUs that lack FP8 hardware support"); none below 8.0 (Turing, Volta)."""
FP8_W8A8_MIN_CC = (8, 9)
"""fp8 weights and activations (W8A8) need FP8 tensor cores: Ada (8.9) and Hopper (9.0) and later."""
_QUANT_MIN_CC = {
    "fp8": FP8_MIN_CC,
    "mxfp4": (8, 0),
    "w4a16": (8, 0),
    "awq": (7, 5),
    "int8": (7, 5),
    "w8a8": (7, 5),
    "gptq": (6, 0),
    "bitsandbytes": (7, 0),
    "compressed-tensors": (7, 0),
}
"""The smallest compute capability of each quantization method (vLLM's get_min_capability)."""


def weight_quantization(model: ModelArch, s: Settings) -> str | None:
    """The quantization the weights run with: --quantization, else the checkpoint's."""
    return s.quantization or (model.quant.method if model.quant else None)


NATIVE_FROM_021 = frozenset({"glm_moe_dsa"})
"""GLM-5: vLLM 0.11 builds it through the Transformers fallback with full K/V heads (the 0.11 oracle:
12x the sparse-MLA pages vLLM 0.21 and 0.33 use)."""
SINKS_MIN_CC = (9, 0)
"""vLLM 0.21 builds MiMo-V2's sliding layers (attention sinks) with FlashAttention 3 only (the 0.21
oracle on A100 / L40S: "Sinks are only supported in FlashAttention 3"); 0.33 runs them there."""
SPARSE_MLA_MIN_CC = (9, 0)
"""FlashMLA sparse / FlashInfer sparse MLA (DeepSeek-V3.2, GLM-5): Hopper and Blackwell only
(v1/attention/backends/mla/flashmla_sparse.py supports_compute_capability; the vLLM 0.33 oracle
refuses A100 and L40S)."""


def gpu_errors(model: ModelArch, s: Settings, gpu: GpuType) -> tuple[list[str], list[str]]:
    """(errors, warnings) of running these settings on this GPU. An unknown compute capability
    (a GPU outside the catalog) checks nothing."""
    cc = gpu.compute_capability
    if cc is None:
        return [], []
    errors: list[str] = []
    warnings: list[str] = []
    where = f"{gpu.product} (compute capability {gpu.cc_label})"
    quant = weight_quantization(model, s)
    need = _QUANT_MIN_CC.get(quant or "")
    if need and cc < need:
        errors.append(f"{where} cannot run {quant} weights (vLLM needs compute capability {need[0]}.{need[1]})")
    elif quant == "fp8" and cc < FP8_W8A8_MIN_CC:
        warnings.append(f"{where} runs fp8 weights weight-only (FP8 Marlin); fp8 W8A8 needs compute capability 8.9")
    if s.kv_cache_dtype.startswith("fp8") and cc < FP8_MIN_CC:
        errors.append(f"{where} cannot run an fp8 KV cache (no fp8 below compute capability 8.0)")
    version = requested_version(s.vllm_version)
    before_033 = version is not None and version < (0, 33)
    if version is not None and version < (0, 21) and model.model_type in NATIVE_FROM_021:
        errors.append(f"vLLM {version[0]}.{version[1]} has no model class for {model.name} ({model.model_type}): "
                      "it falls back to the Transformers backend without MLA, with many times the KV cache "
                      "vllmfit sizes; use vLLM 0.21 or later")
    if before_033 and model.swa_attention_sinks and cc < SINKS_MIN_CC:
        errors.append(f"{where} cannot run {model.name} on vLLM {version[0]}.{version[1]}: 'Sinks are only "
                      "supported in FlashAttention 3' (compute capability 9.0); use vLLM 0.33 or a Hopper GPU")
    if before_033 and model.quant is not None and model.quant.scheme == "modelopt_mixed" and cc < FP8_W8A8_MIN_CC:
        errors.append(f"{where} cannot run {model.name} on vLLM {version[0]}.{version[1]}: 'The quantization method "
                      "modelopt_mixed is not supported for the current GPU. Minimum capability: 89'")
    mq = model.quant
    if before_033 and mq is not None and mq.block_n and model.is_moe:
        # the 0.11 and 0.21 oracles refuse Qwen3-30B-A3B-FP8 at TP 8 (96 rows); 0.33 starts it
        shard = model.moe_intermediate_size // max(s.tp, 1)
        if shard % mq.block_n:
            errors.append(f"tensor parallel size {s.tp} splits {model.name}'s experts into {shard} rows, which vLLM "
                          f"{version[0]}.{version[1]} refuses: 'The output_size of gate's and up's weight = {shard} is "
                          f"not divisible by weight quantization block_n = {mq.block_n}'; use a smaller "
                          "tensor parallel size or vLLM 0.33")
    if model.is_sparse_mla and cc < SPARSE_MLA_MIN_CC:
        # vLLM 0.33 on A100 / L40S: "No valid attention backend found for cuda with
        # AttentionSelectorConfig(head_size=576, ...)" (the sparse-MLA backends are SM90+ only)
        errors.append(f"{where} cannot run {model.name}'s sparse MLA attention: vLLM finds no attention backend "
                      f"for it below compute capability {SPARSE_MLA_MIN_CC[0]}.{SPARSE_MLA_MIN_CC[1]}")
    if cc < BF16_MIN_CC:
        if s.dtype == "bfloat16":
            errors.append(f"{where} cannot run bfloat16 (vLLM needs compute capability 8.0); use dtype: float16")
        elif s.dtype == "auto" and model.torch_dtype == "bfloat16":
            warnings.append(f"{where} has no bfloat16: vLLM runs {model.name} in float16 (same memory)")
    return errors, warnings


def can_run(model: ModelArch, s: Settings, gpu: GpuType) -> bool:
    return not gpu_errors(model, s, gpu)[0]
