"""The operator's state, made explicit (issue 29): objects built once per operator process and
passed in (never reached through a global): `Options` (the settings, read once), `Books` (the
writer's ledger, its lock, the committed snapshot and its version), `Cache` (the object cache: a
record per VLLMDeployment, nodes, reservation pods, DRA objects, the agents' reports), the
`StatusWriter` (booking.statuswriter) and the `WorkQueue` of VLLMDeployments to reconcile with the
background reservation pass after them (booking.workqueue). `Store` holds them (and the API
client) and is handed to
the Kopf handlers through Kopf's memo (handlers.common.store_of), to the webhook through its
constructor (admission.webhook.setup), to the metrics collector explicitly (metrics.register).

- One decision path over snapshots (docs/operator.md, "One writer, committed snapshots").
  `Books.ledger` is the writer's ledger: it changes only inside `Books.transaction()` (or
  `Books.step()`, a change with no await), on the fork it yields (`Books.writing`), by the handler
  that holds it, the one writer. The transaction commits all of its change or, when anything in it
  raises, none; a commit publishes `Books.committed`: a frozen snapshot (Ledger.snapshot,
  structural sharing) of the ledger as that transaction left it, numbered by `Books.version`. Every decision runs on a
  snapshot, never on the changing ledger, and every reader outside the lock reads `committed`;
  the status writer computes a status while holding the lock (the records and the ledger
  together, as a critical section left them). So nothing ever reads a half-changed ledger.
- `Books.ready` is set once `Store.rebuild` has restored the ledger from the API at start-up (the
  nodes, and the `status.memory` of every admitted VLLMDeployment, which are its bookings).
- A `Record` keeps what the operator knows about one VLLMDeployment; `report.status(record,
  ledger)` turns it into `.status`. The status writer writes the status of every key marked
  dirty, one write per key at a time and always from the current record, so a neighbour's
  headroom is never overwritten by an older computation.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import logging
import threading
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from vllmfit.backends import binding, dra
from vllmfit.backends import reservation as rsv
from vllmfit.core import defaults, memory, placement
from vllmfit.core.model.facts import ModelArch
from vllmfit.core.placement import Ledger, Request
from vllmfit.core.spec import api, validate
from vllmfit.operator.booking import draining, mirror, models, workqueue
from vllmfit.operator.booking.books import Books
from vllmfit.operator.booking.pods import PodHealth
from vllmfit.operator.booking.record import (
    OVER_BUDGET,
    PodOwners,
    Record,
    booked_by,
    key_of,
    record_from_object,
    shows,
)
from vllmfit.operator.booking.statuswriter import StatusWriter
from vllmfit.operator.rendering import builders
from vllmfit.sources import catalog

logger = logging.getLogger(__name__)



@dataclass
class Options:
    """The operator's settings, read once: `vllmfit operator`'s flags (their defaults from the
    environment and core.defaults) become one Options (operator.main.options_from_args). The
    defaults here are the same named values, for tests and tools that build a Store directly;
    nothing here reads the environment."""

    namespace: str | None = None
    default_image: str = defaults.DEFAULT_IMAGE
    resync_seconds: float = defaults.RESYNC_SECONDS
    placement_backend: str = "auto"
    reservation: rsv.Config = field(default_factory=rsv.Config)
    dra_driver: str = dra.NVIDIA_DRIVER
    dra_device_class: str = dra.NVIDIA_DRIVER
    budget: memory.BudgetPolicy = memory.DEFAULT_POLICY  # cluster-wide; node-pool labels override it
    kv_grant: memory.KvGrant = memory.DEFAULT_KV_GRANT  # the default KV grant (no kvCache, no maxNumSeqs)
    tenancy: validate.Policy = validate.DEFAULT_POLICY  # what a podTemplate may reach (--pod-security-level, ...)
    mps: binding.Mps | None = None  # the optional MPS memory-limit binding (--mps-pipe-directory)
    memory_limit_bytes: int | None = None  # the operator's own memory limit (--memory-limit), for its advice
    pod_name: str | None = None  # the operator's own pod ($POD_NAME): its Events about itself


class Workers:
    """The threads decisions run in, off the event loop (admission.bounded): one pool for the
    operator's decisions (defaults.DECIDE_WORKERS) and one for the webhook's reviews
    (defaults.REVIEW_WORKERS), so neither waits for the other; made on first use. `abandoned`
    counts the decisions given up on past their time limit (`give_up`: from the operator's loop
    and the webhook's, two threads). One per operator process."""

    def __init__(self) -> None:
        self._decide: concurrent.futures.ThreadPoolExecutor | None = None
        self._review: concurrent.futures.ThreadPoolExecutor | None = None
        self.abandoned = 0
        self._counting = threading.Lock()

    def give_up(self) -> None:
        """One more decision abandoned past its time limit."""
        with self._counting:
            self.abandoned += 1

    def decide(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._decide is None:
            self._decide = concurrent.futures.ThreadPoolExecutor(defaults.DECIDE_WORKERS,
                                                                 thread_name_prefix="vllmfit-decide")
        return self._decide

    def review(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._review is None:
            self._review = concurrent.futures.ThreadPoolExecutor(defaults.REVIEW_WORKERS,
                                                                 thread_name_prefix="vllmfit-review")
        return self._review


class Cache:
    """The object cache: what the operator knows of the cluster's objects (a record per
    VLLMDeployment, the nodes, reservation pods, DRA slices and claims, the agents' reports, the
    learned records). Changed by the handlers on the event loop; what a decision needs of it is
    read under the books' lock. One per operator process."""

    def __init__(self) -> None:
        self.records: dict[str, Record] = {}
        self.pod_index: dict[str, str] = {}  # pod UID -> its record's key (managed_pods; PodOwners checks it)
        self.over_budget: set[str] = set()  # keys whose OverBudget condition says True (handlers.nodes.over_budget)
        self.attributions: dict[str, Any] = {}  # node -> vllmfit.core.observe.attribution.Attribution
        self.log_cache: dict[tuple[str, int], PodHealth] = {}  # (pod uid, restarts) -> health read from its log
        self.child_locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self.node_infos: dict[str, placement.NodeInfo | None] = {}  # node -> what its Node object says
        # placement backends (vllmfit.operator.binding.reservations)
        self.reservations = rsv.Known()  # reservation pod name -> what it holds (and by node)
        self.gated: dict[tuple[str, str], tuple[str, list[str], list[dict[str, Any]]]] = {}  # pod -> node, pins, gates
        self.whole: dict[tuple[str, int], str] = {}  # (deployment, replica) written with device-plugin limits -> node
        self.written: set[tuple[str, int]] = set()  # (deployment, replica) whose Deployment was written
        self.slices: dict[str, dict[str, Any]] = {}  # ResourceSlice name -> object
        self.claims: dict[str, dict[str, Any]] = {}  # ResourceClaim namespace/name -> object
        self.templates: dict[tuple[str, int], str] = {}  # (deployment, replica) -> its ResourceClaimTemplate
        self.reservation_waits: dict[str, str] = {}  # reservation pod -> the scheduler's last Unschedulable message
        self.retiring: set[str] = set()  # reservation pods vllmfit itself deletes (their end is no loss)
        self.lookalikes: set[str] = set()  # pods posing as reservations, already reported (uid or ns/name)
        # nodes whose replicas' pinning may have changed (handlers.writes.rebook_reported looks at
        # the records there, not at every record, on each event); pins_all: look at every one
        self.pins_dirty: set[str] = set()
        self.pins_all = True
        self.runtime_classes: set[str] | None = None  # RuntimeClass names (None: not listed yet)
        self.dra_capacity_ok = True  # False once the API server dropped capacity requests (feature gate off)
        self.dra_refresh = ""  # why the DRA nodes must be looked at again (set while writing; finish() does it)
        # the closed loop (issue 34; handlers.nodes, reservations, vllmfit.core.placement.observed)
        self.footprints: dict[str, dict[tuple[str, int, int], tuple[str, int]]] = {}  # node -> replica, GPU -> (sampledAt, bytes)
        self.replica_usage: dict[str, Any] = {}  # node -> Attribution keyed "namespace/name#replica"
        self.gate_of: dict[tuple[str, str], tuple[str, int, str | None]] = {}  # gated pod -> deployment, replica, "node:i"
        self.gate_holds: dict[tuple[str, str], str] = {}  # gated pod -> why the start gate holds it
        self.started: set[tuple[str, int]] = set()  # (deployment, replica) whose footprint was seen stable
        self.learned: list[memory.learned.Record] = []  # read from the operator's ConfigMap (operator.learning)
        self.learned_dirty = False  # records to write
        self.resynced = mirror.Corrected()  # what the last resync found different from the ledger
        self._devices: dict[str, list[dra.Device]] | None = None
        self._driver: str | None = None

    def devices(self, driver: str) -> dict[str, list[dra.Device]]:
        """node -> the GPUs that ResourceSlices of `driver` publish there (cached)."""
        if self._devices is None or self._driver != driver:
            self._devices = dra.devices_from_slices(self.slices.values(), (driver,))
            self._driver = driver
        return self._devices

    def slices_changed(self) -> None:
        self._devices = None

    def managed_pods(self, *, written: bool = True, replica: bool = False) -> PodOwners:
        """UIDs of vllmfit's vLLM pods -> their deployment (`PodOwners`). Their GPU memory is
        booked in the ledger; the node inventory's other memory in use is foreign
        (vllmfit.core.observe.attribution's rule)."""
        return PodOwners(self.records, self.pod_index, written=written, replica=replica)

    def pod_seen(self, rec: Record, pod: str, uid: str) -> None:
        """A pod event named the UID of one of `rec`'s pods."""
        rec.pod_uids[pod] = uid
        self.pod_index[uid] = rec.key

    def index_records(self, recs: Iterable[Record] | None = None) -> None:
        """Index what node reports look up in these records (None: made anew from every record),
        after records are read back from statuses: their pods' UIDs, and whether their OverBudget
        condition says True."""
        if recs is None:
            self.pod_index, self.over_budget, recs = {}, set(), self.records.values()
        for rec in recs:
            for uid in [*((rec.written or {}).get("podUids") or []), *rec.pod_uids.values()]:
                self.pod_index[str(uid)] = rec.key
            if any(c.type == OVER_BUDGET and c.status == "True" for c in rec.conditions):
                self.over_budget.add(rec.key)

    def upsert(self, body: Mapping[str, Any]) -> Record:
        key = key_of(body)
        rec = self.records.get(key)
        if rec is None:
            rec = self.records[key] = record_from_object({**body, "status": {}})
        rec.body = dict(body)
        rec.generation = (body.get("metadata") or {}).get("generation")
        return rec


class Store:
    """The operator's state, made explicit (issue 29): its parts, built once per operator
    process (operator.main; tests build their own) and passed in, to the Kopf handlers through
    Kopf's memo (`memo.store`), to the webhook through its constructor, to the metrics collector
    explicitly. Nothing reaches it through a global.

    - `options`: the settings, read once (Options);
    - `books`: the writer's ledger, its lock, the committed snapshot and version (Books);
    - `cache`: the object cache (Cache);
    - `writer`: the status writer (StatusWriter);
    - `queue`: the VLLMDeployments to reconcile (WorkQueue), and `placing`, the reservation pass
      run in the background after their reconciles (Rerun);
    plus the API client, and whether this process leads. Its methods are the steps that need
    several parts at once: the start-up rebuild, the resync, adopting a peer's status, the DRA
    view of a node, resolving a spec's model."""

    def __init__(self, options: Options | None = None, kube_config: Any = None) -> None:
        self.options = options or Options()
        self.kube_config: Any = kube_config  # kubernetes_asyncio Configuration; set by tests, else loaded at start-up
        self.api: Any = None  # kubernetes_asyncio ApiClient, set at start-up
        self.books = Books(self.options.kv_grant)
        self.cache = Cache()
        self.writer = StatusWriter(self.books, self.cache, lambda: self.api)
        self.workers = Workers()  # the threads decisions run in (admission.bounded)
        self.leading = False  # this process handles VLLMDeployment events (standalone, or the active peer)
        self.lead_lock = asyncio.Lock()  # taking the lead (a sweep before the first admission)
        self.tasks: list[asyncio.Task[None]] = []  # background tasks (resync), stopped with the writer
        self.collector: Any = None  # its metrics collector while it runs (operator.metrics.register)
        self.queue = workqueue.WorkQueue(defaults.RECONCILE_WORKERS)  # VLLMDeployments to reconcile
        self.placing = workqueue.Rerun("vllmfit reservation pass")  # the pass after queued reconciles

    async def stop(self) -> None:
        """Stop the background tasks, the work queue, the background reservation pass and the
        status writer."""
        for task in self.tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.tasks = []
        await self.queue.stop()
        await self.placing.stop()
        await self.writer.stop()

    def backend_of(self, node: str) -> str:
        """How the GPUs of `node` are held: "device-plugin" (reservation pods, limits) or "dra"
        (claims for the booked memory), under --placement-backend (vllmfit.backends.dra.backend_for)."""
        return dra.backend_for(self.options.placement_backend, self.devices().get(node, []))

    def devices(self) -> dict[str, list[dra.Device]]:
        """node -> the GPUs ResourceSlices of the configured driver publish there (cached)."""
        return self.cache.devices(self.options.dra_driver)

    def effective_node(self, name: str, info: placement.NodeInfo | None,
                       ledger: Ledger | None = None) -> placement.NodeInfo | None:
        """The GPUs of a node as the ledger should see them: on a DRA node, from its slices, with
        the memory every claim vllmfit did not make consumes as foreign use (and the agent's UUIDs
        and indices when it runs there); None on a DRA node when capacity requests are not kept
        (nothing can be shared there). Elsewhere what the Node object says. `ledger`: the one its
        bookings are read from (the writer's by default)."""
        if self.backend_of(name) != "dra":
            return info
        devs = self.devices().get(name) or []
        if not devs or not self.cache.dra_capacity_ok:
            return None
        uses = dra.consumption(self.cache.claims.values(), {d.key: d for d in devs})
        booked: dict[tuple[str, int], int] = {}
        ledger = self.books.ledger if ledger is None else ledger
        for key in ledger.deployments():
            for b in ledger.bookings_of(key):
                if b.node == name:
                    booked[(name, b.index)] = booked.get((name, b.index), 0) + b.footprint.total
        agent = info if info is not None and any(s.uuid for s in info.gpus) else None
        try:
            return dra.node_from_dra(name, info.labels if info else {}, devs, uses, catalog.gpu_for_label,
                                     booked=booked, agent=agent, facts=info)
        except LookupError as e:
            logger.warning("node %s: DRA devices unusable: %s", name, e)
            return None

    def dra_nodes(self) -> set[str]:
        return {n for n in set(self.devices()) | set(self.cache.node_infos) if self.backend_of(n) == "dra"}

    def overlay_dra(self, ledger: Ledger) -> int:
        """Put the DRA view of every DRA node into `ledger` (after its bookings are restored);
        returns how many nodes it set or removed (one that is already as it should be is left)."""
        changed = 0
        for name in sorted(self.dra_nodes()):
            changed += mirror.put_node(ledger, name, self.effective_node(name, self.cache.node_infos.get(name), ledger))
        return changed

    # --- model resolution -------------------------------------------------------------------

    def effective(self, obj: api.VLLMDeployment) -> api.VLLMDeployment:
        """The object with the operator's --default-image when the spec names no image."""
        if "image" in obj.spec.model_fields_set or obj.spec.image == self.options.default_image:
            return obj
        return obj.model_copy(update={"spec": obj.spec.model_copy(update={"image": self.options.default_image})})

    async def request_for(self, obj: api.VLLMDeployment) -> Request:
        """Resolve the model of `obj` (inline modelConfig, modelConfigRef ConfigMap, catalog, then
        the Hugging Face Hub) into a placement request. Raises ModelResolutionError."""
        obj = self.effective(obj)
        req = placement.request_from_object(obj, model := await self.resolve_model(obj))
        if not self.cache.learned:
            return req
        return replace(req, learned=memory.learned.for_model(self.cache.learned, model.name, obj.metadata.namespace))

    async def resolve_model(self, obj: api.VLLMDeployment) -> ModelArch:
        return await models.resolve_model(self.api, obj)

    def rebuild(self, nodes: Iterable[Mapping[str, Any]], deployments: Iterable[Mapping[str, Any]],
                children: Iterable[Mapping[str, Any]] | None = None,
                vllm_pods: Iterable[Mapping[str, Any]] = ()) -> list[str]:
        """Restore the ledger from the cluster: the nodes; the bookings in the status of every
        admitted VLLMDeployment whose objects exist and match (`children`: vllmfit's Deployments;
        a status whose replicas do not all run where it says is no booking, and the deployment
        is decided again); and a drain for every pod of vllmfit that runs where nothing books
        it (`vllm_pods`). Returns warnings. The new ledger replaces the writer's in one step."""
        ledger = Ledger(kv_grant=self.options.kv_grant)
        ledger.multi_node = self.books.ledger.multi_node  # the cluster's capability, discovered at start-up
        self.books.drains, self.books.refused = draining.Drains(), set()
        self.cache.records = {}
        self.cache.pins_all = True
        problems: list[str] = []
        ordered = sorted(deployments, key=lambda b: ((b.get("metadata") or {}).get("creationTimestamp") or "", key_of(b)))
        for body in ordered:
            rec = record_from_object(body)
            rec.resumed = True  # its first event reconciles it (handlers.vllmdeployments.wanted)
            self.cache.records[rec.key] = rec
        self.cache.index_records()
        pods = self.cache.managed_pods()  # read before the nodes: their GPU memory is booked, not foreign
        self.cache.node_infos = {}
        for obj in nodes:
            name = str((obj.get("metadata") or {}).get("name") or "")
            try:
                info = placement.node_from_object(obj, catalog.gpu_for_label, pods, self.options.budget,
                                                  now=datetime.now(UTC))
            except placement.NodeDataError as e:  # refused node data: no new bookings there until it is
                problems.append(str(e))  # fixed; what is booked there stays, as when it is refused live
                self.books.refused.add(name)
                continue
            except ValueError:
                self.cache.node_infos[name] = None
                continue  # no GPU information: not a GPU node
            except LookupError as e:
                problems.append(str(e))
                continue
            self.cache.node_infos[name] = info
            ledger.set_node(info)
        running = None if children is None else draining.children_at(children)
        for body in ordered:
            rec = self.cache.records[key_of(body)]
            if rec.admitted:
                try:
                    status = api.VLLMDeploymentStatus.model_validate(body.get("status") or {})
                except ValueError:
                    continue
                bookings = placement.bookings_from_status(rec.key, status)
                if running is not None and not draining.status_matches(rec, body, bookings, running):
                    problems.append(f"{rec.key}: its status books replicas that do not run where it says; "
                                    "not restored, decided again")
                    rec.admitted, rec.placement, rec.flags, rec.outcome = False, [], None, "Pending"
                    rec.admitted_request = None
                    continue
                ledger.restore(rec.key, bookings)
        self.overlay_dra(ledger)
        covered = {(k, r): (draining.where_of(bs), builders.booked_text(bs)) for k in ledger.deployments()
                   for r, bs in draining.by_replica(ledger.bookings_of(k)).items()}
        self.books.drains = draining.from_pods(ledger, vllm_pods, covered)
        with self.books.step():
            self.books.replace(ledger)
        gc.freeze()  # the rebuilt ledger lives on: full collections skip it from now on (docs/placement.md)
        self.books.ready.set()
        return problems

    def resync(self, nodes: Iterable[Mapping[str, Any]], deployments: Iterable[Mapping[str, Any]],
               children: Iterable[Mapping[str, Any]] | None = None) -> set[str]:
        """Correct the ledger to the API again (booking.mirror: only what differs from the
        listing is changed; the result is the ledger a rebuild from it would give), keeping the
        records whose status is what this process last wrote (`cache.resynced`: what differed).
        Call it holding the lock, with every status written and no change since the listing
        (handlers.resync_once checks both): then, on the active replica, it changes nothing; on
        a standby peer (paused, no events), it catches up with what the active one decided, so a
        fail-over never starts from a stale ledger.

        Level-based status: on the active replica (`leading`), a record this process decided
        whose stored status differs from what it wrote (a write lost, or never made) is kept with
        its bookings, and its key returned: its status is written again.

        A status this process has not seen before books only what runs where it says
        (`children`: vllmfit's Deployments, as listed; the check of `rebuild`): one that does not
        is no booking, and its record has no status, so that it is decided again (and looked at
        again at the next resync: a peer may write the Deployment after the status)."""
        running = None if children is None else draining.children_at(children)
        pods = self.cache.managed_pods()
        t = datetime.now(UTC)
        infos: dict[str, placement.NodeInfo] = {}
        for obj in nodes:
            name = str((obj.get("metadata") or {}).get("name") or "")
            # Refused node data keeps the node's last good state (never "no GPUs"); a stale
            # inventory gives way to the GFD labels (core.placement.read_node).
            read = placement.read_node(obj, catalog.gpu_for_label, pods, now=t,
                                       previous=self.cache.node_infos.get(name), policy=self.options.budget)
            if read.info is None:
                continue
            self.cache.node_infos[name] = infos[name] = read.info
        records: dict[str, Record] = {}
        repair: set[str] = set()
        booked: dict[str, list[placement.Booking]] = {}
        for body in deployments:
            key = key_of(body)
            status = body.get("status") or {}
            rec = self.cache.records.get(key)
            if rec is not None and self.leading and rec.mine and not shows(rec, status):
                rec.written = dict(status)
                rec.body = dict(body)
                records[key] = rec
                repair.add(key)
                if rec.admitted:
                    booked[key] = self.books.ledger.bookings_of(key)
                continue
            news = rec is None or not shows(rec, status)
            if news:
                rec = record_from_object(body)
                rec.written = dict(status)
            records[key] = rec
            if rec.admitted:
                bookings = booked_by(rec, status)
                if bookings is None:
                    continue
                if news and running is not None and not draining.status_matches(rec, body, bookings, running):
                    rec.admitted, rec.placement, rec.flags, rec.outcome = False, [], None, "Pending"
                    rec.admitted_request, rec.written = None, {}
                    continue
                booked[key] = bookings
        with self.books.step() as ledger:
            work, found = mirror.correct(ledger, infos, booked, keep=self.dra_nodes())
            found.nodes += self.overlay_dra(work)
            mirror.recharge(work, self.books.drains, ledger, found)
            if found:
                self.books.replace(work)  # else the ledger already says what the cluster says: kept
        if found or records.keys() != self.cache.records.keys() or \
                any(r is not self.cache.records[k] for k, r in records.items()):
            self.cache.pins_all = True  # what the children are written from may have changed
        self.cache.records = records
        self.cache.index_records()
        self.cache.resynced = found
        return repair

    def news(self, body: Mapping[str, Any]) -> bool:
        """Whether `adopt` could take anything from `body`'s status: not what this process wrote
        or its record shows already, not the first event of a new object (nothing booked: its
        reconcile decides it). Reads no lock: the event handler asks it first, and `adopt`
        again under the lock."""
        status = body.get("status") or {}
        rec = self.cache.records.get(key_of(body))
        if rec is None:
            return bool(status.get("memory"))  # else new: its reconcile decides it
        return not (rec.mine or shows(rec, status))

    def adopt(self, body: Mapping[str, Any], children: Iterable[Mapping[str, Any]] | None = None) -> bool | None:
        """Take a status another process wrote (the previous active peer) as the truth: its
        record and its bookings. Returns whether anything was taken; None for an admitted status
        whose replicas do not all run where it says (`children`: the object's Deployments, as
        listed; checked as at restart, `draining.status_matches`): a tenant's forged status, or a
        peer that died before writing the Deployment. Nothing is taken then; decide it again.
        Hold the lock."""
        if not self.news(body):
            return False
        key, status = key_of(body), body.get("status") or {}
        rec = self.cache.records.get(key)
        try:
            st = api.VLLMDeploymentStatus.model_validate(status)
        except ValueError:
            return False
        new = record_from_object(body)
        if new.admitted and children is not None and not draining.status_matches(
                new, body, placement.bookings_from_status(key, st), draining.children_at(children)):
            return None
        new.written = dict(status)
        self.cache.records[key] = new
        self.cache.index_records([new])
        self.cache.pins_dirty.update(p.node for r in (rec, new) if r is not None for p in r.placement)
        with self.books.step() as ledger:
            if new.admitted:
                ledger.restore(key, placement.bookings_from_status(key, st))
            else:
                ledger.release(key)
        return True
