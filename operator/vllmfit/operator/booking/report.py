"""What the operator reports about a VLLMDeployment: its conditions and its whole `.status`,
computed from the operator's record and the ledger (the headroom of every GPU it uses); the
clock its conditions are stamped with (`now`), the Events it posts (`post_event`), the writes
whose answer it does not read (`unread`) and the reads it takes as plain JSON (`as_json`), for
every room above (handlers, binding)."""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

import kopf

from vllmfit.core import defaults
from vllmfit.core.memory import fmt_gib
from vllmfit.core.placement import Booking, Decision, Ledger
from vllmfit.core.spec import api
from vllmfit.operator.booking.record import Record

logger = logging.getLogger(__name__)


def now() -> str:
    """The time a condition changes, RFC 3339 in seconds (as Kubernetes writes it)."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def post_event(body: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
    """An Event on the object `body` (its message cut to 1,000 characters); logged instead when not
    inside a running operator (handler logic called directly)."""
    try:
        kopf.event(dict(body), type=type_, reason=reason, message=message[:1000])  # type: ignore[arg-type]
    except LookupError:
        logger.info("event %s %s: %s", type_, reason, message)


async def _answer(call: Callable[..., Awaitable[Any]], *args: Any, **kwargs: Any) -> bytes:
    """The body of the answer to a call through the Kubernetes client, never deserialised into
    the client's models; a non-2xx answer raises ApiException, as the client itself would."""
    from kubernetes_asyncio.client import ApiException
    from kubernetes_asyncio.client.rest import RESTResponse

    answer = await call(*args, _preload_content=False, **kwargs)
    data: bytes = await answer.read()  # read to the end: the connection goes back to the pool
    if not 200 <= answer.status <= 299:
        e = ApiException(http_resp=RESTResponse(answer, data))
        e.body = data.decode("utf-8", "replace")
        raise e
    return data


async def unread(call: Callable[..., Awaitable[Any]], *args: Any, **kwargs: Any) -> None:
    """A write through the Kubernetes client whose answer is not used: the answer is read but
    not deserialised into the client's models (half of the client's CPU while 500 deployments
    settle; issue 32). A non-2xx answer raises ApiException, as the client itself would."""
    await _answer(call, *args, **kwargs)


async def as_json(call: Callable[..., Awaitable[Any]], *args: Any, **kwargs: Any) -> Any:
    """A read through the Kubernetes client as the API server's JSON (dicts and lists, as Kopf's
    watches give objects), not the client's models: the resync's listings were deserialised into
    models and serialised back, three quarters of its CPU (issue 32). A non-2xx answer raises
    ApiException."""
    return json.loads(await _answer(call, *args, **kwargs))


def placement_from(decision: Decision, ledger: Ledger) -> list[api.ReplicaPlacement]:
    """Each replica's node and GPUs (a replica across nodes: its leader's, and its workers')."""

    def refs(node: str, indices: Iterable[int]) -> list[api.GpuRef]:
        slots = [(i, ledger.slot(node, i)) for i in indices]
        return [api.GpuRef(index=i, uuid=s.uuid if s else None, product=s.gpu.product if s else "") for i, s in slots]

    return [api.ReplicaPlacement(replica=r.replica, node=r.node, gpus=refs(r.node, r.gpus),
                                 workers=[api.PodPlacement(node=m.node, gpus=refs(m.node, m.gpus)) for m in r.workers])
            for r in decision.replicas]


def kv_status(d: Decision) -> api.KvCacheStatus | None:
    """The KV cache replica 0 was granted: bytes per GPU, tokens, its request and limit, and the
    concurrency they buy at maxModelLen and at the typical length asked for."""
    if not d.replicas:
        return None
    z = d.replicas[0].sizing
    return api.KvCacheStatus(
        bytes=z.footprint.kv_cache, tokens=z.granted_tokens, granted_by=z.grant or None,
        request_tokens=z.request_tokens or None, limit_tokens=z.limit_tokens or None,
        request_bytes=z.footprint.kv_cache - z.kv_above_request if z.request_tokens else None,
        concurrency_at_max_model_len=round(z.max_concurrency, 2), typical_length=z.typical_len,
        concurrency_at_typical_length=None if z.concurrency_typical is None else round(z.concurrency_typical, 2))


