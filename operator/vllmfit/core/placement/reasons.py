"""Why a deployment does not fit: one line per node, like the kube-scheduler's messages."""

from __future__ import annotations

from collections.abc import Sequence

from vllmfit.core.memory import Settings, fmt_gib
from vllmfit.core.placement.inputs import Request, gpu_label
from vllmfit.core.placement.ledger import Ledger, NodeSet
from vllmfit.core.placement.search import _UNLIMITED, _full_sizing, _min_need, _shrinkable


def _why_not(
    ledger: Ledger, req: Request, s: Settings, matching: NodeSet | None, only: Sequence[str] | None = None
) -> list[str]:
    """Why no node (or no node of `only`) takes one more replica, like the scheduler says it: one
    line per node with what its best GPU group needs and has, the closest to fitting first (then by
    name), then one line for the nodes the nodeSelector excludes."""
    allowed = ledger.nodes.keys() if matching is None else matching.members
    names = sorted(only if only is not None else ledger.nodes)
    lines = sorted(_node_why_not(ledger, req, s, name) for name in names if name in allowed)
    out = [line for _, line in lines]
    excluded = [name for name in names if name not in allowed]
    if excluded:
        who = ", ".join(excluded) if len(excluded) <= 3 else f"{len(excluded)} nodes"
        out.append(f"{who}: {'does' if len(excluded) == 1 else 'do'} not match the nodeSelector")
    return out


def _node_why_not(ledger: Ledger, req: Request, s: Settings, name: str) -> tuple[tuple[int, str], str]:
    """((sort key: least missing first, name), 'node: what its best group needs and has')."""
    n = s.gpus
    node = ledger.nodes[name]
    parts = []
    missing = _UNLIMITED
    types = sorted({sl.gpu for sl in node.gpus if n == 1 or not sl.mig}, key=lambda t: t.product)
    for t in types:
        label = f" {t.product}" if len(types) > 1 else ""
        full = _full_sizing(req.model, s, t)
        need = _min_need(req.model, s, t)
        if isinstance(full, str) or need is None or not full.fits:
            parts.append(f"{t.product}: {full if isinstance(full, str) else '; '.join(full.reasons)}")
            continue
        heads = sorted(
            ((ledger._head[(name, sl.index)], sl.index) for sl in node.gpus if sl.gpu == t),
            key=lambda e: (-e[0], e[1]),
        )
        least = "at least " if _shrinkable(s) else ""
        if len(heads) < n:
            parts.append(f"needs {n} GPUs{label or ' of one type'}, has {len(heads)}")
            continue
        h, i = heads[n - 1]
        missing = min(missing, need - h)
        if n == 1:
            parts.append(f"{gpu_label(i)}{label} needs {least}{fmt_gib(need)}, {fmt_gib(max(h, 0))} free")
        else:
            ok = sum(1 for hh, _ in heads if hh >= need)
            parts.append(
                f"needs {n}{label} GPUs with {least}{fmt_gib(need)} free, {ok} have "
                f"({gpu_label(i)}: {fmt_gib(max(h, 0))})"
            )
    return (missing, name), f"{name}: " + (", ".join(parts) if parts else "no GPUs")
