"""CRC-32 (zlib's) of a file written in parallel pieces: each writer checksums its own range and
``crc32_combine`` joins the ranges' checksums, so nothing is read twice."""

from __future__ import annotations

from functools import cache

_POLY = 0xEDB88320  # CRC-32, bit-reflected


def _apply(matrix: tuple[int, ...], vector: int) -> int:
    """A 32x32 matrix over GF(2) (one column per input bit) times a 32-bit vector."""
    out, bit = 0, 0
    while vector:
        if vector & 1:
            out ^= matrix[bit]
        vector >>= 1
        bit += 1
    return out


def _square(matrix: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(_apply(matrix, column) for column in matrix)


@cache
def _zero_byte_powers() -> tuple[tuple[int, ...], ...]:
    """M, M^2, M^4, ... where M advances a CRC register over one zero byte."""
    columns = []
    for bit in range(32):
        v = 1 << bit
        for _ in range(8):
            v = (v >> 1) ^ (_POLY if v & 1 else 0)
        columns.append(v)
    powers = [tuple(columns)]
    for _ in range(63):
        powers.append(_square(powers[-1]))
    return tuple(powers)


def crc32_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """``zlib.crc32(a + b)`` from ``zlib.crc32(a)``, ``zlib.crc32(b)`` and ``len(b)``.

    zlib's register update is affine in its input; the pre- and post-inversions cancel, so the
    CRC of the concatenation is ``crc_a`` carried over ``len_b`` zero bytes, xor ``crc_b``.
    """
    if len_b < 0:
        raise ValueError(f"len_b must be >= 0, got {len_b}")
    carried = crc_a
    for power in _zero_byte_powers():
        if not len_b:
            break
        if len_b & 1:
            carried = _apply(power, carried)
        len_b >>= 1
    return carried ^ crc_b
