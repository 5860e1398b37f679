"""The chart's PrometheusRule, unit-tested with `promtool test rules` on series written here.

The rules are the ones `helm template` renders (metrics.prometheusRule.enabled=true), so what is
tested is what ships. promtool comes from Debian's `prometheus` package (`apt-get install -y
prometheus`; `.ci/run` installs it in CI, `make test` never does); without it the tests that
need it skip with that reason. Each alert has a case where it fires (with its labels and summary,
written by hand here) and one where it does not.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from .conftest import find, one

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (Debian: apt-get install -y "
                                                              "prometheus; .ci/run installs it in CI: make promtool)")
ALERTS = {"VllmfitGpuOverBudget", "VllmfitGpuOverBooked", "VllmfitMemoryDrift", "VllmfitDeploymentPending",
          "VllmfitDeploymentFailed", "VllmfitWebhookErrors", "VllmfitWebhookSlow", "VllmfitAgentNotReporting",
          "VllmfitReservationLost", "VllmfitOperatorNotReady", "VllmfitOperatorMemoryNearLimit",
          "VllmfitOperatorUndersized"}
ON = ("--set", "metrics.prometheusRule.enabled=true", "--set-json", 'metrics.prometheusRule.alertLabels={"team":"ml"}')
GPU_A = 'node="gpu-a",gpu="0",uuid="GPU-aaaa",product="NVIDIA-H100-80GB-HBM3"'
OP_1 = 'namespace="vllmfit",pod="op-1",instance="10.0.0.1:8080",job="vllmfit-operator"'
OP_2 = 'namespace="vllmfit",pod="op-2",instance="10.0.0.2:8080",job="vllmfit-operator"'
GPU_B = 'node="gpu-b",gpu="1",uuid="GPU-bbbb",product="NVIDIA-H100-80GB-HBM3"'


def rules(render: Any) -> dict[str, Any]:
    rule = one(render("default", *ON), "PrometheusRule")
    return {"groups": rule["spec"]["groups"]}


def test_prometheus_rule_is_off_by_default(render: Any) -> None:
    assert not find(render(), "PrometheusRule")


def test_every_alert_is_rendered_with_severity_and_routing_labels(render: Any) -> None:
    got = {r["alert"]: r for g in rules(render)["groups"] for r in g["rules"]}
    assert set(got) == ALERTS
    for r in got.values():
        assert r["labels"]["team"] == "ml" and r["labels"]["severity"] in ("warning", "critical")
        assert r["annotations"]["summary"] and r["annotations"]["description"]


def test_thresholds_come_from_values(render: Any) -> None:
    rule = one(render("default", *ON, "--set-json", "metrics.prometheusRule.driftRatio=0.25",
                      "--set", "metrics.prometheusRule.stuckFor=1h"), "PrometheusRule")
    got = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}
    assert got["VllmfitMemoryDrift"]["expr"].endswith("> 0.25")
    assert got["VllmfitDeploymentPending"]["for"] == "1h"


def series(name: str, labels: str, values: str) -> dict[str, str]:
    return {"series": f"{name}{{{labels}}}", "values": values}


def alert(labels: dict[str, str], summary: str) -> dict[str, Any]:
    return {"exp_labels": {**labels, "team": "ml"}, "exp_annotations": {"summary": summary}}


# Every case: (alert, series, eval time, expected alerts). `instance` tells the two operator
# replicas apart: each exports the same ledger, and each alert must fire once, not per replica.
CASES: list[tuple[str, list[dict[str, str]], str, list[dict[str, Any]]]] = [
    ("VllmfitGpuOverBudget", [
        series("vllmfit_gpu_observed_bytes", GPU_A + ',instance="op-1"', "80000000000x30"),
        series("vllmfit_gpu_observed_bytes", GPU_A + ',instance="op-2"', "80000000000x30"),
        series("vllmfit_gpu_budget_bytes", GPU_A + ',instance="op-1"', "70000000000x30"),
        series("vllmfit_gpu_budget_bytes", GPU_A + ',instance="op-2"', "70000000000x30"),
        series("vllmfit_gpu_observed_bytes", GPU_B + ',instance="op-1"', "60000000000x30"),  # under budget
        series("vllmfit_gpu_budget_bytes", GPU_B + ',instance="op-1"', "70000000000x30"),
    ], "15m", [alert({"severity": "critical", "node": "gpu-a", "gpu": "0", "uuid": "GPU-aaaa",
                      "product": "NVIDIA-H100-80GB-HBM3"},
                     "GPU 0 of node gpu-a uses more memory than vllmfit's budget")]),
    ("VllmfitGpuOverBudget", [  # over budget for 5 minutes only: `for: 10m` not reached
        series("vllmfit_gpu_observed_bytes", GPU_A, "60000000000x10 80000000000x5"),
        series("vllmfit_gpu_budget_bytes", GPU_A, "70000000000x15"),
    ], "15m", []),
    ("VllmfitGpuOverBooked", [
        series("vllmfit_gpu_headroom_bytes", GPU_A, "-1073741824x30"),
        series("vllmfit_gpu_headroom_bytes", GPU_B, "1073741824x30"),
    ], "15m", [alert({"severity": "warning", "node": "gpu-a", "gpu": "0", "uuid": "GPU-aaaa",
                      "product": "NVIDIA-H100-80GB-HBM3"}, "The ledger of gpu-a GPU 0 is over budget")]),
    ("VllmfitMemoryDrift", [
        series("vllmfit_deployment_drift_ratio", 'namespace="ml",name="llama",node="gpu-a",gpu="0"', "0.2x30"),
        series("vllmfit_deployment_drift_ratio", 'namespace="ml",name="qwen",node="gpu-a",gpu="1"', "0.05x30"),
    ], "15m", [alert({"severity": "warning", "namespace": "ml", "name": "llama", "node": "gpu-a", "gpu": "0"},
                     "ml/llama uses more GPU memory than predicted")]),
    ("VllmfitDeploymentPending", [
        series("vllmfit_deployment_phase", 'namespace="ml",name="stuck",phase="Pending"', "1x50"),
        series("vllmfit_deployment_phase", 'namespace="ml",name="quick",phase="Pending"', "1x10"),  # then decided
        series("vllmfit_deployment_phase", 'namespace="ml",name="quick",phase="Admitted"', "_x10 1x40"),
    ], "45m", [alert({"severity": "warning", "namespace": "ml", "name": "stuck"}, "ml/stuck has been Pending too long")]),
    ("VllmfitDeploymentFailed", [
        series("vllmfit_deployment_phase", 'namespace="ml",name="crash",phase="Failed"', "1x50"),
        series("vllmfit_deployment_phase", 'namespace="ml",name="blip",phase="Failed"', "_x30 1x20"),  # 20 min only
    ], "45m", [alert({"severity": "critical", "namespace": "ml", "name": "crash"}, "ml/crash has been Failed too long")]),
    ("VllmfitWebhookErrors", [  # 10 errors in 100 reviews a minute: 10 % > 5 %
        series("vllmfit_webhook_duration_seconds_count", 'webhook="validate",outcome="error"', "0+10x30"),
        series("vllmfit_webhook_duration_seconds_count", 'webhook="validate",outcome="allowed"', "0+90x30"),
    ], "20m", [alert({"severity": "critical"}, "vllmfit's admission webhook answers with errors")]),
    ("VllmfitWebhookErrors", [  # 1 in 100: 1 %
        series("vllmfit_webhook_duration_seconds_count", 'webhook="validate",outcome="error"', "0+1x30"),
        series("vllmfit_webhook_duration_seconds_count", 'webhook="validate",outcome="allowed"', "0+99x30"),
    ], "20m", []),
    ("VllmfitWebhookSlow", [  # of 100 reviews a minute 90 take over 1 s: p99 is in the (1, 2.5] bucket
        series("vllmfit_webhook_duration_seconds_bucket", 'webhook="validate",outcome="allowed",le="0.5"', "0+10x30"),
        series("vllmfit_webhook_duration_seconds_bucket", 'webhook="validate",outcome="allowed",le="1"', "0+10x30"),
        series("vllmfit_webhook_duration_seconds_bucket", 'webhook="validate",outcome="allowed",le="2.5"',
               "0+100x30"),
        series("vllmfit_webhook_duration_seconds_bucket", 'webhook="validate",outcome="allowed",le="+Inf"',
               "0+100x30"),
    ], "20m", [alert({"severity": "warning"}, "vllmfit's validating webhook is slow")]),
    ("VllmfitWebhookSlow", [  # every review under 10 ms
        series("vllmfit_webhook_duration_seconds_bucket", 'webhook="validate",outcome="allowed",le="0.01"',
               "0+100x30"),
        series("vllmfit_webhook_duration_seconds_bucket", 'webhook="validate",outcome="allowed",le="+Inf"',
               "0+100x30"),
    ], "20m", []),
    ("VllmfitAgentNotReporting", [  # gpu-a's agent sampled once at t=0; gpu-b's keeps sampling
        series("vllmfit_node_inventory_timestamp_seconds", 'node="gpu-a"', "0x30"),
        series("vllmfit_node_inventory_timestamp_seconds", 'node="gpu-b"', "0+60x30"),
    ], "15m", [alert({"severity": "warning", "node": "gpu-a"}, "The vllmfit agent on gpu-a stopped reporting")]),
    ("VllmfitReservationLost", [
        series("vllmfit_reservations", 'state="unschedulable"', "1x30"),
        series("vllmfit_reservations", 'state="held"', "3x30"),
    ], "15m", [alert({"severity": "warning"}, "GPU reservation pods do not hold their GPUs")]),
    ("VllmfitReservationLost", [  # pending for a minute while the pod starts: normal
        series("vllmfit_reservations", 'state="pending"', "0x5 1 0x24"),
        series("vllmfit_reservations", 'state="held"', "3x30"),
    ], "15m", []),
    ("VllmfitOperatorNotReady", [series("vllmfit_ledger_ready", 'instance="op-1"', "0x20")], "10m",
     [alert({"severity": "critical"}, "No vllmfit operator replica has a ledger")]),
    ("VllmfitOperatorNotReady", [series("vllmfit_build_info", 'version="0.1.0"', "1x20")], "10m",  # no ledger series
     [alert({"severity": "critical"}, "No vllmfit operator replica has a ledger")]),
    ("VllmfitOperatorNotReady", [series("vllmfit_ledger_ready", 'instance="op-1"', "0x20"),
                                 series("vllmfit_ledger_ready", 'instance="op-2"', "1x20")], "10m", []),
    # 960 MiB of a 1 GiB limit (0.94 > 0.85) on op-1; op-2 at 512 MiB does not fire
    ("VllmfitOperatorMemoryNearLimit", [
        series("process_resident_memory_bytes", OP_1, "1006632960x20"),
        series("vllmfit_operator_memory_limit_bytes", OP_1, "1073741824x20"),
        series("process_resident_memory_bytes", OP_2, "536870912x20"),
        series("vllmfit_operator_memory_limit_bytes", OP_2, "1073741824x20"),
    ], "10m", [alert({"severity": "warning", "namespace": "vllmfit", "pod": "op-1"},
                     "vllmfit operator op-1 is close to its memory limit")]),
    ("VllmfitOperatorMemoryNearLimit", [  # no limit given (--memory-limit unset): nothing to compare
        series("process_resident_memory_bytes", OP_1, "1006632960x20")], "10m", []),
    # the cluster needs 1.2 GiB at peak, the limit is 1 GiB
    ("VllmfitOperatorUndersized", [
        series("vllmfit_operator_memory_needed_bytes", OP_1, "1288490189x20"),
        series("vllmfit_operator_memory_limit_bytes", OP_1, "1073741824x20"),
    ], "10m", [alert({"severity": "warning", "namespace": "vllmfit", "pod": "op-1"},
                     "The cluster is larger than vllmfit operator op-1's memory limit allows")]),
    ("VllmfitOperatorUndersized", [
        series("vllmfit_operator_memory_needed_bytes", OP_1, "805306368x20"),
        series("vllmfit_operator_memory_limit_bytes", OP_1, "1073741824x20"),
    ], "10m", []),
]


def promtool(tmp_path: Path, rule_doc: dict[str, Any], cases: list[Any]) -> subprocess.CompletedProcess:
    """Write the rules (descriptions left out: promtool compares every annotation, and those are
    long prose; `promtool check rules` still parses their templates) and the cases; run promtool."""
    trimmed = {"groups": [{**g, "rules": [{**r, "annotations": {"summary": r["annotations"]["summary"]}}
                                          for r in g["rules"]]} for g in rule_doc["groups"]]}
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(trimmed))
    tests = [{"interval": "1m", "input_series": s,
              "alert_rule_test": [{"eval_time": t, "alertname": name, "exp_alerts": exp}]}
             for name, s, t, exp in cases]
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump({"rule_files": ["rules.yaml"], "evaluation_interval": "1m",
                                                         "tests": tests}))
    return subprocess.run([PROMTOOL or "promtool", "test", "rules", "tests.yaml"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60, check=False)


@needs_promtool
def test_promtool_checks_the_rendered_rules(render: Any, tmp_path: Path) -> None:
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rules(render)))
    proc = subprocess.run([PROMTOOL or "promtool", "check", "rules", "rules.yaml"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in proc.stdout


@needs_promtool
def test_every_alert_fires_on_its_series_and_not_otherwise(render: Any, tmp_path: Path) -> None:
    assert {c[0] for c in CASES} == ALERTS
    assert {c[0] for c in CASES if c[3]} == ALERTS  # each one fires somewhere
    proc = promtool(tmp_path, rules(render), CASES)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


@needs_promtool
def test_promtool_would_catch_a_wrong_expectation(render: Any, tmp_path: Path) -> None:
    """The harness can fail: a case expecting no alert where one fires is reported."""
    name, s, t, _ = CASES[0]
    proc = promtool(tmp_path, rules(render), [(name, s, t, [])])
    assert proc.returncode != 0 and "VllmfitGpuOverBudget" in proc.stdout + proc.stderr
