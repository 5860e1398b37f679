"""The reconcile queue (one of the operator's state objects, state.Store.queue): the VLLMDeployments
to reconcile, each once at a time, by a bounded number of workers, as controller-runtime's work
queue does for a kubebuilder controller.

A watch event only adds its object's key with the latest body seen (`add`: what a record keeps of
it, booking.record.kept_body); the event handler returns at once, so Kopf lets the event go. A key
is in the queue at most once, and one worker reconciles it at a time: events that arrive while it
is queued only replace its body; events that arrive while it is being reconciled queue it once
more, to run after. A reconcile that fails is queued again after a delay (the delay its error
names, kopf.TemporaryError's, else a backoff that doubles per failure in a row, up to
RETRY_MAX_S); one that succeeds resets its backoff.

Why (docs/operator.md, "A burst"): with the reconcile awaited inside Kopf's handler, every object
of a burst (thousands applied at once, or a restart) was in flight at once, each holding Kopf's
event, its contexts and a parsed spec while it waited for the writer's lock: the operator's peak
memory grew with the burst. Here it grows with `workers`.

Owner: the operator's event loop. Every method runs on it; nothing here is shared with a thread."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from vllmfit.operator.booking.record import kept_body, key_of

logger = logging.getLogger(__name__)

RETRY_MIN_S = 1.0
RETRY_MAX_S = 60.0

Run = Callable[[Mapping[str, Any], bool], Awaitable[None]]
"""What a worker runs for a key: (the latest body, force)."""


class WorkQueue:
    """Keys to reconcile with the latest body of each, worked by at most `workers` at once."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self._latest: dict[str, tuple[dict[str, Any], bool]] = {}  # key -> (kept body, force): to run
        self._ready: deque[str] = deque()  # keys to run, in the order they came (each at most once)
        self._active: dict[str, asyncio.Event] = {}  # keys a worker runs now -> set when it ends
        self._failures: dict[str, int] = {}  # key -> failures in a row (its backoff)
        self._later: dict[str, asyncio.TimerHandle] = {}  # key -> its retry, waiting for its delay
        self._wake = asyncio.Event()
        self._run: Run | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._on_error: Callable[[str, Exception], None] = lambda key, e: None

    def start(self, run: Run, on_error: Callable[[str, Exception], None] | None = None) -> None:
        """Start the workers (once; later calls change nothing). `on_error`: told of each failed
        run (metrics), before it is queued again."""
        if self._tasks:
            return
        self._run = run
        self._on_error = on_error or self._on_error
        self._tasks = [asyncio.create_task(self._work(), name=f"vllmfit reconcile worker {i}")
                       for i in range(self.workers)]

    async def stop(self) -> None:
        for handle in self._later.values():
            handle.cancel()
        self._later.clear()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []

    def add(self, body: Mapping[str, Any], *, force: bool = False) -> None:
        """Reconcile this object soon, from this body (or a later one). `force`: decide it again
        even when it was decided for its generation (kept until it runs)."""
        key = key_of(body)
        held = self._latest.get(key)
        self._latest[key] = (kept_body(body), force or (held is not None and held[1]))
        if (handle := self._later.pop(key, None)) is not None:
            handle.cancel()  # new news: now, not after the retry's delay
        if held is None and key not in self._active:
            self._ready.append(key)
            self._wake.set()

    async def forget(self, key: str, uid: str | None = None) -> None:
        """The object (of this `uid`) is being deleted: drop its waiting run and its retry, and wait
        until a run of it under way has ended (the deletion then frees whatever that run booked).
        Its events queue it no more (handlers.vllmdeployments.on_event). A waiting run of a new
        object of the same name stays."""
        held = self._latest.get(key)
        if held is not None and uid and (held[0].get("metadata") or {}).get("uid") not in (None, uid):
            return
        self._latest.pop(key, None)  # its place in `_ready` is skipped
        self._failures.pop(key, None)
        if (handle := self._later.pop(key, None)) is not None:
            handle.cancel()
        if (ended := self._active.get(key)) is not None:
            await ended.wait()
        self._latest.pop(key, None)  # news that came while it ran: not run

    def busy(self) -> bool:
        """Keys wait or run (retries waiting for their delay are not counted)."""
        return bool(self._ready or self._active)

    def depth(self) -> int:
        """Keys waiting to run, not yet taken by a worker."""
        return len(self._ready)

    async def join(self, timeout: float = 30.0) -> None:
        """Wait until no key waits or runs (tests, benchmarks)."""
        async with asyncio.timeout(timeout):
            while self.busy():
                await asyncio.sleep(0.005)

    async def _work(self) -> None:
        assert self._run is not None
        while True:
            while not self._ready:
                self._wake.clear()
                await self._wake.wait()
            key = self._ready.popleft()
            if key not in self._latest or key in self._active:
                continue  # forgotten (its object deleted), or queued twice meanwhile
            body, force = self._latest.pop(key)
            ended = self._active[key] = asyncio.Event()
            try:
                await self._run(body, force)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - a worker outlives any one key's error
                self._retry(key, body, force, e)
            else:
                self._failures.pop(key, None)
            finally:
                del self._active[key]
                ended.set()
                if key in self._latest:  # news came while it ran: once more, from the latest body
                    self._ready.append(key)
                    self._wake.set()

    def _retry(self, key: str, body: dict[str, Any], force: bool, error: Exception) -> None:
        n = self._failures[key] = self._failures.get(key, 0) + 1
        named = getattr(error, "delay", None)
        delay = float(named) if isinstance(named, int | float) else min(RETRY_MAX_S, RETRY_MIN_S * 2 ** (n - 1))
        logger.warning("%s: %s; reconciled again in %g s", key, error or type(error).__name__, delay)
        self._on_error(key, error)

        def again() -> None:
            self._later.pop(key, None)
            if key not in self._latest:  # else newer news is queued already
                self.add(body, force=force)

        if key not in self._latest:
            self._later[key] = asyncio.get_running_loop().call_later(delay, again)


class Rerun:
    """A background step many callers ask for (`soon`) and none waits for: one run at a time,
    and one more after it when asked while it ran (the reservation pass after reconciles of a
    burst: handlers.writes.place_soon). Owner: the operator's event loop."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._task: asyncio.Task[None] | None = None
        self._again = False

    def soon(self, step: Callable[[], Awaitable[None]]) -> None:
        self._again = True
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._loop(step), name=self.name)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _loop(self, step: Callable[[], Awaitable[None]]) -> None:
        while self._again:
            self._again = False
            try:
                await step()
            except Exception:  # logged; the next ask, or the resync, runs it again
                logger.exception("%s failed", self.name)
