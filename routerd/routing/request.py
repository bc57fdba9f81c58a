"""How a request becomes the :class:`~routerd.plugins.RequestView` routing policies see.

Built once per request where its body is already parsed (the HTTP ingress, a queue job), from the
head :func:`routerd.ingress.validate.read_head` decoded, and passed down to ``Router.choose``.

**The prompt as the engine will see it.** routerd runs neither the model's tokenizer nor its chat
template, so it works on text:

* a completion's ``prompt`` is its own text (a token-id prompt is used as ids: exact); of a batch of
  prompts the first one is hashed and all are counted;
* chat ``messages`` are rendered canonically, message after message: ``role``, a newline, then the
  content (text parts in order; another part — an image, audio — as its JSON, so two different images
  never look alike), ``name``/``tool_calls``/``tool_call_id`` when present, and a newline. Each
  message's rendering depends on that message alone, so a conversation's next turn starts with exactly
  the rendering of the turn before — what prefix caching rewards — and the same messages render the
  same whatever JSON spelling the client used (key order, spacing, ``\\u`` escapes).

**Tokens from bytes.** Where the fleet's engines are keyed (:mod:`routerd.routing.engine_cache.block_keys`:
their
tokenizer and chat template run here), the prompt's tokens are theirs, counted by that tokenizer
(``RequestView.engine_prompt_tokens``), and a token-id prompt counts its ids; otherwise the estimate
is the rendering's UTF-8 bytes × the fleet's tokens per byte, learned from what the engines count
(``Δvllm:prompt_tokens`` over the bytes routerd sent them between two scrapes, as decayed sums,
:class:`TokenRatio`), starting at 1 token per 4 bytes (English BPE).
Its error: a template adds a few tokens per message that the canonical rendering does not have, and a
template that injects text (a default system prompt, a date) adds more — both are folded into the
learned ratio as an average, so a request with unusually many short messages is underestimated by
a few tokens per message; text whose density differs from the fleet's mean (code, another script)
by its own difference; an image part counts as its URL's length, not as the hundreds of tokens the
engine spends on it. Engines shared with traffic that does not pass through routerd skew the ratio.

**Block keys.** The rendering's UTF-8 bytes are cut into blocks of ``routing.prefix_block_tokens`` × 4
bytes (a fixed width, so keys do not move when the ratio is relearned) and only full blocks are
keyed, up to ``routing.prefix_hash_max_tokens``. Key *i* is ``Σ_{j≤i} hash(block_j) ⊕ M_j``, with
``M_j`` a fixed random word per position: it stands for the whole prefix up to block *i*, in order,
and every step runs in C (one ``struct`` unpack cuts the blocks; ``map``/``accumulate`` do the rest)
— a loop in Python would cost several times more per block. A block does not fall on the engine's
token blocks; the prefix index turns matched bytes into tokens at the learned ratio.
"""

from __future__ import annotations

import random
import struct
from collections.abc import Callable, Sequence
from itertools import accumulate
from operator import xor
from typing import TYPE_CHECKING, Any

import msgspec

from ..config import RoutingConfig
from ..openai import ChatHead, ChatMessage, CompletionHead
from ..plugins import RequestView
from ..vllm_wire import block_hash
from .engine_cache import block_keys as engine_keys

if TYPE_CHECKING:
    from .engine_cache.keying_process import KeyingProcess

__all__ = ["BYTES_PER_TOKEN", "RequestView", "RequestViews", "TokenRatio", "block_keys", "render_chat"]

BYTES_PER_TOKEN = 4  # block width per token of routing.prefix_block_tokens, and the ratio's prior
PRIOR_WEIGHT_BYTES = 64.0  # the prior counts as this many bytes: the first prompt all but replaces it
HORIZON_BYTES = 4_000_000.0  # evidence beyond this is halved: the ratio follows a changing mix

_MIX_SEED = 0x5EED_B10C
_mix: list[int] = []  # M_j: grown (deterministically) as longer prompts need it, never shrunk
_encode = msgspec.json.Encoder().encode


def _mixers(n: int) -> list[int]:
    if len(_mix) < n:
        rng = random.Random(_MIX_SEED + len(_mix))
        _mix.extend(rng.getrandbits(63) for _ in range(n - len(_mix)))
    return _mix


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, list):
        return "".join(p["text"] if isinstance(p, dict) and isinstance(p.get("text"), str)
                       else _encode(p).decode() for p in content)
    return _encode(content).decode()


def render_chat(messages: Sequence[ChatMessage]) -> str:
    """The canonical rendering of chat ``messages``, as hashed and counted (joined once: a long
    conversation's text is copied as few times as can be)."""
    parts: list[str] = []
    for m in messages:
        content = m.content
        parts.append(m.role if type(m.role) is str else _encode(m.role).decode())
        parts.append("\n")
        if m.name is not None or m.tool_calls is not None or m.tool_call_id is not None:
            parts.append(_encode([m.name, m.tool_calls, m.tool_call_id]).decode())
        parts.append(content if type(content) is str else _content_text(content))
        parts.append("\n")
    return "".join(parts)


