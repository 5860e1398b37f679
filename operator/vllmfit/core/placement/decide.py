"""`decide`: the one entry point the CLI, the webhook and the operator share. Place a deployment
without changing the ledger; when it does not fit, add checked fixes."""

from __future__ import annotations

from dataclasses import replace

from vllmfit.core import memory
from vllmfit.core.placement.fixes import _suggest
from vllmfit.core.placement.inputs import Request
from vllmfit.core.placement.ledger import Decision, Ledger
from vllmfit.core.placement.place import _decide


def decide(ledger: Ledger, req: Request, *, policy: memory.Policy = "vllm", suggest: bool = True) -> Decision:
    """Check and place every replica of `req` without changing the ledger.

    Bookings the deployment already holds are ignored (an update is checked with its own
    allocation released first). Pinned placement is tried first; if it overfits and
    allowReschedule permits, or if nothing is pinned, the best-fit search runs over every
    node matching the node selector. When it does not fit, `suggestions` lists changes that
    were each checked to make it fit (omitted with suggest=False).
    """
    own = ledger.release(req.key)
    try:
        d = _decide(ledger, req, policy)
        if suggest and d.phase == "Unschedulable":
            fixes = tuple(_suggest(ledger, req, policy))
            d = replace(
                d,
                suggestions=fixes,
                message=d.message + (". Fits with: " + "; or ".join(fixes) if fixes else ""),
            )
        return d
    finally:
        ledger._add(req.key, own)
