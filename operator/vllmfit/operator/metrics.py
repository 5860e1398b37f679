"""Prometheus metrics of the operator (served on --metrics-port, path /metrics; docs/metrics.md).

One registry: prometheus_client's default REGISTRY. Two kinds of metric:

- read from the operator's state at scrape time by `StoreCollector` (the committed ledger, the
  records, the agent's attributions, the reservation pods and DRA claims), so a gauge can never
  disagree with what the operator decides on, and the handlers need no call to keep them current.
  The scrape runs on the metrics server's thread, but what it reads of the object cache (which
  the operator's loop changes) is copied on that loop (`View.of`, asked for with
  run_coroutine_threadsafe), so a scrape never walks a dict the loop is changing; the committed
  ledger is an immutable snapshot, read as it is. The collector is given the state it reads
  (`register(store)`, on the operator's loop); the collector itself is kept in the global
  REGISTRY (prometheus_client's), given back by `unregister`;
- events counted where they happen: ADMISSIONS (each decision), RECONCILE / RECONCILE_ERRORS
  (handlers), NODE_DATA_REFUSED (node data refused), WEBHOOK (each admission review, by outcome;
  observed through `observe_review`, which the webhook calls through its `observer` hook).

Cardinality is bounded by what the cluster holds: per-GPU series by the GPU slots in the ledger
(core.limits bounds nodes and GPUs per node), per-deployment series by the VLLMDeployments and
their bookings; label values of counters come from fixed sets (results, outcomes, handlers,
states) except NODE_DATA_REFUSED's node. docs/metrics.md gives the bound of each.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import platform
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from prometheus_client import REGISTRY, Counter, Histogram, disable_created_metrics, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from vllmfit import __version__
from vllmfit.core import defaults

disable_created_metrics()  # no *_created series: they double the series and no query here needs them

PHASES = ("Pending", "Admitted", "Running", "Rejected", "Unschedulable", "Failed")
OUTCOMES = ("allowed", "warned", "denied", "invalid", "error")  # of one admission review
RESERVATION_STATES = ("held", "pending", "unschedulable", "terminating")
CLAIM_STATES = ("allocated", "pending")

ADMISSIONS = Counter("vllmfit_admissions", "Decisions on VLLMDeployment specs, by result.", ["result"])
NODE_DATA_REFUSED = Counter("vllmfit_node_data_refused", "Node GPU labels or inventories refused (malformed, out of "
                            "range, not believable); the node kept its last good state.", ["node"])
RECONCILE = Histogram("vllmfit_reconcile_seconds", "Time to reconcile one VLLMDeployment (a key of the work queue).",
                      buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
RECONCILE_ERRORS = Counter("vllmfit_reconcile_errors", "Handler runs that ended in an exception (retried), by "
                           "handler; a VLLMDeployment's reconcile from the work queue counts as \"reconcile\".",
                           ["handler"])
WEBHOOK = Histogram("vllmfit_webhook_duration_seconds", "Time to answer one admission review, by webhook "
                    "(validate, default) and outcome (allowed, warned, denied, invalid, error).",
                    ["webhook", "outcome"],
                    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5))

OVER_LIMIT = Counter("vllmfit_replica_over_limit", "Replica pods stopped at their enforced GPU memory limit "
                     "(condition Ready reason OverLimit), by deployment.", ["namespace", "name"])
NOT_ENFORCED = Counter("vllmfit_not_enforced", "Times a deployment's replicas were written to run without an "
                       "enforced GPU memory limit (condition Enforced False), by deployment.", ["namespace", "name"])

GPU_LABELS = ["node", "gpu", "uuid", "product"]


def over_limit(key: str) -> None:
    OVER_LIMIT.labels(*_split(key)).inc()


def not_enforced(key: str) -> None:
    NOT_ENFORCED.labels(*_split(key)).inc()


def counted(handler: str, fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """`fn` (a Kopf handler) with its exceptions counted in vllmfit_reconcile_errors_total{handler}."""

    @functools.wraps(fn)
    async def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return await fn(*args, **kwargs)
        except Exception:
            RECONCILE_ERRORS.labels(handler).inc()
            raise

    return run


def observe_review(webhook: str, outcome: str, seconds: float) -> None:
    """One admission review answered (the webhook's `observer` hook)."""
    WEBHOOK.labels(webhook, outcome if outcome in OUTCOMES else "error").observe(seconds)


def _split(key: str) -> tuple[str, str]:
    ns, _, name = key.partition("/")
    return ns, name


def _timestamp(text: str | None) -> float | None:
    if not text:
        return None
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        return None


@dataclass(frozen=True)
class View:
    """What one scrape reads of the operator's state, copied on the operator's loop: the
    committed ledger (immutable), and copies of what the loop changes in the object cache."""

    ledger: Any  # the committed snapshot
    attributions: tuple[tuple[str, Any], ...]  # (node, Attribution), sorted; each replaced whole, never changed
    phases: tuple[tuple[str, str, tuple[Any, ...]], ...]  # (key, phase, observed), sorted
    reservations: dict[str, int]  # state -> reservation pods
    claims: dict[str, int]  # state -> ResourceClaims
    ready: bool
    deployments: int  # VLLMDeployments the operator holds (the operator's own memory need)

    @classmethod
    def of(cls, store: Any) -> View:
        """Copy it, on the operator's loop (or wherever nothing else changes the store)."""
        from vllmfit.operator.booking import report

        cache = store.cache
        states = dict.fromkeys(RESERVATION_STATES, 0)
        for r in list(cache.reservations.values()):
            if r.terminating:
                states["terminating"] += 1
            elif r.reported:
                states["held"] += 1
            elif r.name in cache.reservation_waits:
                states["unschedulable"] += 1
            else:
                states["pending"] += 1
        cs = dict.fromkeys(CLAIM_STATES, 0)
        for c in list(cache.claims.values()):
            cs["allocated" if (c.get("status") or {}).get("allocation") else "pending"] += 1
        return cls(store.books.committed, tuple(sorted(cache.attributions.items())),
                   tuple((k, report.phase(rec), tuple(rec.observed)) for k, rec in sorted(cache.records.items())),
                   states, cs, store.books.ready.is_set(), len(cache.records))


class StoreCollector(Collector):
    """The ledger, the records and what the agents and the backends report, read at scrape time
    from `store` (booking.state.Store) through a `View` copied on `loop`, the operator's loop (none:
    copied in place, as tests that scrape on the loop do)."""

    def __init__(self, store: Any, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.store = store
        self.loop = loop
        self.last: View | None = None  # served when the loop does not answer in time

    def view(self) -> View:
        loop = self.loop
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        if loop is None or here is loop or not loop.is_running():
            self.last = View.of(self.store)
            return self.last

        async def copy() -> View:
            return View.of(self.store)

        try:
            self.last = asyncio.run_coroutine_threadsafe(copy(), loop).result(defaults.METRICS_COPY_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            if self.last is None:
                raise
        return self.last

    def collect(self) -> Iterator[Any]:
        from vllmfit.core.observe.attribution import split_unit_index
        from vllmfit.operator.booking import own_memory

        view = self.view()
        ledger = view.ledger  # a committed snapshot: never half-changed

        def gauge(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=labels)

        capacity = gauge("vllmfit_gpu_capacity_bytes", "Total memory of the GPU as CUDA reports it (vLLM's total).",
                         GPU_LABELS)
        budget = gauge("vllmfit_gpu_budget_bytes", "GPU memory vllmfit may hand out: utilization x capacity - "
                       "reserve.", GPU_LABELS)
        booked = gauge("vllmfit_gpu_booked_bytes", "GPU memory booked for vllmfit's replicas (the prediction, or "
                       "observed + margin for a started replica measured above it).", GPU_LABELS)
        foreign = gauge("vllmfit_gpu_foreign_bytes", "GPU memory of processes vllmfit does not manage.", GPU_LABELS)
        used = gauge("vllmfit_gpu_used_bytes", "Booked plus foreign GPU memory.", GPU_LABELS)
        head = gauge("vllmfit_gpu_headroom_bytes", "Budget minus used (negative: over budget).", GPU_LABELS)
        observed = gauge("vllmfit_gpu_observed_bytes", "GPU memory in use as the node agent last measured it (NVML).",
                         GPU_LABELS)
        pred = gauge("vllmfit_deployment_predicted_bytes", "Predicted GPU memory of one replica on one GPU (the "
                     "floor of its booking).", ["namespace", "name", "replica", "node", "gpu"])
        obs = gauge("vllmfit_deployment_observed_bytes", "GPU memory the node agent attributes to a deployment's "
                    "processes on one GPU.", ["namespace", "name", "node", "gpu"])
        drift = gauge("vllmfit_deployment_drift_bytes", "Observed minus predicted bytes of a deployment on one GPU "
                      "(positive: uses more than booked).", ["namespace", "name", "node", "gpu"])
        ratio = gauge("vllmfit_deployment_drift_ratio", "Observed minus predicted, over predicted.",
                      ["namespace", "name", "node", "gpu"])
        phase = gauge("vllmfit_deployment_phase", "1 for the phase a VLLMDeployment is in.",
                      ["namespace", "name", "phase"])
        sampled = gauge("vllmfit_node_inventory_timestamp_seconds", "When the node agent last sampled the node's "
                        "GPUs (Unix time), as its inventory says.", ["node"])
        reservations = gauge("vllmfit_reservations", "GPU reservation pods (device-plugin backend), by state.",
                             ["state"])
        claims = gauge("vllmfit_resource_claims", "DRA ResourceClaims the operator watches, by state "
                       "(allocated or pending).", ["state"])
        ready = gauge("vllmfit_ledger_ready", "1 once the ledger was rebuilt from the API at start-up.", [])
        own_limit = gauge("vllmfit_operator_memory_limit_bytes", "The operator's own memory limit (--memory-limit, "
                          "the chart's operator.resources.limits.memory); absent without one.", [])
        own_need = gauge("vllmfit_operator_memory_needed_bytes", "The operator's peak resident memory for the "
                         "VLLMDeployments and GPU nodes it holds, as measured (docs/install.md, \"Sizing the "
                         "operator\").", [])
        info = gauge("vllmfit_build_info", "Always 1; the labels say which build runs.",
                     ["version", "python_version"])

        units: dict[tuple[str, int], Any] = {}
        for node, att in view.attributions:
            for index, u in att.units.items():
                units[(node, index)] = u
            ts = _timestamp(getattr(att, "sampled_at", None))
            if ts is not None:
                sampled.add_metric([node], ts)
        for slot in ledger.slots():
            gpu = str(slot.index)
            labels = [slot.node, gpu, slot.uuid or "", slot.gpu.product]
            total = ledger.used_bytes(slot.node, slot.index)
            capacity.add_metric(labels, slot.capacity_bytes)
            budget.add_metric(labels, slot.budget_bytes)
            booked.add_metric(labels, total - slot.foreign_bytes)
            foreign.add_metric(labels, slot.foreign_bytes)
            used.add_metric(labels, total)
            head.add_metric(labels, ledger.headroom_bytes(slot.node, slot.index))
            u = units.get((slot.node, slot.index))
            if u is not None:
                observed.add_metric(labels, u.used_bytes)
            for b in ledger.bookings_on(slot.node, slot.index):
                pred.add_metric([*_split(b.deployment), str(b.replica), b.node, gpu], b.footprint.predicted)
        for node, att in view.attributions:
            for deployment, by_unit in sorted(att.by_deployment.items()):
                for unit, n in sorted(by_unit.items()):
                    g, mig = split_unit_index(unit)
                    obs.add_metric([*_split(deployment), node, str(unit if mig is not None else g)], n)
        for key, ph, observations in view.phases:
            ns, name = _split(key)
            phase.add_metric([ns, name, ph], 1)
            for o in observations:
                labels = [ns, name, o.node, str(o.index)]
                drift.add_metric(labels, o.drift_bytes)
                if o.predicted_bytes > 0:
                    ratio.add_metric(labels, o.drift_bytes / o.predicted_bytes)
        for state, n in view.reservations.items():
            reservations.add_metric([state], n)
        for state, n in view.claims.items():
            claims.add_metric([state], n)
        ready.add_metric([], 1 if view.ready else 0)
        if self.store.options.memory_limit_bytes:
            own_limit.add_metric([], self.store.options.memory_limit_bytes)
        own_need.add_metric([], own_memory.needed_bytes(view.deployments, len(ledger.nodes)))
        info.add_metric([__version__, platform.python_version()], 1)
        yield from (capacity, budget, booked, foreign, used, head, observed, pred, obs, drift, ratio, phase,
                    sampled, reservations, claims, ready, own_limit, own_need, info)


def register(store: Any) -> StoreCollector:
    """Add a collector of `store` to the registry; give it back with `unregister` when that
    operator stops (tests run many operators in one process, one at a time). Called on the
    operator's loop: the collector copies what it reads there."""
    try:
        loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
    except RuntimeError:
        loop = None
    collector = StoreCollector(store, loop)
    REGISTRY.register(collector)
    for outcome in ("allowed", "denied"):  # the series alerts divide by exist from the start
        WEBHOOK.labels("validate", outcome)
    return collector


def unregister(collector: StoreCollector | None) -> None:
    if collector is not None:
        with contextlib.suppress(KeyError):
            REGISTRY.unregister(collector)


def serve(port: int, addr: str = "0.0.0.0") -> None:
    """Serve /metrics (the default registry) on `port`."""
    start_http_server(port, addr=addr)
