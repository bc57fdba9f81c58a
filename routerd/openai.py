"""The OpenAI request bodies' heads: what routerd decodes of a completion or chat body to check and route
it (the prompt or the messages, ``max_tokens``, ``user``, ``stream``), and their decoders.

Shared by both ways in (:mod:`routerd.ingress.validate` checks a body with them and maps what is wrong
to a 400) and by routing (:mod:`routerd.routing.request` builds its view from a head), so they sit
on the floor below both: routing never imports the ingress.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import Meta

__all__ = ["HEAD_DECODERS", "ChatHead", "ChatMessage", "CompletionHead"]

_Model = Annotated[str, Meta(min_length=1)]


class CompletionHead(msgspec.Struct):
    """What routerd reads of a completion body. Fields typed ``Any`` are not checked (the engine
    does): routing reads them when they have the type it can use (``routerd.routing.request``)."""

    model: _Model
    prompt: Any  # a non-empty string or array (checked); what is in the array, the engine checks
    stream: bool | None = None
    max_tokens: Any = None
    user: Any = None


class ChatMessage(msgspec.Struct):
    """A chat message: an object (checked), its fields as sent (the engine checks them). Decoded here,
    once, because routing renders them (``routerd.routing.request``): a second pass over a long
    conversation would cost as much as this one."""

    role: Any = None
    content: Any = None
    name: Any = None
    tool_calls: Any = None
    tool_call_id: Any = None


class ChatHead(msgspec.Struct):
    """What routerd reads of a chat body (see :class:`CompletionHead`)."""

    model: _Model
    messages: list[ChatMessage]
    stream: bool | None = None
    max_tokens: Any = None
    max_completion_tokens: Any = None
    user: Any = None


# by endpoint; a head decoded with one is checked for what msgspec cannot say by validate.read_head
HEAD_DECODERS: dict[str, msgspec.json.Decoder[Any]] = {
    "/v1/completions": msgspec.json.Decoder(CompletionHead),
    "/v1/chat/completions": msgspec.json.Decoder(ChatHead),
}
