"""Routing: what routerd decides — which instance of a fleet takes a request.

- ``router``: the candidates a policy plugin chooses from, over the registry, and the decision's reasons
  (:class:`~.router.RouteDecision`);
- ``request``: a request turned into the :class:`~routerd.plugins.RequestView` a policy sees;
- ``prefix_index``: routerd's own model of each engine's prefix cache, and the session table;
- ``scraper``: every instance's ``/metrics`` kept fresh (the page is read by
  :mod:`routerd.vllm_wire.metrics_text`);
- ``breaker``: failing instances taken out of rotation;
- ``engine_cache/``: the engines' *own* cache, from their KV events — subscriber, per-engine block
  views, keyers — behind the router's :class:`~.engine_cache.blocks.EngineCacheSource` protocol.

What vLLM speaks on the wire (block hashes, KV-event frames, metrics text) is :mod:`routerd.vllm_wire`'s,
not routing's: routing decides, the wire package only reads and writes vLLM's formats.
"""

from .breaker import CircuitBreaker
from .prefix_index import PrefixIndex, Sessions
from .request import RequestViews
from .router import RouteDecision, Router
from .scraper import Scraper

__all__ = ["CircuitBreaker", "PrefixIndex", "RequestViews", "RouteDecision", "Router", "Scraper", "Sessions"]
