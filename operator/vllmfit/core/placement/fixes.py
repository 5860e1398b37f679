"""Changes that make a refused deployment fit now, each verified with a fresh placement."""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any

from vllmfit.core import defaults, limits, memory
from vllmfit.core.memory import Settings, SpecError
from vllmfit.core.model.facts import GpuType, ModelArch
from vllmfit.core.placement import affinity, summary
from vllmfit.core.placement.decision import Decision
from vllmfit.core.placement.inputs import Request, settings_of, where
from vllmfit.core.placement.ledger import Ledger, NodeSet
from vllmfit.core.placement.place import _decide, replicas_bound
from vllmfit.core.placement.search import _UNLIMITED, _is_mig_type, _pick, schedulable
from vllmfit.core.spec.api import KvCacheSpec, VLLMDeploymentSpec

# --- Suggestions (each re-checked against the ledger) --------------------------------------------

def _spec_update(spec: VLLMDeploymentSpec, fix: memory.Fix) -> dict[str, Any]:
    """A memory fix as a spec update (Settings field -> spec field)."""
    update: dict[str, Any] = {}
    for key, value in fix.changes:
        if key == "kv_tokens":
            update["kv_cache"] = (spec.kv_cache or KvCacheSpec()).model_copy(
                update={"tokens": value, "memory": None, "concurrency": None, "grow": False})
        elif key == "kv_concurrency":
            update["kv_cache"] = (spec.kv_cache or KvCacheSpec()).model_copy(
                update={"concurrency": value, "tokens": None, "memory": None, "grow": False})
        elif key == "tp":
            update["tensor_parallel_size"] = value
        else:
            update[key] = value
    return update


def _most_replicas(ledger: Ledger, req: Request, policy: memory.Policy, placed: int, s: Settings) -> int:
    """The most replicas of `req` that fit now (0: none), each answer checked with a fresh decision.
    Fewer always fit if more do, so it is a bisection, between the cheap bound (place.replicas_bound:
    more never fit) and the replicas the refused decision placed (`placed`, usually the answer).
    At most limits.MAX_REPLICA_FIX_DECISIONS decisions: past them, the most that were seen to fit.
    Not looked for (0) when the bound is above defaults.SEARCHED_REPLICAS. `s`: the request's
    settings (`settings_of`); a replica count does not change them."""
    matching = schedulable(ledger, ledger.matching(req.spec.placement.node_selector,
                                                   affinity.required_terms(req.spec)), req.spec)
    lo, hi = 0, req.spec.replicas - 1  # lo fits (0: nothing to place), hi + 1 does not
    if not req.spec.placement.node_name:
        hi = min(hi, replicas_bound(ledger, req, s, matching)[0])
    if hi > defaults.SEARCHED_REPLICAS:
        return 0  # the refusal says how many the cluster could hold at most; placing them is not bounded
    guess = min(placed, hi) if placed else hi
    for _ in range(limits.MAX_REPLICA_FIX_DECISIONS):
        if lo >= hi:
            break
        mid = guess if lo < guess <= hi else (lo + hi + 1) // 2
        d = _decide(ledger, replace(req, spec=req.spec.model_copy(update={"replicas": mid})), policy,
                    explain=False, s=s)
        if d.admitted:
            lo = mid
        else:
            hi = mid - 1
            guess = len(d.replicas)  # the search placed these before one did not fit: most likely the answer
    return lo


