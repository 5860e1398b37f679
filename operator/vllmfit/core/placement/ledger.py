"""The per-GPU ledger: what is booked where, kept under budget by construction (`book` raises
rather than overfill), with the indices the search uses (headroom per GPU group)."""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from vllmfit.core.memory import DEFAULT_KV_GRANT, Flags, Footprint, KvGrant, Sizing
from vllmfit.core.model.facts import GpuType
from vllmfit.core.placement import affinity
from vllmfit.core.placement.inputs import DecisionPhase, GpuKey, GpuSlot, NodeInfo

# --- The ledger --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Booking:
    """One replica of one deployment on one GPU."""

    deployment: str
    replica: int
    node: str
    index: int
    footprint: Footprint
    kv_beyond: int = 0  # KV bytes beyond maxNumSeqs x maxModelLen (kvCache.grow, a grant from before issue 33)


@dataclass(frozen=True)
class ReplicaAllocation:
    """One replica: a TP x PP group on one node. `sizing.flags` are this replica's vLLM flags
    (maxModelLen and maxNumSeqs equal across replicas; u may differ by GPU product)."""

    replica: int
    node: str
    gpus: tuple[int, ...]
    sizing: Sizing
    footprints: tuple[Footprint, ...] = ()  # per GPU, aligned with gpus; empty = sizing.footprint on each

    def footprint_on(self, position: int) -> Footprint:
        return self.footprints[position] if self.footprints else self.sizing.footprint


@dataclass(frozen=True)
class Decision:
    """The outcome of `decide`, as data."""

    key: str
    phase: DecisionPhase
    replicas: tuple[ReplicaAllocation, ...] = ()
    flags: Flags | None = None  # replica 0's
    reasons: tuple[str, ...] = ()
    suggestions: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    moved: bool = False  # placed elsewhere than where it was pinned
    message: str = ""  # one line: what the webhook denies with and the Event says
    restored: bool = False  # rebuilt from status.memory (kept where it is, never re-decided)

    @property
    def admitted(self) -> bool:
        return self.phase == "Admitted"

    def bookings(self) -> list[Booking]:
        return [
            Booking(self.key, r.replica, r.node, i, r.footprint_on(p), r.sizing.kv_beyond_caps)
            for r in self.replicas
            for p, i in enumerate(r.gpus)
        ]


@dataclass(frozen=True)
class NodeSet:
    """Some nodes of a ledger (a nodeSelector's matches, a pinned node), with their GPU types."""

    names: tuple[str, ...]
    members: frozenset[str]
    types: tuple[GpuType, ...]


class OverBudget(ValueError):
    """`Ledger.book` of a decision that no longer fits (the ledger changed since `decide`)."""


