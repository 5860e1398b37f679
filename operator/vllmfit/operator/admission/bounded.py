"""Placement decisions with a time limit, off the event loop, in a worker that can be abandoned
(issue 14: bounded work).

`decide` runs `placement.decide` in a thread of a small pool, on a snapshot of the ledger
(Ledger.snapshot: frozen, structurally shared, taken in microseconds), and waits at most a time
limit. Past it, the caller gets a Rejected decision that says why ("too costly to decide"), the
event loop never stopped serving (Kopf's handlers, the liveness probe, the webhook), and the
thread is abandoned: it works on a snapshot nobody changes, so whatever it does later touches
nothing the operator uses, and its result is dropped. The pools are the Store's (state.Workers:
nothing here is global); webhook reviews use their own pool (`Workers.review`), so the operator's decisions and the tenants' reviews never wait for each other.

Why a thread and not a process: a worker process needs the ledger pickled and unpickled on every
decision (1,000 nodes x 8 GPUs, 4,000 deployments: 20 ms + 120 ms, measured), more than the
decision itself (at most about 0.1 s for the worst spec within core.limits); the copy a thread
needed took 6 ms (a snapshot now takes microseconds). A Python thread cannot be killed, so the core is also kept cheap and bounded
(core.limits: layers, heads, experts, vocabulary, context, replicas, TP, PP): the time limit is
the second line of defence, not the first. An abandoned thread holds one of DECIDE_WORKERS
workers until it ends; when all are held, further decisions wait and time out, and are denied:
bounded either way.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from vllmfit.core import defaults, placement

logger = logging.getLogger(__name__)
T = TypeVar("T")

class TooCostly(Exception):
    """A decision did not finish within its limit (message: one line for the user)."""


async def run(workers: Any, fn: Callable[..., T], *args: Any, timeout: float, **kwargs: Any) -> T:
    """fn(*args, **kwargs) in the operator's pool (`workers`: the Store's state.Workers); raises
    TooCostly after `timeout` seconds. The arguments must not be shared with the event loop's
    state (pass copies): the call may go on after it."""
    fut = asyncio.get_running_loop().run_in_executor(workers.decide(), functools.partial(fn, *args, **kwargs))
    try:
        async with asyncio.timeout(timeout):
            return await asyncio.shield(fut)
    except TimeoutError:
        workers.give_up()
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())  # nobody waits for it: no warning
        raise TooCostly(too_costly_message(timeout)) from None


def too_costly_message(timeout: float) -> str:
    return (f"deciding where it fits took more than {timeout:g} s, so vllmfit refuses it; "
            "lower spec.replicas or the model's sizes")


def too_costly(req: placement.Request, e: TooCostly) -> placement.Decision:
    logger.warning("%s: %s", req.key, e)
    return placement.Decision(req.key, "Rejected", reasons=(str(e),), message=str(e))


async def decide(workers: Any, ledger: placement.Ledger, req: placement.Request, *, timeout: float | None = None,
                 **kwargs: Any) -> placement.Decision:
    """placement.decide(ledger, req, **kwargs) in `workers`' pool within `timeout` (default
    DECIDE_TIMEOUT_S), else Rejected with a message. Decides on `ledger.snapshot()`: the ledger as
    it is now (a committed snapshot is its own), which the caller applies the decision to."""
    try:
        return await run(workers, placement.decide, ledger.snapshot(), req, timeout=timeout or defaults.DECIDE_TIMEOUT_S, **kwargs)
    except TooCostly as e:
        return too_costly(req, e)
