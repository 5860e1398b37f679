"""What one vLLM deployment needs on each of its GPUs. Pure functions, integer bytes.

Two policies:
- `vllm` (default) predicts what vLLM itself does at start-up, following
  shared/reference/vllm-memory-accounting.md: weights from parameter counts and quantization,
  KV pages per layer type with block rounding, the activation peak of the profile run,
  non-torch memory, CUDA graphs, and the CUDA context outside the requested budget.
- `adr` is ADR-0002 exactly: weights x (1 + replication) / tp, GQA KV bytes per token / tp,
  nothing else.

The footprint of one vLLM process on a GPU is what the ledger books: its CUDA context
(outside --gpu-memory-utilization) plus R = ceil(T x u), the budget vLLM requests (plus the
CUDA-graph pool before 0.21, which was captured outside R). vllmfit chooses u so that R holds
weights + activation + non-torch + graphs + the KV reservation; see `sizing.size`.

One module per concern, in dependency order:
  versions    the vLLM versions modelled and the rules that change between them
  types       Settings in; Footprint, Flags, Sizing, Estimate out
  budget      the GPU budget (ADR-0002) and vLLM's requested memory R
  validation  which settings can run a model at all
  weights     weight bytes per GPU; CPU offload (spec.cpuOffload)
  kv          KV pages, groups, blocks per request, KV tokens
  lora        LoRA adapter slots (spec.lora): buffers per layer, punica metadata, profile extras
  overhead    activation peak, non-torch memory, CUDA graphs, CUDA context
  sizing      choose context, concurrency and utilization; check the fit
  fixes       changes that make a deployment fit, each re-checked
  estimate    one deployment on empty GPUs (`vllmfit estimate`)
  learned     what a configuration really used at its first start, and the correction it
              teaches (`memory.size` is `learned.size`: sizing with a learned over-run on top)

This package re-exports the names the shells use; inside the core, import the module.
"""

from vllmfit.core.defaults import MIB
from vllmfit.core.memory.budget import (
    ADR_POLICY,
    DEFAULT_POLICY,
    POLICIES,
    BudgetPolicy,
    budget_bytes,
    default_policy,
    policy_named,
    requested_bytes,
    utilization_for,
    utilization_within,
)
from vllmfit.core.memory.estimate import estimate
from vllmfit.core.memory.fixes import (
    MAX_FIX_TP,
    SPEC_NAMES,
    Fix,
    fixes,
    kv_request_too_large,
    larger_gpu,
    largest_kv_tokens,
    one_node_fixes,
    one_node_reason,
)
from vllmfit.core.memory.kv import KvLayout, adr_kv_bytes_per_token, kv_layout
from vllmfit.core.memory.learned import size  # sizing.size with a learned over-run booked on top
from vllmfit.core.memory.lora import lora_args, lora_bytes
from vllmfit.core.memory.sizing import (
    MIN_BATCHED_TOKENS,
    UNLIMITED,
    default_batch,
    default_grant,
    request_only,
    vllm_startup,
)
from vllmfit.core.memory.types import (
    DEFAULT_KV_GRANT,
    Estimate,
    Flags,
    Footprint,
    KvGrant,
    Policy,
    Settings,
    Sizing,
    SpecError,
    VllmStartup,
    fmt_gib,
    kv_json,
)
from vllmfit.core.memory.validation import can_run, gpu_errors, validate
from vllmfit.core.memory.versions import VllmVersion, parse_version
from vllmfit.core.memory.weights import adr_weights_bytes, cpu_offload_arg, cpu_offloaded_bytes, weights_bytes

__all__ = [
    "ADR_POLICY",
    "DEFAULT_KV_GRANT",
    "DEFAULT_POLICY",
    "MAX_FIX_TP",
    "MIB",
    "MIN_BATCHED_TOKENS",
    "POLICIES",
    "SPEC_NAMES",
    "UNLIMITED",
    "BudgetPolicy",
    "Estimate",
    "Fix",
    "Flags",
    "Footprint",
    "KvGrant",
    "KvLayout",
    "Policy",
    "Settings",
    "Sizing",
    "SpecError",
    "VllmStartup",
    "VllmVersion",
    "adr_kv_bytes_per_token",
    "adr_weights_bytes",
    "budget_bytes",
    "can_run",
    "cpu_offload_arg",
    "cpu_offloaded_bytes",
    "default_batch",
    "default_grant",
    "default_policy",
    "estimate",
    "fixes",
    "fmt_gib",
    "gpu_errors",
    "kv_json",
    "kv_layout",
    "kv_request_too_large",
    "larger_gpu",
    "largest_kv_tokens",
    "lora_args",
    "lora_bytes",
    "one_node_fixes",
    "one_node_reason",
    "parse_version",
    "policy_named",
    "request_only",
    "requested_bytes",
    "size",
    "utilization_for",
    "utilization_within",
    "validate",
    "vllm_startup",
    "weights_bytes",
]
