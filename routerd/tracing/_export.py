"""Spans out: a bounded queue the loop appends to, and one thread that encodes and posts them.

The loop's share of a span's export is one locked append (:meth:`Exporter.add`). The thread takes
batches (at most :data:`BATCH` spans, or what is there every :data:`DELAY_S`), encodes them to an OTLP
``ExportTraceServiceRequest`` in protobuf's wire format by hand (:func:`encode` — a fixed schema of a
dozen fields, checked against ``opentelemetry-proto`` by the tests' receiver, which decodes with it),
and posts it over OTLP/HTTP with a timeout. When the collector is down or slow the queue fills;
spans beyond ``max_queue`` are dropped and counted, and a batch the collector did not take is counted
as failed: memory stays bounded whatever the collector does.
"""

from __future__ import annotations

import gzip
import ssl
import struct
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .. import log
from ._span import Span

_log = log.get("routerd.tracing")

BATCH = 512  # spans per export at most (the SDK's default)
DELAY_S = 5.0  # a batch leaves at least this often (the SDK's default)
_RETRY_STATUSES = frozenset({429, 502, 503, 504})  # OTLP/HTTP: retryable; anything else is final
_DOUBLE = struct.Struct("<d")
_FIXED64 = struct.Struct("<Q")


class Counts:
    """Spans waiting for export, exported, dropped: written by the loop (on span end) and by the
    exporting thread, so under a lock."""

    __slots__ = ("dropped_full", "exported", "failed", "lock", "waiting")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.waiting = 0
        self.exported = 0
        self.dropped_full = 0
        self.failed = 0


class Exporter:
    """The bounded queue and the thread that empties it to ``url`` (started at once, a daemon: a hung
    collector never keeps the process from exiting; :meth:`stop` is how spans are flushed)."""

    def __init__(self, url: str, resource: bytes, *, max_queue: int, timeout_s: float,
                 headers: Mapping[str, str] | None = None, gzip: bool = False, cafile: str = "",
                 delay_s: float = DELAY_S) -> None:
        self.url = url
        self.counts = Counts()
        self._resource = resource
        self._max = max_queue
        self._batch = min(BATCH, max_queue)  # a full queue leaves at once
        self._timeout_s = timeout_s
        self._delay_s = delay_s
        self._headers = {"Content-Type": "application/x-protobuf", **(headers or {})}
        self._gzip = gzip
        if gzip:
            self._headers["Content-Encoding"] = "gzip"
        self._ssl = ssl.create_default_context(cafile=cafile) if cafile else None
        self._queue: deque[Span] = deque()
        self._wake = threading.Condition(self.counts.lock)
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="routerd-tracing-export", daemon=True)
        self._thread.start()

    def add(self, span: Span) -> None:
        """Queue a finished span (the loop's side: a lock and an append), or drop and count it."""
        c = self.counts
        with c.lock:
            if c.waiting >= self._max:
                c.dropped_full += 1
                return
            c.waiting += 1
            self._queue.append(span)
            if len(self._queue) >= self._batch:
                self._wake.notify()

    def stop(self, timeout_s: float) -> bool:
        """Export what is queued and end the thread; blocks up to ``timeout_s`` (call it off the loop).
        False: the thread was still exporting when the time was up."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while True:
            with self._wake:
                if not self._stopping and len(self._queue) < self._batch:
                    self._wake.wait(self._delay_s)
                n = min(self._batch, len(self._queue))
                batch = [self._queue.popleft() for _ in range(n)]
                self.counts.waiting -= n
                done = self._stopping and not self._queue
            if batch:
                self._export(batch)
            if done:
                return

    def _export(self, batch: list[Span]) -> None:
        try:
            body = encode(self._resource, batch)
            ok = self._post(gzip.compress(body) if self._gzip else body)
        except Exception:  # noqa: BLE001 — the thread's loop boundary: a bad span loses its batch, not the thread
            _log.exception("tracing_export_error", spans=len(batch))
            ok = False
        with self.counts.lock:
            if ok:
                self.counts.exported += len(batch)
            else:
                self.counts.failed += len(batch)

    def _post(self, body: bytes) -> bool:
        """POST with retries (a retryable status or no connection, backing off 0.5 s, 1 s, …) until
        ``timeout_s`` from the first try is spent — the OTLP exporters' rule."""
        deadline = time.monotonic() + self._timeout_s
        backoff = 0.5
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                request = urllib.request.Request(self.url, data=body, headers=self._headers, method="POST")
                with urllib.request.urlopen(request, timeout=left, context=self._ssl) as response:
                    response.read()
                    return True
            except urllib.error.HTTPError as e:
                if e.code not in _RETRY_STATUSES:
                    _log.warning("tracing_export_refused", status=e.code, url=self.url)
                    return False
            except (OSError, TimeoutError):  # no connection, a reset, the timeout
                pass
            if self._stopping or time.monotonic() + backoff >= deadline:
                return False
            time.sleep(backoff)
            backoff *= 2


class Collector:
    """``routerd_trace_spans_*``: read at scrape time from the counts the exporter keeps."""

    def __init__(self, counts: Counts, max_queue: int) -> None:
        self._counts = counts
        self._max = max_queue

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        c = self._counts
        with c.lock:
            waiting, exported, full, failed = c.waiting, c.exported, c.dropped_full, c.failed
        yield CounterMetricFamily("routerd_trace_spans_exported", "Spans the collector accepted",
                                  value=exported)
        dropped = CounterMetricFamily("routerd_trace_spans_dropped", "Spans lost: queue_full (more "
                                      "than tracing.max_queue_spans waiting), export_failed (the "
                                      "collector down or refusing)", labels=["reason"])
        dropped.add_metric(["queue_full"], full)
        dropped.add_metric(["export_failed"], failed)
        yield dropped
        yield GaugeMetricFamily("routerd_trace_spans_waiting", f"Spans waiting for export (at most "
                                f"{self._max})", value=waiting)


