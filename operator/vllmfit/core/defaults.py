"""Every default of the memory model, named once.

Units: bytes are integers; fractions are floats in (0, 1]. ADR-0002 (shared/seeds/000_*.txt)
is the contract for the first four.
"""

GIB = 1 << 30
MIB = 1 << 20

# ADR-0002: budget = UTILIZATION x capacity - RESERVE_BYTES (the `adr-0002` budget policy).
UTILIZATION = 0.90
"""Fraction of a GPU's capacity vllmfit lets deployments use (ADR-0002 default; also `counted`'s)."""
RESERVE_BYTES = 2 * GIB
"""Bytes kept free on every GPU on top of (1 - UTILIZATION) (ADR-0002 default, '2 GB'): the
`adr-0002` budget policy's reserve, for overheads ADR-0002 does not model."""
COUNTED_RESERVE_BYTES = 0
"""The `counted` budget policy's reserve (the default policy): the overheads ADR-0002's reserve
stood for (CUDA context, non-torch memory, CUDA graphs, a safety margin) are booked in every
footprint of the `vllm` memory model, per process, so they are not held back a second time."""
CUDA_CONTEXT_BYTES = int(0.55 * GIB)
"""The CUDA context (+ cuBLAS) of one vLLM process on one GPU, resident before vLLM measures and so
outside its requested memory R = ceil(T x u) (calibration: init snapshot 0.51 GiB on an H100).
The `vllm` memory model books it in every single-GPU footprint (memory.overhead)."""
COUNTED_CONTEXT_BYTES = CUDA_CONTEXT_BYTES
"""What the `counted` budget adds to ceil(UTILIZATION x capacity): the CUDA context of one lone
vLLM process, so that the budget is what vLLM's own default (`--gpu-memory-utilization 0.9`, one
server, an empty GPU) really uses, R + its context outside R, and that server is admitted. Counted
once per GPU, never per process: every colocated server books its own context in its footprint, so
a shared GPU keeps (1 - UTILIZATION) x capacity - one context held back (7.4 GiB of an H100, 1.6 GiB
of an L4). ADR-0002 has no such term (the `adr-0002` policy: 0). docs/memory-model.md, "Budget"."""
BUDGET_POLICY = "counted"
"""The default budget policy by name (`counted`: ceil(UTILIZATION x capacity) + COUNTED_CONTEXT_BYTES
- COUNTED_RESERVE_BYTES; `adr-0002`: UTILIZATION x capacity - RESERVE_BYTES). The `adr` memory
policy, whose footprint models none of those overheads, defaults to `adr-0002`."""
REPLICATION_OVERHEAD = 0.02
"""ADR policy: replicated parameters add 2% to sharded weights."""
BLOCK_SIZE = 16
"""KV block size in tokens (vLLM's default for FlashAttention / FlashInfer)."""

KV_OVERHEAD = 0.0
"""ADR policy: kvOverheadPct in the KV bytes-per-token formula."""

ADR_MAX_NUM_SEQS = 8
"""`adr` policy only: the numSeq of ADR-0002's formulas when neither maxModelLen nor maxNumSeqs is
set. The `vllm` policy sizes the KV cache by the KV request (kvCache) and injects vLLM's own
--max-num-seqs default for the image's version and GPU tier when maxNumSeqs is unset."""

DEFAULT_KV_FULL_REQUESTS = 1
"""The floor of a default KV grant (no spec.kvCache): this many requests of the full maxModelLen
(vLLM refuses to start when its KV cache cannot hold one)."""

