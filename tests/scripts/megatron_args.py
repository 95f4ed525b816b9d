"""Megatron-LM's ``megatron.training`` stood in for (it is not on PyPI): a module whose
``get_args()`` returns the namespace given, installed before DLRover's Megatron drop-ins import
it. Shared by the Megatron-LM style test scripts."""

from __future__ import annotations

import argparse
import importlib.util
import sys
import types
from typing import Any


def stand_in_megatron_training(**arguments: Any) -> argparse.Namespace:
    """Install ``megatron.training`` with ``get_args()`` returning these arguments; returns
    them (the script sets ``save``, ``load`` and the rest on it as Megatron-LM would)."""
    args = argparse.Namespace(**arguments)
    training = types.ModuleType("megatron.training")
    training.get_args = lambda: args  # type: ignore[attr-defined]
    if importlib.util.find_spec("megatron") is None:
        sys.modules["megatron"] = types.ModuleType("megatron")
    sys.modules["megatron.training"] = training
    return args