class _Cutter:
    """Cuts the first ``n`` blocks of ``width`` bytes off a prompt's bytes in C: ``struct`` formats of
    2**k blocks (built on first use, so at most twice the largest block count in all), one
    ``unpack_from`` per set bit of ``n``."""

    __slots__ = ("_formats", "width")

    def __init__(self, width: int) -> None:
        self.width = width
        self._formats: dict[int, struct.Struct] = {}

    def __call__(self, data: bytes, n: int) -> tuple[bytes, ...]:
        out: tuple[bytes, ...] = ()
        offset = 0
        while n:
            k = 1 << (n.bit_length() - 1)
            fmt = self._formats.get(k)
            if fmt is None:
                fmt = self._formats[k] = struct.Struct(f"{self.width}s" * k)
            out += fmt.unpack_from(data, offset)
            offset += k * self.width
            n -= k
        return out


def block_keys(blocks: Sequence[object]) -> tuple[int, ...]:
    """Chained keys of ``blocks`` (bytes, or tuples of token ids): key *i* = Σ_{j≤i} hash(block_j) ⊕ M_j."""
    return tuple(accumulate(map(xor, map(hash, blocks), _mixers(len(blocks)))))


def _engine_floor(view: RequestView) -> int:
    """The fewest tokens the prompt can have, by the engine's own tokens (its hittable full blocks and
    the last token): an estimate from bytes below it would price an exact hit above the prompt."""
    return len(view.engine_keys) * view.engine_block_tokens + 1 if view.engine_keys else 1


class TokenRatio:
    """A fleet's tokens per byte of canonical text: the engines' prompt-token counts over the bytes
    routerd sent them, as decayed sums (each halved past :data:`HORIZON_BYTES`), starting from the
    prior 1/:data:`BYTES_PER_TOKEN` weighted as :data:`PRIOR_WEIGHT_BYTES` bytes."""

    __slots__ = ("_bytes", "_tokens", "value")

    def __init__(self) -> None:
        self._bytes = PRIOR_WEIGHT_BYTES
        self._tokens = PRIOR_WEIGHT_BYTES / BYTES_PER_TOKEN
        self.value = 1.0 / BYTES_PER_TOKEN

    def add(self, tokens: float, nbytes: float) -> None:
        """``tokens`` counted by an engine for ``nbytes`` bytes routerd sent it."""
        if nbytes <= 0.0 or tokens <= 0.0:
            return
        self._tokens += tokens
        self._bytes += nbytes
        if self._bytes > HORIZON_BYTES:
            self._tokens /= 2
            self._bytes /= 2
        # Bounded: no tokenizer makes a byte more than ~2 tokens or fewer than 1/16 of one.
        self.value = min(max(self._tokens / self._bytes, 1 / 16), 2.0)


def _no_block_size(fleet: str) -> int | None:
    return None


