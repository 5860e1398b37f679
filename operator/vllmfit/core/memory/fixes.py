"""Changes that make a deployment fit a GPU, each verified by sizing again: an fp8 KV cache, fewer
KV tokens, a shorter context, quantized weights the GPU can run, more TP, the utilization that
fits (for an explicit one) or the budget policy that admits it, a larger GPU; and two changes
together when neither fits alone."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

from vllmfit.core import defaults
from vllmfit.core.memory.budget import DEFAULT_POLICY, BudgetPolicy, utilization_within
from vllmfit.core.memory.sizing import explicit_request, resolve, size
from vllmfit.core.memory.types import Settings, Sizing, SpecError, fmt_gib
from vllmfit.core.memory.validation import can_run
from vllmfit.core.model.facts import GpuType, ModelArch, check_tp

SPEC_NAMES = {
    "max_model_len": "maxModelLen",
    "kv_tokens": "kvCache",
    "kv_cache_dtype": "kvCacheDtype",
    "quantization": "quantization",
    "tp": "tensorParallelSize",
    "gpu_memory_utilization": "gpuMemoryUtilization",
}
"""Settings fields a fix may change, by the spec field users write."""


@dataclass(frozen=True)
class Fix:
    """One checked change (or two together): Settings fields and values, or a budget policy."""

    changes: tuple[tuple[str, object], ...] = ()
    policy: BudgetPolicy | None = None
    note: str = ""

    @property
    def text(self) -> str:
        if self.policy is not None:
            return self.note
        # the KV request is replaced whole: "kvCache: {tokens: N}" (YAML, like the spec)
        return ", ".join(f"{SPEC_NAMES[k]}: {{tokens: {v}}}" if k == "kv_tokens" else f"{SPEC_NAMES[k]}: {v}"
                         for k, v in self.changes)

    def settings(self, s: Settings) -> Settings:
        extra: dict[str, object] = {}
        if any(k == "kv_tokens" for k, _ in self.changes):
            extra = {"kv_bytes": None, "kv_concurrency": None, "kv_grow": False}
        return replace(s, **extra, **dict(self.changes))  # type: ignore[arg-type]


def _fits(model: ModelArch, s: Settings, gpu: GpuType, avail: int) -> Sizing | None:
    try:
        sz = size(model, s, gpu, avail)
    except SpecError:
        return None
    return sz if sz.fits else None


def largest_kv_tokens(model: ModelArch, s: Settings, gpu: GpuType, avail: int) -> int | None:
    """The largest kvCache.tokens that fits `avail` (None: not even one request of the context)."""
    try:
        r = resolve(model, replace(s, kv_bytes=None, kv_concurrency=None, kv_grow=False), gpu)
    except SpecError:
        return None
    lay = r.layout
    if lay.pooling or not lay.block_bytes or s.policy != "vllm":
        return None
    probe = size(model, replace(s, kv_tokens=lay.block_size, kv_bytes=None, kv_concurrency=None, kv_grow=False),
                 gpu, avail)
    room = int(avail - probe.footprint.non_kv - 10**-defaults.UTILIZATION_DECIMALS * gpu.cuda_total_bytes)
    bs = lay.block_size

    def ok(tokens: int) -> bool:
        return tokens > 0 and _fits(model, replace(s, kv_tokens=tokens, kv_bytes=None, kv_concurrency=None,
                                                    kv_grow=False), gpu, avail) is not None

    lo = lay.pool_tokens(max(room, 0)) // bs * bs  # a first guess from the room: step down to a fit
    for _ in range(8):
        if ok(lo):
            break
        lo -= bs
    else:
        return None
    if lo <= 0:
        return None
    step = bs  # then up: a smaller batch default (MIN_BATCHED_TOKENS) may leave more room at the limit
    while ok(lo + step):
        lo, step = lo + step, step * 2
    hi = lo + step  # does not fit
    while hi - lo > bs:
        mid = (lo + hi) // 2 // bs * bs
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def _largest_context(model: ModelArch, s: Settings, gpu: GpuType, avail: int) -> int | None:
    """The largest maxModelLen (a multiple of the block size, >= MIN_AUTO_MAX_MODEL_LEN) that fits."""
    bs = s.block_size
    floor = min(defaults.MIN_AUTO_MAX_MODEL_LEN, model.max_model_len)
    top = min(s.max_model_len or model.max_model_len, model.max_model_len)
    if not _fits(model, replace(s, max_model_len=floor), gpu, avail):
        return None
    lo, hi = floor // bs, top // bs
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if _fits(model, replace(s, max_model_len=mid * bs), gpu, avail) else (lo, mid - 1)
    length = lo * bs
    return length if length < top or s.max_model_len is None else None


def fixes(model: ModelArch, s: Settings, gpu: GpuType, other_gpus: tuple[GpuType, ...] = (),
          available: int | None = None, policy: BudgetPolicy = DEFAULT_POLICY) -> list[Fix]:
    """Concrete changes that make the deployment fit `available` bytes of a `gpu`, each verified by
    sizing again. Never one the GPU cannot run (compute capability)."""
    T = gpu.cuda_total_bytes
    avail = policy.budget(T) if available is None else available
    out: list[Fix] = []

    def ok(changes: dict[str, object]) -> bool:
        fx = Fix(tuple(changes.items()))
        return _fits(model, fx.settings(s), gpu, avail) is not None

    def numeric(base: dict[str, object]) -> list[dict[str, object]]:
        """With `base` applied: the largest context, or the largest KV tokens, that fits."""
        found: list[dict[str, object]] = []
        t = Fix(tuple(base.items())).settings(s)
        if explicit_request(t) or t.kv_concurrency:
            tokens = largest_kv_tokens(model, t, gpu, avail)
            current = _granted(model, t, gpu)
            if tokens and (current is None or tokens < current):
                found.append({**base, "kv_tokens": tokens})
        length = _largest_context(model, t, gpu, avail) if s.policy == "vllm" else None
        if length and (s.max_model_len or not explicit_request(t)):
            found.append({**base, "max_model_len": length})
        return found

    # 1. the explicit --gpu-memory-utilization: the one that fits, or the policy that admits it
    if s.gpu_memory_utilization is not None:
        try:
            r = resolve(model, s, gpu)
        except SpecError:
            r = None
        if r is not None:
            outside = r.fixed.cuda_context + (0 if r.version.graphs_in_budget else r.fixed.cuda_graphs)
            u_fit = utilization_within(T, avail - outside)
            if 0 < u_fit < s.gpu_memory_utilization and ok({"gpu_memory_utilization": u_fit}):
                out.append(Fix((("gpu_memory_utilization", u_fit),)))
            try:
                need = size(model, s, gpu, avail).footprint.total
            except SpecError:
                need = 0
            used = policy.budget(T) - avail
            want = math.ceil((need + used + policy.reserve_bytes) / T * 100) / 100
            if need and want <= 1:
                new = BudgetPolicy(want, policy.reserve_bytes, policy.source)
                out.append(Fix(policy=new, note=(
                    f"budget policy utilization {want:g} (now {policy.rule}, which holds back "
                    f"{fmt_gib(policy.held_back(T))} of this GPU)")))
    # 2. single changes
    singles: list[dict[str, object]] = []
    if not s.kv_cache_dtype.startswith("fp8"):
        singles.append({"kv_cache_dtype": "fp8"})
    if not s.quantization and not model.quant:
        singles.append({"quantization": "fp8"})
    tps = [tp for tp in (2, 4, 8, 16) if tp > s.tp and not check_tp(model, tp)]
    singles = [c for c in singles if can_run(model, Fix(tuple(c.items())).settings(s), gpu)]
    fitting = [c for c in [*numeric({}), *singles] if ok(c)]
    tp_fix = next((tp for tp in tps if ok({"tp": tp})), None)
    if tp_fix:
        fitting.append({"tp": tp_fix})
    # 3. two changes together, where neither alone fits
    pairs: list[dict[str, object]] = []
    lone = [c for c in singles if c not in fitting]
    for c in lone:
        pairs.extend(p for p in numeric(c) if ok(p))
    if len(lone) == 2 and ok({**lone[0], **lone[1]}):
        pairs.append({**lone[0], **lone[1]})
    if "quantization" in str(lone):
        tp_fp8 = next((tp for tp in tps if tp < (tp_fix or 99) and ok({"tp": tp, "quantization": "fp8"})), None)
        if tp_fp8:  # fewer GPUs than TP alone needs
            pairs.append({"tp": tp_fp8, "quantization": "fp8"})
    for c in [*fitting, *pairs]:
        fx = Fix(tuple(c.items()))
        if fx not in out:
            out.append(fx)
    return out


def _granted(model: ModelArch, s: Settings, gpu: GpuType) -> int | None:
    try:
        return size(model, s, gpu, 1 << 62).granted_tokens
    except SpecError:
        return None


def larger_gpu(model: ModelArch, s: Settings, gpu: GpuType, other_gpus: tuple[GpuType, ...],
               policy: BudgetPolicy = DEFAULT_POLICY) -> GpuType | None:
    """The smallest larger GPU (that can run these settings) on which the deployment fits."""
    for other in sorted(other_gpus, key=lambda g: (g.cuda_total_bytes, g.product)):
        if other.cuda_total_bytes <= gpu.cuda_total_bytes:
            continue
        if _fits(model, s, other, policy.budget(other.cuda_total_bytes)):
            return other
    return None


def kv_request_too_large(model: ModelArch, s: Settings, gpus: tuple[GpuType, ...],
                         policy: BudgetPolicy = DEFAULT_POLICY,
                         policies: Mapping[GpuType, BudgetPolicy] | None = None) -> str | None:
    """One line when an explicit KV request is larger than any of `gpus` could hold, empty, at this
    TP: with the largest that fits. None when some GPU holds it (or there is no explicit request)."""
    if s.policy != "vllm" or not explicit_request(s):
        return None
    best: tuple[int, str] | None = None
    for g in sorted(gpus, key=lambda g: (-g.cuda_total_bytes, g.product)):
        budget = (policies or {}).get(g, policy).budget(g.cuda_total_bytes)
        if _fits(model, s, g, budget):
            return None
        tokens = largest_kv_tokens(model, s, g, budget)
        if tokens and (best is None or tokens > best[0]):
            best = (tokens, g.product)
    try:
        r = resolve(model, s, gpus[0]) if gpus else None
    except SpecError:
        return None
    asked = (f"kvCache.memory {fmt_gib(s.kv_bytes)}" if s.kv_bytes is not None else
             f"kvCache.tokens {s.kv_tokens}" if s.kv_tokens is not None else
             f"kvCache.concurrency {s.kv_concurrency} x typicalLength {s.typical_len}")
    where = f"{model.name} at tensorParallelSize {s.tp}"
    if best is None or r is None:
        return f"{asked} is more than any GPU can hold for {where}, and not even one request of the context fits"
    size_ = r.layout.bytes_for_tokens(best[0])
    return (f"{asked} is more than any GPU can hold for {where}; the largest that fits is "
            f"kvCache.tokens {best[0]} ({fmt_gib(size_)} per GPU, on {best[1]})")
