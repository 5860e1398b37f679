"""The operator's /metrics in an emulator scenario (KMock + the real operator), scraped over HTTP:
values checked against the objects the test wrote; every metric documented in docs/metrics.md;
every query of the Grafana dashboard naming only metrics the operator exposes; and, where the
`prometheus` binary is installed (Debian's prometheus package), a real Prometheus server scraping
it and answering every dashboard query."""

# The real clock, on purpose (issue 29): prometheus_client serves /metrics from a thread and a real
# Prometheus scrapes it from another process; their waits and the hang guard are in real seconds.

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from opkit import H100, Cluster, Operator, node, vd
from prometheus_client.parser import text_string_to_metric_families

from vllmfit.core import defaults, memory
from vllmfit.operator import metrics
from vllmfit.sources import catalog

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "charts" / "vllmfit" / "files" / "dashboard.json"
DOC = ROOT / "docs" / "metrics.md"
GIB = 1 << 30
UUIDS = ["GPU-0a0a0a0a-0000-0000-0000-000000000000", "GPU-1b1b1b1b-1111-1111-1111-111111111111"]
SAMPLED = "2030-01-01T00:00:00Z"
PROMETHEUS = shutil.which("prometheus")
SUFFIXES = ("_total", "_bucket", "_count", "_sum", "_created")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def inventory(processes: dict[int, list[tuple[str, int]]]) -> str:
    total = catalog.gpu(H100).memory_bytes
    return json.dumps({"sampled_at": SAMPLED, "nvml": True, "gpus": [
        {"index": i, "uuid": u, "product": H100, "total_bytes": total,
         "used_bytes": sum(n for _, n in processes.get(i, [])),
         "processes": [{"pid": 100 + k, "used_bytes": n, "pod_uid": uid} for k, (uid, n) in enumerate(processes.get(i, []))]}
        for i, u in enumerate(UUIDS)]})


OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # 127.0.0.1 only, never a proxy


