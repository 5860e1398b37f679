"""Bookings that outlive their replica (issue 22): a replica's memory stays booked until the API
shows that no pod which could hold it is left.

A replica stops when its VLLMDeployment is deleted, scaled down, moved or evicted. Its vLLM may
hold the GPU for the pod's whole termination (`terminationGracePeriodSeconds` up to a day, preStop
hooks, seconds for vLLM to free its memory). So when a replica's placement leaves the booking of
its deployment, its bookings become a *drain*: kept in the ledger under a key of their own
(`drain_key`), so that every decision counts them, until the evidence says the pods are gone:
no pod of that deployment, replica and placement (`vllmfit.dev/placement`, which the pod template
carries) is listed any more, or each one that is listed has phase Succeeded or Failed (its
containers terminated). Until then the replica is *draining*.

A *resize in place* (new flags, same GPUs) rolls the same Deployment (Recreate): the old pod
keeps the old footprint until it is gone, while the ledger books the new one. When the new
footprint is smaller on a GPU, the difference is a drain too, of the pods that carry the old
booking (`vllmfit.dev/booked`, the bytes the pod template was written for; `Drain.booked`).

The ledger is charged with what the GPU still had room for (never above its budget, so the
re-planning never evicts a running neighbour for a drain); `blocked` tells which new replicas
must wait for a drain on their own GPUs (break-then-make), the rest start at once
(make-before-break, where the memory allows it).

No I/O here: the handlers list the pods (`handlers.writes.settle_drains`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from vllmfit.core.memory import Footprint
from vllmfit.core.placement import Booking, Ledger
from vllmfit.operator.rendering.builders import (
    ANNOTATION_BOOKED,
    ANNOTATION_PLACEMENT,
    GROUP_JOIN,
    LABEL_DEPLOYMENT,
    LABEL_REPLICA,
    booked_text,
    replica_of,
)

DRAIN = "~draining/"
FINISHED = ("Succeeded", "Failed")


@dataclass
class Drain:
    """The memory of one stopped replica at one placement, until its pods are gone."""

    key: str  # the VLLMDeployment, namespace/name
    replica: int
    where: str  # its placement as the pods carry it ("node:0,1")
    bookings: list[Booking] = field(default_factory=list)  # what its vLLM may hold, in full
    stopped: bool = False  # its Deployment was deleted, moved away or resized: from now on pods can only go
    booked: str = ""  # a resize in place: only the pods written for this booking (ANNOTATION_BOOKED) hold it

    @property
    def name(self) -> str:
        return drain_key(self.key, self.replica, self.where, self.booked)

    @property
    def namespace(self) -> str:
        return self.key.split("/", 1)[0]

    @property
    def deployment(self) -> str:
        return self.key.split("/", 1)[1]


class Drains(dict[str, Drain]):
    """The drains by name, also kept by deployment (`of`) and by GPU (`on`), and the nodes whose
    drains began, grew or ended since the last `take_changed` (issue 32: every step scanned every
    drain, a quadratic cost when hundreds are deleted together). Written by name only (set, del,
    pop, clear); a Drain's bookings and key are never changed in place (`stopped` may be)."""

    def __init__(self, drains: Mapping[str, Drain] | None = None) -> None:
        super().__init__()
        self._of: dict[str, dict[str, None]] = {}  # deployment key -> its drains' names (insertion order)
        self._on: dict[tuple[str, int], dict[str, None]] = {}  # (node, GPU) -> the names of the drains there
        self._changed: set[str] = set()
        for name, d in (drains or {}).items():
            self[name] = d

    def of(self, key: str) -> list[Drain]:
        """The drains of deployment `key`."""
        return [self[n] for n in self._of.get(key, ())]

    def on(self, node: str, index: int) -> list[Drain]:
        """The drains holding memory on this GPU."""
        return [self[n] for n in self._on.get((node, index), ())]

    def take_changed(self) -> set[str]:
        """The nodes whose drains changed since the last call."""
        changed, self._changed = self._changed, set()
        return changed

    def __setitem__(self, name: str, d: Drain) -> None:
        if name in self:
            self._unindex(name, self[name])
        super().__setitem__(name, d)
        self._of.setdefault(d.key, {})[name] = None
        for b in d.bookings:
            self._on.setdefault((b.node, b.index), {})[name] = None
            self._changed.add(b.node)

    def __delitem__(self, name: str) -> None:
        self._unindex(name, self[name])
        super().__delitem__(name)

    def pop(self, name: str, *default: Any) -> Any:  # type: ignore[override]
        if name in self:
            self._unindex(name, self[name])
        return super().pop(name, *default)

    def clear(self) -> None:
        for name, d in list(self.items()):
            self._unindex(name, d)
        super().clear()

    def update(self, *args: Any, **kwargs: Any) -> None:
        for name, d in dict(*args, **kwargs).items():
            self[name] = d

    def setdefault(self, *args: Any) -> Any:
        raise NotImplementedError("Drains are written by name: drains[name] = drain")

    def popitem(self) -> Any:
        raise NotImplementedError("Drains are removed by name: drains.pop(name)")

    def _unindex(self, name: str, d: Drain) -> None:
        _drop(self._of, d.key, name)
        for b in d.bookings:
            _drop(self._on, (b.node, b.index), name)
            self._changed.add(b.node)


