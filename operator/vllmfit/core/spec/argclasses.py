"""The class of every `vllm serve` option of the supported vLLM versions (pure; docs/webhook.md,
"Every vLLM argument"): computed by vllmfit, modelled (set from a spec field whose memory vllmfit
models), allowed because it cannot change GPU memory (or only with the values VALUE_RULES lets
through), or refused, each with why. The options themselves are vllmfit.core.spec.vllmargs,
generated from vLLM's parser; tests/test_vllm_args.py fails when one of them has no class here.
vllmfit.core.spec.extraargs resolves an extraArgs entry to an option and applies its class."""

from __future__ import annotations

from vllmfit.core.spec import vllmargs

# Refused long options -> why (the text after "extraArgs X ").
_SET = "is set by vllmfit; use {} instead"
_FIXED = "is set by vllmfit; remove it"
_MEMORY = "changes GPU memory ({}) in a way vllmfit does not model; remove it"
_LOADS = "loads {}; use spec.model (and spec.modelConfig for a model that is not on the Hub) instead"
_IMPORTS = "imports code into the server, where it can take GPU memory vllmfit did not book; remove it"
_UNKNOWN = ("is not known to leave GPU memory unchanged (vllmfit refuses what it has not classified as "
            "harmless); remove it")
_DRAFT = "a draft model's weights, KV cache and CUDA graphs: a second model vllmfit does not size"

