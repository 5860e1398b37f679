"""The operator's side of the device-plugin backend: reservation pods and scheduling gates.

The decisions are pure (vllmfit.backends.reservation); this module reads and writes the objects:
- `wanted`: the GPU slots that need a reservation (every GPU a replica shares, or uses without
  taking its whole node with device-plugin limits);
- `sync`: create the missing reservation pods, delete those no replica needs any more;
- `observe`: a reservation pod changed (it reported its GPU, or ended); re-book the replicas on
  the GPU it got when that differs from the one asked for;
- `pins`: the UUIDs a replica's pod is pinned to, and `ungate`: lift a replica pod's
  scheduling gate once every GPU it is pinned to is held.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Callable, Iterable, Mapping
from time import perf_counter
from typing import Any

from kubernetes_asyncio import client
from kubernetes_asyncio.client import ApiException

from vllmfit.backends import reservation as rsv
from vllmfit.core.spec import api
from vllmfit.operator.booking import measured, report
from vllmfit.operator.booking.state import Store
from vllmfit.operator.rendering import builders

logger = logging.getLogger(__name__)

JSON_PATCH = "application/json-patch+json"
LOCK = "__reservations__"


def device_plugin(store: Store, node: str) -> bool:
    """Whether `node`'s GPUs are held by the device plugin (not DRA)."""
    return store.backend_of(node) == "device-plugin"


def slot_uuids(store: Store, node: str) -> dict[int, str | None]:
    info = store.books.ledger.nodes.get(node)
    return {s.index: s.uuid for s in info.gpus if not s.mig} if info else {}


def uuids(store: Store, node: str) -> dict[int, str]:
    """Known and reservation-reported UUIDs of the node's GPUs."""
    return rsv.learned_uuids(store.cache.reservations.on(node), node, slot_uuids(store, node))


UuidTable = Callable[[str], dict[int, str]]


def uuid_table(store: Store) -> UuidTable:
    """`uuids` of every node, for one pass over many replicas (the store unchanged meanwhile):
    each node's answer computed once."""
    memo: dict[str, dict[int, str]] = {}

    def table(node: str) -> dict[int, str]:
        if node not in memo:
            memo[node] = uuids(store, node)
        return memo[node]

    return table


def replicas(store: Store) -> dict[tuple[str, int], tuple[str, tuple[int, ...]]]:
    """(deployment, replica) -> (node, GPUs) from the ledger."""
    out: dict[tuple[str, int], tuple[str, list[int]]] = {}
    for key in store.books.ledger.deployments():
        for b in store.books.ledger.bookings_of(key):
            out.setdefault((key, b.replica), (b.node, []))[1].append(b.index)
    return {k: (n, tuple(g)) for k, (n, g) in out.items()}


Holders = Callable[[str], set[str]]


def holders(store: Store) -> Holders:
    """node -> the deployments with a live replica written with device-plugin limits there (it
    holds every GPU of the node), for one pass over many replicas (the store unchanged
    meanwhile): store.cache.whole grouped by node once (issue 32: `whole` per replica went over
    every such replica of the cluster, for every replica, on every event)."""
    by_node: dict[str, set[str]] = {}
    for (k, _), n in store.cache.whole.items():
        by_node.setdefault(n, set()).add(k)
    memo: dict[str, set[str]] = {}

    def table(node: str) -> set[str]:
        if node not in memo:
            memo[node] = {k for k in by_node.get(node, ())
                          if any(b.node == node for b in store.books.ledger.bookings_of(k))}
        return memo[node]

    return table


def whole(store: Store, node: str, but: str | None = None, held: Holders | None = None) -> bool:
    """A live replica (of another deployment than `but`) written with device-plugin limits holds
    every GPU of the node. `held`: a `holders` table of the store as it is."""
    if held is not None:
        return bool(held(node) - {but})
    return any(n == node and k != but and any(b.node == node for b in store.books.ledger.bookings_of(k))
               for (k, _), n in store.cache.whole.items())


