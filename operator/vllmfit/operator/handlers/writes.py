"""Writing what a step decided, in the order that keeps a crash safe (`finish`: the write order,
named once, one loop), and making Kubernetes hold what the ledger books (reservation pods,
scheduling gates)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from kubernetes_asyncio import client
from kubernetes_asyncio.client import ApiException

from vllmfit.operator.binding import reservations
from vllmfit.operator.booking import draining
from vllmfit.operator.booking.report import as_json, post_event
from vllmfit.operator.booking.state import Store
from vllmfit.operator.handlers import children
from vllmfit.operator.handlers.children import children_state, sync_children
from vllmfit.operator.handlers.common import Effects, gone_ok
from vllmfit.operator.handlers.decide import resolve_requests_on, retry_waiting, update_node
from vllmfit.operator.rendering import builders

logger = logging.getLogger(__name__)


async def finish(store: Store, fx: Effects, *, strict: bool = True, hold: bool = True, place_later: bool = False) -> None:
    """Apply what a step decided, in the write order named here once (issue 14: after a crash at
    any write, the API holds the booking of whatever runs; issue 29: one loop, no recursion):

    1. post the events;
    2. what stops runs down (its Deployments) before its status releases it;
    3. what starts is booked (its status written) before it runs (its Deployments);
    4. stopped replicas whose pods are gone end their drains (`ended_drains`): their memory is
       free, which may start or admit others: their effects go through 1-4 again;
    5. with `hold`, once nothing is left: Kubernetes is made to hold what the ledger books
       (`rebook`: reservations that got another GPU re-book it, whose effects go through 1-4;
       then reservation pods and scheduling gates).

    `place_later` (a reconcile of the work queue): step 5 is `place_soon`, run in the background.

    With strict, a failed write of the handled object raises (its reconcile is queued again, or
    Kopf retries its handler); other failures (and every later round) are logged and left to the
    resync, which repairs children and statuses that differ from the records."""
    rounds: list[tuple[Effects, bool]] = [(fx, strict)]
    rebooked = not hold or place_later
    while rounds:
        fx, strict = rounds.pop(0)
        # a record being deleted is left to its own deletion (`forget` stops its children and
        # ends its drains): rewritten by a neighbour's step too, each such step listed the pods
        # of its drains (a mass delete: issue 32, --churn)
        fx.sync -= {k for k in fx.sync if (r := store.cache.records.get(k)) is not None and r.going}
        touched(store, fx.sync | fx.mark)
        await _write(store, fx, strict)  # 1-3
        if any(d.stopped for k in fx.sync for d in store.books.drains.of(k)) \
                and (freed := await ended_drains(store, set(fx.sync))) is not None:  # 4
            rounds.append((freed, False))
        if not rounds and not rebooked:  # 5
            rebooked = True
            if (moved := await rebook(store)) is not None:
                rounds.append((moved, False))
    if hold and place_later:
        place_soon(store)
    elif hold:
        await _hold(store)


async def _write(store: Store, fx: Effects, strict: bool) -> None:
    """Steps 1-3 of finish()."""
    for body, type_, reason, message in fx.events:
        post_event(body, type_, reason, message)
    starting = {k for k in fx.sync if (r := store.cache.records.get(k)) is not None and r.admitted}
    stopping = sorted(fx.sync - starting)
    # replicas that move or shrink leave GPUs another key may have just been booked on: first
    ordered = sorted(starting, key=lambda k: (not store.cache.records[k].children, k))
    failed: list[str] = []
    try:
        with store.writer.hold(fx.sync):
            store.writer.mark(fx.mark - fx.sync)
            for key in stopping:
                if await _step(store, key, CHILDREN, strict):
                    await _step(store, key, RELEASE, strict)
                else:
                    failed.append(key)
            for key in ordered:
                # each write awaits: a deletion may have forgotten a later key meanwhile (forget),
                # and nothing of a forgotten record starts (a mass delete: issue 32)
                if (rec := store.cache.records.get(key)) is None:
                    continue
                if failed:  # something that should have stopped may still run: book nothing new
                    logger.warning("%s: not started while %s may still run; the resync retries", key, ", ".join(failed))
                    rec.synced = None
                    continue
                # replicas that stop (scale-down, move) stop before the status releases them
                if (children.stopping(rec) or set(children.waiting_for_drains(store, rec)) & rec.children) \
                        and not await _step(store, key, STOP, strict):
                    continue
                if await _step(store, key, BOOK, strict):
                    await _step(store, key, CHILDREN, strict)
    finally:
        if store.cache.dra_refresh:  # a claim template lost its capacity requests (children.claim_template)
            why, store.cache.dra_refresh = store.cache.dra_refresh, ""
            store.tasks.append(asyncio.create_task(refresh_nodes(store, store.dra_nodes(), why)))


async def settle_drains(store: Store, keys: set[str] | None = None) -> None:
    """End the drains (of `keys`, or all) whose pods are gone, and apply what follows (finish)."""
    freed = await ended_drains(store, keys)
    if freed is not None:
        await finish(store, freed, strict=False)


async def ended_drains(store: Store, keys: set[str] | None = None) -> Effects | None:
    """End the drains (of `keys`, or all) whose pods are gone: list the pods of their
    deployments; a stopped replica none of whose pods is listed (or each one listed has
    terminated) frees its memory: the neighbours' headroom grows, blocked replicas start,
    waiting specs get another chance. Returns what must be written then (None: nothing ended)."""
    drains = store.books.drains
    chosen = drains.values() if keys is None else [d for k in keys for d in drains.of(k)]
    targets = sorted({(d.namespace, d.deployment) for d in chosen if d.stopped})
    if not targets:
        return None
    core, apps = client.CoreV1Api(store.api), client.AppsV1Api(store.api)
    groups = {(d.namespace, d.deployment) for d in chosen if d.stopped and builders.GROUP_JOIN in d.where}
    listed: dict[tuple[str, str], tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]] = {}
    try:
        for ns, name in targets:
            selector = builders.selector(name)
            lwss = await children.list_groups(store, ns, selector) if (ns, name) in groups else []
            sets = await as_json(apps.list_namespaced_replica_set, ns, label_selector=selector)
            pods = await as_json(core.list_namespaced_pod, ns, label_selector=selector)  # after the sets: none is new
            listed[(ns, name)] = pods.get("items") or [], sets.get("items") or [], lwss
    except (ApiException, OSError) as e:
        logger.warning("cannot list the pods of stopped replicas (the resync retries): %s", e)
        return None
    fx = Effects()
    async with store.books.changing():
        done = [n for (ns, name), (pods, sets, lwss) in listed.items()
                for n in draining.ended(store.books.drains, ns, name, pods, sets, lwss)]
        for n in done:
            d = store.books.drains.pop(n)
            fx.mark.update(builders.neighbours(store.books.ledger, builders.gpus_of(store.books.ledger, n)))
            store.books.writing.release(n)
            logger.info("%s replica %d: its pods on %s are gone; its memory is free", d.key, d.replica, d.where)
            if d.key in store.cache.records:
                fx.sync.add(d.key)  # a replica waiting for this GPU may start now
        if done:
            await retry_waiting(store, fx)
    return fx if done else None


@dataclass(frozen=True)
class Write:
    """One kind of write of finish(), named: what it writes (for the log) and how."""

    what: str
    run: Callable[[Store, str], Awaitable[Any]]


BOOK = Write("its status", lambda store, key: store.writer.persist(key))  # what starts is booked first
RELEASE = Write("its status", lambda store, key: store.writer.persist(key, missing_ok=True))  # after it stopped
CHILDREN = Write("its Deployments", lambda store, key: sync_children(store, key))
STOP = Write("its Deployments", lambda store, key: children.stop_children(store, key))


async def _step(store: Store, key: str, write: Write, strict: bool) -> bool:
    """One write of finish(); False when it failed (raised again with strict)."""
    try:
        await write.run(store, key)
        return True
    except (TimeoutError, ApiException, OSError, ValueError) as e:  # ValueError: that spec's (podtemplate)
        if strict and not isinstance(e, ValueError):
            raise
        what = f"{e.status} {e.reason}" if isinstance(e, ApiException) else str(e) or type(e).__name__
        logger.error("%s: writing %s failed: %s", key, write.what, what)
        rec = store.cache.records.get(key)
        if rec is not None:
            rec.synced = None
            post_event(rec.body, "Warning", "SyncFailed", f"writing its Deployments or status failed: {what}")
        return False


def touched(store: Store, keys: set[str]) -> None:
    """These deployments were decided, released or marked (their bookings, or their neighbours',
    changed): the nodes they are placed or booked on are looked at by the next rebook_reported."""
    for k in keys:
        if (rec := store.cache.records.get(k)) is not None:
            store.cache.pins_dirty.update(p.node for p in rec.placement)
        store.cache.pins_dirty.update(b.node for b in store.books.ledger.bookings_of(k))


def pinned_anew(store: Store) -> list[str]:
    """The records whose children may differ from what they were written from for a reason not
    their own (pins learned from reports, a whole-node holder gone or back, a drain that began,
    grew or ended): those placed on a node where such a thing changed since the last look
    (cache.pins_dirty, and the nodes whose drains changed: Drains.take_changed), or all of them
    after a rebuild or a resync that changed something (cache.pins_all; an idle resync compares
    every record itself, handlers.startup.resync_once). Issue 32: looking at every record on every
    event was a quadratic cost at a few hundred deployments, and so was looking again at the
    records beside every drain still under way (a mass delete: hundreds of drains for seconds).
    A record being deleted (`going`) is left to its own deletion."""
    cache, ledger = store.cache, store.books.ledger
    drained = store.books.drains.take_changed()
    if cache.pins_all:
        keys = list(cache.records)
    else:
        nodes = cache.pins_dirty | drained
        keys = sorted({k for n in nodes for k in ledger.deployments_on(n) if k in cache.records})
    cache.pins_all, cache.pins_dirty = False, set()
    # a record being deleted (`forget`) has its children deleted by its own deletion; `finish`
    # drops it from any step's writes, and here its children are not even compared
    return [k for k in keys if not cache.records[k].going]


def rebook_reported(store: Store, fx: Effects) -> list[str]:
    """Reservations that reported another GPU than the one asked for: re-book their replicas on
    the GPU they hold (or give them back when it has not the room); pins learned from reports
    rewrite the replicas' Deployments. Hold the lock. Returns reservations to delete."""
    retire: list[str] = []
    for r in store.cache.reservations.reported_live():
        on_it = {b.deployment for b in store.books.ledger.bookings_on(r.node, r.index)}
        moved, message = reservations.rebook(store, r)
        if message and not moved:  # the GPU it got has not the room: ask again
            store.cache.reservations.pop(r.name, None)
            retire.append(r.name)
            fx.events.extend((store.cache.records[k].body, "Warning", "ReservationMismatch", message)
                             for k in sorted(on_it) if k in store.cache.records)
        for k in sorted(moved):
            if k in store.cache.records:
                fx.events.append((store.cache.records[k].body, "Normal", "Rebooked", message or ""))
            fx.sync.add(k)
            fx.mark.update({k} | builders.neighbours(store.books.ledger, builders.gpus_of(store.books.ledger, k)))
    table = reservations.uuid_table(store)
    for k in pinned_anew(store):  # pins learned from the reports, a whole-node holder gone or back
        rec = store.cache.records[k]
        if rec.admitted and rec.synced is not None and rec.synced != children_state(store, rec, table):
            fx.sync.add(k)
    return retire


