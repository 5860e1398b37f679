"""Changes that make a deployment fit a GPU, each verified by sizing again, ranked as a user would
try them: the utilization that fits (for an explicit one), fewer KV tokens or a shorter context, an
fp8 KV cache, the budget policy that admits it (where only the policy refuses it), quantized
weights the GPU can run, more TP (within one server), two changes together when neither fits
alone; then (estimate) a larger GPU, of the same class and generation first."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from vllmfit.core import defaults
from vllmfit.core.memory.budget import DEFAULT_POLICY, POLICIES, BudgetPolicy, utilization_within
from vllmfit.core.memory.learned import size  # with a learned over-run of the same configuration on top
from vllmfit.core.memory.sizing import explicit_request, kv_request_bytes, resolve
from vllmfit.core.memory.types import Settings, Sizing, SpecError, fmt_gib
from vllmfit.core.memory.validation import can_run
from vllmfit.core.model.facts import GpuType, ModelArch, check_tp

SPEC_NAMES = {
    "max_model_len": "maxModelLen",
    "kv_tokens": "kvCache",
    "kv_concurrency": "kvCache.concurrency",
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
                         for k, v in self.changes) + self.note

    def settings(self, s: Settings) -> Settings:
        extra: dict[str, object] = {}
        if any(k == "kv_tokens" for k, _ in self.changes):
            extra = {"kv_bytes": None, "kv_concurrency": None, "kv_grow": False}
        elif any(k == "kv_concurrency" for k, _ in self.changes):  # fewer requests of the same length
            extra = {"kv_bytes": None, "kv_tokens": None, "kv_grow": False}
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


MAX_FIX_TP = 8
"""The largest tensorParallelSize `estimate` suggests: the most GPUs of one type in one server
(HGX/DGX boards carry 8); placement caps it at the most GPUs of one type any node has."""


def fixes(model: ModelArch, s: Settings, gpu: GpuType, other_gpus: tuple[GpuType, ...] = (),
          available: int | None = None, policy: BudgetPolicy = DEFAULT_POLICY,
          max_tp: int = MAX_FIX_TP) -> list[Fix]:
    """Concrete changes that make the deployment fit `available` bytes of a `gpu`, each verified by
    sizing again, in the order a user would try them: a smaller context or KV request, an fp8 KV
    cache, the budget policy (where only the policy refuses it), quantized weights, more TP (never
    beyond `max_tp`), then two changes together. Never one the GPU cannot run (compute capability).
    A fix under which an unset context is reduced to fit says so."""
    T = gpu.cuda_total_bytes
    avail = policy.budget(T) if available is None else available
    used = policy.budget(T) - avail  # booked by neighbours
    out: list[Fix] = []

    def sized(changes: dict[str, object]) -> Sizing | None:
        return _fits(model, Fix(tuple(changes.items())).settings(s), gpu, avail)

    def ok(changes: dict[str, object]) -> bool:
        return sized(changes) is not None

    def numeric(base: dict[str, object]) -> list[dict[str, object]]:
        """With `base` applied: the largest context, or the largest KV tokens, that fits."""
        found: list[dict[str, object]] = []
        t = Fix(tuple(base.items())).settings(s)
        if t.kv_concurrency and t.kv_tokens is None and t.kv_bytes is None and t.kv_concurrency > 1:
            fewer = _largest_concurrency(model, t, gpu, avail)  # fewer sequences first: what users try
            if fewer:
                found.append({**base, "kv_concurrency": fewer})
        if explicit_request(t) or t.kv_concurrency:
            tokens = largest_kv_tokens(model, t, gpu, avail)
            current = _granted(model, t, gpu)
            if tokens and (current is None or tokens < current):
                found.append({**base, "kv_tokens": tokens})
        length = _largest_context(model, t, gpu, avail) if s.policy == "vllm" else None
        if length and (s.max_model_len or not explicit_request(t)):
            found.append({**base, "max_model_len": length})
        return found

    def add(changes: dict[str, object]) -> None:
        fx = Fix(tuple(changes.items()), note=context_note(model, s, sized(changes), changes))
        if all(fx.changes != o.changes for o in out):
            out.append(fx)

    # 1. the explicit --gpu-memory-utilization: the one that fits
    if s.gpu_memory_utilization is not None:
        try:
            r = resolve(model, s, gpu)
        except SpecError:
            r = None
        if r is not None:
            outside = r.fixed.cuda_context + (0 if r.version.graphs_in_budget else r.fixed.cuda_graphs)
            u_fit = utilization_within(T, avail - outside)
            if 0 < u_fit < s.gpu_memory_utilization and ok({"gpu_memory_utilization": u_fit}):
                add({"gpu_memory_utilization": u_fit})
    # 2. single changes, in the order a user tries them
    singles: list[dict[str, object]] = []
    if not s.kv_cache_dtype.startswith("fp8"):
        singles.append({"kv_cache_dtype": "fp8"})
    if not s.quantization and not model.quant:
        singles.append({"quantization": "fp8"})
    tps = [tp for tp in (2, 4, 8, 16) if s.tp < tp <= max_tp and not check_tp(model, tp)]
    singles = [c for c in singles if can_run(model, Fix(tuple(c.items())).settings(s), gpu)]
    for c in numeric({}):
        if ok(c):
            add(c)
    granted = _granted(model, s, gpu) if explicit_request(s) and s.max_model_len else None
    if granted is not None and s.max_model_len and granted < s.max_model_len:  # less than one request
        for c in ({"kv_tokens": s.max_model_len},
                  {"max_model_len": granted // s.block_size * s.block_size}):
            if min(c.values()) >= min(defaults.MIN_AUTO_MAX_MODEL_LEN, model.max_model_len) and ok(c):  # type: ignore[type-var]
                add(c)
    kv_dtype = [c for c in singles if "kv_cache_dtype" in c]
    quant = [c for c in singles if "quantization" in c]
    for c in kv_dtype:
        if ok(c):
            add(c)
    policy_fix = _policy_fix(model, s, gpu, policy, used)
    if policy_fix is not None:
        out.append(policy_fix)
    for c in quant:
        if ok(c):
            add(c)
    tp_fix = next((tp for tp in tps if ok({"tp": tp})), None)
    if tp_fix:
        add({"tp": tp_fix})
    # 3. two changes together, where neither alone fits
    lone = [c for c in singles if not ok(c)]
    alone = {kv for o in out for kv in o.changes if len(o.changes) == 1}
    for c in lone:
        for p in numeric(c):
            if ok(p) and not any(kv in alone for kv in p.items() if kv[0] not in c):  # not when the number alone fits
                add(p)
    if len(lone) == 2 and ok({**lone[0], **lone[1]}):
        add({**lone[0], **lone[1]})
    if "quantization" in str(lone):
        tp_fp8 = next((tp for tp in tps if tp < (tp_fix or 99) and ok({"tp": tp, "quantization": "fp8"})), None)
        if tp_fp8:  # fewer GPUs than TP alone needs
            add({"tp": tp_fp8, "quantization": "fp8"})
    return out


def _largest_concurrency(model: ModelArch, s: Settings, gpu: GpuType, avail: int) -> int | None:
    """The largest kvCache.concurrency below the spec's that fits (None: not even 1)."""
    def ok(c: int) -> bool:
        return _fits(model, replace(s, kv_concurrency=c, kv_grow=False), gpu, avail) is not None

    lo, hi = 0, (s.kv_concurrency or 1) - 1  # lo fits (0: none), hi + 1 does not
    if hi < 1 or not ok(1):
        return None
    lo = 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
    return lo