def needs_reservation(store: Store, key: str, replica: int, node: str, gpus: Iterable[int],
                      held: Holders | None = None, plugin: bool | None = None) -> bool:
    """A replica's GPUs need reservations: a device-plugin node, the replica is not written with
    limits, and no other replica holds the whole node. Before its Deployment is first written,
    one that will get limits (builders.exclusive) needs none. `plugin`: `device_plugin` of the
    node, when the caller has it (`wanted` asks once per node)."""
    if not (device_plugin(store, node) if plugin is None else plugin) or (key, replica) in store.cache.whole \
            or whole(store, node, but=key, held=held):
        return False
    return (key, replica) in store.cache.written or not builders.exclusive(store.books.ledger, key, node, list(gpus))


def tolerations_on(store: Store, node: str, index: int) -> list[dict[str, Any]]:
    """The tolerations a reservation for `node` GPU `index` needs: those of every deployment
    booked there (backends.reservation.tolerations_for)."""
    specs = []
    for b in store.books.ledger.bookings_on(node, index):
        rec = store.cache.records.get(b.deployment)
        req = rec.admitted_request or rec.request if rec is not None else None
        if req is not None:
            specs.append(req.spec)
    return rsv.tolerations_for(specs)


def wanted(store: Store) -> set[tuple[str, int]]:
    """The GPU slots that need a reservation (`needs_reservation` of every booked replica); each
    node's backend is looked up once."""
    out: set[tuple[str, int]] = set()
    held = holders(store)
    plugin: dict[str, bool] = {}
    for (key, replica), (node, gpus) in replicas(store).items():
        if node not in plugin:
            plugin[node] = device_plugin(store, node)
        if needs_reservation(store, key, replica, node, gpus, held, plugin[node]):
            out.update((node, i) for i in gpus)
    return out


def pins(store: Store, key: str, p: api.ReplicaPlacement, table: UuidTable | None = None) -> list[str] | None:
    """What a shared replica's NVIDIA_VISIBLE_DEVICES names: the UUIDs of its GPUs (known from
    the agent or reported by their reservations). On a node held whole by a device-plugin limit
    and without UUIDs, the indices. None: not known yet (its pod waits behind the gate).
    `table`: a `uuid_table` of the store as it is."""
    gpus = [g.index for g in p.gpus]
    known = table(p.node) if table is not None else uuids(store, p.node)
    got = rsv.pins(p.node, gpus, known)
    if got is None and whole(store, p.node, but=key):
        return [known.get(i) or str(i) for i in gpus]
    return got


def gated(store: Store, key: str, p: api.ReplicaPlacement) -> bool:
    return needs_reservation(store, key, p.replica, p.node, [g.index for g in p.gpus])


# --- reservation pods ---------------------------------------------------------------------------


def observe(store: Store, pod: Mapping[str, Any], deleted: bool) -> rsv.Reservation | None:
    """Record a reservation pod's state (hold the lock). A lookalike (a pod with the reservation
    labels that vllmfit did not make: rsv.untrusted) changes nothing, whatever its name; it is
    logged and reported once with an Event on it."""
    if rsv.is_reservation(pod) and (why := rsv.untrusted(pod, store.options.reservation)) is not None:
        report_lookalike(store, pod, why, deleted)
        return None
    r = rsv.reservation_from_pod(pod, store.options.reservation)
    name = str((pod.get("metadata") or {}).get("name") or "")
    old = store.cache.reservations.get(name)
    store.cache.pins_dirty.update(x.node for x in (old, r) if x is not None)  # the UUIDs learned there may change
    if r is None or deleted:
        store.cache.reservations.pop(name, None)
        return None
    store.cache.reservations[name] = r
    return r


LOOKALIKE_REASON = "NotAReservation"


def report_lookalike(store: Store, pod: Mapping[str, Any], why: str, deleted: bool) -> None:
    """Log a pod that poses as a reservation, and post one Event on it (once per pod)."""
    meta = pod.get("metadata") or {}
    key = str(meta.get("uid") or f"{meta.get('namespace')}/{meta.get('name')}")
    seen = store.cache.lookalikes
    if deleted:
        seen.discard(key)
        return
    if key in seen:
        return
    seen.add(key)
    where = f"{str(meta.get('namespace'))[:63]}/{str(meta.get('name'))[:253]}"
    message = (f"pod {where} carries vllmfit's reservation labels but is not a vllmfit reservation ({why}); "
               "it holds nothing for vllmfit and is ignored")
    logger.warning("%s", message)
    report.post_event(pod, "Warning", LOOKALIKE_REASON, message)


