"""The request path: everything between a way in having read a request and its response written.

Modules, each importing only those listed after it (the ``request-path`` contract in pyproject.toml):

- ``dispatch``: the one sequence both ways in call — tenant charged, admission ticket, engine call,
  usage settled, the fields of the request's log line (:class:`~.dispatch.Dispatch`);
- ``admission``: the per-fleet scheduler both ways in wait in (priority, deadline, fair share, the
  waiting room, preemption); ``upstream``: the engine call — where a request is routed, retried before
  its first byte, resumed after it (:class:`~.upstream.Upstream`);
- ``slots``: one fleet's admission state — its slots in use, its tenants' lines of waiters;
  ``attempt``: one attempt on one instance, and what its failure costs that instance;
- ``relay``: one streamed response moved to its sink, and how it ended; ``resume``: whether a stream
  can be continued; ``usage``: the tap that bills a tenant what the engine counted;
- ``resume_stream``: a resumable stream's events read, rewritten and continued; ``engine_http``: the
  keep-alive HTTP/1.1 connections to the engines; ``engine_errors``: an engine's error answer in
  OpenAI's shape;
- ``engine_conn``: one keep-alive connection (an asyncio Protocol) and its response framing;
- ``sinks``: the ground floor — :class:`ResponseSink`, :class:`ForwardResult` and the
  :class:`EngineCall` seam between the dispatch and the engine call.

The ways in (:mod:`routerd.ingress`) read a request into a :class:`~.dispatch.Request` and give it a
sink; they reach nothing else here.
"""

from .sinks import EngineCall, ForwardResult, ResponseSink

__all__ = ["EngineCall", "ForwardResult", "ResponseSink"]
