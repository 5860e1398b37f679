"""Placing every replica of one deployment: pinned placement first, then the search; the same
context and concurrency for all replicas. No suggestions (see `decide`)."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from vllmfit.core import defaults, memory
from vllmfit.core.memory import Footprint, Settings, Sizing, SpecError, fmt_gib
from vllmfit.core.model.facts import GpuType, ModelArch
from vllmfit.core.placement import affinity, bulk, gang, summary
from vllmfit.core.placement.decision import Decision, ReplicaAllocation
from vllmfit.core.placement.inputs import (
    GpuSlot,
    NodeInfo,
    Request,
    gpu_label,
    refusal,
    settings_of,
    where,
)
from vllmfit.core.placement.ledger import Ledger, NodeSet
from vllmfit.core.placement.reasons import (
    NO_NODE,
    _node_cause,
    _node_why_not,
    _policy_is_a_cause,
    _policy_line,
    _why_not,
)
from vllmfit.core.placement.search import (
    _Candidate,
    _full_sizing,
    _is_mig_type,
    _min_need,
    _node_matches,
    _search,
    _shrinkable,
    grant_room,
    schedulable,
)


def _check_pinned(
    ledger: Ledger, req: Request, s: Settings, node: NodeInfo, idx: tuple[int, ...]
) -> tuple[_Candidate | None, str, list[str]]:
    """Check a pinned group. Returns (candidate or None, why not, warnings)."""
    missing = [i for i in idx if ledger.slot(node.name, i) is None]
    if missing:
        have = ", ".join(gpu_label(sl.index).removeprefix("GPU ") for sl in node.gpus) or "none"
        return None, f"{node.name}: {gpu_label(missing[0])} does not exist (GPUs: {have})", []
    if len(set(idx)) != len(idx):
        return None, f"{node.name}: gpuIndices {list(idx)} repeats a GPU", []
    slots = [sl for i in idx if (sl := ledger.slot(node.name, i)) is not None]  # each exists (above)
    if len(slots) > 1 and any(sl.mig for sl in slots):
        return None, f"{node.name}: MIG slices cannot form a tensor/pipeline-parallel group", []
    warnings = []
    if len({sl.capacity_bytes for sl in slots}) > 1:
        warnings.append(
            f"{node.name} GPUs {list(idx)} mix capacities "
            f"({', '.join(sorted({sl.gpu.product for sl in slots}))}); the smallest sets the limit"
        )
    small = min(slots, key=lambda sl: (sl.capacity_bytes, sl.gpu.product))
    heads = [ledger.heads[(node.name, i)] for i in idx]
    avail = min(heads)
    if s.kv_grow:  # a growing KV cache: its request first, then the room its grant may take
        try:
            floor = memory.size(req.model, memory.request_only(s), small.gpu, avail)
        except SpecError as e:
            return None, f"{node.name}: {e}", warnings
        if floor.fits:
            avail = grant_room(ledger, s, node.name, idx, floor.footprint.total, avail)
    sizing: Sizing | None = None
    fps: tuple[Footprint, ...] = ()
    for _ in range(3):  # a larger GPU of a mixed group requests more (ceil(T x u)): tighten and retry
        try:
            sizing = memory.size(req.model, s, small.gpu, avail)
        except SpecError as e:
            return None, f"{node.name}: {e}", warnings
        fps = _per_gpu(sizing, s, small, slots)
        excess = max(fp.total - h for fp, h in zip(fps, heads))
        if sizing.fits and excess <= 0:
            return _Candidate(node.name, idx, sizing, min(heads) - sizing.footprint.total, fps), "", warnings
        if not sizing.fits or not _shrinkable(s):
            break
        avail -= excess
    assert sizing is not None
    tight = max(range(len(idx)), key=lambda p: (fps[p].total - heads[p], -idx[p]))
    return (
        None,
        (
            f"{node.name}: {slots[tight].label} needs {fmt_gib(fps[tight].total)}, "
            f"{fmt_gib(max(heads[tight], 0))} of budget left"
        ),
        warnings,
    )


def _per_gpu(sizing: Sizing, s: Settings, small: GpuSlot, slots: list[GpuSlot]) -> tuple[Footprint, ...]:
    """Per-GPU footprints of a group: a GPU larger than the smallest one requests ceil(T_i x u),
    more than the smallest; the difference is booked as slack (reserved, unused)."""
    fp = sizing.footprint
    if sizing.flags is None or all(sl.capacity_bytes == small.capacity_bytes for sl in slots):
        return tuple(fp for _ in slots)
    version, _ = memory.parse_version(s.vllm_version)
    u = sizing.flags.gpu_memory_utilization
    base = memory.requested_bytes(small.capacity_bytes, u, version)
    return tuple(
        replace(fp, slack=fp.slack + memory.requested_bytes(sl.capacity_bytes, u, version) - base)
        for sl in slots
    )


@functools.lru_cache(maxsize=4096)
def _validated(model: ModelArch, s: Settings) -> tuple[str, ...]:
    """memory.validate, cached: a pure function of the model and the settings (many deployments
    share both; a full plan validates every one)."""
    return tuple(memory.validate(model, s))


def _spec_errors(req: Request, s: Settings) -> list[str]:
    errors = list(_validated(req.model, s))
    try:
        affinity.required_terms(req.spec)
    except ValueError as e:
        errors.append(str(e))
    pin = req.spec.placement
    if pin.gpu_indices is not None:
        if not pin.node_name:
            errors.append("placement.gpuIndices requires placement.nodeName")
        if len(pin.gpu_indices) != s.gpus:
            errors.append(
                f"placement.gpuIndices lists {len(pin.gpu_indices)} GPUs; tensorParallelSize x "
                f"pipelineParallelSize is {s.gpus}"
            )
        if req.spec.replicas > 1:
            errors.append("placement.gpuIndices pins one GPU group; set replicas: 1 or drop gpuIndices")
    if pin.nodes is not None and s.gpus % pin.nodes:
        errors.append(f"placement.nodes {pin.nodes} does not divide tensorParallelSize x pipelineParallelSize "
                      f"({s.gpus} GPUs) into equal pods")
    return errors


def _decide(
    ledger: Ledger,
    req: Request,
    policy: memory.Policy,
    keep: Sequence[ReplicaAllocation] = (),
    explain: bool = True,
    s: Settings | None = None,
) -> Decision:
    """decide without suggestions; replicas in `keep` stay where they are (their sizing's flags,
    when known, fix the context and concurrency of the others).

    Every replica runs the same context and concurrency. When unset values were lowered for
    replica 0 and a later replica does not fit with them, they are lowered to what the roomiest
    group left takes, and all replicas are placed again (at most `replicas` rounds).

    explain=False: an Unschedulable decision carries no reasons (checking a fix needs only
    whether it fits; the reasons cost a pass over every node). `s`: `settings_of(req, policy,
    ledger.kv_grant)`, when the caller has built them already."""
    if s is None:
        s = settings_of(req, policy, ledger.kv_grant)
    errors = _spec_errors(req, s)
    if errors:
        return Decision(req.key, "Rejected", reasons=tuple(errors), message=f"{req.key}: {errors[0]}")
    spec, pin = req.spec, req.spec.placement
    matching = schedulable(ledger, ledger.matching(pin.node_selector, affinity.required_terms(spec)), spec)
    too_large = _kv_too_large(ledger, req, s)
    if too_large:
        return Decision(req.key, "Rejected", reasons=(too_large,), message=f"{req.key}: {too_large}")
    if gang.spans(ledger, s, pin.nodes, bool(pin.node_name)):
        return gang.decide(ledger, req, s, matching, keep, explain)
    if not pin.node_name and (short := _too_few_groups(ledger, req, s, len(keep), matching)):
        return Decision(req.key, "Unschedulable", reasons=(short,), message=short + "." + "".join(
            f" {p[0].upper()}{p[1:]}." for p in [summary.policy_line(ledger, matching)] if p))
    attempt = _place_replicas(ledger, req, s, keep, matching, explain=explain)
    for _ in range(spec.replicas):
        if attempt.smaller is None:
            break
        attempt = _place_replicas(
            ledger, req, s, keep, matching, attempt.smaller, attempt.smaller_warnings, explain=explain
        )
    replicas = tuple(attempt.placed[r] for r in sorted(attempt.placed))
    if len(replicas) < spec.replicas:
        failure = attempt.failure
        head = (
            f"{len(replicas)}/{spec.replicas} replicas placed; replica {len(replicas)}: " if replicas else ""
        )
        # the budget policy where it is a cause, and the one-node limit: each its own sentence
        policy = [f for f in failure if f.startswith(("budget policy", "needs "))]
        counts = [f for f in failure if not f.startswith(("budget policy", "needs "))]
        if pin.node_name and not pin.allow_reschedule:
            if pin.node_name in ledger.nodes and not ledger.nodes[pin.node_name].error and \
                    _policy_is_a_cause(ledger, _node_cause(ledger, req, s, pin.node_name)):
                policy = [_policy_line(ledger, [pin.node_name])]  # in the message; reasons stay one line
            msg = f"{head}pinned placement does not fit: " + "; ".join(counts)
        else:  # kube-scheduler's FitError: "0/N nodes are available: <count> <reason>, ... ."
            msg = f"{head}{NO_NODE.format(len(ledger.nodes))}: " + ", ".join(counts)
        msg += "." + "".join(f" {p[0].upper()}{p[1:]}." for p in policy if p)
        reasons = failure
        return Decision(
            req.key,
            "Unschedulable",
            replicas,
            replicas[0].sizing.flags if replicas else None,
            tuple(reasons),
            (),
            tuple(attempt.warnings),
            attempt.moved,
            msg,
        )
    flags = replicas[0].sizing.flags if replicas else None
    on = ", ".join(where(r.node, r.gpus) for r in replicas) or "no GPUs (0 replicas)"
    return Decision(
        req.key,
        "Admitted",
        replicas,
        flags,
        (),
        (),
        tuple(attempt.warnings),
        attempt.moved,
        f"admitted on {on}",
    )


def _kv_too_large(ledger: Ledger, req: Request, s: Settings) -> str | None:
    """An explicit KV request no GPU type of the cluster could hold, even empty (one line, with the
    largest that fits)."""
    if not (s.kv_tokens or s.kv_bytes or (s.kv_concurrency and s.typical_len)) or not ledger.nodes:
        return None
    policies: dict[GpuType, memory.BudgetPolicy] = {}
    for sl in (sl for nd in ledger.nodes.values() for sl in nd.gpus):
        if sl.gpu not in policies or sl.budget_bytes > policies[sl.gpu].budget(sl.capacity_bytes):
            policies[sl.gpu] = sl.policy
    if not policies:
        return None
    return memory.kv_request_too_large(req.model, s, tuple(policies), policies=policies)


def replicas_bound(ledger: Ledger, req: Request, s: Settings, matching: NodeSet | None) -> tuple[int, list[str]]:
    """At most how many replicas of `req` the nodes of `matching` (None: all) could take now, from a
    few bisections of the ledger's indices (summary.groups_bound, per GPU type, at the least a replica
    needs there: `_min_need`), and the needs per type, as shown. No search places more (tested)."""
    n = s.gpus
    total, needs = 0, []
    for t in ledger.gpu_types() if matching is None else matching.types:
        if n > 1 and _is_mig_type(ledger, t):
            continue
        full = _full_sizing(req.model, s, t)
        need = _min_need(req.model, s, t)
        if isinstance(full, str) or need is None or not full.fits:
            continue
        groups = summary.groups_bound(ledger, t, n, need)
        if not groups:
            continue
        total += groups
        needs.append(f"{'at least ' if _shrinkable(s) else ''}{fmt_gib(need)} on each {t.product}")
    return total, needs


def _too_few_groups(ledger: Ledger, req: Request, s: Settings, kept: int, matching: NodeSet | None) -> str | None:
    """The cheap bound checked before any search (docs/placement.md, "Bounded work per review"): when
    the cluster has room for fewer replicas than asked, but for more than defaults.SEARCHED_REPLICAS
    (a 405B model at TP 8 with 1,000 replicas), the refusal says so at once instead of placing
    replica after replica until one does not fit. Otherwise the search runs (cheap), and its
    reasons say where the replicas went and why the next did not fit."""
    want = req.spec.replicas - kept
    if want <= defaults.SEARCHED_REPLICAS:
        return None
    bound, needs = replicas_bound(ledger, req, s, matching)
    if bound <= defaults.SEARCHED_REPLICAS or bound >= want:
        return None
    of = f" of {s.gpus} GPUs of one type on one node each" if s.gpus > 1 else ""
    return (f"{want} {'more ' if kept else ''}replicas{of} do not fit: the GPUs of the {len(ledger.nodes)} nodes "
            f"have room for at most {bound} ({'; '.join(needs)})")


@dataclass
class _Attempt:
    placed: dict[int, ReplicaAllocation]
    warnings: list[str]
    moved: bool = False
    failure: list[str] = field(default_factory=list)
    smaller: Settings | None = None  # lowered settings to try again with (all replicas)
    smaller_warnings: list[str] = field(default_factory=list)


def _place_replicas(
    ledger: Ledger,
    req: Request,
    s: Settings,
    keep: Sequence[ReplicaAllocation],
    every: NodeSet | None,
    fixed: Settings | None = None,
    warnings: Sequence[str] = (),
    explain: bool = True,
) -> _Attempt:
    """One round: every replica not kept, in order, with `fixed` settings (else those of the
    first replica placed)."""
    spec, pin = req.spec, req.spec.placement
    spread = pin.policy == "spread"
    out = _Attempt({r.replica: r for r in keep}, list(warnings))
    pending = f"{req.key}\x00pending"  # replicas placed so far, booked for the next ones' search
    queue: list[_Candidate] | None = None  # bulk placement: the next replicas' candidates, last first
    unbooked: list[ReplicaAllocation] = []  # placed in bulk, not booked as pending
    bulk_rs = s  # the settings of the replicas placed in bulk
    try:
        if out.placed:
            ledger.add_bookings(pending, Decision(pending, "Admitted", tuple(out.placed.values())).bookings())
        for replica in range(spec.replicas):
            if replica in out.placed:
                continue
            rs = bulk_rs if queue is not None else fixed or _same_as(s, out.placed)
            cand: _Candidate | None = None
            why, warn = "", list[str]()
            if queue is None and (fixed or (out.placed and min(out.placed) < replica)) and BULK and (
                    not pin.node_name and bulk.applies(rs)):  # rs is the same for every replica left
                left = sum(1 for r in range(replica, spec.replicas) if r not in out.placed)
                queue, bulk_rs = bulk.place(ledger, req, rs, every, spread, left)[::-1], rs
            if queue is not None:
                cand = queue.pop() if queue else None
                if cand is None:  # the next one fits nowhere: book the bulk-placed ones, as one by one would have
                    ledger.add_bookings(pending, Decision(pending, "Admitted", tuple(unbooked)).bookings())
            elif pin.node_name:
                cand, why, warn = _pinned(ledger, req, rs, spread)
                if cand is None and pin.allow_reschedule:
                    cand = _search(ledger, req, rs, every, spread)
                    if cand is not None:
                        out.moved = True
                        out.warnings.append(
                            f"pinned placement does not fit ({why}); placed on "
                            f"{where(cand.node, cand.gpus)} instead"
                        )
                        warn = []
            else:
                cand = _search(ledger, req, rs, every, spread)
            if cand is None:
                if pin.node_name and not pin.allow_reschedule:
                    out.failure = [why]
                elif explain:
                    out.failure = _why_not(ledger, req, rs, every)
                if rs != s and _shrinkable(s) and len(out.placed) > len(keep):  # lower, try again
                    smaller = _search(ledger, req, s, every, spread)
                    if smaller is not None and smaller.sizing.flags is not None:
                        out.smaller = _same_as(s, {0: ReplicaAllocation(0, "", (), smaller.sizing)})
                        out.smaller_warnings = list(smaller.sizing.warnings)
                break
            if warn or cand.sizing.warnings:
                out.warnings.extend(w for w in (*warn, *cand.sizing.warnings) if w not in out.warnings)
            alloc = ReplicaAllocation(replica, cand.node, cand.gpus, cand.sizing, cand.footprints)
            out.placed[replica] = alloc
            if queue is not None:
                unbooked.append(alloc)
            elif replica < spec.replicas - 1:
                ledger.add_bookings(pending, Decision(pending, "Admitted", (alloc,)).bookings())
    finally:
        ledger.release(pending)
    return out


BULK = True
"""Place the replicas after the first in bulk (`bulk.place`) where their settings allow it; the
tests turn it off to compare with the replica-by-replica search."""


def _same_as(s: Settings, placed: Mapping[int, ReplicaAllocation]) -> Settings:
    """Settings for another replica: the context, concurrency and batch of the first one placed."""
    z0 = placed[min(placed)].sizing if placed else None
    f0 = z0.flags if z0 else None
    if z0 is None or f0 is None:
        return s
    grown = {"kv_grow": False, "kv_bytes": z0.footprint.kv_cache, "kv_tokens": None, "kv_concurrency": None,
             "kv_default": None} \
        if s.kv_grow else {}  # every replica gets the KV cache replica 0 grew to
    return replace(
        s,
        max_model_len=f0.max_model_len,
        max_num_seqs=f0.max_num_seqs,
        max_num_batched_tokens=f0.max_num_batched_tokens or s.max_num_batched_tokens,
        **grown,  # type: ignore[arg-type]
    )


def _pinned(
    ledger: Ledger, req: Request, s: Settings, spread: bool
) -> tuple[_Candidate | None, str, list[str]]:
    pin = req.spec.placement
    node = ledger.nodes.get(pin.node_name or "")
    if node is None:
        return None, f"{pin.node_name}: node not found", []
    if not _node_matches(node, req.spec, taints=False):
        return None, f"{node.name}: does not match the nodeSelector", []
    if (why := refusal(node, req.spec)) is not None:
        return None, f"{node.name}: {why.replace('node(s) were', 'is').replace('node(s) had', 'has')}", []
    if pin.gpu_indices:
        return _check_pinned(ledger, req, s, node, tuple(pin.gpu_indices))
    cand = _search(ledger, req, s, ledger.node_set([node.name]), spread)
    return cand, "" if cand else _node_why_not(ledger, req, s, node.name), []
