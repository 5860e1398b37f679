"""Pod status JSON (as the kubelet reports it) -> health of a vLLM replica."""

from __future__ import annotations

import copy
from typing import Any

from vllmfit.operator.booking import pods

BASE: dict[str, Any] = {
    "apiVersion": "v1",
    "kind": "Pod",
    "metadata": {"name": "llama-0-7d9c7b8f5-x2x9q", "namespace": "default", "uid": "6a1c4f3e-pod",
                 "labels": {"vllmfit.dev/deployment": "llama", "vllmfit.dev/replica": "0"}},
    "status": {
        "phase": "Running",
        "conditions": [{"type": "PodScheduled", "status": "True", "lastTransitionTime": "2025-05-01T10:00:00Z"}],
        "hostIP": "10.0.0.12",
        "podIP": "10.244.1.17",
        "startTime": "2025-05-01T10:00:00Z",
        "containerStatuses": [],
    },
}


def pod(container: dict[str, Any] | None = None, **status: Any) -> dict[str, Any]:
    p = copy.deepcopy(BASE)
    p["status"].update(status)
    if container is not None:
        p["status"]["containerStatuses"] = [{
            "name": "vllm", "image": "vllm/vllm-openai:v0.33.0", "imageID": "", "containerID": "containerd://ab12",
            "started": False, "ready": False, "restartCount": 0, "state": {}, "lastState": {}, **container}]
    return p


RUNNING = {"state": {"running": {"startedAt": "2025-05-01T10:00:05Z"}}, "started": True}

CUDA_OOM_LOG = """\
INFO 05-01 10:01:12 [model_runner.py:1120] Loading model weights took 14.99 GiB
INFO 05-01 10:01:20 [worker.py:295] Memory profiling takes 6.01 seconds
ERROR 05-01 10:01:21 [engine.py:160] Traceback (most recent call last):
ERROR 05-01 10:01:21 [engine.py:160]   File "/usr/local/lib/python3.12/dist-packages/vllm/worker/worker.py", line 230
torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which 1.02 GiB is free.
INFO 05-01 10:01:22 [launcher.py:80] Shutting down FastAPI HTTP server.
"""

CONFIG_ERROR_LOG = """\
INFO 05-01 10:01:12 [api_server.py:1043] vLLM API server version 0.33.0
ValueError: The model's max seq len (131072) is larger than the maximum number of tokens that can be stored
Traceback (most recent call last):
  File "/usr/local/bin/vllm", line 8, in <module>
ValueError: Unknown quantization method: foo
"""


def crashloop(last: dict[str, Any], restarts: int = 4) -> dict[str, Any]:
    return {"restartCount": restarts, "state": {"waiting": {
        "reason": "CrashLoopBackOff", "message": "back-off 2m40s restarting failed container=vllm pod=llama-0"}},
        "lastState": {"terminated": {"startedAt": "2025-05-01T10:05:00Z", "finishedAt": "2025-05-01T10:06:00Z",
                                     "containerID": "containerd://cd34", **last}}}


def test_running_and_ready_is_serving() -> None:
    h = pods.pod_health(pod({**RUNNING, "ready": True}))
    assert (h.ready, h.reason, h.failed) == (True, "Serving", False)


def test_running_not_ready_is_loading_the_model() -> None:
    h = pods.pod_health(pod(RUNNING))
    assert (h.ready, h.reason, h.failed, h.needs_log) == (False, "Starting", False, False)


def test_oom_killed_crash_loop_is_failed() -> None:
    h = pods.pod_health(pod(crashloop({"exitCode": 137, "reason": "OOMKilled"})))
    assert (h.ready, h.reason, h.failed, h.needs_log) == (False, "OOMKilled", True, False)
    assert "OOMKilled" in h.message and "spec.resources.limits.memory" in h.message


def test_crash_loop_with_an_error_asks_for_the_log_then_finds_cuda_oom() -> None:
    p = pod(crashloop({"exitCode": 1, "reason": "Error"}))
    first = pods.pod_health(p)
    assert (first.ready, first.reason, first.needs_log, first.failed) == (False, "CrashLoopBackOff", True, False)
    h = pods.pod_health(p, CUDA_OOM_LOG)
    assert (h.ready, h.reason, h.failed, h.needs_log) == (False, "CudaOutOfMemory", True, False)
    assert h.message == ("vLLM ran out of GPU memory: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate "
                         "2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which 1.02 GiB is free.")


def test_crash_loop_for_another_reason_shows_the_last_error_line_and_may_recover() -> None:
    h = pods.pod_health(pod(crashloop({"exitCode": 1, "reason": "Error"}, restarts=2)), CONFIG_ERROR_LOG)
    assert (h.ready, h.reason, h.failed) == (False, "CrashLoopBackOff", False)
    assert h.message == "vLLM exited (2 restarts): ValueError: Unknown quantization method: foo"


def test_kv_cache_too_small_at_start_up_is_a_gpu_memory_failure() -> None:
    log = "ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization`"
    h = pods.pod_health(pod({"state": {"terminated": {"exitCode": 1, "reason": "Error"}}}), log)
    assert (h.reason, h.failed) == ("CudaOutOfMemory", True)


def test_image_pull_errors() -> None:
    for reason in ("ImagePullBackOff", "ErrImagePull"):
        h = pods.pod_health(pod({"state": {"waiting": {
            "reason": reason, "message": 'Back-off pulling image "vllm/vllm-openai:v9.9.9"'}}}, phase="Pending"))
        assert (h.ready, h.reason, h.failed) == (False, "ImagePullBackOff", False)
        assert "v9.9.9" in h.message


def test_unschedulable_pod_reports_the_scheduler_message() -> None:
    msg = "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."
    p = pod(None, phase="Pending", conditions=[{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                                "message": msg}])
    h = pods.pod_health(p)
    assert (h.ready, h.reason, h.message) == (False, "Unschedulable", msg)


def test_missing_secret_is_reported() -> None:
    h = pods.pod_health(pod({"state": {"waiting": {"reason": "CreateContainerConfigError",
                                                   "message": 'secret "hf" not found'}}}, phase="Pending"))
    assert (h.ready, h.reason, h.message) == (False, "CreateContainerConfigError", 'secret "hf" not found')


def test_log_line_prefers_out_of_memory_then_errors() -> None:
    assert pods.log_line("a\nb\n") == (False, "b")
    assert pods.log_line("") == (False, "")
    assert pods.log_line("x Error: one\nINFO ok\n") == (False, "x Error: one")


def test_summary_is_ready_only_when_every_replica_serves() -> None:
    ok = pods.PodHealth(True, "Serving", "")
    starting = pods.PodHealth(False, "Starting", "loading")
    crash = pods.PodHealth(False, "CrashLoopBackOff", "exited")
    oom = pods.PodHealth(False, "CudaOutOfMemory", "oom", failed=True)
    assert pods.summarize([(0, ok), (1, ok)], 2).ready
    assert pods.summarize([(0, ok), (1, ok)], 2).message == "2/2 replicas ready"
    assert not pods.summarize([(0, ok)], 2).ready
    assert pods.summarize([(0, ok), (1, starting)], 2).reason == "Starting"
    assert pods.summarize([(0, ok), (0, crash), (1, ok)], 2).reason == "CrashLoopBackOff"  # never healthy
    s = pods.summarize([(0, ok), (1, oom)], 2)
    assert (s.ready, s.failed, s.reason) == (False, True, "CudaOutOfMemory")
    assert pods.summarize([], 1).reason == "Pending"
