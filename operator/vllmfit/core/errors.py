"""Errors every layer may raise for bad input. The shells turn them into one line: the CLI prints
`vllmfit: error: ...` and exits 2, the webhook denies, the operator sets a condition."""


class UserError(Exception):
    """Bad input: printed as one line, exit code 2."""