class RequestViews:
    """Builds the request views of one router: the hashing settings and each fleet's :class:`TokenRatio`."""

    def __init__(self, cfg: RoutingConfig, *,
                 keyers: dict[str, tuple[engine_keys.EngineKeyer, int | None, bytes]] | None = None,
                 learned_block_size: Callable[[str], int | None] | None = None,
                 keying: KeyingProcess | None = None,
                 adapter_of: Callable[[str, str], tuple[str, str] | None] | None = None) -> None:
        self.ratios: dict[str, TokenRatio] = {}
        # fleet → how its engines key blocks (keyer, block size if configured, first parent); and the
        # block size the engines' own events state, for a fleet whose config does not say
        self.keyers = keyers if keyers is not None else {}
        self.learned_block_size: Callable[[str], int | None] = learned_block_size or _no_block_size
        # long prompts are keyed there when set (routerd.routing.engine_cache.keying_process), else in a
        # thread
        self.keying = keying
        # (fleet, model) → the LoRA adapter's (name, path) when the model names one of the fleet's
        # adapters (routerd.routing.adapters): its blocks are other blocks, as in the engines' cache
        self.adapter_of = adapter_of
        self.configure(cfg)

    def configure(self, cfg: RoutingConfig) -> None:
        self.block_tokens = cfg.prefix_block_tokens
        self.block_bytes = cfg.prefix_block_tokens * BYTES_PER_TOKEN
        self.max_blocks = cfg.prefix_hash_max_tokens // cfg.prefix_block_tokens
        self._cut = _Cutter(self.block_bytes)

    def ratio(self, fleet: str) -> TokenRatio:
        r = self.ratios.get(fleet)
        if r is None:
            r = self.ratios[fleet] = TokenRatio()
        return r

    def current(self, view: RequestView) -> RequestView:
        """``view`` with its token figures at the fleet's tokens per byte as learned by now (the same
        view when they have not moved; a token-id prompt's never do)."""
        if not view.prompt_bytes:
            return view
        ratio = self.ratio(view.fleet).value
        block_tokens = self.block_bytes * ratio
        if block_tokens == view.block_tokens:
            return view
        tokens = view.engine_prompt_tokens or max(_engine_floor(view), round(view.prompt_bytes * ratio))
        return msgspec.structs.replace(view, prompt_tokens=tokens, block_tokens=block_tokens)

    def bare(self, fleet: str, endpoint: str, *, session: str | None = None,
             priority: int = 0) -> RequestView:
        """A view that knows nothing of the prompt (a caller without the parsed body)."""
        return RequestView(fleet=fleet, endpoint=endpoint, session=session, priority=priority)

    def build(self, fleet: str, endpoint: str, head: CompletionHead | ChatHead, *,
              session: str | None = None, priority: int = 0) -> RequestView:
        """:meth:`_build`, for an adapter's request its block keys made the adapter's (another adapter's
        prefix is another cache, in routerd's model as in the engines')."""
        view = self._build(fleet, endpoint, head, session=session, priority=priority)
        found = self.adapter_of(fleet, head.model) if self.adapter_of is not None else None
        if found is None:
            return view
        salt = hash(found)
        return msgspec.structs.replace(view, adapter=found[0],
                                       block_keys=tuple(hash((salt, k)) for k in view.block_keys))

    def _build(self, fleet: str, endpoint: str, head: CompletionHead | ChatHead, *,
               session: str | None = None, priority: int = 0) -> RequestView:
        """The view of a request whose body ``head`` (:func:`routerd.ingress.validate.read_head`) was
        read for ``endpoint``; ``session`` is the caller's (``X-Session-Id``, a job's ``session``),
        else the body's ``user`` when it is a string."""
        if session is None and isinstance(head.user, str) and head.user:
            session = head.user
        max_tokens = head.max_tokens
        if max_tokens is None and isinstance(head, ChatHead):
            max_tokens = head.max_completion_tokens
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool):
            max_tokens = None
        if isinstance(head, ChatHead):
            text, more = render_chat(head.messages), 0
        elif isinstance(head.prompt, str):
            text, more = head.prompt, 0
        else:
            prompt: list[Any] = head.prompt
            first = prompt[0] if prompt else None
            if not isinstance(first, str):
                return self._ids_view(fleet, endpoint, prompt, max_tokens, session, priority)
            # A batch of texts: the first is hashed, all are counted.
            text, more = first, sum(len(p.encode()) for p in prompt[1:] if isinstance(p, str))
        data = text.encode("utf-8", "surrogatepass")
        n = min(len(data) // self.block_bytes, self.max_blocks)
        nbytes = len(data) + more
        ratio = self.ratio(fleet).value
        return RequestView(fleet=fleet, endpoint=endpoint, prompt_tokens=max(1, round(nbytes * ratio)),
                           prompt_bytes=nbytes, max_tokens=max_tokens,
                           block_keys=block_keys(self._cut(data, n)) if n else (),
                           block_tokens=self.block_bytes * ratio, session=session, priority=priority)

    async def with_engine_keys(self, view: RequestView, head: CompletionHead | ChatHead) -> RequestView:
        """``view`` with the block keys its fleet's engines will compute (see
        :mod:`routerd.routing.engine_cache.block_keys`), when the fleet has a keyer and a known block size."""
        keyer = self.keyers.get(view.fleet)
        if keyer is None:
            return view
        tokenizer, block_size, root = keyer
        block_size = block_size or self.learned_block_size(view.fleet)
        if not block_size:
            return view
        keyed = None
        found = self.adapter_of(view.fleet, view.adapter) if view.adapter and self.adapter_of else None
        extra = block_hash.lora_extra(*found) if found is not None else None
        if self.keying is not None and engine_keys.prompt_size(head) > engine_keys.INLINE_MAX:
            keyed = await self.keying.keyed(view.fleet, head, block_size, root, hittable=True, extra=extra)
        if keyed is None:
            keyed = await engine_keys.keyed_for(tokenizer, head, block_size, root, hittable=True, extra=extra)
        view = msgspec.structs.replace(view, engine_keys=keyed.keys, engine_block_tokens=block_size,
                                       engine_prompt_tokens=keyed.tokens)
        # The engines' own count where their tokenizer could count the prompt: exact hits are then
        # priced, and their hit ratio predicted, in the engines' unit (an estimate only as a floor's
        # fallback, for a prompt the keyer could not read).
        return msgspec.structs.replace(view, prompt_tokens=keyed.tokens or max(view.prompt_tokens,
                                                                              _engine_floor(view)))

    def _ids_view(self, fleet: str, endpoint: str, prompt: list[Any], max_tokens: int | None,
                  session: str | None, priority: int) -> RequestView:
        if prompt and isinstance(prompt[0], list):  # a batch of token-id prompts
            ids: list[Any] = prompt[0]
            tokens = sum(len(p) for p in prompt if isinstance(p, list))
        else:
            ids, tokens = prompt, len(prompt)
        bt = self.block_tokens
        n = min(len(ids) // bt, self.max_blocks)
        try:
            keys = block_keys([tuple(ids[i * bt:(i + 1) * bt]) for i in range(n)]) if n else ()
        except TypeError:  # not token ids (objects in the array): the engine will refuse it
            keys = ()
        return RequestView(fleet=fleet, endpoint=endpoint, prompt_tokens=tokens, max_tokens=max_tokens,
                           block_keys=keys, block_tokens=float(bt), session=session, priority=priority)
