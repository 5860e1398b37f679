"""Sizing one deployment for one GPU group: fill in vLLM's defaults, choose context, concurrency
and --gpu-memory-utilization, and check that it fits the bytes available. Also what vLLM would
log at start-up for the chosen flags."""

from __future__ import annotations

from dataclasses import dataclass, replace

from vllmfit.core import defaults, limits
from vllmfit.core.memory.budget import requested_bytes, utilization_for
from vllmfit.core.memory.kv import KvLayout, adr_kv_bytes_per_token, kv_layout
from vllmfit.core.memory.margin import kv_band
from vllmfit.core.memory.overhead import activation_bytes, batch_defaults, graph_bytes, runtime_overheads
from vllmfit.core.memory.types import Flags, Footprint, Settings, Sizing, SpecError, VllmStartup, fmt_gib
from vllmfit.core.memory.validation import validate
from vllmfit.core.memory.versions import VllmVersion, parse_version
from vllmfit.core.memory.weights import adr_weights_bytes, weights_bytes
from vllmfit.core.modelarch import GpuType, ModelArch

# --- Sizing ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Resolved:
    """Settings with vLLM's defaults filled in, and the non-KV footprint."""

    settings: Settings
    version: VllmVersion
    layout: KvLayout
    fixed: Footprint  # kv_cache = 0
    batched_tokens: int
    warnings: tuple[str, ...]


def resolve(model: ModelArch, s: Settings, gpu: GpuType) -> Resolved:
    errors = validate(model, s)
    if errors:
        raise SpecError(errors[0])
    version, vwarn = parse_version(s.vllm_version)
    warnings = [vwarn] if vwarn else []
    warnings += model.warnings  # unknown layer types: never silent
    b_default, _ = batch_defaults(gpu, version)
    batched = s.max_num_batched_tokens or b_default
    layout = kv_layout(model, s, version)
    if s.policy == "adr":
        fixed = Footprint(adr_weights_bytes(model, s), 0, 0, 0, 0, 0)
        return Resolved(s, version, layout, fixed, batched, tuple(warnings))
    seqs_for_profile = s.max_num_seqs or defaults.DEFAULT_MAX_NUM_SEQS
    ctx, non_torch = runtime_overheads(s)
    fixed = Footprint(
        weights=weights_bytes(model, s),
        kv_cache=0,
        activation=activation_bytes(model, s, batched, seqs_for_profile, version),
        cuda_context=ctx,
        non_torch=non_torch,
        cuda_graphs=graph_bytes(model, s),
        margin=kv_band(model)[0],
        kv_band_under=kv_band(model)[1],
    )
    return Resolved(s, version, layout, fixed, batched, tuple(warnings))


def _outside_r(fp: Footprint, version: VllmVersion) -> int:
    """Memory a process uses outside its requested budget R."""
    return fp.cuda_context + (0 if version.graphs_in_budget else fp.cuda_graphs)


def _inside_r(fp: Footprint, version: VllmVersion) -> int:
    return fp.total - _outside_r(fp, version) - fp.slack


def kv_for(model: ModelArch, r: Resolved, length: int, seqs: int) -> int:
    if r.settings.policy == "adr":
        return adr_kv_bytes_per_token(model, r.settings) * length * seqs
    if r.layout.pooling:
        return 0
    return r.layout.bytes_for(length, seqs, r.batched_tokens, r.settings.pp)


