"""Closed-loop HTTP clients that check every answer: the load of the failover and node-loss rounds,
and of the tests that fault engines under traffic (failover, node loss, elastic fleets).

Its own module so the benchmarks that use it do not import one another (``failover`` runs the
``node_loss`` round, which needs this load).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp


@dataclass
class Load:
    """Closed-loop clients (plain or streaming); a failure is "before stream" unless a chunk had reached
    the client first — only those may end in an error event. The failover test uses it too.

    A stream that ends well but is not the whole generation (a token lost or repeated across a resume)
    counts in ``wrong_text``; ``resume_gaps`` are the client-side gaps across :meth:`fault` of the
    streams the faulted instance was serving, ``fault_ttfts`` the time to first token of streams sent
    in the second after it left rotation (:meth:`out`) — what a new request waited for its first token
    on the instances left, when the resumed streams went there too."""

    url: str
    model: str
    max_tokens: int = 24
    ok: int = 0
    failed_before_stream: int = 0
    failed_mid_stream: int = 0
    wrong_text: int = 0
    errors: list[str] = field(default_factory=list)
    resume_gaps: list[float] = field(default_factory=list)
    fault_ttfts: list[float] = field(default_factory=list)
    on_failure: Callable[[str], None] | None = None  # told of each failure as it happens (a test's timeline)
    _fault: tuple[str, float] = ("", 0.0)
    _out_at: float = -1.0

    def fault(self, instance: str) -> None:
        """``instance`` is being killed or stopped now."""
        self._fault = (instance, time.monotonic())

    def out(self) -> None:
        """The faulted instance left rotation now."""
        self._out_at = time.monotonic()

    async def client(self, session: aiohttp.ClientSession, stop: asyncio.Event, stream: bool) -> None:
        from routerd.sim_tokens import expected_text

        body = {"model": self.model, "prompt": "benchmark", "max_tokens": self.max_tokens, "stream": stream}
        want = expected_text(0, "benchmark", self.max_tokens)
        while not stop.is_set():
            sent = time.monotonic()
            try:
                async with session.post(f"{self.url}/v1/completions", json=body,
                                        timeout=aiohttp.ClientTimeout(total=60)) as resp:
                    if resp.status != 200:
                        self._fail(f"{resp.status}: {(await resp.text())[:120]}")
                        continue
                    if not stream:
                        text = (await resp.json())["choices"][0]["text"]
                        self.ok += text == want
                        self.wrong_text += text != want
                        continue
                    await self._stream(resp, want, sent)
            except (aiohttp.ClientError, TimeoutError) as e:
                self._fail(repr(e))

    async def _stream(self, resp: aiohttp.ClientResponse, want: str, sent: float) -> None:
        instance = resp.headers.get("X-Routerd-Instance", "")
        chunks, error, text, last = 0, False, [], 0.0
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            now = time.monotonic()
            faulted, at = self._fault
            if chunks and faulted == instance and last < at <= now:
                self.resume_gaps.append(now - last)
            if not chunks and 0.0 <= sent - self._out_at < 1.0:
                self.fault_ttfts.append(now - sent)
            last = now
            error = error or b'"error"' in line
            if not error:
                chunks += 1
                text.append(json.loads(line[6:])["choices"][0]["text"])
        if not error:
            self.ok += "".join(text) == want
            self.wrong_text += "".join(text) != want
        elif chunks:
            self.failed_mid_stream += 1
            if self.on_failure is not None:
                self.on_failure(f"mid-stream error after {chunks} chunk(s) from {instance}")
        else:
            self._fail("error before first chunk")

    def _fail(self, why: str) -> None:
        self.failed_before_stream += 1
        if self.on_failure is not None:
            self.on_failure(why)
        if len(self.errors) < 10:
            self.errors.append(why)
