"""Issue 30: every pod vllmfit generates passes Pod Security Admission "baseline", and "restricted"
(the chart's default level) — the vLLM pods in each binding (visible devices, gated behind the
reservation gate, device plugin, DRA), with and without a tenant's podTemplate, and the
reservation pods.

The rules are the Kubernetes Pod Security Standards, encoded here as a table from the published page
(https://kubernetes.io/docs/concepts/security/pod-security-standards/, "Baseline" and "Restricted"
tables, Kubernetes v1.33), independently of vllmfit.core.spec.validate."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest

from vllmfit.backends import binding
from vllmfit.backends import reservation as rsv
from vllmfit.core.spec import api, validate
from vllmfit.operator.rendering import builders
from vllmfit.sources import catalog


def spec_problems(o: api.VLLMDeployment, policy: validate.Policy = validate.DEFAULT_POLICY) -> list[str]:
    """The one validator as the shells call it: with the catalog's answer for the model."""
    return validate.problems(o, catalog_model=catalog.knows(o.spec.model), policy=policy)

Pod = Mapping[str, Any]
Meta = Mapping[str, Any]

BASELINE_CAPS = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD", "NET_BIND_SERVICE",
                 "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
                "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                "net.ipv4.tcp_keepalive_probes"}
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                      "projected", "secret"}


def containers(pod: Pod) -> Iterator[Mapping[str, Any]]:
    for field in ("initContainers", "containers", "ephemeralContainers"):
        yield from pod.get(field) or []


def sc(c: Mapping[str, Any]) -> Mapping[str, Any]:
    return c.get("securityContext") or {}


def caps(c: Mapping[str, Any]) -> Mapping[str, Any]:
    return sc(c).get("capabilities") or {}


def contexts(pod: Pod) -> Iterator[Mapping[str, Any]]:
    yield pod.get("securityContext") or {}
    for c in containers(pod):
        yield sc(c)


# (level, control, check(pod spec, pod metadata) -> True when it passes)
RULES: list[tuple[str, str, Callable[[Pod, Meta], bool]]] = [
    ("baseline", "Host Namespaces", lambda p, m: not any(p.get(f) for f in ("hostNetwork", "hostPID", "hostIPC"))),
    ("baseline", "Privileged Containers", lambda p, m: not any(sc(c).get("privileged") for c in containers(p))),
    ("baseline", "Capabilities", lambda p, m: all(set(caps(c).get("add") or []) <= BASELINE_CAPS
                                                   for c in containers(p))),
    ("baseline", "HostPath Volumes", lambda p, m: not any("hostPath" in v for v in p.get("volumes") or [])),
    ("baseline", "Host Ports", lambda p, m: not any(port.get("hostPort") for c in containers(p)
                                                    for port in c.get("ports") or [])),
    ("baseline", "AppArmor", lambda p, m: all(
        v == "runtime/default" or str(v).startswith("localhost/")
        for k, v in (m.get("annotations") or {}).items() if k.startswith("container.apparmor.security.beta.kubernetes.io/"))
        and all((x.get("appArmorProfile") or {}).get("type") in (None, "RuntimeDefault", "Localhost") for x in contexts(p))),
    ("baseline", "SELinux", lambda p, m: all(
        (x.get("seLinuxOptions") or {}).get("type", "") in SELINUX_TYPES
        and not (x.get("seLinuxOptions") or {}).get("user") and not (x.get("seLinuxOptions") or {}).get("role")
        for x in contexts(p))),
    ("baseline", "/proc Mount Type", lambda p, m: all(sc(c).get("procMount") in (None, "Default") for c in containers(p))),
    ("baseline", "Seccomp", lambda p, m: all((x.get("seccompProfile") or {}).get("type") != "Unconfined"
                                             for x in contexts(p))),
    ("baseline", "Sysctls", lambda p, m: all(s.get("name") in SAFE_SYSCTLS
                                             for s in (p.get("securityContext") or {}).get("sysctls") or [])),
    ("baseline", "HostProcess", lambda p, m: not any((x.get("windowsOptions") or {}).get("hostProcess")
                                                     for x in contexts(p))),
    ("restricted", "Volume Types", lambda p, m: all(set(v) - {"name"} <= RESTRICTED_VOLUMES
                                                    for v in p.get("volumes") or [])),
    ("restricted", "Privilege Escalation", lambda p, m: all(sc(c).get("allowPrivilegeEscalation") is False
                                                            for c in containers(p))),
    ("restricted", "Running as Non-root", lambda p, m: all(sc(c).get("runAsNonRoot") is not False
                                                           for c in containers(p)) and (
        (p.get("securityContext") or {}).get("runAsNonRoot") is True
        or all(sc(c).get("runAsNonRoot") is True for c in containers(p)))),
    ("restricted", "Running as Non-root user", lambda p, m: all(x.get("runAsUser") != 0 for x in contexts(p))),
    ("restricted", "Seccomp", lambda p, m: all(
        (sc(c).get("seccompProfile") or (p.get("securityContext") or {}).get("seccompProfile") or {}).get("type")
        in ("RuntimeDefault", "Localhost") for c in containers(p))),
    ("restricted", "Capabilities", lambda p, m: all(
        "ALL" in (caps(c).get("drop") or []) and set(caps(c).get("add") or []) <= {"NET_BIND_SERVICE"}
        for c in containers(p))),
]


def violations(pod: Pod, meta: Meta, level: str) -> list[str]:
    levels = ("baseline",) if level == "baseline" else ("baseline", "restricted")
    return [f"{lv}: {control}" for lv, control, ok in RULES if lv in levels and not ok(pod, meta)]


