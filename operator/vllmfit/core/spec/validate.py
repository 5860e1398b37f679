"""The one validator of a VLLMDeployment spec (pure): `vllmfit plan`, the webhook and the operator
all call `problems`, so a spec gets the same verdict, and the same one-line reason naming the
field, wherever it is checked (docs/webhook.md, "What a tenant may write").

Allow-lists, not deny-lists (issue 30): what a tenant's podTemplate may add to a pod that runs on a
booked GPU is listed here, field by field, and anything else is refused.

- Pod fields: `POD_FIELDS` (tolerations, volumes, affinity, securityContext, ...); the fields
  vllmfit's binding owns name the spec field to use; host namespaces are refused.
- Volumes: `VOLUME_TYPES` (configMap, secret, emptyDir with a sizeLimit, persistentVolumeClaim,
  projected, downwardAPI, ephemeral, image), CSI drivers and hostPath paths only where the admin
  names them (`Policy`).
- Containers: `CONTAINER_FIELDS` for the tenant's own containers (lifecycle hooks only there);
  `VLLM_FIELDS` for the `vllm` container, which runs what vllmfit computed: no lifecycle hooks,
  no workingDir, no probe handlers, no mounts over the image's code, and only the environment
  variables of `ENV_ALLOWED` (spec.env and, resolved, envFrom ConfigMaps).
- Security contexts: no broader than the Pod Security level the chart sets (`Policy.level`,
  "restricted" by default): the Kubernetes Pod Security Standards' rules
  (https://kubernetes.io/docs/concepts/security/pod-security-standards/), plus no privilege
  escalation at any level.
- Device access (issue 21): only the vllm container reaches a GPU, through vllmfit's binding.
- The model's config: not trusted for a catalog model (`model_config_problem`).

ConfigMaps and Secrets named by the vllm container's envFrom are not in the spec: the shells read
what they can (`sources_needed`) and pass the keys in (`Sources`); a source that could not be read
(every Secret: the operator has no right to read them) is refused.
"""

from __future__ import annotations

import posixpath
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllmfit.core import defaults, limits
from vllmfit.core.spec import api, extraargs, names
from vllmfit.core.spec.environment import (  # noqa: F401 - re-exported: the one validator's tables
    BINDING_ENV,
    CACHE_ENV,
    CDI_ANNOTATION_PREFIX,
    DEVICE_ENV,
    ENV_ALLOWED,
    ENV_CODE,
    FORCED_ENV,
    HF_ENDPOINT,
    VOID,
    env_name_problem,
    is_device_env,
    is_gpu_resource,
)
from vllmfit.core.spec.podsecurity import APPARMOR_ANNOTATION, Level, security_context_problems

Sources = Mapping[tuple[str, str], Mapping[str, str] | frozenset[str] | None]
"""(kind, name) -> the data of that ConfigMap (kind "ConfigMap") in the deployment's namespace (or
only its keys); None or absent: it could not be read (every Secret). The values read are the values
the pod gets (vllmfit.core.spec.read.with_env_copied)."""


@dataclass(frozen=True)
class Policy:
    """What the cluster's admin lets a podTemplate reach (chart values `tenants.*`, operator
    flags --pod-security-level, --allow-host-path, --allow-csi-driver)."""

    level: Level = "restricted"
    host_paths: tuple[str, ...] = ()  # a hostPath volume must be one of these or under one
    csi_drivers: tuple[str, ...] = ()  # inline CSI volumes of these drivers
    hf_endpoints: tuple[str, ...] = ()  # Hugging Face mirrors spec.env's HF_ENDPOINT may name
    max_logprobs: int = limits.MAX_LOGPROBS_DEFAULT  # the largest --max-logprobs (vLLM's default)


DEFAULT_POLICY = Policy()

CONTAINER = "vllm"
SHM_VOLUME = "dshm"
MPS_PIPE_VOLUME = "nvidia-mps-pipe"
MPS_LOG_VOLUME = "nvidia-mps-log"
RESERVED_VOLUMES = (SHM_VOLUME, MPS_PIPE_VOLUME, MPS_LOG_VOLUME)
"""Volume names vllmfit's generated pods use (/dev/shm, the optional MPS binding's directories)."""
PREFIX = "podTemplate.spec"

