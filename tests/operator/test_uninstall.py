"""`helm uninstall` leaves no VLLMDeployment stuck on vllmfit's finalizer: the chart's post-delete
hook runs `vllmfit operator --release-finalizers`, tested here against the emulator after the real
operator (which put the finalizers there) has stopped, as helm leaves things once it deleted the
operator's Deployment. Another controller's finalizer is left alone."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import yaml
from opkit import VD, Cluster, Operator, km_url, node, vd

from vllmfit import main as cli
from vllmfit.core.errors import UserError
from vllmfit.core.spec import api
from vllmfit.operator import main

OURS = "vllmfit.dev/finalizer"
THEIRS = "example.com/keep"


@pytest.fixture
def kubeconfig(km: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "km",
        "clusters": [{"name": "km", "cluster": {"server": str(km_url(km)).rstrip("/")}}],
        "users": [{"name": "u", "user": {}}],
        "contexts": [{"name": "km", "context": {"cluster": "km", "user": "u"}}]}))
    monkeypatch.setenv("KUBECONFIG", str(path))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
        monkeypatch.delenv(var, raising=False)
    return path


def finalizers(cluster: Cluster, name: str, ns: str = "default") -> list[str] | None:
    obj = cluster.get(VD, name, ns)
    return None if obj is None else list(obj["metadata"].get("finalizers") or [])


async def test_uninstall_leaves_no_vllmdeployment_with_a_finalizer(km: Any, cluster: Cluster, kubeconfig: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    op = Operator(km)
    await op.start()
    await cluster.create(node("gpu-a", gpus=2))
    await cluster.create(vd("a", "Qwen/Qwen2.5-7B-Instruct"))
    await cluster.create(vd("b", "Qwen/Qwen2.5-7B-Instruct", ns="team-b"))
    await cluster.until(lambda: finalizers(cluster, "a") == [OURS] and finalizers(cluster, "b", "team-b") == [OURS],
                        what="Kopf's finalizers")
    await cluster.custom.patch_namespaced_custom_object(
        api.GROUP, api.VERSION, "team-b", api.PLURAL, "b", {"metadata": {"finalizers": [THEIRS, OURS]}},
        _content_type="application/merge-patch+json")
    await op.stop()  # helm deleted the operator's Deployment; the post-delete hook runs now
    await cluster.reconnect()
    code = await asyncio.to_thread(cli.main, ["operator", "--release-finalizers", "--settle-seconds", "0.2"])
    assert code == 0
    out = capsys.readouterr().out
    assert "released default/a" in out and "released team-b/b" in out and "2 VLLMDeployment finalizer(s)" in out
    assert finalizers(cluster, "a") == [] and finalizers(cluster, "b", "team-b") == [THEIRS]
    # a namespace deletion (or kubectl delete) now completes for ours: nothing waits on vllmfit
    await cluster.delete("a")
    await cluster.until(lambda: cluster.get(VD, "a") is None, what="a to be gone")
    assert not [o for o in cluster.objects(VD) if OURS in (o["metadata"].get("finalizers") or [])]


class Reappearing:
    """A CustomObjectsApi whose objects get the finalizer back `times` times (an operator still
    stopping), or forever."""

    def __init__(self, times: int | None):
        self.times, self.patches = times, 0
        self.obj = {"metadata": {"name": "x", "namespace": "ns", "finalizers": [OURS]}}

    def list_cluster_custom_object(self, *_: Any) -> dict[str, Any]:
        return {"items": [self.obj]}

    def patch_namespaced_custom_object(self, *args: Any, **_: Any) -> None:
        assert args[-1][0] == {"op": "test", "path": "/metadata/finalizers/0", "value": OURS}
        self.patches += 1
        if self.times is not None and self.patches > self.times:
            self.obj["metadata"]["finalizers"] = []


def test_a_finalizer_added_back_by_a_stopping_operator_is_removed_again() -> None:
    api_ = Reappearing(times=2)
    assert main.release_finalizers(api_, 0.05, say=lambda _: None) == 3
    assert api_.obj["metadata"]["finalizers"] == []


def test_an_operator_that_keeps_running_is_one_line_not_a_loop_forever() -> None:
    with pytest.raises(UserError, match="a vllmfit operator is still running"):
        main.release_finalizers(Reappearing(times=None), 0.05, timeout=0.3, say=lambda _: None)
