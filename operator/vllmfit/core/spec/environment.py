"""The environment of the vllm container a tenant may set, and what gives a container a device (pure;
docs/webhook.md, "What a tenant may write"): an allow-list (`ENV_ALLOWED`), the variables that
change what code runs (`ENV_CODE`, refused with why), the NVIDIA container toolkit's device
variables (`DEVICE_ENV`), accelerator resources and CDI annotations, which only vllmfit's GPU
binding sets. The same rule applies to spec.env and to every variable an envFrom
ConfigMap or Secret brings (vllmfit.core.spec.validate)."""

from __future__ import annotations

from typing import Any

BINDING_ENV = ("NVIDIA_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES",
               "NVIDIA_GPU_MEMORY_REQUEST", "NVIDIA_GPU_MEMORY_LIMIT", "NVIDIA_GPU_MEMORY_REQUESTS",
               "NVIDIA_GPU_MEMORY_LIMITS", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")

ENV_ALLOWED = frozenset({
    # Hugging Face: token, caches, mirrors, offline mode
    "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE", "HF_HUB_ENABLE_HF_TRANSFER",
    "HF_HUB_DISABLE_TELEMETRY", "HF_HUB_DISABLE_PROGRESS_BARS", "HF_HUB_ETAG_TIMEOUT",
    "HF_HUB_DOWNLOAD_TIMEOUT", "TRANSFORMERS_OFFLINE", "TRANSFORMERS_CACHE", "HF_DATASETS_OFFLINE",
    # egress through a proxy, private CAs
    "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy", "REQUESTS_CA_BUNDLE",
    "SSL_CERT_FILE", "SSL_CERT_DIR", "CURL_CA_BUNDLE",
    # the server's logging, API key, timeouts and usage reporting
    "VLLM_LOGGING_LEVEL", "VLLM_LOGGING_PREFIX", "VLLM_LOG_STATS_INTERVAL", "VLLM_API_KEY", "VLLM_NO_USAGE_STATS",
    "VLLM_DO_NOT_TRACK", "DO_NOT_TRACK", "VLLM_ENGINE_ITERATION_TIMEOUT_S", "VLLM_HTTP_TIMEOUT_KEEP_ALIVE",
    "VLLM_RPC_TIMEOUT", "VLLM_KEEP_ALIVE_ON_ENGINE_DEATH", "VLLM_IMAGE_FETCH_TIMEOUT", "VLLM_VIDEO_FETCH_TIMEOUT",
    "VLLM_AUDIO_FETCH_TIMEOUT", "VLLM_DEBUG_LOG_API_SERVER_RESPONSE", "VLLM_ALLOW_RUNTIME_LORA_UPDATING",
    # the process's home, locale and CPU threads
    "HOME", "USER", "TMPDIR", "XDG_CACHE_HOME", "TZ", "LANG", "LC_ALL", "PYTHONUNBUFFERED", "PYTHONIOENCODING",
    "TOKENIZERS_PARALLELISM", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
    # NCCL's diagnostics and network interface (not its buffers)
    "NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "NCCL_SOCKET_IFNAME",
    # OpenTelemetry export (--otlp-traces-endpoint)
    "OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES",
})
ENV_ALLOWED_PREFIXES = ("OTEL_EXPORTER_OTLP_",)
ENV_CODE = {
    "PYTHONPATH": "adds directories Python imports from",
    "PYTHONSTARTUP": "runs a file in interactive interpreters",
    "PYTHONHOME": "replaces the interpreter's library",
    "PYTHONUSERBASE": "adds a user site-packages Python imports from",
    "PYTHONNOUSERSITE": "is set by vllmfit (no user site-packages)",
    "PYTHONWARNINGS": "imports the modules its filters name",
    "PYTHONINSPECT": "changes how the interpreter runs",
    "LD_PRELOAD": "loads a shared library into every process",
    "LD_LIBRARY_PATH": "replaces the shared libraries (CUDA, NCCL) the server loads",
    "LD_AUDIT": "loads a shared library into every process",
    "VLLM_PLUGINS": "loads vLLM plugins (code) into the server",
    "VLLM_LOGGING_CONFIG_PATH": "loads a logging config that names classes to import",
}
HF_ENDPOINT = "HF_ENDPOINT"
"""Where huggingface_hub downloads config.json and the weights from: only a mirror the admin names
(validate.Policy.hf_endpoints, --allow-hf-endpoint); a tenant's own endpoint would serve other
weights than the ones sized."""
CACHE_ENV = ("HF_HOME", "HF_HUB_CACHE", "TRANSFORMERS_CACHE", "XDG_CACHE_HOME", "HOME")
"""Where vLLM's huggingface_hub finds a model already downloaded (the first one set wins, in
huggingface_hub's order): a cache the tenant can write is verified before vLLM starts
(vllmfit.verify, rendered by vllmfit.operator.rendering.verifier)."""
FORCED_ENV: tuple[dict[str, str], ...] = ({"name": "PYTHONNOUSERSITE", "value": "1"},)
"""Env vllmfit puts last in the vllm container: no user site-packages (usercustomize, .pth files
under $HOME/.local) is imported, whatever the image or a volume holds there."""

# --- Device access: what gives a container a GPU besides vllmfit's binding -------------------------

VOID = "void"
"""NVIDIA_VISIBLE_DEVICES value that gives a container no GPU (NVIDIA container toolkit, legacy and
CDI modes); forced into every container but vllm's."""
# The NVIDIA container toolkit reads these from a container's env to decide which devices and
# control files it injects (GPUs, driver capabilities, MIG/IMEX/NVSwitch/GDS/MOFED devices).
# NVIDIA_REQUIRE_* and NVIDIA_DISABLE_REQUIRE only constrain, and CUDA_VISIBLE_DEVICES only
# filters what a process already sees: none gives access, so they stay allowed on sidecars.
DEVICE_ENV = frozenset({
    "NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES", "NVIDIA_MIG_CONFIG_DEVICES",
    "NVIDIA_MIG_MONITOR_DEVICES", "NVIDIA_IMEX_CHANNELS", "NVIDIA_GDS", "NVIDIA_MOFED", "NVIDIA_NVSWITCH",
    "NVIDIA_GDRCOPY",
})
# Extended resources that hand a container an accelerator (any resource of these domains).
GPU_RESOURCE_PREFIXES = ("nvidia.com/", "amd.com/", "gpu.intel.com/", "habana.ai/", "aws.amazon.com/neuron",
                         "google.com/tpu", "xilinx.com/", "qualcomm.com/", "huawei.com/ascend", "hami.io/")
CDI_ANNOTATION_PREFIX = "cdi.k8s.io/"

def is_device_env(name: Any) -> bool:
    return isinstance(name, str) and name in DEVICE_ENV


def env_name_problem(name: Any) -> str | None:
    """Why the vllm container may not have env `name` (None: it may)."""
    if not isinstance(name, str) or not name:
        return "an env entry needs a name"
    if name in BINDING_ENV or is_device_env(name):
        return "is set by vllmfit's GPU binding; use spec.placement.gpuIndices to choose GPUs"
    if name == HF_ENDPOINT:
        return ("downloads the model from another endpoint than the Hub vllmfit sized it from; only a mirror the "
                "admin allows (--allow-hf-endpoint) may be set, as a value in spec.env")
    if name in ENV_CODE:
        return f"{ENV_CODE[name]}: the vllm container runs only the server vllmfit sized; remove it"
    if name in ENV_ALLOWED or name.startswith(ENV_ALLOWED_PREFIXES):
        return None
    return ("is not on the allow-list of the vllm container's environment (docs/webhook.md, \"What a tenant may "
            "write\"); remove it")


def is_gpu_resource(name: str) -> bool:
    return any(str(name).startswith(p) for p in GPU_RESOURCE_PREFIXES)
