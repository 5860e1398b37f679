"""A scrape runs on the metrics server's thread while the operator's loop changes the object cache:
it must read copies made on the loop, never walk a dict the loop is changing.

The interleaving is forced at a named point, not left to a sleep: while the scrape counts the DRA
claims (the first claim's `.get("status")`), the loop adds claims and reservation pods (run on the
loop, the scrape thread waiting for it, as the loop would under churn). On code that walks the
loop's dicts from the scrape thread this ends the whole scrape with "dictionary changed size during
iteration" (HTTP 500); here the scrape gets every series, counted from the loop's copy.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from opkit import node
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from vllmfit.backends import reservation as rsv
from vllmfit.operator import metrics
from vllmfit.operator.booking.state import Store


class Churning(dict):  # type: ignore[type-arg]
    """A claim whose first read of its status is the named point where the loop changes the cache."""

    def __init__(self, at_point: Any) -> None:
        super().__init__()
        self.at_point = at_point

    def get(self, key: Any, default: Any = None) -> Any:
        if key == "status":
            self.at_point()
        return super().get(key, default)


async def test_a_scrape_during_churn_reads_copies_made_on_the_loop() -> None:
    store = Store()
    store.rebuild([node("gpu-a", 1)], [])
    loop, home = asyncio.get_running_loop(), threading.get_ident()
    fired: list[str] = []

    def churn() -> None:  # what the loop's handlers do meanwhile: new claims, new reservation pods
        for i in range(3):
            store.cache.claims[f"ns/c{i}"] = {"status": {"allocation": {"devices": {}}}}
            store.cache.reservations[f"r{i}"] = rsv.Reservation(f"r{i}", "gpu-a", 0)

    async def on_loop() -> None:
        churn()

    def at_point() -> None:
        if fired or not armed:
            return
        fired.append("on the loop" if threading.get_ident() == home else "from the scrape thread")
        if threading.get_ident() == home:
            churn()
        else:
            asyncio.run_coroutine_threadsafe(on_loop(), loop).result(10)

    armed = False
    store.cache.claims["ns/first"] = Churning(at_point)
    collector = metrics.register(store)  # on the operator's loop, as the start-up handler calls it
    try:
        armed = True
        first = await asyncio.to_thread(generate_latest, REGISTRY)  # on a thread, as the metrics server scrapes
        second = await asyncio.to_thread(generate_latest, REGISTRY)
    finally:
        metrics.unregister(collector)
    assert fired == ["on the loop"]  # the scrape's reading of the cache ran on the loop
    assert _claims(first) == {"allocated": 0, "pending": 1}  # the copy taken before the churn
    assert _claims(second) == {"allocated": 3, "pending": 1}
    assert sum(_series(second, "vllmfit_reservations").values()) == 3


def _series(text: bytes, name: str) -> dict[str, float]:
    return {s.labels["state"]: s.value for f in text_string_to_metric_families(text.decode()) if f.name == name
            for s in f.samples}


def _claims(text: bytes) -> dict[str, float]:
    return _series(text, "vllmfit_resource_claims")
