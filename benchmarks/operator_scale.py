"""The operator at cluster scale: 500 VLLMDeployments applied at once to 100 emulated GPU nodes.

The Kubernetes API is KMock's emulator (tests/operator/opkit.Emulator), run in a child process so
that this process holds only the operator (Kopf + vllmfit.operator) and a thin client. Seeded:
100 nodes x 8 GPUs (H100 80GB, A100 80GB, A100 40GB, L40S) and 500 deployments from 0.5B to 70B,
mostly with explicit maxModelLen/maxNumSeqs, some tensor-parallel, some with 2 replicas. All are
POSTed at once (32 in flight); measured, per run:

- all_final_s: from the first POST until every VLLMDeployment shows a final phase
  (Admitted, Running, Unschedulable or Rejected) in the API (counted by the emulator as it
  publishes each write, read every 0.05 s: no listing through the API, whose megabytes of JSON at
  5,000 cost both processes more than a real cluster's watchers would);
- children_s: until every admitted replica also has its Deployment;
- peak RSS of the operator's process, resource.getrusage: each run is an operator process of its
  own (as a restarted operator is), so the figure is one operator's peak (in one process, a second
  run's peak sat on the first one's arenas: 3 runs at 5,000 read 853 MB where each alone read 520);
- the garbage collector's time and its longest pause (a gc callback) from the first POST until
  the emulator is quiet: the operator serves the admission webhook in this same process, so its
  longest pause is how long a review can wait behind a collection;
- the requests the emulator answered until it had none for 5 s after the children were written
  (the operator's backlog of echoes included), by kind ("update vllmdeployments/status") and per
  VLLMDeployment, and the operator's CPU until then (settle_cpu_s);
- the invariant: no GPU booked over its budget, recomputed from the stored statuses alone, against
  the budget the operator itself books against (its budget policy: `counted` by default, not
  ADR-0002's 0.9 x capacity - 2 GiB).

The emulated cluster has the `nvidia` RuntimeClass a GPU Operator cluster has (replicas that share
a GPU name it). With --without-runtimeclass it has none: every sharing replica is refused
(RuntimeClassNotFound) until the RuntimeClass appears; once every VLLMDeployment is final and
the emulator has answered no request for 5 s (quiet_s: the work queued before the refusals
ended), the operator's CPU is measured over --idle seconds while it waits (nothing polls
meanwhile; the requests it makes meanwhile are counted). The default, 30 s, is one period of the
operator's periodic resync (defaults.RESYNC_SECONDS: it lists the nodes, VLLMDeployments,
Deployments and pods and rebuilds its ledger), so the figure is the average a waiting operator
costs, resync included; a shorter window shows 0 % or, when it holds a resync, three times more.
Then the RuntimeClass is created and the
time until every replica's Deployment is written is measured (the RuntimeClass watch unblocks them).

--noop-kopf: the baseline. A Kopf operator that decides nothing runs instead of vllmfit, on the
same emulator with the same Kopf settings; its create handler writes what the benchmark waits for
(one Deployment per replica, a final phase). Its figures are Kopf's and the emulator's share of a
run: the floor vllmfit is held against when the emulator is the bottleneck (issue 32: within 2x).

--reviews: the operator's own admission webhook is served (webhook.setup, as the operator starts
it) and a client in another process sends it one validating review every 20 ms, from the first
POST until the emulator is quiet (review_probe.py): how long a review waits while the operator is
busy (its count, p50 / p99 / max, denials and reviews that got no answer).

--churn: once settled, every VLLMDeployment is deleted at once; measured: the seconds until the
API shows none (each delete handler done, its finalizer removed), with the requests made meanwhile
by kind, then the garbage a full collection finds only after gc.unfreeze() (what the start-up's
gc.freeze() froze and later became unreachable).

A run that does not settle within --timeout seconds is reported as a timeout (JSON: null and
`timed_out_runs_count`), never as a number. --quick: 5 nodes, 20 deployments, 60 s (the test
suite runs it so that it cannot rot).

Pinned to two CPU cores, like CI. Prints a table, then as its LAST line one JSON object whose keys
end in their units.

    .venv/bin/python benchmarks/operator_scale.py [--nodes 100] [--deployments 500] [--runs 3]
        [--timeout 600] [--without-runtimeclass [--idle 30]] [--noop-kopf] [--churn] [--reviews] [--quick] [--fleet]
    .venv/bin/python benchmarks/operator_scale.py --nodes 1000 --deployments 5000 --timeout 450   # the supported size
    .venv/bin/python benchmarks/operator_scale.py --fleet                                          # 40,000 on 10,000
    .venv/bin/python benchmarks/operator_scale.py --nodes 1000 --deployments 5000 --timeout 450 --noop-kopf
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import logging
import multiprocessing as mp
import os
import random
import resource
import shutil
import socket
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from vllmfit.core.defaults import RESYNC_SECONDS  # the waiting operator's window: one resync period

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "operator"))

PRODUCTS = (("NVIDIA-H100-80GB-HBM3", 4), ("NVIDIA-A100-SXM4-80GB", 3), ("NVIDIA-A100-SXM4-40GB", 2),
            ("NVIDIA-L40S", 1))
MIX = (  # (model, spec, weight)
    ("Qwen/Qwen2.5-0.5B-Instruct", {"maxModelLen": 4096, "maxNumSeqs": 16}, 6),
    ("Qwen/Qwen2.5-1.5B-Instruct", {"maxModelLen": 8192, "maxNumSeqs": 8}, 4),
    ("meta-llama/Llama-3.2-3B-Instruct", {"maxModelLen": 8192, "maxNumSeqs": 8}, 4),
    ("meta-llama/Llama-3.1-8B-Instruct", {"maxModelLen": 8192, "maxNumSeqs": 8}, 8),
    ("meta-llama/Llama-3.1-8B-Instruct", {"maxNumSeqs": 4}, 2),
    ("Qwen/Qwen2.5-7B-Instruct", {"maxModelLen": 16384, "maxNumSeqs": 4, "replicas": 2}, 4),
    ("mistralai/Mistral-7B-Instruct-v0.3", {"maxModelLen": 8192, "maxNumSeqs": 4}, 4),
    ("Qwen/Qwen2.5-14B-Instruct", {"maxModelLen": 8192, "maxNumSeqs": 8}, 3),
    ("Qwen/Qwen2.5-32B-Instruct", {"maxModelLen": 16384, "maxNumSeqs": 8, "tensorParallelSize": 2}, 2),
    ("meta-llama/Llama-3.1-70B-Instruct", {"maxModelLen": 16384, "maxNumSeqs": 8, "tensorParallelSize": 4}, 1),
)
FINAL = {"Admitted", "Running", "Unschedulable", "Rejected"}
GROUP, VERSION, PLURAL = "vllmfit.dev", "v1alpha1", "vllmdeployments"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve_emulator(port: int, ready: Any, served: Any = None, progress: Any = None,
                   kinds_path: str | None = None) -> None:
    """The child process: KMock's emulator on 127.0.0.1:port until killed; `served` (a shared
    counter) counts the requests it has answered; `progress` (shared counters) is what the API
    shows, kept by the emulator as it publishes each write (`Settled`); `kinds_path`: a JSON file
    kept with the requests answered so far by kind ("PATCH vllmdeployments/status"), every 0.5 s."""
    import kmock
    from opkit import DEPLOYMENTS, VD, Emulator

    logging.disable(logging.WARNING)
    tally = Settled(kmock.resource(VD), kmock.resource(DEPLOYMENTS))
    kinds: dict[str, int] = {}

    class Counted(Emulator):  # type: ignore[misc]
        async def _handle(self, request: Any) -> Any:
            if served is not None:
                with served.get_lock():
                    served.value += 1
            kind = request_kind(request)
            kinds[kind] = kinds.get(kind, 0) + 1
            return await super()._handle(request)

        def stamp(self, event: Any) -> None:
            super().stamp(event)
            tally.seen(event)

    async def main() -> None:
        async with Counted() as km, kmock.Server(km, port=port):
            km.resources.load_bundled()
            km.resources[VD] = kmock.ResourceInfo(kind="VLLMDeployment", namespaced=True,
                                                  subresources={"status"},
                                                  verbs={"get", "list", "watch", "create", "patch", "update",
                                                         "delete"})
            ready.set()
            ticks, dumped = 0, -1
            while progress is not None:
                await asyncio.sleep(0.05)
                progress[:] = tally.counts()
                ticks += 1
                if kinds_path and ticks % 10 == 0 and sum(kinds.values()) != dumped:
                    dumped = sum(kinds.values())
                    Path(kinds_path + ".tmp").write_text(json.dumps(kinds))
                    os.replace(kinds_path + ".tmp", kinds_path)
            await asyncio.Event().wait()

    asyncio.run(main())


def request_kind(request: Any) -> str:
    """A request's kind for the breakdown: its verb and resource ("patch vllmdeployments/status",
    "watch pods", "create events")."""
    verb = str(getattr(request.action or request.method, "name", "?")).lower()
    plural = getattr(request.resource, "plural", None) or request.url.path
    return f"{verb} {plural}{'/' + request.subresource if request.subresource else ''}"


class Settled:
    """What a listing of the API would show, kept from each write the emulator publishes (O(1) a
    write): VLLMDeployments, those in a final phase, the replicas their statuses place, and
    Deployments. No listing through the API: at 5,000 its megabytes of JSON cost both processes
    more than a real cluster's watchers would, and a scan of the store costs the emulator."""

    def __init__(self, vd: Any, deployments: Any) -> None:
        self.vd, self.deployments = vd, deployments
        self.vds: dict[tuple[str, str], tuple[bool, int]] = {}  # (final, replicas placed)
        self.final = self.placed = 0  # their sums, kept as they change: counts() is read every 50 ms
        self.children: set[tuple[str, str]] = set()

    def seen(self, event: Any) -> None:
        obj = event.get("object") or {}
        meta = obj.get("metadata") or {}
        key, gone = (meta.get("namespace"), meta.get("name")), event.get("type") == "DELETED"
        kind = (obj.get("apiVersion"), obj.get("kind"))
        if kind == (f"{GROUP}/{VERSION}", "VLLMDeployment"):
            st = obj.get("status") or {}
            final, placed = self.vds.pop(key, (False, 0))
            self.final, self.placed = self.final - final, self.placed - placed
            if not gone:
                final, placed = st.get("phase") in FINAL, len(st.get("placement") or [])
                self.vds[key] = (final, placed)
                self.final, self.placed = self.final + final, self.placed + placed
        elif kind == ("apps/v1", "Deployment"):
            (self.children.discard if gone else self.children.add)(key)

    def counts(self) -> list[int]:
        """O(1): the emulator publishes them every 50 ms (a sum over 40,000 statuses each time
        was a tenth of its CPU, on the cores the operator runs on)."""
        return [len(self.vds), self.final, self.placed, len(self.children)]


