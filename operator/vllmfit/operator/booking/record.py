"""A `Record`: what the operator knows about one VLLMDeployment (its latest spec resolved, its
decision, its pods and conditions), and how one is read back from the API at start-up."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vllmfit.core.placement import Booking, Request, bookings_from_status
from vllmfit.core.spec import api
from vllmfit.operator.booking.pods import PodHealth
from vllmfit.operator.rendering import builders

logger = logging.getLogger("vllmfit.operator.booking.state")

OVER_BUDGET = "OverBudget"
"""Condition on the deployments booked on a GPU whose measured bookings exceed its budget
(handlers.nodes.over_budget; the keys whose condition says True: Cache.over_budget)."""


def pruned(value: Any) -> Any:
    """A status without its null fields: a merge patch deletes the keys set to None, and a CRD
    prunes nulls of non-nullable fields (also inside lists). Compare statuses this way."""
    if isinstance(value, dict):
        return {k: pruned(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [pruned(v) for v in value]
    return value


KEPT_METADATA = ("name", "namespace", "uid", "generation", "creationTimestamp", "labels", "annotations")
"""What a record keeps of a VLLMDeployment's metadata: what its Events, its children's owner
references and labels (kopf.adopt), and its spec's reading (core.spec.read) use."""

DIFFBASE_KEY = "last-handled-configuration"
DIFFBASE = f"{api.GROUP}/{DIFFBASE_KEY}"
"""The annotation with Kopf's copy of the last handled spec (its diff base, handlers.startup.configure):
Kopf's, not the record's."""


def kept_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """What a record keeps of an object: its apiVersion, kind, spec and the metadata it reads
    (KEPT_METADATA, Kopf's copy of the spec left out), never its status (the record has its own,
    `written`) nor its managedFields: whole bodies were the largest share of what a settled operator
    held beside its code (tracemalloc, 2,000 deployments)."""
    meta = body.get("metadata") or {}
    kept = {k: meta[k] for k in KEPT_METADATA if k in meta}
    if DIFFBASE in (kept.get("annotations") or {}):
        kept["annotations"] = {k: v for k, v in kept["annotations"].items() if k != DIFFBASE}
    return {k: v for k, v in (("apiVersion", body.get("apiVersion")), ("kind", body.get("kind")),
                              ("metadata", kept), ("spec", body.get("spec"))) if v is not None}


@dataclass(eq=False, slots=True, weakref_slot=True)
class Record:
    """What the operator knows about one VLLMDeployment. `body`: the latest object seen, as
    `kept_body` keeps it (for events, owner references and reading its spec again)."""

    key: str
    _body: dict[str, Any]
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
    groups: set[int] = field(default_factory=set)  # replicas written as a LeaderWorkerSet (across nodes)
    synced: bytes | None = None  # handlers.children_state when they were last written
    last_event: str = ""  # the last decision message sent as an Event (no repeats on retries)
    written: dict[str, Any] | None = None  # the status last written (or read back)
    mine: bool = False  # this process wrote its status (echoes of it are not news)
    allocation_failure: str = ""  # the scheduler's last DRA allocation failure message for its pods
    going: bool = False  # being deleted: its children are stopped, then its booking released
    resumed: bool = False  # read back at start-up, not reconciled since: its next event queues it
    _pruned: tuple[Any, Any, Any] = (None, None, None)  # (written, pruned(written), a status shown equal): `shows`
    _booked: tuple[Any, list[Booking] | None] = (None, None)  # (a status, what it books): `booked_by`

    def __post_init__(self) -> None:
        self._body = kept_body(self._body)

    @property
    def body(self) -> dict[str, Any]:
        return self._body

    @body.setter
    def body(self, value: Mapping[str, Any]) -> None:
        self._body = kept_body(value)

    @property
    def name(self) -> str:
        return self.key.split("/", 1)[1]

    @property
    def namespace(self) -> str:
        return self.key.split("/", 1)[0]


