"""VLLMDeployment: the events of every object queue it to be reconciled (created, changed, seen
again at start-up; a peer's statuses after a fail-over are taken first; deletions free it), the
queue's workers reconcile it, and delete."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import kopf
from kubernetes_asyncio import client

from vllmfit.core import defaults
from vllmfit.core.placement import Decision, Ledger, Request
from vllmfit.operator import metrics
from vllmfit.operator.admission import bounded
from vllmfit.operator.booking import draining
from vllmfit.operator.booking.books import Stale
from vllmfit.operator.booking.record import Record, key_of
from vllmfit.operator.booking.report import as_json, now
from vllmfit.operator.booking.state import Store
from vllmfit.operator.handlers.children import children_state
from vllmfit.operator.handlers.common import Effects, Invalid, checked, store_of
from vllmfit.operator.handlers.decide import (
    apply_decision,
    not_admitted,
    refresh_ready,
    retry_waiting,
    scale_keep,
)
from vllmfit.operator.handlers.sweep import lead, sweep
from vllmfit.operator.handlers.writes import finish, settle_drains
from vllmfit.operator.rendering import builders
from vllmfit.sources.resolve import ModelResolutionError

logger = logging.getLogger(__name__)


async def reconcile(store: Store, body: Mapping[str, Any], *, force: bool, place_later: bool = False) -> None:
    """A key of the work queue (booking.workqueue; `enqueue`): decide (or, when already admitted
    for this generation, only re-write the children and status), book, write. `place_later`: the
    reservation pass that follows is run in the background (`writes.place_soon`), not awaited:
    the queue's workers go on to the next key, and a burst's reconciles share passes.

    The decision is taken on the committed snapshot, without the writer's lock (issue 29): the
    search runs in a worker while other handlers change the ledger. It is committed under the
    lock only if the ledger is still the snapshot it was decided on (`Books.check`); otherwise
    (Stale) it is decided again on the new snapshot. After defaults.OPTIMISTIC_DECISIONS stale
    tries it is decided holding the lock, which nothing can make stale: every reconcile ends, and
    no two reconciles can both book the last room on a GPU. While another reconcile is deciding
    too (`Books.alone`: a burst of creates), one of them would make the other's snapshot stale,
    so it decides holding the lock at once: each decided once, in the lock's order (issue 32)."""
    await store.books.ready.wait()
    await lead(store)  # a new leader sweeps before it admits
    if settled(store, store.cache.records.get(key_of(body)), (body.get("metadata") or {}).get("generation"), force):
        return  # queued again by news that changed nothing it reads: nothing to read, decide or write
    t0 = time.monotonic()
    fx = Effects()
    req: Request | None = None
    problem: tuple[str, str, str] | None = None
    transient: str | None = None
    try:
        req = await store.request_for(await checked(store, body))
    except Invalid as e:
        problem = ("Rejected", "InvalidSpec", str(e))
    except ModelResolutionError as e:
        problem = ("Pending", "ModelUnavailable", str(e)) if e.transient else ("Rejected", "ModelNotFound", str(e))
        transient = str(e) if e.transient else None
    key = key_of(body)
    generation = (body.get("metadata") or {}).get("generation")
    done: str | None = None
    store.books.deciding += 1
    try:
        for attempt in range(defaults.OPTIMISTIC_DECISIONS + 1):
            optimistic = attempt < defaults.OPTIMISTIC_DECISIONS and store.books.alone()
            decided: Decided | None = None
            if req is not None and optimistic:
                snapshot, based_on = store.books.snapshot(), store.books.version  # read together: no await between
                seen = store.cache.records.get(key)
                if not decided_already(store, seen, generation, force, snapshot):
                    keep = scale_keep(snapshot, seen, req) if seen is not None else []
                    decided = Decided(based_on, keep, await bounded.decide(store.workers, snapshot, req, keep=keep))
            try:
                async with store.books.transaction(counted=False):
                    if (done := await commit(store, body, req, problem, force, fx, decided,
                                             under_lock=not optimistic)) is not None:
                        break
            except Stale as e:
                logger.info("%s: %s; deciding again on the new snapshot", key, e)
    finally:
        store.books.deciding -= 1
    # Kept as it was (queued again by news that changed nothing, seen again at start-up): nothing
    # was booked or released, so Kubernetes holds what it held; the reservation pass and the
    # re-booking look at the whole ledger and wait for a step that changes it (issue 32).
    await finish(store, fx, hold=not (done == KEPT and not fx.sync), place_later=place_later)
    metrics.RECONCILE.observe(time.monotonic() - t0)
    if transient:
        raise kopf.TemporaryError(transient, delay=30)


