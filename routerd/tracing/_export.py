"""Spans out: a bounded queue the loop appends to, and one thread that encodes and posts them.

The loop's share of a span's export is an append to a deque (:meth:`Exporter.add`, no lock). The
thread takes batches (at most :data:`BATCH` spans, or what is there every :data:`DELAY_S`), encodes
them to an OTLP ``ExportTraceServiceRequest`` in protobuf's wire format by hand (:func:`encode` — a
fixed schema of a dozen fields, checked against ``opentelemetry-proto`` by the tests' receiver, which
decodes with it), and posts it over OTLP/HTTP with a timeout, on one kept-alive connection. When the
collector is down or slow the queue fills; spans beyond ``max_queue`` are dropped and counted, and a
batch the collector did not take is counted as failed: memory stays bounded whatever the collector does.
"""

from __future__ import annotations

import gzip
import http.client
import ssl
import struct
import threading
import time
import urllib.parse
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .. import log
from ._attributes import TTFB, TTFT, field_name, route_name
from ._span import Span

_log = log.get("routerd.tracing")

BATCH = 512  # spans per export at most (the SDK's default)
DELAY_S = 5.0  # a batch leaves at least this often (the SDK's default)
_RETRY_STATUSES = frozenset({429, 502, 503, 504})  # OTLP/HTTP: retryable; anything else is final
_DOUBLE = struct.Struct("<d")
_pack_double = _DOUBLE.pack
_FIXED64 = struct.Struct("<Q")
_LOW64 = (1 << 64) - 1


class Counts:
    """Spans waiting for export (the queue's length), exported, dropped. The loop alone appends and
    counts ``dropped_full``; the exporting thread alone pops and counts ``exported`` and ``failed``,
    under the lock (read at scrape time)."""

    __slots__ = ("dropped_full", "exported", "failed", "lock", "queue")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.queue: deque[Span] = deque()
        self.exported = 0
        self.dropped_full = 0
        self.failed = 0

    @property
    def waiting(self) -> int:
        return len(self.queue)


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
        parts = urllib.parse.urlsplit(url)
        self._https = parts.scheme == "https"
        self._host = parts.hostname or "localhost"
        self._port = parts.port
        self._path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self._conn: http.client.HTTPConnection | None = None  # the export thread's alone
        self._queue = self.counts.queue
        self._wake = threading.Condition(self.counts.lock)
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="routerd-tracing-export", daemon=True)
        self._thread.start()

    def add(self, span: Span) -> None:
        """Queue a finished span, or drop and count it: the loop's side is an append, no lock (a
        deque's append and popleft are atomic); the thread is woken only for a full batch."""
        queue = self._queue
        if len(queue) >= self._max:
            self.counts.dropped_full += 1
            return
        queue.append(span)
        if len(queue) >= self._batch:
            with self._wake:
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
                done = self._stopping and not self._queue
            if batch:
                self._export(batch)
            if done:
                self._close()
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
        ``timeout_s`` from the first try is spent — the OTLP exporters' rule. One connection, kept
        alive from batch to batch (a new one costs as much as encoding a batch of a few dozen spans);
        dropped after any failure, so that a late answer is never read as the next one's."""
        deadline = time.monotonic() + self._timeout_s
        backoff = 0.5
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                if self._conn is None:
                    self._conn = self._connect(left)
                conn = self._conn
                conn.timeout = left
                if conn.sock is not None:
                    conn.sock.settimeout(left)
                conn.request("POST", self._path, body, self._headers)
                with conn.getresponse() as response:
                    response.read()
                    status = response.status
                    if response.will_close:
                        self._close()
                if status < 300:
                    return True
                if status not in _RETRY_STATUSES:
                    _log.warning("tracing_export_refused", status=status, url=self.url)
                    return False
            except (OSError, http.client.HTTPException):  # no connection, a reset, the timeout
                self._close()
            if self._stopping or time.monotonic() + backoff >= deadline:
                return False
            time.sleep(backoff)
            backoff *= 2

    def _connect(self, timeout: float) -> http.client.HTTPConnection:
        if self._https:
            return http.client.HTTPSConnection(self._host, self._port, timeout=timeout,
                                               context=self._ssl or ssl.create_default_context())
        return http.client.HTTPConnection(self._host, self._port, timeout=timeout)

    def _close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()


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
            exported, failed = c.exported, c.failed
        waiting, full = c.waiting, c.dropped_full
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
# table; each attribute key's own encodings (:class:`_Key`) made once; a recurring value's whole field
# looked up, not encoded; a float's field its key's fixed head and eight bytes.
_SMALL = [bytes((n,)) for n in range(0x80)]