REFUSED: dict[str, str] = {
    "--model": _SET.format("spec.model"),
    "--max-model-len": _SET.format("spec.maxModelLen"),
    "--max-num-seqs": _SET.format("spec.maxNumSeqs"),
    "--gpu-memory-utilization": _SET.format("spec.gpuMemoryUtilization"),
    "--device-memory-utilization": _SET.format("spec.gpuMemoryUtilization"),
    "--kv-cache-memory-bytes": _SET.format("spec.kvCache (tokens, memory or concurrency: the KV cache is sized from it)"),
    "--max-num-batched-tokens": _SET.format("spec.maxNumBatchedTokens"),
    "--tensor-parallel-size": _SET.format("spec.tensorParallelSize"),
    "--pipeline-parallel-size": _SET.format("spec.pipelineParallelSize"),
    "--data-parallel-size": _SET.format("spec.replicas"),
    "--dtype": _SET.format("spec.dtype"),
    "--quantization": _SET.format("spec.quantization"),
    "--kv-cache-dtype": _SET.format("spec.kvCacheDtype"),
    "--enforce-eager": _SET.format("spec.enforceEager"),
    "--port": _FIXED + " (the Service and probes use port 8000)",
    "--host": _FIXED + " (the Service and probes use port 8000)",
    "--config": "loads a file that can set any flag; put its flags in the spec or extraArgs",
    "--block-size": _FIXED + " (the KV cache is sized with vLLM's default block size)",
    "--num-gpu-blocks-override": _MEMORY.format("the KV cache size, ignoring the profile"),
    # Data, context and expert parallelism and multi-node: a different layout per GPU.
    "--data-parallel-size-local": _SET.format("spec.replicas"),
    "--data-parallel-rank": _SET.format("spec.replicas"),
    "--data-parallel-start-rank": _SET.format("spec.replicas"),
    "--data-parallel-address": _SET.format("spec.replicas"),
    "--data-parallel-rpc-port": _SET.format("spec.replicas"),
    "--data-parallel-backend": _SET.format("spec.replicas"),
    "--data-parallel-hybrid-lb": _SET.format("spec.replicas"),
    "--data-parallel-external-lb": _SET.format("spec.replicas"),
    "--data-parallel-multi-port-external-lb": _SET.format("spec.replicas"),
    "--decode-context-parallel-size": _MEMORY.format("the KV cache layout"),
    "--prefill-context-parallel-size": _MEMORY.format("the KV cache layout"),
    "--enable-expert-parallel": _MEMORY.format("expert weights per GPU"),
    "--nnodes": _MEMORY.format("a multi-node layout"),
    "--node-rank": _MEMORY.format("a multi-node layout"),
    # Memory vllmfit does not model.
    # Speculative decoding: a draft model is a second model (its own config, weights, KV cache and
    # graphs) that vllmfit would have to resolve and size next to the target; not modelled.
    "--speculative-config": _MEMORY.format(_DRAFT),
    "--spec-method": _MEMORY.format(_DRAFT),
    "--spec-model": _MEMORY.format(_DRAFT),
    "--spec-tokens": _MEMORY.format(_DRAFT),
    # LoRA and CPU offload are modelled: spec.lora and spec.cpuOffload set these flags.
    "--enable-lora": _SET.format("spec.lora (maxLoras, maxLoraRank, loraDtype: the adapter slots are sized from it)"),
    "--max-loras": _SET.format("spec.lora.maxLoras"),
    "--max-lora-rank": _SET.format("spec.lora.maxLoraRank"),
    "--lora-dtype": _SET.format("spec.lora.loraDtype"),
    "--lora-extra-vocab-size": _MEMORY.format("extra vocabulary rows per LoRA slot (vLLM 0.11)"),
    "--fully-sharded-loras": _MEMORY.format("LoRA slot shapes sharded by TP"),
    "--enable-tower-connector-lora": _MEMORY.format("LoRA slots on the multimodal encoder"),
    "--specialize-active-lora": _MEMORY.format("CUDA graphs per number of active LoRAs"),
    "--cpu-offload-gb": _SET.format("spec.cpuOffload (a quantity per GPU, e.g. 10Gi)"),
    "--cpu-offload-params": _MEMORY.format("which weights go to CPU; spec.cpuOffload offloads any"),
    "--offload-backend": _MEMORY.format("the weight offloader; use spec.cpuOffload"),
    "--offload-group-size": _MEMORY.format("prefetch offloading of weights; use spec.cpuOffload"),
    "--offload-num-in-group": _MEMORY.format("prefetch offloading of weights; use spec.cpuOffload"),
    "--offload-prefetch-step": _MEMORY.format("prefetch offloading of weights; use spec.cpuOffload"),
    "--offload-params": _MEMORY.format("prefetch offloading of weights; use spec.cpuOffload"),
    "--kv-offloading-size": _MEMORY.format("KV offload staging buffers"),
    "--kv-offloading-backend": _MEMORY.format("KV offload staging buffers"),
    "--kv-transfer-config": _MEMORY.format("KV connector buffers"),
    "--hf-overrides": _MEMORY.format("the model's architecture"),
    "--compilation-config": _MEMORY.format("CUDA graphs; use spec.enforceEager to turn them off"),
    "--optimization-level": _MEMORY.format("CUDA graphs; use spec.enforceEager to turn them off"),
    "--cudagraph-capture-sizes": _MEMORY.format("CUDA graphs; use spec.enforceEager to turn them off"),
    "--max-cudagraph-capture-size": _MEMORY.format("CUDA graphs; use spec.enforceEager to turn them off"),
    "--cuda-graph-sizes": _MEMORY.format("CUDA graphs; use spec.enforceEager to turn them off"),
    "--max-seq-len-to-capture": _MEMORY.format("CUDA graphs; use spec.enforceEager to turn them off"),
    "--limit-mm-per-prompt": _MEMORY.format("the multimodal encoder profile"),
    "--skip-mm-profiling": _MEMORY.format("the multimodal encoder profile"),
    "--mm-encoder-tp-mode": _MEMORY.format("the multimodal encoder weights"),
    "--mm-ipc-gpu-memory-gb": _MEMORY.format("the KV cache"),
    "--mamba-cache-dtype": _MEMORY.format("Mamba state"),
    "--mamba-ssm-cache-dtype": _MEMORY.format("Mamba state"),
    "--mamba-block-size": _MEMORY.format("Mamba state"),
    "--disable-hybrid-kv-cache-manager": _MEMORY.format("KV cache per request"),
    "--disable-sliding-window": _MEMORY.format("the context length"),
    "--kv-sharing-fast-prefill": _MEMORY.format("the KV cache"),
    "--calculate-kv-scales": _MEMORY.format("the KV cache"),
    "--performance-mode": _MEMORY.format("the batch defaults"),
    "--enable-chunked-prefill": _MEMORY.format("the batch defaults"),
    "--max-num-partial-prefills": _MEMORY.format("the batch defaults"),
    "--enable-sleep-mode": _MEMORY.format("the allocator"),
    "--enable-dbo": _MEMORY.format("micro-batch workspaces"),
    "--all2all-backend": _MEMORY.format("all2all workspaces"),
    # What is loaded must be what vllmfit sized (issue 21 item 4): another revision of the
    # weights or of the model's code, a config from elsewhere, or extra loader settings.
    "--code-revision": _LOADS.format("another revision of the model's code than the one sized"),
    "--hf-config-path": _LOADS.format("a config.json from another place than the one sized"),
    "--model-loader-extra-config": _LOADS.format("loader settings (tensorizer, sharded state) that change what "
                                                 "is loaded"),
    # Code imported into the server by name: it runs next to the model on a shared GPU and can
    # allocate memory there that nothing books.
    "--worker-cls": _IMPORTS,
    "--worker-extension-cls": _IMPORTS,
    "--logits-processors": _IMPORTS,
    "--logits-processor-pattern": _IMPORTS + " (requests name the processors to import)",
    "--scheduler-cls": _IMPORTS,
    "--middleware": _IMPORTS,
    "--tool-parser-plugin": _IMPORTS,
    "--reasoning-parser-plugin": _IMPORTS,
    "--io-processor-plugin": _IMPORTS,
    "--additional-config": "passes settings to platform plugins vllmfit does not know; remove it",
    # Issue 30: the rest of vLLM 0.11-0.33's options that change GPU memory in ways vllmfit does not model.
    "--mm-processor-kwargs": _MEMORY.format("the multimodal encoder profile, e.g. max_pixels"),
    "--trust-request-mm-kwargs": _MEMORY.format("the multimodal encoder profile: requests pass processor kwargs"),
    "--media-io-kwargs": _MEMORY.format("the multimodal encoder profile: frames and pixels per item"),
    "--video-pruning-method": _MEMORY.format("the multimodal encoder profile"),
    "--video-pruning-rate": _MEMORY.format("the multimodal encoder profile"),
    "--disable-chunked-mm-input": _MEMORY.format("the multimodal encoder profile"),
    "--enable-mm-embeds": _MEMORY.format("the multimodal encoder profile"),
    "--enable-multimodal-encoder-data-parallel": _MEMORY.format("the multimodal encoder weights"),
    "--mm-encoder-only": _MEMORY.format("the multimodal encoder weights"),
    "--mm-encoder-attn-backend": _MEMORY.format("the multimodal encoder's attention workspace"),
    "--mm-encoder-attn-dtype": _MEMORY.format("the multimodal encoder's activations"),
    "--mm-encoder-fp8-scale-path": _MEMORY.format("the multimodal encoder's weights"),
    "--mm-encoder-fp8-scale-save-margin": _MEMORY.format("the multimodal encoder's weights"),
    "--mm-encoder-fp8-scale-save-path": _MEMORY.format("the multimodal encoder's weights"),
    "--mm-processor-device": _MEMORY.format("multimodal preprocessing on the GPU"),
    "--mm-device-do-normalize": _MEMORY.format("multimodal preprocessing on the GPU"),
    "--mm-tensor-ipc": _MEMORY.format("multimodal tensors shared through GPU memory"),
    "--language-model-only": _MEMORY.format("the multimodal encoder weights"),
    "--diffusion-config": _MEMORY.format("a diffusion pipeline"),
    "--enable-eplb": _MEMORY.format("redundant experts on every rank: expert-parallel load balancing"),
    "--num-redundant-experts": _MEMORY.format("redundant experts on every rank"),
    "--eplb-config": _MEMORY.format("redundant experts on every rank"),
    "--eplb-window-size": _MEMORY.format("redundant experts on every rank"),
    "--eplb-step-interval": _MEMORY.format("redundant experts on every rank"),
    "--eplb-log-balancedness": _MEMORY.format("redundant experts on every rank"),
    "--expert-placement-strategy": _MEMORY.format("expert weights per GPU"),
    "--enable-elastic-ep": _MEMORY.format("expert weights per GPU"),
    "--elastic-ep-max-dp-size": _MEMORY.format("expert weights per GPU"),
    "--enable-ep-weight-filter": _MEMORY.format("expert weights per GPU"),
    "--enable-return-routed-experts": _MEMORY.format("routed-expert buffers per token"),
    "--device-ids": _SET.format("spec.placement.gpuIndices (vllmfit's GPU binding chooses the GPUs)"),
    "--pt-load-map-location": _MEMORY.format("where the weights are loaded (another device)"),
    "--convert": _MEMORY.format("the runner (a pooling model sizes differently)"),
    "--runner": _MEMORY.format("the runner (a pooling model sizes differently)"),
    "--task": _MEMORY.format("the runner (a pooling model sizes differently)"),
    "--pooler-config": _MEMORY.format("the pooling runner"),
    "--override-pooler-config": _MEMORY.format("the pooling runner"),
    "--use-gpu-for-pooling-score": _MEMORY.format("the pooling runner"),
    "--rope-scaling": _MEMORY.format("the model's architecture and context length"),
    "--rope-theta": _MEMORY.format("the model's architecture"),
    "--override-attention-dtype": _MEMORY.format("the attention activations"),
    "--kv-cache-dtype-skip-layers": _MEMORY.format("the KV cache bytes per layer"),
    "--cp-kv-cache-interleave-size": _MEMORY.format("the KV cache layout"),
    "--dcp-kv-cache-interleave-size": _MEMORY.format("the KV cache layout"),
    "--dcp-comm-backend": _MEMORY.format("the KV cache layout"),
    "--dcp-q-replicate": _MEMORY.format("the KV cache layout"),
    "--num-lookahead-slots": _MEMORY.format(_DRAFT),
    "--quantization-config": _SET.format("spec.quantization"),
    "--attention-backend": _MEMORY.format("the attention workspace"),
    "--attention-config": _MEMORY.format("the attention workspace"),
    "--kernel-config": _MEMORY.format("kernel workspaces"),
    "--ir-op-priority": _MEMORY.format("kernel workspaces"),
    "--moe-backend": _MEMORY.format("kernel workspaces"),
    "--linear-backend": _MEMORY.format("kernel workspaces"),
    "--gdn-prefill-backend": _MEMORY.format("kernel workspaces"),
    "--kda-decode-backend": _MEMORY.format("kernel workspaces"),
    "--kda-prefill-backend": _MEMORY.format("kernel workspaces"),
    "--mamba-backend": _MEMORY.format("Mamba state"),
    "--sparse-indexer-topk-backend": _MEMORY.format("kernel workspaces"),
    "--monokernel": _MEMORY.format("kernel workspaces"),
    "--enable-flashinfer-autotune": _MEMORY.format("autotuning workspaces during the profile"),
    "--enable-flash-late-interaction": _MEMORY.format("kernel workspaces"),
    "--disable-cascade-attn": _MEMORY.format("the attention workspace"),
    "--disable-custom-all-reduce": _MEMORY.format("all-reduce buffers"),
    "--enable-nccl-comm-suspend": _MEMORY.format("NCCL buffers"),
    "--enable-hc-sp": _MEMORY.format("sequence-parallel activations"),
    "--ubatch-size": _MEMORY.format("micro-batch workspaces"),
    "--dbo-decode-token-threshold": _MEMORY.format("micro-batch workspaces"),
    "--dbo-prefill-token-threshold": _MEMORY.format("micro-batch workspaces"),
    "--async-scheduling": _MEMORY.format("the scheduler's double-buffered outputs"),
    "--max-num-active-seqs": _SET.format("spec.maxNumSeqs"),
    "--max-num-scheduled-tokens": _SET.format("spec.maxNumBatchedTokens"),
    "--max-long-partial-prefills": _MEMORY.format("the batch defaults"),
    "--enable-prompt-embeds": _MEMORY.format("an inputs_embeds buffer of maxNumBatchedTokens x hidden size"),
    "--enable-batch-sharded-sampling": _MEMORY.format("the sampler's buffers"),
    "--use-fp64-gumbel": _MEMORY.format("the sampler's buffers"),
    "--return-sampling-mask": _MEMORY.format("the sampler's buffers"),
    "--watermark": _MEMORY.format("the sampler's buffers"),
    "--watermark-config": _MEMORY.format("the sampler's buffers"),
    "--enable-cumem-allocator": _MEMORY.format("the allocator"),
    "--sleep-mode-backend": _MEMORY.format("the allocator"),
    "--sleep-mode-offload-cudagraph": _MEMORY.format("the allocator"),
    "--sleep-preserve-parameter-names": _MEMORY.format("the allocator"),
    "--enable-lora-bias": _MEMORY.format("LoRA slot shapes (bias per slot)"),
    "--lora-target-modules": _MEMORY.format("LoRA slot shapes"),
    "--max-lora-cls-labels": _MEMORY.format("LoRA slot shapes"),
    "--enable-mixed-moe-lora-format": _MEMORY.format("LoRA slot shapes"),
    "--enable-moe-shared-loras": _MEMORY.format("LoRA slot shapes"),
    "--enable-mamba-cache-stochastic-rounding": _MEMORY.format("Mamba state"),
    "--enable-mamba-shared-prefix-checkpoint": _MEMORY.format("Mamba state"),
    "--mamba-cache-mode": _MEMORY.format("Mamba state"),
    "--mamba-cache-philox-rounds": _MEMORY.format("Mamba state"),
    "--mamba-ssu-algorithm": _MEMORY.format("Mamba state"),
    "--use-replayssm": _MEMORY.format("Mamba state"),
    "--replayssm-buffer-len": _MEMORY.format("Mamba state"),
    "--swa-bounded-replay": _MEMORY.format("sliding-window state"),
    "--ec-transfer-config": _MEMORY.format("encoder-cache transfer buffers"),
    "--ec-manager-config": _MEMORY.format("encoder-cache transfer buffers"),
    "--weight-transfer-config": _MEMORY.format("weight-transfer buffers"),
    "--profiler-config": _MEMORY.format("profiler buffers"),
    "--engram-config": _MEMORY.format("an extra memory module"),
    "--aux-output-config": _MEMORY.format("auxiliary output buffers"),
    "--enable-fault-tolerance": _MEMORY.format("a multi-rank layout"),
    "--fault-tolerance-config": _MEMORY.format("a multi-rank layout"),
    "--enable-scale-out": _MEMORY.format("a multi-rank layout"),
    "--master-addr": _MEMORY.format("a multi-node layout"),
    "--master-port": _MEMORY.format("a multi-node layout"),
    "--headless": _FIXED + " (a headless server has no API for the Service and probes)",
    "--grpc": _FIXED + " (the Service and probes use HTTP on port 8000)",
    "--grpc-port": _FIXED + " (the Service and probes use HTTP on port 8000)",
    "--uds": _FIXED + " (the Service and probes use HTTP on port 8000)",
    "--data-parallel-supervisor-port": _SET.format("spec.replicas"),
    "--dp-supervisor-probe-failure-threshold": _SET.format("spec.replicas"),
    "--dp-supervisor-probe-interval-s": _SET.format("spec.replicas"),
    "--dp-supervisor-probe-timeout-s": _SET.format("spec.replicas"),
    "--dp-sync-interval": _SET.format("spec.replicas"),
    "--disable-nccl-for-dp-synchronization": _SET.format("spec.replicas"),
    "--trust-remote-code": "runs the model repository's Python code in the server, where it can take GPU memory "
                           "vllmfit did not book; remove it (vLLM implements the catalog's architectures itself)",
    "--model-class-overrides": _IMPORTS,
    "--log-config-file": _IMPORTS + " (a logging config names handler classes to import)",
    "--logging-config": _IMPORTS + " (a logging config names handler classes to import)",
    "--fingerprint-mode": _UNKNOWN,
    "--fingerprint-value": _UNKNOWN,
    "--jit-monitor-mode": _UNKNOWN,
    "--jit-monitor-verbose": _UNKNOWN,
    "--enable-trace-replay": _UNKNOWN,
    "--enable-shm-tensor-arena": _UNKNOWN,
    "--watchdog-config": _UNKNOWN,
}