def _drop(index: dict[Any, dict[str, None]], at: Any, name: str) -> None:
    names = index[at]
    del names[name]
    if not names:
        del index[at]


def drain_key(key: str, replica: int, where: str, booked: str = "") -> str:
    return f"{DRAIN}{key}/{replica}/{where}" + (f"@{booked}" if booked else "")


def is_drain(key: str) -> bool:
    return key.startswith(DRAIN)


def where_of(bookings: Iterable[Booking]) -> str:
    """The placement text of one replica's bookings (builders.placement_text's format: a replica
    across nodes, each node's, by node name, joined with GROUP_JOIN)."""
    by_node: dict[str, list[int]] = {}
    for b in bookings:
        by_node.setdefault(b.node, []).append(b.index)
    return GROUP_JOIN.join(f"{n}:{','.join(str(i) for i in sorted(ix))}" for n, ix in sorted(by_node.items()))


def pods_of(where: str) -> list[str]:
    """The placement text of each pod of a replica at `where` (one, or a group's)."""
    return where.split(GROUP_JOIN)


def pod_part(where: str, booked: str, pod_where: str) -> str | None:
    """The booked text (builders.booked_text) of the pod at `pod_where` of a replica at `where`
    booked as `booked` (a group's pod carries its own node's part); None: no pod of it."""
    pods, parts = pods_of(where), booked.split(GROUP_JOIN)
    if pod_where not in pods:
        return None
    return parts[pods.index(pod_where)] if len(parts) == len(pods) else booked


def by_replica(bookings: Iterable[Booking]) -> dict[int, list[Booking]]:
    out: dict[int, list[Booking]] = {}
    for b in bookings:
        out.setdefault(b.replica, []).append(b)
    return out


def charge(ledger: Ledger, drain: Drain) -> None:
    """Put the drain into the ledger: on each GPU its full memory, or what the GPU still has room
    for when that is less (the ledger never goes over a budget for a drain)."""
    ledger.release(drain.name)
    out = []
    for b in drain.bookings:
        room = max(0, ledger.headroom_bytes(b.node, b.index)) if ledger.slot(b.node, b.index) else b.footprint.total
        bytes_ = min(b.footprint.total, room)
        out.append(Booking(drain.name, drain.replica, b.node, b.index, Footprint(bytes_, 0, 0, 0, 0, 0)))
    ledger.restore(drain.name, out)


def hold(ledger: Ledger, drains: Drains, key: str, old: Iterable[Booking]) -> list[Drain]:
    """After the bookings of `key` changed (from `old` to what the ledger holds now): every old
    replica whose placement is no longer booked becomes a drain, and so does what a replica booked
    at the same placement shrank by (a resize in place, `_shrunk`). Returns the new drains."""
    booked_now = by_replica(ledger.bookings_of(key))
    now = {r: where_of(bs) for r, bs in booked_now.items()}
    new = []
    for replica, bs in sorted(by_replica(old).items()):
        where = where_of(bs)
        if now.get(replica) == where:
            d = _shrunk(key, replica, where, bs, booked_now[replica])
            if d is None:
                continue
        else:
            d = Drain(key, replica, where, list(bs))
        if d.name in drains:  # the same placement stopped again before its pods were gone: keep the larger
            prev = drains[d.name]
            if sum(b.footprint.total for b in prev.bookings) >= sum(b.footprint.total for b in d.bookings):
                continue
        drains[d.name] = d
        charge(ledger, d)
        new.append(d)
    return new


