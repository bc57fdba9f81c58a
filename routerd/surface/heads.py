"""The one check of a request body, per route, for both ways in: an HTTP request's body and a queue
job's ``body`` (encoded to the JSON bytes routerd sends the engine).

A body is checked just enough to route it: UTF-8 (JSON is; vLLM answers 400 to anything else), a JSON
object, not nested too deeply, ``model`` a non-empty string, ``stream`` a boolean or null, and the
field each route cannot do without (``prompt``, ``messages``, ``input``…). msgspec decodes only those
fields; everything else is the engine's to validate.

What routing reads comes out as a chat or completion head (:mod:`routerd.openai`), so routing needs
no route knowledge: Anthropic's ``messages`` (its ``system`` first) and the Responses API's
``instructions`` + ``input`` items render as chat messages do — a conversation's next turn then
starts with the rendering of the turn before, as it does for chat; pooling inputs, rerank and score
texts, tokenize prompts read as a completion's prompt (counted, not keyed: see ``Route.generates``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from ..errors import BadRequest
from ..openai import HEAD_DECODERS, ChatHead, ChatMessage, CompletionHead
from .multipart import form_fields
from .routes import Family, Route

__all__ = ["Read", "read_body", "read_head"]

_Model = Annotated[str, Meta(min_length=1)]
_encode = msgspec.json.Encoder().encode


@dataclass(slots=True)
class Read:
    """What a way in read of a body: the fleet's model, whether it streams, what routing reads, and the
    body's own session key (a Responses request's ``previous_response_id``)."""

    model: str
    stream: bool
    head: CompletionHead | ChatHead
    session: str | None = None


class _MessagesHead(msgspec.Struct):
    model: _Model
    messages: list[ChatMessage]
    system: Any = None
    stream: bool | None = None
    max_tokens: Any = None
    metadata: Any = None


class _ResponsesHead(msgspec.Struct):
    model: _Model
    input: Any = None
    instructions: Any = None
    stream: bool | None = None
    max_output_tokens: Any = None
    user: Any = None
    previous_response_id: Any = None
    conversation: Any = None


class _InputHead(msgspec.Struct):  # /v1/embeddings, /pooling, /classify, /tokenize (prompt)
    model: _Model
    input: Any = None
    prompt: Any = None
    messages: list[ChatMessage] | None = None
    user: Any = None


class _ScoreHead(msgspec.Struct):
    model: _Model
    query: msgspec.Raw = msgspec.Raw()
    documents: msgspec.Raw = msgspec.Raw()
    queries: msgspec.Raw = msgspec.Raw()
    items: msgspec.Raw = msgspec.Raw()
    text_1: msgspec.Raw = msgspec.Raw()
    text_2: msgspec.Raw = msgspec.Raw()
    data_1: msgspec.Raw = msgspec.Raw()
    data_2: msgspec.Raw = msgspec.Raw()


class _DetokenizeHead(msgspec.Struct):
    model: _Model
    tokens: list[int]


class _ModelHead(msgspec.Struct):  # [http] passthrough: the fleet and whether it streams
    model: _Model
    stream: bool | None = None


_DECODERS: dict[Family, msgspec.json.Decoder[Any]] = {
    Family.MESSAGES: msgspec.json.Decoder(_MessagesHead),
    Family.COUNT_TOKENS: msgspec.json.Decoder(_MessagesHead),
    Family.RESPONSES: msgspec.json.Decoder(_ResponsesHead),
    Family.EMBEDDINGS: msgspec.json.Decoder(_InputHead),
    Family.TOKENIZE: msgspec.json.Decoder(_InputHead),
    Family.SCORE: msgspec.json.Decoder(_ScoreHead),
    Family.DETOKENIZE: msgspec.json.Decoder(_DetokenizeHead),
    Family.OTHER: msgspec.json.Decoder(_ModelHead),
}


def _decode(decoder: msgspec.json.Decoder[Any], body: bytes) -> Any:
    """``body`` decoded, or :class:`BadRequest` naming the field that is wrong."""
    try:
        if not body.isascii():
            body.decode()
        return decoder.decode(body)
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


def read_head(endpoint: str, body: bytes) -> CompletionHead | ChatHead:
    """The checked head of a completion or chat body (``endpoint`` one of those two)."""
    head: CompletionHead | ChatHead = _decode(HEAD_DECODERS[endpoint], body)
    if isinstance(head, ChatHead):
        if not head.messages:
            raise BadRequest(_NOT_MESSAGES, param="messages")
    elif not head.prompt or not isinstance(head.prompt, str | list):
        raise BadRequest("invalid request: `prompt` must be a non-empty string or array", param="prompt")
    return head


def read_body(route: Route, body: bytes, content_type: str = "application/json") -> Read:
    """The checked :class:`Read` of ``body`` for ``route`` (a multipart body: its form fields), or
    :class:`BadRequest` naming what is wrong."""
    family = route.family
    if family is Family.COMPLETIONS or family is Family.CHAT:
        head = read_head(route.path, body)
        return Read(head.model, bool(head.stream), head)
    if family is Family.AUDIO:
        return _audio(body, content_type)
    doc = _decode(_DECODERS[family], body)
    if isinstance(doc, _MessagesHead):
        return _messages(doc, family)
    if isinstance(doc, _ResponsesHead):
        return _responses(doc)
    if isinstance(doc, _InputHead):
        return _input(doc, family)
    if isinstance(doc, _ScoreHead):
        parts = [bytes(r) for r in (doc.query, doc.queries, doc.text_1, doc.data_1, doc.documents,
                                    doc.items, doc.text_2, doc.data_2) if r]
        if not parts:
            raise BadRequest("invalid request: give `query` and `documents` (rerank), or `queries` and "
                             "`documents`/`items`, or `text_1` and `text_2` (score)", param="documents")
        return Read(doc.model, False, CompletionHead(model=doc.model, prompt=b"".join(parts).decode()))
    if isinstance(doc, _DetokenizeHead):
        return Read(doc.model, False, CompletionHead(model=doc.model, prompt=doc.tokens or [0]))
    assert isinstance(doc, _ModelHead)
    return Read(doc.model, bool(doc.stream), CompletionHead(model=doc.model, prompt="", stream=doc.stream))


def _messages(doc: _MessagesHead, family: Family) -> Read:
    if not doc.messages:
        raise BadRequest(_NOT_MESSAGES, param="messages")
    messages = doc.messages if doc.system is None else [ChatMessage(role="system", content=doc.system),
                                                         *doc.messages]
    user = doc.metadata.get("user_id") if isinstance(doc.metadata, dict) else None
    stream = family is Family.MESSAGES and bool(doc.stream)
    return Read(doc.model, stream, ChatHead(model=doc.model, messages=messages, stream=stream,
                                            max_tokens=doc.max_tokens, user=user))


def _responses(doc: _ResponsesHead) -> Read:
    """A Responses request's input items as chat messages: a message item (it has a ``role``) as its
    role and content, any other item (a function call, its output, reasoning) as its type and JSON."""
    items = doc.input
    if isinstance(items, str):
        messages = [ChatMessage(role="user", content=items)]
    elif isinstance(items, list):
        messages = [ChatMessage(role=i.get("role") or i.get("type"), content=i.get("content") if "role" in i
                                else _encode(i).decode()) if isinstance(i, dict)
                    else ChatMessage(role="item", content=i) for i in items]
    elif items is None and (doc.previous_response_id is not None or doc.conversation is not None):
        messages = []
    else:
        raise BadRequest("invalid request: `input` must be a string or an array of input items",
                         param="input")
    if doc.instructions is not None:
        messages.insert(0, ChatMessage(role="system", content=doc.instructions))
    prev = doc.previous_response_id if isinstance(doc.previous_response_id, str) and \
        doc.previous_response_id else None
    return Read(doc.model, bool(doc.stream),
                ChatHead(model=doc.model, messages=messages or [ChatMessage(role="user", content="")],
                         stream=doc.stream, max_tokens=doc.max_output_tokens, user=doc.user), session=prev)


def _input(doc: _InputHead, family: Family) -> Read:
    if doc.messages:
        return Read(doc.model, False, ChatHead(model=doc.model, messages=doc.messages, user=doc.user))
    value = doc.prompt if family is Family.TOKENIZE else doc.input
    if not value or not isinstance(value, str | list):
        field = "prompt" if family is Family.TOKENIZE else "input"
        raise BadRequest(f"invalid request: `{field}` must be a non-empty string or array (or give "
                         "`messages`)", param=field)
    return Read(doc.model, False, CompletionHead(model=doc.model, prompt=value, user=doc.user))


def _audio(body: bytes, content_type: str) -> Read:
    fields = form_fields(body, content_type, ("model", "stream", "prompt"))
    model = fields.get("model", "")
    if not model:
        raise BadRequest("invalid request: the form has no `model` field (it names the fleet)",
                         param="model")
    stream = fields.get("stream", "").strip().lower() in ("true", "1")
    return Read(model, stream, CompletionHead(model=model, prompt=fields.get("prompt", ""), stream=stream))


_NOT_MESSAGES = "invalid request: `messages` must be a non-empty array of message objects"