def shows(rec: Record, status: Mapping[str, Any]) -> bool:
    """Whether `status` (as the API stores it) is what the record last wrote or read back:
    pruned(rec.written) == pruned(status), at the cost of one comparison when the API shows what
    it showed before (the resync asks it of every VLLMDeployment each period; issue 32). The
    written status is pruned once (`written` is replaced, never changed in place), and the last
    stored status found equal to it is kept: pruning is needed again only for a status that
    changed (a stored status may keep nulls a merge patch leaves inside lists)."""
    if rec._pruned[0] is not rec.written:
        bare = pruned(rec.written)
        rec._pruned = (rec.written, rec.written if bare == rec.written else bare, None)  # no second copy
    if rec._pruned[1] == status or rec._pruned[2] == status:
        return True
    if rec._pruned[1] == pruned(status):
        rec._pruned = (*rec._pruned[:2], status)
        return True
    return False


def wrote(rec: Record, status: dict[str, Any]) -> None:
    """The status writer wrote `status`, pruned already: the record keeps it as `written`, and
    `shows` compares with it without pruning it again."""
    rec.written = status
    rec._pruned = (status, status, None)


def booked_by(rec: Record, status: Mapping[str, Any]) -> list[Booking] | None:
    """The bookings `status` (as the API stores it, of this record's VLLMDeployment) says, or
    None when it is no valid status. Derived once per status: the record keeps the last status
    it derived from and the result, used again while the API shows the same status (the resync
    asks each period; a status is parsed again only when it changed)."""
    if rec._booked[0] != status:
        try:
            bookings: list[Booking] | None = bookings_from_status(rec.key, api.VLLMDeploymentStatus.model_validate(status))
        except ValueError:
            bookings = None
        rec._booked = (rec.written if rec.written == status else status, bookings)  # the listing is not kept
    return rec._booked[1]


def key_of(body: Mapping[str, Any]) -> str:
    meta = body.get("metadata") or {}
    return f"{meta.get('namespace') or 'default'}/{meta.get('name')}"


def record_from_object(body: Mapping[str, Any]) -> Record:
    """A record as the API remembers it (start-up): status fields are read back when valid."""
    meta = body.get("metadata") or {}
    key = key_of(body)
    rec = Record(key, body, (str(meta.get("creationTimestamp") or ""), key), meta.get("generation"),
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
        rec.groups = {p.replica for p in st.placement if p.workers}
        rec.child_where = {p.replica: builders.placement_text(p) for p in st.placement}
        rec.failed = st.phase == "Failed"
    else:
        rec.outcome = st.phase
        rec.waiting = st.phase == "Unschedulable"
    admitted = next((c for c in st.conditions if c.type == "Admitted"), None)
    if rec.admitted and admitted is not None and admitted.status != "True":
        rec.waiting = "Unschedulable" in admitted.reason  # an update that waits for room
    return rec


class PodOwners(Mapping[str, str]):
    """vllmfit's vLLM pods by UID, read from the records, for what a node's agent reports (its
    processes' pod UIDs): UID -> "namespace/name" (`replica`: "namespace/name#replica", the pods
    whose replica is known). A UID is one of a record's `pod_uids` (its pod events) or, with
    `written`, of the `podUids` of its status as last written or read back.

    Issue 32: a node's report built these maps from every record (three passes over 40,000 at
    fleet size, for each report of each node). `index` (Cache.pod_index: UID -> key) says where
    to look; each look-up checks the record itself, so an entry left behind (a pod gone, a record
    replaced or forgotten) answers nothing. Every UID that enters a record enters the index: a pod
    event (`Cache.pod_seen`), a status read back (`Cache.index_records`); the status writer writes
    only UIDs the records' pods already have."""

    def __init__(self, records: Mapping[str, Record], index: Mapping[str, str], *, written: bool = True,
                 replica: bool = False):
        self.records, self.index, self.written, self.replica = records, index, written, replica

    def __getitem__(self, uid: str) -> str:
        rec = self.records.get(self.index.get(uid, ""))
        if rec is None:
            raise KeyError(uid)
        if self.replica:
            pod = next((p for p, u in rec.pod_uids.items() if u == uid and p in rec.pods), None)
            if pod is None:
                raise KeyError(uid)
            return f"{rec.key}#{rec.pods[pod][0]}"
        if uid in rec.pod_uids.values() or (self.written and uid in ((rec.written or {}).get("podUids") or ())):
            return rec.key
        raise KeyError(uid)

    def __iter__(self) -> Any:
        return (uid for uid in list(self.index) if uid in self)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __bool__(self) -> bool:
        return bool(self.index)  # `pods or {}`: an empty index answers nothing either way
