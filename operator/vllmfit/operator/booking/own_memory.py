"""The operator's own memory: what it needs for the cluster it holds, against the limit it runs under.

The operator keeps every VLLMDeployment, node and child object of the cluster in memory (its
ledger, its records, Kopf's per-object state), so its resident memory grows with the cluster. The
figures are measured by `benchmarks/operator_scale.py` (peak RSS while every deployment is applied
at once, the worst case: a burst or a restart that rebuilds from every object) and named in
`core.defaults` (OPERATOR_MEMORY_*); docs/install.md, "Sizing the operator", has the table.

`needed_bytes` is that measured peak as a line through the benchmark's points; `advice` says, in one
line, whether the limit the chart gives the operator (the downward API's `limits.memory`, passed as
$VLLMFIT_MEMORY_LIMIT) holds it, and what to set where it does not. Pure: the start-up logs the
line, posts it as an Event and exports both figures as metrics.
"""

from __future__ import annotations

from vllmfit.core import defaults
from vllmfit.core.quantity import format_bytes


def needed_bytes(deployments: int, nodes: int) -> int:
    """The operator's peak resident memory for a cluster of `deployments` VLLMDeployments on
    `nodes` GPU nodes, as measured (a line through the benchmark's points, rounded up)."""
    return (defaults.OPERATOR_MEMORY_BASE_BYTES + deployments * defaults.OPERATOR_MEMORY_PER_DEPLOYMENT_BYTES
            + nodes * defaults.OPERATOR_MEMORY_PER_NODE_BYTES)


def suggested_limit_bytes(deployments: int, nodes: int) -> int:
    """The memory limit to give an operator holding this cluster: the measured need with the
    headroom the chart's default keeps (OPERATOR_MEMORY_HEADROOM), rounded up to 256 MiB."""
    step = 256 * defaults.MIB
    want = -(-needed_bytes(deployments, nodes) * defaults.OPERATOR_MEMORY_HEADROOM_PERCENT // 100)
    return -(-want // step) * step


def advice(deployments: int, nodes: int, limit_bytes: int | None) -> str | None:
    """One line when `limit_bytes` does not hold the cluster with the chart's headroom (None when
    it does, or when the operator runs without a limit)."""
    if not limit_bytes:
        return None
    need = needed_bytes(deployments, nodes)
    if need * defaults.OPERATOR_MEMORY_HEADROOM_PERCENT <= limit_bytes * 100:
        return None
    return (f"the operator's memory limit {format_bytes(limit_bytes)} is too small for {deployments:,} "
            f"VLLMDeployments on {nodes:,} GPU nodes: it needs about {format_bytes(-(-need // defaults.MIB) * defaults.MIB)} "
            f"at peak (a burst of applies or a restart), and may be OOM-killed; set "
            f"operator.resources.limits.memory to {format_bytes(suggested_limit_bytes(deployments, nodes))} or more "
            f"(docs/install.md, \"Sizing the operator\")")
