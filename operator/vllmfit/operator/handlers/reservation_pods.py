"""Reservation pods (the device-plugin backend): the GPU each one reported, or its end."""

from __future__ import annotations

import logging
from typing import Any

import kopf
from kubernetes_asyncio import client

from vllmfit.backends import reservation as rsv
from vllmfit.operator.binding import reservations
from vllmfit.operator.booking.report import post_event
from vllmfit.operator.handlers.common import gone_ok, store_of
from vllmfit.operator.handlers.writes import place

logger = logging.getLogger(__name__)


async def on_reservation(type: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """A reservation pod reported its GPU, or ended: re-book on the GPU it really holds when that
    is another than the one asked for; create or delete reservations; lift gates.

    A reservation that is lost (deleted, evicted, preempted) while its GPU is still booked is
    reported with a ReservationLost Event on the deployments there and asked again for the same
    GPU (`place`: reservations.sync creates it again; a report of another GPU re-books the replica
    there). One that failed (phase Failed or Succeeded: it holds nothing any more) is deleted, and
    so asked again the same way."""
    store = store_of(memo)
    await store.books.ready.wait()
    meta = body.get("metadata") or {}
    name = str(meta.get("name") or "")
    ended = (body.get("status") or {}).get("phase") in ("Failed", "Succeeded")
    async with store.books.changing():
        prev = store.cache.reservations.get(name)
        r = reservations.observe(store, body, type == "DELETED" or ended)
        waiting = None if r is None else rsv.unschedulable(body)
        events = []
        if r is not None and waiting and store.cache.reservation_waits.get(r.name) != waiting:
            store.cache.reservation_waits[r.name] = waiting
            text = (f"the reservation pod {r.name} for {r.node} GPU {r.index} cannot be scheduled: {waiting}; "
                    "the replica waits behind its scheduling gate")
            events = [(store.cache.records[k].body, "Warning", "ReservationPending", text)
                      for k in sorted({b.deployment for b in store.books.ledger.bookings_on(r.node, r.index)})
                      if k in store.cache.records]
        elif r is None or not waiting:
            store.cache.reservation_waits.pop(name, None)
        if r is None:
            store.cache.retiring.discard(name)
        # lost when its end starts: on a real API server an eviction or a deletion first sets a
        # deletionTimestamp (terminating), and the pod leaves the API only later
        if prev is not None and not prev.terminating and (r is None or r.terminating) and name not in store.cache.retiring:
            how = "ended (its pod failed)" if ended and type != "DELETED" else "was deleted, evicted or preempted"
            text = (f"the reservation pod {name} holding {prev.node} GPU {prev.index} {how}; the GPU is asked "
                    "for again (a new reservation pod; the replica is re-booked where it lands)")
            events += [(store.cache.records[k].body, "Warning", "ReservationLost", text)
                       for k in sorted({b.deployment for b in store.books.ledger.bookings_on(prev.node, prev.index)})
                       if k in store.cache.records]
    for event in events:
        post_event(*event)
    if ended and type != "DELETED" and prev is not None:
        await gone_ok(client.CoreV1Api(store.api).delete_namespaced_pod, name, str(meta.get("namespace")))
    if r is not None and r == prev and not events and not ended:
        return  # as it was (the echo of vllmfit's own create, a replay): nothing to place again (issue 32)
    await place(store)