def memory_entries(bookings: Iterable[Booking]) -> list[api.GpuMemory]:
    return [api.GpuMemory(node=b.node, index=b.index, replica=b.replica, weights_bytes=b.footprint.weights,
                          kv_cache_bytes=b.footprint.kv_cache, activation_bytes=b.footprint.activation,
                          overhead_bytes=b.footprint.overhead, total_bytes=b.footprint.total,
                          learned_bytes=b.footprint.learned or None,
                          observed_excess_bytes=b.footprint.observed_excess or None,
                          kv_cache_range_bytes=list(b.footprint.kv_range)
                          if b.footprint.margin or b.footprint.kv_band_under else None)
            for b in sorted(bookings, key=lambda b: (b.replica, b.node, b.index))]


def gpu_headroom(ledger: Ledger, key: str) -> list[api.GpuHeadroom]:
    gpus = sorted({(b.node, b.index) for b in ledger.bookings_of(key)})
    out = []
    for node, i in gpus:
        slot = ledger.slot(node, i)
        budget = slot.budget_bytes if slot else 0
        out.append(api.GpuHeadroom(node=node, index=i, budget_bytes=budget, used_bytes=ledger.used_bytes(node, i),
                                   headroom_bytes=ledger.headroom_bytes(node, i)))
    return out


def headroom_text(gpus: Sequence[api.GpuHeadroom]) -> str | None:
    return fmt_gib(min(g.headroom_bytes for g in gpus)) if gpus else None


def set_condition(conditions: Sequence[api.Condition], type_: str, status: str, reason: str, message: str,
                  now: str, generation: int | None = None) -> list[api.Condition]:
    """Replace the condition of `type_`; lastTransitionTime changes only when status does."""
    old = next((c for c in conditions if c.type == type_), None)
    since = old.last_transition_time if old is not None and old.status == status else now
    new = api.Condition(type=type_, status=status, reason=reason, message=message,  # type: ignore[arg-type]
                        last_transition_time=since, observed_generation=generation)
    out = [c for c in conditions if c.type != type_] + [new]
    order = {"Admitted": 0, "Placed": 1, "Ready": 2, "MemoryDrift": 3}
    return sorted(out, key=lambda c: order.get(c.type, 9))


def phase(rec: Record) -> str:
    if not rec.admitted:
        return rec.outcome
    ready = next((c for c in rec.conditions if c.type == "Ready"), None)
    if rec.failed:
        return "Failed"
    if ready is not None and ready.status == "True":
        return "Running"
    return "Admitted"


def selector(name: str) -> str:
    """The label selector of a VLLMDeployment's vLLM pods, as the scale subresource reports it."""
    return f"{defaults.MANAGED_BY_LABEL}={defaults.MANAGED_BY},{defaults.DEPLOYMENT_LABEL}={name}"


def desired_replicas(rec: Record) -> int:
    """spec.replicas of the latest object (1, the schema default, when absent)."""
    value = (rec.body.get("spec") or {}).get("replicas", 1)
    return value if isinstance(value, int) and not isinstance(value, bool) else 1


def ready_replicas(rec: Record, placed: Sequence[api.ReplicaPlacement]) -> int:
    """Placed replicas with a ready pod."""
    want = {p.replica for p in placed}
    return len({r for r, h in rec.pods.values() if h.ready and r in want})


def status(rec: Record, ledger: Ledger) -> dict[str, Any]:
    """The whole status of a VLLMDeployment, as a merge patch (None removes a field)."""
    gpus = gpu_headroom(ledger, rec.key)
    placement = rec.placement if rec.admitted else []
    nodes = list(dict.fromkeys(q.node for p in placement for q in p.pods()))  # a group's: its leader's, its workers'

    st = api.VLLMDeploymentStatus(
        phase=phase(rec),  # type: ignore[arg-type]
        observed_generation=rec.observed_generation,
        replicas=len(placement),
        ready_replicas=(ready := ready_replicas(rec, placement)),
        ready=f"{ready}/{desired_replicas(rec)}",
        selector=selector(rec.name),
        vllm_version=rec.vllm_version,
        node=",".join(nodes) or None,
        gpu_list=";".join("+".join(",".join(str(g.index) for g in q.gpus) for q in p.pods()) for p in placement) or None,
        placement=placement,
        flags=rec.flags if rec.admitted else None,
        kv_cache=rec.kv_cache if rec.admitted else None,
        memory=memory_entries(ledger.bookings_of(rec.key)),
        gpus=gpus,
        headroom=headroom_text(gpus),
        observed=rec.observed,
        pod_uids=sorted(set(rec.pod_uids.values())),
        reasons=rec.reasons,
        suggestions=rec.suggestions,
        warnings=rec.warnings,
        conditions=rec.conditions,
    )
    return st.model_dump(by_alias=True, mode="json")