def rebook(store: Store, r: rsv.Reservation) -> tuple[set[str], str | None]:
    """A reservation asked for GPU i reported GPU j, and j has no bookings while i has: move the
    replicas booked on i to j, where the GPU is really held (hold the lock). Returns the keys
    that moved and a message; ({}, message) when j has not the room (foreign use): then the
    reservation is deleted, and another one is asked for."""
    node, i = r.node, r.index
    j = rsv.mismatch(r, slot_uuids(store, node))
    ledger = store.books.writing
    if j is None or not ledger.bookings_on(node, i) or ledger.bookings_on(node, j):
        return set(), None
    if any(o.name != r.name and not o.terminating and rsv.serves(o, slot_uuids(store, node)) == i
           for o in store.cache.reservations.on(node)):
        return set(), None  # i is held by another reservation: this one is surplus
    keys = sorted({b.deployment for b in ledger.bookings_on(node, i)})
    old = {k: ledger.release(k) for k in keys}
    for k in keys:
        ledger.restore(k, rsv.swap_bookings(old[k], node, i, j))
    if ledger.headroom_bytes(node, j) < 0:
        for k in keys:
            ledger.restore(k, old[k])
        return set(), (f"the device plugin gave the reservation for {node} GPU {i} the GPU {r.uuid} ({node} GPU {j}), "
                       f"which has not the room; asking again")
    uu = slot_uuids(store, node)
    for k in keys:
        rec = store.cache.records.get(k)
        if rec is not None:
            rec.placement = rsv.swap_placement(rec.placement, node, i, j, uu)
    return set(keys), f"the device plugin gave {node} GPU {j} ({r.uuid}) instead of GPU {i}; re-booked on GPU {j}"


_next_pass: weakref.WeakKeyDictionary[Store, asyncio.Future[None]] = weakref.WeakKeyDictionary()
"""Per store: the reservation pass asked for and not started yet (callers meanwhile join it)."""

PASS_SHARE = 0.1
"""The most of the event loop's time that reservation passes take in a burst of events: a pass
looks at the whole ledger (`wanted`: milliseconds at a few hundred deployments, tens at
thousands), so a pass starts no sooner than (1 / PASS_SHARE - 1) times the last one's computing
time after that one ended; callers meanwhile join it (issue 32: at 5,000 deployments one pass
per event was most of the operator's CPU). Nothing is held open meanwhile: a replica pod stays
behind its scheduling gate until the reservations of its GPUs hold them, a fraction of a second
later even at 40,000 deployments, against the minutes a vLLM server takes to start. A tenth, not
a quarter: the admissions of a burst go faster (5,000 on 1,000 nodes, every one final in 26.9 s
instead of 27.4 s, medians of three; 40,000 on 10,000 in 253 s instead of 280 to 283 s;
benchmarks/operator_scale.py)."""

_last_pass: weakref.WeakKeyDictionary[Store, tuple[float, float]] = weakref.WeakKeyDictionary()
"""Per store: when the last pass ended (the loop's clock) and how long its computing took (s)."""


def pass_delay(store: Store, now: float) -> float:
    """Seconds the next pass waits before it starts (PASS_SHARE); 0 for the first."""
    ended, took = _last_pass.get(store, (now, 0.0))
    return max(0.0, ended + took * (1 / PASS_SHARE - 1) - now)


