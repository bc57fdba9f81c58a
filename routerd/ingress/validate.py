"""The one check of an OpenAI request body, for both ways in: an HTTP request's body and a queue job's
``body`` (the same OpenAI request, encoded to the JSON bytes routerd sends the engine).

A body is checked just enough to route it: the whole body UTF-8 (JSON is; vLLM answers 400 to anything
else, including inside the parts msgspec only skips), a JSON object, not nested too deeply, ``model`` a
non-empty string, ``prompt`` a non-empty string or array (completions) or ``messages`` a non-empty
array of objects (chat), ``stream`` a boolean or null (null is "not streamed", as OpenAI's and vLLM's
schemas read it). msgspec decodes only those fields (skipping the rest) and, unchecked, what routing
reads (the prompt or the messages, ``max_tokens``, ``user``: the request view of
``routerd.routing.request``); everything else (sampling parameters, lengths) is the engine's to
validate.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import Meta

from ..errors import BadRequest

__all__ = ["ChatHead", "ChatMessage", "CompletionHead", "read_head"]

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


_DECODERS: dict[str, msgspec.json.Decoder[Any]] = {
    "/v1/completions": msgspec.json.Decoder(CompletionHead),
    "/v1/chat/completions": msgspec.json.Decoder(ChatHead),
}


def read_head(endpoint: str, body: bytes) -> CompletionHead | ChatHead:
    """The checked head of an OpenAI request body for ``endpoint`` — the one check both ways in make,
    decoded once for routing as well — or :class:`BadRequest` naming the field that is wrong."""
    try:
        if not body.isascii():
            body.decode()
        head: CompletionHead | ChatHead = _DECODERS[endpoint].decode(body)
    except UnicodeDecodeError as e:
        raise BadRequest(f"the body is not valid UTF-8 (byte {e.start}: {e.reason})") from None
    except RecursionError:
        raise BadRequest("the body's JSON is nested too deeply") from None
    except msgspec.ValidationError as e:
        msg = str(e)
        param = msg.rsplit("`$.", 1)[1].rstrip("`").split("[")[0] if "`$." in msg else None
        if param is None and "missing required field" in msg:
            param = msg.rsplit("`", 2)[-2]
        if param == "messages":  # an element that is not an object
            raise BadRequest(_NOT_MESSAGES, param="messages") from None
        raise BadRequest(f"invalid request: {msg}", param=param) from None
    except msgspec.DecodeError as e:
        raise BadRequest(f"the body is not valid JSON: {e}") from None
    if isinstance(head, ChatHead):
        if not head.messages:
            raise BadRequest(_NOT_MESSAGES, param="messages")
    elif not head.prompt or not isinstance(head.prompt, str | list):
        raise BadRequest("invalid request: `prompt` must be a non-empty string or array", param="prompt")
    return head


_NOT_MESSAGES = "invalid request: `messages` must be a non-empty array of message objects"