def nodes(n: int, rnd: random.Random) -> list[dict[str, Any]]:
    choices = [p for p, w in PRODUCTS for _ in range(w)]
    return [{"apiVersion": "v1", "kind": "Node",
             "metadata": {"name": f"gpu-{i:03d}", "uid": str(uuid.uuid4()), "resourceVersion": "1",
                          "labels": {"nvidia.com/gpu.product": rnd.choice(choices), "nvidia.com/gpu.count": "8"}}}
            for i in range(n)]


def deployments(n: int, rnd: random.Random, mutated: bool = True) -> list[dict[str, Any]]:
    """`n` VLLMDeployments as the API server stores them: with what vllmfit's mutating webhook
    adds at creation (its finalizer; verdict.finalizer_ops), which this emulator does not call;
    not `mutated`: as they are written (the no-op operator has no webhook)."""
    import jsonpatch

    from vllmfit.operator.admission.verdict import finalizer_ops

    mix = [(m, s) for m, s, w in MIX for _ in range(w)]
    out = []
    for i in range(n):
        model, spec = rnd.choice(mix)
        out.append({"apiVersion": f"{GROUP}/{VERSION}", "kind": "VLLMDeployment",
                    "metadata": {"name": f"d{i:04d}", "namespace": f"team-{i % 10}", "uid": str(uuid.uuid4()),
                                 "resourceVersion": "1", "generation": 1,
                                 "creationTimestamp": f"2030-01-01T00:{i // 60 % 60:02d}:{i % 60:02d}Z"},
                    "spec": {"model": model, **spec}})
        if mutated:
            jsonpatch.apply_patch(out[-1], finalizer_ops(out[-1]["metadata"]), in_place=True)
    return out


