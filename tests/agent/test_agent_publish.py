"""Publishing the annotation (merge patch, on change, at least every 30 s), /healthz, the run loop."""

from __future__ import annotations

import json
import os
import signal
import threading
import urllib.error
import urllib.request

import pytest
from agent_fakes import GIB, MIB, FakeCoreV1Api, FakeGpu, FakeNVML, FakeProc, scenario

from vllmfit.agent import main as agent_main
from vllmfit.agent import publish as agent_publish
from vllmfit.core.observe.inventory import GpuInventory, InventoryGpu

ANNOTATION = "vllmfit.dev/gpu-inventory"  # written out: the test must not take it from the code under test


def _inv(used=10 * GIB, sampled_at="2025-01-01T00:00:00Z", product="NVIDIA-H100-80GB-HBM3", **kw):
    gpu = InventoryGpu(index=0, uuid="GPU-0", product=product, total_bytes=80 * GIB, used_bytes=used)
    return GpuInventory(sampled_at=sampled_at, gpus=[gpu], **kw)


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_publish_is_a_merge_patch_of_only_the_annotation():
    api = FakeCoreV1Api()
    inv = _inv()
    agent_publish.publish(inv, "node-a", api)
    [(name, body, kwargs)] = api.calls
    assert name == "node-a"
    assert list(body) == ["metadata"] and list(body["metadata"]) == ["annotations"]
    assert list(body["metadata"]["annotations"]) == [ANNOTATION]
    assert kwargs["_content_type"] == "application/merge-patch+json"
    value = body["metadata"]["annotations"][ANNOTATION]
    assert GpuInventory.model_validate_json(value) == inv
    assert json.loads(value)["gpus"][0]["usedBytes"] == 10 * GIB


def test_changed_ignores_sampled_at_and_jitter():
    base = _inv()
    assert agent_publish.changed(None, base)
    assert not agent_publish.changed(base, _inv(sampled_at="2025-01-01T00:00:29Z"))
    assert not agent_publish.changed(base, _inv(used=10 * GIB + 63 * MIB))
    assert not agent_publish.changed(base, _inv(used=10 * GIB - 63 * MIB))
    assert agent_publish.changed(base, _inv(used=10 * GIB + 64 * MIB))
    assert agent_publish.changed(base, _inv(product="other"))
    assert agent_publish.changed(base, _inv(nvml=False))


def test_publisher_on_change_and_every_30s():
    api, clock = FakeCoreV1Api(), Clock()
    pub = agent_publish.Publisher(api, "node-a", clock=clock)
    assert pub.offer(_inv()) is True  # first sample
    clock.t += 10
    assert pub.offer(_inv(used=10 * GIB + 10 * MIB, sampled_at="2025-01-01T00:00:10Z")) is False  # jitter
    clock.t += 10
    assert pub.offer(_inv(used=10 * GIB + 40 * MIB + 30 * MIB, sampled_at="2025-01-01T00:00:20Z")) is True
    clock.t += 29.9
    assert pub.offer(_inv(used=10 * GIB + 70 * MIB, sampled_at="2025-01-01T00:00:50Z")) is False
    clock.t += 0.1  # 30 s since the last publish: refresh so sampled_at moves
    assert pub.offer(_inv(used=10 * GIB + 70 * MIB, sampled_at="2025-01-01T00:00:50Z")) is True
    assert len(api.calls) == 3
    sampled = [json.loads(b["metadata"]["annotations"][ANNOTATION])["sampledAt"] for _, b, _ in api.calls]
    assert sampled == ["2025-01-01T00:00:00Z", "2025-01-01T00:00:20Z", "2025-01-01T00:00:50Z"]


def test_publisher_drift_accumulates_against_last_published():
    api, clock = FakeCoreV1Api(), Clock()
    pub = agent_publish.Publisher(api, "n", clock=clock)
    pub.offer(_inv(used=0))
    published = [pub.offer(_inv(used=k * 40 * MIB)) for k in range(1, 4)]  # 40, 80, 120 MiB
    assert published == [False, True, False]  # 80 MiB >= 64 MiB from 0; 120 is 40 from 80


def test_publisher_retries_after_api_error(caplog):
    api, clock = FakeCoreV1Api(fail=1), Clock()
    pub = agent_publish.Publisher(api, "n", clock=clock)
    assert pub.offer(_inv()) is False and pub.failures == 1
    assert "cannot patch node n: connection refused" in caplog.text
    assert pub.offer(_inv()) is True and len(api.calls) == 1


def test_health_status():
    clock = Clock()
    h = agent_main.Health(window_s=60, clock=clock)
    assert h.status() == (503, "no NVML: no NVML sample yet\n")
    h.mark(GpuInventory(sampled_at="x", nvml=False, error="NVML not available: Driver Not Loaded"))
    assert h.status() == (503, "no NVML: Driver Not Loaded\n")
    h.mark(_inv())
    assert h.status() == (200, "ok\n")
    clock.t += 61
    code, text = h.status()
    assert code == 503 and text.startswith("no NVML: last good read 61s ago")


