"""The routes routerd serves, and what each one is: one table both ways in read (HTTP registers its
handlers from it, a queue job's ``endpoint`` is looked up in it) and the request path consults (does
it take an engine slot, how is its stream shaped, can it be resumed).

What differs between routes is only how a body is read (JSON or multipart; which fields pick the
fleet and what routing keys on), whether the request takes an engine slot, how its stream ends and
fails, and the shape of its errors. The sequence — tenant, rate limit, admission, routing, retries
before the first byte, breaker, usage, log line — is the one dispatch's for all of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

__all__ = ["ROUTES", "Body", "ErrorShape", "Family", "Route", "StreamShape", "passthrough_route", "route_for"]


class Body(Enum):
    JSON = "json"
    MULTIPART = "multipart"  # multipart/form-data: the form's `model` field picks the fleet


class ErrorShape(Enum):
    OPENAI = "openai"  # {"error": {"message", "type", "param", "code"}}
    ANTHROPIC = "anthropic"  # {"type": "error", "error": {"type", "message"}}: vLLM's on /v1/messages


class StreamShape(Enum):
    """How a streamed answer is framed, ends and fails."""

    SSE = "sse"  # OpenAI's: `data: {...}` events, ended by `data: [DONE]`; an error is `data: {"error"…}`
    # Named events (`event: <type>` + `data: {...}`), ended by a terminal event; an error is
    # `event: error`: the Responses API's semantic events and Anthropic's message events.
    EVENTS = "events"


class Family(Enum):
    """What a route's body holds, for reading it (:mod:`routerd.surface.heads`)."""

    COMPLETIONS = "completions"
    CHAT = "chat"
    RESPONSES = "responses"
    MESSAGES = "messages"
    COUNT_TOKENS = "count_tokens"  # Anthropic's messages, counted: no slot
    EMBEDDINGS = "embeddings"  # and /pooling, /classify: `input` (or chat `messages`)
    SCORE = "score"  # /score, /v1/score, /rerank, /v1/rerank, /v2/rerank
    TOKENIZE = "tokenize"
    DETOKENIZE = "detokenize"
    AUDIO = "audio"
    OTHER = "other"  # [http] passthrough: only `model` (and `stream`) are read


@dataclass(frozen=True, slots=True)
class Route:
    """One route: its path on routerd and on the engine, and how it is treated."""

    path: str
    family: Family
    body: Body = Body.JSON
    slot: bool = True  # takes an engine slot (admission); tokenize and count_tokens do not
    # Generates text: routed by the cache-aware policy keyed on the rendered prompt (the engine's own
    # block keys where the fleet publishes them). Otherwise least load, the input counted for the
    # estimates but not keyed (pooling models seldom cache prefixes; their blocks would only crowd
    # the prefix index).
    generates: bool = False
    stream: StreamShape | None = None  # None: never streamed
    resumable: bool = False  # a failed stream continued on another instance (chat and completions only)
    errors: ErrorShape = ErrorShape.OPENAI
    terminal_events: tuple[str, ...] = ()  # StreamShape.EVENTS: the events a complete stream ends with

    @property
    def label(self) -> str:
        """Its ``route`` label on metrics: the path, or ``passthrough`` for any other (a bounded set)."""
        return "passthrough" if self.family is Family.OTHER else self.path


_MESSAGES_END = ("message_stop",)
_RESPONSES_END = ("response.completed", "response.incomplete", "response.failed")


def _table() -> dict[str, Route]:
    routes = [
        Route("/v1/completions", Family.COMPLETIONS, generates=True, stream=StreamShape.SSE, resumable=True),
        Route("/v1/chat/completions", Family.CHAT, generates=True, stream=StreamShape.SSE, resumable=True),
        Route("/v1/responses", Family.RESPONSES, generates=True, stream=StreamShape.EVENTS,
              terminal_events=_RESPONSES_END),
        Route("/v1/messages", Family.MESSAGES, generates=True, stream=StreamShape.EVENTS,
              errors=ErrorShape.ANTHROPIC, terminal_events=_MESSAGES_END),
        Route("/v1/messages/count_tokens", Family.COUNT_TOKENS, slot=False, errors=ErrorShape.ANTHROPIC),
        Route("/v1/embeddings", Family.EMBEDDINGS),
        Route("/pooling", Family.EMBEDDINGS),
        Route("/classify", Family.EMBEDDINGS),
        *(Route(p, Family.SCORE) for p in ("/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank")),
        Route("/tokenize", Family.TOKENIZE, slot=False),
        Route("/detokenize", Family.DETOKENIZE, slot=False),
        *(Route(p, Family.AUDIO, body=Body.MULTIPART, stream=StreamShape.SSE)
          for p in ("/v1/audio/transcriptions", "/v1/audio/translations")),
    ]
    return {r.path: r for r in routes}


ROUTES: dict[str, Route] = _table()
"""Every route routerd serves, by path (the engine's path is the same)."""


def route_for(path: str) -> Route | None:
    return ROUTES.get(path)


def passthrough_route(path: str) -> Route:
    """The route of a path under ``/v1/`` the table does not have, forwarded with ``[http] passthrough``:
    its body's ``model`` picks the fleet, it takes a slot, a stream passes through as OpenAI's SSE."""
    return Route(path, Family.OTHER, stream=StreamShape.SSE)