KV_GRANT_RULES = ("requests", "room")
DEFAULT_KV_GRANT = "requests"
"""The cluster's rule for the KV cache of a spec without spec.kvCache (operator --default-kv-grant,
chart value kvCache.defaultGrant, CLI --default-kv-grant). Its request, what placement needs and
the floor it keeps, is DEFAULT_KV_GRANT_REQUESTS requests of the full maxModelLen (at most
maxNumSeqs); its limit is maxNumSeqs x maxModelLen (vLLM's default maxNumSeqs when unset). The grant
lies between them: `requests`, a fair share, the footprint grows to at most 1/DEFAULT_KV_TENANTS of
its GPU's budget; `room`, vLLM's own behaviour, the room left. Both are clamped to the room left and
never below the request (docs/memory-model.md, "The KV request")."""
DEFAULT_KV_GRANT_REQUESTS = 2
"""The KV request of a spec without kvCache: this many requests of the full maxModelLen (operator
--default-kv-requests, chart value kvCache.defaultRequests, CLI --default-kv-requests)."""
DEFAULT_KV_TENANTS = 8
"""The `requests` rule's fair share: a grant grows a footprint to at most 1/N of its GPU's budget,
so N tenants per GPU each keep at least that (operator --kv-tenants-per-gpu, chart value
kvCache.tenantsPerGpu, CLI --kv-tenants-per-gpu)."""

BUDGET_UTILIZATION_LABEL = "vllmfit.dev/budget-utilization"
BUDGET_RESERVE_LABEL = "vllmfit.dev/budget-reserve"
"""Node labels that set the budget policy of a node pool (e.g. "0.95" and "1Gi"); they override
the cluster-wide policy (operator flags --budget-utilization / --budget-reserve)."""

GPUS_PER_NODE = 8
"""`vllmfit estimate --gpus-per-node`: the GPUs of one type a node has (an HGX/DGX board: 8). A
deployment needing more (tp x pp beyond it) spans several such nodes, one pod per node, as `plan`
places it on a cluster whose nodes have that many."""

TOPOLOGY_LABELS = (
    "topology.kubernetes.io/region",
    "topology.kubernetes.io/zone",
    "topology.kubernetes.io/rack",
    "nvidia.com/gpu.clique",
)
"""Node labels whose values every node of one multi-node replica shares where its nodes carry them:
region, zone, rack, and the NVLink domain (NVIDIA's GPU feature discovery labels a multi-node
NVLink domain `nvidia.com/gpu.clique`). A node without one of these labels forms a domain of its own
with the other nodes without it."""

GANG_REASON_NODES = 8
"""A refused multi-node replica names why, node by node, for at most this many nodes (then how many more)."""

MIN_AUTO_MAX_MODEL_LEN = 2048
"""When maxModelLen is not set and the model's full context does not fit, the context is
reduced to fit, but never below this (or the model's maximum, if smaller)."""

DRIVER_RESERVED_BYTES = 512 * MIB
"""Memory the driver keeps from CUDA applications (NVML total - cudaMemGetInfo total), used
for GPUs not in the catalog. Measured: ~0.46 GiB on H100 80GB (79.65 vs 79.19 GiB), ~450 MiB
on T4 (KAI-scheduler#2212)."""

DEFAULT_VLLM_VERSION = "0.33"
"""The newest vLLM version shared/reference/vllm-memory-accounting.md covers."""
DEFAULT_IMAGE = "vllm/vllm-openai:v0.33.0"
"""The pinned vLLM image generated pods run when the spec names none."""
RESYNC_SECONDS = 30.0
"""How often the operator rebuilds its ledger from the API when idle (--resync-seconds)."""
RESYNC_SHARE = 0.1
"""The most of one core the periodic resync takes: it lists and compares every object, so the next
one starts no sooner than (1 / RESYNC_SHARE - 1) times the last one's CPU after it ended, if that
is longer than RESYNC_SECONDS (issue 32: an idle resync took 4.3 s of CPU at 5,000 deployments; at
40,000, every 30 s, it would take more than a core)."""

KOPF_WORKERS = None
"""How many objects of one kind Kopf processes at once (settings.queueing.worker_limit; None:
Kopf's own, no bound). Kopf's handlers of VLLMDeployments only queue a key (RECONCILE_WORKERS), so
an object's worker is done in a moment; a bound would only make every object wait for a worker
that waits for the echo of a patch."""

