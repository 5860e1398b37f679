"""vllmfit: per-GPU memory admission and placement for vLLM on Kubernetes.

The pure core is `vllmfit.core.memory` (what one deployment needs per GPU) and
`vllmfit.core.placement` (the ledger, fit checks and placement search). Everything else
(`vllmfit.cli`, `vllmfit.operator`, `vllmfit.agent`) is a thin shell around it.
"""

__version__ = "0.1.0"
