"""The pure core: every decision vllmfit makes, as data. No I/O, no Kubernetes, Kopf, NVML or HTTP
library (import-linter checks it). The shells (CLI, operator, agent, placement backends) call
these same functions, so they never disagree.

The ground floor, imported by everything above it:
  defaults     every default, named once
  limits       every physical bound on outside input, named once
  errors       bad-input errors every layer may raise
  quantity     Kubernetes quantities (`20Gi`) as integer bytes

The rooms, each a package (an upper one may import a lower one, never the reverse):
  placement/   the per-GPU ledger, the search, reasons, fixes, re-planning, the plan JSON contract
  memory/      what one deployment needs on each GPU (weights, KV, activation, overhead, versions)
  model/       the model facts: config.json read as vLLM reads it -> ModelArch, GpuType, hybrid layers
  spec/        the VLLMDeployment API: spec, parts, status, extraArgs, names (crds/ comes from here)
  observe/     what the node agent measured (the inventory) and whose it is (attribution)
"""
