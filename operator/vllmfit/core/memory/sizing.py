"""Sizing one deployment for one GPU group: fill in vLLM's defaults, size the KV cache by the KV
request, choose --gpu-memory-utilization, and check that it fits the bytes available. Also what
vLLM would log at start-up for the chosen flags."""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from vllmfit.core import defaults, limits
from vllmfit.core.memory.budget import requested_bytes, utilization_for
from vllmfit.core.memory.kv import KvLayout, adr_kv_bytes_per_token, kv_layout
from vllmfit.core.memory.lora import LORA_GRAPH_CASES, lora_activation_bytes, lora_bytes, lora_errors
from vllmfit.core.memory.margin import kv_band
from vllmfit.core.memory.overhead import activation_bytes, batch_defaults, graph_bytes, runtime_overheads
from vllmfit.core.memory.types import (
    DEFAULT_KV_GRANT,
    Flags,
    Footprint,
    KvGrant,
    Settings,
    Sizing,
    SpecError,
    VllmStartup,
    fmt_gib,
)
from vllmfit.core.memory.validation import cpu_offload_errors, gpu_errors, validate
from vllmfit.core.memory.versions import VllmVersion, parse_version
from vllmfit.core.memory.weights import (
    adr_weights_bytes,
    cpu_offloaded_bytes,
    mxfp4_padding_bytes,
    weights_bytes,
)
from vllmfit.core.model.facts import GpuType, ModelArch

# --- Sizing ------------------------------------------------------------------------------------

UNLIMITED = 1 << 62
"""`available` meaning "no limit" (the search's full-size probe): a growing KV cache does not grow."""


@dataclass(frozen=True)
class Resolved:
    """Settings with vLLM's defaults filled in, and the non-KV footprint."""

    settings: Settings
    version: VllmVersion
    layout: KvLayout
    fixed: Footprint  # kv_cache = 0
    batched_tokens: int
    warnings: tuple[str, ...]
    max_num_seqs: int = 1  # --max-num-seqs: the spec's, else vLLM's default for the version and GPU tier