RECONCILE_WORKERS = 256
"""How many VLLMDeployments the operator reconciles at once (its work queue,
operator.booking.workqueue). A watch event only queues its object's key; a burst (thousands
applied at once, or a restart) waits there as keys, not as handlers in flight that each hold
Kopf's event, contexts and a parsed spec. More workers overlap more of the API's latency; the
decisions themselves take the writer's lock one at a time. Measured (5,000 applied at once on
1,000 nodes, benchmarks/operator_scale.py --reviews, one run each, reservation passes at a
quarter of the loop): 16 workers, every one final
in 32.0 s; 64: 29.6 s; 128: 28.3 s; 256: 26.7 s; 512: 26.0 s; peak RSS 322 to 330 MiB and reviews'
p99 21 to 37 ms throughout (rising with the workers)."""

KOPF_IDLE_SECONDS = 0.5
"""How long Kopf keeps an object's worker after its last event (settings.queueing.idle_timeout;
Kopf's own is 5 s). An idle worker holds the last event's whole object; in a burst every object
has one, so a short idle time frees them sooner (5,000 applied at once on 1,000 nodes: 565 MiB
peak at 5 s, 524 MiB at 0.5 s, benchmarks/operator_scale.py); a later event starts a new worker."""

LIST_PAGE = 500
"""How many objects one request of the operator's listings (start-up, resync) asks for, as
client-go's pager does: a listing is taken a page at a time, each page trimmed to what the
operator reads before the next is asked for, so no listing is held whole as JSON."""

OPERATOR_MEMORY_BASE_BYTES = 128 * MIB
"""The operator's resident memory before it holds any object (Python, Kopf, the Kubernetes client,
vllmfit's modules and catalog: 102 MiB at import), with its empty event loop and webhook: the
intercept of a line at or above every peak RSS `benchmarks/operator_scale.py` measured (docs/install.md,
"Sizing the operator"). `operator.booking.own_memory.needed_bytes` adds the two figures below."""
OPERATOR_MEMORY_PER_DEPLOYMENT_BYTES = 40 * 1024
"""The operator's peak resident memory per VLLMDeployment when every one is applied at once (or
rebuilt at a restart): its record, bookings, status, children and Kopf's per-object state, with the
burst's keys in the work queue and a resync's listing (measured: 500 -> 141.6 MiB, 2,000 -> 203.7
MiB, 5,000 -> 327.0 MiB, 40,000 -> 1,819 MiB on 100, 400, 1,000 and 10,000 nodes; the line sits
at or above each)."""
OPERATOR_MEMORY_PER_NODE_BYTES = 16 * 1024
"""The operator's resident memory per GPU node (its GPUs in the ledger and its indices, the node
object; measured: 1,000 instead of 100 nodes under 500 deployments add 12.2 MiB)."""
OPERATOR_MEMORY_HEADROOM_PERCENT = 125
"""The memory limit an operator should have, in percent of its measured peak: the chart's default
limit holds the documented supported cluster with this headroom, and the start-up says so (a log
line, an Event, `vllmfit_operator_memory_needed_bytes`) when the limit it runs under does not."""

LORA_MAX_LORAS = 1
LORA_MAX_RANK = 16
"""spec.lora defaults: vLLM's own `LoRAConfig` defaults (max_loras 1, max_lora_rank 16) in every version
read (0.11 to 0.33); vllmfit injects them explicitly."""

UTILIZATION_DECIMALS = 4
"""--gpu-memory-utilization is rounded up to this many decimals."""

DRIFT_WARNING_FRACTION = 0.10
"""Observed memory above prediction by more than this fraction raises a MemoryDrift condition."""

INVENTORY_ANNOTATION = "vllmfit.dev/gpu-inventory"
"""Node annotation the node agent writes (schema: vllmfit.core.observe.inventory.GpuInventory)."""
INVENTORY_STALE_SECONDS = 300
"""An inventory older than this is reported as stale (the agent publishes every 30 s)."""

