"""The request path: everything between a way in having read a request and its response written.

Modules, each importing only those listed after it:

- ``dispatch``: the one sequence both ways in call — tenant charged, admission ticket, engine call,
  usage settled, the fields of the request's log line (:class:`~.dispatch.Dispatch`);
- ``admission``: the per-fleet scheduler both ways in wait in (priority, deadline, fair share);
- ``upstream``: the engine call — where a request is routed, retried before its first byte, resumed
  after it (:class:`~.upstream.Upstream`);
- ``relay``: one streamed response moved to its sink, and how it ended;
- ``resume``: whether a stream can be continued, and its events rewritten into the client's stream;
- ``engine_http``: the keep-alive HTTP/1.1 connections to the engines;
- ``sinks``: the ground floor — :class:`ResponseSink`, :class:`ForwardResult` and the
  :class:`EngineCall` seam between the dispatch and the engine call.

The ways in (:mod:`routerd.ingress`) read a request into a :class:`~.dispatch.Request` and give it a
sink; they reach nothing else here.
"""

from .sinks import EngineCall, ForwardResult, ResponseSink

__all__ = ["EngineCall", "ForwardResult", "ResponseSink"]
