"""`vllmfit reserve`: the container of a GPU reservation pod (device-plugin backend).

The pod requests `nvidia.com/gpu: 1`; the device plugin picks the GPU and the NVIDIA container
runtime exposes exactly that one to the container. This command asks NVML which GPU it sees
(exactly one, else it fails and the pod restarts), writes its UUID on its own pod as the
annotation `vllmfit.dev/gpu-uuid` (a merge patch with the pod's service-account token), writes
the readiness file, then sleeps until it is stopped. It never touches the GPU otherwise.

The same way KAI-Scheduler's reservation pods report their GPU: it needs nothing on the node (no
hostPath, no kubelet socket, no privilege), so it works on managed clusters too. An annotation
already there (a restarted container) is kept.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import threading
from types import ModuleType
from typing import Any

from vllmfit.agent.nvml import NO_NVML_HINT

ANNOTATION_UUID = "vllmfit.dev/gpu-uuid"  # = vllmfit.backends.reservation.ANNOTATION_UUID
READY_FILE = "/run/vllmfit/reported"
MERGE_PATCH = "application/merge-patch+json"


def visible_uuid(nvml: ModuleType) -> str:
    """The UUID of the one GPU this container sees. Raises RuntimeError otherwise."""
    try:
        nvml.nvmlInit()
    except Exception as e:  # noqa: BLE001 - every NVML failure is reported the same way
        raise RuntimeError(f"NVML: {e} ({NO_NVML_HINT})") from None
    try:
        n = nvml.nvmlDeviceGetCount()
        if n != 1:
            raise RuntimeError(f"found {n} GPUs, 1 was expected (does the pod request nvidia.com/gpu: 1 and run "
                               f"with the NVIDIA runtime?)")
        uuid = nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(0))
        return uuid.decode() if isinstance(uuid, bytes) else str(uuid)
    finally:
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()


def report(core_v1: Any, name: str, namespace: str, uuid: str) -> None:
    """Write the UUID on the pod, unless it already carries one."""
    pod = core_v1.read_namespaced_pod(name, namespace)
    have = ((pod.metadata.annotations or {}) if pod.metadata else {}).get(ANNOTATION_UUID)
    if have:
        if have != uuid:
            raise RuntimeError(f"pod {namespace}/{name} already reports {have}, NVML sees {uuid}")
        return
    core_v1.patch_namespaced_pod(name, namespace, {"metadata": {"annotations": {ANNOTATION_UUID: uuid}}},
                                 _content_type=MERGE_PATCH)


def run(args: argparse.Namespace) -> int:
    import pynvml
    from kubernetes import client, config

    name, namespace = os.environ.get("POD_NAME"), os.environ.get("POD_NAMESPACE")
    if not name or not namespace:
        raise ValueError("POD_NAME and POD_NAMESPACE must be set (downward API)")
    uuid = visible_uuid(pynvml)
    config.load_incluster_config()
    report(client.CoreV1Api(), name, namespace, uuid)
    print(f"reserved {uuid}", flush=True)
    with open(args.ready_file, "w") as f:
        f.write(uuid + "\n")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("reserve", help="Hold one GPU for vllmfit (the container of a GPU reservation pod).",
                       description="Report the one GPU NVML sees on this pod's annotation, then sleep.")
    p.add_argument("--ready-file", default=READY_FILE, help="written once reported (readiness probe)")
    p.set_defaults(func=run)