def _varint(n: int) -> bytes:
    if n < 0x80:
        return _SMALL[n]
    if n < 0x4000:  # a span's length, an attribute's: two bytes
        return bytes((n & 0x7F | 0x80, n >> 7))
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
        return b"\x21" + _pack_double(v)
    if isinstance(v, list | tuple):
        return _field(5, b"".join(_field(1, _any_value(x)) for x in v))
    return _field(1, str(v).encode())


def _attributes(tag: bytes, attributes: Mapping[str, Any]) -> bytes:
    """``attributes`` as repeated ``KeyValue`` fields whose tag (with wire type) is ``tag`` (a resource's,
    an event's: rare, so encoded plainly)."""
    out = []
    for key, value in attributes.items():
        if value is not None:
            kv = _field(1, key.encode()) + _field(2, _any_value(value))
            out.append(tag + _varint(len(kv)) + kv)
    return b"".join(out)


_MAX_VALUES = 256  # recurring values a key keeps encoded (cleared when full: request ids never recur)


class _Key:
    """One attribute name's encodings as a ``Span.attributes`` field (tag 9): the key's bytes, the head
    of a double's field (all but its eight bytes), and the whole field of each value that recurs (a
    method, a path, a model, an instance, a status, a count) — str and int kept apart, since
    ``1 == 1.0 == True`` in Python but not on the wire."""

    __slots__ = ("double", "false", "head", "ints", "name", "strs", "true")

    def __init__(self, name: str) -> None:
        self.name = name
        self.head = _field(1, name.encode()) + b"\x12"  # KeyValue.key, then the tag of its value
        self.double = b"\x4a" + _varint(len(self.head) + 10) + self.head + b"\x09\x21"
        self.true = self.whole(b"\x10\x01")
        self.false = self.whole(b"\x10\x00")
        self.strs: dict[str, bytes] = {}
        self.ints: dict[int, bytes] = {}

    def whole(self, value: bytes) -> bytes:
        """The attribute's field around an encoded ``AnyValue``."""
        kv = self.head + _varint(len(value)) + value
        return b"\x4a" + _varint(len(kv)) + kv

    def str_(self, v: str) -> bytes:
        if (b := self.strs.get(v)) is None:
            b = self.whole(_any_value(v))
            if len(self.strs) >= _MAX_VALUES:
                self.strs.clear()
            self.strs[v] = b
        return b

    def int_(self, v: int) -> bytes:
        if (b := self.ints.get(v)) is None:
            b = self.whole(_any_value(v))
            if len(self.ints) >= _MAX_VALUES:
                self.ints.clear()
            self.ints[v] = b
        return b


_MAX_KEYS = 1024  # names a table keeps (a fixed few dozen in practice)
_KEYS: dict[str, _Key] = {}  # by attribute name: set on a span directly
_FIELD_KEYS: dict[str, _Key] = {}  # by log field (_SKIP: not an attribute of the request's span)
_ROUTE_KEYS: dict[str, _Key] = {}  # by routing decision field
_TTFT = _Key(TTFT)


def _key(name: str) -> _Key:
    if (key := _KEYS.get(name)) is None:
        key = _Key(name)
        if len(_KEYS) >= _MAX_KEYS:
            _KEYS.clear()
        _KEYS[name] = key
    return key


