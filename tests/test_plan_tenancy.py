"""`vllmfit plan` takes the tenancy policy the operator takes (--pod-security-level, --allow-host-path,
--allow-csi-driver), so a cluster whose admin allows a host path gets the same verdict from `plan`
as from its webhook and operator (issue 30: one validator, the same policy in every shell)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from vllmfit import main as cli

NODE = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "gpu-a", "labels": {
    "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3", "nvidia.com/gpu.count": "1"}}}


def spec_with_host_path(path: str) -> dict:
    return {"apiVersion": "vllmfit.dev/v1alpha1", "kind": "VLLMDeployment",
            "metadata": {"name": "cache", "namespace": "tenant-a"},
            "spec": {"model": "Qwen/Qwen2.5-0.5B-Instruct", "maxModelLen": 1024, "maxNumSeqs": 4,
                     "podTemplate": {"spec": {"volumes": [{"name": "h", "hostPath": {"path": path}}],
                                              "containers": [{"name": "vllm", "volumeMounts": [
                                                  {"name": "h", "mountPath": "/models"}]}]}}}}


def plan(tmp_path: Path, capsys: pytest.CaptureFixture[str], *flags: str) -> tuple[int, dict]:
    f = tmp_path / "in.yaml"
    f.write_text(yaml.safe_dump_all([NODE, spec_with_host_path("/data/models")]))
    capsys.readouterr()
    code = cli.main(["plan", "-f", str(f), "-o", "json", *flags])
    return code, json.loads(capsys.readouterr().out)


def test_a_host_path_is_refused_unless_the_admin_allows_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = plan(tmp_path, capsys)
    assert code == 2 and len(out["errors"]) == 1
    assert "podTemplate.spec.volumes[h].hostPath.path '/data/models'" in out["errors"][0]
    code, out = plan(tmp_path, capsys, "--allow-host-path", "/data")  # it or below it
    assert code == 0 and out["errors"] == [] and out["summary"]["admitted"] == 1
    code, out = plan(tmp_path, capsys, "--allow-host-path", "/data/other")  # a sibling is not allowed
    assert code == 2 and "hostPath" in out["errors"][0]
