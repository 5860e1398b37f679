"""Start-up (rebuild the ledger from the cluster), the periodic resync, login and clean-up."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import socket
import time
from typing import Any

import aiohttp
import kopf
from aiohttp.helpers import proxies_from_env
from kubernetes_asyncio import client
from kubernetes_asyncio import config as kube_config
from kubernetes_asyncio.client import ApiException

from vllmfit import __version__
from vllmfit.core import defaults
from vllmfit.core.spec import api
from vllmfit.operator import metrics
from vllmfit.operator.binding import claims, reservations
from vllmfit.operator.booking import learning, measured, own_memory
from vllmfit.operator.booking.record import key_of
from vllmfit.operator.booking.report import post_event
from vllmfit.operator.booking.state import Store
from vllmfit.operator.handlers.children import children_state
from vllmfit.operator.handlers.common import Effects, store_of
from vllmfit.operator.handlers.decide import retry_waiting
from vllmfit.operator.handlers.sweep import Abandoned, list_cluster, list_ours, sweep
from vllmfit.operator.handlers.vllmdeployments import enqueue
from vllmfit.operator.handlers.writes import finish, settle_drains
from vllmfit.operator.rendering import lws

logger = logging.getLogger(__name__)

IDENTITY = "vllmfit"
USER_AGENT = f"{IDENTITY}/{__version__}"


GC_YOUNG = 20_000
"""Allocations between two collections of the youngest generation (Python: 700). Each event
allocates thousands of short-lived objects (Kopf's causes, the client's requests, a status):
at 700 they were promoted and walked again by the older generations' collections, a fifth of
the operator's CPU while 1,500 deployments settle (issue 32: 3.4 s of 18.7; 1.1 s at 20,000).
The operator sets it at start-up, for its own process."""
GC_OLD = 100
"""Middle-generation collections between two full ones (Python: 10). A full collection walks
every object the start-up did not freeze and stops every thread, the webhook's included: while
5,000 VLLMDeployments settled, the heap doubled every few seconds and full collections of 1.0 to
1.1 s came one after another, the longest wait of any review (issue 32, ninth round:
benchmarks/operator_scale.py --reviews). At 100 the longest pause was 0.31 to 0.34 s (a middle
collection), the collector's time 4.8 to 5.6 s instead of 6.2 to 6.6 s, peak RSS no higher (three runs
each). Python's own rule still holds: no full collection until the objects promoted since the
last one are a quarter of those it kept."""


def tune_collector() -> None:
    """The collector's thresholds of an operator's process (GC_YOUNG, GC_OLD; the middle one is
    Python's), set at start-up; benchmarks/webhook_latency.py sets the same."""
    gc.set_threshold(GC_YOUNG, gc.get_threshold()[1], GC_OLD)


class DiffBase(kopf.DiffBaseStorage):
    """No diff base. The operator does not use Kopf's change detection for VLLMDeployments: their
    events queue them to be reconciled (handlers.vllmdeployments.on_event, booking.workqueue), which
    compares generations itself; Kopf's only changing handler is the delete handler, which needs no
    diff. So every object's essence is the same empty one: Kopf builds none per event (it
    deep-copied each object to build it) and never patches an object to store one (a request, and
    the echo of it, per object and change)."""

    def build(self, *, body: kopf.Body, extra_fields: Any = None) -> Any:
        return kopf.BodyEssence()

    def fetch(self, *, body: kopf.Body) -> Any:
        return kopf.BodyEssence()

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: Any) -> None:
        return None


