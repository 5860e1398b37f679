"""How webhook reviews are bounded and shared between tenants (issue 29): the time budget of one
review, the fail-open setting, and the per-namespace count of reviews deciding. The review itself
is operator/admission/webhook.py's (`review`, `late`)."""

from __future__ import annotations

import asyncio

from vllmfit.core import defaults


class Admission:
    """How reviews are bounded (state passed in, one per webhook): the time budget of one review,
    the fail-open setting, and the per-namespace count of reviews deciding (fairness: a tenant
    whose reviews are costly waits for its own, never for another's)."""

    def __init__(self, *, fail_open: bool = False, budget_s: float = defaults.REVIEW_BUDGET_S,
                 per_namespace: int = defaults.REVIEW_PER_NAMESPACE) -> None:
        self.fail_open, self.budget_s, self.per_namespace = fail_open, budget_s, per_namespace
        self._deciding: dict[str, int] = {}  # namespace -> reviews deciding (threads running)
        self._freed: dict[str, asyncio.Event] = {}

    async def slot(self, namespace: str, deadline: float) -> bool:
        """Take one of the namespace's places before `deadline` (loop time); False if none freed."""
        while self._deciding.get(namespace, 0) >= self.per_namespace:
            freed = self._freed.setdefault(namespace, asyncio.Event())
            try:
                async with asyncio.timeout_at(deadline):
                    await freed.wait()
            except TimeoutError:
                return False
        self._deciding[namespace] = self._deciding.get(namespace, 0) + 1
        return True

    def free(self, namespace: str) -> None:
        n = self._deciding.get(namespace, 0) - 1
        if n > 0:
            self._deciding[namespace] = n
        else:
            self._deciding.pop(namespace, None)
        if (freed := self._freed.pop(namespace, None)) is not None:
            freed.set()  # every waiter looks again; one takes the place