FLAGS = api.Flags(max_model_len=8192, max_num_seqs=8, gpu_memory_utilization=0.5)
REPLICA = api.ReplicaPlacement(replica=0, node="gpu-a", gpus=[api.GpuRef(index=1, uuid="GPU-1"),
                                                                api.GpuRef(index=2, uuid="GPU-2")])
TEMPLATE = {  # a tenant's template the restricted level admits: a cache, a sidecar, timings
    "metadata": {"labels": {"team": "search"}},
    "spec": {
        "volumes": [{"name": "cache", "persistentVolumeClaim": {"claimName": "hf"}},
                    {"name": "scratch", "emptyDir": {"sizeLimit": "1Gi"}}],
        "securityContext": {"fsGroup": 2000},
        "containers": [
            {"name": "vllm", "volumeMounts": [{"name": "cache", "mountPath": "/cache"}],
             "securityContext": {"readOnlyRootFilesystem": False}},
            {"name": "proxy", "image": "envoy", "ports": [{"containerPort": 9000}],
             "lifecycle": {"preStop": {"exec": {"command": ["sleep", "5"]}}}}],
        "initContainers": [{"name": "warm", "image": "busybox", "command": ["true"]}],
    },
}


def obj(template: dict[str, Any] | None) -> api.VLLMDeployment:
    spec: dict[str, Any] = {"model": "meta-llama/Llama-3.1-8B-Instruct", "tensorParallelSize": 2}
    if template is not None:
        spec["podTemplate"] = copy.deepcopy(template)
    return api.VLLMDeployment.model_validate({"metadata": {"name": "llama", "namespace": "t"}, "spec": spec})


BINDINGS: dict[str, dict[str, Any]] = {
    "visible-devices": {"exclusive": False},
    "gated": {"exclusive": False, "gated": True, "pins": ["GPU-1", "GPU-2"]},
    "device-plugin": {"exclusive": True},
    "dra": {"exclusive": False, "claim_template": "llama-0-gpus"},
}


def vllm_pod(template: dict[str, Any] | None, **kw: Any) -> tuple[Pod, Meta]:
    d = builders.deployment(obj(template), REPLICA, FLAGS, "m", booked="1=1000000000,2=1000000000", **kw)
    return d["spec"]["template"]["spec"], d["spec"]["template"]["metadata"]


@pytest.mark.parametrize("template", [None, TEMPLATE], ids=["plain", "template"])
@pytest.mark.parametrize("mode", sorted(BINDINGS))
def test_every_vllm_pod_passes_restricted(mode: str, template: dict[str, Any] | None) -> None:
    o = obj(template)
    assert spec_problems(o) == []  # the restricted level (the chart's default) admits the template
    assert violations(*vllm_pod(template, **BINDINGS[mode]), "restricted") == []


def test_reservation_pods_pass_restricted() -> None:
    cfg = rsv.Config(namespace="vllmfit", image="vllmfit:1", runtime_class="nvidia")
    p = rsv.reservation_pod(cfg, "gpu-a", 1, "r-gpu-a-1")
    assert violations(p["spec"], p["metadata"], "restricted") == []


def test_a_template_the_baseline_level_admits_passes_baseline_only() -> None:
    # the checker can fail: root is baseline, not restricted; vllmfit admits it only where the chart says baseline
    root = {"spec": {"securityContext": {"runAsUser": 0, "runAsNonRoot": False},
                     "containers": [{"name": "vllm", "securityContext": {"capabilities": {"add": ["CHOWN"]}}}]}}
    assert spec_problems(obj(root)) != []
    assert spec_problems(obj(root), validate.Policy(level="baseline")) == []
    pod, meta = vllm_pod(root, exclusive=False)
    assert violations(pod, meta, "baseline") == []
    assert violations(pod, meta, "restricted") == ["restricted: Running as Non-root",
                                                   "restricted: Running as Non-root user",
                                                   "restricted: Capabilities"]


@pytest.mark.parametrize("level", ["baseline", "restricted"])
def test_every_template_the_validator_admits_passes_its_level(level: str) -> None:
    # what each level lets a tenant write, at the edge of what it allows
    edge = {"spec": {
        "securityContext": {"seccompProfile": {"type": "Localhost", "localhostProfile": "p.json"},
                            "sysctls": [{"name": "net.ipv4.tcp_keepalive_time", "value": "60"}]},
        "volumes": [{"name": "v", "projected": {"sources": []}}],
        "containers": [{"name": "proxy", "image": "x",
                        "securityContext": {"capabilities": {"add": ["NET_BIND_SERVICE"]},
                                            "seLinuxOptions": {"type": "container_t"}}}]}}
    policy = validate.Policy(level=level)  # type: ignore[arg-type]
    assert spec_problems(obj(edge), policy) == []
    for mode in sorted(BINDINGS):
        assert violations(*vllm_pod(edge, **BINDINGS[mode]), level) == [], mode


def test_with_the_mps_binding_only_its_host_directories_break_baseline() -> None:
    # MPS clients reach the daemon through host directories: a namespace of MPS-bound replicas needs the
    # privileged PSA level (docs/placement-backends.md, "Enforcement"); nothing else changes
    pod, meta = vllm_pod(TEMPLATE, exclusive=False, mps=binding.Mps())
    assert violations(pod, meta, "restricted") == ["baseline: HostPath Volumes", "restricted: Volume Types"]
    host = [v["name"] for v in pod["volumes"] if "hostPath" in v]
    assert host == [binding.MPS_PIPE_VOLUME, binding.MPS_LOG_VOLUME]
