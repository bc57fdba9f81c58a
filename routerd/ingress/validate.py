"""The one check of an OpenAI request body, for both ways in: an HTTP request's body and a queue job's
``body`` (the same OpenAI request, encoded to the JSON bytes routerd sends the engine).

A body is checked just enough to route it: the whole body UTF-8 (JSON is; vLLM answers 400 to anything
else, including inside the parts msgspec only skips), a JSON object, not nested too deeply, ``model`` a
non-empty string, ``prompt`` a non-empty string or array (completions) or ``messages`` a non-empty
array of objects (chat), ``stream`` a boolean or null (null is "not streamed", as OpenAI's and vLLM's
schemas read it). msgspec decodes only those fields (``msgspec.Raw`` for the rest); everything else
(sampling parameters, lengths) is the engine's to validate.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import Meta

from ..errors import BadRequest

__all__ = ["check_body"]

_Model = Annotated[str, Meta(min_length=1)]


class _Completion(msgspec.Struct):
    model: _Model
    prompt: msgspec.Raw
    stream: bool | None = None


class _Chat(msgspec.Struct):
    model: _Model
    messages: list[msgspec.Raw]
    stream: bool | None = None


_DECODERS: dict[str, msgspec.json.Decoder[Any]] = {
    "/v1/completions": msgspec.json.Decoder(_Completion),
    "/v1/chat/completions": msgspec.json.Decoder(_Chat),
}


def check_body(endpoint: str, body: bytes) -> tuple[str, bool]:
    """``(model, stream)`` of an OpenAI request body for ``endpoint``, or :class:`BadRequest` naming
    the field (``param``) that is wrong."""
    try:
        if not body.isascii():
            body.decode()
        head = _DECODERS[endpoint].decode(body)
    except UnicodeDecodeError as e:
        raise BadRequest(f"the body is not valid UTF-8 (byte {e.start}: {e.reason})") from None
    except RecursionError:
        raise BadRequest("the body's JSON is nested too deeply") from None
    except msgspec.ValidationError as e:
        msg = str(e)
        param = msg.rsplit("`$.", 1)[1].rstrip("`").split("[")[0] if "`$." in msg else None
        if param is None and "missing required field" in msg:
            param = msg.rsplit("`", 2)[-2]
        raise BadRequest(f"invalid request: {msg}", param=param) from None
    except msgspec.DecodeError as e:
        raise BadRequest(f"the body is not valid JSON: {e}") from None
    if isinstance(head, _Chat):
        if not head.messages or not all(bytes(m)[:1] == b"{" for m in head.messages):
            raise BadRequest("invalid request: `messages` must be a non-empty array of message objects",
                             param="messages")
    elif _empty_or_not(bytes(head.prompt)):
        raise BadRequest("invalid request: `prompt` must be a non-empty string or array", param="prompt")
    return head.model, bool(head.stream)


def _empty_or_not(prompt: bytes) -> bool:
    """True unless ``prompt`` (raw JSON) is a non-empty string or a non-empty array."""
    if prompt[:1] == b'"':
        return prompt == b'""'
    if prompt[:1] == b"[":
        return prompt[1:-1].strip() == b""
    return True
