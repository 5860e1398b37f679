"""Errors every layer may raise for bad input. The shells turn them into one line: the CLI prints
`vllmfit: error: ...` and exits 2, the webhook denies, the operator sets a condition."""


class UserError(Exception):
    """Bad input: printed as one line, exit code 2."""


def one_line(e: BaseException) -> str:
    """An exception as one line for a user: pydantic's first problem with its field path
    (`spec.replicas: Input should be ...`), else the first line of its text, else its type."""
    errs = getattr(e, "errors", None)
    if callable(errs):
        try:
            first = errs()[0]
            loc = ".".join(str(x) for x in first.get("loc", ()))
            return f"{loc}: {first.get('msg', '')}" if loc else str(first.get("msg", ""))
        except (IndexError, TypeError, AttributeError):
            pass
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
