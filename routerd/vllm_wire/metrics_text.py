"""Prometheus text exposition → :class:`LoadSnapshot`, reading only the ``vllm:`` families routing needs.

A vLLM ``/metrics`` page is ~600 lines, most of them histogram buckets routing never looks at. Going
through ``prometheus_client.parser`` would build objects for every sample (milliseconds per scrape,
per instance, several times a second, on the event loop). This parser touches each line once, skips
everything that is not a wanted family by a dict lookup on the name, and parses labels only for the
``*_info`` gauges that carry configuration. It never blocks long enough to matter (≈0.2 ms per page).

Names are matched by *family*: a counter ``vllm:X`` is exposed as ``vllm:X_total`` (prometheus_client)
but older or hand-written exporters send ``vllm:X``; both count, and ``_created`` samples are ignored.
Of the histograms only the ``_sum`` and ``_count`` of the finished-request ones are read: the
deltas routing learns each instance's speed from (:mod:`routerd.speed`).
Both current and pre-0.12 names are understood (``kv_cache_usage_perc`` / ``gpu_cache_usage_perc``,
``prefix_cache_*`` / ``gpu_prefix_cache_*``); the current name wins when both appear. Samples are summed
over the ``engine`` label (a data-parallel server exports one series per engine); KV usage is averaged.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterable

from ..snapshot import LoadSnapshot

# family name → snapshot field. Old names map to a separate key so the new one can win.
_FAMILIES: dict[str, str] = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv",
    "vllm:gpu_cache_usage_perc": "kv_old",
    "vllm:generation_tokens": "generation_tokens",
    "vllm:prompt_tokens": "prompt_tokens",
    "vllm:num_preemptions": "preemptions",
    "vllm:request_success": "requests_finished",
    "vllm:prefix_cache_queries": "pq",
    "vllm:prefix_cache_hits": "ph",
    "vllm:gpu_prefix_cache_queries": "pq_old",
    "vllm:gpu_prefix_cache_hits": "ph_old",
    # finished-request histograms: only their _sum and _count (never the ~20 _bucket lines each)
    "vllm:request_inference_time_seconds_sum": "running_seconds_sum",
    "vllm:request_inference_time_seconds_count": "running_seconds_count",
    "vllm:request_prefill_time_seconds_sum": "prefill_seconds_sum",
    "vllm:request_prefill_time_seconds_count": "prefill_seconds_count",
    "vllm:request_decode_time_seconds_sum": "decode_seconds_sum",
    "vllm:request_decode_time_seconds_count": "decode_seconds_count",
    "vllm:request_generation_tokens_sum": "finished_generation_tokens",
    "vllm:request_prefill_kv_computed_tokens_sum": "prefill_computed_tokens",
}


def _family(sample: str) -> str:
    for suffix in ("_sum", "_count"):
        if sample.endswith(suffix):
            return sample[:-len(suffix)]
    return sample


# The ``# HELP`` names of the families read (prometheus_client names a counter's family ``X_total``).
_WANTED_BLOCKS = frozenset(b for name in _FAMILIES for b in (_family(name).encode(),
                                                                  _family(name).encode() + b"_total"))
_LABEL_RE = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')
_CAPACITY_LABELS = ("max_num_seqs",)


class ParseError(ValueError):
    """The text is not Prometheus exposition (an HTML error page, a truncated body…)."""


@functools.lru_cache(maxsize=64)
def _labels(text: str) -> tuple[tuple[str, str], ...]:
    """An ``*_info`` gauge's labels (dozens of them, the same on every scrape: read once)."""
    return tuple(_LABEL_RE.findall(text))


def _value(rest: str) -> float:
    # "<value> [timestamp]"
    part = rest.split(None, 1)[0] if rest else ""
    try:
        return float(part)
    except ValueError:
        raise ParseError(f"bad sample value {part!r}") from None


