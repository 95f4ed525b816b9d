"""Reading settings from environment variables, with errors that name the variable."""

from __future__ import annotations

import os
from collections.abc import Mapping


def number_from_env(
    name: str, default: float, what: str, env: Mapping[str, str] | None = None
) -> float:
    """The number >= 0 in the environment variable ``name`` (unset or blank: ``default``).
    Raises ValueError naming the variable and ``what`` to give (e.g. "a number of seconds")."""
    raw = (os.environ if env is None else env).get(name, "")
    if not raw.strip():
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:  # also refuses nan
        raise ValueError(f"{name}={raw!r}: give {what}")
    return value
