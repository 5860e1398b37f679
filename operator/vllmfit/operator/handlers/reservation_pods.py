"""Reservation pods (the device-plugin backend): the GPU each one reported, or its end."""

from __future__ import annotations

import logging
from typing import Any

import kopf

from vllmfit.backends import reservation as rsv
from vllmfit.operator import reservations
from vllmfit.operator.handlers.common import post_event
from vllmfit.operator.handlers.writes import place
from vllmfit.operator.state import get_store

logger = logging.getLogger(__name__)


async def on_reservation(type: str | None, body: kopf.Body, **_: Any) -> None:
    """A reservation pod reported its GPU, or ended: re-book on the GPU it really holds when that
    is another than the one asked for; create or delete reservations; lift gates."""
    store = get_store()
    await store.ready.wait()
    async with store.changing():
        r = reservations.observe(store, body, type == "DELETED")
        waiting = None if r is None else rsv.unschedulable(body)
        events = []
        if r is not None and waiting and store.reservation_waits.get(r.name) != waiting:
            store.reservation_waits[r.name] = waiting
            text = (f"the reservation pod {r.name} for {r.node} GPU {r.index} cannot be scheduled: {waiting}; "
                    "the replica waits behind its scheduling gate")
            events = [(store.records[k].body, "Warning", "ReservationPending", text)
                      for k in sorted({b.deployment for b in store.ledger.bookings_on(r.node, r.index)})
                      if k in store.records]
        elif r is None or not waiting:
            store.reservation_waits.pop(str((body.get("metadata") or {}).get("name")), None)
    for event in events:
        post_event(*event)
    await place(store)