def context_note(model: ModelArch, s: Settings, sz: Sizing | None, changes: dict[str, object]) -> str:
    """' (context reduced to N tokens)' when the fix fits only with an unset context reduced."""
    if sz is None or sz.flags is None or s.max_model_len is not None or "max_model_len" in changes:
        return ""
    length = sz.flags.max_model_len
    return f" (context reduced to {length} tokens from {model.max_model_len})" if length < model.max_model_len else ""


MAX_SUGGESTED_UTILIZATION = 0.95
"""The highest budget utilization a fix suggests: beyond it, too little of the GPU is left for what
no model sees (fragmentation, a second CUDA context, a monitoring process)."""


def _policy_fix(model: ModelArch, s: Settings, gpu: GpuType, policy: BudgetPolicy, used: int) -> Fix | None:
    """Where only the budget policy refuses the spec as it is: the named policy that admits it
    (`counted` under `adr-0002`), else the budget utilization that does (at most
    MAX_SUGGESTED_UTILIZATION), each checked by sizing again with the budget it gives."""
    T = gpu.cuda_total_bytes
    for name, named in POLICIES.items():
        if named.budget(T) > policy.budget(T) and _fits(model, s, gpu, named.budget(T) - used):
            return Fix(policy=replace(named, source=policy.source), note=(
                f"budget policy {name} ({named.formula}; now {policy.rule}: "
                f"{fmt_gib(policy.held_back(T))} of this GPU held back)"))
    try:
        need = size(model, s, gpu, policy.budget(T) - used).footprint.total
    except SpecError:
        return None
    want = policy.utilization_for(T, need + used)
    if want <= policy.utilization or want > MAX_SUGGESTED_UTILIZATION:
        return None
    new = policy.with_utilization(want)
    if not _fits(model, s, gpu, new.budget(T) - used):
        return None
    return Fix(policy=new, note=(f"budget policy utilization {want:g} (now {policy.rule}: "
                                 f"{fmt_gib(policy.held_back(T))} of this GPU held back)"))


