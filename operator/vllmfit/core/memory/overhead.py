"""Runtime memory vLLM measures at start-up: the activation peak of the profile run, non-torch
memory, CUDA graphs and the CUDA context; vLLM's batch defaults per GPU tier."""

from __future__ import annotations

from vllmfit.core.defaults import CUDA_CONTEXT_BYTES, GIB
from vllmfit.core.memory.types import Settings
from vllmfit.core.memory.versions import VllmVersion
from vllmfit.core.memory.weights import activation_dtype_bytes
from vllmfit.core.model.facts import GpuType, ModelArch, ceil_div

# --- Runtime memory vLLM measures (calibrated on shared/calibration, as functions of shape) ---

CUDA_CONTEXT_SINGLE = CUDA_CONTEXT_BYTES
"""CUDA context + cuBLAS at start-up, one GPU (calibration: init snapshot 0.51 GiB on H100); the
`counted` budget counts one of these (defaults.COUNTED_CONTEXT_BYTES)."""
CUDA_CONTEXT_MULTI = 2 * GIB
"""With TP/PP > 1, NCCL communicators and custom all-reduce buffers (calibration: 1.43-1.99 GiB)."""
NON_TORCH_SINGLE = int(0.27 * GIB)
"""Non-torch growth while profiling, one GPU (calibration: 0.24-0.27 GiB, granite 0.46)."""
NON_TORCH_TP = int(2.25 * GIB)
"""Non-torch growth with TP > 1: lazily created NCCL buffers (calibration: 2.06-2.21 GiB)."""
NON_TORCH_PP = int(0.1 * GIB)
"""Non-torch growth with PP only (calibration: 0.07 GiB)."""
GRAPH_BASE = int(0.45 * GIB)
GRAPH_PER_LAYER = int(0.0145 * GIB)
GRAPH_MOE_EXTRA = int(0.35 * GIB)
"""CUDA graphs: base + per layer (+ MoE); calibration: 0.64-1.79 GiB on H100 for 24-80 layers."""
FORWARD_HIDDEN_COPIES = 4
"""Activation of the profile forward: B x (3 x I / tp + 4 x hidden) elements (calibrated)."""


def batch_defaults(gpu: GpuType, version: VllmVersion) -> tuple[int, int]:
    """vLLM's API-server defaults (max_num_batched_tokens, max_num_seqs) by device memory
    (vllm-flags.md section 3: the >= 160 GiB tier is in 0.33's get_batch_defaults, not in 0.11, 0.15
    or 0.21; it is used from 0.33 on, the first version read that has it)."""
    mem = gpu.cuda_total_bytes
    if mem >= 160 * GIB and version.at_least(33):
        return 16384, 1024
    if mem >= 70 * GIB and not gpu.is_a100:
        return 8192, 1024
    return 2048, 256


def activation_bytes(model: ModelArch, s: Settings, batched: int, seqs: int, version: VllmVersion,
                     lora: tuple[int, int] = (0, 0)) -> int:
    """Peak of the profile run: max(sampler logits, forward intermediates) + fused-MoE workspace;
    `lora`: what LoRA adds to (forward, logits) (memory.lora.lora_activation_bytes)."""
    act = activation_dtype_bytes(model, s)
    # a pooling model's profile run calls the pooler, not the sampler: no logits over the vocabulary
    rows = 0 if model.pooling else min(seqs, batched)
    logits = rows * (ceil_div(model.vocab_size, 64) * 64) * (version.logits_bytes_per_element + (act - 2))
    inter = 0 if model.is_moe else 3 * model.intermediate_size // s.tp
    forward = batched * (inter + FORWARD_HIDDEN_COPIES * model.hidden_size) * act
    moe = 0
    if model.is_moe:
        moe = batched * model.num_experts_per_tok * (2 * model.moe_intermediate_size // s.tp + model.hidden_size) * act
    # with PP the logits live on the last stage only; the fuller stage is taken (conservative)
    return int(max(logits + lora[1], forward + lora[0]) + moe)


def graph_bytes(model: ModelArch, s: Settings) -> int:
    if s.enforce_eager:
        return 0
    layers = ceil_div(model.num_layers, s.pp)
    return GRAPH_BASE + GRAPH_PER_LAYER * layers + (GRAPH_MOE_EXTRA if model.is_moe else 0)


def runtime_overheads(s: Settings) -> tuple[int, int]:
    """(CUDA context outside R, non-torch growth inside R)."""
    if s.tp > 1:
        return CUDA_CONTEXT_MULTI, NON_TORCH_TP
    if s.pp > 1:
        return CUDA_CONTEXT_MULTI, NON_TORCH_PP
    return CUDA_CONTEXT_SINGLE, NON_TORCH_SINGLE
