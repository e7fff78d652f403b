"""Whose fault a rank's exception is (flodl/runtime/rank/blame.py), without processes."""

from __future__ import annotations

import pytest
import torch

from flodl.runtime.rank import blame
from flodl.runtime.rank.process import failure_message


def _raised(fn, hook: str | None = "train_step") -> BaseException:
    try:
        if hook is None:
            fn()
        else:
            with blame.user_code(hook):
                fn()
    except Exception as exc:
        return exc
    raise AssertionError("nothing raised")


def users_step() -> None:
    raise ValueError("bad shapes")


def test_the_users_exception_is_blamed_on_the_user_with_its_frame():
    exc = _raised(users_step)
    kind, where = blame.classify(exc)
    assert kind == blame.USER
    assert where.startswith("tests/unit/test_blame.py:") and where.endswith(" in users_step")
    message, kind = failure_message(exc)
    assert kind == "user" and message.startswith("ValueError: bad shapes (at tests/unit/")


def test_the_last_frame_outside_libraries_is_the_users_own():
    """An error raised inside torch, called from the user's step, points at the user's line."""

    def step() -> None:
        torch.nn.functional.linear(torch.ones(2, 3), torch.ones(4, 5))

    kind, where = blame.classify(_raised(step))
    assert kind == blame.USER and " in step" in where and "torch" not in where


def test_anything_not_raised_in_user_code_is_a_membership_event():
    assert blame.classify(_raised(users_step, hook=None)) == ("", "")
    assert failure_message(_raised(users_step, hook=None)) == ("ValueError: bad shapes", "")


@pytest.mark.parametrize(
    "exc",
    [
        torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        RuntimeError("DataLoader worker (pid 123) is killed by signal: Killed."),
    ],
)
def test_device_failures_inside_user_code_stay_membership_events(exc):
    def step() -> None:
        raise exc

    assert blame.classify(_raised(step))[0] == ""


def test_non_finite_errors_are_the_policys():
    exc = blame.NonFiniteError("the weights of rank 1 are NaN/inf")
    assert blame.classify(exc) == (blame.NONFINITE, "")
    wrapped = _raised(lambda: (_ for _ in ()).throw(RuntimeError("x")), hook=None)
    wrapped.__cause__ = exc
    assert blame.classify(wrapped)[0] == blame.NONFINITE
