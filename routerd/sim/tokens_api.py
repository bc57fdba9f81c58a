"""``POST /tokenize`` and ``POST /detokenize`` with the sim's tokens (``routerd.sim_tokens``).

A prompt's ids are its words' CRC-32s — the very ids its KV-cache events carry and a router keys it
by — and a chat is tokenized as rendered (ChatML), as vLLM applies the model's template. The ids are not
invertible, so ``/detokenize`` knows the words the sim generates (its vocabulary: any output it gave,
on any replica) and the words this server has tokenized (bounded); an id it never met is left out, as
vLLM 0.32 leaves out an id outside its vocabulary (``{"prompt": ""}`` for ``[99999]``). Neither route
takes an engine slot or counts in ``/load``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from ..sim_tokens import VOCAB, prompt_words, render_chat, token_ids
from . import protocol as p
from . import wire
from .config import SimConfig

_KNOWN_WORDS = 65536  # words remembered from /tokenize for /detokenize, least recently used first out


class TokenizeRoutes:
    """The two handlers and the id → word memory they share."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self._words: OrderedDict[int, str] = OrderedDict()
        self._vocab = dict(zip(token_ids(VOCAB), VOCAB, strict=True))

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/tokenize", self.tokenize), web.post("/detokenize", self.detokenize)]

    def _remember(self, words: Sequence[str], ids: Sequence[int]) -> None:
        for word, i in zip(words, ids, strict=True):
            self._words[i] = word
            self._words.move_to_end(i)
        while len(self._words) > _KNOWN_WORDS:
            self._words.popitem(last=False)

    async def tokenize(self, request: web.Request) -> web.Response:
        try:
            body = await wire.read_json(request)
            words = self._words_of(body)
        except wire.Unparsable:
            return wire.unparsable()
        except p.RequestError as e:
            return wire.json_response(e.body, e.status)
        ids = token_ids(words)
        self._remember(words, ids)
        out: dict[str, Any] = {"count": len(ids), "max_model_len": self.config.max_model_len, "tokens": ids,
                               "token_strs": list(words) if body.get("return_token_strs") is True else None}
        return wire.json_response(out)

    def _words_of(self, body: Any) -> list[str]:
        if not isinstance(body, dict):
            raise p.not_a_dict(body)
        p.check_model(body, self.config)
        if "messages" in body:
            messages = p.parse_messages(body)
            return prompt_words(render_chat(messages, **p.generation_prompt(body)))
        prompt = body.get("prompt")
        if prompt is None:  # neither of the union's two shapes: vLLM's pydantic names both
            missing = [f"{{'type': 'missing', 'loc': 'body.{f}', 'msg': 'Field required', 'input': "
                       f"'<dict of {len(body)} items>'}}" for f in ("prompt", "messages")]
            raise p.RequestError(400, "2 validation errors:\n  " + "\n  ".join(missing), "Bad Request",
                                 "body.prompt")
        if not isinstance(prompt, str):
            raise p.field_error("string_type", "prompt", "Input should be a valid string", prompt)
        return prompt_words(prompt)

    async def detokenize(self, request: web.Request) -> web.Response:
        try:
            body = await wire.read_json(request)
            if not isinstance(body, dict):
                raise p.not_a_dict(body)
            p.check_model(body, self.config)
            ids = body.get("tokens")
            if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool)
                                                    and i >= 0 for i in ids):
                raise p.field_error("list_type", "tokens", "Input should be a valid list", ids)
            words = [w for i in ids if (w := self._word(i)) is not None]
        except wire.Unparsable:
            return wire.unparsable()
        except p.RequestError as e:
            return wire.json_response(e.body, e.status)
        return wire.json_response({"prompt": " ".join(words)})

    def _word(self, i: int) -> str | None:
        return self._vocab.get(i) or self._words.get(i)
