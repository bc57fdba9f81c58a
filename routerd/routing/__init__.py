"""Routing: which instance of a fleet takes a request.

``promtext`` reads an engine's ``/metrics`` page, ``scraper`` keeps every instance's figures fresh,
``breaker`` takes failing instances out of rotation, and ``router`` builds the candidates a policy
plugin chooses from.
"""

from .breaker import CircuitBreaker
from .router import Router
from .scraper import Scraper

__all__ = ["CircuitBreaker", "Router", "Scraper"]
