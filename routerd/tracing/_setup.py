"""Where spans go and how routerd and its engines learn it: ``[tracing]`` first, then the standard
``OTEL_*`` variables, read as every OpenTelemetry SDK reads them."""

from __future__ import annotations

import os
import urllib.parse
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..config import TracingConfig

_TRACES_PATH = "/v1/traces"


def otlp_endpoint(cfg: TracingConfig, environ: Mapping[str, str]) -> str:
    """Where spans go (the full OTLP/HTTP traces URL), or ``""`` when tracing is off.

    ``[tracing] endpoint`` first; else ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` (used as it is), else
    ``OTEL_EXPORTER_OTLP_ENDPOINT`` (a base: ``/v1/traces`` is added), as every OpenTelemetry SDK reads
    them. ``OTEL_SDK_DISABLED=true`` or ``OTEL_TRACES_EXPORTER=none`` turn it off whatever is set."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true" \
            or environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
        return ""
    if cfg.endpoint:
        return _traces_url(cfg.endpoint)
    if url := environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip():
        return url
    if url := environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip():
        return _traces_url(url)
    return ""


def engine_env(cfg: TracingConfig, fleet: str, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """What a launched engine is told when routerd traces (``{}`` when not): routerd's collector,
    over OTLP/HTTP, as service ``vllm-<fleet>``; the vLLM launcher adds ``--otlp-traces-endpoint``."""
    endpoint = otlp_endpoint(cfg, os.environ if environ is None else environ)
    if not endpoint:
        return {}
    return {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": endpoint,
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", "OTEL_SERVICE_NAME": f"vllm-{fleet}"}


def _traces_url(base: str) -> str:
    base = base.rstrip("/")
    return base if base.endswith(_TRACES_PATH) else base + _TRACES_PATH


def _pairs(text: str) -> dict[str, str]:
    """``k1=v1,k2=v2``, URL-encoded: ``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_EXPORTER_OTLP_HEADERS``."""
    out: dict[str, str] = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if sep and key.strip():
            out[urllib.parse.unquote(key.strip())] = urllib.parse.unquote(value.strip())
    return out