# ---- OTLP protobuf, by hand (opentelemetry/proto/trace/v1/trace.proto, common/v1/common.proto) ---------
# Written for the export thread's CPU, which callgrind counts with the request's: short varints from a
# table, an attribute key's encoding (the same few dozen keys every span) from a cache.
_SMALL = [bytes((n,)) for n in range(0x80)]
_KEYS: dict[str, bytes] = {}
_MAX_KEYS = 4096


def _varint(n: int) -> bytes:
    if n < 0x80:
        return _SMALL[n]
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2): bytes, a string, a message."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _any_value(v: Any) -> bytes:
    """An ``AnyValue``: string 1, bool 2, int 3, double 4, array 5 (bool before int: it is one)."""
    if isinstance(v, str):
        b = v.encode()
        return b"\x0a" + _varint(len(b)) + b
    if isinstance(v, bool):
        return b"\x10\x01" if v else b"\x10\x00"
    if isinstance(v, int):
        return b"\x18" + _varint(v & 0xFFFF_FFFF_FFFF_FFFF)  # int64: two's complement, 10 bytes if < 0
    if isinstance(v, float):
        return b"\x21" + _DOUBLE.pack(v)
    if isinstance(v, list | tuple):
        return _field(5, b"".join(_field(1, _any_value(x)) for x in v))
    return _field(1, str(v).encode())


def _key(key: str) -> bytes:
    """``KeyValue.key`` with its tag, and the tag of the value that follows."""
    if (b := _KEYS.get(key)) is None:
        b = _field(1, key.encode()) + b"\x12"
        if len(_KEYS) < _MAX_KEYS:
            _KEYS[key] = b
    return b


def _attributes(tag: bytes, attributes: Mapping[str, Any]) -> bytes:
    """``attributes`` as repeated ``KeyValue`` fields whose tag (with wire type) is ``tag``."""
    out = []
    for key, value in attributes.items():
        if value is not None:
            v = _any_value(value)
            kv = _key(key) + _varint(len(v)) + v
            out.append(tag + _varint(len(kv)) + kv)
    return b"".join(out)


# a span attribute's whole field by (key, value), one table per value type (True == 1 == 1.0 must not
# share an entry): the strings, ints and bools that recur from span to span are encoded once
_KV: dict[type, dict[tuple[str, Any], bytes]] = {str: {}, int: {}, bool: {}}
_MAX_KV = 8192


def _kv(key: str, value: Any) -> bytes:
    if value is None:
        return b""
    kv = _key(key)
    v = _any_value(value)
    kv += _varint(len(v)) + v
    return b"\x4a" + _varint(len(kv)) + kv


def _span_attributes(attributes: Mapping[str, Any]) -> bytes:
    """A span's attributes as ``Span.attributes`` fields, looked up rather than encoded where the
    (key, value) recurs (a method, a path, a model, an instance, a status, a count)."""
    out = []
    for item in attributes.items():
        cache = _KV.get(type(item[1]))
        if cache is None:  # a float (a time: it does not recur), a list
            out.append(_kv(*item))
            continue
        b = cache.get(item)
        if b is None:
            b = _kv(*item)
            if len(cache) >= _MAX_KV:
                cache.clear()  # bounded: request ids never recur
            cache[item] = b
        out.append(b)
    return b"".join(out)


def _span(s: Span) -> bytes:
    parts = [b"\x0a\x10", s.trace_id.to_bytes(16, "big"), b"\x12\x08", s.span_id.to_bytes(8, "big")]
    if s.tracestate:
        parts.append(_field(3, s.tracestate.encode()))
    if s.parent_id:
        parts += (b"\x22\x08", s.parent_id.to_bytes(8, "big"))
    parts += (_field(5, s.name.encode()), b"\x30", _SMALL[s.kind], b"\x39", _FIXED64.pack(s.start_ns),
              b"\x41", _FIXED64.pack(s.end_ns), _span_attributes(s.attributes))
    for name, at, attributes in s.events or ():
        parts.append(_field(11, b"\x09" + _FIXED64.pack(at) + _field(2, name.encode())
                            + _attributes(b"\x1a", attributes)))
    if s.status:
        parts.append(_field(15, (_field(2, s.message.encode()) if s.message else b"")
                            + b"\x18" + _varint(s.status)))
    return b"".join(parts)


def resource(attributes: Mapping[str, Any]) -> bytes:
    """A ``Resource`` message (encoded once, at start-up)."""
    return _attributes(b"\x0a", attributes)


_SCOPE = _field(1, _field(1, b"routerd"))  # ScopeSpans.scope: InstrumentationScope{name}


def encode(resource_bytes: bytes, spans: Iterable[Span]) -> bytes:
    """``ExportTraceServiceRequest{resource_spans: [{resource, scope_spans: [{scope, spans}]}]}``."""
    scope_spans = _SCOPE + b"".join(_field(2, _span(s)) for s in spans)
    return _field(1, _field(1, resource_bytes) + _field(2, scope_spans))


__all__ = ["BATCH", "Collector", "Counts", "Exporter", "encode", "resource"]
