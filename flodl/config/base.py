"""The config error and the base every schema model shares (frozen, unknown keys refused)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """A user configuration error: names the key, the value and what is allowed (exit code 2)."""

    exit_code = 2


class _Schema(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)