@dataclass(frozen=True)
class Decided:
    """A decision taken outside the lock: on the snapshot numbered `based_on`, keeping `keep`."""

    based_on: int
    keep: list[Any]
    decision: Decision


def decided_already(store: Store, rec: Record | None, generation: Any, force: bool,
                    ledger: Ledger | None = None) -> bool:
    """Nothing to decide for this event (a resume, a repeated event): admitted for this
    generation and still where it fits, or refused for this generation (a waiting spec is
    retried when room frees up). `ledger`: the writer's, or the snapshot a decision would use."""
    if rec is None or force or rec.observed_generation != generation:
        return False
    if rec.admitted:
        return not store.books.misplaced(rec.key, ledger)
    return rec.request is not None and rec.outcome != "Pending"


def settled(store: Store, rec: Record | None, generation: Any, force: bool) -> bool:
    """Nothing at all to do for this event, seen without the writer's lock: decided for this
    generation already (`decided_already`, on the committed ledger) and, when admitted, its
    children written from what it is now (`children_state`). A key queued again by news that
    changed nothing it reads (its own status's echo that came while it ran, a forced event
    decided meanwhile) ends here instead of reading the spec again and queueing for the lock;
    anything else takes the whole path."""
    if rec is None or not decided_already(store, rec, generation, force, store.books.committed):
        return False
    return not rec.admitted or (rec.synced is not None and rec.synced == children_state(store, rec))


KEPT, APPLIED = "kept", "applied"  # what commit() did: nothing to decide for this event, or applied


async def commit(store: Store, body: Mapping[str, Any], req: Request | None, problem: tuple[str, str, str] | None,
                 force: bool, fx: Effects, decided: Decided | None, *, under_lock: bool) -> str | None:
    """Under the writer's lock: apply what reconcile found to the record and the ledger. Raises
    Stale when `decided` was taken on a ledger that is no longer the writer's; returns None when
    a decision is needed that was not taken (decide again), KEPT when there was nothing to decide
    (decided for this generation already: only its children and status are looked at again),
    APPLIED when a decision or a refusal was applied. `under_lock`: past the optimistic tries,
    decide here, holding the lock."""
    rec = store.cache.upsert(body)  # under the lock: a resync may have replaced the record
    rec.resumed = False
    for held in (rec.admitted_request, rec.request):  # one parsed spec per deployment, not one per event
        if req is not None and held is not None and held is not req and held == req:
            req = held
    if req is None:
        assert problem is not None
        store.books.changes += 1
        rec.observed_generation = rec.generation
        not_admitted(rec, *problem, fx, t=now())
        refresh_ready(rec, now())
        fx.mark.add(rec.key)
        return APPLIED
    if decided_already(store, rec, rec.generation, force):
        if rec.admitted:
            rec.request = req
            if rec.admitted_request is None and not rec.waiting:
                rec.admitted_request = req
            if rec.synced != children_state(store, rec):  # a resume after a restart, or an earlier write failed
                fx.sync.add(rec.key)
        else:
            rec.request = req  # decided for this generation already; waiting specs are retried when room frees up
        if rec.key in fx.sync:
            fx.mark.add(rec.key)
        else:  # nothing of it changed: its status is looked at again, no other record's children
            store.writer.mark([rec.key])
        return KEPT
    keep = scale_keep(store.books.ledger, rec, req)
    if under_lock:
        d = await bounded.decide(store.workers, store.books.ledger, req, keep=keep)
    elif decided is None:
        return None  # it looked decided already when the snapshot was taken
    else:
        store.books.check(decided.based_on)  # raises Stale: the ledger moved since the snapshot
        if decided.keep != keep:  # its record changed meanwhile (what a scale keeps)
            store.books.stale += 1
            raise Stale("the record changed since the snapshot")
        d = decided.decision
    store.books.changes += 1
    lost = rec.admitted and store.books.misplaced(rec.key)  # its node or GPUs are gone (a restart after)
    if lost and not d.admitted:  # nothing to keep serving: it is evicted, as on_node would have
        draining.hold(store.books.writing, store.books.drains, rec.key, store.books.writing.release(rec.key))
        rec.admitted = False
    held = sum(b.footprint.total for b in store.books.ledger.bookings_of(rec.key))
    apply_decision(store, rec, req, d, fx, cause="its GPUs are gone or over budget" if lost else "")
    if sum(b.footprint.total for b in store.books.ledger.bookings_of(rec.key)) < held:
        await retry_waiting(store, fx)  # it books less (scale-down, smaller spec): room may be free
    return APPLIED