# --- What vllmfit owns ---------------------------------------------------------------------------

# PodSpec fields vllmfit sets -> what to use instead (None: nothing; vllmfit's GPU binding owns it).
OWNED_POD_FIELDS: dict[str, str | None] = {
    "nodeName": "spec.placement.nodeName",
    "nodeSelector": "spec.placement.nodeSelector (or a required nodeAffinity in podTemplate.spec.affinity)",
    "runtimeClassName": None,
    "resourceClaims": None,
    "schedulingGates": None,  # the reservation gate the operator lifts (backends/reservation.py)
}
# Fields of the vllm container vllmfit sets -> what to use instead.
OWNED_CONTAINER_FIELDS: dict[str, str | None] = {
    "image": "spec.image",
    "command": "spec.extraArgs",
    "args": "spec.extraArgs (the computed flags have their own spec fields)",
    "env": "spec.env",
    "resources": "spec.resources",
    "ports": None,
}
APPENDED_POD_LISTS = ("tolerations", "volumes", "imagePullSecrets", "initContainers", "containers", "schedulingGates")
OWNED_LABELS = ("app.kubernetes.io/name", "app.kubernetes.io/instance", defaults.MANAGED_BY_LABEL)

# --- The allow-lists -----------------------------------------------------------------------------

POD_FIELDS = frozenset({
    "affinity", "tolerations", "volumes", "imagePullSecrets", "initContainers", "containers", "serviceAccountName",
    "serviceAccount", "automountServiceAccountToken", "priorityClassName", "priority", "preemptionPolicy",
    "securityContext", "dnsConfig", "dnsPolicy", "hostAliases", "topologySpreadConstraints",
    "terminationGracePeriodSeconds", "readinessGates", "enableServiceLinks", "setHostnameAsFQDN", "hostname",
    "subdomain", "hostUsers", "os", "restartPolicy"})
"""PodSpec fields a podTemplate may set (besides the owned ones, refused with what to use)."""
HOST_POD_FIELDS = ("hostNetwork", "hostPID", "hostIPC", "shareProcessNamespace")
CONTAINER_FIELDS = frozenset({
    "name", "image", "command", "args", "workingDir", "ports", "env", "envFrom", "resources", "volumeMounts",
    "volumeDevices", "livenessProbe", "readinessProbe", "startupProbe", "lifecycle", "terminationMessagePath",
    "terminationMessagePolicy", "imagePullPolicy", "securityContext", "stdin", "stdinOnce", "tty", "restartPolicy",
    "resizePolicy"})
"""Fields of the tenant's own containers and init containers."""
VLLM_FIELDS = frozenset({
    "name", "volumeMounts", "securityContext", "imagePullPolicy", "startupProbe", "readinessProbe", "livenessProbe",
    "envFrom", "terminationMessagePath", "terminationMessagePolicy", "resizePolicy"})
"""Fields a podTemplate may set on the vllm container (merged into vLLM's own)."""
PROBE_TIMING = frozenset({"initialDelaySeconds", "periodSeconds", "timeoutSeconds", "successThreshold",
                          "failureThreshold", "terminationGracePeriodSeconds"})
VOLUME_TYPES = frozenset({"configMap", "secret", "emptyDir", "persistentVolumeClaim", "projected", "downwardAPI",
                          "ephemeral", "image"})
"""Volume sources a podTemplate may use; csi and hostPath only as the Policy allows."""
RESTRICTED_VOLUME_TYPES = frozenset({"configMap", "secret", "emptyDir", "persistentVolumeClaim", "projected",
                                     "downwardAPI", "ephemeral", "csi"})
"""The volume types of the restricted Pod Security level."""
CODE_PATHS = ("/usr", "/lib", "/lib32", "/lib64", "/bin", "/sbin", "/opt", "/etc", "/vllm-workspace", "/app", "/proc",
              "/sys", "/dev")
"""Where the vLLM image keeps its interpreter, libraries and code (the official image: /usr/local and
/opt/venv; /vllm-workspace), and the kernel's: no volume may be mounted at, under or over them in
the vllm container."""