def configure(settings: kopf.OperatorSettings) -> None:
    """Kopf settings the operator relies on: handler progress in annotations (not in status,
    which belongs to vllmfit and is pruned by the CRD schema), no diff base (`DiffBase`), our own
    finalizer name."""
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=api.GROUP)
    settings.persistence.diffbase_storage = DiffBase()
    settings.persistence.finalizer = api.FINALIZER
    # A burst (thousands applied at once, or a restart): the handlers only queue VLLMDeployments
    # (booking.workqueue), so Kopf needs no bound on its workers (KOPF_WORKERS: its default, none);
    # an object's worker is let go KOPF_IDLE_SECONDS after its last event (it holds that event).
    settings.queueing.worker_limit = defaults.KOPF_WORKERS
    settings.queueing.idle_timeout = defaults.KOPF_IDLE_SECONDS
    # Identity: Events say "vllmfit" (source.component, reportingComponent; `kubectl describe`
    # shows "From vllmfit") and name the pod that posted them; every write carries the User-Agent
    # vllmfit/<version>, which the API server takes as the field manager.
    settings.posting.reporting_component = IDENTITY
    settings.posting.reporting_instance = os.environ.get("POD_NAME") or socket.gethostname()
    settings.posting.event_name_prefix = f"{IDENTITY}-"


class Identified(kopf.ConnectionInfo):
    """Kopf's connection with vllmfit's User-Agent (Kopf's own is kopf/<version>): its writes
    (finalizers, annotations, Events) are managed by "vllmfit" as the operator's are."""

    def as_http_headers(self) -> dict[str, str]:
        return {**super().as_http_headers(), "User-Agent": USER_AGENT}


async def load_config() -> client.Configuration:
    """In-cluster config, else the current kubeconfig context."""
    cfg = client.Configuration()
    try:
        kube_config.load_incluster_config(client_configuration=cfg)
    except kube_config.ConfigException:
        try:
            await kube_config.load_kube_config(client_configuration=cfg)
        except (kube_config.ConfigException, OSError) as e:
            raise kopf.TemporaryError(f"no Kubernetes API: not in a cluster, and no usable kubeconfig ({e})",
                                      delay=10) from None
    return cfg


async def login(memo: kopf.Memo, **_: Any) -> kopf.ConnectionInfo:
    """Kopf uses the same credentials as the operator's own API client."""
    store = store_of(memo)
    cfg = store.kube_config or await load_config()
    token = (cfg.api_key.get("BearerToken") or cfg.api_key.get("authorization") or "").removeprefix("Bearer ")
    return Identified(server=str(cfg.host), ca_path=cfg.ssl_ca_cert, insecure=not cfg.verify_ssl,
                      scheme="Bearer" if token else None, token=token or None,
                      certificate_path=cfg.cert_file, private_key_path=cfg.key_file,
                      default_namespace=store.options.namespace)


async def resync_once(store: Store) -> bool:
    """store.resync from a fresh listing, unless anything changed meanwhile or statuses are
    still being written. Returns whether it resynced. On the active replica it then repairs
    (level-based, whatever events were missed or writes lost): statuses that differ from the
    records, children that differ from the bookings (written, or deleted by `sweep`), objects
    that never got a decision (queued to be decided), and waiting specs, which get another chance. Not while statuses
    are being written or VLLMDeployments wait in the work queue (a burst: what it would repair is
    under way)."""
    before = store.books.changes

    def moved() -> bool:  # what it would repair is under way: a listing taken now is thrown away
        return store.books.changes != before or store.writer.busy() or store.queue.busy()

    if moved():
        return False
    try:  # given up at the first page after anything moved (a burst: thousands of objects a listing)
        nodes, deployments = await list_cluster(store, abandon=moved)
        children, pods = await list_ours(store, abandon=moved)
    except Abandoned:
        return False
    fx = Effects()
    async with store.books.transaction(counted=False):
        if moved():
            return False
        repair = store.resync(nodes, deployments, children)
        measured.forget(store)  # the samples of replicas released where no node reports any more
        if store.leading:
            if repair:
                logger.warning("resync: rewriting statuses that differ from the records: %s", ", ".join(sorted(repair)))
            fx.mark.update(repair)
            table = reservations.uuid_table(store)
            fx.sync.update(k for k, r in store.cache.records.items() if r.admitted and r.synced != children_state(store, r, table)
                           and r.admitted_request is not None)
            await retry_waiting(store, fx)
        undecided = [r.body for r in store.cache.records.values() if not (r.written or {}).get("phase")]
        # admitted on GPUs that are gone (a node lost while no operator ran, no event for it)
        lost = [r.body for r in store.cache.records.values() if r.admitted and store.books.misplaced(r.key)]
    if not store.leading:
        return True
    await finish(store, fx, strict=False)
    await sweep(store, listed=(children, pods))  # re-read under the lock before a deletion
    await settle_drains(store)  # pods of stopped replicas whose deletion no event told
    # queued, not reconciled here: one reconcile of an object at a time, and a deletion waits for it
    for body in undecided:
        logger.warning("resync: %s has no status; deciding it", key_of(body))
        enqueue(store, body)
    for body in lost:
        logger.warning("resync: %s is booked on GPUs that are gone; deciding it again", key_of(body))
        enqueue(store, body)
    return True