def enqueue(store: Store, body: Mapping[str, Any], *, force: bool = False) -> None:
    """Queue this object to be reconciled (the work queue's workers run `reconcile`)."""
    store.queue.start(lambda latest, forced: reconcile(store, latest, force=forced, place_later=True),
                      on_error=lambda key, e: metrics.RECONCILE_ERRORS.labels("reconcile").inc())
    store.queue.add(body, force=force)


def wanted(store: Store, body: Mapping[str, Any]) -> bool:
    """Whether an event of this object needs a reconcile: a new object, a new generation (its spec
    changed), one not decided for its generation, or one read back at start-up and not reconciled
    since (its decision and its children are checked, as Kopf's resume handlers did). The echoes of
    the operator's own writes need none, nor a status taken from a peer (Store.adopt)."""
    rec = store.cache.records.get(key_of(body))
    generation = (body.get("metadata") or {}).get("generation")
    return rec is None or rec.resumed or rec.generation != generation or rec.observed_generation != generation


async def on_event(type: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """Every event of a VLLMDeployment. A status this process did not write is news from the
    previous active peer (after a fail-over, Kopf replays every object): take its bookings, so
    nothing it admitted is lost. Then the object is queued to be reconciled when it needs it
    (`wanted`: new, changed, or seen again at start-up). A deletion seen here frees the booking
    even when the finalizer was never set (an object deleted right after its creation: the
    delete handler never runs for it)."""
    store = store_of(memo)
    await store.books.ready.wait()
    await lead(store)  # a new leader sweeps before it admits
    if type == "DELETED":
        await forget(store, body)
        return
    if (body.get("metadata") or {}).get("deletionTimestamp"):
        return
    took: bool | None = False
    if store.news(body):  # else nothing to take (its own writes' echoes, a new object): no listing, no lock
        children = None
        if (body.get("status") or {}).get("memory"):
            children = await children_of(store, body)  # a status books only what runs where it says
        async with store.books.transaction(counted=False):
            took = store.adopt(body, children)
            if took:
                store.books.changes += 1
                logger.info("%s: took the status another replica wrote", key_of(body))
    if took is None:
        logger.warning("%s: its status books replicas that do not run where it says; not taken, decided again",
                       key_of(body))
        enqueue(store, body, force=True)
    elif wanted(store, body):
        enqueue(store, body)


async def children_of(store: Store, body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The Deployments of vllmfit for this VLLMDeployment (found by label), as JSON."""
    meta = body.get("metadata") or {}
    listed = await as_json(client.AppsV1Api(store.api).list_namespaced_deployment,
                           meta.get("namespace") or "default", label_selector=builders.selector(str(meta.get("name"))))
    return listed.get("items") or []


async def forget(store: Store, body: Mapping[str, Any]) -> None:
    """The object is going or gone: stop its Deployments and bare pods first, then free its GPUs
    (so a crash in between leaves its booking, never a pod on GPUs booked to another) once its
    pods are gone: until then its replicas are drains (vllmfit.operator.booking.draining, settled by
    writes.settle_drains from the pods the API lists); its neighbours' headroom grows then and
    waiting specs get another chance."""
    key = key_of(body)
    uid = (body.get("metadata") or {}).get("uid")
    await store.queue.forget(key, uid)  # no reconcile of it runs after this, nor alongside the release
    rec = store.cache.records.get(key)
    if rec is None or (uid and (rec.body.get("metadata") or {}).get("uid") not in (None, uid)):
        return  # already forgotten, or a new object of the same name
    rec.going = True  # no booking covers its children any more; sync_children only deletes
    async with store.cache.child_locks[key]:
        pass  # a write of its children in flight ends first
    await sweep(store, rec.namespace, only=rec.name)
    rec.children.clear()
    fx = Effects()
    async with store.books.changing():
        if store.cache.records.get(key) is not rec:
            return
        before = builders.gpus_of(store.books.ledger, key)
        for d in draining.hold(store.books.writing, store.books.drains, key, store.books.writing.release(key)):
            d.stopped = True  # its Deployments and bare pods were deleted (sweep)
        store.cache.records.pop(key, None)
        fx.mark.update(builders.neighbours(store.books.ledger, before))
        if before:
            await retry_waiting(store, fx)
    await finish(store, fx, strict=False)
    await settle_drains(store, {key})


async def on_delete(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """Free its GPUs once its Deployments are gone (forget). A failed deletion raises: Kopf
    retries and the finalizer stays."""
    store = store_of(memo)
    await store.books.ready.wait()
    await forget(store, body)