# Single-dash aliases: vllmargs.ALIASES (what vLLM registers); -O is resolved by hand below.
ALIASES: dict[str, str] = dict(vllmargs.ALIASES)

# Options allowed because they cannot change GPU memory -> why (the docs' table groups them).
_SERVER = "the HTTP server, its API and its security (CPU only)"
_LOGS = "logging, metrics and tracing"
_TOKENS = "tokenizer, chat templates and parsers (CPU only)"
_HOST = "host memory or host I/O only"
_SCHED = "scheduling order within the KV cache and batch vllmfit sized"
ALLOWED: dict[str, str] = {
    **dict.fromkeys((
        "--allow-credentials", "--allowed-headers", "--allowed-methods", "--allowed-origins", "--api-key",
        "--api-server-count", "--allowed-local-media-path", "--allowed-media-domains", "--disable-fastapi-docs",
        "--disable-frontend-multiprocessing", "--disable-uvicorn-access-log", "--disable-access-log-for-endpoints",
        "--enable-auto-tool-choice", "--enable-force-include-usage", "--enable-offline-docs",
        "--enable-prompt-tokens-details", "--enable-request-id-headers", "--enable-server-load-tracking",
        "--enable-ssl-refresh", "--enable-tokenizer-info-endpoint", "--exclude-tools-when-tool-choice-none",
        "--h11-max-header-count", "--h11-max-incomplete-event-size", "--response-role",
        "--return-tokens-as-token-ids", "--root-path", "--served-model-name", "--ssl-ca-certs", "--ssl-cert-reqs",
        "--ssl-certfile", "--ssl-ciphers", "--ssl-keyfile", "--sse-keep-alive-interval", "--stream-interval",
        "--tokens-only", "--tool-server", "--tool-strict-level", "--uvicorn-log-level", "--shutdown-timeout",
        "--anthropic-disabled-thinking-effort", "--distributed-timeout-seconds",
        "--cpu-distributed-timeout-seconds", "--fail-on-environ-validation", "--hf-token", "--seed",
        "--logprobs-mode", "--generation-config", "--override-generation-config",
        "--structured-outputs-config", "--allow-deprecated-quantization", "--renderer-num-workers"), _SERVER),
    **dict.fromkeys((
        "--aggregate-engine-logging", "--collect-detailed-traces", "--cudagraph-metrics", "--custom-histogram-buckets",
        "--disable-log-requests", "--disable-log-stats", "--enable-layerwise-nvtx-tracing", "--enable-log-deltas",
        "--enable-log-outputs", "--enable-log-requests", "--enable-logging-iteration-details",
        "--enable-mfu-metrics", "--enable-per-request-metrics", "--kv-cache-metrics", "--kv-cache-metrics-sample",
        "--kv-events-config", "--log-error-stack", "--log-level", "--max-log-len", "--otlp-traces-endpoint",
        "--per-request-spec-decode-metrics", "--show-hidden-metrics-for-version", "--ray-workers-use-nsight"), _LOGS),
    **dict.fromkeys((
        "--chat-template", "--chat-template-content-format", "--cohere-format", "--cohere-is-reasoning-model",
        "--default-chat-template-kwargs", "--interleave-mm-strings", "--reasoning-config",
        "--reasoning-effort-map", "--reasoning-parser", "--skip-tokenizer-init", "--tokenizer", "--tokenizer-mode",
        "--tokenizer-revision", "--tool-call-parser", "--trust-request-chat-template", "--mm-hasher-algorithm"),
        _TOKENS),
    **dict.fromkeys((
        "--ignore-patterns", "--max-parallel-loading-workers", "--safetensors-load-strategy",
        "--safetensors-prefetch-block-size", "--safetensors-prefetch-num-threads", "--use-tqdm-on-load",
        "--swap-space", "--max-cpu-loras", "--mm-processor-cache-gb", "--mm-processor-cache-type",
        "--mm-shm-cache-max-object-size-mb", "--disable-mm-preprocessor-cache", "--numa-bind", "--numa-bind-cpus",
        "--numa-bind-nodes"), _HOST),
    **dict.fromkeys((
        "--enable-prefix-caching", "--prefix-caching-hash-algo", "--prefix-cache-retention-interval",
        "--prefix-match-unit", "--long-prefill-token-threshold", "--long-prefill-token-threshold-adaptive",
        "--scheduling-policy", "--scheduler-reserve-full-isl", "--prefill-schedule-interval",
        "--max-num-queued-reqs", "--max-num-queued-tokens"), _SCHED),
    "--download-dir": ("the model cache: a cache the tenant can write is verified against what was sized before "
                       "vLLM starts (docs/trust-model.md)"),
    "--lora-modules": "adapters loaded into the LoRA slots spec.lora sized",
    "--default-mm-loras": "adapters loaded into the LoRA slots spec.lora sized",
}

