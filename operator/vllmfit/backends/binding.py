"""How a replica's container is bound to the GPUs the core chose, as data the pod builder applies.

- `device-plugin`: the replica takes whole GPUs of its node; `nvidia.com/gpu` limits make the
  device plugin hand them over, and Kubernetes accounts for them.
- `visible-devices`: the replica shares GPUs; no GPU limit, NVIDIA_VISIBLE_DEVICES names the GPUs
  (by UUID when known) and the `nvidia` runtime class makes the NVIDIA container runtime inject
  exactly those. Kubernetes accounts for those GPUs through reservation pods
  (vllmfit.backends.reservation): the pod carries a scheduling gate, lifted by the operator once
  every GPU it is pinned to is held (docs/placement-backends.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from vllmfit.backends import dra, enforcement, reservation
from vllmfit.core import defaults
from vllmfit.core.spec import api, validate

GPU_RESOURCE = defaults.GPU_RESOURCE
RUNTIME_CLASS = "nvidia"
PIN_DEVICE_PLUGIN = "device-plugin"
PIN_VISIBLE_DEVICES = "visible-devices"
PIN_DRA = "dra"


@dataclass(frozen=True)
class Binding:
    """What the pod builder adds for the GPUs: container limits and env, pod-spec fields."""

    mode: str
    limits: dict[str, Any] = field(default_factory=dict)
    env: tuple[dict[str, Any], ...] = ()
    pod: dict[str, Any] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)  # on the pod template
    claims: tuple[dict[str, Any], ...] = ()  # the container's resources.claims
    volumes: tuple[dict[str, Any], ...] = ()  # pod volumes (the MPS binding's host directories)
    mounts: tuple[dict[str, Any], ...] = ()  # the container's volumeMounts of those


@dataclass(frozen=True)
class Mps:
    """The optional MPS binding (chart value `mps.enabled`, off by default; docs/placement-backends.md,
    "Enforcement"): on nodes that run NVIDIA's MPS control daemon, a sharing replica's CUDA context
    goes through MPS, which refuses it device memory beyond CUDA_MPS_PINNED_DEVICE_MEM_LIMIT, set here
    to what vllmfit booked for it on each GPU. The container reaches the daemon through its pipe
    directory (CUDA_MPS_PIPE_DIRECTORY) and log directory (CUDA_MPS_LOG_DIRECTORY), mounted from the
    host at the same paths."""

    pipe_directory: str = defaults.MPS_PIPE_DIRECTORY
    log_directory: str = defaults.MPS_LOG_DIRECTORY


MPS_PIPE_VOLUME = validate.MPS_PIPE_VOLUME
MPS_LOG_VOLUME = validate.MPS_LOG_VOLUME


def mps_limit(booked: Sequence[int]) -> str:
    """CUDA_MPS_PINNED_DEVICE_MEM_LIMIT for a container whose GPUs have these booked bytes, in GPU
    index order: "0=22418M,1=22418M" (device ordinal = limit; NVIDIA's MPS documentation,
    "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"). M is MiB, rounded down: the limit never exceeds the booking.
    The ordinals are the container's own CUDA devices, which CUDA_DEVICE_ORDER=PCI_BUS_ID numbers in
    the order NVML (and so vllmfit's GPU indices) does."""
    return ",".join(f"{i}={b // defaults.MIB}M" for i, b in enumerate(booked))


def mps_parts(mps: Mps, booked: Sequence[int]) -> tuple[tuple[dict[str, Any], ...], tuple[dict[str, Any], ...],
                                                         tuple[dict[str, Any], ...]]:
    """(env, volumes, mounts) of the MPS binding for GPUs with these booked bytes."""
    env = ({"name": "CUDA_DEVICE_ORDER", "value": "PCI_BUS_ID"},
           {"name": "CUDA_MPS_PIPE_DIRECTORY", "value": mps.pipe_directory},
           {"name": "CUDA_MPS_LOG_DIRECTORY", "value": mps.log_directory},
           {"name": "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "value": mps_limit(booked)})
    volumes = ({"name": MPS_PIPE_VOLUME, "hostPath": {"path": mps.pipe_directory, "type": "Directory"}},
               {"name": MPS_LOG_VOLUME, "hostPath": {"path": mps.log_directory, "type": "Directory"}})
    mounts = ({"name": MPS_PIPE_VOLUME, "mountPath": mps.pipe_directory},
              {"name": MPS_LOG_VOLUME, "mountPath": mps.log_directory})
    return env, volumes, mounts


def visible_devices(gpus: Sequence[api.GpuRef]) -> str:
    """NVIDIA_VISIBLE_DEVICES for these GPUs: UUIDs when every one is known, else indices."""
    uuids = [g.uuid for g in gpus]
    return ",".join(u for u in uuids if u) if all(uuids) else ",".join(str(g.index) for g in gpus)


def bind(replica: api.ReplicaPlacement, n_gpus: int, *, exclusive: bool, pins: Sequence[str] | None = None,
         gated: bool = False, claim_template: str | None = None, runtime_class: str | None = RUNTIME_CLASS,
         mps: Mps | None = None, booked: Sequence[int] = (), enforce: str = enforcement.NONE) -> Binding:
    """`pins`: the UUIDs to pin to (None: from the placement). `gated`: the pod waits behind the
    reservation gate until the operator sees every pinned GPU held; with no pins known yet it
    names no GPU (`void`) and is replaced once they are. `claim_template`: a DRA node; the
    container gets its GPUs through a claim made from that ResourceClaimTemplate (the DRA driver
    exposes them; no limit, no runtime class; NVIDIA_VISIBLE_DEVICES=void). `runtime_class`: the
    RuntimeClass of sharing replicas, the same as the reservation pods' (chart value
    `placement.reservation.runtimeClassName`; empty or None where the NVIDIA runtime is the
    default). `mps` (with `booked`, the bytes booked on each of the replica's GPUs in index order):
    a sharing replica also gets the MPS memory limit (`Mps`). `enforce` (vllmfit.backends.enforcement):
    with `driver-limits` a sharing replica gets the driver's per-container limits from `booked`."""
    if claim_template:
        # The driver's CDI edits inject the claimed GPUs; void keeps the NVIDIA runtime (the
        # default runtime on GPU Operator nodes) from adding what an image's own env names
        # (CUDA images say `all`). NVIDIA's own CDI specs carry the same value.
        pod_fields, container = dra.pod_binding(claim_template)
        return Binding(PIN_DRA, pod=pod_fields, claims=tuple(container["claims"]),
                       env=({"name": "NVIDIA_VISIBLE_DEVICES", "value": reservation.VOID},))
    if exclusive:
        return Binding(PIN_DEVICE_PLUGIN, limits={GPU_RESOURCE: n_gpus})
    if pins is None and not gated:
        visible = visible_devices(replica.gpus)
    else:
        visible = ",".join(pins or ()) or reservation.VOID
    env: tuple[dict[str, Any], ...] = ({"name": "NVIDIA_VISIBLE_DEVICES", "value": visible},
                                       {"name": "NVIDIA_DRIVER_CAPABILITIES", "value": "compute,utility"})
    volumes: tuple[dict[str, Any], ...] = ()
    mounts: tuple[dict[str, Any], ...] = ()
    if mps is not None and booked:
        more, volumes, mounts = mps_parts(mps, booked)
        env += more
    if enforce == enforcement.DRIVER_LIMITS and booked:
        env += enforcement.driver_env(booked)
    pod: dict[str, Any] = {"runtimeClassName": runtime_class} if runtime_class else {}
    annotations: dict[str, str] = {}
    if gated:
        pod["schedulingGates"] = [{"name": reservation.GATE}]
        annotations[reservation.ANNOTATION_PINS] = ",".join(pins or ())
    return Binding(PIN_VISIBLE_DEVICES, env=env, pod=pod, annotations=annotations, volumes=volumes, mounts=mounts)