# --- The closed loop (issue 34): what the GPUs really hold corrects the ledger and gates starts ---

AGENT_PUBLISH_SECONDS = 30
"""The node agent samples every 30 s and publishes on a change of more than
FOOTPRINT_STABLE_BYTES, and at least this often (vllmfit.agent.publish.PUBLISH_EVERY_S): one agent
interval, the time the operator needs at most to see a footprint twice."""
FOOTPRINT_STABLE_BYTES = 64 * MIB
"""A replica has "started" (vLLM has allocated its KV cache) when its pod is Ready, or when two
consecutive agent samples (different sampledAt) show its processes on a GPU within this many bytes
of each other. Equal to the agent's publish jitter (vllmfit.agent.publish.USED_JITTER_BYTES): a
change smaller than that is not even published, so it cannot tell a start-up still under way."""
OBSERVED_MARGIN_BYTES = 256 * MIB
"""Added to a started replica's observed footprint before it is booked: booking = max(prediction,
observed + this). Why 256 MiB: the observed figure is one NVML sample, and after start-up vLLM's
memory still moves by what the sampler cannot see or does not publish: the 64 MiB publish jitter,
PyTorch's caching allocator rounding new blocks up to 2 MiB segments and 20 MiB large-block
chunks under load, and the per-request sampler and detokenizer buffers (tens of MiB on 7-70B
models); four times the publish jitter keeps one more sample from over-running the booking
again, and it is under 0.4 % of an 80 GB GPU, so it never costs a neighbour its place."""
START_GATE_MAX_AGE_SECONDS = 3 * AGENT_PUBLISH_SECONDS
"""The start gate trusts an inventory no older than this (three publish periods: one missed
publish and a slow watch are tolerated). Older: the gate holds the replica and says so."""
CALIBRATION_CONFIGMAP = "vllmfit-calibration"
"""The ConfigMap, in the operator's own namespace, created and written by the operator only, that
keeps the learned records (what each configuration really used at its first start)."""
CALIBRATION_KEY = "records.json"
"""The key of CALIBRATION_CONFIGMAP's data holding the records (JSON; `vllmfit estimate
--calibration` reads the same text, the ConfigMap's YAML, or a plain YAML file)."""
MAX_CALIBRATION_RECORDS = 2000
"""Records kept (the newest win): one per configuration; a ConfigMap holds at most 1 MiB."""
LEARNED_RECORD_TTL_SECONDS = 30 * 24 * 3600
"""A learned record ages out this long after the start that taught it (a driver, image or vLLM
patch release moves what a configuration uses; a record nobody re-teaches stops correcting)."""

GFD_PRODUCT_LABEL = "nvidia.com/gpu.product"
GFD_MEMORY_LABEL = "nvidia.com/gpu.memory"
GFD_COUNT_LABEL = "nvidia.com/gpu.count"

DEPLOYMENT_LABEL = "vllmfit.dev/deployment"
"""Label on every Deployment, pod and Service vllmfit writes: the VLLMDeployment's name."""
GPU_RESOURCE = "nvidia.com/gpu"
"""The NVIDIA device plugin's extended resource: exclusive replicas take whole GPUs with it, the
reservation pods hold them with it; no other container of a generated pod may ask for it."""
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
"""The Kubernetes recommended label; its value on what vllmfit writes is MANAGED_BY."""
MANAGED_BY = "vllmfit"

STARTUP_BASE_SECONDS = 600
"""Start-up time of a vLLM server besides reading its weights (engine and NCCL start-up, profiling,
torch.compile, CUDA graph capture): the 10 minutes the startup probe allowed before it scaled."""
STARTUP_LOAD_BYTES_PER_SECOND = 100 * MIB
"""Assumed rate at which a replica downloads (first start, empty model cache) and loads its
checkpoint; the startup probe allows weights / this on top of STARTUP_BASE_SECONDS, so a 405B
bf16 checkpoint (~810 GB) gets about 2 h 20 min and an 8B one about 12.5 min."""
STARTUP_PROBE_PERIOD_SECONDS = 20
"""periodSeconds of the startup probe; failureThreshold is derived from the time allowed."""