def budget_of(product: str) -> int:
    """A GPU's budget under the policy the operator books against (its options: `counted` unless
    --budget-policy / --budget-utilization / --budget-reserve say otherwise)."""
    from vllmfit.operator.booking.state import Options
    from vllmfit.sources import catalog

    return Options().budget.budget(catalog.gpu_for_label(product, None).cuda_total_bytes)


RUNTIME_CLASS = {"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass", "metadata": {"name": "nvidia"},
                 "handler": "nvidia"}
"""What the NVIDIA GPU Operator creates: the runtime class of the replicas that share a GPU."""


def noop_registry(url: str, started: asyncio.Event) -> Any:
    """The baseline: a Kopf operator that decides nothing. Its create handler writes what the
    benchmark waits for, as vllmfit would, with nothing computed: one Deployment per replica
    (spec.replicas) and a status in a final phase that lists them; Kopf's settings as vllmfit's
    (handlers.configure) but Kopf's own diff base, which a create handler needs (vllmfit's
    handlers queue VLLMDeployments from their events instead). What it costs is Kopf's and the
    emulator's share of a run."""
    import kopf
    from kubernetes_asyncio import client

    reg = kopf.OperatorRegistry()
    api: dict[str, Any] = {}

    @kopf.on.startup(registry=reg)
    async def start(**_: Any) -> None:
        api["client"] = client.ApiClient(client.Configuration(host=url))
        started.set()

    @kopf.on.login(registry=reg)
    async def login(**_: Any) -> Any:
        return kopf.ConnectionInfo(server=url, insecure=True)

    @kopf.on.cleanup(registry=reg)
    async def stop(**_: Any) -> None:
        await api["client"].close()

    @kopf.on.create(GROUP, VERSION, PLURAL, registry=reg)
    async def create(body: Any, patch: Any, **_: Any) -> None:
        meta, apps = body["metadata"], client.AppsV1Api(api["client"])
        replicas = int(body["spec"].get("replicas", 1))
        for r in range(replicas):
            name, labels = f"{meta['name']}-{r}", {"app": meta["name"], "replica": str(r)}
            manifest = {"apiVersion": "apps/v1", "kind": "Deployment",
                        "metadata": {"name": name, "namespace": meta["namespace"], "labels": labels},
                        "spec": {"replicas": 1, "selector": {"matchLabels": labels},
                                 "template": {"metadata": {"labels": labels},
                                              "spec": {"containers": [{"name": "vllm", "image": "vllm"}]}}}}
            kopf.adopt(manifest, owner=dict(body))
            with contextlib.suppress(client.ApiException):  # 409: written by an earlier run of the handler
                await apps.create_namespaced_deployment(meta["namespace"], manifest, _preload_content=False)
        patch.status["phase"] = "Admitted"
        patch.status["placement"] = [{"replica": r, "node": "", "gpus": []} for r in range(replicas)]

    return reg