# Every --load-format value of vLLM 0.11-0.33 by its loading peak on the GPU (vllm/model_executor/
# model_loader/): "per tensor" loaders read each tensor on the host and copy it into a parameter vLLM
# already allocated (the profile's weights, nothing more); the others are refused.
LOAD_FORMATS: dict[str, tuple[str, str]] = {
    "auto": ("per tensor", "safetensors, else pt: read on the host, copied into each parameter"),
    "safetensors": ("per tensor", "safe_open on the host (mmap), one tensor at a time"),
    "pt": ("per tensor", "torch.load(map_location='cpu'), one tensor at a time"),
    "npcache": ("per tensor", "numpy memmaps on the host"),
    "runai_streamer": ("per tensor", "streamed into host buffers, then copied into each parameter"),
    "fastsafetensors": ("refused", ("copies whole shards onto the GPU (GDS or a bounce buffer) while every "
                                    "parameter is already allocated: up to a shard per rank on top of the weights")),
    "dummy": ("refused", "random weights: not the checkpoint sized"),
    "tensorizer": ("refused", "another serialisation of the weights than the checkpoint sized"),
    "sharded_state": ("refused", "per-rank shards written by another run, not the checkpoint sized"),
    "gguf": ("refused", "a GGUF file: other weights and quantization than sized"),
    "bitsandbytes": ("refused", "quantizes while loading: other weight bytes than sized"),
    "mistral": ("refused", "consolidated Mistral weights with params.json, not the config.json sized"),
}