# --- Small rules -------------------------------------------------------------------------------------


def normpath(path: Any) -> str | None:
    """An absolute path with `..`, `.` and repeated slashes resolved (None: not a path)."""
    if not isinstance(path, str) or not path.strip():
        return None
    return posixpath.normpath("/" + path.strip().lstrip("/")).replace("//", "/")


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def host_path_allowed(path: Any, policy: Policy) -> bool:
    """A hostPath is allowed only at or under a path the admin named (never "/")."""
    p = normpath(path)
    return p is not None and p != "/" and any(_under(p, a) for a in (normpath(x) for x in policy.host_paths) if a)


def _use(field: str, use: str | None, why: str = "vllmfit's GPU binding sets it") -> str:
    return f"{field} is set by vllmfit; use {use} instead" if use else f"{field} is set by vllmfit ({why}); remove it"


def _name(c: Mapping[str, Any], i: int) -> str:
    return c["name"] if isinstance(c.get("name"), str) else str(i)


# --- Volumes ---------------------------------------------------------------------------------------


def volume_problems(v: Any, i: int, policy: Policy) -> list[str]:
    if not isinstance(v, Mapping):
        return [f"{PREFIX}.volumes[{i}] must be an object"]
    name = _name(v, i)
    where = f"{PREFIX}.volumes[{name}]"
    if name == SHM_VOLUME:
        return [f"{where}: the name {SHM_VOLUME} is vllmfit's /dev/shm volume; use another name"]
    if name in RESERVED_VOLUMES:
        return [f"{where}: the name {name} is one of vllmfit's volumes; use another name"]
    kinds = [k for k in v if k != "name"]
    if len(kinds) != 1:
        return [f"{where} must have exactly one volume source (got {', '.join(sorted(kinds)) or 'none'})"]
    kind = kinds[0]
    src = v[kind]
    if kind == "hostPath":
        path = src.get("path") if isinstance(src, Mapping) else None
        if not host_path_allowed(path, policy):
            allowed = ", ".join(policy.host_paths) or "none"
            return [(f"{where}.hostPath.path {str(path)[:80]!r}: host paths reach the node (its devices, the "
                    f"container runtime, the GPUs); only paths the admin allows may be mounted (allowed: {allowed}); "
                    "remove it")]
        return []
    if kind == "csi":
        driver = src.get("driver") if isinstance(src, Mapping) else None
        if driver not in policy.csi_drivers:
            return [(f"{where}.csi.driver {str(driver)[:80]!r}: only CSI drivers the admin allows "
                    f"({', '.join(policy.csi_drivers) or 'none'}); remove it")]
        return []
    if kind not in VOLUME_TYPES:
        return [(f"{where}.{kind}: not a volume type a podTemplate may use (allowed: {', '.join(sorted(VOLUME_TYPES))}"
                ", and csi/hostPath where the admin allows); remove it")]
    if policy.level == "restricted" and kind not in RESTRICTED_VOLUME_TYPES:
        return [f"{where}.{kind}: not a volume type of the restricted Pod Security level; remove it"]
    if kind == "emptyDir" and not (isinstance(src, Mapping) and src.get("sizeLimit")):
        return [f"{where}.emptyDir.sizeLimit is required (an unbounded emptyDir fills the node's disk or memory)"]
    return []


# --- Containers ------------------------------------------------------------------------------------


def _device_problems(c: Mapping[str, Any], where: str) -> list[str]:
    out = []
    for e in c.get("env") or []:
        if isinstance(e, Mapping) and is_device_env(e.get("name")):
            out.append(f"{where}.env[{e['name']}]: only the {CONTAINER} container may see GPUs (vllmfit "
                       f"sets {VOID} here); remove it")
    resources = c.get("resources")
    if isinstance(resources, Mapping):
        for part in ("limits", "requests"):
            values = resources.get(part)
            for r in sorted(values) if isinstance(values, Mapping) else ():
                if is_gpu_resource(r):
                    out.append(_use(f"{where}.resources.{part}[{r}]", None,
                                    f"only the {CONTAINER} container gets GPUs, through its binding"))
        if resources.get("claims"):
            out.append(_use(f"{where}.resources.claims", None))
    return out


