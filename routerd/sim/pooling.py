"""vLLM's pooling routes: ``/v1/embeddings``, ``/score`` (and ``/v1/score``), ``/rerank`` (and
``/v1/rerank``, ``/v2/rerank``), ``/pooling`` and ``/classify``, in vLLM 0.32's shapes.

vLLM serves these only with a pooling model (``--runner pooling``); the sim serves them beside the
generating routes, so one sim fleet runs every path. The numbers are deterministic functions of the
sim's tokens: an input's embedding is the normalised sum of its words' vectors (each word's from a
hash of it and the seed), so texts that share words are close; a score or rerank relevance is the
cosine of the two embeddings, as vLLM scores with an embedding model; a classification is a softmax
over the embedding's first components. Every input is one engine request of one prefill-only step
(``Runner.pooling``), so pooling traffic queues and batches with generation as it does in vLLM.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import math
import secrets
import struct
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from ..sim_tokens import count_prompt_tokens, prompt_words, render_chat
from . import protocol as p
from . import wire
from .config import SimConfig
from .running import Prompt, Runner

# ScoreRequest's four spellings of its two sides, as vLLM's union tries them
_SCORE_FIELDS = (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"), ("text_1", "text_2"))
NUM_LABELS = 2  # what `--convert classify` gives a causal LM without `num_labels`


def _usage(prompt_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens, "completion_tokens": 0,
            "prompt_tokens_details": None, "completion_tokens_details": None}


def _prompt(item: str | list[int]) -> Prompt:
    words = prompt_words(item)
    return Prompt(words, count_prompt_tokens(item), " ".join(words))


class PoolingRoutes:
    """The handlers; each input takes one engine slot for one prefill step."""

    def __init__(self, config: SimConfig, runner: Runner) -> None:
        self.config = config
        self.runner = runner
        self.dim = config.embedding_dim

    def routes(self) -> list[web.RouteDef]:
        """An embedding model's routes (vLLM's ``--convert embed``), and ``/classify`` on runner "all"
        (vLLM serves it only from a classifier, which serves no embeddings)."""
        embed = [
            web.post("/v1/embeddings", self.embeddings),
            web.post("/pooling", self.pooling),
            *(web.post(path, self.score) for path in ("/score", "/v1/score")),
            *(web.post(path, self.rerank) for path in ("/rerank", "/v1/rerank", "/v2/rerank")),
        ]
        return embed + ([web.post("/classify", self.classify)] if self.config.runner == "all" else [])

    # ---- the numbers ------------------------------------------------------------------------------

    def embed(self, words: list[str]) -> list[float]:
        """The unit vector of a text: its words' vectors summed (each word's fixed by the seed)."""
        acc = [0.0] * self.dim
        seed = self.config.seed.to_bytes(8, "little", signed=True)
        for word, n in Counter(words).items():
            raw = hashlib.shake_128(seed + word.encode()).digest(self.dim)
            for j, b in enumerate(raw):
                acc[j] += n * (b - 127.5)
        norm = math.sqrt(sum(x * x for x in acc)) or 1.0
        return [x / norm for x in acc]

    def cosine(self, a: list[str], b: list[str]) -> float:
        return sum(x * y for x, y in zip(self.embed(a), self.embed(b), strict=True))

    # ---- the engine -------------------------------------------------------------------------------

    async def _run(self, prompts: list[Prompt]) -> bool:
        """Every prompt through the engine at once; False when a fault or the engine refused one."""
        if self.runner.refuses("\n".join(pr.key for pr in prompts)):  # one draw of the error rate a request
            return False
        async with contextlib.AsyncExitStack() as stack:
            seqs = [await stack.enter_async_context(self.runner.running(self.runner.pooling(pr)))
                    for pr in prompts]
            for seq in seqs:
                if not await self.runner.finish(seq):
                    return False
        return True

    async def _body(self, request: web.Request) -> dict[str, Any]:
        body = await wire.read_json(request)
        if not isinstance(body, dict):
            raise p.not_a_dict(body)
        model = p.get_field(body, "model", str, "string_type", "Input should be a valid string")
        if model is not None and model != self.config.model:  # the pooling routes' own wording, no param
            raise p.RequestError(404, f"The model `{model}` does not exist.", "NotFoundError", None)
        return body

    def _inputs(self, body: dict[str, Any], key: str = "input") -> list[Prompt]:
        """``input`` as vLLM takes it (a string, strings, token ids, lists of ids) or chat ``messages``."""
        if key == "input" and "messages" in body and "input" not in body:
            rendered = render_chat(p.parse_messages(body), **p.generation_prompt(body))
            return [_prompt(rendered)]
        value = body.get(key)
        if value is None:
            raise p.field_error("missing", key, "Field required", body)
        items = _items(value)
        if items is None or not items:
            raise p.field_error("string_type", key, "Input should be a valid string", value)
        prompts = [_prompt(item) for item in items]
        for pr in prompts:
            self._check_length(pr)
        return prompts

    def _check_length(self, pr: Prompt) -> None:
        limit = self.config.max_model_len
        if pr.tokens > limit:  # vLLM's renderer check (renderers/params.py)
            raise p.semantic_error(f"This model's maximum context length is {limit} tokens. However, your "
                                   f"prompt contains {pr.tokens} input tokens, which exceeds this limit even "
                                   "without any output tokens. Please reduce the length of the input prompt.",
                                   "input_tokens", pr.tokens)

    async def _answer(self, request: web.Request, build: Any) -> web.Response:
        try:
            body = await self._body(request)
            prompts, answer = build(body)
        except wire.Unparsable:
            return wire.unparsable()
        except p.RequestError as e:
            return wire.json_response(e.body, e.status)
        if not await self._run(prompts):
            return wire.internal_error()
        return wire.json_response(answer)

    # ---- the routes -------------------------------------------------------------------------------

    async def embeddings(self, request: web.Request) -> web.Response:
        return await self._answer(request, self._embeddings)

    def _embeddings(self, body: dict[str, Any]) -> tuple[list[Prompt], dict[str, Any]]:
        prompts = self._inputs(body)
        fmt = body.get("encoding_format", "float")
        if fmt not in ("float", "base64"):
            raise p.field_error("literal_error", "encoding_format", "Input should be 'float' or 'base64'",
                                fmt)
        data = [{"index": i, "object": "embedding", "embedding": _encode(self.embed(pr.words), fmt)}
                for i, pr in enumerate(prompts)]
        total = sum(pr.tokens for pr in prompts)
        return prompts, {"id": "embd-" + secrets.token_hex(8), "object": "list", "created": int(time.time()),
                         "model": self.config.model, "data": data, "usage": _usage(total)}

    async def pooling(self, request: web.Request) -> web.Response:
        return await self._answer(request, self._pooling)

    def _pooling(self, body: dict[str, Any]) -> tuple[list[Prompt], dict[str, Any]]:
        prompts = self._inputs(body)
        data = [{"index": i, "object": "pooling", "data": self.embed(pr.words)}
                for i, pr in enumerate(prompts)]
        total = sum(pr.tokens for pr in prompts)
        return prompts, {"id": "pooling-" + secrets.token_hex(8), "object": "list",
                         "created": int(time.time()), "model": self.config.model, "data": data,
                         "usage": _usage(total)}

    async def classify(self, request: web.Request) -> web.Response:
        return await self._answer(request, self._classify)

    def _classify(self, body: dict[str, Any]) -> tuple[list[Prompt], dict[str, Any]]:
        prompts = self._inputs(body)
        data = []
        for i, pr in enumerate(prompts):
            logits = self.embed(pr.words)[:NUM_LABELS]
            top = max(logits)
            exps = [math.exp(x - top) for x in logits]
            probs = [e / sum(exps) for e in exps]
            label = max(range(NUM_LABELS), key=probs.__getitem__)
            data.append({"index": i, "label": f"LABEL_{label}", "probs": probs, "num_classes": NUM_LABELS})
        total = sum(pr.tokens for pr in prompts)
        return prompts, {"id": "classify-" + secrets.token_hex(8), "object": "list",
                         "created": int(time.time()), "model": self.config.model, "data": data,
                         "usage": _usage(total)}

    async def score(self, request: web.Request) -> web.Response:
        return await self._answer(request, self._score)

    def _pairs(self, body: dict[str, Any], first: str, second: str) -> Pairs:
        """The two sides paired as vLLM pairs them (1:1, 1:N or N:N); each text is embedded once, so
        the engine runs and the usage count every distinct text once (one query against N documents)."""
        queries, docs = self._inputs(body, first), self._inputs(body, second)
        if len(queries) != 1 and len(queries) != len(docs):
            raise p.semantic_error("Input lengths must be either 1:1, 1:N or N:N", first, len(queries))
        texts = [*queries, *docs]
        return Pairs(queries * len(docs) if len(queries) == 1 else queries, docs, texts,
                     sum(t.tokens for t in texts))

    def _score(self, body: dict[str, Any]) -> tuple[list[Prompt], dict[str, Any]]:
        names = next((pair for pair in _SCORE_FIELDS if pair[0] in body and pair[1] in body),
                     _SCORE_FIELDS[0])
        pairs = self._pairs(body, *names)
        data = [{"index": i, "object": "score", "score": self.cosine(q.words, d.words)}
                for i, (q, d) in enumerate(zip(pairs.queries, pairs.docs, strict=True))]
        return pairs.texts, {"id": "score-" + secrets.token_hex(8), "object": "list",
                             "created": int(time.time()), "model": self.config.model, "data": data,
                             "usage": _usage(pairs.tokens)}

    async def rerank(self, request: web.Request) -> web.Response:
        return await self._answer(request, self._rerank)

    def _rerank(self, body: dict[str, Any]) -> tuple[list[Prompt], dict[str, Any]]:
        if isinstance(body.get("query"), list):
            raise p.field_error("string_type", "query", "Input should be a valid string", body["query"])
        pairs = self._pairs(body, "query", "documents")
        top_n = p.get_field(body, "top_n", int, "int_type", "Input should be a valid integer") or 0
        texts = _items(body["documents"]) or []
        scores = [self.cosine(q.words, d.words) for q, d in zip(pairs.queries, pairs.docs, strict=True)]
        order = sorted(range(len(scores)), key=scores.__getitem__, reverse=True)
        results = [{"index": i,
                    "document": {"text": t if isinstance(t := texts[i], str) else None, "multi_modal": None},
                    "relevance_score": scores[i]} for i in order]
        if 0 < top_n < len(results):
            results = results[:top_n]
        return pairs.texts, {"id": "score-" + secrets.token_hex(8), "model": self.config.model,
                             "usage": {"prompt_tokens": pairs.tokens, "total_tokens": pairs.tokens},
                             "results": results}


@dataclass(frozen=True)
class Pairs:
    queries: list[Prompt]  # one per document
    docs: list[Prompt]
    texts: list[Prompt]  # each distinct text once: what the engine runs
    tokens: int


def _items(value: Any) -> list[str | list[int]] | None:
    """vLLM's ``str | list[str] | list[int] | list[list[int]]`` as a list of prompts (None: not one)."""
    if isinstance(value, str):
        return [value]
    if p.is_token_ids(value) and value:
        return [list(value)]
    if isinstance(value, list) and all(isinstance(v, str) or (p.is_token_ids(v) and v) for v in value):
        return list(value)
    return None


def _encode(vector: list[float], fmt: str) -> list[float] | str:
    if fmt == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