def test_liveness_ignores_nvml_but_not_a_stuck_loop():
    clock = Clock()
    h = agent_main.Health(window_s=60, clock=clock, live_window_s=150)
    h.mark(GpuInventory(sampled_at="x", nvml=False, error="NVML not available: Driver Not Loaded"))
    clock.t += 150
    assert h.liveness() == (200, "ok\n") and h.status()[0] == 503  # unready, but alive: no restarts
    clock.t += 1
    assert h.liveness() == (503, "sampling loop stuck for 151s\n")
    h.beat()
    assert h.liveness()[0] == 200


def test_health_http_endpoint():
    clock = Clock()
    h = agent_main.Health(window_s=60, clock=clock)
    server = agent_main.serve_health(h, 0, host="127.0.0.1")
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(url + "/healthz", timeout=2)
        assert e.value.code == 503 and e.value.read().decode().startswith("no NVML")
        h.mark(_inv())
        with urllib.request.urlopen(url + "/healthz", timeout=2) as r:
            assert (r.status, r.read()) == (200, b"ok\n")
        with urllib.request.urlopen(url + "/livez", timeout=2) as r:
            assert (r.status, r.read()) == (200, b"ok\n")
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(url + "/other", timeout=2)
        assert e.value.code == 404
    finally:
        server.shutdown()
        server.server_close()


def test_run_once_publishes_one_sample(tmp_path):
    api = FakeCoreV1Api()
    assert agent_main.run("node-a", 30, once=True, nvml=scenario(tmp_path), proc_root=tmp_path, api=api) == 0
    [(name, body, _)] = api.calls
    inv = GpuInventory.model_validate_json(body["metadata"]["annotations"][ANNOTATION])
    assert name == "node-a" and len(inv.gpus) == 4 and inv.gpus[0].processes[0].pid == 1001


def test_run_without_nvml_keeps_publishing_nvml_false(tmp_path):
    api, stop = FakeCoreV1Api(), threading.Event()
    fake = FakeNVML([], init_error=12)
    t = threading.Thread(
        target=agent_main.run, args=("n", 0.005), kwargs={"nvml": fake, "api": api, "stop": stop, "refresh_s": 0.0}
    )
    t.start()
    while fake.init_calls < 3 and t.is_alive():
        stop.wait(0.005)
    stop.set()
    t.join(2)
    assert not t.is_alive() and fake.init_calls >= 3  # it retries NVML each interval
    docs = [json.loads(b["metadata"]["annotations"][ANNOTATION]) for _, b, _ in api.calls]
    assert docs and all(d["nvml"] is False and "NVML Shared Library Not Found" in d["error"] for d in docs)


def test_run_stops_cleanly_on_sigterm(tmp_path):
    class KillingApi(FakeCoreV1Api):
        """Sends SIGTERM to this process from inside the loop (after run installed its handler)."""

        def patch_node(self, name, body, **kwargs):
            super().patch_node(name, body, **kwargs)
            if len(self.calls) == 2:
                os.kill(os.getpid(), signal.SIGTERM)

    api = KillingApi()
    gpu = FakeGpu("GPU-0", "NVIDIA L4", 24 * GIB, 1 * GIB, procs=[FakeProc(7, GIB)])
    before = signal.getsignal(signal.SIGTERM)
    assert agent_main.run("n", 0.001, nvml=FakeNVML([gpu]), proc_root=tmp_path, api=api, refresh_s=0.0) == 0
    assert signal.getsignal(signal.SIGTERM) is before  # handler restored
    assert len(api.calls) == 2  # stopped right after the signal


def test_run_rejects_bad_interval():
    with pytest.raises(ValueError):
        agent_main.run("n", 0, api=FakeCoreV1Api())


def test_publish_through_the_real_kubernetes_client(monkeypatch):
    """The generated client (kubernetes>=35) defaults PATCH to JSON Patch; publish must ask for a merge patch."""
    from kubernetes import client

    api = client.CoreV1Api(client.ApiClient(client.Configuration(host="http://127.0.0.1:9")))
    sent = {}

    class Sent(Exception):
        pass

    def call_api(method, url, header_params=None, body=None, post_params=None, _request_timeout=None):
        sent.update(method=method, url=url, headers=header_params, body=body)
        raise Sent

    monkeypatch.setattr(api.api_client, "call_api", call_api)
    with pytest.raises(Sent):
        agent_publish.publish(_inv(), "gpu-node-1", api)
    assert sent["method"] == "PATCH" and sent["url"].endswith("/api/v1/nodes/gpu-node-1")
    assert sent["headers"]["Content-Type"] == "application/merge-patch+json"
    assert list(sent["body"]["metadata"]["annotations"]) == [ANNOTATION]
