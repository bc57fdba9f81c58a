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

import msgspec

from ..errors import BadRequest
from ..openai import HEAD_DECODERS as _DECODERS
from ..openai import ChatHead, ChatMessage, CompletionHead

__all__ = ["ChatHead", "ChatMessage", "CompletionHead", "read_head"]

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
