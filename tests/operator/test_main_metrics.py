"""`vllmfit operator` arguments, and the Prometheus metrics read from the live ledger."""

# The real clock, on purpose (issue 29): `kopf run` (KopfRunner) runs the operator in a thread of
# its own, against KMock in another thread; the test's guards wait for those threads in real time.

from __future__ import annotations

import json
import math
from typing import Any

import kopf
import pytest
from opkit import H100, Cluster, Operator, node, vd
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from vllmfit import main as cli
from vllmfit.core import memory
from vllmfit.operator import main
from vllmfit.sources import catalog

GIB = 1 << 30
BUDGET = math.ceil(0.90 * catalog.gpu(H100).cuda_total_bytes) + int(0.55 * GIB)  # counted: ceil(0.9 T) + context


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    seen: dict[str, Any] = {}

    async def fake_operator(**kwargs: Any) -> None:
        seen.update(kwargs)

    monkeypatch.setattr(kopf, "operator", fake_operator)
    return seen


def test_operator_command_runs_kopf_clusterwide_with_its_flags(captured: dict[str, Any],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POD_NAME", "vllmfit-operator-abc")
    assert cli.main(["operator", "--metrics-port", "0", "--health-port", "18081", "--peering", "vllmfit",
                     "--default-image", "registry.local/vllm:v0.21.0", "--namespace", "vllmfit-system",
                     "--no-webhook"]) == 0
    assert captured["clusterwide"] is True
    assert (captured["standalone"], captured["peering_name"]) == (False, "vllmfit")
    assert captured["priority"] == main.peering_priority("vllmfit-operator-abc")  # from POD_NAME
    assert captured["liveness_endpoint"] == "http://0.0.0.0:18081/healthz"
    settings: kopf.OperatorSettings = captured["settings"]
    assert settings.persistence.finalizer == "vllmfit.dev/finalizer"
    assert isinstance(settings.persistence.progress_storage, kopf.AnnotationsProgressStorage)
    store = captured["memo"]["store"]  # built once from the flags, handed to the handlers in the memo
    assert (store.options.namespace, store.options.default_image) == ("vllmfit-system",
                                                                      "registry.local/vllm:v0.21.0")
    assert store.books.ledger.kv_grant == store.options.kv_grant
    captured.clear()
    assert cli.main(["operator", "--metrics-port", "0", "--health-port", "0", "--no-webhook"]) == 0
    assert (captured["standalone"], captured["peering_name"], captured["liveness_endpoint"]) == (True, None, None)
    assert captured["priority"] is None
    assert captured["memo"]["store"] is not store  # each run builds its own


def samples() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(generate_latest(REGISTRY).decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_replicas_get_distinct_stable_peering_priorities() -> None:
    names = [f"vllmfit-operator-7d9c{i}-x{i}q" for i in range(50)]
    prios = [main.peering_priority(n) for n in names]
    assert len(set(prios)) == len(prios) and all(p > 0 for p in prios)
    assert main.peering_priority(names[0]) == prios[0]


async def test_metrics_follow_the_ledger(cluster: Cluster, operator: Operator, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cluster.store.options, "budget", memory.BudgetPolicy(0.90, 0))  # BUDGET's figures (counted)
    before = samples().get(("vllmfit_admissions_total", (("result", "Admitted"),)), 0)
    await cluster.create(node("gpu-a", gpus=2))
    await cluster.create(vd("llama", "Qwen/Qwen2.5-7B-Instruct"))
    st = await cluster.phase("llama", "Admitted")
    await cluster.until(lambda: samples().get(("vllmfit_reconcile_seconds_count", ())), what="a reconcile timed")
    used = st["memory"][0]["totalBytes"]
    m = samples()
    gpu0, gpu1 = ((("gpu", str(i)), ("node", "gpu-a"), ("product", H100), ("uuid", "")) for i in (0, 1))
    assert m[("vllmfit_gpu_budget_bytes", gpu0)] == BUDGET
    assert m[("vllmfit_gpu_used_bytes", gpu0)] == used and m[("vllmfit_gpu_used_bytes", gpu1)] == 0
    assert m[("vllmfit_gpu_headroom_bytes", gpu0)] == BUDGET - used
    assert m[("vllmfit_gpu_booked_bytes", gpu0)] == used and m[("vllmfit_gpu_foreign_bytes", gpu0)] == 0
    assert m[("vllmfit_gpu_capacity_bytes", gpu0)] == catalog.gpu(H100).cuda_total_bytes
    assert m[("vllmfit_deployment_predicted_bytes", (("gpu", "0"), ("name", "llama"), ("namespace", "default"),
                                                      ("node", "gpu-a"), ("replica", "0")))] == used
    assert m[("vllmfit_deployment_phase", (("name", "llama"), ("namespace", "default"), ("phase", "Admitted")))] == 1
    assert m[("vllmfit_admissions_total", (("result", "Admitted"),))] == before + 1
    assert m[("vllmfit_reconcile_seconds_count", ())] >= 1


def test_kopf_run_module_serves_the_operator(monkeypatch: pytest.MonkeyPatch) -> None:
    """`kopf run -m vllmfit.operator`, the CLI way (KopfRunner), against KMock in its own thread."""
    import asyncio
    import threading
    import time
    import urllib.request

    import kmock
    from kopf.testing import KopfRunner
    from kubernetes_asyncio import client
    from opkit import VD, Emulator

    from vllmfit.core.spec import api
    from vllmfit.operator.handlers import startup

    loop = asyncio.new_event_loop()
    started, stop = threading.Event(), asyncio.Event()
    box: dict[str, Any] = {}

    async def serve() -> None:
        async with Emulator() as km, kmock.Server(km) as server:
            km.resources.load_bundled()
            km.resources[VD] = kmock.ResourceInfo(kind=api.KIND, namespaced=True, subresources={"status"},
                                                  verbs={"get", "list", "watch", "create", "patch", "update",
                                                         "delete"})
            box["km"], box["url"] = km, str(server.url).rstrip("/")
            started.set()
            await stop.wait()

    thread = threading.Thread(target=lambda: loop.run_until_complete(serve()), daemon=True)
    thread.start()
    assert started.wait(10)
    url, km = box["url"], box["km"]

    def post(path: str, obj: dict[str, Any]) -> None:
        req = urllib.request.Request(url + path, data=json.dumps(obj).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=5).read()

    def phase() -> str | None:
        key = (kmock.resource(VD), "default", "llama")
        return ((km.objects[key].raw.get("status") or {}).get("phase")) if key in km.objects else None

    async def kube_config() -> client.Configuration:
        return client.Configuration(host=url)

    monkeypatch.setattr(startup, "load_config", kube_config)  # `kopf run` has no flags: the default store
    try:
        with KopfRunner(["run", "-A", "--standalone", "-m", "vllmfit.operator"], timeout=30) as runner:
            deadline = time.monotonic() + 10
            while not km.sent("watch", VD):
                if not time.monotonic() < deadline:
                    pytest.fail("the operator never started watching")
                time.sleep(0.02)
            post("/api/v1/nodes", node("gpu-a", gpus=1))
            post("/apis/vllmfit.dev/v1alpha1/namespaces/default/vllmdeployments", vd("llama", "Qwen/Qwen2.5-7B-Instruct"))
            while phase() != "Admitted":
                if not time.monotonic() < deadline + 10:
                    pytest.fail(f"phase is {phase()}")
                time.sleep(0.02)
        assert runner.exit_code == 0 and runner.exception is None
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(10)


def test_the_operators_settings_are_read_once_from_its_flags(monkeypatch):
    """Issue 29: the environment is read in one place (the flags' defaults); state.Options reads
    nothing itself, and its own defaults are the flags' defaults (the same named values)."""
    from vllmfit import main as cli
    from vllmfit.operator import main as operator_main
    from vllmfit.operator.booking.state import Options

    monkeypatch.setenv("VLLMFIT_RESYNC_SECONDS", "7")
    monkeypatch.setenv("VLLMFIT_DRA_DRIVER", "gpu.example.com")
    assert Options().resync_seconds == 30.0 and Options().dra_driver == "gpu.nvidia.com"  # no env read
    args = cli.build_parser().parse_args(["operator"])
    opts = operator_main.options_from_args(args)
    assert (opts.resync_seconds, opts.dra_driver) == (7.0, "gpu.example.com")
    monkeypatch.delenv("VLLMFIT_RESYNC_SECONDS")
    monkeypatch.delenv("VLLMFIT_DRA_DRIVER")
    plain = operator_main.options_from_args(cli.build_parser().parse_args(["operator"]))
    base = Options()
    assert (plain.budget.utilization, plain.budget.reserve_bytes) == (base.budget.utilization, base.budget.reserve_bytes)
    assert plain == Options(reservation=plain.reservation, budget=plain.budget)  # the same defaults, named once
