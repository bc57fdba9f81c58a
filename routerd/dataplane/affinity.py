"""Session affinity for the Responses API's chains: a ``POST /v1/responses`` naming a
``previous_response_id`` goes to the instance that made that response while it is not saturated.

The request's session key is its ``previous_response_id`` (:mod:`routerd.surface.heads`; a client's
``X-Session-Id`` or a job's ``session`` wins). What makes it find the instance is this hook: as an
answer leaves, the id of the response it carries — the first bytes of a non-streamed answer, the
``response.created`` event of a stream — is noted as a session on the instance that answered (and,
with several routerd, in the table they share), so the next turn of the chain is routed there like
any session. An engine keeps a stored response only in its memory (``VLLM_ENABLE_RESPONSES_API_STORE``),
so this is also what lets a chain continue on the engine that holds it at all; a conversation layer
(``routerd.conversations``) that rehydrates chains replaces or wraps this hook (``Dispatch.hooks``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from ..registry import Registry
from ..routing import Router
from .dispatch import Request
from .sinks import ForwardResult, ResponseSink

__all__ = ["ResponseAffinity"]

_ID = re.compile(rb'"id"\s*:\s*"(resp[_-][A-Za-z0-9_-]{1,200})"')
_HEAD_BYTES = 4096  # the id is among the first fields of the answer or of its first event


class _IdTap:
    """Passes every byte on; notes the response's id on the answering instance from the first chunk."""

    __slots__ = ("_affinity", "_inner", "_instance", "_looked")

    def __init__(self, affinity: ResponseAffinity, inner: ResponseSink) -> None:
        self._affinity, self._inner = affinity, inner
        self._instance = ""
        self._looked = False

    async def start(self, status: int, headers: Mapping[str, str]) -> None:
        self._looked = not 200 <= status < 300
        self._instance = headers.get("X-Routerd-Instance", "")
        await self._inner.start(status, headers)

    async def write(self, chunk: bytes) -> None:
        if not self._looked:
            self._looked = True
            found = _ID.search(chunk, 0, _HEAD_BYTES)
            if found is not None and self._instance:
                self._affinity.noted(found.group(1).decode(), self._instance)
        await self._inner.write(chunk)


class ResponseAffinity:
    """:class:`routerd.dataplane.dispatch.RouteHook` of ``POST /v1/responses``."""

    def __init__(self, router: Router, registry: Registry) -> None:
        self._router, self._registry = router, registry

    async def prepare(self, req: Request) -> None:
        return None  # the body goes as it came; its session key is its previous_response_id

    def observe(self, req: Request, sink: ResponseSink) -> ResponseSink:
        return _IdTap(self, sink)

    async def finished(self, req: Request, result: ForwardResult) -> None:
        return None

    def noted(self, response_id: str, instance_id: str) -> None:
        inst = self._registry.get(instance_id)
        if inst is not None:
            self._router.note_session(response_id, inst)
