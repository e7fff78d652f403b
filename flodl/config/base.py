"""The config error and the base every schema model shares (frozen, unknown keys refused)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """A user configuration error: names the key, the value and what is allowed (exit code 2)."""

    exit_code = 2


def did_you_mean(key: str, known: Iterable[str], prefix: str = "") -> str:
    """`` (did you mean <prefix><closest>?)`` for a misspelt key, else ``""``: the one suggestion
    the command line, the YAML files and the Python API's keyword arguments all give."""
    close = difflib.get_close_matches(key, list(known), n=1)
    return f" (did you mean {prefix}{close[0]}?)" if close else ""


def schema_keys(model: type[BaseModel]) -> list[str]:
    """The keys a schema model accepts (field names, and their aliases)."""
    keys = list(model.model_fields)
    keys += [f.alias for f in model.model_fields.values() if f.alias]
    return keys


class UnknownKey(ConfigError):
    """A keyword a schema model does not have. Raised by the model's ``__init__``: one line for a
    direct call (``TrainerConfig(chekpoint_every=1)``); inside a whole config's validation
    (pydantic calls the custom ``__init__`` of nested models too) :func:`flodl.config.explain`
    rewrites it with the key's full path."""

    def __init__(self, model: str, key: str, known: list[str]) -> None:
        self.model, self.key, self.known = model, key, known
        hint = did_you_mean(key, known)
        allowed = "" if hint else f"; allowed: {', '.join(sorted(known))}"
        super().__init__(f"{model}({key}=...): unknown key{hint}{allowed}")


class _Schema(BaseModel):
    # allow_inf_nan=False: no knob means anything at NaN or inf (issue 41: start_timeout_s=inf
    # crashed every rank, elche.gamma=nan was reported as "should be <= 4").
    model_config = ConfigDict(
        frozen=True, extra="forbid", validate_default=True, allow_inf_nan=False
    )

    def __init__(self, /, **data: Any) -> None:
        # An unknown keyword (TrainerConfig(chekpoint_every=1)) is a ConfigError in one line with
        # the likely key, as on the command line, not pydantic's raw extra_forbidden.
        if type(self).model_config.get("extra") == "forbid":
            known = schema_keys(type(self))
            unknown = [k for k in data if k not in known]
            if unknown:
                raise UnknownKey(type(self).__name__, str(unknown[0]), known)
        super().__init__(**data)
