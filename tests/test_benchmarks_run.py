"""Every benchmark the README and docs name runs from a clone (issue 31), each in a quick mode:
it needs nothing outside the repository (the calibration logs are in tests/data/calibration) and
ends, as every benchmark must, with one JSON object whose keys end in their unit."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
QUICK = {  # benchmark -> the arguments of its quick mode
    "accuracy.py": [],
    "plan_scale.py": ["--quick"],
    "webhook_latency.py": ["--quick"],
    "event_fuzz.py": ["--seeds", "1", "--steps", "10"],
    "review_fairness.py": ["--nodes", "20", "--deployments", "40", "--seconds", "2"],
    "snapshot_cost.py": ["--nodes", "20", "--deployments", "40"],
    "node_report.py": ["--quick"],
    "fair_share.py": ["--quick"],
    "selection_cache.py": ["--nodes", "20", "--reviews", "200", "--joins", "3"],
}
ELSEWHERE = {"operator_scale.py": "tests/test_operator_scale_bench.py",
             "review_probe.py": "tests/test_operator_scale_bench.py"}  # operator_scale.py --reviews
"""Benchmarks whose quick mode another test runs and checks more closely (not run twice)."""
UNITS = ("_s", "_ms", "_mb", "_gib", "_pct", "_count", "_bytes")
"""How a key of a benchmark's JSON line ends (its unit); a few name what was counted or set."""


def documented() -> set[str]:
    text = "\n".join(p.read_text() for p in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
    return set(re.findall(r"benchmarks/([a-z_]+\.py)", text)) | set(
        re.findall(r"`([a-z_]+\.py)`: ", (ROOT / "README.md").read_text()))


def test_every_documented_benchmark_has_a_quick_mode() -> None:
    assert documented() and documented() <= set(QUICK) | set(ELSEWHERE)
    assert all((ROOT / "benchmarks" / name).exists() for name in (*QUICK, *ELSEWHERE))


@pytest.mark.parametrize("name", sorted(QUICK))
def test_the_benchmark_runs_from_a_clone(name: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / name), *QUICK[name]], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert isinstance(last, dict) and last
    if name == "webhook_latency.py":  # the fitting specs allowed, the one that fits nowhere denied
        assert last["seq_denied_count"] == 0 and last["deny_denied_count"] == 200 and last["baseline"] is None
    if name == "accuracy.py":  # the figures the README quotes, from the logs in the repository
        assert last["cases"] == 52 and last["kv_overpredicted_over_0_5_gib_count"] == 0
        assert last["logged_context_above_budget_context_count"] == 0


def test_the_webhook_benchmark_measures_its_floor(tmp_path: Path) -> None:
    """--noop-kopf: the same reviews to a Kopf webhook that decides nothing (kopf.WebhookServer
    over TLS): every one answered and allowed, the spec that fits nowhere included."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "webhook_latency.py"), "--quick", "--noop-kopf"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert last["baseline"] == "noop-kopf" and last["deny_denied_count"] == 0 and last["seq_p50_ms"] > 0
