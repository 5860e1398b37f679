"""/proc/<pid>/cgroup -> pod UID and container ID, for the systemd and cgroupfs drivers."""

from __future__ import annotations

import os
import re
from pathlib import Path

# --- /proc/<pid>/cgroup -> pod UID, container ID ------------------------------------------------

# systemd driver: .../kubepods-burstable-pod<uid with _>.slice/cri-containerd-<id>.scope
# (guaranteed pods: kubepods-pod<uid>.slice; kind: kubelet-kubepods-...)
_POD_SYSTEMD = re.compile(
    r"kubepods(?:-(?:burstable|besteffort|guaranteed))?-pod([0-9a-fA-F_]{32,36})\.slice"
)
# cgroupfs driver: /kubepods/burstable/pod<uid>/<container id>  (guaranteed: /kubepods/pod<uid>/...)
_POD_CGROUPFS = re.compile(
    r"/kubepods(?:/(?:burstable|besteffort|guaranteed))?/pod([0-9a-fA-F-]{32,36})(?:/([^/\s]+))?"
)
_CONTAINER_SCOPE = re.compile(r"(?:cri-containerd|docker|crio|containerd)-([0-9a-fA-F]{12,64})\.scope")
_CONTAINER_ID = re.compile(r"^(?:[a-z-]+-)?([0-9a-fA-F]{12,64})(?:\.scope)?$")


def parse_cgroup(text: str) -> tuple[str | None, str | None]:
    """(pod UID, container ID) from the text of /proc/<pid>/cgroup, cgroup v1 or v2.

    Lines are `hierarchy-id:controllers:path`. The first line naming a pod wins; a line naming
    a container too is preferred. Pod UIDs come back with dashes; the container ID is the bare
    hex ID the runtime uses (without `containerd://`).
    """
    best: tuple[str | None, str | None] = (None, None)
    for line in text.splitlines():
        path = line.split(":", 2)[-1].strip()
        if not path:
            continue
        pod: str | None = None
        container: str | None = None
        m = _POD_SYSTEMD.search(path)
        if m:
            pod = m.group(1).replace("_", "-")
            c = _CONTAINER_SCOPE.search(path, m.end())
            container = c.group(1) if c else None
        else:
            m = _POD_CGROUPFS.search(path)
            if m:
                pod = m.group(1)
                if m.group(2):
                    c = _CONTAINER_ID.match(m.group(2))
                    container = c.group(1) if c else None
        if pod is None:
            continue
        if container is not None:
            return pod, container
        if best[0] is None:
            best = (pod, None)
    return best


def pod_of_pid(pid: int, proc_root: str | os.PathLike[str] = "/proc") -> tuple[str | None, str | None]:
    """(pod UID, container ID) of a host PID, (None, None) when unknown or unreadable."""
    try:
        text = (Path(proc_root) / str(pid) / "cgroup").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None, None
    return parse_cgroup(text)