def _granted(model: ModelArch, s: Settings, gpu: GpuType) -> int | None:
    try:
        return size(model, s, gpu, 1 << 62).granted_tokens
    except SpecError:
        return None


def _gpu_class(g: GpuType) -> str:
    """consumer (GeForce), workstation (RTX / Quadro boards), or data center."""
    if "GeForce" in g.product:
        return "consumer"
    return "workstation" if "RTX" in g.product else "datacenter"


def larger_gpu(model: ModelArch, s: Settings, gpu: GpuType, other_gpus: tuple[GpuType, ...],
               policy: BudgetPolicy = DEFAULT_POLICY) -> GpuType | None:
    """A larger GPU (that can run these settings) on which the deployment fits: the same class
    (data center, workstation, consumer) before another, a generation at least as new (compute
    capability) before an older one, then the smallest (the cheapest of its kind)."""
    cc = gpu.compute_capability or (0, 0)

    def key(g: GpuType) -> tuple[object, ...]:
        return (_gpu_class(g) != _gpu_class(gpu), (g.compute_capability or (0, 0)) < cc, g.cuda_total_bytes,
                g.product)

    for other in sorted(other_gpus, key=key):
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
    try:
        r0 = resolve(model, s, gpus[0]) if gpus else None
    except SpecError:
        return None
    if r0 is not None and s.max_model_len and not model.pooling and not r0.layout.pooling and \
            kv_request_bytes(model, r0, s.max_model_len) < r0.layout.bytes_for(s.max_model_len, 1, r0.batched_tokens, s.pp):
        return None  # less than one request of the context: not too large (the sizing says why, with fixes)
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


# --- One node: vllmfit places a deployment within one node ---------------------------------------


def one_node_reason(s: Settings, most: int) -> str:
    """Why a spec that needs more GPUs than one node has is refused (estimate and plan say the same)."""
    return (f"needs {s.gpus} GPUs (tensorParallelSize {s.tp} x pipelineParallelSize {s.pp}); nodes have "
            f"at most {most} GPUs of one type, and a replica across nodes keeps each tensor-parallel group of "
            f"{s.tp} GPUs on one node")


def one_node_fixes(model: ModelArch, s: Settings, gpu: GpuType, most: int, other_gpus: tuple[GpuType, ...],
                   policy: BudgetPolicy = DEFAULT_POLICY) -> list[str]:
    """For a spec that needs more than `most` GPUs (tp x pp > most): the changes that fit it on
    `most` GPUs of one node, each checked by sizing on empty GPUs, in the order a user tries them:
    fewer GPUs by pipeline parallelism on this GPU, the same with fp8 weights, then a larger GPU
    type (a larger node type) with that pipeline parallelism. Spec words ("pipelineParallelSize: 1")."""
    if s.tp > most:
        return []
    pp = most // s.tp
    fewer = replace(s, pp=pp)
    out: list[str] = []
    if _fits(model, fewer, gpu, policy.budget(gpu.cuda_total_bytes)):
        out.append(f"pipelineParallelSize: {pp}")
    fp8 = replace(fewer, quantization="fp8")
    if (model.quant is None or model.quant.method != "fp8") and s.quantization != "fp8" and \
            can_run(model, fp8, gpu) and _fits(model, fp8, gpu, policy.budget(gpu.cuda_total_bytes)):
        out.append(f"quantization: fp8, pipelineParallelSize: {pp}")
    other = larger_gpu(model, fewer, gpu, other_gpus, policy)
    if other is not None:
        out.append(f"a larger GPU: {other.product}, pipelineParallelSize: {pp}")
    return out
