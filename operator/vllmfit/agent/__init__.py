"""The node agent (`vllmfit agent`). Reads every GPU of its node through NVML, maps the GPU
processes to pods through /proc/<pid>/cgroup, and publishes the result as the JSON node
annotation `vllmfit.dev/gpu-inventory` (schema: `vllmfit.core.observe.inventory.GpuInventory`).

It runs as a DaemonSet on GPU nodes (hostPID, runtimeClassName nvidia; see docs/agent.md).
pynvml, kubernetes and rich are imported inside the functions that need them.

  cgroups   /proc/<pid>/cgroup -> pod UID, container ID
  nvml      NVML -> GpuInventory
  publish   GpuInventory -> the node annotation, when it changed
  main      the loop, the health endpoint, the command line
"""
