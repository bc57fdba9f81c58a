"""Routing: which instance of a fleet takes a request.

``promtext`` reads an engine's ``/metrics`` page, ``scraper`` keeps every instance's figures fresh,
``speed`` learns each instance's capacity and speed from them, ``breaker`` takes failing instances out
of rotation, ``request`` turns a request into the view a policy sees, ``prefix_index`` models what each
engine's prefix cache holds, and ``router`` builds the candidates a policy plugin chooses from.
"""

from .breaker import CircuitBreaker
from .prefix_index import PrefixIndex, Sessions
from .request import RequestViews
from .router import Decision, Router
from .scraper import Scraper

__all__ = ["CircuitBreaker", "Decision", "PrefixIndex", "RequestViews", "Router", "Scraper", "Sessions"]
