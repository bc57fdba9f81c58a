"""Who runs a batch: a lease in Redis (``SET NX PX``, renewed by its holder, given up on the way out).

Exactly one routerd feeds and collects a batch at a time; when its holder dies the lease lapses after
``[batches] lease_s`` and any other routerd takes the batch over. The lease is about work, not about
correctness: every step a runner takes is atomic and refused or skipped when already done
(:mod:`.store`), so a holder that lost its lease without knowing it (a long pause) can do no harm
before its next renew tells it so.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any

from .. import _aio
from ..peers.lease import RELEASE_IF_HELD, RENEW_IF_HELD
from ..redis_keys import RedisKeys


class BatchLease:
    """This process's leases on batches, all under one token (``<holder> <random>``)."""

    def __init__(self, client: Callable[[], Any], keys: RedisKeys, holder: str, *,
                 op_timeout_s: float) -> None:
        self._client = client
        self.keys = keys
        self.token = f"{holder} {secrets.token_hex(8)}"
        self._timeout = op_timeout_s
        self._scripts: dict[str, Any] = {}

    async def _script(self, src: str, batch_id: str, *args: str) -> Any:
        client = self._client()
        script = self._scripts.get(src)
        if script is None or script.registered_client is not client:
            script = self._scripts[src] = client.register_script(src)
        async with _aio.timeout(self._timeout):
            return await script(keys=[self.keys.batch_lease(batch_id)], args=[self.token, *args])

    async def take(self, batch_id: str, lease_ms: int) -> bool:
        async with _aio.timeout(self._timeout):
            return bool(await self._client().set(self.keys.batch_lease(batch_id), self.token, nx=True,
                                                 px=lease_ms))

    async def renew(self, batch_id: str, lease_ms: int) -> bool:
        return bool(await self._script(RENEW_IF_HELD, batch_id, str(lease_ms)))

    async def release(self, batch_id: str) -> None:
        await self._script(RELEASE_IF_HELD, batch_id)