async def one_run(n_nodes: int, n_deployments: int, seed: int, timeout: float = 600.0,
                  runtime_class: bool = True, idle: float = RESYNC_SECONDS, noop: bool = False,
                  churn: bool = False, reviews: bool = False) -> dict[str, Any]:
    import kopf
    from kubernetes_asyncio import client

    from vllmfit.operator import handlers
    from vllmfit.operator.booking.state import Store

    port = free_port()
    ready = mp.get_context("spawn").Event()
    served = mp.get_context("spawn").Value("q", 0)
    progress = mp.get_context("spawn").Array("q", 4)
    kinds_path = os.path.join(tempfile.mkdtemp(prefix="operator-scale-"), "kinds.json")
    child = mp.get_context("spawn").Process(target=serve_emulator, args=(port, ready, served, progress, kinds_path),
                                            daemon=True)
    child.start()
    if not ready.wait(60):
        raise RuntimeError("the emulator did not start")
    url = f"http://127.0.0.1:{port}"
    rnd = random.Random(seed)
    node_objs, objs = nodes(n_nodes, rnd), deployments(n_deployments, rnd, mutated=not noop)
    api = client.ApiClient(client.Configuration(host=url))
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    for n in node_objs:
        await core.create_node(n)
    if runtime_class:
        await client.NodeV1Api(api).create_runtime_class(RUNTIME_CLASS)

    store = Store(kube_config=client.Configuration(host=url))  # the operator's state, passed in through the memo
    settings = kopf.OperatorSettings()
    handlers.configure(settings)
    settings.batching.exit_timeout = 0.1
    probe: Any = None
    if noop:  # its create handler needs Kopf's change detection, which vllmfit's settings turn off
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP, key="last-handled-configuration")
        started = asyncio.Event()
        task = asyncio.create_task(kopf.operator(registry=noop_registry(url, started), settings=settings,
                                                 clusterwide=True, standalone=True))
        await started.wait()
    else:
        if reviews:  # the operator's own webhook, served by this operator (review_probe)
            from review_probe import Probe

            probe = Probe(free_port())
            probe.serve(settings, store)
        task = asyncio.create_task(kopf.operator(settings=settings, clusterwide=True, standalone=True,
                                                 memo=kopf.Memo(store=store)))
        while not (store.books.ready.is_set() and len(store.books.ledger.nodes) == n_nodes):
            await asyncio.sleep(0.05)
    await asyncio.sleep(0.5)  # the watches are up

    todo = iter(objs)

    async def poster() -> None:  # 32 in flight, not one waiting task per object: the client stays thin
        for o in todo:  # the answer read as bytes and dropped, not decoded into objects
            await (await custom.create_namespaced_custom_object(GROUP, VERSION, o["metadata"]["namespace"], PLURAL, o,
                                                                _preload_content=False)).read()

    if probe is not None:
        await asyncio.to_thread(probe.start)  # its client connects first (the server starts with Kopf)
    t0, cpu0 = time.monotonic(), time.process_time()
    pauses = Pauses()  # until the emulator is quiet (or the timeout)
    await asyncio.gather(*(poster() for _ in range(32)))
    posted_s = time.monotonic() - t0
    all_final_s = children_s = unblocked_s = quiet_s = None
    waiting_cpu_percent = waiting_requests = None
    while time.monotonic() - t0 < timeout:
        # what the API shows, as the emulator keeps it (Settled), every 0.05 s
        await asyncio.sleep(0.05)
        n, final, want, written = progress[:]
        if all_final_s is None and n == n_deployments and final == n:
            all_final_s = time.monotonic() - t0
            if not runtime_class:  # nothing can be written: the operator waits for the RuntimeClass
                quiet_s = await quiet(served, t0 + timeout)  # the work queued before the refusals ends
                c0, w0, n0 = time.process_time(), time.monotonic(), served.value
                await asyncio.sleep(idle)  # nothing polls meanwhile
                waiting_cpu_percent = 100 * (time.process_time() - c0) / (time.monotonic() - w0)
                waiting_requests = served.value - n0
                t1 = time.monotonic()
                await client.NodeV1Api(api).create_runtime_class(RUNTIME_CLASS)
                runtime_class = True
        if all_final_s is not None and runtime_class and written >= want:
            children_s = time.monotonic() - t0
            if waiting_cpu_percent is not None:
                unblocked_s = time.monotonic() - t1
            break
    operator_cpu_s = time.process_time() - cpu0
    resync_cpu_ms = None
    settle_kinds: dict[str, int] = {}
    review: dict[str, Any] = {}
    if children_s is not None:
        await quiet(served, time.monotonic() + 120)  # the operator's backlog (status echoes) ends first
        settle_cpu_s = time.process_time() - cpu0  # the settle's whole CPU, its backlog included
        if probe is not None:  # the reviews until quiet, the backlog included
            review = await asyncio.to_thread(probe.stop)
        pauses.stop()
        settle_kinds = await kinds_now(kinds_path)
        if not noop:  # bounded: at 5,000 the operator's backlog after every status is final runs for minutes
            with contextlib.suppress(TimeoutError):
                resync_cpu_ms = await asyncio.wait_for(resync_cpu(store), RESYNC_WAIT_S)
    pauses.stop()  # (already, unless the run timed out)
    if probe is not None and not review:
        review = await asyncio.to_thread(probe.stop)
    items = await stored(custom)  # once, for the invariant
    deleted_s = hidden = None
    churn_kinds: dict[str, int] = {}
    if churn and children_s is not None:
        deleted_s, hidden = await delete_all(custom, items, progress, served, timeout)
        churn_kinds = {k: v - settle_kinds.get(k, 0) for k, v in (await kinds_now(kinds_path)).items()
                       if v > settle_kinds.get(k, 0)}
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await store.stop()
    if store.api is not None:
        await store.api.close()
        store.api = None
    await api.close()
    child.kill()
    child.join()
    shutil.rmtree(os.path.dirname(kinds_path), ignore_errors=True)
    emulator_cpu_s = resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime + \
        resource.getrusage(resource.RUSAGE_CHILDREN).ru_stime  # this run's (its process has one)

    budgets = {n["metadata"]["name"]: budget_of(n["metadata"]["labels"]["nvidia.com/gpu.product"])
               for n in node_objs}
    used: dict[tuple[str, int], int] = {}
    counts: dict[str, int] = {}
    for i in items:
        st = i.get("status") or {}
        counts[st.get("phase")] = counts.get(st.get("phase"), 0) + 1
        if st.get("phase") in ("Admitted", "Running", "Failed"):
            for m in st.get("memory") or []:
                used[(m["node"], m["index"])] = used.get((m["node"], m["index"]), 0) + m["totalBytes"]
    over = sum(1 for (n, _), v in used.items() if v > budgets[n])
    return {"posted_s": posted_s, "all_final_s": all_final_s, "children_s": children_s,
            "waiting_cpu_percent": waiting_cpu_percent, "unblocked_s": unblocked_s, "quiet_s": quiet_s,
            "waiting_requests": waiting_requests, "requests": served.value, "resync_cpu_ms": resync_cpu_ms,
            "admitted": counts.get("Admitted", 0) + counts.get("Running", 0),
            "unschedulable": counts.get("Unschedulable", 0), "rejected": counts.get("Rejected", 0),
            "gpus_used": len(used), "overbooked": over, "operator_cpu_s": operator_cpu_s,
            "settle_cpu_s": settle_cpu_s if children_s is not None else None, "settle_kinds": settle_kinds,
            "emulator_cpu_total_s": emulator_cpu_s, "gc_s": pauses.total_s,
            "gc_longest_ms": 1000 * pauses.longest_s, "gc_longest_generation": pauses.longest_generation,
            "deleted_s": deleted_s, "hidden_garbage": hidden, "churn_kinds": churn_kinds,
            **{f"review_{k}": v for k, v in review.items()}}


