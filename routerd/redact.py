"""Keeping secrets out of what routerd shows: logs, status, admin replies and the files it writes.

Two layers. Where routerd itself shows a URL it passes it through :func:`url` first (a password in the
userinfo or a secret-looking query parameter becomes ``***``; the user name stays, so an operator can
still tell which credentials are in use). Under that, :class:`Redactor` is a structlog processor that
every log event goes through: it redacts URL credentials found in any string, replaces the values of
the secrets the config holds (API keys, the admin key, Redis and engine passwords, secret-looking
engine environment) wherever they appear, and masks fields whose *name* says they hold a secret.
"""

from __future__ import annotations

import enum
import functools
import os
import re
import sys
from collections.abc import Iterable, Mapping, MutableMapping
from typing import Any
from urllib.parse import urlsplit, urlunsplit

MASK = "***"
MIN_SECRET_CHARS = 4  # shorter values would mask unrelated text everywhere; no real key is this short

_USERINFO = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^\s/@:\"'<>]*):[^\s/\"'<>]*@")
_QUERY = re.compile(r"(?i)(?P<head>[?&;](?:password|passwd|pass|pwd|secret|token|access_token|api[_-]?key"
                    r"|auth)=)[^&;#\s\"'<>]*")
# an Authorization value: "Bearer <token>" anywhere, "Basic <credentials>" after the header's name
_CREDENTIAL = re.compile(r"(?P<head>\bBearer\s+|(?i:authorization)\W{0,4}Basic\s+)[A-Za-z0-9._~+/=-]{4,}")
_QUERY_STRING = re.compile(r"\?[^\s\"'<>#]+")
# a header line, or one that lacks its colon (aiohttp quotes the line it could not parse)
_HEADER_LINE = re.compile(r"(?P<head>(?P<name>[A-Za-z0-9_-]+)(?:[ \t]*:[ \t]*|[ \t]+))[^\s\"'<>][^\n\"'<>]*")
_SECRET_WORDS = frozenset({"password", "passwd", "pwd", "pass", "secret", "token", "credential",
                           "credentials", "authorization", "auth", "apikey", "bearer"})
_KEY_OWNERS = frozenset({"api", "admin", "private", "access", "secret"})  # api_key, admin_key, …
_PLAIN = frozenset({str, int, float, bool, type(None)})  # field types value() may return as they are


def url(value: str) -> str:
    """``value`` with the password of its userinfo and secret query parameters replaced by ``***``."""
    try:
        parts = urlsplit(value)
        password = parts.password
    except ValueError:  # not parseable as a URL (a bad port, a broken IPv6 literal): redact as text
        return text(value)
    if password is not None:
        user, _, hostport = parts.netloc.rpartition("@")
        name = user.split(":", 1)[0]
        parts = parts._replace(netloc=f"{name}:{MASK}@{hostport}")
        value = urlunsplit(parts)
    return _QUERY.sub(rf"\g<head>{MASK}", value)


def warn_argv(prog: str, what: str, instead: str) -> None:
    """Tell the operator that a secret they gave on the command line is in the process list."""
    print(f"{prog}: warning: {what} is visible to every user of this machine (ps, /proc/<pid>/cmdline); "
          f"{instead}", file=sys.stderr)


def warn_argv_url(prog: str, value: str, env: str = "ROUTERD_REDIS_URL") -> None:
    """:func:`warn_argv` for a ``--redis`` URL holding a password that came from the command line (not
    from ``env``, the option's default)."""
    if value and value != os.environ.get(env, "") and url(value) != value:
        warn_argv(prog, "the password in --redis", f"give the URL in ${env}, or the password in "
                  "$ROUTERD_REDIS_PASSWORD")


def text(value: str) -> str:
    """Free text with the credentials of every URL in it redacted (see :func:`url`), and the value
    of an ``Authorization`` header quoted in it (``Bearer …``, ``Basic …``)."""
    if "@" in value:
        value = _USERINFO.sub(rf"\g<head>:{MASK}@", value)
    if "=" in value:
        value = _QUERY.sub(rf"\g<head>{MASK}", value)
    if "Bearer" in value or "Basic" in value:
        value = _CREDENTIAL.sub(rf"\g<head>{MASK}", value)
    return value


def request_head(value: str) -> str:
    """Client input quoted from a request's head (aiohttp's words on a malformed request line or header
    line), as it may be logged: every query-string value masked whatever its parameter's name (a
    tenant's key may be configured only as its SHA-256, so the log cannot know its value), and the
    rest of a header line whose name says it holds a secret (``X-Api-Key: …``); then :func:`text`."""
    if "?" in value:
        value = _QUERY_STRING.sub(_mask_query, value)
    if ":" in value:
        value = _HEADER_LINE.sub(lambda m: m["head"] + MASK if secret_name(m["name"]) else m[0], value)
    return text(value)


def _mask_query(m: re.Match[str]) -> str:
    params = re.split(r"([&;])", m[0][1:])
    return "?" + "".join(p if p in {"&", ";"} or not p else
                         (p.partition("=")[0] + "=" + MASK if "=" in p else MASK) for p in params)


