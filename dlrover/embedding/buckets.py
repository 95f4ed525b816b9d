"""Virtual buckets: every id hashes to one of a fixed number of buckets, and a versioned map
says which embedding server owns each bucket. Changing the server set moves whole buckets, the
fewest that even out the load; ids never need re-hashing."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

DEFAULT_NUM_BUCKETS = 1024

IdArray = npt.NDArray[np.int64]
BucketArray = npt.NDArray[np.int64]

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def mix64(values: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """A 64-bit mixing hash of each value (splitmix64's finaliser): equal inputs, equal outputs,
    on every machine; neighbouring ids land far apart."""
    with np.errstate(over="ignore"):
        z = values + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        return z ^ (z >> np.uint64(31))


def bucket_of(ids: IdArray, num_buckets: int = DEFAULT_NUM_BUCKETS) -> BucketArray:
    """The bucket of each id (int64 array in, int64 array out; no Python loop)."""
    hashed = mix64(np.asarray(ids, dtype=np.int64).view(np.uint64))
    return (hashed % np.uint64(num_buckets)).astype(np.int64)


@dataclass(frozen=True)
class BucketMap:
    """Owner (server index) of every bucket, at a version the master increments on each change."""

    version: int
    owners: tuple[int, ...]

    @classmethod
    def even(cls, num_servers: int, num_buckets: int = DEFAULT_NUM_BUCKETS) -> BucketMap:
        """Version 1: bucket b on server b % num_servers."""
        if num_servers < 1 or num_buckets < num_servers:
            raise ValueError(
                f"need 1 <= servers <= buckets, got {num_servers} servers, {num_buckets} buckets"
            )
        return cls(1, tuple(b % num_servers for b in range(num_buckets)))

    @property
    def num_buckets(self) -> int:
        """How many buckets ids hash into."""
        return len(self.owners)

    @property
    def num_servers(self) -> int:
        """Servers that own at least one bucket (they are numbered 0 .. num_servers - 1)."""
        return max(self.owners) + 1

    def owner_of(self, ids: IdArray) -> npt.NDArray[np.int64]:
        """The server of each id."""
        return np.asarray(self.owners, dtype=np.int64)[bucket_of(ids, self.num_buckets)]

    def resized(self, num_servers: int) -> BucketMap:
        """The next version over ``num_servers`` servers, moving as few buckets as possible: a
        removed server's buckets and the surplus of the fullest servers go to the emptiest."""
        if num_servers < 1 or num_servers > self.num_buckets:
            raise ValueError(f"need 1 .. {self.num_buckets} servers, got {num_servers}")
        owners = list(self.owners)
        base, extra = divmod(self.num_buckets, num_servers)
        # Servers 0 .. extra-1 may hold one bucket more than the others.
        quota = [base + (1 if s < extra else 0) for s in range(num_servers)]
        held: dict[int, list[int]] = {s: [] for s in range(num_servers)}
        loose: list[int] = []
        for bucket, owner in enumerate(owners):
            if owner < num_servers and len(held[owner]) < quota[owner]:
                held[owner].append(bucket)
            else:
                loose.append(bucket)
        for server in range(num_servers):
            while len(held[server]) < quota[server]:
                bucket = loose.pop()
                held[server].append(bucket)
                owners[bucket] = server
        return BucketMap(self.version + 1, tuple(owners))

    def moves(self, newer: BucketMap) -> list[tuple[int, int, int]]:
        """(bucket, from server, to server) for every bucket whose owner differs in ``newer``."""
        return [
            (b, old, new)
            for b, (old, new) in enumerate(zip(self.owners, newer.owners, strict=True))
            if old != new
        ]