async def kinds_now(kinds_path: str) -> dict[str, int]:
    """The requests the emulator has answered so far, by kind, from its next count (every 0.5 s;
    {} when it wrote none)."""
    await asyncio.sleep(0.6)
    with contextlib.suppress(OSError, ValueError):
        return dict(json.loads(Path(kinds_path).read_text()))
    return {}


async def stored(custom: Any) -> list[dict[str, Any]]:
    """Every VLLMDeployment as the API stores it, trimmed to what the invariant and --churn read
    (its name, namespace and phase, and its status's memory), listed 500 at a time: the
    benchmark's own listing must not add 40,000 whole objects to the peak RSS it reports as the
    operator's (it runs in the operator's process)."""
    items: list[dict[str, Any]] = []
    token = None
    while True:
        answer = await custom.list_cluster_custom_object(GROUP, VERSION, PLURAL, limit=500, _continue=token,
                                                         _preload_content=False)
        page = json.loads(await answer.read())
        for o in page.get("items") or []:
            st = o.get("status") or {}
            items.append({"metadata": {k: o["metadata"][k] for k in ("name", "namespace")},
                          "status": {"phase": st.get("phase"), "memory": [
                              {k: m[k] for k in ("node", "index", "totalBytes")} for m in st.get("memory") or []]}})
        if not (token := (page.get("metadata") or {}).get("continue")):
            return items


