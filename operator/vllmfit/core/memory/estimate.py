"""`vllmfit estimate`: one deployment alone on empty GPUs of one type, with checked fixes."""

from __future__ import annotations

from vllmfit.core import defaults
from vllmfit.core.memory.budget import budget_bytes
from vllmfit.core.memory.fixes import fixes
from vllmfit.core.memory.sizing import size, vllm_startup
from vllmfit.core.memory.types import Estimate, Settings
from vllmfit.core.memory.versions import parse_version
from vllmfit.core.modelarch import GpuType, ModelArch

# --- estimate: one deployment, empty GPUs, with checked fixes -----------------------------------


def estimate(model: ModelArch, s: Settings, gpu: GpuType, *, other_gpus: tuple[GpuType, ...] = ()) -> Estimate:
    T = gpu.cuda_total_bytes
    budget = budget_bytes(T)
    sizing = size(model, s, gpu, budget)
    version, _ = parse_version(s.vllm_version)
    vllm = None
    if sizing.flags and s.policy == "vllm" and model.num_layers:
        f = sizing.flags
        vllm = vllm_startup(model, s, gpu, f.gpu_memory_utilization, f.max_model_len, f.max_num_seqs)
    suggestions = () if sizing.fits else tuple(fixes(model, s, gpu, other_gpus))
    return Estimate(model, gpu, s, version, sizing, budget, defaults.RESERVE_BYTES, T, vllm, suggestions,
                    sizing.warnings)
