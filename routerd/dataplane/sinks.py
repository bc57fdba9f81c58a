"""The request path's ground floor: where a response goes, how a forwarded request ended, and the one
seam between the dispatch and the engine call.

Everything above imports from here and nothing here imports the rest of the package: the relay writes
into a :class:`ResponseSink`, the engine call (:class:`~routerd.dataplane.upstream.Upstream`) returns a
:class:`ForwardResult`, and :class:`~routerd.dataplane.dispatch.Dispatch` calls an :class:`EngineCall`
— the real upstream, or a fake of it in a test that is about a way in and not about engines.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ..plugins import RequestView
    from ..routing import RouteDecision
    from ..surface import Route

__all__ = ["EngineCall", "ForwardResult", "ResponseSink"]


class ResponseSink(Protocol):
    """Where an engine response goes: the client's HTTP response, or a queue job's result."""

    async def start(self, status: int, headers: Mapping[str, str]) -> None: ...  # once, before any byte

    async def write(self, chunk: bytes) -> None: ...  # raw bytes, in order


@dataclass
class ForwardResult:
    """How a forwarded request ended once bytes reached the sink."""

    instance: str
    attempts: int
    status: int
    ok: bool  # 2xx and, for streams, ended with [DONE] and no error event
    error: str | None
    ttfb_s: float = 0.0  # from forward() being called to the first byte going to the sink
    decision: RouteDecision | None = None  # why its first instance was chosen (for the request's log line)
    resumes: int = 0  # times the stream was continued on another instance after its engine failed
    slot_wait_s: float = 0.0  # an adapter request's wait for a LoRA slot to free before it was routed
    # A stream's usage as the engine counted it (prompt, completion tokens; a continued stream's whole
    # generation), whether or not the client asked for it, as far as it was read — a stream that
    # did not end well included: its engine generated them; None for a non-stream (its body holds it)
    # and for a stream whose events carried no count.
    usage: tuple[int, int] | None = None


class EngineCall(Protocol):
    """The engine call the dispatch makes (:meth:`routerd.dataplane.upstream.Upstream.forward`)."""

    async def forward(self, fleet: str, endpoint: str, body: bytes, sink: ResponseSink, *,
                      stream: bool, request_id: str, request: RequestView | None = None,
                      route: Route | None = None,
                      content_type: str = "application/json") -> ForwardResult: ...