VLLM_RUN_AS_USER = 1000
"""uid (and gid, fsGroup) the generated vLLM pods run as: the restricted Pod Security Standard
needs a non-root user, and the vLLM image sets none (it would run as root). A podTemplate
securityContext overrides it (operator/rendering/builders.py, docs/operator.md)."""
VLLM_HOME = "/tmp"
"""$HOME of the vLLM container: writable by any uid, so the caches vLLM, Hugging Face, torch and
Triton keep under ~/.cache work without root (the image's /root is not readable by uid 1000)."""

# Bounded work (issue 14): every placement decision of the operator and the webhook runs off the
# event loop with a time limit; a spec that takes longer is denied with a message. The worst spec
# within core.limits takes about 0.1 s on a 1,000-node ledger (benchmarks/webhook_latency.py).
METRICS_COPY_TIMEOUT_S = 5.0
"""How long a scrape (on the metrics server's thread) waits for the operator's loop to copy what
the gauges read; past it the scrape serves the last copy (the loop is busy, not gone)."""

DECIDE_TIMEOUT_S = 10.0
"""The operator's limit for one decision (create, update, a waiting spec retried)."""
DECIDE_WORKERS = 4
"""Threads deciding at once; one stuck past its limit holds one until it ends."""
OPTIMISTIC_DECISIONS = 3
"""How many times a reconcile decides on the committed snapshot without the writer's lock before
it gives up on optimism (issue 29): each commit that finds the ledger changed since its snapshot
(Stale) decides again on the new one; past this many, it decides holding the lock, which nothing
can make stale, so every reconcile ends."""
SEARCHED_REPLICAS = 128
"""The most replicas of one spec a refusal places one by one. A spec asking for more replicas than
the cluster could hold by a cheap bound (core.placement.summary.groups_bound: a few bisections of
the ledger's headroom indices), when that bound is above this, is refused at once, saying how many
it could hold at most; and the `replicas: N` fix is looked for only up to this many. Below it,
the search places each replica, and the refusal names where they went and why the next did not
fit. docs/placement.md, "Bounded work per review"."""

# Bounded, honest admission (issue 29). The API server waits WEBHOOK_TIMEOUT_S for a review (the
# chart's webhook.timeoutSeconds; tests/chart checks they agree). One review - model resolution,
# waiting for a worker and deciding, all together - gets REVIEW_BUDGET_S, well inside it; a review
# that cannot be decided in time is refused, saying so (fail closed), unless the operator runs
# with --webhook-fail-open. Reviews decide on the committed snapshot and take no lock, so they
# never queue behind the operator or each other; REVIEW_WORKERS threads decide them, and one
# namespace holds at most REVIEW_PER_NAMESPACE of them at once (one tenant cannot starve another).
WEBHOOK_TIMEOUT_S = 5
"""The ValidatingWebhookConfiguration's timeoutSeconds (chart value webhook.timeoutSeconds, passed
to the operator as --webhook-timeout-seconds)."""
REVIEW_BUDGET_FRACTION = 0.6
"""A review's budget is this share of the webhook's timeout: the rest is for TLS, the network, the
API server's own work, and a GIL shared with the operator's threads."""
REVIEW_BUDGET_S = WEBHOOK_TIMEOUT_S * REVIEW_BUDGET_FRACTION
"""Everything one review may take (3 s): resolving the model, waiting for a worker, deciding."""


def review_budget_s(webhook_timeout_s: float) -> float:
    """The budget of one review under a webhook timeout of `webhook_timeout_s` seconds."""
    return webhook_timeout_s * REVIEW_BUDGET_FRACTION

