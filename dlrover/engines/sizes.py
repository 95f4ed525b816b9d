"""Sizes as users write them (``4Gi``, ``cpu=8,memory=32Gi``), parsed for specs and engine settings."""

from __future__ import annotations

import re

from dlrover.engines.base import Capacity

_MEMORY_UNITS = {
    "": 1 / (1024 * 1024),
    "ki": 1 / 1024,
    "mi": 1,
    "gi": 1024,
    "ti": 1024 * 1024,
    "k": 1000 / (1024 * 1024),
    "m": 1e6 / (1024 * 1024),
    "g": 1e9 / (1024 * 1024),
}
_MEMORY = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]{0,2})\s*$")


class SizeError(ValueError):
    """A size that cannot be read; the message names the field and how to write it."""


def parse_memory_mib(value: str | int | float, field: str = "memory") -> int:
    """'4Gi' -> 4096, '512Mi' -> 512, 2048 (a number is MiB) -> 2048. Refuses negatives."""
    if isinstance(value, bool):
        raise SizeError(f"resources.{field} must be a size like 4Gi or 512Mi, not {value!r}")
    if isinstance(value, (int, float)):
        mib = float(value)
    else:
        text = str(value)
        if text.strip().startswith("-"):
            raise SizeError(f"resources.{field} is {text}; it must be >= 0")
        match = _MEMORY.match(text)
        unit = match.group(2).lower() if match else ""
        if match is None or unit not in _MEMORY_UNITS:
            raise SizeError(
                f"resources.{field} {text!r} is not a size; use e.g. 4Gi, 512Mi or a number of MiB"
            )
        mib = float(match.group(1)) * _MEMORY_UNITS[unit]
    if mib < 0:
        raise SizeError(f"resources.{field} is {value}; it must be >= 0")
    return int(round(mib))


def parse_capacity(text: str) -> Capacity:
    """``cpu=8,memory=32Gi`` (either part may be left out) as a Capacity."""
    cpu: float | None = None
    memory: int | None = None
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, _, value = part.partition("=")
        if key == "cpu":
            try:
                cpu = float(value)
            except ValueError:
                raise SizeError(f"capacity cpu={value!r} is not a number") from None
            if cpu < 0:
                raise SizeError(f"capacity cpu={value} must be >= 0")
        elif key == "memory":
            memory = parse_memory_mib(value, "capacity memory")
        else:
            raise SizeError(f"capacity {part!r}: use cpu=N,memory=SIZE, e.g. cpu=8,memory=32Gi")
    return Capacity(cpu, memory)