async def sync(store: Store) -> None:
    """Create the reservations wanted and not there; delete those no replica needs. A pass looks
    at the whole ledger (`wanted`), so callers that come while one waits to start join it rather
    than queue one pass each behind it (issue 32: every event's finish() ran a full pass, one
    after another, quadratic at a few hundred deployments); the pass they join starts after they
    called, so it sees what they changed. Its error is raised to each of them."""
    if store.api is None:
        return
    loop = asyncio.get_running_loop()
    waiting = _next_pass.get(store)
    if waiting is not None and waiting.get_loop() is loop and not waiting.done():
        await asyncio.wait([waiting])
        if not waiting.cancelled():
            return waiting.result()
    mine: asyncio.Future[None] = loop.create_future()
    mine.add_done_callback(lambda f: f.cancelled() or f.exception())  # read here if nobody joined
    _next_pass[store] = mine
    try:
        if (delay := pass_delay(store, loop.time())) > 0:
            await asyncio.sleep(delay)  # callers meanwhile join this pass
        async with store.cache.child_locks[LOCK]:
            if _next_pass.get(store) is mine:
                del _next_pass[store]  # started: a later caller's change needs a later pass
            await _sync_once(store)
    except BaseException as e:
        if _next_pass.get(store) is mine:
            del _next_pass[store]
        if isinstance(e, Exception):
            mine.set_exception(e)
        else:
            mine.cancel()  # its joiners run a pass of their own
        raise
    mine.set_result(None)


async def _sync_once(store: Store) -> None:
    """One pass of `sync` (hold child_locks[LOCK])."""
    async with store.books.transaction(counted=False):
        t0 = perf_counter()
        want = wanted(store)
        reservations = list(store.cache.reservations.values())
        table = uuid_table(store)
        known = {n: table(n) for n in {r.node for r in reservations} | {n for n, _ in want}}
        todo = rsv.plan(want, reservations, known)
        _last_pass[store] = (asyncio.get_running_loop().time(), perf_counter() - t0)
    core = client.CoreV1Api(store.api)
    cfg = store.options.reservation
    taken = {r.name for r in reservations}
    for node, i in todo.create:
        name = rsv.reservation_name(node, i, taken)
        taken.add(name)
        manifest = rsv.reservation_pod(cfg, node, i, name, tolerations_on(store, node, i))
        try:
            await report.unread(core.create_namespaced_pod, cfg.namespace, manifest)
        except ApiException as e:
            if e.status != 409:
                logger.error("reservation %s for %s GPU %d: %s %s", name, node, i, e.status, e.reason)
                continue
        async with store.books.transaction(counted=False):
            store.cache.reservations.setdefault(name, rsv.Reservation(name, node, i))
            store.cache.pins_dirty.add(node)
            store.cache.retiring.discard(name)  # a new pod of a name vllmfit deleted before
    for name in todo.delete:
        store.cache.retiring.add(name)
        try:
            await core.delete_namespaced_pod(name, cfg.namespace)
        except ApiException as e:
            if e.status != 404:
                logger.error("deleting reservation %s: %s %s", name, e.status, e.reason)
                continue
        async with store.books.transaction(counted=False):
            if (gone := store.cache.reservations.pop(name, None)) is not None:
                store.cache.pins_dirty.add(gone.node)


async def load(store: Store) -> None:
    """Read every reservation pod, and which replicas hold their whole node with device-plugin
    limits (their Deployments' pinning annotation), at start-up: a neighbour sharing such a node
    needs no reservation, whatever order the deployments are resumed in."""
    pods = await report.as_json(client.CoreV1Api(store.api).list_namespaced_pod,
                                store.options.reservation.namespace, label_selector=f"{rsv.ROLE_LABEL}={rsv.ROLE}")
    for pod in pods.get("items") or []:
        observe(store, pod, False)
    apps = client.AppsV1Api(store.api)
    for ns in sorted({rec.namespace for rec in store.cache.records.values() if rec.admitted}):
        listed = await report.as_json(apps.list_namespaced_deployment, ns, label_selector=builders.selector(),
                                      _request_timeout=30)
        for d in listed.get("items") or []:
            whole_from_deployment(store, d)


def whole_from_deployment(store: Store, d: Mapping[str, Any]) -> None:
    meta = d.get("metadata") or {}
    ours = builders.replica_of(meta)
    if ours is None or (meta.get("labels") or {}).get(builders.MANAGED_BY) != "vllmfit":
        return
    key, replica, where = ours
    node = where.split(":", 1)[0]
    if node:
        store.cache.written.add((key, replica))
        if (meta.get("annotations") or {}).get(builders.ANNOTATION_PINNING) == "device-plugin":
            store.cache.whole[(key, replica)] = node
            store.cache.pins_dirty.add(node)


# --- replica pods: the scheduling gate -----------------------------------------------------------