def _int_label(labels: dict[str, str], key: str) -> int | None:
    raw = labels.get(key)
    if raw is None:
        return None
    try:
        v = int(float(raw))
    except (ValueError, OverflowError):  # "NaN", "x"; "+Inf" or "1e400" overflow int()
        return None
    return v if v > 0 else None


def parse(text: str, scraped_at: float) -> LoadSnapshot:
    """Reduce one ``/metrics`` page to a snapshot stamped ``scraped_at`` (monotonic seconds).

    Raises :class:`ParseError` when the page holds no ``vllm:`` sample at all, so a proxy's error page
    answering 200 is reported as a failed scrape instead of an idle engine.
    """
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    info: dict[str, str] = {}
    if not _read(text.splitlines(), sums, counts, info):
        raise ParseError("no vllm: samples in the page")
    return _snapshot(sums, counts, info, scraped_at)


def parse_page(page: bytes, scraped_at: float) -> LoadSnapshot:
    """:func:`parse` of a page as it came off the wire, reading only the families routing uses.

    The fast path for prometheus_client's layout (vLLM's, the sim's): every family opens with its
    ``# HELP <name>`` line and its samples follow it. The page is cut at those lines (one C-level
    split), a family is kept by a set lookup on its name, and only the kept ones (≈20 of ≈110, and of
    the finished-request histograms only their ``_sum`` and ``_count`` lines) are decoded and read by
    :func:`parse`'s own line reader — so the result is the same snapshot, for a third of the CPU, and
    far less for an idle engine, whose blocks do not change (:func:`_family_block`).
    A page in another layout (no leading ``# HELP``, or no wanted sample found under the ``# HELP``
    lines) goes through :func:`parse` whole.
    """
    if page.startswith(b"# HELP "):
        blocks = page.split(b"\n# HELP ")
        blocks[0] = blocks[0][7:]
        sums: dict[str, float] = {}
        counts: dict[str, int] = {}
        info: dict[str, str] = {}
        seen = 0
        for block in blocks:
            name = block[:block.find(b" ")]  # prometheus_client writes "# HELP <name> <doc>"
            if name not in _WANTED_BLOCKS and not name.endswith(b"_info"):
                continue
            samples, labels, n = _family_block(name, block)
            seen += n
            for key, v, c in samples:  # in page order, as parse() adds them
                sums[key] = sums.get(key, 0.0) + v
                counts[key] = counts.get(key, 0) + c
            info.update(labels)
        if seen:
            return _snapshot(sums, counts, info, scraped_at)
    return parse(page.decode("utf-8", "replace"), scraped_at)


@functools.lru_cache(maxsize=1024)
def _family_block(name: bytes, block: bytes) -> tuple[tuple[tuple[str, float, int], ...],
                                                      tuple[tuple[str, str], ...], int]:
    """One family's block of a page (its ``# HELP`` line on): its sums and counts by snapshot key,
    its ``*_info`` labels, and how many ``vllm:`` samples it held.

    Memoized on the block's bytes: an idle engine's blocks are byte-identical scrape after scrape
    (its gauges 0, its counters still; the ``_created`` stamps are families of their own), and so
    are those of the idle instances of one model, so watching many idle instances reads each block
    once. A busy engine's blocks change and are read as they come (least recently used out first)."""
    bucket = name.decode("utf-8", "replace") + "_bucket"
    lines = [line for line in block.decode("utf-8", "replace").split("\n")[1:] if not line.startswith(bucket)]
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    info: dict[str, str] = {}
    seen = _read(lines, sums, counts, info)
    return tuple((k, v, counts[k]) for k, v in sums.items()), tuple(info.items()), seen


