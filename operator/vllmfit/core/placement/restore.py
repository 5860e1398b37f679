"""Admitted deployments read back from their status (the operator's restart path)."""

from __future__ import annotations

import math
from collections.abc import Iterable

from vllmfit.core.memory import Flags, Footprint
from vllmfit.core.placement.decide import _allocation_from_bookings
from vllmfit.core.placement.decision import Booking, Decision
from vllmfit.core.placement.inputs import where
from vllmfit.core.spec.api import VLLMDeploymentStatus

# --- Admitted deployments read back from status ------------------------------------------------


def bookings_from_status(key: str, status: VLLMDeploymentStatus) -> list[Booking]:
    """The ledger entries an operator wrote to status.memory (GpuMemory), as bookings; with the KV
    bytes each holds above its KV request and the spec change that gives them back (`_above_request`)."""
    out = []
    for m in status.memory:
        learned, excess = m.learned_bytes or 0, m.observed_excess_bytes or 0
        parts = m.weights_bytes + m.kv_cache_bytes + m.activation_bytes + m.overhead_bytes + learned + excess
        fp = Footprint(
            m.weights_bytes,
            m.kv_cache_bytes,
            m.activation_bytes,
            m.overhead_bytes,
            0,
            0,
            slack=max(m.total_bytes - parts, 0),
            kv_band_under=(m.kv_cache_range_bytes[1] - m.kv_cache_range_bytes[0]) if m.kv_cache_range_bytes else 0,
            learned=learned,
            observed_excess=excess,
        )
        out.append(Booking(key, m.replica, m.node, m.index, fp, *_above_request(status, m.kv_cache_bytes)))
    return out


def _above_request(status: VLLMDeploymentStatus, kv_bytes: int) -> tuple[int, str]:
    """KV bytes above the request (status.kvCache.requestBytes) and the spec change that gives them
    back; a status without requestBytes: what it holds beyond maxNumSeqs x maxModelLen (`_beyond_caps`)."""
    kv, flags = status.kv_cache, status.flags
    if kv is None or kv.request_bytes is None:  # beyond its caps: back to maxNumSeqs x maxModelLen
        beyond = _beyond_caps(status, kv_bytes)
        if not beyond or flags is None:
            return beyond, ""
        return beyond, "kvCache.grow: false" if kv and kv.granted_by else f"kvCache.concurrency: {flags.max_num_seqs}"
    above = max(kv_bytes - kv.request_bytes, 0)
    if not above:
        return 0, ""
    if "kvCache.grow" in (kv.granted_by or "") or flags is None or not kv.request_tokens:
        return above, "kvCache.grow: false"
    return above, f"kvCache.concurrency: {max(round(kv.request_tokens / flags.max_model_len), 1)}"


def _beyond_caps(status: VLLMDeploymentStatus, kv_bytes: int) -> int:
    """KV bytes beyond what maxNumSeqs requests of maxModelLen hold, for a grant that grew
    (kvCache.grow) or a status written before issue 33 (no grantedBy: the default grant was the room
    left on the GPU), from status.kvCache's concurrency at maxModelLen: kv x (1 - seqs / concurrency)."""
    kv, flags = status.kv_cache, status.flags
    if kv is None or flags is None or (kv.granted_by is not None and "kvCache.grow" not in kv.granted_by):
        return 0
    conc = kv.concurrency_at_max_model_len
    if conc <= flags.max_num_seqs:
        return 0
    return kv_bytes - math.ceil(kv_bytes * flags.max_num_seqs / conc)


def restored_decision(
    key: str, bookings: Iterable[Booking], flags: Flags | None = None, warnings: Iterable[str] = ()
) -> Decision:
    """An admitted Decision rebuilt from bookings (for display: `vllmfit plan` and `status`)."""
    by_rep: dict[int, list[Booking]] = {}
    for b in bookings:
        by_rep.setdefault(b.replica, []).append(b)
    replicas = tuple(_allocation_from_bookings(r, bs, flags) for r, bs in sorted(by_rep.items()))
    on = ", ".join(where(r.node, r.gpus) for r in replicas)
    return Decision(
        key,
        "Admitted",
        replicas,
        flags,
        warnings=tuple(warnings),
        message=f"admitted on {on} (from status)",
        restored=True,
    )