async def place(store: Store) -> None:
    """Make Kubernetes hold what the ledger books (finish's step 5 alone: a reservation pod
    changed)."""
    moved = await rebook(store)
    await finish(store, moved or Effects(), strict=False, hold=False)
    await _hold(store)


def place_soon(store: Store) -> None:
    """`place` in the background (store.placing: one pass at a time, one more after it when asked
    meanwhile): the work queue's reconciles do not wait for it, and a burst's share passes."""
    store.placing.soon(lambda: place(store))


async def rebook(store: Store) -> Effects | None:
    """Re-book on the GPUs reservations really got (rebook_reported) and delete the
    reservations that must ask again; returns what must be written then (None: nothing)."""
    fx = Effects()
    try:
        async with store.books.transaction(counted=False):
            retire = rebook_reported(store, fx)
            if fx.sync or fx.mark or retire:
                store.books.changes += 1
        for name in retire:
            store.cache.retiring.add(name)
            await gone_ok(client.CoreV1Api(store.api).delete_namespaced_pod, name, store.options.reservation.namespace)
    except (ApiException, OSError) as e:
        logger.error("placement backend: %s", e)
    return fx if fx.sync or fx.mark or fx.events else None


async def _hold(store: Store) -> None:
    """Create and delete reservation pods on device-plugin nodes, then lift the scheduling gates
    of the replica pods whose GPUs are held."""
    try:
        await reservations.sync(store)
        await reservations.ungate(store)
    except (ApiException, OSError) as e:
        logger.error("placement backend: %s", e)


async def refresh_nodes(store: Store, names: set[str], why: str) -> None:
    """Slices or claims changed: the DRA view of these nodes again (as on_node does)."""
    if not names:
        return
    await resolve_requests_on(store, names)
    fx = Effects()
    async with store.books.changing():
        for name in sorted(names):
            await update_node(store, name, store.effective_node(name, store.cache.node_infos.get(name)), fx,
                              f"has no shareable GPUs any more ({why})")
    await finish(store, fx, strict=False)