async def delete_all(custom: Any, items: list[dict[str, Any]], progress: Any, served: Any,
                     timeout: float) -> tuple[float | None, int]:
    """--churn: every VLLMDeployment deleted at once (32 in flight). Returns the seconds until the
    API shows none (the operator's delete handler has released each, and its finalizer with it;
    None: not within `timeout`), and, once the emulator is quiet, how many objects a full
    collection finds only after gc.unfreeze(): garbage hidden in the frozen set (the operator
    freezes its rebuilt ledger at start-up, Store.rebuild)."""
    from kubernetes_asyncio.client import ApiException

    sem = asyncio.Semaphore(32)

    async def delete(o: dict[str, Any]) -> None:
        async with sem:
            with contextlib.suppress(ApiException):  # 404: gone already
                await custom.delete_namespaced_custom_object(GROUP, VERSION, o["metadata"]["namespace"], PLURAL,
                                                             o["metadata"]["name"])

    t0 = time.monotonic()
    await asyncio.gather(*(delete(o) for o in items))
    gone_s = None
    while time.monotonic() - t0 < timeout:
        await asyncio.sleep(0.05)
        if progress[0] == 0:
            gone_s = time.monotonic() - t0
            break
    await quiet(served, time.monotonic() + 120)
    gc.collect()  # the garbage outside the frozen set
    gc.unfreeze()
    return gone_s, gc.collect()  # what only the frozen set held