def _host_ports(c: Mapping[str, Any], where: str) -> list[str]:
    return [f"{where}.ports[{p.get('name') or i}].hostPort: host ports are not allowed; remove it"
            for i, p in enumerate(c.get("ports") or []) if isinstance(p, Mapping) and p.get("hostPort")]


def container_problems(c: Mapping[str, Any], where: str, policy: Policy, *, init: bool) -> list[str]:
    """A tenant's own container or init container."""
    out = [f"{where}.{k}: not a container field a podTemplate may set; remove it" for k in sorted(c)
           if k not in CONTAINER_FIELDS]
    out += security_context_problems(c.get("securityContext"), f"{where}.securityContext", policy.level, pod=False)
    out += _device_problems(c, where) + _host_ports(c, where)
    if c.get("restartPolicy") not in (None, "Always") or (c.get("restartPolicy") and not init):
        out.append(f"{where}.restartPolicy: only Always, on an init container (a native sidecar)")
    return out


def vllm_container_problems(c: Mapping[str, Any], where: str, policy: Policy, sources: Sources) -> list[str]:
    """The podTemplate's `vllm` container: what may be merged into the container vllmfit runs."""
    out = []
    for k in sorted(c):
        if k in OWNED_CONTAINER_FIELDS:
            out.append(_use(f"{where}.{k}", OWNED_CONTAINER_FIELDS[k], "the Service and probes use port 8000"))
        elif k == "lifecycle":
            out.append(f"{where}.lifecycle: hooks run code in the container vllmfit sized, where it can take GPU "
                       "memory nothing books; put them on a sidecar")
        elif k == "workingDir":
            out.append(f"{where}.workingDir: the vllm container runs from the image's directory; remove it")
        elif k not in VLLM_FIELDS:
            out.append(f"{where}.{k}: not a field a podTemplate may set on the {CONTAINER} container (allowed: "
                       f"{', '.join(sorted(VLLM_FIELDS - {'name'}))}); remove it")
    out += security_context_problems(c.get("securityContext"), f"{where}.securityContext", policy.level, pod=False)
    for i, m in enumerate(c.get("volumeMounts") or []):
        path = normpath(m.get("mountPath")) if isinstance(m, Mapping) else None
        if path == "/dev/shm":
            out.append(f"{where}.volumeMounts: /dev/shm is vllmfit's memory-backed mount (NCCL needs it); remove it")
        elif path is None or path == "/" or any(_under(path, r) or _under(r, path) for r in CODE_PATHS):
            out.append(f"{where}.volumeMounts[{m.get('name', i) if isinstance(m, Mapping) else i}].mountPath "
                       f"{str(path)[:80]!r}: would cover the image's interpreter, libraries or code "
                       f"({', '.join(CODE_PATHS)}); mount it elsewhere")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        if probe not in c:
            continue
        if not isinstance(c[probe], Mapping):
            out.append(f"{where}.{probe} must be an object")
            continue
        out += [f"{where}.{probe}.{k}: the {CONTAINER} container's probes are vllmfit's (GET /health); only their "
                f"timing ({', '.join(sorted(PROBE_TIMING))}) may be set" for k in sorted(c[probe]) if k not in PROBE_TIMING]
    out += env_from_problems(c.get("envFrom"), f"{where}.envFrom", sources, policy)
    return out


def env_problem(name: Any, value: Any, policy: Policy) -> str | None:
    """Why the vllm container may not have env `name` = `value` (None: it may): the name's rule
    (`env_name_problem`), save a Hugging Face mirror the admin allows, given as a plain value."""
    if name == HF_ENDPOINT and isinstance(value, str) and value.strip().rstrip("/") in {
            e.strip().rstrip("/") for e in policy.hf_endpoints}:
        return None
    return env_name_problem(name)