def default_batch(gpu: GpuType, s: Settings, version: VllmVersion) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) as injected: the spec's values, else vLLM's API-server
    defaults for the GPU tier and version (vllm-flags.md section 3) with vLLM's post-processing
    S = min(S, B); a maxNumSeqs above the default B raises B to it (vLLM requires B >= S)."""
    b_default, s_default = batch_defaults(gpu, version)
    batched = s.max_num_batched_tokens or max(b_default, s.max_num_seqs or 0)
    seqs = s.max_num_seqs or min(s_default, batched)
    return batched, seqs


def resolve(model: ModelArch, s: Settings, gpu: GpuType) -> Resolved:
    """Settings with vLLM's defaults filled in and the non-KV footprint (SpecError: why they
    cannot run). Cached: the answer depends only on these three frozen values (their compared
    fields; every one that `_resolve` reads is compared), and one review sizes the same settings
    for several rooms (tests/test_resolve_cache.py checks it against `_resolve`)."""
    hit = _resolved(model, s, gpu)
    if isinstance(hit, str):
        raise SpecError(hit)
    return hit


@functools.lru_cache(maxsize=4096)
def _resolved(model: ModelArch, s: Settings, gpu: GpuType) -> Resolved | str:
    try:
        return _resolve(model, s, gpu)
    except SpecError as e:
        return str(e)


def _resolve(model: ModelArch, s: Settings, gpu: GpuType) -> Resolved:
    errors = validate(model, s)
    gpu_errs, gpu_warns = gpu_errors(model, s, gpu)
    errors.extend(gpu_errs)
    if errors:
        raise SpecError(errors[0])
    version, vwarn = parse_version(s.vllm_version)
    warnings = ([vwarn] if vwarn else []) + gpu_warns
    warnings += model.warnings  # unknown layer types: never silent
    batched, seqs = default_batch(gpu, s, version)
    if s.max_num_batched_tokens is None and model.min_batched_tokens > batched:  # Gemma 4 multimodal
        batched = model.min_batched_tokens
    layout = kv_layout(model, s, version, gpu)
    errors = lora_errors(model, s, version) + cpu_offload_errors(model, s, version, layout.groups)
    if errors:
        raise SpecError(errors[0])
    if s.policy == "adr":
        fixed = Footprint(adr_weights_bytes(model, s), 0, 0, 0, 0, 0)
        return Resolved(s, version, layout, fixed, batched, tuple(warnings), seqs)
    ctx, non_torch = runtime_overheads(s)
    adapters = lora_bytes(model, s, version, batched, seqs)
    offloaded = cpu_offloaded_bytes(model, s)
    graphs = graph_bytes(model, s)
    band_over, band_under = kv_band(model, version, s.enforce_eager)
    if s.lora_max_loras is not None:  # cudagraph_specialize_lora: every graph captured without and with LoRA
        graphs *= LORA_GRAPH_CASES
    fixed = Footprint(
        # vLLM counts the LoRA slots as model weights; MXFP4 experts are padded per GPU arch
        weights=weights_bytes(model, s) + mxfp4_padding_bytes(model, s, gpu) - offloaded + adapters,
        kv_cache=0,
        activation=activation_bytes(model, s, batched, seqs, version,
                                    lora_activation_bytes(model, s, version, batched, seqs)),
        cuda_context=ctx,
        non_torch=non_torch,
        cuda_graphs=graphs,
        margin=band_over,
        kv_band_under=band_under,
        lora=adapters,
        cpu_offloaded=offloaded,
    )
    return Resolved(s, version, layout, fixed, batched, tuple(warnings), seqs)


def _outside_r(fp: Footprint, version: VllmVersion) -> int:
    """Memory a process uses outside its requested budget R."""
    return fp.cuda_context + (0 if version.graphs_in_budget else fp.cuda_graphs)


def _inside_r(fp: Footprint, version: VllmVersion) -> int:
    return fp.total - _outside_r(fp, version) - fp.slack


def kv_request_bytes(model: ModelArch, r: Resolved, length: int) -> int:
    """The KV cache the request asks for, in bytes per GPU (`vllm` policy), for a context of
    `length`: memory as given; tokens as whole blocks in every group (one request of `length` at
    least, once they reach what its pool holds); concurrency as that many
    requests of the typical length (maxModelLen when unset); nothing given: the default request,
    `default_request_seqs` requests of the full context. Plus the null block."""
    s, lay = r.settings, r.layout
    if lay.pooling:
        return 0
    if model.pooling:  # a decoder-based embedder: the KV of one batch
        return lay.bytes_for(min(r.batched_tokens, length), 1, r.batched_tokens, s.pp)
    if s.kv_bytes is not None:
        return s.kv_bytes
    if s.kv_tokens is not None:
        # Tokens in every group; and one request of the context at least, once they are as many as
        # one request's pool holds in every group: a window-bounded group needs fewer blocks than
        # a full one, so the tokens that pool shows, spread evenly, can be a few blocks short of it
        tokens = lay.bytes_for_tokens(s.kv_tokens)
        one = lay.bytes_for(length, 1, r.batched_tokens, s.pp)
        return max(tokens, one) if s.kv_tokens >= lay.pool_tokens(one) else tokens
    if s.kv_concurrency is not None:
        return lay.bytes_for(s.typical_len or length, s.kv_concurrency, r.batched_tokens, s.pp)
    return lay.bytes_for(length, default_request_seqs(s, r.max_num_seqs), r.batched_tokens, s.pp)


def default_request_seqs(s: Settings, seqs: int) -> int:
    """Full-length requests of the KV request of a spec without kvCache: the cluster's number, at
    most the effective --max-num-seqs `seqs` (DEFAULT_KV_FULL_REQUESTS without a cluster rule)."""
    return min(s.kv_default_requests, seqs) if s.kv_default else defaults.DEFAULT_KV_FULL_REQUESTS


def request_only(s: Settings) -> Settings:  # sized at the KV request alone (no growth): what placement needs
    return replace(s, kv_grow=False) if s.kv_grow else s


def default_grant(s: Settings, grant: KvGrant = DEFAULT_KV_GRANT) -> Settings:
    """A spec that asks for no KV cache gets the cluster's rule: its request (what placement needs,
    the floor it keeps) is `grant.requests` requests of the full context, at most maxNumSeqs; its
    limit maxNumSeqs x maxModelLen (vLLM's default maxNumSeqs when unset); it is granted between them
    as placement's room allows (KvGrant: a fair share, or the room left). More KV is asked for with
    spec.kvCache. The `adr` policy and an explicit gpuMemoryUtilization keep their own rules."""
    if s.policy != "vllm" or s.kv_grow or s.gpu_memory_utilization is not None or \
            s.kv_tokens is not None or s.kv_bytes is not None or s.kv_concurrency is not None:
        return s
    return replace(s, kv_grow=True, kv_default=grant.rule, kv_default_requests=grant.requests)


def default_cap_seqs(s: Settings, seqs: int) -> int | None:
    """The requests of the full context a growing default grant holds at most (its limit: `seqs`, the
    effective --max-num-seqs); None: not a growing default grant."""
    return seqs if s.kv_grow and s.kv_default is not None else None


def grant_text(model: ModelArch, s: Settings, r: Resolved, sizing: Sizing) -> str:
    """Which rule granted the KV cache, for output and status: 'maxNumSeqs 4 x maxModelLen 1024'
    (the limit), 'default request: 2 x maxModelLen 8192', 'between the request ... and ...'."""
    f, lay = sizing.flags, r.layout
    if f is None or lay.pooling or model.pooling or not lay.block_bytes:
        return ""
    if s.policy == "adr":
        return "ADR-0002's formulas"
    if s.gpu_memory_utilization is not None:
        return f"what gpuMemoryUtilization {s.gpu_memory_utilization} leaves"
    kv, L = sizing.footprint.kv_cache, f.max_model_len
    if s.kv_default is not None:
        n, limit = default_request_seqs(s, f.max_num_seqs), f"maxNumSeqs {f.max_num_seqs} x maxModelLen {L}"
        if kv >= lay.bytes_for(L, f.max_num_seqs, r.batched_tokens, s.pp):
            return limit
        request = f"default request: {n} x maxModelLen {L}"
        if kv <= kv_request_bytes(model, r, L):
            return request
        how = "a fair share" if s.kv_default == "requests" else "the room left"
        return f"{how}, between the {request} and the limit {limit}"
    if s.kv_tokens is not None:
        asked = f"kvCache.tokens {s.kv_tokens}"
    elif s.kv_bytes is not None:
        asked = f"kvCache.memory {s.kv_bytes} B"
    elif s.kv_concurrency is not None:
        asked = f"kvCache.concurrency {s.kv_concurrency} x {s.typical_len or L} tokens"
    else:
        asked = f"one request of maxModelLen {L}"
    if s.kv_grow and kv > kv_request_bytes(model, r, L):
        asked += ", grown into the room left (kvCache.grow)"
    return asked


def explicit_request(s: Settings) -> bool:
    """A KV request that does not scale with the context (memory, tokens, or a concurrency at a
    given typical length)."""
    return s.kv_bytes is not None or s.kv_tokens is not None or (
        s.kv_concurrency is not None and s.typical_len is not None)


def finish(model: ModelArch, r: Resolved, gpu: GpuType, length: int, kv: int, warnings: list[str],
           seqs: int | None = None) -> Sizing:
    """Footprint and flags for a chosen context and KV reservation (bytes per GPU)."""
    s, version = r.settings, r.version
    seqs = seqs or r.max_num_seqs
    need = _inside_r(r.fixed, version) + kv  # the fixed part books no KV cache (kv_cache 0, slack 0)
    T = gpu.cuda_total_bytes
    inject_kv = False
    if s.gpu_memory_utilization is not None:
        u = s.gpu_memory_utilization
        requested = requested_bytes(T, u, version)
        kv_avail = requested - need + kv
        if kv_avail < kv and s.policy == "vllm":
            warnings.append(
                f"gpuMemoryUtilization {u} leaves {fmt_gib(max(kv_avail, 0))} for KV cache, less than the "
                f"{fmt_gib(kv)} the KV request needs"
            )
        fp = replace(r.fixed, kv_cache=max(kv_avail, 0))
    else:
        u = utilization_for(T, need)
        requested = requested_bytes(T, u, version)
        fp = replace(r.fixed, kv_cache=kv, slack=max(requested - need, 0))
        # --kv-cache-memory-bytes pins the KV cache to the request; the matching u passes vLLM's
        # start-up check (free >= ceil(T x u)) next to its neighbours (docs/memory-model.md)
        inject_kv = s.policy == "vllm" and version.kv_cache_memory_bytes_flag and kv > 0
    lay = r.layout
    kv_tokens, conc, granted, typical = 0, 0.0, 0, None
    if not lay.pooling and lay.block_bytes:
        kv_tokens, conc = lay.tokens(fp.kv_cache, length, r.batched_tokens, s.pp)
        granted = lay.pool_tokens(fp.kv_cache)
        if s.typical_len:
            typical = lay.concurrency(fp.kv_cache, s.typical_len, r.batched_tokens, s.pp)
    per_token = adr_kv_bytes_per_token(model, s) if s.policy == "adr" else lay.bytes_per_token
    if s.policy == "adr":
        granted = fp.kv_cache // per_token if per_token else 0
    flags = Flags(
        max_model_len=length,
        max_num_seqs=seqs,
        gpu_memory_utilization=u,
        kv_cache_memory_bytes=fp.kv_cache if inject_kv else None,
        max_num_batched_tokens=r.batched_tokens if s.policy == "vllm" else None,
    )
    return Sizing(True, fp, flags, per_token, kv_tokens, conc, (), tuple(warnings), granted, s.typical_len, typical)


MIN_BATCHED_TOKENS = 2048
MIN_DEFAULT_SEQS = 256
"""vLLM's smallest API-server defaults (max_num_batched_tokens, max_num_seqs: the < 70 GiB tier);
used when the GPU tier's defaults do not fit (their profile run's activation is larger)."""


def size(model: ModelArch, s: Settings, gpu: GpuType, available: int) -> Sizing:
    """Size one deployment for GPUs of type `gpu` with `available` bytes of budget left on the
    tightest of them (budget minus everything already booked there).

    Rules (documented in docs/memory-model.md):
    - The KV cache is the KV request (`kv_request_bytes`): memory, tokens, or a concurrency at a
      typical length; nothing given: the cluster's default request (`default_grant`). It never
      shrinks; with kv_grow it grows into the room `available` leaves, a default grant only up to
      its limit, maxNumSeqs requests of the full context; placement sizes at the request alone
      (`request_only`) and grants the rest where it is placed.
    - max_model_len unset: the model's full context, capped to what an explicit KV request holds;
      if one request of it does not fit, the largest multiple of the block size that fits, not
      below MIN_AUTO_MAX_MODEL_LEN (warning).
    - max_num_seqs unset: vLLM's own default for the version and GPU tier (a scheduler cap only).
    - u is the smallest value whose ceil(T x u) holds the process's requested part, and the KV
      reservation is injected as --kv-cache-memory-bytes (versions >= 0.10.2).
    - max_num_batched_tokens unset: vLLM's default for the GPU; if that does not fit the budget,
      2048 (warning). A KV request too small for one request at vLLM's defaults is refused as vLLM
      refuses it, not rescued by a smaller batch. The value used is always injected, so the pod
      runs what was predicted.
    """
    sizing = _size(model, s, gpu, available)
    if sizing.fits or s.max_num_batched_tokens is not None or s.policy != "vllm":
        return sizing
    if sizing.footprint.total <= available:
        # Within the budget, but the KV request cannot hold one request at vLLM's defaults: vLLM
        # refuses that at start-up (its sliding / chunked / state pages count the batched tokens),
        # and it never lowers its own defaults; neither does vllmfit (issue 23 item 8).
        return sizing
    default_b, default_s = batch_defaults(gpu, parse_version(s.vllm_version)[0])
    if default_b <= MIN_BATCHED_TOKENS or (s.max_num_seqs or 0) > MIN_BATCHED_TOKENS:
        return sizing
    seqs = s.max_num_seqs or min(default_s, MIN_DEFAULT_SEQS)
    smaller = _size(model, replace(s, max_num_batched_tokens=MIN_BATCHED_TOKENS, max_num_seqs=seqs), gpu, available)
    if not smaller.fits:
        return sizing
    note = f"max_num_batched_tokens lowered from vLLM's default {default_b} to {MIN_BATCHED_TOKENS} to fit"
    if not s.max_num_seqs:
        note += f", max_num_seqs from {default_s} to {seqs}"
    return replace(smaller, warnings=(*smaller.warnings, note))


def _size(model: ModelArch, s: Settings, gpu: GpuType, available: int) -> Sizing:
    r = resolve(model, s, gpu)
    warnings = list(r.warnings)
    rounding = 10**-defaults.UTILIZATION_DECIMALS * gpu.cuda_total_bytes  # u is rounded up
    if s.policy == "adr":
        return _size_adr(model, s, gpu, available, r, warnings, rounding)
    lay = r.layout
    length = s.max_model_len or model.max_model_len
    if s.max_model_len is None and explicit_request(s) and not lay.pooling and not model.pooling:
        # the full context, capped to what one request can take of the KV request
        cap = lay.max_length(kv_request_bytes(model, r, length), 1, r.batched_tokens, model.max_model_len, s.pp)
        if min(defaults.MIN_AUTO_MAX_MODEL_LEN, model.max_model_len) <= cap < length:
            warnings.append(f"maxModelLen {cap}: the longest request the KV request holds (model: {length})")
            length = cap
    sizing = finish(model, r, gpu, length, kv_request_bytes(model, r, length), warnings)
    cap = default_cap_seqs(s, r.max_num_seqs)  # a default grant: at most this many full-length requests
    if sizing.footprint.total <= available and s.kv_grow and (available < UNLIMITED or cap is not None) and \
            s.gpu_memory_utilization is None and lay.block_bytes and not lay.pooling and not model.pooling:
        # the u rounding slack of the first sizing is not part of the room's cost (it is recomputed)
        room = int(available - (sizing.footprint.non_kv - sizing.footprint.slack) - rounding)
        grown = room // lay.block_bytes * lay.block_bytes
        if cap is not None:  # never more than the server can hold: cap x blocks(maxModelLen) + null
            grown = min(grown, lay.bytes_for(length, cap, r.batched_tokens, s.pp))
        if grown > sizing.footprint.kv_cache:
            big = finish(model, r, gpu, length, grown, [*warnings])
            if big.footprint.total <= available:
                return _check(big, available, model, s, r)
    if sizing.footprint.total <= available or model.pooling or s.gpu_memory_utilization is not None:
        return _check(sizing, available, model, s, r)
    # An unset context gives way; the KV request never does.
    if s.max_model_len is None and not explicit_request(s):
        kv_room = int(available - sizing.footprint.non_kv - rounding)
        n = s.kv_concurrency or default_request_seqs(s, r.max_num_seqs)
        fit_len = lay.max_length(kv_room, n, r.batched_tokens, model.max_model_len, s.pp)
        floor = min(defaults.MIN_AUTO_MAX_MODEL_LEN, model.max_model_len)
        if fit_len >= floor:
            note = f"context reduced from {model.max_model_len} to {fit_len} tokens to fit; set maxModelLen to choose"
            sized = finish(model, r, gpu, fit_len, kv_request_bytes(model, r, fit_len), [*warnings, note])
            if sized.footprint.total <= available:
                return _check(sized, available, model, s, r)
    return _check(sizing, available, model, s, r)


def _size_adr(model: ModelArch, s: Settings, gpu: GpuType, available: int, r: Resolved, warnings: list[str],
              rounding: float) -> Sizing:
    """ADR-0002 exactly: max_model_len = floor(budgetLeft / (kvPerTok x numSeq)),
    max_num_seqs = floor(budgetLeft / (kvPerTok x modelLen)), budgetLeft = share - weights."""
    per = adr_kv_bytes_per_token(model, s)
    left = max(int(available - r.fixed.weights - rounding), 0)
    if s.kv_tokens is not None or s.kv_bytes is not None:  # a KV request: kvPerTok x tokens
        kv = per * s.kv_tokens if s.kv_tokens is not None else int(s.kv_bytes or 0)
        length = s.max_model_len or min(model.max_model_len, kv // per // s.block_size * s.block_size or 1)
        seqs = s.max_num_seqs or max(kv // (per * length), 1)
        return _check(finish(model, r, gpu, length, kv, warnings, seqs), available, model, s, r)
    if s.max_model_len and not s.max_num_seqs:
        length, seqs = s.max_model_len, max(left // (per * s.max_model_len), 1)
    elif not s.max_model_len:
        seqs = s.max_num_seqs or defaults.ADR_MAX_NUM_SEQS
        length = min(model.max_model_len, left // (per * seqs) // s.block_size * s.block_size) or model.max_model_len
    else:
        length, seqs = s.max_model_len, s.max_num_seqs or 1
    return _check(finish(model, r, gpu, length, per * length * seqs, warnings, seqs), available, model, s, r)


def _check(sizing: Sizing, available: int, model: ModelArch, s: Settings, r: Resolved) -> Sizing:
    total = sizing.footprint.total
    reasons: list[str] = []
    if total > available >= limits.MAX_GPU_MEMORY_BYTES:  # sized with no limit: never quote that
        reasons.append(f"needs {fmt_gib(total)} per GPU, more than any GPU has")
    elif total > available:
        reasons.append(f"needs {fmt_gib(total)} per GPU, over the {fmt_gib(max(available, 0))} of budget left")
    elif s.policy == "vllm" and not model.pooling and sizing.flags is not None and not r.layout.pooling:
        need_one = r.layout.bytes_for(sizing.flags.max_model_len, 1, r.batched_tokens, s.pp)
        if sizing.footprint.kv_cache < need_one:
            reasons.append(
                f"KV cache {fmt_gib(sizing.footprint.kv_cache)} cannot hold one request of "
                f"{sizing.flags.max_model_len} tokens ({fmt_gib(need_one)}, "
                f"{r.layout.pool_tokens(need_one)} KV tokens)"
            )
    refused = {"fits": False, "reasons": tuple(reasons)} if reasons else {}
    return replace(sizing, grant=grant_text(model, s, r, sizing), **_request_and_limit(model, s, r, sizing),
                   **refused)  # type: ignore[arg-type]


def _request_and_limit(model: ModelArch, s: Settings, r: Resolved, sizing: Sizing) -> dict[str, object]:
    """The KV request and limit in tokens; the bytes granted above the request and the spec change
    that gives them back (refusals of neighbours name them); a warning when a default grant holds
    fewer full-length requests than the maxNumSeqs the spec states."""
    f, lay = sizing.flags, r.layout
    if s.policy != "vllm" or s.gpu_memory_utilization is not None or f is None or not grant_text(model, s, r, sizing):
        return {}
    L, kv = f.max_model_len, sizing.footprint.kv_cache
    request = kv_request_bytes(model, r, L)
    limit = lay.bytes_for(L, f.max_num_seqs, r.batched_tokens, s.pp)
    out: dict[str, object] = {"request_tokens": lay.pool_tokens(request), "limit_tokens": lay.pool_tokens(limit)}
    if s.kv_grow and kv > request:
        out["kv_above_request"] = kv - request
        out["give_back"] = (f"kvCache.concurrency: {default_request_seqs(s, f.max_num_seqs)}"
                            if s.kv_default is not None else "kvCache.grow: false")
    if s.kv_default is not None and s.max_num_seqs is not None and kv < limit and sizing.fits:
        held = lay.concurrency(kv, L, r.batched_tokens, s.pp)
        warn = (f"KV grant holds {held:.1f} requests of maxModelLen {L}, fewer than maxNumSeqs {f.max_num_seqs}: "
                "under that load vLLM queues or preempts the rest; set kvCache to ask for more")
        out["warnings"] = (*sizing.warnings, warn)
    return out


def vllm_startup(model: ModelArch, s: Settings, gpu: GpuType, flags: Flags) -> VllmStartup:
    """vLLM's own start-up numbers for these exact flags (its log lines, per GPU): KV = the
    --kv-cache-memory-bytes when injected, else R - weights - activation - non-torch (- graphs)."""
    vs = replace(s, policy="vllm", max_num_seqs=flags.max_num_seqs,
                 max_num_batched_tokens=flags.max_num_batched_tokens or s.max_num_batched_tokens)
    r = resolve(model, vs, gpu)
    version = r.version
    fp = r.fixed
    R = requested_bytes(gpu.cuda_total_bytes, flags.gpu_memory_utilization, version)
    graphs_inside = fp.cuda_graphs if version.graphs_in_budget else 0
    kv = flags.kv_cache_memory_bytes
    if kv is None:
        kv = R - fp.weights - fp.activation - fp.non_torch - graphs_inside
    blocks = r.layout.num_blocks(kv)
    length = flags.max_model_len
    tokens, conc = r.layout.tokens(kv, length, r.batched_tokens, s.pp) if r.layout.block_bytes else (0, 0.0)
    over, under = kv_band(model, version, s.enforce_eager)
    if flags.kv_cache_memory_bytes:  # pinned: vLLM allocates exactly N, whatever it measures
        over = under = 0
    return VllmStartup(R, fp.weights, fp.activation, fp.non_torch, fp.cuda_graphs, kv, tokens, blocks, conc,
                       max(kv - over, 0), kv + under)