def _read(lines: Iterable[str], sums: dict[str, float], counts: dict[str, int],
          info: dict[str, str]) -> int:
    """Add the wanted samples of ``lines`` into ``sums``/``counts`` and the ``*_info`` labels into
    ``info``; returns how many ``vllm:`` samples were seen (wanted or not)."""
    seen = 0
    for line in lines:
        if not line.startswith("vllm:"):
            continue
        brace = line.find("{")
        space = line.find(" ")
        if brace != -1 and (space == -1 or brace < space):
            name = line[:brace]
            end = line.rfind("}")
            if end < brace:
                raise ParseError(f"unterminated label set in {line[:80]!r}")
            rest = line[end + 1:].strip()
            if name == _LORA_INFO:
                _lora_info(_labels(line[brace + 1:end]), rest, info)
                seen += 1
                continue
            if name.endswith("_info"):
                info.update(_labels(line[brace + 1:end]))
                seen += 1
                continue
        else:
            name = line[:space] if space != -1 else line
            rest = line[space + 1:].strip() if space != -1 else ""
        if name.endswith("_created"):
            continue
        key = _FAMILIES.get(name)
        if key is None and name.endswith("_total"):
            key = _FAMILIES.get(name[:-6])
        seen += 1
        if key is None:
            continue
        v = _value(rest)
        if math.isnan(v):
            continue
        sums[key] = sums.get(key, 0.0) + v
        counts[key] = counts.get(key, 0) + 1
    return seen


_LORA_INFO = "vllm:lora_requests_info"


def _lora_info(labels: tuple[tuple[str, str], ...], rest: str, info: dict[str, str]) -> None:
    """vLLM keeps one series per label set it ever exported, valued at the time it was last true:
    the one with the highest value is now."""
    try:
        at = _value(rest)
    except ParseError:
        return
    if at >= float(info.get("lora:at", "-inf")):
        d = dict(labels)
        info.update({"lora:at": repr(at), "lora:running": d.get("running_lora_adapters", ""),
                     "lora:waiting": d.get("waiting_lora_adapters", ""), "lora:max": d.get("max_lora", "")})


def _snapshot(sums: dict[str, float], counts: dict[str, int], info: dict[str, str],
              scraped_at: float) -> LoadSnapshot:
    kv_key = "kv" if "kv" in sums else "kv_old"
    kv = sums.get(kv_key, 0.0) / max(counts.get(kv_key, 1), 1)
    pq = "pq" if "pq" in sums else "pq_old"
    ph = "ph" if "ph" in sums else "ph_old"
    capacity = next((c for k in _CAPACITY_LABELS if (c := _int_label(info, k)) is not None), None)
    return LoadSnapshot(
        scraped_at=scraped_at,
        running=sums.get("running", 0.0),
        waiting=sums.get("waiting", 0.0),
        kv_usage=min(max(kv, 0.0), 1.0),
        capacity=capacity,
        generation_tokens=sums.get("generation_tokens", 0.0),
        prompt_tokens=sums.get("prompt_tokens", 0.0),
        preemptions=sums.get("preemptions", 0.0),
        requests_finished=sums.get("requests_finished", 0.0),
        prefix_cache_queries=sums.get(pq, 0.0),
        prefix_cache_hits=sums.get(ph, 0.0),
        num_gpu_blocks=_int_label(info, "num_gpu_blocks"),
        block_size=_int_label(info, "block_size"),
        running_seconds_sum=sums.get("running_seconds_sum", 0.0),
        running_seconds_count=sums.get("running_seconds_count", 0.0),
        prefill_seconds_sum=sums.get("prefill_seconds_sum", 0.0),
        prefill_seconds_count=sums.get("prefill_seconds_count", 0.0),
        decode_seconds_sum=sums.get("decode_seconds_sum", 0.0),
        decode_seconds_count=sums.get("decode_seconds_count", 0.0),
        finished_generation_tokens=sums.get("finished_generation_tokens", 0.0),
        prefill_computed_tokens=sums.get("prefill_computed_tokens"),
        lora_running=tuple(n for n in info.get("lora:running", "").split(",") if n),
        lora_waiting=tuple(n for n in info.get("lora:waiting", "").split(",") if n),
        max_lora=_int_label(info, "lora:max"),
    )