def _shrunk(key: str, replica: int, where: str, old: list[Booking], new: list[Booking]) -> Drain | None:
    """A resize in place: the drain of what the old footprint has more than the new one on each
    GPU, held by the pods written for the old booking; None when nothing shrank."""
    now = {(b.node, b.index): b.footprint.total for b in new}
    more = [Booking(key, replica, b.node, b.index, Footprint(b.footprint.total - now[(b.node, b.index)], 0, 0, 0, 0, 0))
            for b in sorted(old, key=lambda b: b.index) if b.footprint.total > now.get((b.node, b.index), 0)]
    return Drain(key, replica, where, more, booked=booked_text(old)) if more else None


def revive(ledger: Ledger, drains: Drains, key: str) -> None:
    """`key` is booked again where one of its drains is (a move back, a scale up again before the
    pods were gone, a resize back to the old footprint): that placement is a booking again, not
    a drain."""
    for r, bs in by_replica(ledger.bookings_of(key)).items():
        for name in (drain_key(key, r, where_of(bs)), drain_key(key, r, where_of(bs), booked_text(bs))):
            if name in drains:
                drains.pop(name)
                ledger.release(name)


def carry(ledger: Ledger, drains: Mapping[str, Drain]) -> None:
    """Put every drain into a ledger rebuilt from the API (resync)."""
    for d in sorted(drains.values(), key=lambda d: d.name):
        charge(ledger, d)


def blocked(ledger: Ledger, drains: Drains, key: str, replica: int) -> list[Drain]:
    """The drains that keep a new replica of `key` from starting: on one of its GPUs, the
    bookings plus the drains' full memory are over the budget (break-then-make)."""
    out: list[Drain] = []
    for b in ledger.bookings_of(key, replica):
        slot = ledger.slot(b.node, b.index)
        if slot is None:
            continue
        here = drains.on(b.node, b.index)
        if not here:
            continue
        charged = sum(x.footprint.total for d in here for x in ledger.bookings_of(d.name)
                      if (x.node, x.index) == (b.node, b.index))
        full = sum(x.footprint.total for d in here for x in d.bookings if (x.node, x.index) == (b.node, b.index))
        if ledger.used_bytes(b.node, b.index) - charged + full > slot.budget_bytes:
            out.extend(d for d in here if d not in out)
    return out


def _is_for(meta: Mapping[str, Any], drain: Drain) -> bool:
    """Whether this metadata (of a pod, or of a ReplicaSet's pod template) is the drain's replica at
    the drain's placement (the caller lists one namespace), and for a resize, written for the old
    booking (or for no known one: a pod from before vllmfit wrote ANNOTATION_BOOKED)."""
    labels, annotations = meta.get("labels") or {}, meta.get("annotations") or {}
    part = pod_part(drain.where, drain.booked, str(annotations.get(ANNOTATION_PLACEMENT)))  # a group's pod: its node's
    return (labels.get(LABEL_DEPLOYMENT) == drain.deployment and labels.get(LABEL_REPLICA) == str(drain.replica)
            and part is not None and (not drain.booked or annotations.get(ANNOTATION_BOOKED, part) == part))


def pod_holds(pod: Mapping[str, Any], drain: Drain) -> bool:
    """Whether this pod (as listed by the API) may still hold the drain's memory."""
    return _is_for(pod.get("metadata") or {}, drain) and (pod.get("status") or {}).get("phase") not in FINISHED


def set_holds(rs: Mapping[str, Any], drain: Drain) -> bool:
    """Whether this ReplicaSet (as listed) may still create a pod for the drain: the Deployment is
    deleted first, and its ReplicaSets only later by the garbage collector. One scaled to zero
    creates none (a resized Deployment keeps its old ReplicaSet so, for its revision history)."""
    spec = rs.get("spec") or {}
    return spec.get("replicas", 1) != 0 and _is_for((spec.get("template") or {}).get("metadata") or {}, drain)


