"""Seeded bijections on range(n) that cost O(1) memory, so shard orders need no stored lists."""

import random

_MASK64 = (1 << 64) - 1
_ROUNDS = 4


def mix64(*values: int) -> int:
    """Hash integers into 64 bits (splitmix64 finaliser); the same inputs give the same output."""
    state = 0x9E3779B97F4A7C15
    for value in values:
        state = (state ^ (value & _MASK64)) & _MASK64
        state = (state + 0x9E3779B97F4A7C15) & _MASK64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        state = z ^ (z >> 31)
    return state


def permute(index: int, n: int, seed: int) -> int:
    """Return where `index` goes in a seeded pseudo-random permutation of range(n).

    A balanced Feistel network permutes range(2**bits); walking the cycle until the value
    falls below n restricts that bijection to range(n). Expected walk length is below 4,
    and nothing of size n is ever built, which is what lets 1e8-sample datasets stay small.
    """
    if not 0 <= index < n:
        raise ValueError(f"index {index} is outside range({n})")
    if n <= 2:
        return index if n == 1 or seed % 2 == 0 else 1 - index
    bits = max(2, (n - 1).bit_length())
    bits += bits % 2
    half = bits // 2
    mask = (1 << half) - 1
    value = index
    while True:
        left, right = value >> half, value & mask
        for round_number in range(_ROUNDS):
            left, right = right, left ^ (mix64(seed, round_number, right) & mask)
        value = (left << half) | right
        if value < n:
            return value


def unpermute(value: int, n: int, seed: int) -> int:
    """The inverse of ``permute``: the index that ``permute(index, n, seed)`` sends to ``value``.

    The Feistel rounds run backwards, and the cycle walk with them: the forward walk from the
    index passes only through values >= n before it stops at ``value``, so walking back from
    ``value`` stops at the index.
    """
    if not 0 <= value < n:
        raise ValueError(f"value {value} is outside range({n})")
    if n <= 2:
        return permute(value, n, seed)  # the identity or the swap: its own inverse
    bits = max(2, (n - 1).bit_length())
    bits += bits % 2
    half = bits // 2
    mask = (1 << half) - 1
    current = value
    while True:
        left, right = current >> half, current & mask
        for round_number in reversed(range(_ROUNDS)):
            left, right = right ^ (mix64(seed, round_number, left) & mask), left
        current = (left << half) | right
        if current < n:
            return current


def shuffled_range(length: int, seed: int) -> list[int]:
    """A seeded permutation of range(length), built in full: for the samples of one shard."""
    order = list(range(length))
    random.Random(seed).shuffle(order)
    return order