def env_from_problems(env_from: Any, where: str, sources: Sources, policy: Policy = DEFAULT_POLICY) -> list[str]:
    """The vllm container's envFrom: every variable it brings must pass `env_name_problem`,
    whichever kind of object it comes from; an object that could not be read is refused."""
    out = []
    for i, src in enumerate(env_from or []):
        if not isinstance(src, Mapping):
            out.append(f"{where}[{i}] must be an object")
            continue
        prefix = src.get("prefix") or ""
        for field, kind in (("configMapRef", "ConfigMap"), ("secretRef", "Secret")):
            ref = src.get(field)
            if not isinstance(ref, Mapping):
                continue
            name = str(ref.get("name"))
            keys = sources.get((kind, name))
            if keys is None:
                why = ("vllmfit does not read Secrets; use spec.env with valueFrom.secretKeyRef for each variable"
                       if kind == "Secret" else "it could not be read to check the variables it sets")
                out.append(f"{where}[{field} {name}]: {kind} {name}: {why}")
                continue
            for key in sorted(keys):
                value = keys.get(key) if isinstance(keys, Mapping) else None
                if (p := env_problem(prefix + key, value, policy)) is not None:
                    out.append(f"{where}[{field} {name}] {prefix + key}: {p}")
    return out


def sources_needed(spec: api.VLLMDeploymentSpec) -> list[tuple[str, str]]:
    """The (kind, name) of every ConfigMap and Secret the vllm container's envFrom names, in order."""
    pod = (spec.pod_template.spec if spec.pod_template else None) or {}
    out: list[tuple[str, str]] = []
    for c in pod.get("containers") or [] if isinstance(pod, Mapping) else []:
        if not isinstance(c, Mapping) or c.get("name") != CONTAINER:
            continue
        for src in c.get("envFrom") or []:
            for field, kind in (("configMapRef", "ConfigMap"), ("secretRef", "Secret")):
                ref = src.get(field) if isinstance(src, Mapping) else None
                if isinstance(ref, Mapping) and (kind, str(ref.get("name"))) not in out:
                    out.append((kind, str(ref.get("name"))))
    return out


# --- The spec ----------------------------------------------------------------------------------------


def model_config_problem(spec: api.VLLMDeploymentSpec, catalog_model: bool) -> str | None:
    """Inline `modelConfig` (or `modelConfigRef`) is not trusted for a model vllmfit knows
    (`catalog_model`; issue 21 item 4): vLLM loads the real config of a catalog model, so a smaller
    config written by a tenant would only make vllmfit book less than the server takes, next to
    other tenants' servers. For a model vllmfit does not know (a private repository, a local path)
    the spec's config is all it has, and it is used (docs/webhook.md, "What vllmfit believes")."""
    if (spec.model_config_inline is None and spec.model_config_ref is None) or not catalog_model:
        return None
    field = "spec.modelConfig" if spec.model_config_inline is not None else "spec.modelConfigRef"
    return (f"{field}: {spec.model} is in vllmfit's catalog, whose config is what vLLM loads; remove {field} "
            "(a config that differs from the real one would book the wrong memory)")


def problems(obj: api.VLLMDeployment, *, catalog_model: bool, policy: Policy = DEFAULT_POLICY,
             sources: Sources | None = None, named: bool = True) -> list[str]:
    """Every reason `obj` may not run, one line each naming the field. `catalog_model`: whether
    vllmfit's catalog knows spec.model; `sources`: the keys of the ConfigMaps/Secrets of
    `sources_needed`; `named=False`: a CREATE with generateName (the API server makes the name).
    extraArgs are checked when the spec is parsed (vllmfit.core.spec.extraargs)."""
    out = [p for p in [names.deployment_name_problem(obj.metadata.name) if named else None] if p]
    return out + spec_problems(obj.spec, catalog_model=catalog_model, policy=policy, sources=sources or {})