def pod_pins(pod: Mapping[str, Any]) -> list[str]:
    raw = ((pod.get("metadata") or {}).get("annotations") or {}).get(rsv.ANNOTATION_PINS) or ""
    return [u for u in raw.split(",") if u]


def has_gate(pod: Mapping[str, Any]) -> bool:
    return any(g.get("name") == rsv.GATE for g in (pod.get("spec") or {}).get("schedulingGates") or [])


def pod_node(pod: Mapping[str, Any]) -> str:
    return str(((pod.get("metadata") or {}).get("annotations") or {}).get(builders.ANNOTATION_PLACEMENT, "")
               ).split(":", 1)[0]


def track(store: Store, pod: Mapping[str, Any], deleted: bool) -> None:
    """Remember a gated replica pod (hold the lock)."""
    meta = pod.get("metadata") or {}
    key = (str(meta.get("namespace") or "default"), str(meta.get("name") or ""))
    if deleted or not has_gate(pod):
        store.cache.gated.pop(key, None)
        store.cache.gate_of.pop(key, None)
        store.cache.gate_holds.pop(key, None)
    else:
        store.cache.gated[key] = (pod_node(pod), pod_pins(pod), [g for g in (pod.get("spec") or {}).get(
            "schedulingGates") or []])
        ours = builders.replica_of({**meta, "namespace": key[0]})
        if ours is None:
            store.cache.gate_of.pop(key, None)
        else:
            store.cache.gate_of[key] = (ours[0], ours[1], ours[2] or None)


def openable(store: Store) -> list[tuple[str, str, list[dict[str, Any]]]]:
    """Gated pods whose GPUs are all held now and whose GPUs the agent measured room on
    (`measured.gate`: what it holds back is in `store.cache.gate_holds`). Hold the lock."""
    out = []
    for (ns, name), (node, pinned, gates) in sorted(store.cache.gated.items()):
        if not rsv.gate_open(pinned, rsv.held_uuids(store.cache.reservations.on(node), node)):
            continue
        owner = store.cache.gate_of.get((ns, name))
        if owner is not None:  # the start gate on measured room (issue 34)
            verdict = measured.gate(store, owner[0], owner[1], made_for=owner[2])
            start_condition(store, owner[0], name, verdict)
            if not verdict.open:
                store.cache.gate_holds[(ns, name)] = verdict.reason
                continue
            store.cache.gate_holds.pop((ns, name), None)
        out.append((ns, name, [g for g in gates if g.get("name") != rsv.GATE]))
    return out


START_GATE = "StartGate"
"""Condition: whether the start gate on measured room released the replica pods (issue 34)."""


def start_condition(store: Store, key: str, pod: str, verdict: Any) -> None:
    """The StartGate condition of `key` (and a Warning Event when a hold begins or changes)."""
    rec = store.cache.records.get(key)
    if rec is None:
        return
    old = next((c for c in rec.conditions if c.type == START_GATE), None)
    status, reason = ("True", "Released") if verdict.open else ("False", "HeldOnMeasuredRoom")
    message = f"pod {pod}: {verdict.reason}"
    if old is not None and (old.status, old.message) == (status, message):
        return
    rec.conditions = report.set_condition(rec.conditions, START_GATE, status, reason, message, report.now(),
                                          rec.generation)
    store.writer.mark([key])
    if not verdict.open:
        report.post_event(rec.body, "Warning", "StartHeld", message)


async def ungate(store: Store) -> None:
    if not store.cache.gated:
        return  # no gated pod: nothing to look at, and no turn at the writer's lock
    async with store.books.transaction(counted=False):
        todo = openable(store)
    core = client.CoreV1Api(store.api)
    for ns, name, rest in todo:
        patch = [{"op": "replace", "path": "/spec/schedulingGates", "value": rest}]
        try:
            await core.patch_namespaced_pod(name, ns, patch, _content_type=JSON_PATCH)  # type: ignore[call-arg]
        except ApiException as e:
            if e.status not in (404, 422):
                logger.error("pod %s/%s: removing the scheduling gate failed: %s %s", ns, name, e.status, e.reason)
            continue
        async with store.books.transaction(counted=False):
            store.cache.gated.pop((ns, name), None)
