"""The per-GPU ledger, fit checks and placement search. Pure: no I/O, no Kubernetes imports.

Shared by `vllmfit plan`, the operator and the admission webhook, so they can never disagree:
- `node_from_object` turns a v1/Node (GFD labels + the agent's inventory annotation) into GPUs;
- `request_from_object` turns a VLLMDeployment into a `Request` (model facts resolved by the caller);
- `decide(ledger, request)` returns a `Decision` (placement, flags, reasons, fixes) without
  changing anything; `ledger.book(decision)` applies it; `ledger.release(key)` frees it;
- `replan(ledger, requests)` moves the fewest deployments after a node vanished or filled up.

The ledger invariant, checked by every test: on every GPU, the sum of the footprints booked on
it plus foreign use never exceeds its budget (utilization x capacity - reserve, ADR-0002). Because
each vLLM process's footprint is its CUDA context plus ceil(T x u) (see vllmfit.core.memory), that
sum staying under T is exactly the condition for the processes to start in any order.

One module per concern, in dependency order:
  affinity  a podTemplate's required node affinity, matched as the scheduler matches it
  inputs    GPU slots, nodes, requests; the memory settings a spec asks for
  nodes     a v1/Node (GFD labels, agent inventory) -> NodeInfo
  ledger    bookings per GPU, kept under budget, with the search indices
  summary   per-node-set counts and the cheap replicas bound, cached until a node changes
  search    the best-fit (or spread) search for one GPU group; cached sizing
  reasons   why a deployment fits nowhere, grouped by cause like the kube-scheduler
  place     placing every replica of one deployment (pinned first, then the search)
  fixes     changes that make a refused deployment fit, each re-checked
  decide    place + fixes: the entry point every shell calls
  replan    moving the fewest deployments after a node vanished or filled up
  restore   admitted deployments read back from their status
  plan      a whole cluster decided in a deterministic order
  contract  the `vllmfit plan --output json` contract

The placement rules (best fit, groups, MIG, replicas, re-placement) are in docs/placement.md.
This package re-exports the names the shells use; inside the core, import the module.
"""

from vllmfit.core.placement.contract import to_json
from vllmfit.core.placement.decide import decide, held_replicas, quick
from vllmfit.core.placement.decision import Booking, Decision, ReplicaAllocation
from vllmfit.core.placement.inputs import (
    DecisionPhase,
    GpuSlot,
    NodeInfo,
    Request,
    request_from_object,
    settings_from_spec,
    where,
)
from vllmfit.core.placement.ledger import Ledger, OverBudget
from vllmfit.core.placement.nodes import NodeDataError, NodeRead, node_from_object, read_node
from vllmfit.core.placement.plan import Plan, plan
from vllmfit.core.placement.replan import replan
from vllmfit.core.placement.restore import bookings_from_status

__all__ = [
    "Booking",
    "Decision",
    "DecisionPhase",
    "GpuSlot",
    "Ledger",
    "NodeDataError",
    "NodeInfo",
    "NodeRead",
    "OverBudget",
    "Plan",
    "ReplicaAllocation",
    "Request",
    "bookings_from_status",
    "decide",
    "held_replicas",
    "node_from_object",
    "plan",
    "quick",
    "read_node",
    "replan",
    "request_from_object",
    "settings_from_spec",
    "to_json",
    "where",
]
