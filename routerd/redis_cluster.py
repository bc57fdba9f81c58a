"""A Redis Cluster, as routerd uses one (``[redis] cluster = true``): every key it reads or writes is
under one hash tag (:func:`routerd.config_schema.cluster_names`), so all of them live in one slot, on
one master. routerd talks to that master as to a single Redis — its Lua scripts, ``MULTI``, pipelines,
blocking reads and pub/sub as they are — through connections that ask the cluster where the slot is.

Why not redis-py's ``RedisCluster``: its asyncio client has no pub/sub and no ``MULTI``, and routerd
would gain nothing from routing per key when every key is in one slot. What it does give — following
the slot when it moves — is done here: each new connection asks a node (``CLUSTER SLOTS``: the URL's
node first, then every master it has learned of) which master serves the slot; a ``MOVED`` reply points
every connection at the new master and sends the command once more, there (it did not run: a
``MOVED`` reply, like the error of a script whose keys the node no longer serves, comes before
anything is written). A failover is found the same way: the dead master's connections fail as they
would on a single Redis (routerd's loops retry), and the next one asks the cluster again.
"""

from __future__ import annotations

import asyncio
from typing import Any

import redis.exceptions
from redis.asyncio.connection import Connection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.crc import key_slot

from ._aio import timeout
from .redis_faults import WatchedBase, WatchedConnection, WatchedSSLConnection


def tag_slot(stream: str) -> int:
    """The slot of every key of the deployment whose (tagged) request stream is ``stream``."""
    return int(key_slot(stream.encode()))


class SlotMaster:
    """Where the master of ``slot`` is: asked of the cluster's nodes, remembered until it moves."""

    def __init__(self, seed: tuple[str, int], slot: int, connection_class: type[Connection],
                 connect_kwargs: dict[str, Any], timeout_s: float) -> None:
        self.slot = slot
        self.nodes: list[tuple[str, int]] = [seed]  # the URL's node, then the masters learned of
        self._connection_class = connection_class
        self._kwargs = connect_kwargs
        self._timeout_s = timeout_s
        self._address: tuple[str, int] | None = None
        self._lock = asyncio.Lock()
        self.epoch = 0  # one more each time the slot moves: the connections made before it follow

    async def address(self) -> tuple[str, int]:
        if self._address is None:
            async with self._lock:
                if self._address is None:
                    self._address = await self._ask()
        return self._address

    def moved(self, address: tuple[str, int] | None) -> None:
        """The slot moved (to ``address``, if the reply said where): the next connection goes there."""
        if address is not None and address == self._address:
            return
        self._address = address
        self.epoch += 1
        if address is not None and address not in self.nodes:
            self.nodes.append(address)

    async def _ask(self) -> tuple[str, int]:
        problems = []
        for host, port in list(self.nodes):
            conn = self._connection_class(host=host, port=port, **self._kwargs)
            try:
                async with timeout(self._timeout_s):
                    await conn.connect()  # type: ignore[no-untyped-call]  # redis-py leaves it untyped
                    await conn.send_command("CLUSTER", "SLOTS")
                    slots = await conn.read_response()
            except (redis.exceptions.RedisError, OSError, TimeoutError) as e:
                problems.append(f"{host}:{port}: {e}")
                continue
            finally:
                await conn.disconnect()
            found = self._learn(host, slots)
            if found is not None:
                return found
            problems.append(f"{host}:{port}: no master serves slot {self.slot}")
        raise redis.exceptions.ConnectionError(
            f"no node of the Redis Cluster said which master serves slot {self.slot}: " + "; ".join(problems))

    def _learn(self, asked: str, slots: Any) -> tuple[str, int] | None:
        """The master of the slot in a ``CLUSTER SLOTS`` reply; every master in it becomes a node to ask."""
        found = None
        for start, end, master, *_ in slots:
            raw = master[0]
            host = (raw.decode() if isinstance(raw, bytes) else str(raw)) or asked
            node = (host, int(master[1]))
            if node not in self.nodes:
                self.nodes.append(node)
            if int(start) <= self.slot <= int(end):
                found = node
        return found


class SlotMoved(redis.exceptions.ConnectionError):
    """The slot is served elsewhere now: the command was not run, and is sent once more, there
    (:data:`RETRY`)."""


# Each command or pipeline once more after SlotMoved, and after nothing else (a lost connection's
# command may have run: its retry is the caller's to decide, as without a cluster).
RETRY = Retry(NoBackoff(), 1, supported_errors=(SlotMoved,))


class _SlotConnection(WatchedBase):
    """A connection to whichever master serves the deployment's slot (``slot_master``)."""

    def __init__(self, *, slot_master: SlotMaster, **kwargs: Any) -> None:
        self._slots = slot_master
        self._epoch = -1  # the slot master's epoch when this connection was made
        super().__init__(**kwargs)

    async def connect_check_health(self, check_health: bool = True,
                                   retry_socket_connect: bool = True) -> None:
        if self.is_connected:
            return
        self._epoch = self._slots.epoch
        self.host, self.port = await self._slots.address()
        try:
            await super().connect_check_health(check_health, retry_socket_connect)
        except (redis.exceptions.RedisError, OSError):
            self._slots.moved(None)  # that master is gone, perhaps failed over: ask again next time
            raise

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        if self.is_connected and self._epoch != self._slots.epoch:
            await self.disconnect()  # another connection saw the slot move: this one follows
        await super().send_packed_command(command, check_health)

    async def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().read_response(*args, **kwargs)
        except redis.exceptions.MovedError as e:
            self._slots.moved((e.host, int(e.port)))
            await self.disconnect()
            raise SlotMoved(f"slot {self._slots.slot} moved to {e.host}:{e.port}") from e
        except redis.exceptions.AskError as e:  # being migrated: the new master owns it once it is done
            await self.disconnect()
            raise redis.exceptions.ConnectionError(
                f"slot {self._slots.slot} is moving to {e.host}:{e.port}") from e
        except redis.exceptions.ResponseError as e:
            if "non local key" not in str(e) and not str(e).startswith("UNBLOCKED"):
                raise
            # A script whose keys are its arguments (the rate limiter's) is not answered MOVED: it
            # fails on the first key the node no longer serves, before it has written anything. A
            # blocked XREADGROUP is answered UNBLOCKED when its stream is migrated away.
            self._slots.moved(None)
            await self.disconnect()
            raise SlotMoved(f"slot {self._slots.slot} is no longer served by {self.where}") from e


class SlotConnection(_SlotConnection, WatchedConnection):
    """``redis://`` to the slot's master."""


class SlotSSLConnection(_SlotConnection, WatchedSSLConnection):
    """``rediss://`` to the slot's master."""
