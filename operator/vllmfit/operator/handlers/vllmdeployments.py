"""VLLMDeployment: create, update, resume, the events of every object (a peer's statuses
after a fail-over, deletions) and delete."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

import kopf
from kubernetes_asyncio import client

from vllmfit.core.placement import Request
from vllmfit.operator import metrics
from vllmfit.operator.admission import bounded
from vllmfit.operator.booking import draining
from vllmfit.operator.booking.record import ModelResolutionError, key_of
from vllmfit.operator.booking.state import Store
from vllmfit.operator.handlers.children import children_state
from vllmfit.operator.handlers.common import Effects, Invalid, checked, now, store_of
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

logger = logging.getLogger(__name__)


async def reconcile(store: Store, body: Mapping[str, Any], *, force: bool) -> None:
    """create/update/resume: decide (or, when already admitted for this generation, only
    re-write the children and status), book, write."""
    await store.books.ready.wait()
    await lead(store)  # a new leader sweeps before it admits
    t0 = time.monotonic()
    fx = Effects()
    req: Request | None = None
    transient: str | None = None
    try:
        req = await store.request_for(await checked(store, body))
    except Invalid as e:
        problem = ("Rejected", "InvalidSpec", str(e))
    except ModelResolutionError as e:
        problem = ("Pending", "ModelUnavailable", str(e)) if e.transient else ("Rejected", "ModelNotFound", str(e))
        transient = str(e) if e.transient else None
    async with store.books.lock:
        rec = store.cache.upsert(body)  # under the lock: a resync may have replaced the record
        if req is None:
            store.books.changes += 1
            rec.observed_generation = rec.generation
            not_admitted(rec, *problem, fx, t=now())
            refresh_ready(rec, now())
            fx.mark.add(rec.key)
        elif (not force and rec.admitted and rec.observed_generation == rec.generation
              and not store.books.misplaced(rec.key)):  # nothing to decide (a resume, a repeated event)
            rec.request = req
            if rec.admitted_request is None and not rec.waiting:
                rec.admitted_request = req
            if rec.synced != children_state(store, rec):  # a resume after a restart, or an earlier write failed
                fx.sync.add(rec.key)
            fx.mark.add(rec.key)
        elif (not force and not rec.admitted and rec.request is not None and rec.outcome != "Pending"
              and rec.observed_generation == rec.generation):
            rec.request = req  # decided for this generation already; waiting specs are retried when room frees up
            fx.mark.add(rec.key)
        else:
            store.books.changes += 1
            lost = rec.admitted and store.books.misplaced(rec.key)  # its node or GPUs are gone (a restart after)
            keep = scale_keep(store, rec, req)
            d = await bounded.decide(store.books.ledger, req, keep=keep)
            if lost and not d.admitted:  # nothing to keep serving: it is evicted, as on_node would have
                draining.hold(store.books.ledger, store.books.drains, rec.key, store.books.ledger.release(rec.key))
                rec.admitted = False
            held = sum(b.footprint.total for b in store.books.ledger.bookings_of(rec.key))
            apply_decision(store, rec, req, d, fx, cause="its GPUs are gone or over budget" if lost else "")
            if sum(b.footprint.total for b in store.books.ledger.bookings_of(rec.key)) < held:
                await retry_waiting(store, fx)  # it books less (scale-down, smaller spec): room may be free
    await finish(store, fx)
    metrics.RECONCILE.observe(time.monotonic() - t0)
    if transient:
        raise kopf.TemporaryError(transient, delay=30)


async def on_create(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    await reconcile(store_of(memo), body, force=False)


async def on_update(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    await reconcile(store_of(memo), body, force=True)


async def on_resume(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    await reconcile(store_of(memo), body, force=False)


async def on_event(type: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """A status this process did not write is news from the previous active peer (after a
    fail-over, Kopf replays every object): take its bookings, so nothing it admitted is lost.
    An object it never heard of is decided (idempotent: the create handler may do it too).
    A deletion seen here frees the booking even when the finalizer was never set (an object
    deleted right after its creation: the delete handler never runs for it)."""
    store = store_of(memo)
    await store.books.ready.wait()
    await lead(store)  # a new leader sweeps before it admits
    if type == "DELETED":
        await forget(store, body)
        return
    if (body.get("metadata") or {}).get("deletionTimestamp"):
        return
    rec = store.cache.records.get(key_of(body))
    children = None
    if (body.get("status") or {}).get("memory") and not (rec is not None and rec.mine):
        children = await children_of(store, body)  # a status books only what runs where it says
    async with store.books.lock:
        took = store.adopt(body, children)
        if took:
            store.books.changes += 1
            logger.info("%s: took the status another replica wrote", key_of(body))
    if took is None:
        logger.warning("%s: its status books replicas that do not run where it says; not taken, decided again",
                       key_of(body))
        await reconcile(store, body, force=True)
        return
    if key_of(body) not in store.cache.records:  # handled by a peer that died before writing its status
        await reconcile(store, body, force=False)


async def children_of(store: Store, body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The Deployments of vllmfit for this VLLMDeployment (found by label), as JSON."""
    meta = body.get("metadata") or {}
    listed = await client.AppsV1Api(store.api).list_namespaced_deployment(
        meta.get("namespace") or "default", label_selector=builders.selector(str(meta.get("name"))))
    return store.api.sanitize_for_serialization(listed).get("items") or []


async def forget(store: Store, body: Mapping[str, Any]) -> None:
    """The object is going or gone: stop its Deployments and bare pods first, then free its GPUs
    (so a crash in between leaves its booking, never a pod on GPUs booked to another) once its
    pods are gone: until then its replicas are drains (vllmfit.operator.booking.draining, settled by
    writes.settle_drains from the pods the API lists); its neighbours' headroom grows then and
    waiting specs get another chance."""
    key = key_of(body)
    rec = store.cache.records.get(key)
    uid = (body.get("metadata") or {}).get("uid")
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
        for d in draining.hold(store.books.ledger, store.books.drains, key, store.books.ledger.release(key)):
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
