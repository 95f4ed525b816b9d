"""Bit-exact fingerprints of tensors for consistency oracles, without numpy (torch's optional dependency)."""

from __future__ import annotations

import ctypes
import hashlib
from collections.abc import Iterable
from typing import Any


def tensor_bytes(tensor: Any) -> bytes:
    """The raw bytes of a CPU tensor in row-major order (a contiguous copy first when needed)."""
    flat = tensor.detach().cpu().contiguous()
    return ctypes.string_at(flat.data_ptr(), flat.numel() * flat.element_size())


def tensors_digest(tensors: Iterable[Any]) -> str:
    """SHA-256 over the bytes of `tensors` in the given order: equal iff bit-for-bit equal."""
    digest = hashlib.sha256()
    for tensor in tensors:
        digest.update(tensor_bytes(tensor))
    return digest.hexdigest()