@functools.lru_cache(maxsize=4096)  # every log line asks it of each of its field names, the same few
def secret_name(name: str) -> bool:
    """Whether a field or variable called ``name`` holds a secret (``HF_TOKEN``, ``api_keys``, …).

    Matched on whole words so that ``max_tokens`` or a Redis ``key`` are not taken for one.
    """
    words = [w for w in re.split(r"[^a-z0-9]+", name.lower()) if w]
    for i, w in enumerate(words):
        if w in _SECRET_WORDS:
            return True
        if w in {"key", "keys"} and i > 0 and words[i - 1] in _KEY_OWNERS:
            return True
    return False


def shown(name: str, value: Any) -> Any:
    """A config value as it may be shown under the key ``name`` (a log line, a reload diff)."""
    if secret_name(name):
        return MASK if value else value
    if isinstance(value, str):
        return url(value) if "://" in value else value
    if isinstance(value, list):
        return [shown(name, v) for v in value]
    return value


def argv(args: list[str]) -> list[str]:
    """A command line as it may be written down: the value of a secret flag (``--api-key K``,
    ``--hf-token=T``) masked, URLs without their passwords."""
    out: list[str] = []
    mask_next = False
    for arg in args:
        flag, eq, _ = arg.partition("=")
        if mask_next:
            out.append(MASK)
        elif arg.startswith("-") and eq and secret_name(flag.lstrip("-")):
            out.append(f"{flag}={MASK}")
        else:
            out.append(text(arg))
        mask_next = arg.startswith("-") and not eq and secret_name(arg.lstrip("-"))
    return out


class Redactor:
    """The structlog processor: no secret leaves in a log event, whatever field or text carries it.

    ``learn`` adds the config's secret values (:func:`routerd.config.secret_values`; at start-up and on
    every reload; values are never forgotten, so a line about the previous config is masked too).
    """

    def __init__(self) -> None:
        self._secrets: list[str] = []
        self._plain_names: dict[tuple[str, ...], bool] = {}  # a line's field names → none is a secret's

    def learn(self, secrets: Iterable[str]) -> None:
        new = {s for s in secrets if len(s) >= MIN_SECRET_CHARS} - set(self._secrets)
        if new:
            # Longest first, so a secret that contains another is masked whole.
            self._secrets = sorted([*self._secrets, *new], key=len, reverse=True)

    def text(self, value: str) -> str:
        value = text(value)
        for secret in self._secrets:
            if secret in value:
                value = value.replace(secret, MASK)
        return value

    def value(self, name: str, value: Any) -> Any:
        """``value`` (a field called ``name``) with every secret in it masked, walking containers."""
        kind = type(value)
        if kind is str:  # most fields of most lines: the checks below in their order, for a str
            if secret_name(name):
                return MASK
            if self._secrets or "@" in value or "=" in value or "Bearer" in value or "Basic" in value:
                return self.text(value)
            return value  # nothing in it that text() would touch
        if kind is int or kind is float or value is None or isinstance(value, bool | int | float | enum.Enum):
            return value
        if secret_name(name):
            return MASK
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, Mapping):
            return {k: self.value(str(k), v) for k, v in value.items()}
        if isinstance(value, list | tuple | set | frozenset):
            return [self.value(name, v) for v in value]
        return self.text(repr(value))  # what the JSON renderer would fall back to, masked

    def __call__(self, logger: Any, method: str, event: MutableMapping[str, Any]) -> dict[str, Any]:
        # exc_info stays an exception object for the console renderer (whose output is redacted
        # whole by render()); the JSON chain formats it into the "exception" text before this runs.
        if self._untouched(event):
            return dict(event)
        return {k: v if k == "exc_info" else self.value(k, v) for k, v in event.items()}

    def _untouched(self, event: MutableMapping[str, Any]) -> bool:
        """Whether :meth:`value` would return every field as it is: only strs, numbers and None, no
        field named like a secret, and nothing in the strs that :meth:`text` would touch — checked
        over all of them at once, since every log line passes here (field by field was a quarter of
        the request's log line)."""
        if not set(map(type, event.values())) <= _PLAIN:
            return False
        names = tuple(event)
        plain_names = self._plain_names.get(names)
        if plain_names is None:
            if len(self._plain_names) >= 1024:
                self._plain_names.clear()
            plain_names = self._plain_names[names] = not any(map(secret_name, names))
        if not plain_names:
            return False
        joined = "\x1f".join([v for v in event.values() if type(v) is str])
        if "@" in joined or "=" in joined or "Bearer" in joined or "Basic" in joined:
            return False
        return not self._secrets or not any(secret in joined for secret in self._secrets)

    def render(self, renderer: Any) -> Any:
        """Wrap a renderer so its finished text is redacted too (tracebacks a renderer formats itself)."""

        def rendered(logger: Any, method: str, event: dict[str, Any]) -> Any:
            out = renderer(logger, method, event)
            return self.text(out) if isinstance(out, str) else out

        return rendered