class Pauses:
    """The garbage collector's pauses of this process while it is installed (a gc callback): its
    time in all, and its longest pause with that pause's generation. The operator serves the
    admission webhook in the same process, so a pause is how long a review can wait for it."""

    def __init__(self) -> None:
        self.total_s, self.longest_s, self.longest_generation = 0.0, 0.0, -1
        self._start = 0.0
        gc.callbacks.append(self._seen)

    def _seen(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        took = time.perf_counter() - self._start
        self.total_s += took
        if took > self.longest_s:
            self.longest_s, self.longest_generation = took, info["generation"]

    def stop(self) -> None:
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(self._seen)


RESYNC_WAIT_S = 60.0
"""How long the idle-resync figure waits for the operator's writes to drain (then: "not quiet")."""


async def resync_cpu(store: Any, rounds: int = 3, tries: int = 20) -> float | None:
    """The CPU of one periodic resync of the settled operator (handlers.startup.resync_once: its
    listings and the ledger's correction), the median of `rounds`, in ms: what the resync costs
    each defaults.RESYNC_SECONDS when nothing changed. None when `tries` resyncs did not get
    `rounds` done (each skips while a status write or a change is in flight: not settled)."""
    from vllmfit.operator.handlers import startup

    await store.writer.flush()
    cpu: list[float] = []
    for _ in range(tries):
        c0 = time.process_time()
        if await startup.resync_once(store):
            cpu.append(1000 * (time.process_time() - c0))
            if len(cpu) == rounds:
                return statistics.median(cpu)
        else:
            await asyncio.sleep(0.5)
    return None


async def quiet(served: Any, deadline: float, still: float = 5.0) -> float:
    """Wait until the emulator has answered no request for `still` seconds (the operator has
    nothing left to do; nothing else calls it meanwhile); returns the seconds waited. 5 s: the
    operator's retries of the replicas it cannot write yet back off, so its backlog of status writes
    comes in bursts up to 2 s apart (a 2 s stillness ended inside it, and the window measured it)."""
    t, last, since = time.monotonic(), served.value, time.monotonic()
    while time.monotonic() - since < still and time.monotonic() < deadline:
        await asyncio.sleep(0.25)
        if served.value != last:
            last, since = served.value, time.monotonic()
    return time.monotonic() - t


def operator_process(args: tuple[Any, ...], answer: Any) -> None:
    """One run (one_run(*args)) in the process it is spawned in: an operator process of its own.
    Puts its result on `answer`, with this process's peak RSS and its RSS after the imports."""
    logging.basicConfig(level=logging.ERROR)
    logging.getLogger("kopf").setLevel(logging.ERROR)
    import kopf  # noqa: F401  (imported before vllmfit.operator, as under `kopf run`)

    import vllmfit.operator.handlers  # noqa: F401  (registers the handlers)

    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result = asyncio.run(one_run(*args))
    answer.put({**result, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                "import_rss_mb": base})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=100)
    p.add_argument("--deployments", type=int, default=500)
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a run may take to settle")
    p.add_argument("--without-runtimeclass", action="store_true",
                   help="no `nvidia` RuntimeClass at first: measure the operator's CPU while it waits for one")
    p.add_argument("--idle", type=float, default=RESYNC_SECONDS,
                   help="seconds the waiting operator's CPU is measured (default: one resync period)")
    p.add_argument("--quick", action="store_true", help="5 nodes, 20 deployments, 60 s: a smoke run")
    p.add_argument("--fleet", action="store_true",
                   help="10,000 nodes, 40,000 deployments, 3,600 s: the largest cluster docs/install.md sizes")
    p.add_argument("--churn", action="store_true",
                   help="then delete every VLLMDeployment at once: seconds until none is left, and the garbage "
                        "hidden in the collector's frozen set")
    p.add_argument("--reviews", action="store_true",
                   help="serve the operator's admission webhook and send it a review every 20 ms while the "
                        "deployments settle (review_probe.py): its latency while the operator is busy")
    p.add_argument("--noop-kopf", action="store_true",
                   help="the baseline: a Kopf operator that decides nothing (noop_registry), on the same emulator")
    a = p.parse_args()
    if a.noop_kopf and a.without_runtimeclass:
        p.error("--noop-kopf needs no RuntimeClass; leave out --without-runtimeclass")
    if a.reviews and a.noop_kopf:
        p.error("--reviews measures vllmfit's webhook; the no-op operator serves none")
    if a.churn and a.noop_kopf:
        p.error("--churn measures vllmfit's delete handler; the no-op operator has none")
    if a.quick:
        a.nodes, a.deployments, a.timeout, a.idle = 5, 20, 60.0, 2.0
    if a.fleet:
        a.nodes, a.deployments, a.timeout = 10_000, 40_000, max(a.timeout, 3600.0)
    try:
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:2])
    except (AttributeError, OSError):
        pass
    logging.basicConfig(level=logging.ERROR)
    logging.getLogger("kopf").setLevel(logging.ERROR)
    from vllmfit.operator.booking import own_memory

    runs = []
    for _ in range(a.runs):
        ctx = mp.get_context("spawn")
        answer = ctx.Queue()
        proc = ctx.Process(target=operator_process, args=((a.nodes, a.deployments, a.seed, a.timeout,
                                                           not a.without_runtimeclass, a.idle, a.noop_kopf,
                                                           a.churn, a.reviews), answer))
        proc.start()
        runs.append(answer.get())
        proc.join()
    peak_rss = statistics.median(r["peak_rss_mb"] for r in runs)
    base_rss = statistics.median(r["import_rss_mb"] for r in runs)
    need_mb = own_memory.needed_bytes(a.deployments, a.nodes) / (1 << 20)  # the line the operator warns by
    r0 = runs[0]
    timed_out = sum(1 for r in runs if r["children_s"] is None)

    def med(key: str) -> float | None:
        """The median over the runs that got there (None: none did, a timeout)."""
        vals = [r[key] for r in runs if r[key] is not None]
        return statistics.median(vals) if vals else None

    def show(key: str, fmt: str = ".2f") -> str:
        v = med(key)
        return f"timeout ({a.timeout:.0f} s)" if v is None else f"{v:{fmt}}"

    def rounded(key: str) -> float | None:
        v = med(key)
        return None if v is None else round(v, 2)

    print(f"operator scale{' (BASELINE: a no-op Kopf operator)' if a.noop_kopf else ''}: "
          f"{a.deployments} VLLMDeployments at once onto {a.nodes} nodes x 8 GPUs "
          f"(KMock emulator in a child process); {a.runs} run(s), median; CPU cores "
          f"{len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()}")
    print(f"{'measure':<54} {'value':>14}")
    waiting = (
        ("seconds until the emulator had no request for 2 s", show("quiet_s")),
        ("operator CPU while it waits for a RuntimeClass (%)", show("waiting_cpu_percent", ".1f")),
        ("requests to the emulator meanwhile", show("waiting_requests", ".0f")),
        ("RuntimeClass created -> every Deployment written (s)", show("unblocked_s")),
    ) if a.without_runtimeclass else ()
    for r in runs:
        r["settle_requests_per_deployment"] = sum(r["settle_kinds"].values()) / a.deployments \
            if r["settle_kinds"] else None
    for label, value in (
        ("all POSTed (s)", show("posted_s")),
        ("every VLLMDeployment in a final phase (s)", show("all_final_s")),
        ("every admitted replica has its Deployment (s)", show("children_s")),
        *waiting,
        ("admitted / unschedulable / rejected", f"{r0['admitted']}/{r0['unschedulable']}/{r0['rejected']}"),
        ("GPUs in use", f"{r0['gpus_used']}"),
        ("GPUs over budget (from the statuses)", f"{max(r['overbooked'] for r in runs)}"),
        ("CPU of this process while they settle (s)", show("operator_cpu_s")),
        ("  the same, until the emulator is quiet for 5 s (s)", show("settle_cpu_s")),
        ("requests until quiet, per VLLMDeployment", show("settle_requests_per_deployment")),
        ("CPU of one idle resync, after they settled (ms)",
         "not quiet" if med("resync_cpu_ms") is None else show("resync_cpu_ms", ".0f")),
        ("garbage collector: its time in all, until quiet (s)", show("gc_s")),
        (f"  its longest pause (ms; generation {r0['gc_longest_generation']} in the first run)",
         show("gc_longest_ms", ".0f")),
        *((("--churn: all deleted at once, until none is left (s)", show("deleted_s")),
           ("  then garbage hidden in the frozen set (objects)", show("hidden_garbage", ".0f"))) if a.churn else ()),
        *((("--reviews: reviews answered while they settled", show("review_count", ".0f")),
           ("  review latency p50 / p99 / max (ms)",
            f"{show('review_p50_ms')} / {show('review_p99_ms')} / {show('review_max_ms')}"),
           ("  denied / no answer", f"{show('review_denied_count', '.0f')} / {show('review_failed_count', '.0f')}"))
          if a.reviews else ()),
        ("CPU of the emulator process, per run (s)", show("emulator_cpu_total_s")),
        ("requests the emulator answered", show("requests", ".0f")),
        ("peak RSS of the operator process (MB; median of the runs)", f"{peak_rss:.0f}"),
        ("  what docs/install.md sizes the operator for (MB)", f"{need_mb:.0f}"),
        ("RSS after imports (MB)", f"{base_rss:.0f}"),
    ):
        print(f"{label:<54} {value:>14}")
    for title, kinds in (("", r0["settle_kinds"]), ("--churn, the deletions: ", r0["churn_kinds"])):
        if title and kinds:
            print(title)
        for kind in sorted(kinds, key=lambda k: -kinds[k]):  # the first run's, until quiet: what each request is
            print(f"  {kind:<52} {kinds[kind]:>8} {kinds[kind] / a.deployments:>5.2f}/deployment")
    print(json.dumps({
        "nodes": a.nodes, "deployments": a.deployments, "runs": a.runs, "timeout_s": a.timeout,
        "baseline": "noop-kopf" if a.noop_kopf else None,
        "timed_out_runs_count": timed_out,
        "all_final_s": rounded("all_final_s"), "children_s": rounded("children_s"),
        "waiting_cpu_percent": rounded("waiting_cpu_percent"), "unblocked_s": rounded("unblocked_s"),
        "quiet_s": rounded("quiet_s"), "waiting_requests_count": med("waiting_requests"),
        "requests_count": med("requests"),
        "all_final_runs_s": [None if r["all_final_s"] is None else round(r["all_final_s"], 2) for r in runs],
        "admitted_count": r0["admitted"], "unschedulable_count": r0["unschedulable"],
        "rejected_count": r0["rejected"], "overbooked_gpus_count": max(r["overbooked"] for r in runs),
        "operator_cpu_s": rounded("operator_cpu_s"), "settle_cpu_s": rounded("settle_cpu_s"),
        "settle_requests_per_deployment_count": rounded("settle_requests_per_deployment"),
        "resync_cpu_ms": rounded("resync_cpu_ms"),
        "gc_s": rounded("gc_s"), "gc_longest_ms": rounded("gc_longest_ms"),
        "deleted_s": rounded("deleted_s") if a.churn else None,
        **({k: rounded(k) for k in ("review_count", "review_p50_ms", "review_p99_ms", "review_max_ms",
                                     "review_denied_count", "review_failed_count")} if a.reviews else {}),
        "hidden_garbage_count": med("hidden_garbage") if a.churn else None,
        "emulator_cpu_s": rounded("emulator_cpu_total_s"),
        "peak_rss_mb": round(peak_rss, 1), "import_rss_mb": round(base_rss, 1),
        "peak_rss_runs_mb": [round(r["peak_rss_mb"], 1) for r in runs],
        "documented_need_mb": round(need_mb, 1),
    }))


if __name__ == "__main__":
    main()
