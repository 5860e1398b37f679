"""Changes that make a deployment fit a GPU, each verified by sizing again."""

from __future__ import annotations

from dataclasses import replace

from vllmfit.core import defaults
from vllmfit.core.memory.budget import budget_bytes
from vllmfit.core.memory.sizing import finish, resolve, size
from vllmfit.core.memory.types import Settings, Sizing, SpecError
from vllmfit.core.modelarch import GpuType, ModelArch, check_tp


def fixes(model: ModelArch, s: Settings, gpu: GpuType, other_gpus: tuple[GpuType, ...] = (),
          available: int | None = None) -> list[str]:
    """Concrete changes that make the deployment fit, each verified by sizing again."""
    avail = budget_bytes(gpu.cuda_total_bytes) if available is None else available
    out: list[str] = []

    def fits(**changes: object) -> Sizing | None:
        try:
            sz = size(model, replace(s, **changes), gpu, avail)  # type: ignore[arg-type]
        except SpecError:
            return None
        return sz if sz.fits else None

    seqs = s.max_num_seqs or defaults.DEFAULT_MAX_NUM_SEQS
    # 1. the largest context that fits (a multiple of the block size)
    r = resolve(model, s, gpu)
    base = finish(model, r, gpu, s.block_size, seqs, [])
    room = avail - base.footprint.non_kv - 10 ** -defaults.UTILIZATION_DECIMALS * gpu.cuda_total_bytes
    if room > 0 and s.policy == "vllm" and not r.layout.pooling:
        length = r.layout.max_length(int(room), seqs, r.batched_tokens, model.max_model_len, s.pp)
        useful = min(defaults.MIN_AUTO_MAX_MODEL_LEN, model.max_model_len)  # a 352-token context fixes nothing
        if length >= useful and fits(max_model_len=length):
            out.append(f"maxModelLen: {length}")
    # 2. fewer concurrent sequences at the asked context
    if seqs > 1 and s.max_model_len and fits(max_num_seqs=1):
        lo, hi = 1, seqs - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(max_num_seqs=mid) else (lo, mid - 1)
        out.append(f"maxNumSeqs: {lo}")
    # 3. an fp8 KV cache
    if not s.kv_cache_dtype.startswith("fp8") and fits(kv_cache_dtype="fp8"):
        out.append("kvCacheDtype: fp8")
    # 4. fp8 weights
    if not s.quantization and not model.quant and fits(quantization="fp8"):
        out.append("quantization: fp8")
    # 5. the smallest TP that fits; if none does alone, the smallest with fp8 weights
    tps = [tp for tp in (2, 4, 8, 16) if tp > s.tp and not check_tp(model, tp)]
    tp_fix = next((tp for tp in tps if fits(tp=tp)), None)
    if tp_fix:
        out.append(f"tensorParallelSize: {tp_fix}")
    if not s.quantization and not model.quant and "quantization: fp8" not in out:
        tp_fp8 = next((tp for tp in tps if tp < (tp_fix or 99) and fits(tp=tp, quantization="fp8")), None)
        if tp_fp8:  # fewer GPUs than TP alone needs
            out.append(f"tensorParallelSize: {tp_fp8}, quantization: fp8")
    # 6. a larger GPU
    for other in sorted(other_gpus, key=lambda g: (g.cuda_total_bytes, g.product)):
        if other.cuda_total_bytes <= gpu.cuda_total_bytes:
            continue
        try:
            if size(model, s, other, budget_bytes(other.cuda_total_bytes)).fits:
                out.append(f"a larger GPU: {other.product}")
                break
        except SpecError:
            continue
    return out