class JsonApiClient(client.ApiClient):  # type: ignore[misc]
    """kubernetes_asyncio's ApiClient, sending what the operator hands it as it is: every body,
    path and query the operator writes is JSON already (dicts, lists, strings, numbers and
    booleans it built; never the client's model classes). The client's own
    `sanitize_for_serialization` rebuilt each body object by object before encoding it: 4 % of
    the operator's CPU while 40,000 VLLMDeployments settle (benchmarks/operator_scale.py --fleet)."""

    def sanitize_for_serialization(self, obj: Any) -> Any:
        return obj


def api_client(config: Any) -> client.ApiClient:
    """The operator's API client. kubernetes_asyncio's session trusts the environment, which
    sends every request through a thread twice (a ~/.netrc lookup, a proxy lookup): those
    hand-offs were about 7% of a profile of 500 deployments settling (issue 32). When the environment names no proxy (looked up once,
    here), the session trusts nothing else: Kubernetes credentials come from the kubeconfig or
    the service account, never ~/.netrc. With a proxy, it is left as it is."""
    api = JsonApiClient(config)
    session = api.rest_client.pool_manager
    if not proxies_from_env():
        api.rest_client.pool_manager = aiohttp.ClientSession(connector=session.connector, trust_env=False,
                                                             read_bufsize=2**21)  # the client's own buffer
        session.detach()  # the connector (and its TLS settings) now belongs to the new session
    return api


def resync_wait(every: float, cpu: float) -> float:
    """Seconds from the end of a resync that took `cpu` seconds of CPU to the start of the next:
    `every` (--resync-seconds), or longer, so that resyncs take at most defaults.RESYNC_SHARE of
    a core however large the cluster."""
    return max(every, cpu * (1 / defaults.RESYNC_SHARE - 1))


async def resync_loop(store: Store, every: float) -> None:
    wait = every
    while True:
        await asyncio.sleep(wait)
        cpu = time.process_time()  # the process's: events handled while it awaits its listings count too
        try:
            await resync_once(store)
        except Exception as e:  # noqa: BLE001 - a failed listing is retried next time
            logger.warning("resync failed: %s", e)
        wait = resync_wait(every, time.process_time() - cpu)


STARTUP_DRAINS = "vllmfit_startup_drains"
"""Kopf memo key: the drains made at start-up from pods, until the pods watch has listed."""


NO_LWS = (f"a replica across nodes runs as a LeaderWorkerSet ({lws.GROUP}/{lws.VERSION}), which this cluster does "
          "not serve; install LeaderWorkerSet, or fit the replica in one node (fewer GPUs, larger GPUs)")


async def multi_node_refusal(store: Store) -> str | None:
    """Why a replica may not span nodes on this cluster (start-up): the API does not serve the
    LeaderWorkerSet resource (404, or 403: vllmfit may not use it); None: it does, and such a
    replica runs as one LeaderWorkerSet (handlers.children.write_group)."""
    try:
        await client.CustomObjectsApi(store.api).list_cluster_custom_object(lws.GROUP, lws.VERSION, lws.PLURAL,
                                                                            limit=1)
    except ApiException as e:
        if e.status in (403, 404):
            logger.info("%s/%s not available (%s %s): no replica spans nodes", lws.GROUP, lws.VERSION, e.status,
                        e.reason)
            return NO_LWS
        raise
    return None