REVIEW_DECIDE_TIMEOUT_S = 2.5
"""The most a review's decision may take: a spec whose decision takes longer is refused as too
costly (422). The rest of REVIEW_BUDGET_S is for resolving the model and waiting for a worker; a
decision squeezed below this by that wait is refused as not checked in time (429, retry)."""
REVIEW_WORKERS = 8
"""Threads deciding reviews (apart from the operator's DECIDE_WORKERS)."""
REVIEW_INLINE_REPLICAS = 4
"""A spec of at most this many replicas, with no node selection (placement.quick), is first
decided on the webhook's event loop, without fixes (a few bisections, ~0.2 ms at 1,000 and 10,000
nodes); only when it does not fit is it decided again, with its fixes, on a review thread. Any
other spec is decided on a thread."""
REVIEW_PER_NAMESPACE = 2
"""Reviews of one namespace deciding at once; a review past its budget keeps its place until its
thread ends, so abandoned work counts against its own namespace."""

# Admission webhook transport limits (operator/admission/webhook.py Server). An AdmissionReview carries the
# object (and oldObject), far below 1 MiB for a VLLMDeployment; a client that has not sent its
# whole body within 5 s is dropped (HTTP 408; kube-apiserver sends a review at once). At most
# WEBHOOK_MAX_CONCURRENT reviews are read or decided at once (so at most that many bodies are
# buffered); more get HTTP 429 at once.
WEBHOOK_MAX_BODY_BYTES = 1024 * 1024
WEBHOOK_READ_TIMEOUT_S = 5.0
WEBHOOK_MAX_CONCURRENT = 32

# Connections to the admission webhook (operator/admission/webhook.py Server, docs/webhook.md). asyncio gives
# every accepted TLS connection a 256 KiB read buffer before the handshake starts: 1,000 idle TCP
# connections grew the operator by 299 MiB, so without a cap a flood of connections that never
# speak gets it OOM-killed. Beyond WEBHOOK_MAX_CONNECTIONS open connections (counted from accept,
# before any TLS work) a new one is closed at once. kube-apiserver keeps up to 25 idle connections
# per webhook host and opens one per review in flight (at most WEBHOOK_MAX_CONCURRENT are served).
WEBHOOK_MAX_CONNECTIONS = 128
WEBHOOK_HANDSHAKE_TIMEOUT_S = 5.0
"""TLS must be up this long after accept (asyncio's default is 60 s; the API server's client
gives up after 10 s, and on a cluster network a handshake takes milliseconds)."""
WEBHOOK_HEADER_TIMEOUT_S = 5.0
"""A request's line and headers must be complete this long after its first byte (for the first
request of a connection: after TLS is up); else the connection is closed. aiohttp bounds their
size, not their time."""
WEBHOOK_IDLE_TIMEOUT_S = 120.0
"""An idle keep-alive connection is closed after this long (aiohttp's default: 3,630 s). Longer
than the API server's own 90 s idle timeout (Go's http.DefaultTransport, kept by
k8s.io/apimachinery/pkg/util/net SetOldTransportDefaults), so the client closes first and never
sends a review on a connection the server is closing."""
WEBHOOK_LOOP_PROBE_S = 2.0
"""The liveness probe asks the webhook's own event loop (it runs in a thread of its own) to answer
within this long; a loop that does not (a review's quick decision that spins: a bug) fails the
probe, and the kubelet restarts the operator after failureThreshold misses. Under the chart's
probe timeoutSeconds (3)."""
WEBHOOK_MAX_HEADERS = 32
"""Header fields per request (aiohttp's default 128, each up to 8,190 bytes): bounds what a
half-sent request head can buffer. kube-apiserver sends under ten."""

MPS_PIPE_DIRECTORY = "/tmp/nvidia-mps"
"""Where an MPS control daemon keeps its pipes by default (CUDA_MPS_PIPE_DIRECTORY, NVIDIA's MPS
documentation); the optional MPS binding mounts it into the vLLM pods (chart value mps.*)."""
MPS_LOG_DIRECTORY = "/var/log/nvidia-mps"
"""The MPS control daemon's default log directory (CUDA_MPS_LOG_DIRECTORY)."""