def group_holds(lws: Mapping[str, Any], drain: Drain) -> bool:
    """Whether this LeaderWorkerSet (as listed) is the drain's replica across nodes: until it is
    gone (deleted in the foreground: after its StatefulSets and their pods) its group may hold
    the memory, and its StatefulSets may create a pod."""
    meta = lws.get("metadata") or {}
    labels = meta.get("labels") or {}
    return (labels.get(LABEL_DEPLOYMENT) == drain.deployment and labels.get(LABEL_REPLICA) == str(drain.replica)
            and (meta.get("annotations") or {}).get(ANNOTATION_PLACEMENT) == drain.where)


def ended(drains: Drains, namespace: str, deployment: str, pods: Iterable[Mapping[str, Any]],
          sets: Iterable[Mapping[str, Any]] = (), groups: Iterable[Mapping[str, Any]] = ()) -> list[str]:
    """The stopped drains of one deployment that no listed pod holds any more, and for which no
    listed ReplicaSet may create one, nor a listed LeaderWorkerSet (`groups`) still hold its group."""
    pods, sets, groups = list(pods), list(sets), list(groups)
    return sorted(d.name for d in drains.of(f"{namespace}/{deployment}")
                  if d.stopped and not any(pod_holds(p, d) for p in pods) and not any(set_holds(r, d) for r in sets)
                  and not any(group_holds(g, d) for g in groups))


def from_pods(ledger: Ledger, pods: Iterable[Mapping[str, Any]],
              covered: Mapping[tuple[str, int], tuple[str, str]]) -> Drains:
    """At start-up: every pod of vllmfit that is not finished and not covered by a booking
    (`covered`: (key, replica) -> (placement, booked_text) booked) holds memory that nothing
    books: a drain for it, charged with its GPUs' whole room (the pod says where it runs, not
    how much it uses). Its Deployment is gone or elsewhere by then (the sweep deletes what is not
    covered). A pod at the booked placement written for another booking (a resize in place
    whose old pod is still there) is a drain of that booking."""
    out = Drains()
    for pod in pods:
        meta = pod.get("metadata") or {}
        ours = replica_of(meta)
        if ours is None or ":" not in ours[2] or (pod.get("status") or {}).get("phase") in FINISHED:
            continue
        key, replica, where = ours
        booked = ""
        part = pod_part(*covered[(key, replica)], where) if (key, replica) in covered else None
        if part is not None:
            booked = str((meta.get("annotations") or {}).get(ANNOTATION_BOOKED) or "")
            if booked in ("", part):
                continue
        node, _, gpus = where.partition(":")
        try:
            indices = sorted({int(i) for i in gpus.split(",")})
        except ValueError:
            continue
        bookings = []
        for i in indices:
            slot = ledger.slot(node, i)
            room = slot.budget_bytes if slot else 0
            bookings.append(Booking(key, replica, node, i, Footprint(room, 0, 0, 0, 0, 0)))
        d = Drain(key, replica, where, bookings, stopped=True, booked=booked)
        out[d.name] = d
    for d in out.values():
        charge(ledger, d)
    return out


def children_at(children: Iterable[Mapping[str, Any]]) -> dict[tuple[str, int], list[tuple[str, str]]]:
    """vllmfit's Deployments (as listed, JSON): (key, replica) -> [(placement, owner uid)]."""
    out: dict[tuple[str, int], list[tuple[str, str]]] = {}
    for d in children:
        meta = d.get("metadata") or {}
        ours = replica_of(meta)
        if ours is None:
            continue
        key, replica, where = ours
        owner = next((str(o.get("uid")) for o in meta.get("ownerReferences") or [] if o.get("controller")), "")
        out.setdefault((key, replica), []).append((where, owner))
    return out


def status_matches(rec: Any, body: Mapping[str, Any], bookings: Iterable[Booking],
                   running: Mapping[tuple[str, int], list[tuple[str, str]]]) -> bool:
    """Whether a status's bookings describe objects that exist and match: every booked replica
    has its Deployment, owned by this VLLMDeployment (uid), at the booked placement. A status
    alone (written by a tenant, or by an operator that died before writing the Deployment)
    books nothing: the deployment is decided again."""
    uid = str((body.get("metadata") or {}).get("uid") or "")
    reps = by_replica(bookings)
    if not reps:
        return False
    return all(any(w == where_of(bs) and (not uid or o == uid) for w, o in running.get((rec.key, r), []))
               for r, bs in reps.items())