async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    """Rebuild the ledger from the API before any handler allocates: every node, and the
    bookings recorded in the status of every admitted VLLMDeployment."""
    configure(settings)
    if "store" not in memo:  # `kopf run -m vllmfit.operator`: no flags, so the options' defaults
        memo["store"] = Store()  # (before any other handler: Kopf runs start-up handlers first)
    store = store_of(memo)
    store.api = api_client(store.kube_config or await load_config())
    store.api.user_agent = USER_AGENT  # the field manager of every write: "vllmfit"
    await learning.load(store)  # what earlier starts taught, before any decision (issue 34)
    node_dicts, deployments = await list_cluster(store)
    store.books.ledger.multi_node = await multi_node_refusal(store)  # before any decision; the rebuild keeps it
    await claims.load(store)  # the DRA nodes' GPUs and claims, before the ledger is rebuilt
    children, pods = await list_ours(store)  # a status books only what runs where it says; pods drain
    problems = store.rebuild(node_dicts, deployments, children, pods)
    tune_collector()
    # shared by every object's memo (each a shallow copy of this one): see settle_startup_drains
    memo[STARTUP_DRAINS] = sorted(store.books.drains)
    await reservations.load(store)
    for p in problems:
        logger.warning("start-up: %s", p)
    logger.info("ledger rebuilt: %d GPU nodes, %d VLLMDeployments, %d with bookings", len(store.books.ledger.nodes),
                len(store.cache.records), len(store.books.ledger.deployments()))
    say_memory(store)
    try:
        await sweep(store)
    except (ApiException, OSError) as e:
        logger.warning("start-up: cannot look for Deployments without a booking (the resync retries): %s", e)
    store.writer.start()
    if store.options.resync_seconds > 0:
        store.tasks.append(asyncio.create_task(resync_loop(store, store.options.resync_seconds)))
    metrics.unregister(store.collector)
    store.collector = metrics.register(store)  # the gauges read this store at scrape time


def say_memory(store: Store) -> None:
    """At start-up: whether the operator's memory limit holds the cluster it has just rebuilt
    (booking.own_memory), as a log line and an Event on its own pod when it does not."""
    nodes, deployments = len(store.books.ledger.nodes), len(store.cache.records)
    line = own_memory.advice(deployments, nodes, store.options.memory_limit_bytes)
    if line is None:
        return
    logger.warning("start-up: %s", line)
    if store.options.pod_name and store.options.namespace:
        post_event({"apiVersion": "v1", "kind": "Pod",
                    "metadata": {"name": store.options.pod_name, "namespace": store.options.namespace}},
                   "Warning", "MemoryLimitTooSmall", line)


async def pods_listed(**_: Any) -> None:
    """An index on vllmfit's replica pods that keeps nothing: Kopf runs no handler before every
    index is filled by its watch's first listing (an empty one too), so whatever handler runs
    knows that the pods watch has listed (settle_startup_drains)."""


async def settle_startup_drains(memo: kopf.Memo, **_: Any) -> None:
    """At the first node event after a start-up: end the drains made at start-up whose pods are
    gone. A pod that leaves the API between the start-up listing and the first listing of the
    pods watch sends no event (the watch never saw it), so its drain would wait for the resync;
    no handler runs before that listing (pods_listed), so a listing now sees what it missed. A
    start-up drain's GPUs are on a node, so a node event comes (one that is gone charges no GPU)."""
    pending = memo.get(STARTUP_DRAINS)
    if not pending:
        return
    names, pending[:] = list(pending), []
    store = store_of(memo)
    await store.books.ready.wait()
    if any(n in store.books.drains for n in names):
        await settle_drains(store)


async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    """The operator stops: its work queue, its writer, its metrics collector and its client end,
    and what its rebuild froze (`Store.rebuild`: gc.freeze) goes back to the collector. Frozen
    objects are never collected, nor anything they reference: a Store that stopped frozen would
    keep every record it held for as long as the process lives (one operator per process in a cluster, but
    the tests and `benchmarks/operator_scale.py --runs` start many, one after another)."""
    store = store_of(memo)
    await store.stop()
    metrics.unregister(store.collector)
    store.collector = None
    if store.api is not None:
        await store.api.close()
        store.api = None
    gc.unfreeze()