def spec_problems(spec: api.VLLMDeploymentSpec, *, catalog_model: bool, policy: Policy = DEFAULT_POLICY,
                  sources: Sources | None = None) -> list[str]:
    out = [p for p in [model_config_problem(spec, catalog_model)] if p]
    for e in spec.env:
        if (p := env_problem(e.get("name"), e.get("value"), policy)) is not None:
            out.append(f"spec.env {e.get('name')} {p}" if e.get("name") else f"spec.env: {p}")
    for part, values in sorted((spec.resources or {}).items()):
        if isinstance(values, Mapping):
            out += [f"spec.resources.{part}[{r}]: GPUs are given by vllmfit's binding (the GPUs it booked); remove it"
                    for r in sorted(values) if is_gpu_resource(r) and r != defaults.GPU_RESOURCE]
    out += logprobs_problems(spec.extra_args, policy)
    tpl = spec.pod_template
    if tpl is None:
        return out
    return out + pod_template_problems(tpl, policy, sources or {})


def logprobs_problems(args: Any, policy: Policy) -> list[str]:
    """--max-logprobs within 0..the admin's bound (vLLM's default, 20, unless raised): -1 asks for the
    whole vocabulary per token, memory that grows with what a request asks for and nothing books."""
    out = []
    for head, value in extraargs.values_of(args, "--max-logprobs"):
        try:
            n = int(value.strip())
        except ValueError:
            n = -2
        if not 0 <= n <= policy.max_logprobs:
            out.append(f"extraArgs {head} {value.strip()[:20]!r}: at most {policy.max_logprobs} top logprobs per "
                       "token (-1, the whole vocabulary, is never allowed; the admin raises the bound with "
                       "--allow-max-logprobs); the logprobs a request asks for take GPU memory nothing books")
    return out


def pod_template_problems(tpl: api.PodTemplate, policy: Policy, sources: Sources) -> list[str]:
    out = []
    meta = tpl.metadata or api.PodTemplateMetadata()
    for kind, values in (("labels", meta.labels), ("annotations", meta.annotations)):
        for key in sorted(values or {}):
            if key.startswith(f"{api.GROUP}/") or (kind == "labels" and key in OWNED_LABELS):
                out.append(_use(f"podTemplate.metadata.{kind}[{key}]", None, "the operator and the Service select by it"
                                if kind == "labels" else "it records the placement"))
            elif kind == "annotations" and key.startswith(CDI_ANNOTATION_PREFIX):
                out.append(f"podTemplate.metadata.annotations[{key}]: CDI annotations inject devices into containers; "
                           "only vllmfit's GPU binding may; remove it")
            elif kind == "annotations" and key.startswith(APPARMOR_ANNOTATION) and values and not (
                    values[key] == "runtime/default" or str(values[key]).startswith("localhost/")):
                out.append(f"podTemplate.metadata.annotations[{key}]: only runtime/default or localhost/ AppArmor "
                           "profiles; remove it")
    pod = tpl.spec or {}
    for field in sorted(pod):
        if field in OWNED_POD_FIELDS:
            out.append(_use(f"{PREFIX}.{field}", OWNED_POD_FIELDS[field]))
        elif field in HOST_POD_FIELDS:
            if pod[field] is True:
                out.append(f"{PREFIX}.{field}: true lets a container reach the GPU processes of other containers or "
                           "the host; remove it")
        elif field not in POD_FIELDS:
            out.append(f"{PREFIX}.{field}: not a pod field a podTemplate may set; remove it")
    for field in APPENDED_POD_LISTS:
        if field in pod and not isinstance(pod[field], list):
            out.append(f"{PREFIX}.{field} must be a list")
    if out:
        return out
    if pod.get("restartPolicy") not in (None, "Always"):
        out.append(f"{PREFIX}.restartPolicy: a Deployment's pods restart Always; remove it")
    out += security_context_problems(pod.get("securityContext"), f"{PREFIX}.securityContext", policy.level, pod=True)
    for i, v in enumerate(pod.get("volumes") or []):
        out += volume_problems(v, i, policy)
    for field in ("initContainers", "containers"):
        for i, c in enumerate(pod.get(field) or []):
            if not isinstance(c, Mapping) or not isinstance(c.get("name"), str):
                out.append(f"{PREFIX}.{field}[{i}] must be a container with a name")
                continue
            where = f"{PREFIX}.{field}[{c['name']}]"
            if field == "containers" and c["name"] == CONTAINER:
                out += vllm_container_problems(c, where, policy, sources)
            else:
                out += container_problems(c, where, policy, init=field == "initContainers")
    return out
