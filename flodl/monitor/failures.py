"""What a failure was, in one line: the innermost cause of an exception chain.

Wrappers such as Hydra's ``InstantiationException`` ("Error in call to target '...':") hide the
exception the user can act on (``FileNotFoundError: pretrained/backbone.pt``); the launcher,
``summary.json`` and :class:`RunFailed` report the root instead, and the full traceback stays in
the rank's log.
"""

from __future__ import annotations


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
