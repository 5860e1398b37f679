"""What the node agent measured, and whose it is.

  inventory    the node inventory annotation the agent writes (versioned, forward-compatible)
  attribution  the measured GPU use split between vllmfit deployments and foreign processes; drift

Imports only the ground floor of the core (defaults, limits, errors, quantity)."""
