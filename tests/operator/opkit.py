"""Helpers for the operator tests: object factories, the emulated cluster, the operator task.

See shared/testing.md §2: declare the resources (list+watch are required), set uid,
resourceVersion, generation and creationTimestamp on test objects (KMock sets none), wait for
the operator's watches before creating objects, stop the operator with task.cancel().
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import itertools
import uuid
from collections.abc import Callable
from typing import Any

import attrs
import jsonpatch
import kmock
import kopf
import pytest
from kmock._internal import aiobus as kmock_bus
from kubernetes_asyncio import client

from vllmfit.core import placement
from vllmfit.core.spec import api
from vllmfit.operator import handlers  # registers the handlers in Kopf's default registry
from vllmfit.operator.booking.state import Options, Store
from vllmfit.operator.handlers import startup

VD = f"{api.GROUP}/{api.VERSION}/{api.PLURAL}"
DEPLOYMENTS = "apps/v1/deployments"
SERVICES = "v1/services"
NODES = "v1/nodes"
PODS = "v1/pods"
EVENTS = "v1/events"
H100 = "NVIDIA-H100-80GB-HBM3"
TEST_AGENT = "vllmfit-tests"
_clock = itertools.count(1)


def vd(name: str, model: str = "Qwen/Qwen2.5-7B-Instruct", *, ns: str = "default", **spec: Any) -> dict[str, Any]:
    """A VLLMDeployment as the API server would store it (KMock fills in no metadata). With no kvCache
    it asks for one request of the full context (kvCache.concurrency 1), the KV cache these tests
    were written for (a spec that asks for nothing gets the default grant, issue 33: up to four
    full-length requests, which would move the numbers these tests check by hand;
    tests/operator/test_sharing.py applies specs without kvCache)."""
    if "kvCache" not in spec and "gpuMemoryUtilization" not in spec:
        spec = {**spec, "kvCache": {"concurrency": 1}}
    return {
        "apiVersion": f"{api.GROUP}/{api.VERSION}",
        "kind": api.KIND,
        "metadata": {"name": name, "namespace": ns, "uid": str(uuid.uuid4()), "resourceVersion": "1",
                     "generation": 1, "creationTimestamp": f"2030-01-01T00:{next(_clock) // 60 % 60:02d}:"
                                                           f"{next(_clock) % 60:02d}.{next(_clock):06d}Z"},
        "spec": {"model": model, **spec},
    }


def node(name: str, gpus: int = 2, product: str = H100, annotations: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "uid": str(uuid.uuid4()), "resourceVersion": "1",
                     "labels": {"nvidia.com/gpu.product": product, "nvidia.com/gpu.count": str(gpus),
                                "kubernetes.io/hostname": name},
                     "annotations": annotations or {}},
        "status": {"capacity": {"nvidia.com/gpu": str(gpus)}},
    }


WRITES = frozenset({kmock.action.CREATE, kmock.action.UPDATE, kmock.action.DELETE})
"""The actions no discovery request (a GET) can be."""

_SERVING: contextvars.ContextVar[Any] = contextvars.ContextVar("vllmfit_kmock_serving", default=None)
"""The request whose reaction KMock is choosing (each request is served in a task of its own)."""


def label_matcher(selector: str) -> Callable[[dict[str, str]], bool]:
    """What a labelSelector of equality and existence terms selects ("a=b,c!=d,e,!f"), as the
    API server reads it; a set-based term ("in", "notin") is refused, so no test relies on one
    unread."""
    terms: list[tuple[str, str, str]] = []
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if " in " in term or " notin " in term or "(" in term:
            raise kmock.KubernetesError(status=400, reason="BadRequest", message=f"unsupported selector: {term}")
        if "!=" in term:
            key, _, value = term.partition("!=")
            terms.append(("!=", key.strip(), value.strip()))
        elif "=" in term:
            key, _, value = term.replace("==", "=").partition("=")
            terms.append(("=", key.strip(), value.strip()))
        elif term.startswith("!"):
            terms.append(("!", term[1:].strip(), ""))
        else:
            terms.append(("?", term, ""))

    def selects(labels: dict[str, str]) -> bool:
        return all(labels.get(k) == v if op == "=" else labels.get(k) != v if op == "!="
                   else k not in labels if op == "!" else k in labels for op, k, v in terms)
    return selects


@attrs.define(kw_only=True)
class Emulator(kmock.KubernetesEmulator):
    """KMock's emulator, fast for thousands of requests. KMock decides which reaction serves a
    request by scanning its whole request log through every reaction's filters (O(n) per request,
    minutes for a few thousand); here a request being served is the only one its reactions' filters
    see (the log they scan otherwise holds only the requests being served), and `journal` keeps
    every request for the tests to read. Objects named in a request are found by key, not by a scan. Like the API server (and unlike KMock),
    it gives objects POSTed with only a generateName (Kopf's Events) a name, answers a JSON Patch
    whose "test" fails with 422 (KMock: 500, which Kopf retries with the same stale patch), and its
    watch loses no change made while it starts.

    Like the API server (and unlike KMock, whose objects keep the resourceVersion they were
    created with), every write gives the object a new resourceVersion from one counter: the
    response to the write and its watch event carry it (`_Versioned`). Kopf relies on it to tell
    its own patches' echoes from news (it waits for the version its patch returned before it runs
    state-dependent handlers again); without it, a stale event re-ran the create handler.
    Unlike the API server, a patch that changes nothing still makes a version and an event."""

    journal: list[Any] = attrs.field(factory=list, init=False)
    operated: bool = attrs.field(default=False, init=False)  # an Operator runs on it (Operator.start/stop)
    store: Any = attrs.field(default=None, init=False)  # the state of the last Operator started on it
    _serving: list[Any] = attrs.field(factory=list, init=False)
    _buses: dict[Any, Any] = attrs.field(init=False, default=attrs.Factory(
        lambda self: collections.defaultdict(lambda: _Versioned(stamp=self.stamp)), takes_self=True))
    version: int = attrs.field(default=999, init=False)  # the last resourceVersion given

    def stamp(self, event: Any) -> None:
        """A write happened (`event`, its watch event, is about to be published): its object
        gets the next resourceVersion. `event["object"]` shares its metadata with the stored
        version (KMock keeps a fresh copy per write), so the stored object, the write's response
        and the event all carry it."""
        meta = (event.get("object") or {}).get("metadata") if isinstance(event, dict) else None
        if isinstance(meta, dict):
            self.version += 1
            meta["resourceVersion"] = str(self.version)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        object.__setattr__(self._objects, "_objects", _ByResource())
        # KMock tries its reactions in order until one's filters match, each try a few regular
        # expressions: the writes (nine requests in ten of an operator's) are tried before the
        # discovery paths (GET /api, /apis/<group>, ...), which no POST, PATCH or DELETE matches
        self._payloads.sort(key=lambda p: getattr(getattr(p._source, "criteria", None), "action", None) not in WRITES)

    def _get_resources(self) -> list[Any]:
        """The resources served: those declared and those of stored objects (KMock: a scan of
        every object ever stored, Events and deleted ones included, on each listing)."""
        store = self._objects._objects
        return list(set(super(kmock.KubernetesEmulator, self)._get_resources())
                    | {g for g in store.groups if not isinstance(g, tuple)})

    async def _serve_list(self, request: Any) -> Any:
        """KMock's list, with the resourceVersion it was taken at (KMock: "..."), as a watch
        started from it wants (`_serve_watch`), only the objects its labelSelector selects
        (KMock ignores it and lists the whole namespace), and a page at a time when it asks for a
        `limit` (`paged`; KMock ignores it)."""
        selects = label_matcher(str((request.params or {}).get("labelSelector") or ""))
        listed = await super()._serve_list(request)
        listed["metadata"]["resourceVersion"] = str(self.version)  # no await since the listing
        listed["items"] = [o for o in listed["items"] if selects((o.get("metadata") or {}).get("labels") or {})]
        return paged(listed, request.params or {})

    def __iter__(self) -> Any:
        current = _SERVING.get()
        if current is not None:  # choosing the reaction of this request: only it can match
            yield current
            return
        yield from reversed(self._serving)

    async def _handle(self, request: Any) -> Any:
        token = _SERVING.set(request)
        try:
            return await self._handle_one(request)
        finally:
            _SERVING.reset(token)

    async def _handle_one(self, request: Any) -> Any:
        self.journal.append(request)
        meta = request.data.get("metadata") if isinstance(request.data, dict) else None
        if request.method == kmock.method.POST and meta and meta.get("generateName") and not meta.get("name"):
            meta["name"] = f"{meta['generateName']}{uuid.uuid4().hex[:10]}"  # as the API server would
        self._requests.clear()
        self._serving.append(request)
        try:
            return await super()._handle(request)
        except jsonpatch.JsonPatchTestFailed as e:  # the API server's answer to a failed "test" op
            raise kmock.KubernetesError(status=422, reason="Invalid", message=str(e)) from None
        finally:
            self._serving.remove(request)

    def _KubernetesEmulator__get_objs(self, request: Any, strict: bool) -> list[Any]:
        """KMock's object lookup, indexed: KMock compares the request with every stored object
        (Events included) on each get, create, patch and delete, which made the emulator, not the
        operator, the bottleneck of benchmarks/operator_scale.py at a few thousand objects. A
        request that names the object (and its namespace, or asks strictly) is one dict lookup;
        lists and watches read their resource's (in their namespace) only (`_ByResource`). Same
        answers as KMock's scan: the keys are (resource, namespace, name) and a resource hashes
        and compares by (group, version, plural)."""
        objects = self._objects._objects
        if request.name is not None and (strict or request.namespace is not None):
            obj = objects.get((request.resource, request.namespace, request.name))
            return [] if obj is None else [obj]
        group = request.resource if request.namespace is None else (request.resource, request.namespace)
        return [o for (_, _, n), o in objects.groups.get(group, {}).items() if request.name is None or n == request.name]

    async def _serve_watch(self, request: Any) -> Any:
        """KMock's watch, minus its race: it snapshots the objects and only then subscribes to
        changes, losing those in between. Here both happen under the emulator's lock. A watch
        from a resourceVersion (Kopf's, after its listing) starts, as the API server's does, with
        what changed since that version (KMock: every object again, ADDED, so Kopf handled stale
        states once more): each object written since, as it is now (DELETED when gone)."""
        yield b""
        bus = self._buses[request.resource]
        since = str((request.params or {}).get("resourceVersion") or "")
        async with self._lock:
            objs = self._KubernetesEmulator__get_objs(request, strict=False)  # type: ignore[attr-defined]
            if since.isdigit():
                events = [{"type": "DELETED" if o.deleted else "MODIFIED", "object": o.last.raw} for o in objs
                          if not o.empty and int(o.last.get("metadata", {}).get("resourceVersion") or 0) > int(since)]
            else:
                events = [{"type": "ADDED", "object": o.raw} for o in objs if not o.deleted]
            mark = await bus.mark()
        try:
            for event in events:
                yield event
            async for event in bus.stream(since=mark):
                meta = (event.get("object") or {}).get("metadata") or {}
                if self._KubernetesEmulator__check(  # type: ignore[attr-defined]
                        request, request.resource, meta.get("namespace"), meta.get("name"), strict=False):
                    yield event
        finally:
            await bus.unmark(mark)

    def sent(self, method: str, resource: str) -> list[Any]:
        """Requests of `method` ("watch" for watches) to `resource`, oldest first."""
        res = kmock.resource(resource)
        if method == "watch":
            return [r for r in self.journal if r.resource == res and r.action == kmock.action.WATCH]
        return [r for r in self.journal if r.resource == res and r.method == kmock.method[method.upper()]]


def paged(listed: dict[str, Any], params: Any) -> dict[str, Any]:
    """A listing's page, as the API server gives it for `limit` and `continue`: the items in
    (namespace, name) order after the continue token's, at most `limit` of them, and a continue
    token when more remain (metadata.continue, metadata.remainingItemCount)."""
    limit = int(params.get("limit") or 0)
    after = str(params.get("continue") or "")
    if not limit and not after:
        return listed
    def order(o: Any) -> str:
        meta = o.get("metadata") or {}
        return f"{meta.get('namespace') or ''}/{meta.get('name') or ''}"
    items = sorted((o for o in listed["items"] if order(o) > after), key=order)
    page = items[:limit] if limit else items
    listed["items"] = page
    if len(items) > len(page):
        listed["metadata"]["continue"] = order(page[-1])
        listed["metadata"]["remainingItemCount"] = len(items) - len(page)
    return listed


class _ByResource(dict[Any, Any]):
    """The emulator's store (KMock's dict of (resource, namespace, name) to object), also kept by
    resource and by (resource, namespace) in `groups`, so that a listing or a watch reads the
    objects it asks for, not every object the emulator has held (Events included). KMock writes
    it by key only (set, delete, clear)."""

    def __init__(self) -> None:
        super().__init__()
        self.groups: dict[Any, dict[Any, Any]] = {}  # resource, and (resource, namespace) -> {key: object}

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key, value)
        for group in (key[0], key[:2]):
            self.groups.setdefault(group, {})[key] = value

    def __delitem__(self, key: Any) -> None:
        super().__delitem__(key)
        for group in (key[0], key[:2]):
            same = self.groups[group]
            del same[key]
            if not same:
                del self.groups[group]

    def clear(self) -> None:
        super().clear()
        self.groups.clear()


@attrs.mutable
class _Versioned(kmock_bus.Bus):  # type: ignore[misc,type-arg]
    """A watch bus of the Emulator that stamps each write's object with a new resourceVersion
    (Emulator.stamp) as the write is published: KMock publishes every create, patch and delete
    once, under its lock, so the versions follow the order of the writes."""

    stamp: Callable[[Any], None] = attrs.field(kw_only=True)

    async def put(self, *items: Any) -> None:
        for event in items:
            self.stamp(event)
        await super().put(*items)


def km_url(km: Any) -> str:
    return str(km.url).rstrip("/")


class Cluster:
    """The emulated API server, seen through the same client library the operator uses."""

    def __init__(self, km: Any):
        self.km = km
        self.connect()

    @property
    def store(self) -> Store:
        """The state (booking.state.Store) of the operator running on this cluster: what the
        tests look into (the operator's handlers get it through Kopf's memo)."""
        return self.km.store

    def connect(self) -> None:
        self.api = client.ApiClient(client.Configuration(host=str(km_url(self.km))))
        self.api.user_agent = TEST_AGENT  # tells the test's own requests from the operator's
        self.custom = client.CustomObjectsApi(self.api)
        self.core = client.CoreV1Api(self.api)

    async def reconnect(self) -> None:
        """New connections: a cancelled Kopf operator cancels every task created while it ran,
        KMock's connection handlers included, so kept-alive connections are dead afterwards."""
        await self.api.close()
        self.connect()

    def objects(self, resource: str, ns: str | None = None) -> list[dict[str, Any]]:
        res = kmock.resource(resource)
        out = []
        for (r, n, _name), obj in list(self.km.objects.items()):
            if r == res and (ns is None or n == ns) and not obj.deleted:
                out.append(obj.raw)
        return out

    def get(self, resource: str, name: str, ns: str | None = "default") -> dict[str, Any] | None:
        for obj in self.objects(resource, ns):
            if obj["metadata"]["name"] == name:
                return obj
        return None

    def status(self, name: str, ns: str = "default") -> dict[str, Any]:
        key = (kmock.resource(VD), ns, name)
        if key not in self.km.objects or self.km.objects[key].deleted:
            return {}
        return self.km.objects[key].raw.get("status") or {}

    def phases(self) -> dict[str, str | None]:
        return {o["metadata"]["name"]: (o.get("status") or {}).get("phase") for o in self.objects(VD)}

    def events(self, name: str) -> list[dict[str, Any]]:
        """Events posted about `name`, from the request log: KMock stores only the first object
        created with generateName (it keeps it under the name None), so read what was POSTed."""
        posted = [r.data for r in self.km.sent("post", EVENTS)]
        return [e for e in posted if isinstance(e, dict) and (e.get("involvedObject") or {}).get("name") == name]

    async def event(self, name: str, reason: str, timeout: float = 10.0) -> dict[str, Any]:
        """The first Event about `name` with `reason`, once posted. Kopf posts Events from a queue
        of its own, so an Event can reach the API after the status written in the same step:
        wait for it, never read it right after the status."""
        return await self.until(lambda: next((e for e in self.events(name) if e.get("reason") == reason), None),
                                timeout, f"a {reason} Event about {name}")

    async def create(self, obj: dict[str, Any]) -> None:
        if obj["kind"] == api.KIND:
            await self.custom.create_namespaced_custom_object(api.GROUP, api.VERSION, obj["metadata"]["namespace"],
                                                              api.PLURAL, obj)
        elif obj["kind"] == "Node":
            await self.core.create_node(obj)
            if self.km.operated:
                # Nodes and VLLMDeployments come on two watch streams, in no guaranteed order
                # (as from a real API server): a spec created next could reach the operator
                # first and be Unschedulable for a moment. Tests that mean "the node is there"
                # wait until the operator has it (test_a_spec_created_before_its_node_... covers
                # the other order).
                name = obj["metadata"]["name"]
                await self.until(lambda: name in self.store.cache.node_infos, what=f"the operator to see node {name}")
        elif obj["kind"] == "Pod":
            await self.core.create_namespaced_pod(obj["metadata"]["namespace"], obj)
        else:
            raise ValueError(obj["kind"])

    async def patch_spec(self, name: str, spec: dict[str, Any], ns: str = "default") -> None:
        """A spec change as the API server makes it: the generation goes up."""
        gen = self.get(VD, name, ns)["metadata"].get("generation") or 1
        await self.custom.patch_namespaced_custom_object(
            api.GROUP, api.VERSION, ns, api.PLURAL, name, {"metadata": {"generation": gen + 1}, "spec": spec},
            _content_type="application/merge-patch+json")

    async def patch_node(self, name: str, patch: dict[str, Any]) -> None:
        await self.core.patch_node(name, patch, _content_type="application/merge-patch+json")

    async def patch_pod(self, name: str, patch: dict[str, Any], ns: str = "default") -> None:
        await self.core.patch_namespaced_pod(name, ns, patch, _content_type="application/merge-patch+json")

    async def delete(self, name: str, ns: str = "default") -> None:
        await self.custom.delete_namespaced_custom_object(api.GROUP, api.VERSION, ns, api.PLURAL, name)

    async def delete_node(self, name: str) -> None:
        await self.core.delete_node(name)

    async def until(self, pred: Callable[[], Any], timeout: float = 10.0, what: str = "") -> Any:
        """Poll `pred` until it holds; fail after `timeout` seconds of the event loop's time (a
        hang guard: on a virtual clock, looptime, its seconds are virtual, never the machine's)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            value = pred()
            if value:
                return value
            if loop.time() > deadline:
                raise AssertionError(f"timed out waiting for {what or pred}")
            await asyncio.sleep(0.01)

    async def phase(self, name: str, *phases: str, timeout: float = 10.0) -> dict[str, Any]:
        await self.until(lambda: self.status(name).get("phase") in phases, timeout,
                         f"{name} to reach {phases}, is {self.status(name).get('phase')}")
        await self.store.writer.flush()
        return self.status(name)


class Operator:
    """The real operator (vllmfit.operator.handlers) running in this event loop. Each start is a
    new process as far as the operator can tell: a new Store (its books, cache and status writer)
    built from the same `options`, handed to the handlers through Kopf's memo."""

    def __init__(self, km: Any, *, runtime_classes: tuple[str, ...] = ("nvidia",), options: Options | None = None):
        self.km = km
        self.task: asyncio.Task[None] | None = None
        self.runtime_classes = runtime_classes  # the RuntimeClasses the cluster has (GPU Operator: nvidia)
        self.options = options or Options()
        self.store = Store(self.options)  # replaced at each start

    async def start(self) -> None:
        self.store = store = Store(self.options, kube_config=client.Configuration(host=km_url(self.km)))
        self.km.store = store
        for name in self.runtime_classes:
            key = (kmock.resource("node.k8s.io/v1/runtimeclasses"), None, name)
            if key not in self.km.objects or self.km.objects[key].deleted:
                self.km.objects[key] = {"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass",
                                        "metadata": {"name": name, "uid": str(uuid.uuid4()), "resourceVersion": "1"},
                                        "handler": name}
        settings = kopf.OperatorSettings()
        handlers.configure(settings)
        settings.posting.level = 0
        settings.batching.exit_timeout = 0.1  # a worker waiting out a retry delay must not hold up the stop
        # A stop by cancellation must never SIGKILL the test process: Kopf's "ultimate exit" timer
        # is due at once on a virtual clock (looptime), where the fuzz runs.
        settings.process.ultimate_exiting_timeout = None
        self.task = asyncio.create_task(kopf.operator(settings=settings, clusterwide=True, standalone=True,
                                                      memo=kopf.Memo(store=store)))
        loop = asyncio.get_running_loop()  # hang guards in the loop's time (virtual under looptime)
        for res in (VD, NODES, PODS):  # watching everything before the test creates objects
            deadline = loop.time() + 10
            while not self.km.sent("watch", res):
                if not loop.time() < deadline:
                    pytest.fail(f"operator never watched {res}")
                if self.task.done():
                    self.task.result()
                await asyncio.sleep(0.01)
        deadline = loop.time() + 30
        while not store.books.ready.is_set():
            if self.task.done():
                self.task.result()
            if loop.time() > deadline:
                pytest.fail("the operator's start-up never finished (no ledger rebuilt in 30 s)")
            await asyncio.sleep(0.01)
        self.km.operated = True

    async def stop(self) -> None:
        self.km.operated = False
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
            self.task = None
        await startup.cleanup(memo=kopf.Memo(store=self.store))  # what Kopf's cleanup runs on a stop


def used_from_statuses(statuses: list[dict[str, Any]]) -> dict[tuple[str, int], int]:
    """Bytes booked per GPU, recomputed from the stored statuses alone."""
    used: dict[tuple[str, int], int] = {}
    for st in statuses:
        if st.get("phase") in ("Admitted", "Running", "Failed"):
            for m in st.get("memory") or []:
                used[(m["node"], m["index"])] = used.get((m["node"], m["index"]), 0) + m["totalBytes"]
    return used


def budget(product: str = H100) -> int:
    from vllmfit.sources import catalog

    return placement.GpuSlot("n", 0, catalog.gpu(product)).budget_bytes