def finish(model: ModelArch, r: Resolved, gpu: GpuType, length: int, seqs: int, warnings: list[str]) -> Sizing:
    """Footprint and flags for a chosen context and concurrency."""
    s, version = r.settings, r.version
    kv = kv_for(model, r, length, seqs)
    if model.pooling and r.settings.policy == "vllm" and not r.layout.pooling:
        kv = r.layout.bytes_for(min(r.batched_tokens, length), 1, r.batched_tokens, s.pp)
    fp = replace(r.fixed, kv_cache=kv)
    T = gpu.cuda_total_bytes
    if s.gpu_memory_utilization is not None:
        u = s.gpu_memory_utilization
        requested = requested_bytes(T, u, version)
        kv_avail = requested - _inside_r(fp, version) + kv
        if kv_avail < kv and s.policy == "vllm":
            warnings.append(
                f"gpuMemoryUtilization {u} leaves {fmt_gib(max(kv_avail, 0))} for KV cache, less than the "
                f"{fmt_gib(kv)} this context and concurrency need"
            )
        fp = replace(fp, kv_cache=max(kv_avail, 0))
    else:
        need = _inside_r(fp, version)
        u = utilization_for(T, need)
        requested = requested_bytes(T, u, version)
        fp = replace(fp, slack=max(requested - need, 0))
    kv_tokens, conc = (0, 0.0)
    if not r.layout.pooling and r.layout.block_bytes:
        kv_tokens, conc = r.layout.tokens(fp.kv_cache, length, r.batched_tokens, s.pp)
    per_token = adr_kv_bytes_per_token(model, s) if s.policy == "adr" else r.layout.bytes_per_token
    flags = Flags(
        max_model_len=length,
        max_num_seqs=seqs,
        gpu_memory_utilization=u,
        kv_cache_memory_bytes=fp.kv_cache if r.settings.policy == "vllm" else None,
        max_num_batched_tokens=r.batched_tokens if s.policy == "vllm" else None,
    )
    return Sizing(True, fp, flags, per_token, kv_tokens, conc, (), tuple(warnings))


MIN_BATCHED_TOKENS = 2048
"""vLLM's smallest default max_num_batched_tokens; used when the GPU tier's default does not fit."""


def size(model: ModelArch, s: Settings, gpu: GpuType, available: int) -> Sizing:
    """Size one deployment for GPUs of type `gpu` with `available` bytes of budget left on the
    tightest of them (budget minus everything already booked there).

    Rules (documented in docs/memory-model.md):
    - max_num_seqs unset: DEFAULT_MAX_NUM_SEQS concurrent full-context sequences.
    - max_model_len unset: the model's full context; if that does not fit, the largest multiple of
      the block size that fits, not below MIN_AUTO_MAX_MODEL_LEN (warning).
    - The KV reservation is exactly seqs x blocks(max_model_len) (+ the null block); an unset value
      only takes `available`, never memory another deployment holds.
    - u is the smallest value whose ceil(T x u) holds the process's requested part.
    - max_num_batched_tokens unset: vLLM's default for the GPU; if that does not fit, 2048 (warning).
      The value used is always injected, so the pod runs what was predicted.
    """
    sizing = _size(model, s, gpu, available)
    if sizing.fits or s.max_num_batched_tokens is not None or s.policy != "vllm":
        return sizing
    default_b, _ = batch_defaults(gpu, parse_version(s.vllm_version)[0])
    if default_b <= MIN_BATCHED_TOKENS:
        return sizing
    smaller = _size(model, replace(s, max_num_batched_tokens=MIN_BATCHED_TOKENS), gpu, available)
    if not smaller.fits:
        return sizing
    note = f"max_num_batched_tokens lowered from vLLM's default {default_b} to {MIN_BATCHED_TOKENS} to fit"
    return replace(smaller, warnings=(*smaller.warnings, note))


