"""What a failure was, in one line: the innermost cause of an exception chain.

Wrappers such as Hydra's ``InstantiationException`` ("Error in call to target '...':") hide the
exception the user can act on (``FileNotFoundError: pretrained/backbone.pt``); the launcher,
``summary.json`` and :class:`RunFailed` report the root instead, and the full traceback stays in
the rank's log.
"""

from __future__ import annotations

import errno


def root_cause(exc: BaseException) -> BaseException:
    """The innermost exception of ``exc``'s explicit chain (``raise Wrapper(...) from cause``).

    Only ``__cause__`` is followed: an exception raised *while handling* another (implicit
    context) is usually a different failure, and its own message is the one to report.
    """
    seen = {id(exc)}
    while exc.__cause__ is not None and id(exc.__cause__) not in seen:
        exc = exc.__cause__
        seen.add(id(exc))
    return exc


def describe(exc: BaseException) -> str:
    """``Type: message`` of the root cause, on one line (its first non-empty line)."""
    root = root_cause(exc)
    lines = [line.strip() for line in str(root).splitlines() if line.strip()]
    return f"{type(root).__name__}: {lines[0]}" if lines else type(root).__name__


_FULL = (errno.ENOSPC, errno.EDQUOT)


def disk_full(exc: BaseException) -> bool:
    """``exc`` (or its chain) is a write that found no space: ENOSPC or a quota."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in _FULL:
            return True
        current = current.__cause__ or current.__context__
    return False


def write_failure(exc: BaseException, path: object) -> str:
    """One line for a failed write of ``path``: "no space left on <path>" for a full disk or
    quota, else the error itself with the path."""
    if disk_full(exc):
        return f"no space left on {path}"
    return f"writing {path} failed: {describe(exc)}"
