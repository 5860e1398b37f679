"""The per-GPU ledger: what is booked where, kept under budget by construction (`book` raises
rather than overfill), with the indices the search uses (headroom per GPU group). What it books: a
`Decision` (core.placement.decision)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from vllmfit.core.memory import DEFAULT_KV_GRANT, KvGrant
from vllmfit.core.model.facts import GpuType
from vllmfit.core.placement import affinity
from vllmfit.core.placement.census import BY_PRODUCT, Census, NodeSet, Selections, still_matching
from vllmfit.core.placement.decision import Booking, Decision
from vllmfit.core.placement.headroom import Index
from vllmfit.core.placement.inputs import GpuKey, GpuSlot, NodeInfo
from vllmfit.core.placement.layers import Layer as _Layer

# --- The ledger --------------------------------------------------------------------------------


class OverBudget(ValueError):
    """`Ledger.book` of a decision that no longer fits (the ledger changed since `decide`)."""


class Ledger:
    """Bookings per GPU, with indices sorted by headroom so a search never scans every GPU.

    Versioned, copy-on-write (issue 29; `version` counts this object's changes). `snapshot()`
    is a frozen view of it as it is now, `fork()` a private mutable copy; both share every
    container (a few attribute copies at any size) and whichever side changes one first copies
    it (`_changing`): maps are layers (only their changes are copied), sorted indices one GPU
    type or group size at a time, bookings one node at a time. A snapshot never changes, and
    `decide` on one works on a scratch copy. Lazy group indices are published whole; selections
    (`matching`) live in a locked, bounded cache per node state (census.Selections). Indices:
    - per GPU type: (headroom, node, index) sorted, for single-GPU placements;
    - per (GPU type, n), built on first use: (key, node) sorted, where key is the n-th largest
      headroom among the node's (non-MIG) GPUs of that type: the largest need an n-GPU group there can take.
    Both are `headroom.Index`es: buckets per distinct headroom, each copied when it changes.
    """

    def __init__(self, nodes: Iterable[NodeInfo] = (), kv_grant: KvGrant = DEFAULT_KV_GRANT):
        self.kv_grant = kv_grant  # the cluster's default KV grant (a spec without kvCache or maxNumSeqs)
        self.multi_node: str | None = None  # why no replica may span nodes here (None: it may; core.placement.gang)
        self.version = 0
        self.frozen = False
        self._shared = False  # its containers may be shared: copy each before changing it
        self._owned: set[object] = set()  # while shared: the containers copied since (this object's own)
        self.nodes: dict[str, NodeInfo] = {}
        self._slots: dict[GpuKey, GpuSlot] = {}
        self._on_gpu: Any = {}  # node -> GPU -> bookings (each node's copied when it changes)
        self._used: Any = {}  # GpuKey -> booked bytes
        self._by_deployment: Any = {}  # key -> its bookings (a list never changed in place)
        self._beyond: Any = {}  # deployments with a booking that holds KV above its request (-> True)
        self.heads: Any = {}  # GpuKey -> headroom as indexed (others read it); these maps: dicts until shared
        self._free: dict[GpuType, Index] = {}
        self._by_type: dict[str, dict[GpuType, list[int]]] = {}  # node -> type -> indices (non-MIG)
        self.census = Census()  # the nodes by what a refusal counts (core.placement.census; read only)
        self._groups: dict[tuple[GpuType, int], Index] = {}
        self._group_key: dict[tuple[GpuType, int], Any] = {}  # (type, n) -> node -> its key (a dict or a layer)
        self._selected = Selections()  # (nodeSelector, affinity) -> matches, and summaries (one per node state)
        self._stale: set[tuple[str, GpuType]] = set()  # (node, type) whose group keys lag its bookings
        self._load(list(nodes))

    # nodes
    def set_node(self, node: NodeInfo) -> list[str]:
        """Add or update a node. Returns the deployments booked there that no longer fit: on a GPU
        now over budget, or on a GPU that disappeared (pass them to `replan`)."""
        self._changing("nodes", "acct")
        selection = (old := self.nodes.get(node.name)) is None or not old.selected_as(node)  # not only foreign use
        self._unindex_node(node.name)
        self.nodes[node.name] = node
        if selection:  # each selection's matches with this node looked at again (a new cache: snapshots keep theirs)
            self._selected = still_matching(self._selected, node.name, old, node, self.node_set)
        types: dict[GpuType, list[int]] = {}
        for s in node.gpus:
            key = (s.node, s.index)
            self._slots[key] = s
            self._gpu_book(s.node).setdefault(s.index, {})
            if key not in self._used:
                self._used[key] = 0
            self._index(key, s.budget_bytes - self._used[key] - s.foreign_bytes)  # headroom_bytes(*key)
            if not s.mig:
                types.setdefault(s.gpu, []).append(s.index)
        self._by_type[node.name] = {t: sorted(ix) for t, ix in types.items()}
        self.census.count(node, types, 1)
        for t, ix in types.items():  # the whole-node group of each type indexed as nodes come, not by
            self.group_index(t, len(ix))  # the first review that asks for it (a full pass, issue 32)
            self._refresh_groups(node.name, t)
        return self.affected(node.name)

    def _load(self, nodes: list[NodeInfo]) -> None:
        """`set_node` of each node, into this new ledger, with each index built once at the end
        (not 80,000 inserts into sorted lists: issue 32). The same state, tested."""
        if len({n.name for n in nodes}) < len(nodes):  # a name given twice: the later one wins, as set_node does
            for n in nodes:
                self.set_node(n)
            return
        self.version += len(nodes)
        entries: dict[GpuType, list[tuple[int, str, int]]] = {}
        slots, on_gpu, used, head = self._slots, self._on_gpu, self._used, self.heads
        budget: dict[tuple[int, int], int] = {}  # (id(policy), id(type)) -> budget: the same for most GPUs
        for node in nodes:
            self.nodes[node.name] = node
            types: dict[GpuType, list[int]] = {}
            for s in node.gpus:
                key = (s.node, s.index)
                slots[key] = s
                on_gpu.setdefault(s.node, {}).setdefault(s.index, {})
                used[key] = 0
                if (b := budget.get(k := (id(s.policy), id(s.gpu)))) is None:  # both alive: the node holds them
                    b = budget[k] = s.budget_bytes
                h = head[key] = b - s.foreign_bytes
                entries.setdefault(s.gpu, []).append((h, s.node, s.index))
                if not s.mig:
                    types.setdefault(s.gpu, []).append(s.index)
            self._by_type[node.name] = {t: sorted(ix) for t, ix in types.items()}
            self.census.count(node, types, 1)
        self._free = {t: Index(e) for t, e in entries.items()}
        for t, size in dict.fromkeys((t, len(ix)) for types in self._by_type.values() for t, ix in types.items()):
            self.group_index(t, size)  # each type's whole-node groups (set_node), in the order nodes give them

    def remove_node(self, name: str) -> list[str]:
        """Forget a node. Returns the deployments booked there (they must move: `replan`)."""
        self._changing("nodes", "acct")
        self._unindex_node(name)
        old = self.nodes.pop(name, None)
        self._selected = still_matching(self._selected, name, old, None, self.node_set)
        return self.affected(name)

    def _unindex_node(self, name: str) -> None:
        old = self.nodes.get(name)
        for s in old.gpus if old else ():
            self._unindex((s.node, s.index))
            self._slots.pop((s.node, s.index), None)
        if old is not None:
            self.census.count(old, self._by_type.get(name, {}), -1)
        for t in self._by_type.pop(name, {}):
            for gt, n in list(self._groups):
                if gt == t:
                    self._set_group_key(t, n, name, None)

    def slots(self) -> list[GpuSlot]:
        return [self._slots[k] for k in sorted(self._slots)]

    def slot(self, node: str, index: int) -> GpuSlot | None:
        return self._slots.get((node, index))

    def most_of_one_type(self, t: GpuType | None = None) -> int:
        """The most GPUs of one type (non-MIG; of type `t` if given) any node has: the largest group
        one deployment can use (counted as nodes change: core.placement.census)."""
        return self.census.most(t)

    def gpu_types(self) -> list[GpuType]:
        return sorted(self._free, key=BY_PRODUCT)

    def node_set(self, names: Iterable[str]) -> NodeSet:
        names = tuple(sorted(n for n in set(names) if n in self.nodes))
        types = {s.gpu for n in names for s in self.nodes[n].gpus}
        return NodeSet(names, frozenset(names), tuple(sorted(types, key=BY_PRODUCT)))

    def matching(
        self, selector: Mapping[str, str] | None, terms: tuple[affinity.Term, ...] | None = None
    ) -> NodeSet | None:
        """The nodes whose labels match a nodeSelector and the required node affinity `terms`;
        None when there is neither (every node). Cached; a node's change updates it (census.still_matching)."""
        if not selector and terms is None:
            return None
        key = (tuple(sorted((selector or {}).items())), terms)
        return self._selected.remembered(key, lambda: self.node_set(  # type: ignore[no-any-return]
            n for n, nd in self.nodes.items() if affinity.selected(n, nd.labels, key[0], terms)))

    @property
    def selections(self) -> Selections:  # read it; `remembered` adds to it
        return self._selected

    def remembered(self, key: tuple[object, ...], build: Any) -> Any:
        """A value of this ledger's nodes alone (never its bookings): `build()` once per node state,
        kept in its bounded selection cache (census.Selections; `key[0]` names the kind of value)."""
        return self._selected.remembered(key, build)

    # accounting
    def used_bytes(self, node: str, index: int) -> int:
        """Everything booked on the GPU plus foreign use."""
        slot = self._slots.get((node, index))
        return self._used.get((node, index), 0) + (slot.foreign_bytes if slot else 0)

    def headroom_bytes(self, node: str, index: int) -> int:
        slot = self._slots.get((node, index))
        return (slot.budget_bytes - self.used_bytes(node, index)) if slot else 0

    def bookings_on(self, node: str, index: int) -> list[Booking]:
        return sorted(self._on_gpu.get(node, {}).get(index, {}).values(), key=lambda b: (b.deployment, b.replica))

    def deployments_on(self, node: str) -> list[str]:  # from the per-GPU books, not a pass over all
        return sorted({b.deployment for book in self._on_gpu.get(node, {}).values() for b in book.values()})

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
        return sorted((e[1], e[2]) for index in self._free.values() for e in index.below(0))  # every GPU is indexed

    # changes
    def book(self, decision: Decision) -> None:
        """Apply an admitted decision (replacing the deployment's earlier bookings). Raises
        OverBudget (and changes nothing) if it no longer fits: decide again."""
        if not decision.admitted:
            return
        self._changing()
        old = self.release(decision.key)
        new = decision.bookings()
        need: dict[GpuKey, int] = {}
        for b in new:
            need[(b.node, b.index)] = need.get((b.node, b.index), 0) + b.footprint.total
        bad = sorted(k for k, v in need.items() if (h := self.heads.get(k)) is None or v > h)  # heads: current
        if bad:
            self.add_bookings(decision.key, old)
            raise OverBudget(f"{decision.key} no longer fits on {bad[0][0]} GPU {bad[0][1]}; decide again")
        self.add_bookings(decision.key, new)

    def restore(self, key: str, bookings: Iterable[Booking]) -> None:
        """Re-add bookings read back from a VLLMDeployment's status (operator start-up), unchecked."""
        self._changing()
        self.release(key)
        self.add_bookings(key, list(bookings))

    def add_bookings(self, key: str, bookings: list[Booking]) -> None:
        if not bookings:
            return
        self._changing("acct", "deps")
        for b in bookings:
            gkey, book = (b.node, b.index), self._gpu_book(b.node).setdefault(b.index, {})
            old = book.get(who := (b.deployment, b.replica))  # a replica booked twice on one GPU counts once
            book[who] = b
            self._used[gkey] = self._used.get(gkey, 0) + b.footprint.total - (old.footprint.total if old else 0)
            if b.kv_beyond:
                self._beyond[key] = True
        self._by_deployment[key] = [*self._by_deployment.get(key, ()), *bookings]  # a new list: never changed in place
        self._reindex(bookings)

    def beyond_caps(self) -> list[str]:
        """The deployments holding KV cache above their KV request (what they could give back), sorted."""
        return sorted(self._beyond)

    def release(self, key: str) -> list[Booking]:
        if key not in self._by_deployment:
            return []
        self._changing("acct", "deps")
        bookings = self._by_deployment.pop(key)
        self._beyond.pop(key, None)
        for b in bookings:
            gkey = (b.node, b.index)
            if b.node in self._on_gpu and (old := self._gpu_book(b.node).get(b.index, {}).pop(
                    (b.deployment, b.replica), None)) is not None:
                self._used[gkey] -= old.footprint.total
        self._reindex(bookings)
        return bookings

    # versions and sharing
    def snapshot(self) -> Ledger:
        """This ledger as it is now, frozen: it never changes, whatever this one does next.
        Costs a few attribute copies (the containers are shared; see the class docstring)."""
        if self.frozen:
            return self
        snap = self._share()
        snap.frozen = True
        return snap

    def fork(self) -> Ledger:
        """A private mutable copy (shared, copied where it changes): the writer's next version."""
        return self._share()

    def scratch(self) -> Ledger:
        """A mutable copy for one computation on a snapshot (`decide` on it); unlike `fork`, use
        it only while this ledger does not change (a frozen one never does), then drop it."""
        if self._stale:
            self._fresh()  # a copy shares the group indices as they are: current ones
        new = object.__new__(Ledger)
        new.__dict__.update(self.__dict__)
        new.frozen, new._shared, new._owned, new._stale = False, True, set(), set()
        return new

    copy = fork  # a mutable copy

    def _share(self) -> Ledger:
        new = self.scratch()
        # this object shares its containers from now on too: it copies before it changes one
        self._shared, self._owned = True, set()
        return new

    def _changing(self, *units: str) -> None:
        """Before a change: count it, and (when shared) copy the containers of `units`: "nodes"
        (the node table), "acct" (the accounting maps and the outer index tables; each index list
        is copied when it changes: _free_list, _group_list)."""
        if self.frozen:
            raise TypeError("a ledger snapshot never changes; fork() it")
        self.version += 1
        if not self._shared:
            return
        for unit in units:
            if unit in self._owned:
                continue
            if unit == "nodes":
                self.nodes, self._slots = dict(self.nodes), dict(self._slots)
                self._by_type = dict(self._by_type)  # values are replaced whole, never changed in place
                self.census = self.census.copy()  # small: a few entries per GPU type
            elif unit == "acct":
                self._used, self.heads = _Layer.over(self._used), _Layer.over(self.heads)
                # dict() is one step under the GIL, while a thread may publish a lazy index there
                self._free, self._groups, self._group_key = dict(self._free), dict(self._groups), dict(self._group_key)
            elif unit == "deps":
                self._by_deployment, self._beyond = _Layer.over(self._by_deployment), _Layer.over(self._beyond)
            self._owned.add(unit)

    def _free_list(self, t: GpuType) -> Index:
        """The free index of type t, this object's own (a copy sharing its buckets first)."""
        if self._shared and ("free", t) not in self._owned:
            old = self._free.get(t)
            self._free[t] = old.copy() if old is not None else Index()
            self._owned.add(("free", t))
        found = self._free.get(t)
        if found is None:
            found = self._free[t] = Index()
        return found

    def _group_list(self, t: GpuType, n: int) -> tuple[Index, Any]:
        """The group index of (t, n) and its keys per node, this object's own."""
        if self._shared and ("groups", t, n) not in self._owned:
            self._group_key[(t, n)] = _Layer.over(self._group_key.get((t, n), {}))  # its changes only
            self._groups[(t, n)] = self._groups[(t, n)].copy()
            self._owned.add(("groups", t, n))
        return self._groups[(t, n)], self._group_key[(t, n)]

    def _gpu_book(self, node: str) -> dict[int, dict[tuple[str, int], Booking]]:
        """The bookings of one node's GPUs, this object's own (copied from a shared one first)."""
        if self._shared and ("gpu", node) not in self._owned:
            if "gpu" not in self._owned:
                self._on_gpu = _Layer.over(self._on_gpu)  # its values are copied one node at a time
                self._owned.add("gpu")
            old = self._on_gpu.get(node)
            self._on_gpu[node] = {i: dict(b) for i, b in old.items()} if old else {}
            self._owned.add(("gpu", node))
        book = self._on_gpu.get(node)
        if book is None:
            book = self._on_gpu[node] = {}
        return book

    # indices
    def _index(self, key: GpuKey, h: int | None = None) -> None:
        s = self._slots[key]
        h = self.heads[key] = self.headroom_bytes(*key) if h is None else h
        self._free_list(s.gpu).add((h, key[0], key[1]))

    def _unindex(self, key: GpuKey) -> None:
        s = self._slots.get(key)
        h = self.heads.pop(key, None)
        if s is None or h is None:
            return
        lst = self._free_list(s.gpu)
        lst.remove((h, key[0], key[1]))
        if not lst:
            del self._free[s.gpu]

    def _reindex(self, bookings: Iterable[Booking]) -> None:
        """The headroom of the GPUs of `bookings` indexed anew (a GPU twice: the second finds it done)."""
        for b in bookings:
            s = self._slots.get(key := (b.node, b.index))
            if s is None or (old := self.heads.get(key)) == (h := s.budget_bytes - self._used.get(key, 0) - s.foreign_bytes):
                continue
            lst = self._free_list(s.gpu)  # _unindex, then _index at h
            if old is not None:
                lst.remove((old, key[0], key[1]))
            lst.add((h, key[0], key[1]))
            self.heads[key] = h
            if not s.mig:  # its node's group keys are refreshed when a group index is read next (_fresh)
                self._stale.add((s.node, s.gpu))

    def _refresh_groups(self, node: str, t: GpuType) -> None:
        heads = sorted([self.heads[(node, i)] for i in self._by_type.get(node, {}).get(t, [])], reverse=True)
        for (gt, n), keys in self._group_key.items():  # each n's key is heads[n - 1] (node_group_key)
            if (gt is t or (gt.product == t.product and gt == t)) and (  # equal types may be distinct objects
                    keys.get(node) != (key := heads[n - 1] if len(heads) >= n else None)):
                self._set_group_key(t, n, node, key)

    def _fresh(self) -> dict[tuple[GpuType, int], Index]:
        """The group indices, every node booked since they were read refreshed (once per node)."""
        stale, self._stale = self._stale, set()
        for node, t in sorted(stale, key=lambda e: (e[0], e[1].product)):
            self._refresh_groups(node, t)
        return self._groups

    def node_group_key(self, node: str, t: GpuType, n: int) -> int | None:
        heads = sorted([self.heads[(node, i)] for i in self._by_type.get(node, {}).get(t, [])], reverse=True)
        return heads[n - 1] if len(heads) >= n else None

    def _set_group_key(self, t: GpuType, n: int, node: str, key: int | None) -> None:
        if self._group_key[(t, n)].get(node) == key:
            return
        lst, keys = self._group_list(t, n)
        old = keys.pop(node, None)
        if old is not None:
            lst.remove((old, node))
        if key is not None:
            keys[node] = key
            lst.add((key, node))

    def group_index(self, t: GpuType, n: int) -> Index:
        """(n-th largest headroom, node) sorted, for nodes with at least n GPUs of type t."""
        found = self._groups.get((t, n)) if not self._stale else self._fresh().get((t, n))
        if found is None:  # built whole, then published in one assignment (no thread sees it half built)
            keys, head = {}, self.heads  # the nodes with n GPUs of type t: their node_group_key
            for node, types in self._by_type.items():
                ix = types.get(t)
                if ix is not None and len(ix) >= n:
                    keys[node] = sorted([head[(node, i)] for i in ix], reverse=True)[n - 1]
            found = Index((k, node) for node, k in keys.items())
            self._group_key[(t, n)], self._groups[(t, n)] = keys, found
        return found

    def free_index(self, t: GpuType) -> Index:
        """(headroom, node, index) sorted, for every GPU (or MIG slice) of type t."""
        return self._free.get(t, _EMPTY)

    def type_indices(self, node: str, t: GpuType) -> list[int]:
        return self._by_type.get(node, {}).get(t, [])


_EMPTY = Index()  # the index of a GPU type the ledger does not have (never changed)