def _size(model: ModelArch, s: Settings, gpu: GpuType, available: int) -> Sizing:
    r = resolve(model, s, gpu)
    warnings = list(r.warnings)
    rounding = 10**-defaults.UTILIZATION_DECIMALS * gpu.cuda_total_bytes  # u is rounded up
    if s.policy == "adr":
        # ADR-0002: max_model_len = floor(budgetLeft / (kvPerTok x numSeq)),
        #           max_num_seqs  = floor(budgetLeft / (kvPerTok x modelLen)), budgetLeft = share - weights
        per = adr_kv_bytes_per_token(model, s)
        left = max(int(available - r.fixed.weights - rounding), 0)
        if s.max_model_len and not s.max_num_seqs:
            length, seqs = s.max_model_len, max(left // (per * s.max_model_len), 1)
        elif not s.max_model_len:
            seqs = s.max_num_seqs or defaults.DEFAULT_MAX_NUM_SEQS
            length = min(model.max_model_len, left // (per * seqs) // s.block_size * s.block_size) or model.max_model_len
        else:
            length, seqs = s.max_model_len, s.max_num_seqs or 1
        return _check(finish(model, r, gpu, length, seqs, warnings), available, model, s, r)
    seqs = s.max_num_seqs or defaults.DEFAULT_MAX_NUM_SEQS
    length = s.max_model_len or model.max_model_len
    sizing = finish(model, r, gpu, length, seqs, warnings)
    if sizing.footprint.total <= available or model.pooling or s.gpu_memory_utilization is not None:
        return _check(sizing, available, model, s, r)
    # Unset values give way, context first, then concurrency; set values never change.
    kv_room = int(available - sizing.footprint.non_kv - rounding)
    if s.max_model_len is None:
        fit_len = r.layout.max_length(kv_room, seqs, r.batched_tokens, model.max_model_len, s.pp)
        floor = min(defaults.MIN_AUTO_MAX_MODEL_LEN, model.max_model_len)
        if fit_len >= floor:
            note = f"context reduced from {model.max_model_len} to {fit_len} tokens to fit {seqs} sequences"
            sized = finish(model, r, gpu, fit_len, seqs, [*warnings, note + "; set maxModelLen/maxNumSeqs to choose"])
            if sized.footprint.total <= available:
                return sized
        length = floor
    if s.max_num_seqs is None:
        fit_seqs = min(r.layout.max_seqs(kv_room, length, r.batched_tokens, s.pp), seqs)
        if fit_seqs >= 1:
            note = f"concurrency reduced from {seqs} to {fit_seqs} sequences of {length} tokens to fit"
            sized = finish(model, r, gpu, length, fit_seqs, [*warnings, note + "; set maxNumSeqs to choose"])
            if sized.footprint.total <= available:
                return sized
    return _check(sizing, available, model, s, r)


def _check(sizing: Sizing, available: int, model: ModelArch, s: Settings, r: Resolved) -> Sizing:
    total = sizing.footprint.total
    reasons: list[str] = []
    if total > available >= limits.MAX_GPU_MEMORY_BYTES:  # sized with no limit: never quote that
        reasons.append(f"needs {fmt_gib(total)} per GPU, more than any GPU has")
    elif total > available:
        reasons.append(f"needs {fmt_gib(total)} per GPU, {fmt_gib(max(available, 0))} free")
    elif s.policy == "vllm" and not model.pooling and sizing.flags is not None:
        need_one = r.layout.bytes_for(sizing.flags.max_model_len, 1, r.batched_tokens, s.pp)
        if sizing.footprint.kv_cache < need_one:
            reasons.append(
                f"KV cache {fmt_gib(sizing.footprint.kv_cache)} cannot hold one request of "
                f"{sizing.flags.max_model_len} tokens ({fmt_gib(need_one)})"
            )
    if reasons:
        return replace(sizing, fits=False, reasons=tuple(reasons))
    return sizing


def vllm_startup(model: ModelArch, s: Settings, gpu: GpuType, u: float, length: int, seqs: int) -> VllmStartup:
    """vLLM's own start-up numbers for these exact flags (its log lines, per GPU)."""
    vs = replace(s, policy="vllm", max_num_seqs=seqs)
    r = resolve(model, vs, gpu)
    version = r.version
    fp = r.fixed
    R = requested_bytes(gpu.cuda_total_bytes, u, version)
    graphs_inside = fp.cuda_graphs if version.graphs_in_budget else 0
    kv = R - fp.weights - fp.activation - fp.non_torch - graphs_inside
    blocks = r.layout.num_blocks(kv)
    tokens, conc = r.layout.tokens(kv, length, r.batched_tokens, s.pp) if r.layout.block_bytes else (0, 0.0)
    over, under = kv_band(model)
    return VllmStartup(R, fp.weights, fp.activation, fp.non_torch, fp.cuda_graphs, kv, tokens, blocks, conc,
                       max(kv - over, 0), kv + under)
