"""The config error and the base every schema model shares (frozen, unknown keys refused)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """A user configuration error: names the key, the value and what is allowed (exit code 2)."""

    exit_code = 2


class _Schema(BaseModel):
    # allow_inf_nan=False: no knob means anything at NaN or inf (issue 41: start_timeout_s=inf
    # crashed every rank, elche.gamma=nan was reported as "should be <= 4").
    model_config = ConfigDict(
        frozen=True, extra="forbid", validate_default=True, allow_inf_nan=False
    )
