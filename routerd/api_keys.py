"""How an API key may be written in the config, and what routerd keeps of it: a SHA-256 digest.

Three forms, for ``http.api_keys`` and every ``[[tenants]] api_keys`` alike:

- ``"sk-…"`` — the key itself (fine for tests and local use; the file then holds a secret);
- ``"sha256:<64 hex digits>"`` — the key's SHA-256 (``printf %s "$KEY" | sha256sum``): the file holds
  nothing that opens the API;
- ``"env:VAR"`` — the key is the value of environment variable ``VAR`` (systemd's
  ``EnvironmentFile=``), read when the config is loaded.

A request's bearer token is hashed once and looked up in a dict of digests, so the check costs the
same for one key or ten thousand, and a lookup by digest leaks nothing about the key through timing
(the attacker does not choose the digest's bytes).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping

__all__ = ["ENV_PREFIX", "HASH_PREFIX", "KeyFormError", "digest", "key_digest", "resolve_env"]

HASH_PREFIX = "sha256:"
ENV_PREFIX = "env:"
_HEX64 = re.compile(r"[0-9a-fA-F]{64}")
_VAR = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class KeyFormError(ValueError):
    """A key written in a form that cannot be used; the message says why (never the key itself)."""


def digest(token: bytes) -> bytes:
    """The SHA-256 of a presented key."""
    return hashlib.sha256(token).digest()


def resolve_env(spec: str, environ: Mapping[str, str]) -> str:
    """``spec`` with an ``env:VAR`` form replaced by the variable's value; other forms unchanged."""
    if not spec.startswith(ENV_PREFIX):
        return spec
    var = spec[len(ENV_PREFIX):]
    if not _VAR.fullmatch(var):
        raise KeyFormError(f"{spec!r}: expected env:<VARIABLE_NAME>")
    value = environ.get(var, "")
    if not value:
        raise KeyFormError(f"env:{var}: the environment variable is not set (or empty)")
    return value


def key_digest(spec: str) -> bytes:
    """The digest a configured key (plain or ``sha256:<hex>``, ``env:`` already resolved) matches."""
    if not spec:
        raise KeyFormError("empty key")
    if spec.startswith(HASH_PREFIX):
        hexdigest = spec[len(HASH_PREFIX):]
        if not _HEX64.fullmatch(hexdigest):
            raise KeyFormError("sha256: must be followed by 64 hexadecimal digits")
        return bytes.fromhex(hexdigest)
    return digest(spec.encode("utf-8", "surrogateescape"))
