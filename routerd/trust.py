"""The shared secret: what lets one routerd process trust another, and what the engines trust.

Everything that carries authority between routerd processes through Redis (admin calls and their
answers, wake calls, the published fleet state, run-time replica counts, adapters) is *sealed*: an
HMAC-SHA256 tag under a key derived from ``[control] secret``, bound to the record's kind, so a record
of one kind cannot be replayed as another. Anyone who can write to Redis (queue producers must) can no
longer command routerd: an unsealed or forged record is refused (:class:`Rejected`), never acted on.

The engines routerd launches are started with an API key derived from the same secret (vLLM's
``VLLM_API_KEY``, in the engine's environment rather than on its command line), so every process of
a deployment (workers, followers on other hosts, a restarted routerd adopting its engines) can
compute it, and it never travels through Redis in clear.

Where the secret comes from, first found wins:

1. ``[control] secret`` (or ``ROUTERD_CONTROL_SECRET``), plain or ``env:VAR``; several replicas on
   other hosts must be given the same one;
2. else ``<state_dir>/secret``: generated on first start (mode 0600) and read again on every start, so
   one host's processes (its workers, and the daemon after a restart) agree without configuration.

A replica that holds another secret sees every sealed record as ``other_secret`` (the tag names the
secret's fingerprint), so it can say *why* it refuses to follow rather than only that it does.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import os
import secrets
from pathlib import Path

__all__ = ["MIN_SECRET_CHARS", "SECRET_FILE", "Rejected", "Trust", "Why"]

SECRET_FILE = "secret"
MIN_SECRET_CHARS = 16  # a configured secret shorter than this is refused by check-config
_MAGIC = b"RS1"  # format version of a sealed record
_FINGERPRINT_BYTES = 4
_TAG_BYTES = 32
_HEADER = len(_MAGIC) + _FINGERPRINT_BYTES + _TAG_BYTES


class Why(enum.Enum):
    """Why a record was refused; the value is the log and metric word."""

    UNSIGNED = "unsigned"  # not a sealed record at all (written by hand, or by a routerd without trust)
    OTHER_SECRET = "other_secret"  # sealed by a routerd holding a different secret
    FORGED = "forged"  # claims our secret's fingerprint but the tag does not match


class Rejected(Exception):
    """A shared record that must not be acted on."""

    def __init__(self, kind: str, why: Why) -> None:
        super().__init__(f"{kind}: {why.value}")
        self.kind = kind
        self.why = why


class Trust:
    """The keys one secret gives: a record sealer/opener and the engines' API key.

    The secret itself is never exposed by this object (no ``__repr__`` of it, no attribute): only
    derived keys leave it, each bound to one purpose by a distinct HMAC label.
    """

    __slots__ = ("_fingerprint", "_sign_key", "engine_api_key", "source")

    def __init__(self, secret: bytes, *, source: str) -> None:
        if not secret:
            raise ValueError("empty secret")
        self._sign_key = hmac.new(secret, b"routerd/records/v1", hashlib.sha256).digest()
        self._fingerprint = hmac.new(secret, b"routerd/fingerprint/v1", hashlib.sha256).digest()[
            :_FINGERPRINT_BYTES]
        #: The bearer token launched engines require (vLLM's ``VLLM_API_KEY``); the same on every process
        #: that holds the secret.
        self.engine_api_key = "rtd-" + hmac.new(secret, b"routerd/engine-api-key/v1",
                                                 hashlib.sha256).hexdigest()[:48]
        #: Where the secret came from, for logs and status: "config" or the file's path. Never the value.
        self.source = source

    def __repr__(self) -> str:
        return f"Trust(fingerprint={self.fingerprint}, source={self.source!r})"

    @property
    def fingerprint(self) -> str:
        """A short public id of the secret (an HMAC of it, which tells nothing of it): two processes
        with the same fingerprint hold the same secret. Safe to log and show."""
        return self._fingerprint.hex()

    @classmethod
    def load(cls, configured: str, state_dir: Path) -> Trust:
        """The secret from the config (``env:`` already resolved by the loader), else the state dir's
        file, generated there (0600, written atomically) the first time."""
        if configured:
            return cls(configured.encode(), source="config")
        path = state_dir / SECRET_FILE
        try:
            return cls(bytes.fromhex(path.read_text().strip()), source=str(path))
        except FileNotFoundError:
            pass
        state_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{SECRET_FILE}.{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, secrets.token_hex(32).encode() + b"\n")
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)  # loses to a sibling that wrote first: both then read the winner's
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
        return cls(bytes.fromhex(path.read_text().strip()), source=str(path))

    def _tag(self, kind: str, payload: bytes) -> bytes:
        mac = hmac.new(self._sign_key, kind.encode(), hashlib.sha256)
        mac.update(b"\0")
        mac.update(payload)
        return mac.digest()

    def seal(self, kind: str, payload: bytes) -> bytes:
        """``payload`` with a header that binds it to ``kind`` and this secret."""
        return _MAGIC + self._fingerprint + self._tag(kind, payload) + payload

    def open(self, kind: str, record: bytes) -> bytes:
        """The payload of a record sealed by :meth:`seal` for ``kind``, or :class:`Rejected`."""
        if len(record) < _HEADER or not record.startswith(_MAGIC):
            raise Rejected(kind, Why.UNSIGNED)
        start = len(_MAGIC)
        if not hmac.compare_digest(record[start:start + _FINGERPRINT_BYTES], self._fingerprint):
            raise Rejected(kind, Why.OTHER_SECRET)
        payload = record[_HEADER:]
        if not hmac.compare_digest(record[start + _FINGERPRINT_BYTES:_HEADER], self._tag(kind, payload)):
            raise Rejected(kind, Why.FORGED)
        return payload
