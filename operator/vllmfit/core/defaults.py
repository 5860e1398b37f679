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
BUDGET_POLICY = "counted"
"""The default budget policy by name (`counted`: UTILIZATION x capacity - COUNTED_RESERVE_BYTES;
`adr-0002`: UTILIZATION x capacity - RESERVE_BYTES). The `adr` memory policy, whose footprint
models none of those overheads, defaults to `adr-0002`."""
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
"""The cluster's default KV grant for a spec that sets neither spec.kvCache nor maxNumSeqs
(operator --default-kv-grant, chart value kvCache.defaultGrant, CLI --default-kv-grant):
`requests`: DEFAULT_KV_GRANT_REQUESTS requests of the full maxModelLen, clamped to the room its GPUs
have left; `room`: vLLM's own behaviour, the room left, at most vLLM's default maxNumSeqs x
maxModelLen. A spec that sets maxNumSeqs is granted at most maxNumSeqs x maxModelLen under either
rule (docs/memory-model.md, "The KV request")."""
DEFAULT_KV_GRANT_REQUESTS = 4
"""The `requests` rule's number of full-length requests (operator --default-kv-requests, chart value
kvCache.defaultRequests, CLI --default-kv-requests)."""

BUDGET_UTILIZATION_LABEL = "vllmfit.dev/budget-utilization"
BUDGET_RESERVE_LABEL = "vllmfit.dev/budget-reserve"
"""Node labels that set the budget policy of a node pool (e.g. "0.95" and "1Gi"); they override
the cluster-wide policy (operator flags --budget-utilization / --budget-reserve)."""

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

GFD_PRODUCT_LABEL = "nvidia.com/gpu.product"
GFD_MEMORY_LABEL = "nvidia.com/gpu.memory"
GFD_COUNT_LABEL = "nvidia.com/gpu.count"

DEPLOYMENT_LABEL = "vllmfit.dev/deployment"
"""Label on every Deployment, pod and Service vllmfit writes: the VLLMDeployment's name."""
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
securityContext overrides it (operator/builders.py, docs/operator.md)."""
VLLM_HOME = "/tmp"
"""$HOME of the vLLM container: writable by any uid, so the caches vLLM, Hugging Face, torch and
Triton keep under ~/.cache work without root (the image's /root is not readable by uid 1000)."""

# Bounded work (issue 14): every placement decision of the operator and the webhook runs off the
# event loop with a time limit; a spec that takes longer is denied with a message. The worst spec
# within core.limits takes about 0.1 s on a 1,000-node ledger (benchmarks/webhook_latency.py).
DECIDE_TIMEOUT_S = 10.0
"""The operator's limit for one decision (create, update, a waiting spec retried)."""
REVIEW_DECIDE_TIMEOUT_S = 3.0
"""The webhook's limit for one review's decision; kube-apiserver waits timeoutSeconds (chart: 10)."""
DECIDE_WORKERS = 4
"""Threads deciding at once; one stuck past its limit holds one until it ends."""
SEARCHED_REPLICAS = 128
"""The most replicas of one spec a refusal places one by one. A spec asking for more replicas than
the cluster could hold by a cheap bound (core.placement.summary.groups_bound: a few bisections of
the ledger's headroom indices), when that bound is above this, is refused at once, saying how many
it could hold at most; and the `replicas: N` fix is looked for only up to this many. Below it,
the search places each replica, and the refusal names where they went and why the next did not
fit. docs/placement.md, "Bounded work per review"."""

# Admission webhook transport limits (operator/webhook.py Server). An AdmissionReview carries the
# object (and oldObject), far below 1 MiB for a VLLMDeployment; a client that has not sent its
# whole body within 5 s is dropped (HTTP 408; kube-apiserver sends a review at once). At most
# WEBHOOK_MAX_CONCURRENT reviews are read or decided at once (so at most that many bodies are
# buffered); more get HTTP 429 at once.
WEBHOOK_MAX_BODY_BYTES = 1024 * 1024
WEBHOOK_READ_TIMEOUT_S = 5.0
WEBHOOK_MAX_CONCURRENT = 32

# Connections to the admission webhook (operator/webhook.py Server, docs/webhook.md). asyncio gives
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
WEBHOOK_MAX_HEADERS = 32
"""Header fields per request (aiohttp's default 128, each up to 8,190 bytes): bounds what a
half-sent request head can buffer. kube-apiserver sends under ten."""
