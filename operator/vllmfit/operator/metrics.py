"""Prometheus metrics of the operator (served on --metrics-port, path /metrics).

The GPU gauges are read from the live ledger at scrape time (a custom collector), so they can
never disagree with what the operator decides on:

  vllmfit_gpu_budget_bytes{node,gpu}            utilization x capacity - reserve
  vllmfit_gpu_used_bytes{node,gpu}              bookings + foreign use
  vllmfit_gpu_headroom_bytes{node,gpu}          budget - used
  vllmfit_gpu_foreign_bytes{node,gpu}           memory used by processes vllmfit does not manage
  vllmfit_deployment_predicted_bytes{deployment,replica,node,gpu}
  vllmfit_deployment_observed_bytes{deployment,node,gpu}   from the node agent, when it attributes
  vllmfit_admissions_total{result}              Admitted, Rejected, Unschedulable, Pending
  vllmfit_reconcile_seconds                     one create/update/resume, model resolution included
  vllmfit_node_data_refused_total{node}         node GPU labels/inventory refused (the node kept its last good state)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import REGISTRY, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

ADMISSIONS = Counter("vllmfit_admissions", "Decisions on VLLMDeployment specs, by result.", ["result"])
NODE_DATA_REFUSED = Counter("vllmfit_node_data_refused", "Node GPU labels or inventories refused (malformed, out of "
                            "range, not believable); the node kept its last good state.", ["node"])
RECONCILE = Histogram("vllmfit_reconcile_seconds", "Time to handle one VLLMDeployment create/update/resume.",
                      buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))


class LedgerCollector(Collector):
    def collect(self) -> Iterator[Any]:
        from vllmfit.core.observe.attribution import split_unit_index
        from vllmfit.operator.state import get_store

        store = get_store()
        ledger = store.ledger
        gl = ["node", "gpu"]
        budget = GaugeMetricFamily("vllmfit_gpu_budget_bytes", "GPU memory vllmfit may hand out.", labels=gl)
        used = GaugeMetricFamily("vllmfit_gpu_used_bytes", "GPU memory booked plus foreign use.", labels=gl)
        head = GaugeMetricFamily("vllmfit_gpu_headroom_bytes", "Budget minus used.", labels=gl)
        foreign = GaugeMetricFamily("vllmfit_gpu_foreign_bytes", "GPU memory of processes vllmfit does not manage.",
                                    labels=gl)
        pred = GaugeMetricFamily("vllmfit_deployment_predicted_bytes", "Predicted GPU memory of one replica.",
                                 labels=["deployment", "replica", "node", "gpu"])
        obs = GaugeMetricFamily("vllmfit_deployment_observed_bytes", "GPU memory the node agent attributes.",
                                labels=["deployment", "node", "gpu"])
        for slot in ledger.slots():
            labels = [slot.node, str(slot.index)]
            budget.add_metric(labels, slot.budget_bytes)
            used.add_metric(labels, ledger.used_bytes(slot.node, slot.index))
            head.add_metric(labels, ledger.headroom_bytes(slot.node, slot.index))
            foreign.add_metric(labels, slot.foreign_bytes)
            for b in ledger.bookings_on(slot.node, slot.index):
                pred.add_metric([b.deployment, str(b.replica), b.node, str(b.index)], b.footprint.total)
        for node, attribution in sorted(store.attributions.items()):
            for deployment, units in attribution.by_deployment.items():
                for unit, n in units.items():
                    gpu, mig = split_unit_index(unit)
                    obs.add_metric([deployment, node, str(unit) if mig is not None else str(gpu)], n)
        yield from (budget, used, head, foreign, pred, obs)


_collector: LedgerCollector | None = None
_served: set[int] = set()


def register() -> None:
    global _collector
    if _collector is None:
        _collector = LedgerCollector()
        REGISTRY.register(_collector)


def serve(port: int, addr: str = "0.0.0.0") -> None:
    """Serve /metrics on `port` (once per port per process)."""
    register()
    if port and port not in _served:
        start_http_server(port, addr=addr)
        _served.add(port)
