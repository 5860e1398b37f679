"""Physical limits on every number vllmfit accepts from outside, named once.

A value past one of these is refused with a one-line message before any work is done on it,
so that a hostile or broken input (a spec, an inline config.json, a node label or the agent's
inventory annotation) cannot make vllmfit allocate gigabytes, loop for minutes or book
memory that does not exist. Each bound is far above anything real (the largest real value is
given with each one) and small enough that the work it allows is bounded.
"""

from __future__ import annotations

from vllmfit.core.defaults import GIB

# --- Model architecture (config.json) -------------------------------------------------------------

MAX_LAYERS = 1024
"""num_hidden_layers. Real: 126 (Llama 3.1 405B), 160 (PaLM-style research models)."""
MAX_HIDDEN_SIZE = 1 << 17
"""hidden_size / intermediate sizes' unit. Real: 16384 (Llama 3.1 405B), 25600 (Falcon 180B is 14848)."""
MAX_INTERMEDIATE_SIZE = 1 << 20
"""intermediate_size / moe_intermediate_size. Real: 73728 (Grok-1 style dense MLPs)."""
MAX_HEADS = 4096
"""num_attention_heads / num_key_value_heads. Real: 128 (DeepSeek-V3, Llama 3.1 405B)."""
MAX_HEAD_DIM = 4096
"""head_dim (and MLA ranks). Real: 576 (DeepSeek MLA latent 512 + rope 64)."""
MAX_EXPERTS = 4096
"""Routed experts. Real: 384 (Kimi K2), 512 (Qwen3-Next)."""
MAX_VOCAB = 1 << 24
"""vocab_size. Real: 262144 (Gemma 3)."""
MAX_CONTEXT = 1 << 26
"""Context length (max_position_embeddings after rope scaling, spec.maxModelLen). Real: 10M (Llama 4 Scout)."""
MAX_PARAMS = 10**14
"""Parameter count (spec.modelParams, --params). Real: about 2e12 (the largest MoE checkpoints)."""

# --- A deployment ----------------------------------------------------------------------------

MAX_TP = 64
"""Tensor parallel size: GPUs of one NVLink domain a pipeline stage spans. Real: 72 GPUs per NVL72 rack."""
MAX_PP = 16
"""Pipeline stages."""
MAX_NODES_PER_REPLICA = 64
"""Nodes one replica spans (spec.placement.nodes, the LeaderWorkerSet's size). Real: 2 to 4 nodes
of 8 GPUs for the largest models; at most one node per GPU (MAX_TP x MAX_PP)."""
MAX_REPLICAS = 1000
"""Replicas of one VLLMDeployment."""
MAX_REPLICA_FIX_DECISIONS = 8
"""Decisions one refusal may make to find its `replicas: N` fix (the most replicas that fit now).
A bisection between the cheap bound and the replicas the refused decision placed, which is
usually the answer at the first decision; 8 bisect up to 256 candidates. Past it, the fix is the
most replicas seen to fit (checked, perhaps not the most). With the fixed number of other fixes,
this bounds the decisions of one review (docs/placement.md, "Bounded work per review")."""
MAX_NUM_SEQS = 1 << 20
"""--max-num-seqs. vLLM's largest default is 1024."""
MAX_BATCHED_TOKENS = 1 << 26
"""--max-num-batched-tokens (at most max-num-seqs x max-model-len is ever used)."""
MAX_KV_TOKENS = 1 << 40
"""kvCache.tokens: a trillion tokens of KV (about 128 PiB for an 8B model) is past any cluster."""
MAX_KV_BYTES = 1 << 50
"""kvCache.memory per GPU: 1 PiB, past any GPU (MAX_GPU_MEMORY_BYTES is 2 TiB)."""
MAX_LORAS = 1024
"""lora.maxLoras: adapter slots on the GPU at once (vLLM's default is 1; each slot costs memory)."""
MAX_CPU_OFFLOAD_BYTES = 1 << 50
"""cpuOffload per GPU: 1 PiB of host memory is past any node."""

# --- A node -------------------------------------------------------------------------------------

