"""A ReplicaSet controller and kubelet for vllmfit's Deployments on KMock (which runs none), and
the invariant of issue 22: for every GPU, the sum over every pod that may be running on it is
within its budget at every instant.

- One pod per Deployment, at the placement its template carries, created only when no pod of
  that Deployment is left (the Recreate strategy vllmfit writes).
- A pod whose Deployment is gone or now carries another pod template (a move, a resize in place:
  the Deployment controller rolls it out) terminates: it gets a deletionTimestamp, keeps running for `grace` seconds (terminationGracePeriodSeconds, vLLM
  freeing its memory), then leaves the API.
- A pod holds what the stored status of its VLLMDeployment booked for its replica on each GPU
  when the pod started, read from the API (never from the operator's memory). A pod that starts
  where no stored status books its replica holds an unknown amount: a violation by itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from dataclasses import dataclass, field
from typing import Any

from opkit import DEPLOYMENTS, PODS, VD, Cluster, budget

from vllmfit.operator.rendering import builders


@dataclass
class Pod:
    name: str
    deployment: str  # the Deployment's name
    owner: str  # the VLLMDeployment's name
    replica: int
    where: str
    memory: dict[tuple[str, int], int] = field(default_factory=dict)
    template: dict[str, Any] = field(default_factory=dict)  # the Deployment's pod template it was made from
    ends_at: float | None = None  # terminating: leaves the API then


class Kubelet:
    def __init__(self, cluster: Cluster, grace: float = 0.3, gpus: dict[str, int] | None = None):
        self.cluster = cluster
        self.grace = grace
        self.pods: dict[str, Pod] = {}
        self.violations: list[str] = []
        self.errors: list[str] = []
        self.started = 0  # pods started
        self.last_status: dict[str, dict[str, Any]] = {}  # VLLMDeployment -> its status when last seen
        self.gpus = gpus  # node -> GPU count that exist (others are not checked)
        self.task: asyncio.Task[None] | None = None
        self.paused = False

    def start(self) -> None:
        self.task = asyncio.create_task(self._loop())

    async def ensure(self) -> None:
        """Running again after an operator restart: Kopf's stop cancels every task created while
        it ran (this loop too) and KMock's connections with them."""
        if self.task is None or self.task.done():
            await self.cluster.reconnect()
            self.start()

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
        await self.cluster.api.close()

    async def _loop(self) -> None:
        while True:
            try:
                if not self.paused:
                    # not asyncio.wait_for: on Python 3.11 its inner task can swallow the cancel
                    # that Kopf's stop sends to this loop, and the stop then waits forever
                    async with asyncio.timeout(2.0):
                        await self.step()
            except Exception as e:  # noqa: BLE001 - a connection closed by an operator restart: a new one
                self.errors.append(repr(e))
                await self.cluster.reconnect()
            await asyncio.sleep(0.02)

    def last_written(self, owner: str) -> dict[str, Any]:
        """The last status the API stored for `owner` (from the emulator's request log), for one
        deleted before this loop saw it."""
        for r in reversed(list(self.cluster.km.journal)):
            if str(r.method).upper().endswith("PATCH") and str(r.url).split("?")[0].endswith(
                    f"/vllmdeployments/{owner}/status") and isinstance(r.data, dict):
                return dict(r.data.get("status") or {})
        return {}

    def booked(self, owner: str, replica: int, where: str) -> dict[tuple[str, int], int] | None:
        # a VLLMDeployment deleted a moment ago (with no finalizer yet) takes its status along while
        # its Deployment is still there: the booking it had is the last status this loop saw, or the
        # last one written to the API (this loop may have seen only an earlier one)
        live = self.cluster.status(owner)
        for st in [live] if live else [self.last_status.get(owner) or {}, self.last_written(owner)]:
            if st.get("phase") not in ("Admitted", "Running", "Failed"):
                continue
            for p in st.get("placement") or []:
                if p["replica"] == replica and placement_of(p) == where:
                    return {(m["node"], m["index"]): m["totalBytes"] for m in st.get("memory") or []
                            if m["replica"] == replica}
        return None

    async def step(self) -> None:
        loop = asyncio.get_running_loop()
        for o in self.cluster.objects(VD):
            self.last_status[o["metadata"]["name"]] = o.get("status") or {}
        deps = {d["metadata"]["name"]: d for d in self.cluster.objects(DEPLOYMENTS)
                if (d["metadata"].get("labels") or {}).get(builders.MANAGED_BY) == "vllmfit"}
        for pod in list(self.pods.values()):
            if pod.ends_at is None:
                d = deps.get(pod.deployment)
                if d is None or d["spec"]["template"] != pod.template:
                    pod.ends_at = loop.time() + self.grace
                    # the API keeps a deleted pod (with a deletionTimestamp) until the kubelet says
                    # its containers terminated; KMock does the same while a finalizer is on it
                    await self.cluster.core.delete_namespaced_pod(pod.name, "default")
            elif loop.time() >= pod.ends_at:
                await self.cluster.core.patch_namespaced_pod(
                    pod.name, "default", {"metadata": {"finalizers": None}},
                    _content_type="application/merge-patch+json")
                with contextlib.suppress(Exception):
                    await self.cluster.core.delete_namespaced_pod(pod.name, "default")
                del self.pods[pod.name]
        for name, d in sorted(deps.items()):
            if any(p.deployment == name for p in self.pods.values()):
                continue  # Recreate: the new pod starts once the old one is gone
            now = self.cluster.get(DEPLOYMENTS, name)
            if now is None or now["spec"]["template"] != d["spec"]["template"]:
                continue  # deleted or changed meanwhile (its ReplicaSet goes with it)
            tmpl = d["spec"]["template"]
            labels = tmpl["metadata"]["labels"]
            where = tmpl["metadata"]["annotations"][builders.ANNOTATION_PLACEMENT]
            owner, replica = labels[builders.LABEL_DEPLOYMENT], int(labels[builders.LABEL_REPLICA])
            memory = self.booked(owner, replica, where)
            pod = Pod(f"{name}-{uuid.uuid4().hex[:5]}", name, owner, replica, where, memory or {}, tmpl)
            await self._create({
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": pod.name, "namespace": "default", "uid": str(uuid.uuid4()),
                             "resourceVersion": "1", "labels": dict(labels), "finalizers": ["tests/kubelet"],
                             "annotations": dict(tmpl["metadata"]["annotations"]),
                             "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": name,
                                                  "uid": str(uuid.uuid4()), "controller": True}]},
                "spec": {"nodeName": where.split(":")[0], "containers": tmpl["spec"]["containers"]},
                "status": {"phase": "Running"},
            }, pod.name)
            # it runs (and holds memory) only once the API has it: a create lost with a connection
            # closed by an operator restart started nothing
            self.pods[pod.name] = pod
            self.started += 1
            if memory is None:
                self.violations.append(f"pod of {name} started on {where} with no stored booking")
        self.check("")

    async def _create(self, manifest: dict[str, Any], name: str) -> None:
        try:
            await self.cluster.create(manifest)
        except Exception:
            if self.cluster.get(PODS, name) is None:
                raise  # not created: the next step tries again

    def used(self) -> dict[tuple[str, int], int]:
        out: dict[tuple[str, int], int] = {}
        for p in self.pods.values():
            for gpu, b in p.memory.items():
                out[gpu] = out.get(gpu, 0) + b
        return out

    def check(self, where: str) -> None:
        for (node, index), used in sorted(self.used().items()):
            if self.gpus is not None and index >= self.gpus.get(node, 0):
                continue  # that GPU is gone
            if used > budget():
                holders = sorted(f"{p.name}@{p.where}{' (terminating)' if p.ends_at else ''}"
                                 for p in self.pods.values() if (node, index) in p.memory)
                self.violations.append(f"{where or 'at an instant'}: {node} GPU {index} holds {used} > budget "
                                       f"{budget()}: {holders}")

    def assert_ok(self, where: str) -> None:
        assert not self.violations, f"{where}: {self.violations[:3]} (kubelet errors: {self.errors[:3]})"

    def all_pods(self) -> list[dict[str, Any]]:
        return self.cluster.objects(PODS)


def phase(cluster: Cluster, name: str) -> str | None:
    return cluster.status(name).get("phase")


def placement_of(p: dict[str, Any]) -> str:
    """A status placement entry as the pods' placement annotation writes it ("node:0,1")."""
    return f"{p['node']}:{','.join(str(g['index']) for g in p['gpus'])}"


def placed(cluster: Cluster, name: str) -> list[str]:
    return [placement_of(p) for p in cluster.status(name).get("placement") or []]


def exists(cluster: Cluster, name: str) -> bool:
    return cluster.get(VD, name) is not None