class Ledger:
    """Bookings per GPU, with indices sorted by headroom so a search never scans every GPU.

    Mutable; the operator serializes access to its one instance. Indices:
    - per GPU type: [(headroom, node, index)] sorted, for single-GPU placements;
    - per (GPU type, n), built on first use: [(key, node)] sorted, where key is the n-th largest
      headroom among the node's (non-MIG) GPUs of that type: the largest need an n-GPU group
      there can take.
    """

    def __init__(self, nodes: Iterable[NodeInfo] = (), kv_grant: KvGrant = DEFAULT_KV_GRANT):
        self.kv_grant = kv_grant  # the cluster's default KV grant (a spec without kvCache or maxNumSeqs)
        self.nodes: dict[str, NodeInfo] = {}
        self._slots: dict[GpuKey, GpuSlot] = {}
        self._on_gpu: dict[str, dict[int, dict[tuple[str, int], Booking]]] = {}  # node -> GPU -> bookings
        self._used: dict[GpuKey, int] = {}
        self._by_deployment: dict[str, list[Booking]] = {}
        self._beyond: set[str] = set()  # deployments with a booking that holds KV beyond its caps
        self._head: dict[GpuKey, int] = {}  # headroom as currently indexed
        self._free: dict[GpuType, list[tuple[int, str, int]]] = {}
        self._by_type: dict[str, dict[GpuType, list[int]]] = {}  # node -> type -> indices (non-MIG)
        self._groups: dict[tuple[GpuType, int], list[tuple[int, str]]] = {}
        self._group_key: dict[tuple[GpuType, int, str], int] = {}
        self._selected: dict[tuple[object, ...], NodeSet] = {}  # (nodeSelector, affinity) -> matches
        for n in nodes:
            self.set_node(n)

    # nodes
    def set_node(self, node: NodeInfo) -> list[str]:
        """Add or update a node. Returns the deployments booked there that no longer fit: on a GPU
        now over budget, or on a GPU that disappeared (pass them to `replan`)."""
        self._unindex_node(node.name)
        self._selected.clear()
        self.nodes[node.name] = node
        types: dict[GpuType, list[int]] = {}
        for s in node.gpus:
            key = (s.node, s.index)
            self._slots[key] = s
            self._on_gpu.setdefault(s.node, {}).setdefault(s.index, {})
            self._used.setdefault(key, 0)
            self._index(key)
            if not s.mig:
                types.setdefault(s.gpu, []).append(s.index)
        self._by_type[node.name] = {t: sorted(ix) for t, ix in types.items()}
        for t in types:
            self._refresh_groups(node.name, t)
        return self.affected(node.name)

    def remove_node(self, name: str) -> list[str]:
        """Forget a node. Returns the deployments that had bookings on it (they must move; their
        bookings stay until released or re-placed by `replan`)."""
        self._unindex_node(name)
        self._selected.clear()
        self.nodes.pop(name, None)
        return self.affected(name)

    def _unindex_node(self, name: str) -> None:
        old = self.nodes.get(name)
        for s in old.gpus if old else ():
            self._unindex((s.node, s.index))
            self._slots.pop((s.node, s.index), None)
        for t in self._by_type.pop(name, {}):
            for gt, n in list(self._groups):
                if gt == t:
                    self._set_group_key(t, n, name, None)

    def slots(self) -> list[GpuSlot]:
        return [self._slots[k] for k in sorted(self._slots)]

    def slot(self, node: str, index: int) -> GpuSlot | None:
        return self._slots.get((node, index))

    def gpu_types(self) -> list[GpuType]:
        return sorted(self._free, key=lambda t: t.product)

    def node_set(self, names: Iterable[str]) -> NodeSet:
        names = tuple(sorted(n for n in set(names) if n in self.nodes))
        types = {s.gpu for n in names for s in self.nodes[n].gpus}
        return NodeSet(names, frozenset(names), tuple(sorted(types, key=lambda t: t.product)))

    def matching(
        self, selector: Mapping[str, str] | None, terms: tuple[affinity.Term, ...] | None = None
    ) -> NodeSet | None:
        """The nodes whose labels match a nodeSelector and the required node affinity `terms`;
        None when there is neither (every node). Cached until a node changes."""
        if not selector and terms is None:
            return None
        key = (tuple(sorted((selector or {}).items())), terms)
        if key not in self._selected:
            self._selected[key] = self.node_set(
                n
                for n, nd in self.nodes.items()
                if all(nd.labels.get(k) == v for k, v in key[0]) and affinity.terms_match(n, nd.labels, terms)
            )
        return self._selected[key]

    # accounting
    def used_bytes(self, node: str, index: int) -> int:
        """Everything booked on the GPU plus foreign use."""
        slot = self._slots.get((node, index))
        return self._used.get((node, index), 0) + (slot.foreign_bytes if slot else 0)

    def headroom_bytes(self, node: str, index: int) -> int:
        slot = self._slots.get((node, index))
        return (slot.budget_bytes - self.used_bytes(node, index)) if slot else 0

    def bookings_on(self, node: str, index: int) -> list[Booking]:
        return sorted(
            self._on_gpu.get(node, {}).get(index, {}).values(), key=lambda b: (b.deployment, b.replica)
        )

    def bookings_of(self, key: str, replica: int | None = None) -> list[Booking]:
        """The bookings of deployment `key`, or of one of its replicas."""
        return [b for b in self._by_deployment.get(key, []) if replica is None or b.replica == replica]

    def deployments(self) -> list[str]:
        return sorted(self._by_deployment)

    def overfull_deployments(self, node: str) -> list[str]:
        out: set[str] = set()
        for i, book in self._on_gpu.get(node, {}).items():
            if book and self.headroom_bytes(node, i) < 0:
                out.update(b.deployment for b in book.values())
        return sorted(out)

    def affected(self, node: str) -> list[str]:
        """Deployments with a booking on this node's GPUs that is over budget or on no GPU."""
        out: set[str] = set()
        for i, book in self._on_gpu.get(node, {}).items():
            if book and ((node, i) not in self._slots or self.headroom_bytes(node, i) < 0):
                out.update(b.deployment for b in book.values())
        return sorted(out)

    def over_budget(self) -> list[GpuKey]:
        """GPUs whose bookings plus foreign use exceed the budget (empty in every plan vllmfit outputs)."""
        return [k for k in sorted(self._slots) if self.headroom_bytes(*k) < 0]

    # changes
    def book(self, decision: Decision) -> None:
        """Apply an admitted decision (replacing the deployment's earlier bookings). Raises
        OverBudget (and changes nothing) if it no longer fits: decide again."""
        if not decision.admitted:
            return
        old = self.release(decision.key)
        new = decision.bookings()
        need: dict[GpuKey, int] = {}
        for b in new:
            need[(b.node, b.index)] = need.get((b.node, b.index), 0) + b.footprint.total
        bad = [k for k, v in sorted(need.items()) if k not in self._slots or v > self.headroom_bytes(*k)]
        if bad:
            self._add(decision.key, old)
            raise OverBudget(f"{decision.key} no longer fits on {bad[0][0]} GPU {bad[0][1]}; decide again")
        self._add(decision.key, new)

    def restore(self, key: str, bookings: Iterable[Booking]) -> None:
        """Re-add bookings read back from a VLLMDeployment's status (operator start-up), unchecked."""
        self.release(key)
        self._add(key, list(bookings))

    def _add(self, key: str, bookings: list[Booking]) -> None:
        for b in bookings:
            gkey = (b.node, b.index)
            self._on_gpu.setdefault(b.node, {}).setdefault(b.index, {})[(b.deployment, b.replica)] = b
            self._used[gkey] = self._used.get(gkey, 0) + b.footprint.total
        if bookings:
            self._by_deployment.setdefault(key, []).extend(bookings)
            if any(b.kv_beyond for b in bookings):
                self._beyond.add(key)
        self._reindex({(b.node, b.index) for b in bookings})

    def beyond_caps(self) -> list[str]:
        """The deployments holding KV cache beyond their maxNumSeqs x maxModelLen, sorted."""
        return sorted(self._beyond)

    def release(self, key: str) -> list[Booking]:
        bookings = self._by_deployment.pop(key, [])
        self._beyond.discard(key)
        for b in bookings:
            gkey = (b.node, b.index)
            if self._on_gpu.get(b.node, {}).get(b.index, {}).pop((b.deployment, b.replica), None) is not None:
                self._used[gkey] -= b.footprint.total
        self._reindex({(b.node, b.index) for b in bookings})
        return bookings

    def copy(self) -> Ledger:
        new = Ledger(kv_grant=self.kv_grant)
        new.nodes = dict(self.nodes)
        new._slots = dict(self._slots)
        new._on_gpu = {n: {i: dict(b) for i, b in g.items()} for n, g in self._on_gpu.items()}
        new._used = dict(self._used)
        new._by_deployment = {k: list(v) for k, v in self._by_deployment.items()}
        new._beyond = set(self._beyond)
        new._head = dict(self._head)
        new._free = {k: list(v) for k, v in self._free.items()}
        new._by_type = {k: dict(v) for k, v in self._by_type.items()}
        new._groups = {k: list(v) for k, v in self._groups.items()}
        new._group_key = dict(self._group_key)
        return new

    # indices
    def _index(self, key: GpuKey) -> None:
        s = self._slots[key]
        h = self.headroom_bytes(*key)
        self._head[key] = h
        bisect.insort(self._free.setdefault(s.gpu, []), (h, key[0], key[1]))

    def _unindex(self, key: GpuKey) -> None:
        s = self._slots.get(key)
        h = self._head.pop(key, None)
        if s is None or h is None:
            return
        lst = self._free[s.gpu]
        del lst[bisect.bisect_left(lst, (h, key[0], key[1]))]
        if not lst:
            del self._free[s.gpu]

    def _reindex(self, keys: Iterable[GpuKey]) -> None:
        refresh: set[tuple[str, GpuType]] = set()
        for key in keys:
            s = self._slots.get(key)
            if s is None or self._head.get(key) == self.headroom_bytes(*key):
                continue
            self._unindex(key)
            self._index(key)
            if not s.mig:
                refresh.add((s.node, s.gpu))
        for node, t in refresh:
            self._refresh_groups(node, t)

    def _refresh_groups(self, node: str, t: GpuType) -> None:
        for gt, n in self._groups:
            if gt == t:
                self._set_group_key(t, n, node, self._node_group_key(node, t, n))

    def _node_group_key(self, node: str, t: GpuType, n: int) -> int | None:
        idx = self._by_type.get(node, {}).get(t, [])
        if len(idx) < n:
            return None
        return sorted((self._head[(node, i)] for i in idx), reverse=True)[n - 1]

    def _set_group_key(self, t: GpuType, n: int, node: str, key: int | None) -> None:
        old = self._group_key.pop((t, n, node), None)
        if old == key and key is not None:
            self._group_key[(t, n, node)] = key
            return
        lst = self._groups[(t, n)]
        if old is not None:
            del lst[bisect.bisect_left(lst, (old, node))]
        if key is not None:
            self._group_key[(t, n, node)] = key
            bisect.insort(lst, (key, node))

    def group_index(self, t: GpuType, n: int) -> list[tuple[int, str]]:
        """[(n-th largest headroom, node)] sorted, for nodes with at least n GPUs of type t."""
        if (t, n) not in self._groups:
            self._groups[(t, n)] = []
            for node in sorted(self._by_type):
                self._set_group_key(t, n, node, self._node_group_key(node, t, n))
        return self._groups[(t, n)]

    def free_index(self, t: GpuType) -> list[tuple[int, str, int]]:
        """[(headroom, node, index)] sorted, for every GPU (or MIG slice) of type t."""
        return self._free.get(t, [])

    def type_indices(self, node: str, t: GpuType) -> list[int]:
        return self._by_type.get(node, {}).get(t, [])