MAX_GPUS_PER_NODE = 64
"""GPUs one node reports (nvidia.com/gpu.count, inventory GPUs). Real: 16 (HGX-2 / DGX-2)."""
MAX_MIG_PER_GPU = 8
"""MIG slices of one GPU. Real: 7 (A100, H100, B200: 1g profiles)."""
MAX_GPU_MEMORY_BYTES = 2048 * GIB
"""Memory of one GPU. Real: 288 GB (B300, MI355X)."""
MIN_GPU_MEMORY_BYTES = 1 * GIB
"""Memory of one whole GPU at least (the driver alone keeps about 0.5 GiB). Real: 4 GiB (the smallest
data-centre GPUs); MIG slices are checked against their GPU instead."""
MAX_PROCESSES_PER_GPU = 4096
"""Compute processes the inventory may list on one GPU (NVML's own cap is far lower in practice)."""
MAX_INVENTORY_CHARS = 256 * 1024
"""Size of the inventory annotation: all annotations of an object together may hold 256 KiB
(Kubernetes' TotalAnnotationSizeLimitB)."""
GPU_MEMORY_TOLERANCE = 0.02
"""How far the memory the agent reports for a GPU may exceed what the catalog (or the node's
GFD memory label) says for its product. NVML and GFD read the same number, so real reports match
to the MiB; lower reports (ECC on, a driver reserving more) are safe and always accepted."""

# --- Names ------------------------------------------------------------------------------------

MAX_DEPLOYMENT_NAME = 56
"""metadata.name of a VLLMDeployment: it names the Service (a DNS-1035 label, 63) and the
Deployment `<name>-<replica>` of each replica, with room for up to 6 digits."""
MAX_REPO_ID = 96
"""Length of a Hugging Face repo id (huggingface_hub's validate_repo_id: at most 96 characters)."""

# --- Input files ---------------------------------------------------------------------------------

MAX_INPUT_BYTES = 256 << 20
"""Bytes the CLI reads from one input (`plan -f FILE`, `-f -`, `estimate --model-config`, a
safetensors index), whatever it is: a file, a FIFO, a pipe, a device such as /dev/zero. Past it
the command stops with one line (exit 2) instead of reading forever or filling memory. Real: a
`kubectl get nodes,vllmdeployments -A -o yaml` export is about 9 KB per GPU node
(benchmarks/plan_scale.py), so 45 MB for 5,000 nodes, Kubernetes' largest supported cluster; a
config.json is a few KB, a safetensors index a few MB."""

MAX_NESTING = 1000
"""Flow-collection nesting ([ and {) of one YAML document. libyaml's composer recurses in C and
crashes the process (SIGSEGV) at about 30,000 levels; a Kubernetes object nests about 10."""

MAX_KV_GRANT_REQUESTS = 4096
"""The largest number of full-length requests the cluster's default KV grant may name
(--default-kv-requests): vLLM's largest default maxNumSeqs is 1024."""
MAX_KV_TENANTS = 1024
"""The most tenants per GPU the fair share may target (--kv-tenants-per-gpu)."""

# vLLM's own default of --max-logprobs (vllm/config/model.py, ModelConfig.max_logprobs = 20): the
# most top logprobs a request may ask for unless the admin raises the bound (--allow-max-logprobs).
# -1 (the whole vocabulary) is never allowed: its gather holds an int64 index and a float32 value
# per prompt token and vocabulary entry (tokens x vocab x 12 bytes) that nothing books.
MAX_LOGPROBS_DEFAULT = 20
MAX_LOGPROBS = 1024

# The largest over-run a replica's first start may teach its configuration (vllmfit.core.memory.learned):
# a quarter of the prediction, and at least 4 GiB. The memory model misses by start-up buffers and
# allocator rounding, a few GiB; a server that uses far more is doing what its booking did not
# describe (other weights, requests driving memory), so its deployment is flagged instead and no
# other deployment of the configuration pays for it.
LEARNED_OVERRUN_MIN_BYTES = 4 * GIB
LEARNED_OVERRUN_FRACTION_DENOMINATOR = 4
MAX_EPOCH_SECONDS = 1 << 40
"""A timestamp read from outside (a learned record's learnedAt), in seconds since the epoch."""

MAX_SELECTIONS = 512
"""Entries of one ledger's selection cache (core.placement.census.Selections): the nodes each
nodeSelector / required node affinity matches, and the per-set summaries, taints and policy lines
a refusal counts. Keyed by what tenants write, so bounded: the least recently used entry goes
first, and is computed again when asked for. At 1,000 nodes an entry of every node is about
60 KB, so the cache holds at most about 30 MB whatever reviews ask."""

MAX_SELECTIONS_KEPT = 32
"""Of a ledger's selection cache, the most recently used entries a node's change carries over
(each updated with that one node, census.still_matching); the others are dropped and computed
again when asked for. Bounds the work a node joining, leaving or changing its labels does on the
operator's loop to this many set updates, whatever number of selectors reviews have asked for."""

MAX_HUB_MODELS = 256
"""Models read from the Hugging Face Hub kept in memory (sources.hub; the least recently used
goes first and is read again from the HF cache on disk). Keyed by the `spec.model` tenants write."""
