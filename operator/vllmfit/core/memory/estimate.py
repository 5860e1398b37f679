"""`vllmfit estimate`: one deployment alone on empty GPUs of one type, with checked fixes."""

from __future__ import annotations

from dataclasses import replace

from vllmfit.core.memory.budget import BudgetPolicy, default_policy
from vllmfit.core.memory.fixes import context_note, fixes, larger_gpu, one_node_fixes, one_node_reason
from vllmfit.core.memory.learned import size  # with a learned over-run of this configuration on top
from vllmfit.core.memory.sizing import request_only, vllm_startup
from vllmfit.core.memory.stages import pods, stage_footprints
from vllmfit.core.memory.types import DEFAULT_KV_GRANT, Estimate, KvGrant, Settings, Sizing, SpecError
from vllmfit.core.memory.versions import parse_version
from vllmfit.core.model.facts import GpuType, ModelArch

# --- estimate: one deployment, empty GPUs, with checked fixes -----------------------------------


def estimate(model: ModelArch, s: Settings, gpu: GpuType, *, other_gpus: tuple[GpuType, ...] = (),
             policy: BudgetPolicy | None = None, gpus_per_node: int | None = None,
             grant: KvGrant = DEFAULT_KV_GRANT) -> Estimate:
    """`policy` None: the memory policy's default budget policy (`counted`; `adr-0002` for `adr`).
    `grant`: the cluster's rule for a default KV grant (its fair share of the GPU, `granted`).
    `gpus_per_node`: a spec needing more GPUs than that spans several nodes of that many GPUs, one
    pod per node, as `plan` places it (`stages.pods`); refused, with the changes that fit it in one
    node, when its GPUs do not split into such pods. pp > 1: the footprint of each stage's GPUs."""
    policy = default_policy(s.policy) if policy is None else policy
    T = gpu.cuda_total_bytes
    bad = policy.error(T)
    if bad:
        raise SpecError(bad)
    budget = policy.budget(T)
    nodes = pods(s.gpus, gpus_per_node, s.tp) if gpus_per_node is not None else 1
    # a replica across nodes is placed and booked at its KV request (placement.gang), one node's
    # is granted as placement grants it
    sizing = granted(model, s, gpu, budget, grant) if nodes == 1 else size(model, request_only(s), gpu, budget)
    version, _ = parse_version(s.vllm_version)
    vllm = None
    if sizing.flags and s.policy == "vllm" and model.num_layers:
        vllm = vllm_startup(model, s, gpu, sizing.flags)
    suggestions: tuple[str, ...] = ()
    per_stage = stage_footprints(model, s, gpu, sizing) if s.pp > 1 and sizing.flags is not None else ()
    if nodes is None:
        sizing = replace(sizing, fits=False, reasons=(one_node_reason(s, gpus_per_node),))
        suggestions = tuple(one_node_fixes(model, s, gpu, gpus_per_node, other_gpus, policy))
    elif not sizing.fits:
        if sizing.footprint.total - budget <= policy.held_back(T):  # the policy is a cause: say which
            sizing = replace(sizing, reasons=(*sizing.reasons, policy.describe(T)))
        found = [f.text for f in fixes(model, s, gpu, other_gpus, budget, policy)]
        other = larger_gpu(model, s, gpu, other_gpus, policy)
        if other is not None:
            there = size(model, s, other, policy.budget(other.cuda_total_bytes))
            found.append(f"a larger GPU: {other.product}{context_note(model, s, there, {})}")
        suggestions = tuple(found)
    return Estimate(model, gpu, s, version, sizing, budget, policy.reserve_bytes, T, vllm, suggestions,
                    sizing.warnings, policy, nodes or 1, per_stage)


def granted(model: ModelArch, s: Settings, gpu: GpuType, budget: int, grant: KvGrant) -> Sizing:
    """Sized alone on an empty GPU of this budget as placement sizes it: a default KV grant grows
    from its request to at most a fair share of the budget (KvGrant.share) and its limit."""
    share = grant.share(budget) if s.kv_grow and s.kv_default is not None else None
    if share is None:
        return size(model, s, gpu, budget)
    request = size(model, request_only(s), gpu, budget)
    if not request.fits:
        return request
    grown = size(model, s, gpu, grant.room(budget, request.footprint.total, budget, True))
    return grown if grown.fits and grown.footprint.kv_cache >= request.footprint.kv_cache else request
