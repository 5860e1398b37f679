"""Security contexts no broader than a Pod Security level (pure): the rules of the Kubernetes Pod
Security Standards (https://kubernetes.io/docs/concepts/security/pod-security-standards/, "Baseline"
and "Restricted"), applied to what a podTemplate writes, plus no privilege escalation at any level.
vllmfit's generated pods carry the restricted defaults and a template is merged over them field by
field (vllmfit.operator.rendering.podtemplate), so checking what the template writes is checking the pod."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

Level = Literal["baseline", "restricted"]

BASELINE_CAPABILITIES = frozenset({"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
                                   "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"})
RESTRICTED_CAPABILITIES = frozenset({"NET_BIND_SERVICE"})
SELINUX_TYPES = frozenset({"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"})
SAFE_SYSCTLS = frozenset({"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
                          "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                          "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                          "net.ipv4.tcp_keepalive_probes"})
APPARMOR_ANNOTATION = "container.apparmor.security.beta.kubernetes.io/"
POD_SC_FIELDS = frozenset({"fsGroup", "fsGroupChangePolicy", "runAsGroup", "runAsNonRoot", "runAsUser", "seccompProfile",
                           "appArmorProfile", "seLinuxOptions", "supplementalGroups", "supplementalGroupsPolicy",
                           "sysctls", "windowsOptions", "seLinuxChangePolicy"})
CONTAINER_SC_FIELDS = frozenset({"allowPrivilegeEscalation", "capabilities", "privileged", "readOnlyRootFilesystem",
                                 "runAsGroup", "runAsNonRoot", "runAsUser", "seccompProfile", "appArmorProfile",
                                 "seLinuxOptions", "procMount", "windowsOptions"})


def security_context_problems(sc: Any, where: str, level: Level, *, pod: bool) -> list[str]:
    """Fields of one securityContext broader than `level` (pod: the PodSecurityContext)."""
    if sc is None:
        return []
    if not isinstance(sc, Mapping):
        return [f"{where} must be an object"]
    out = []
    allowed = POD_SC_FIELDS if pod else CONTAINER_SC_FIELDS
    out += [f"{where}.{k}: not a securityContext field a podTemplate may set; remove it" for k in sorted(sc)
            if k not in allowed]
    if sc.get("privileged") is True:
        out.append(f"{where}.privileged: a privileged container sees every GPU of the node; remove it")
    if sc.get("allowPrivilegeEscalation") is True:
        out.append(f"{where}.allowPrivilegeEscalation: true lets a process gain more privileges than its parent; "
                   "remove it")
    caps = sc.get("capabilities")
    if isinstance(caps, Mapping):
        can = RESTRICTED_CAPABILITIES if level == "restricted" else BASELINE_CAPABILITIES
        for cap in caps.get("add") or []:
            if cap not in can:
                out.append(f"{where}.capabilities.add[{str(cap)[:40]}]: the {level} Pod Security level allows only "
                           f"{', '.join(sorted(can))}; remove it")
        drop = caps.get("drop")
        if level == "restricted" and drop is not None and "ALL" not in (drop or []):
            out.append(f"{where}.capabilities.drop must include ALL (the restricted Pod Security level)")
    elif caps is not None:
        out.append(f"{where}.capabilities must be an object")
    for key in ("seccompProfile", "appArmorProfile"):
        prof = sc.get(key)
        kind = prof.get("type") if isinstance(prof, Mapping) else None
        if kind == "Unconfined":
            out.append(f"{where}.{key}.type: Unconfined turns the kernel's confinement off; use RuntimeDefault")
        elif key == "seccompProfile" and level == "restricted" and prof is not None \
                and kind not in ("RuntimeDefault", "Localhost"):
            out.append(f"{where}.seccompProfile.type must be RuntimeDefault or Localhost (the restricted level)")
    se = sc.get("seLinuxOptions")
    if isinstance(se, Mapping):
        if se.get("type", "") not in SELINUX_TYPES:
            out.append(f"{where}.seLinuxOptions.type {str(se.get('type'))[:40]!r}: the {level} Pod Security level "
                       f"allows only {', '.join(sorted(t for t in SELINUX_TYPES if t))}")
        out += [f"{where}.seLinuxOptions.{k}: custom SELinux users and roles are not allowed; remove it"
                for k in ("user", "role") if se.get(k)]
    if sc.get("procMount") not in (None, "Default"):
        out.append(f"{where}.procMount: only Default; remove it")
    if isinstance(sc.get("windowsOptions"), Mapping) and sc["windowsOptions"].get("hostProcess") is True:
        out.append(f"{where}.windowsOptions.hostProcess: host processes are not allowed; remove it")
    for sysctl in sc.get("sysctls") or [] if pod else []:
        name = sysctl.get("name") if isinstance(sysctl, Mapping) else sysctl
        if name not in SAFE_SYSCTLS:
            out.append(f"{where}.sysctls[{str(name)[:60]}]: not one of the safe sysctls Pod Security allows; "
                       "remove it")
    if level == "restricted":
        if sc.get("runAsNonRoot") is False:
            out.append(f"{where}.runAsNonRoot: false; the restricted Pod Security level needs a non-root user")
        if sc.get("runAsUser") == 0:
            out.append(f"{where}.runAsUser: 0 is root; the restricted Pod Security level needs a non-root user")
    return out