def scrape(port: int) -> str:
    with OPENER.open(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def parse(text: str) -> tuple[dict[str, str], dict[tuple[str, tuple[tuple[str, str], ...]], float]]:
    """(family name -> type, (sample name, sorted labels) -> value)."""
    families, samples = {}, {}
    for fam in text_string_to_metric_families(text):
        families[fam.name] = fam.type
        for s in fam.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return families, samples


def dashboard_queries() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    out = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    for v in dash["templating"]["list"]:
        q = v.get("query")
        if isinstance(q, dict):
            out.append(q["query"])
    return out


def names_in(expr: str) -> set[str]:
    return set(re.findall(r"\bvllmfit_[a-z0-9_]+\b", expr))


def family_of(name: str, families: dict[str, str]) -> str | None:
    if name in families:
        return name
    for suffix in SUFFIXES:
        if name.endswith(suffix) and name.removesuffix(suffix) in families:
            return name.removesuffix(suffix)
    return None


def as_promql(expr: str) -> str:
    """A dashboard query with Grafana's variables replaced as Grafana would for 'All'."""
    expr = expr.replace("$__rate_interval", "1m")
    expr = re.sub(r"label_values\((\w+), (\w+)\)", r"group by (\2) (\1)", expr)
    return expr.replace("$node", ".*")


@contextlib.contextmanager
def prometheus_server(targets: list[str], tmp: Path) -> Iterator[str]:
    port = free_port()
    (tmp / "prometheus.yml").write_text(json.dumps({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": "vllmfit", "static_configs": [{"targets": targets}]}]}))
    proc = subprocess.Popen([PROMETHEUS or "prometheus", f"--config.file={tmp / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=(tmp / "prometheus.log").open("w"))
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def query(base: str, promql: str) -> dict[str, Any]:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    try:
        with OPENER.open(url, timeout=5) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        body = e.read()
        if e.code == 503:  # still starting: Prometheus answers "Service Unavailable" until it is ready
            return {"status": "down", "error": body.decode(errors="replace")}
        return json.loads(body)
    except urllib.error.URLError as e:  # not listening yet
        return {"status": "down", "error": str(e)}


@pytest.fixture
def metrics_port(operator: Operator, monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(operator.store.options, "budget", memory.BudgetPolicy(0.90, 2 * GIB, context_bytes=0))  # ADR-0002's figures
    port = free_port()
    metrics.serve(port, addr="127.0.0.1")
    return port


async def scenario(cluster: Cluster) -> dict[str, Any]:
    """Node gpu-a (2 H100s, agent inventory), llama admitted and Running with its pod measured
    at its prediction + 1 GiB, huge Unschedulable. Returns what the test wrote and read back."""
    await cluster.create(node("gpu-a", gpus=2, annotations={defaults.INVENTORY_ANNOTATION: inventory({})}))
    await cluster.create(vd("llama", "Qwen/Qwen2.5-7B-Instruct", ns="ml", maxModelLen=8192))
    await cluster.until(lambda: cluster.status("llama", "ml").get("phase") == "Admitted", what="llama admitted")
    await cluster.store.writer.flush()
    st = cluster.status("llama", "ml")
    [mem] = st["memory"]
    labels = {"vllmfit.dev/deployment": "llama", "vllmfit.dev/replica": "0", "app.kubernetes.io/managed-by": "vllmfit"}
    await cluster.create({"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": "llama-0-abc", "namespace": "ml", "uid": "pod-uid-llama", "labels": labels},
        "status": {"phase": "Running", "containerStatuses": [{
            "name": "vllm", "image": "vllm/vllm-openai:v0.33.0", "imageID": "", "ready": True, "restartCount": 0,
            "state": {"running": {}}}]}})
    await cluster.until(lambda: cluster.status("llama", "ml").get("phase") == "Running", what="llama Running")
    observed = mem["totalBytes"] + GIB
    await cluster.patch_node("gpu-a", {"metadata": {"annotations": {
        defaults.INVENTORY_ANNOTATION: inventory({mem["index"]: [("pod-uid-llama", observed)]})}}})
    await cluster.until(lambda: cluster.status("llama", "ml").get("observed"), what="llama's observed memory")
    await cluster.create(vd("huge", "Qwen/Qwen2.5-72B-Instruct", ns="ml"))
    await cluster.until(lambda: cluster.status("huge", "ml").get("phase") == "Unschedulable", what="huge refused")
    return {"index": mem["index"], "predicted": mem["totalBytes"], "observed": observed}


async def test_the_scraped_metrics_follow_the_scenario(cluster: Cluster, operator: Operator, metrics_port: int,
                                                      tmp_path: Path) -> None:
    got = await scenario(cluster)
    text = await asyncio.to_thread(scrape, metrics_port)
    (tmp_path / "metrics.txt").write_text(text)
    families, m = parse(text)
    i, other = got["index"], 1 - got["index"]
    gpu = (("gpu", str(i)), ("node", "gpu-a"), ("product", H100), ("uuid", UUIDS[i]))
    idle = (("gpu", str(other)), ("node", "gpu-a"), ("product", H100), ("uuid", UUIDS[other]))
    budget = int(0.90 * catalog.gpu(H100).cuda_total_bytes) - 2 * GIB  # 0.90 x capacity - 2 GiB, by hand
    assert m[("vllmfit_gpu_budget_bytes", gpu)] == m[("vllmfit_gpu_budget_bytes", idle)] == budget
    assert m[("vllmfit_gpu_capacity_bytes", gpu)] == catalog.gpu(H100).cuda_total_bytes
    # the pod is Ready (started) and uses 1 GiB more than predicted: the GPU books what it holds plus
    # the margin (issue 34), while the per-deployment metric keeps the prediction
    booked = got["observed"] + defaults.OBSERVED_MARGIN_BYTES
    assert m[("vllmfit_gpu_booked_bytes", gpu)] == booked and m[("vllmfit_gpu_booked_bytes", idle)] == 0
    assert m[("vllmfit_gpu_observed_bytes", gpu)] == got["observed"] and m[("vllmfit_gpu_observed_bytes", idle)] == 0
    assert m[("vllmfit_gpu_headroom_bytes", gpu)] == budget - booked
    dep = (("gpu", str(i)), ("name", "llama"), ("namespace", "ml"), ("node", "gpu-a"))
    assert m[("vllmfit_deployment_predicted_bytes", (*dep[:3], ("node", "gpu-a"), ("replica", "0")))] == got["predicted"]
    assert m[("vllmfit_deployment_observed_bytes", dep)] == got["observed"]
    assert m[("vllmfit_deployment_drift_bytes", dep)] == GIB
    assert m[("vllmfit_deployment_drift_ratio", dep)] == pytest.approx(GIB / got["predicted"])
    phase = {(dict(k)["name"], dict(k)["phase"]) for (n, k), v in m.items() if n == "vllmfit_deployment_phase" and v}
    assert phase == {("llama", "Running"), ("huge", "Unschedulable")}
    assert m[("vllmfit_node_inventory_timestamp_seconds", (("node", "gpu-a"),))] == datetime(
        2030, 1, 1, tzinfo=UTC).timestamp()
    assert m[("vllmfit_ledger_ready", ())] == 1
    assert m[("vllmfit_admissions_total", (("result", "Unschedulable"),))] >= 1
    assert m[("vllmfit_reconcile_seconds_count", ())] >= 2
    assert families["vllmfit_build_info"] == "gauge"
    assert [v for (n, _), v in m.items() if n == "vllmfit_build_info"] == [1]


async def test_every_metric_is_documented_and_every_dashboard_query_names_exposed_metrics(
        cluster: Cluster, operator: Operator, metrics_port: int) -> None:
    await scenario(cluster)
    families, _ = parse(await asyncio.to_thread(scrape, metrics_port))
    ours = {f: t for f, t in families.items() if f.startswith("vllmfit_")}
    doc = DOC.read_text()
    rows = re.findall(r"^\| `(vllmfit_[a-z0-9_]+)` \| (\w+) \|", doc, re.MULTILINE)
    documented = {family_of(n, ours) or n: t for n, t in rows}
    assert len(documented) == len(rows) and documented == ours, "docs/metrics.md's table differs from /metrics"
    queries = dashboard_queries()
    assert len(queries) >= 10
    unknown = {n for q in queries for n in names_in(q) if family_of(n, ours) is None}
    assert not unknown, f"dashboard queries name metrics the operator does not expose: {unknown}"
    assert family_of("vllmfit_gpu_budget_bytez", ours) is None  # the check can fail


@pytest.mark.skipif(PROMETHEUS is None, reason="the prometheus binary is not installed (Debian: apt-get install -y "
                                                "prometheus)")
async def test_a_real_prometheus_scrapes_the_operator_and_answers_every_dashboard_query(
        cluster: Cluster, operator: Operator, metrics_port: int, tmp_path: Path) -> None:
    got = await scenario(cluster)
    with prometheus_server([f"127.0.0.1:{metrics_port}"], tmp_path) as base:
        deadline = time.monotonic() + 30
        while True:
            r = await asyncio.to_thread(query, base, 'vllmfit_gpu_booked_bytes{node="gpu-a"}')
            if r.get("status") == "success" and len(r["data"]["result"]) == 2:
                break
            if time.monotonic() > deadline:  # a hang guard, not a speed check
                pytest.fail("Prometheus never scraped the operator: " + (tmp_path / "prometheus.log").read_text()[-2000:])
            await asyncio.sleep(0.25)
        booked = {s["metric"]["gpu"]: float(s["value"][1]) for s in r["data"]["result"]}
        # measured above its prediction once Ready: booked at observed + margin (issue 34)
        assert booked == {str(got["index"]): got["observed"] + defaults.OBSERVED_MARGIN_BYTES, str(1 - got["index"]): 0}
        up = await asyncio.to_thread(query, base, 'up{job="vllmfit"}')
        assert [s["value"][1] for s in up["data"]["result"]] == ["1"]
        for q in dashboard_queries():
            r = await asyncio.to_thread(query, base, as_promql(q))
            assert r.get("status") == "success", (q, r)
        r = await asyncio.to_thread(query, base, "max by (namespace, name, node, gpu) (vllmfit_deployment_drift_ratio)")
        [s] = r["data"]["result"]
        assert s["metric"] == {"namespace": "ml", "name": "llama", "node": "gpu-a", "gpu": str(got["index"])}
        assert float(s["value"][1]) == pytest.approx(GIB / got["predicted"])