def _suggest(ledger: Ledger, req: Request, policy: memory.Policy, placed: int = 0,
             s: Settings | None = None) -> list[str]:
    """Concrete changes that make `req` fit now, each verified with a fresh decision. `placed`: the
    replicas the refused decision placed; `s`: the request's settings (`settings_of`, the learned
    over-runs of its model included), when the caller has built them."""
    if s is None:
        s = settings_of(req, policy, ledger.kv_grant)
    out: list[str] = []
    spec, pin = req.spec, req.spec.placement

    def fits(**changes: Any) -> Decision | None:
        new_pin = changes.pop("placement", pin)
        r = replace(req, spec=spec.model_copy(update={**changes, "placement": new_pin}))
        d = _decide(ledger, r, policy, explain=False)
        return d if d.admitted else None

    # 0. the cause, where it is one: neighbours holding KV cache above their requests
    held = _give_back_fix(ledger, req, policy, s)
    if held:
        out.append(held)
    # 1. somewhere else: drop the pin or the selector
    if pin.node_name and not pin.allow_reschedule:
        d = fits(placement=pin.model_copy(update={"node_name": None, "gpu_indices": None}))
        if d and d.replicas:
            fix = f"placement.nodeName: {d.replicas[0].node}"
            if pin.gpu_indices:
                fix += f", placement.gpuIndices: {list(d.replicas[0].gpus)}"
            out += [fix, "placement.allowReschedule: true"]
    if pin.node_selector:
        d = fits(placement=pin.model_copy(update={"node_selector": None}))
        if d and d.replicas:
            out.append(f"placement.nodeSelector: remove (fits on {d.replicas[0].node})")
    # 2. fewer replicas
    if spec.replicas > 1 and (lo := _most_replicas(ledger, req, policy, placed, s)):
        out.append(f"replicas: {lo}")
    # 3. memory changes, sized on the roomiest group the deployment may use
    room = _roomiest(ledger, req, s)
    if room is not None:
        gpu, avail, budget = room
        # never a TP beyond the most GPUs of this type one node has (a TP group lives on one node)
        max_tp = summary.most_of_type(ledger, gpu)
        for fx in _memory_fixes(req.model, s, gpu, avail, budget, max_tp):
            # a budget policy change is set on the operator (--budget-utilization / --budget-reserve)
            # or the node pool's labels; checked by placing on the nodes with that policy
            if fx.policy is not None:
                if _under_policy(ledger, req, policy, s, gpu, budget, fx.policy):
                        out.append(f"{fx.text}: node labels {defaults.BUDGET_UTILIZATION_LABEL} / "
                               f"{defaults.BUDGET_RESERVE_LABEL}, or the operator's --budget-utilization / "
                               "--budget-reserve")
            elif fits(**_spec_update(spec, fx)):
                out.append(fx.text)
    # 4. more GPUs than any node has: fewer by pipeline parallelism (with fp8 weights), as estimate offers
    most = ledger.most_of_one_type()
    if s.gpus > 1 and 0 < most < s.gpus and s.tp <= most:
        # fewer stages still across nodes (fewer nodes), the most that fit
        fewer = next((p for p in range(s.pp - 1, most // s.tp, -1) if fits(pipeline_parallel_size=p)), None)
        if fewer is not None:
            out.append(f"pipelineParallelSize: {fewer}")
        pp = most // s.tp
        if fits(pipeline_parallel_size=pp):
            out.append(f"pipelineParallelSize: {pp}")
        elif spec.quantization != "fp8" and fits(pipeline_parallel_size=pp, quantization="fp8"):
            out.append(f"quantization: fp8, pipelineParallelSize: {pp}")
    return out


def _under_policy(ledger: Ledger, req: Request, policy: memory.Policy, s: Settings, gpu: GpuType,
                  old: memory.BudgetPolicy, new: memory.BudgetPolicy) -> bool:
    """Whether `req` is admitted on a copy of the ledger whose GPUs of type `gpu` under the budget
    policy `old` have the policy `new` (the bookings as they are: neighbours do not grow)."""
    trial = ledger.fork()
    for node in list(trial.nodes.values()):
        if any(sl.gpu == gpu and sl.policy == old for sl in node.gpus):
            trial.set_node(replace(node, gpus=tuple(replace(sl, policy=new) if sl.gpu == gpu and sl.policy == old
                                                     else sl for sl in node.gpus)))
    return _decide(trial, req, policy, explain=False, s=s).admitted


def _give_back_fix(ledger: Ledger, req: Request, policy: memory.Policy, s: Settings) -> str | None:
    """When `req` would fit if the deployments holding KV cache above their requests (a grant between
    request and limit, or kvCache.grow) held only their requests: which of them, on the GPUs it
    would take, what each holds above its request, and the spec change that shrinks it to it
    (`Booking.give_back`: `kvCache.concurrency: N`, its request, exactly). Checked by deciding
    again with those bookings at their requests; the ledger is left as it was."""
    keys = ledger.beyond_caps()
    if not keys:
        return None
    held = {key: ledger.bookings_of(key) for key in keys}

    def at_requests(given: set[str]) -> Decision:
        for key, bookings in held.items():
            ledger.restore(key, [replace(b, footprint=replace(b.footprint, kv_cache=b.footprint.kv_cache - b.kv_beyond),
                                         kv_beyond=0) for b in bookings] if key in given else bookings)
        return _decide(ledger, req, policy, explain=False, s=s)

    given = set(held)
    try:
        d = at_requests(given)
        if d.admitted:  # the fewest that admit it: those on the GPUs it takes, the most held above first
            gpus = {(b.node, b.index) for b in d.bookings()}
            there = sorted((key for key, bs in held.items() if any((b.node, b.index) in gpus for b in bs)),
                           key=lambda k: (-max(b.kv_beyond for b in held[k]), k))
            for count in range(1, len(there) + 1):
                d = at_requests(given := set(there[:count]))
                if d.admitted:
                    break
    finally:
        for key, bookings in held.items():
            ledger.restore(key, bookings)
    if not d.admitted:
        return None
    gpus = {(b.node, b.index) for b in d.bookings()}
    above: dict[str, tuple[int, str]] = {}
    for key, bookings in held.items():
        for b in bookings:
            if key in given and (b.node, b.index) in gpus and b.kv_beyond:
                n, _ = above.get(b.deployment, (0, ""))
                above[b.deployment] = (n + b.kv_beyond, b.give_back or "kvCache.grow: false")
    if not above:
        return None
    names = ", ".join(f"{key} {memory.fmt_gib(n)}" for key, (n, _) in sorted(above.items()))
    changes = ", ".join(f"{change} on {key}" for key, (_, change) in sorted(above.items()))
    on = ", ".join(where(r.node, r.gpus) for r in d.replicas)
    return (f"neighbours on {on} hold KV cache above their requests ({names}): set {changes} (their requests; "
            "a rolling restart), and this fits there")


@functools.lru_cache(maxsize=1024)
def _memory_fixes(model: ModelArch, s: Settings, gpu: GpuType, available: int,
                  budget: memory.BudgetPolicy, max_tp: int = memory.MAX_FIX_TP) -> tuple[memory.Fix, ...]:
    """memory.fixes, cached: it sizes the model a dozen times, and the answer depends only on these
    (a refused spec asked again, by kubectl retries or the operator's waiting list, costs nothing)."""
    try:
        return tuple(memory.fixes(model, s, gpu, (), available=available, policy=budget, max_tp=max_tp))
    except SpecError:
        return ()


def _roomiest(ledger: Ledger, req: Request, s: Settings) -> tuple[GpuType, int, memory.BudgetPolicy] | None:
    """The GPU type, available bytes and budget policy of the roomiest group the deployment may use."""
    pin = req.spec.placement
    if pin.node_name and not pin.allow_reschedule:
        nodes: NodeSet | None = ledger.node_set([pin.node_name])
    else:
        nodes = ledger.matching(pin.node_selector, affinity.required_terms(req.spec))
    best: tuple[int, int, GpuType, memory.BudgetPolicy] | None = None
    for t in ledger.gpu_types():
        if s.gpus > 1 and _is_mig_type(ledger, t):
            continue
        hit = _pick(ledger, t, s.gpus, -_UNLIMITED, nodes, True)
        if hit and (best is None or (hit[2], t.cuda_total_bytes) > best[:2]):
            slot = ledger.slot(hit[0], hit[1][0])
            best = (hit[2], t.cuda_total_bytes, t, slot.policy if slot else memory.DEFAULT_POLICY)
    return None if best is None else (best[2], best[0], best[3])