# Options allowed only with an immutable revision (a 40-hex commit): a branch or a tag names what
# the repository's owner pushes next, not what vllmfit sized -> why.
COMMIT: dict[str, str] = {
    "--revision": ("only a commit (40 hexadecimal digits) pins the weights and config.json vllmfit sized; a branch "
                   "or tag moves with the repository"),
}

# Options allowed up to a bound the admin may raise (vllmfit.core.spec.validate.Policy) -> why.
BOUNDED: dict[str, str] = {
    "--max-logprobs": ("top logprobs per request; prompt logprobs take a float32 log-softmax over a whole "
                       "prefill chunk x vocabulary either way (docs/trust-model.md); -1 (the whole vocabulary) "
                       "and values above vLLM's default (20) only where the admin raises the bound "
                       "(--allow-max-logprobs)"),
}

# Options allowed with some values only -> (allowed values, why the others are refused).
VALUE_RULES: dict[str, tuple[frozenset[str], str]] = {
    # vLLM's LoadFormat (0.11-0.33): these read the checkpoint vllmfit sized, as it is. dummy
    # (random weights), tensorizer, sharded_state, gguf, bitsandbytes and mistral load
    # something else, or quantize while loading.
    "--load-format": (frozenset(v for v, (peak, _) in LOAD_FORMATS.items() if peak != "refused"),
                      ("loads other weights than the checkpoint vllmfit sized, quantizes them while loading, or "
                       "copies whole shards onto the GPU next to the weights (fastsafetensors: a loading peak "
                       "nothing books); use auto, safetensors, pt, npcache or runai_streamer")),
    # mistral reads params.json, not the config.json vllmfit sized.
    "--config-format": (frozenset({"auto", "hf"}), ("reads another config than the config.json vllmfit sized; use "
                        "auto or hf")),
    # A dotted value is a class vLLM imports; ray needs a Ray cluster vllmfit does not place.
    "--distributed-executor-backend": (frozenset({"mp", "uni"}),
                                       "only mp and uni run the replica on the GPUs vllmfit booked for it"),
    # transformers (and terratorch) run another implementation of the model than the one sized.
    "--model-impl": (frozenset({"auto", "vllm"}), ("runs another implementation of the model than the one sized; "
                     "use auto or vllm")),
}

