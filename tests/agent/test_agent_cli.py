"""`vllmfit agent` on the command line; the real-GPU comparison with nvidia-smi."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from agent_fakes import FakeCoreV1Api, scenario

from vllmfit import main as cli
from vllmfit.agent import main as agent_main
from vllmfit.agent import nvml as agent_nvml
from vllmfit.core.observe.inventory import GpuInventory

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has an NVIDIA driver")
def test_once_json_without_driver_subprocess():
    python = REPO / ".venv" / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("NODE_NAME", "KUBECONFIG")}
    r = subprocess.run(
        [
            str(python if python.exists() else sys.executable),
            "-m",
            "vllmfit",
            "agent",
            "--once",
            "--output",
            "json",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    assert lines[0].startswith("vllmfit agent: no NVML on this machine (")
    assert "runtimeClassName: nvidia" in lines[0]
    inv = GpuInventory.model_validate_json(r.stdout)  # stdout still carries the (empty) inventory
    assert inv.nvml is False and inv.gpus == []


@pytest.fixture
def fake_collect(tmp_path, monkeypatch):
    fake = scenario(tmp_path)
    real = agent_nvml.collect
    monkeypatch.setattr(agent_main, "collect", lambda *a, **k: real(fake, tmp_path))
    return fake


def test_once_json_with_gpus(fake_collect, capsys):
    assert cli.main(["agent", "--once", "--output", "json"]) == 0
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert [g["product"] for g in doc["gpus"]] == [
        "NVIDIA-H100-80GB-HBM3",
        "NVIDIA-A100-SXM4-80GB",
        "NVIDIA-A100-SXM4-80GB",
        "NVIDIA-A100-PCIE-40GB",
    ]
    assert err == ""


def test_once_table(fake_collect, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    assert cli.main(["agent", "--once", "--output", "table"]) == 0
    out = capsys.readouterr().out
    for s in ("NVIDIA-H100-80GB-HBM3", "1/0", "3g.40gb", "GPU is lost", "Not Supported", "7f3c1a2b"):
        assert s in out


def test_once_publish(fake_collect, monkeypatch, capsys):
    api = FakeCoreV1Api()
    monkeypatch.setattr(agent_main, "core_v1_api", lambda: api)
    monkeypatch.setenv("NODE_NAME", "gpu-node-7")
    assert cli.main(["agent", "--once", "--publish", "--output", "json"]) == 0
    [(name, body, _)] = api.calls
    assert name == "gpu-node-7" and json.loads(capsys.readouterr().out) == json.loads(
        body["metadata"]["annotations"]["vllmfit.dev/gpu-inventory"]
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["agent", "--interval", "0"], "--interval must be positive"),
        (["agent", "--health-port", "70000"], "--health-port must be 0..65535"),
        (["agent"], "no node name"),
    ],
)
def test_bad_input_is_one_line(monkeypatch, capsys, argv, message):
    monkeypatch.delenv("NODE_NAME", raising=False)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("vllmfit: error: ") and message in err and len(err.strip().splitlines()) == 1


@pytest.mark.gpu
@pytest.mark.skipif(shutil.which("nvidia-smi") is None, reason="needs an NVIDIA GPU and nvidia-smi")
def test_collect_matches_nvidia_smi():
    out = subprocess.run(
        [
            "nvidia-smi",
            "--query-gpu=index,uuid,name,memory.total,memory.used",
            "--format=csv,noheader,nounits",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    smi = [[c.strip() for c in line.split(",")] for line in out.strip().splitlines()]
    inv = agent_nvml.collect()
    assert inv.nvml is True and len(inv.gpus) == len(smi)
    mib = 1 << 20
    for g, (index, uuid, name, total, used) in zip(inv.gpus, smi, strict=True):
        assert (g.index, g.uuid, g.product) == (int(index), uuid, name.replace(" ", "-"))
        assert abs(g.total_bytes - int(total) * mib) <= mib
        if g.error is None and not g.mig_enabled:
            assert abs(g.used_bytes - int(used) * mib) <= max(0.05 * int(used) * mib, 256 * mib)
