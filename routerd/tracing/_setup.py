"""Where spans go and how routerd and its engines learn it: ``[tracing]`` first, then the standard
``OTEL_*`` variables, read as every OpenTelemetry SDK reads them — and which of them routerd does not
implement (:func:`unsupported`: OTLP/gRPC, other samplers and exporters), named once at start-up."""

from __future__ import annotations

import os
import urllib.parse
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..config import TracingConfig

_TRACES_PATH = "/v1/traces"

# The samplers routerd implements (README, "Tracing"): all parent-based, a new trace sampled by ratio.
SAMPLERS = ("parentbased_traceidratio", "parentbased_always_on", "parentbased_always_off")
# The standard variables whose other values routerd does not implement: the values it does.
_VALUES = {"PROTOCOL": ("http/protobuf",), "COMPRESSION": ("gzip", "none")}  # OTEL_EXPORTER_OTLP_[TRACES_]…
_LISTS = {"OTEL_TRACES_EXPORTER": ("otlp", "none"), "OTEL_PROPAGATORS": ("tracecontext", "none")}
# Standard variables of the SDK's trace export that routerd does not read ([tracing] has its own keys).
_NOT_READ = ("OTEL_EXPORTER_OTLP_TIMEOUT", "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT",
             "OTEL_EXPORTER_OTLP_CLIENT_KEY", "OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY",
             "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE", "OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE",
             "OTEL_BSP_SCHEDULE_DELAY", "OTEL_BSP_EXPORT_TIMEOUT", "OTEL_BSP_MAX_QUEUE_SIZE",
             "OTEL_BSP_MAX_EXPORT_BATCH_SIZE")


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


def otlp_setting(environ: Mapping[str, str], name: str) -> str:
    """``OTEL_EXPORTER_OTLP_TRACES_<name>``, else ``OTEL_EXPORTER_OTLP_<name>`` (``""``: neither)."""
    return environ.get(f"OTEL_EXPORTER_OTLP_TRACES_{name}", "").strip() \
        or environ.get(f"OTEL_EXPORTER_OTLP_{name}", "").strip()


def unsupported(environ: Mapping[str, str]) -> list[str]:
    """The ``OTEL_*`` settings routerd does not implement, as ``NAME=value``: another protocol than
    OTLP/HTTP protobuf (``grpc``, ``http/json``), a sampler not in :data:`SAMPLERS`, an exporter or a
    propagator it does not have, and the SDK's export variables it does not read. routerd goes on as
    it does without them (OTLP/HTTP protobuf, parent-based ratio sampling, W3C ``traceparent``)."""
    out = []
    for name, values in _VALUES.items():  # the traces' own variable wins over the general one
        for var in (f"OTEL_EXPORTER_OTLP_TRACES_{name}", f"OTEL_EXPORTER_OTLP_{name}"):
            if value := environ.get(var, "").strip():
                if value.lower() not in values:
                    out.append(f"{var}={value[:50]}")
                break
    sampler = environ.get("OTEL_TRACES_SAMPLER", "").strip()
    if sampler and sampler.lower() not in SAMPLERS:
        out.append(f"OTEL_TRACES_SAMPLER={sampler[:50]}")
    for var, values in _LISTS.items():
        items = [v.strip() for v in environ.get(var, "").split(",") if v.strip()]
        if other := [v for v in items if v.lower() not in values]:
            out.append(f"{var}={','.join(other)[:50]}")
    out += [f"{var}={environ[var].strip()[:50]}" for var in _NOT_READ if environ.get(var, "").strip()]
    return out


def pairs(text: str) -> dict[str, str]:
    """``k1=v1,k2=v2``, URL-encoded: ``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_EXPORTER_OTLP_HEADERS``."""
    out: dict[str, str] = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if sep and key.strip():
            out[urllib.parse.unquote(key.strip())] = urllib.parse.unquote(value.strip())
    return out
