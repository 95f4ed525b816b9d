"""A StateStore on a Redis server, so that a master started on another machine can take over.

One Redis hash per namespace (`<prefix>:<namespace>`), fields are keys. Durability is the
server's: run it with `appendonly yes` (and `appendfsync always` for the StateStore invariant
that a returned put survives a crash; `everysec` may lose the last second).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any
from urllib.parse import parse_qs, urlsplit

from dlrover.master.store_base import StateStore, StateStoreError

# KEYS[1]: the hash; ARGV: field, expected ("" + flag for absent), value. Atomic on the server.
_COMPARE_AND_SET = """
local current = redis.call('HGET', KEYS[1], ARGV[1])
if ARGV[2] == '1' then
  if current then return 0 end
elseif current ~= ARGV[3] then
  return 0
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[4])
return 1
"""


class RedisStateStore(StateStore):
    """The master's state in Redis: `redis://[:password@]host:port[/db][?prefix=NAME]`.

    `prefix` (default `dlrover`) keeps several jobs apart on one server; give each job its own.
    Thread-safe (the client pools connections). Errors reaching the server are StateStoreError
    naming the URL (without its password).
    """

    def __init__(self, url: str, timeout_s: float = 5.0) -> None:
        try:
            import redis
        except ImportError:
            raise StateStoreError(
                f"--state-db {_safe(url)} needs the redis package: pip install 'dlrover[redis]'"
            ) from None
        parts = urlsplit(url)
        self.prefix = parse_qs(parts.query).get("prefix", ["dlrover"])[0]
        self.url = _safe(url)
        self._errors: tuple[type[BaseException], ...] = (redis.RedisError,)
        self._client: Any = redis.Redis.from_url(
            url.split("?", 1)[0], socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )
        self._cas = self._call(lambda: self._client.register_script(_COMPARE_AND_SET))
        self._call(self._client.ping)

    def __str__(self) -> str:
        return f"{self.url} (prefix {self.prefix})"

    def _key(self, namespace: str) -> str:
        return f"{self.prefix}:{namespace}"

    def _call(self, fn: Any) -> Any:
        try:
            return fn()
        except self._errors as e:
            raise StateStoreError(
                f"the master's state at {self} cannot be reached ({e}); is redis-server running "
                "there, and is the URL of --state-db right?"
            ) from None

    def get(self, namespace: str, key: str) -> bytes | None:
        """The value of ``key`` in ``namespace`` (HGET), or None if absent."""
        value = self._call(lambda: self._client.hget(self._key(namespace), key))
        return None if value is None else bytes(value)

    def put(self, namespace: str, key: str, value: bytes) -> None:
        """HSET the field; as durable as the server's append-only file makes it."""
        self._call(lambda: self._client.hset(self._key(namespace), key, value))

    def put_many(
        self, namespace: str, values: dict[str, bytes], delete: Collection[str] = ()
    ) -> None:
        """One HDEL of the fields of ``delete`` and one HSET of ``values``, in one MULTI/EXEC
        transaction (atomic on the server)."""
        gone = [key for key in delete if key not in values]
        if not values and not gone:
            return

        def write() -> None:
            pipe = self._client.pipeline(transaction=True)
            if gone:
                pipe.hdel(self._key(namespace), *gone)
            if values:
                pipe.hset(self._key(namespace), mapping=values)
            pipe.execute()

        self._call(write)

    def delete(self, namespace: str, key: str) -> None:
        """HDEL the field; an absent one is not an error."""
        self._call(lambda: self._client.hdel(self._key(namespace), key))

    def items(self, namespace: str) -> dict[str, bytes]:
        """Every field of the namespace's hash (HGETALL, one consistent read)."""
        raw = self._call(lambda: self._client.hgetall(self._key(namespace)))
        return {k.decode(): bytes(v) for k, v in raw.items()}

    def compare_and_set(
        self, namespace: str, key: str, expected: bytes | None, value: bytes
    ) -> bool:
        """Write ``value`` only if the field equals ``expected`` (None: absent), in one Lua
        script on the server (atomic against every other client)."""
        args = [key, "1" if expected is None else "0", expected or b"", value]
        return bool(self._call(lambda: self._cas(keys=[self._key(namespace)], args=args)))

    def close(self) -> None:
        """Release the client's connections."""
        self._client.close()


def _safe(url: str) -> str:
    """The URL without a password, for messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return parts._replace(netloc=netloc, query="").geturl()