_SKIP = _Key("")  # a log field that is no attribute of the request's span (the routing decision's)


def _learn(table: dict[str, _Key], field: str, namer: Callable[[str], str] | None) -> _Key:
    name = namer(field) if namer is not None else field
    key = _key(name) if name else _SKIP
    if len(table) >= _MAX_KEYS:
        table.clear()
    table[field] = key
    return key


def _encode_attributes(out: list[bytes], attributes: Mapping[str, Any], table: dict[str, _Key],
                       namer: Callable[[str], str] | None) -> None:
    """Append ``attributes``' fields to ``out``: each key found in ``table`` (learnt through ``namer``
    on first sight; None: the key is the name). ``namer`` set: only scalars count, as in a log line
    (a list there is not an attribute). This runs for every attribute of every span: few bytecodes."""
    append = out.append
    for field, v in attributes.items():
        if (key := table.get(field)) is None:
            key = _learn(table, field, namer)
        if key is _SKIP:
            continue
        t = type(v)
        if t is str:
            append(key.strs.get(v) or key.str_(v))
        elif t is float:
            append(key.double + _pack_double(v))
        elif t is int:
            append(key.ints.get(v) or key.int_(v))
        elif t is bool:
            append(key.true if v else key.false)
        elif v is not None and (namer is None or isinstance(v, str | int | float)):
            append(key.whole(_any_value(v)))


_IDS = struct.Struct(">2sQQ2sQ")  # trace_id (1) and span_id (2), each with its tag and length
_IDS_PARENT = struct.Struct(">2sQQ2sQ2sQ")  # … and parent_span_id (4): fields may come in any order
_TIMES = struct.Struct("<BQBQ")  # start_time_unix_nano (7), end_time_unix_nano (8): fixed64 each
_KIND = [b"\x30" + bytes((k,)) for k in range(6)]  # kind (6)
_NAMES: dict[str, bytes] = {}  # name (5) as a field, by name (a few: the span names are routerd's)


def _span(s: Span) -> bytes:
    t = s.trace_id
    if s.parent_id:
        ids = _IDS_PARENT.pack(b"\x0a\x10", t >> 64, t & _LOW64, b"\x12\x08", s.span_id, b"\x22\x08",
                               s.parent_id)
    else:
        ids = _IDS.pack(b"\x0a\x10", t >> 64, t & _LOW64, b"\x12\x08", s.span_id)
    if (name := _NAMES.get(s.name)) is None:
        name = _field(5, s.name.encode())
        if len(_NAMES) >= _MAX_KEYS:
            _NAMES.clear()
        _NAMES[s.name] = name
    parts = [ids, name, _KIND[s.kind], _TIMES.pack(0x39, s.start_ns, 0x41, s.end_ns)]
    if s.tracestate:
        parts.append(_field(3, s.tracestate.encode()))
    _encode_attributes(parts, s.attributes, _KEYS, None)
    if (fields := s.fields) is not None:  # a log field never names an attribute set on the span itself
        _encode_attributes(parts, fields, _FIELD_KEYS, field_name)
        ttfb = fields.get(TTFB)
        if type(ttfb) is float or type(ttfb) is int:
            parts.append(_TTFT.double + _pack_double(ttfb / 1000))
    if s.route is not None:
        _encode_attributes(parts, s.route, _ROUTE_KEYS, route_name)
    for event, at, attributes in s.events or ():
        parts.append(_field(11, b"\x09" + _FIXED64.pack(at) + _field(2, event.encode())
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
    parts = [_SCOPE]
    for s in spans:
        b = _span(s)
        parts += (b"\x12", _varint(len(b)), b)  # ScopeSpans.spans (2)
    scope_spans = b"".join(parts)
    return _field(1, _field(1, resource_bytes) + _field(2, scope_spans))


__all__ = ["BATCH", "Collector", "Counts", "Exporter", "encode", "resource"]
