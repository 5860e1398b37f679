"""A `Record`: what the operator knows about one VLLMDeployment (its latest spec resolved, its
decision, its pods and conditions), and how one is read back from the API at start-up."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vllmfit.core.placement import Request
from vllmfit.core.spec import api
from vllmfit.operator.booking.pods import PodHealth

logger = logging.getLogger("vllmfit.operator.booking.state")


def pruned(value: Any) -> Any:
    """A status without its null fields: a merge patch deletes the keys set to None, and a CRD
    prunes nulls of non-nullable fields (also inside lists). Compare statuses this way."""
    if isinstance(value, dict):
        return {k: pruned(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [pruned(v) for v in value]
    return value


@dataclass(eq=False)
class Record:
    """What the operator knows about one VLLMDeployment."""

    key: str
    body: dict[str, Any]  # the latest object seen (for events and owner references)
    order: tuple[str, str]  # (creationTimestamp, key): earlier first
    generation: int | None = None
    observed_generation: int | None = None
    admitted: bool = False  # holds bookings (or was admitted with 0 replicas)
    outcome: str = "Pending"  # phase when not admitted: Pending, Rejected, Unschedulable
    placement: list[api.ReplicaPlacement] = field(default_factory=list)
    flags: api.Flags | None = None
    kv_cache: api.KvCacheStatus | None = None  # KV granted and the concurrency it buys (replica 0)
    vllm_version: str | None = None
    reasons: list[str] = field(default_factory=list)
    suggestions: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    conditions: list[api.Condition] = field(default_factory=list)
    request: Request | None = None  # the latest spec, resolved
    admitted_request: Request | None = None  # the spec its bookings and children are for
    waiting: bool = False  # the latest spec is Unschedulable: retried when room frees up
    failed: bool = False  # a pod failed in a way it will not recover from
    pods: dict[str, tuple[int, PodHealth]] = field(default_factory=dict)  # pod name -> (replica, health)
    pod_uids: dict[str, str] = field(default_factory=dict)  # pod name -> uid
    observed: list[api.ObservedMemory] = field(default_factory=list)
    children: set[int] = field(default_factory=set)  # replicas whose Deployment was written
    child_where: dict[int, str] = field(default_factory=dict)  # replica -> the placement its Deployment has
    synced: tuple[Any, ...] | None = None  # handlers.children_state when they were last written
    last_event: str = ""  # the last decision message sent as an Event (no repeats on retries)
    written: dict[str, Any] | None = None  # the status last written (or read back)
    mine: bool = False  # this process wrote its status (echoes of it are not news)
    allocation_failure: str = ""  # the scheduler's last DRA allocation failure message for its pods
    going: bool = False  # being deleted: its children are stopped, then its booking released

    @property
    def name(self) -> str:
        return self.key.split("/", 1)[1]

    @property
    def namespace(self) -> str:
        return self.key.split("/", 1)[0]


def key_of(body: Mapping[str, Any]) -> str:
    meta = body.get("metadata") or {}
    return f"{meta.get('namespace') or 'default'}/{meta.get('name')}"


def record_from_object(body: Mapping[str, Any]) -> Record:
    """A record as the API remembers it (start-up): status fields are read back when valid."""
    meta = body.get("metadata") or {}
    key = key_of(body)
    rec = Record(key, dict(body), (str(meta.get("creationTimestamp") or ""), key), meta.get("generation"),
                 written=dict(body.get("status") or {}))
    try:
        st = api.VLLMDeploymentStatus.model_validate(body.get("status") or {})
    except ValueError:
        logger.warning("%s: unreadable status; it will be decided again", key)
        return rec
    rec.observed_generation = st.observed_generation
    rec.conditions = list(st.conditions)
    rec.reasons, rec.suggestions, rec.warnings = list(st.reasons), list(st.suggestions), list(st.warnings)
    rec.vllm_version = st.vllm_version
    if st.phase in ("Admitted", "Running", "Failed"):
        rec.admitted = True
        rec.placement, rec.flags = list(st.placement), st.flags
        rec.kv_cache = st.kv_cache
        rec.children = {p.replica for p in st.placement}
        rec.child_where = {p.replica: f"{p.node}:{','.join(str(g.index) for g in p.gpus)}" for p in st.placement}
        rec.failed = st.phase == "Failed"
    else:
        rec.outcome = st.phase
        rec.waiting = st.phase == "Unschedulable"
    admitted = next((c for c in st.conditions if c.type == "Admitted"), None)
    if rec.admitted and admitted is not None and admitted.status != "True":
        rec.waiting = "Unschedulable" in admitted.reason  # an update that waits for room
    return rec