# The class of every option (docs/webhook.md, "Every vLLM argument"): computed by vllmfit from
# the spec and the ledger; modelled (set from a spec field whose memory vllmfit models); allowed
# (cannot change GPU memory, or only with the values VALUE_RULES lets through); refused.
COMPUTED = frozenset({"--model", "--host", "--port", "--max-model-len", "--max-num-seqs", "--gpu-memory-utilization",
                      "--kv-cache-memory-bytes", "--max-num-batched-tokens"})
MODELLED = frozenset({"--tensor-parallel-size", "--pipeline-parallel-size", "--dtype", "--kv-cache-dtype",
                      "--quantization", "--enforce-eager", "--enable-lora", "--max-loras", "--max-lora-rank",
                      "--lora-dtype", "--cpu-offload-gb"})
KNOWN: frozenset[str] = (frozenset(vllmargs.OPTIONS) | frozenset(REFUSED) | frozenset(ALLOWED) | frozenset(VALUE_RULES)
                         | frozenset(BOUNDED) | frozenset(COMMIT))


def classify(option: str) -> tuple[str, str]:
    """(class, why) of a long option: computed, modelled, allowed, allowed-values or refused;
    ('unclassified', '') for an option this table does not know."""
    if option in COMPUTED:
        return "computed", REFUSED[option]
    if option in MODELLED:
        return "modelled", REFUSED[option]
    if option in REFUSED:
        return "refused", REFUSED[option]
    if option in VALUE_RULES:
        allowed, _why = VALUE_RULES[option]
        return "allowed-values", "only " + ", ".join(sorted(allowed))
    if option in BOUNDED:
        return "bounded", BOUNDED[option]
    if option in COMMIT:
        return "commit", COMMIT[option]
    if option in ALLOWED:
        return "allowed", ALLOWED[option]
    return "unclassified", ""


def table_markdown() -> str:
    """docs/webhook.md's table of every option of the supported vLLM versions (tests keep it in step)."""
    rows = ["| option | vLLM | class | why |", "|---|---|---|---|"]
    for option in sorted(KNOWN):
        versions = vllmargs.OPTIONS.get(option, ())
        kind, why = classify(option)
        shown = ", ".join(v.rsplit(".", 1)[0] for v in versions) or "older"
        rows.append(f"| `{option}` | {shown} | {kind} | {why.replace('|', '/')} |")
    return "\n".join(rows) + "\n"
