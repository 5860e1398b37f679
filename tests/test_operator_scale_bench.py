"""benchmarks/operator_scale.py runs in its quick mode (5 nodes, 20 deployments, KMock in a child
process) and ends with one JSON line whose keys end in units, so that it cannot rot again
(issue 32: it waited out its 600 s for a RuntimeClass its emulator did not have, and reported NaN)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "operator_scale.py"


def _run(*args: str) -> dict:
    out = subprocess.run([sys.executable, str(BENCH), "--quick", *args], capture_output=True, text=True,
                         check=True, timeout=240).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_operator_scale_quick_settles_within_budget_reviews_and_deletes() -> None:
    r = _run("--churn", "--reviews")
    assert r["timed_out_runs_count"] == 0 and r["all_final_s"] is not None and r["children_s"] is not None
    assert r["admitted_count"] + r["unschedulable_count"] + r["rejected_count"] == r["deployments"] == 20
    assert r["admitted_count"] > 0
    assert r["overbooked_gpus_count"] == 0  # against the operator's own (counted) budget
    # every VLLMDeployment's POST, status, Deployment and Service at least, counted by kind
    assert r["settle_requests_per_deployment_count"] >= 4 and r["settle_cpu_s"] >= r["operator_cpu_s"]
    assert r["gc_longest_ms"] is not None and r["gc_s"] is not None
    # --reviews: the operator's own webhook answered every review sent while they settled
    assert r["review_count"] > 0 and r["review_failed_count"] == 0
    assert r["review_p99_ms"] is not None and r["review_denied_count"] >= 0
    # --churn: every one deleted at once is gone (each delete handler done, its finalizer removed)
    assert r["deleted_s"] is not None and isinstance(r["hidden_garbage_count"], int)
    # beside its peak RSS, what docs/install.md sizes the operator for at this size: 128 MiB +
    # 20 x 40 KiB + 5 x 16 KiB (core.defaults' measured line)
    assert r["documented_need_mb"] == round((128 * 1024 + 20 * 40 + 5 * 16) / 1024, 1)


def test_operator_scale_quick_waits_for_the_runtimeclass() -> None:
    r = _run("--without-runtimeclass")
    assert r["timed_out_runs_count"] == 0 and r["unblocked_s"] is not None  # written once it exists
    assert r["waiting_cpu_percent"] is not None


def test_operator_scale_quick_noop_kopf_baseline() -> None:
    """The baseline the operator is held against when the emulator is the bottleneck (issue 32)."""
    r = _run("--noop-kopf")
    assert r["baseline"] == "noop-kopf" and r["timed_out_runs_count"] == 0 and r["children_s"] is not None
    assert r["admitted_count"] == r["deployments"] == 20 and r["requests_count"] > 0


def test_settled_keeps_what_a_listing_would_show() -> None:
    """The emulator's progress counters (read every 50 ms, kept as each write is published):
    after these events, a listing would show two VLLMDeployments, one of them final with two
    replicas placed, and one Deployment."""
    sys.path.insert(0, str(BENCH.parent))
    from operator_scale import Settled

    def vd(name: str, kind: str = "MODIFIED", phase: str | None = None, placed: int = 0) -> dict:
        status = {"phase": phase, "placement": [{}] * placed} if phase else {}
        return {"type": kind, "object": {"apiVersion": "vllmfit.dev/v1alpha1", "kind": "VLLMDeployment",
                                         "metadata": {"namespace": "ns", "name": name}, "status": status}}

    s = Settled(None, None)
    for e in (vd("a", "ADDED"), vd("b", "ADDED"), vd("c", "ADDED"), vd("a", phase="Admitted", placed=1),
              vd("a", phase="Running", placed=2), vd("b", phase="Pending"), vd("c", phase="Admitted", placed=3),
              vd("c", "DELETED", phase="Admitted", placed=3),
              {"type": "ADDED", "object": {"apiVersion": "apps/v1", "kind": "Deployment",
                                           "metadata": {"namespace": "ns", "name": "a-0"}}}):
        s.seen(e)
    assert s.counts() == [2, 1, 2, 1]
