"""Reading the text fields of a ``multipart/form-data`` body (the audio routes): the body is read
whole first — within ``[http] max_audio_bytes``, refused while it is read when larger — and forwarded
as the client sent it, boundary and all; only the small fields routing needs are picked out here.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from ..errors import BadRequest, UnsupportedMediaType

__all__ = ["boundary_of", "form_fields"]

_NAME = re.compile(rb'(?i)content-disposition:\s*form-data\s*;(?:[^\r\n]*?;)?\s*name="([^"]*)"')
_FILENAME = re.compile(rb'(?i)filename\*?=')
_MAX_FIELD_BYTES = 64 * 1024  # a text field routerd reads; a larger one is not a model name


def boundary_of(content_type: str) -> bytes:
    """The boundary of a ``multipart/form-data`` content type, or :class:`UnsupportedMediaType`."""
    media, _, params = content_type.partition(";")
    if media.strip().lower() != "multipart/form-data":
        raise UnsupportedMediaType(f"this route takes multipart/form-data (an audio file and a `model` "
                                   f"field), not {media.strip() or 'a body without a Content-Type'}")
    for param in params.split(";"):
        key, _, value = param.strip().partition("=")
        if key.strip().lower() == "boundary" and value.strip().strip('"'):
            return value.strip().strip('"').encode("latin-1", "replace")
    raise BadRequest("the multipart/form-data Content-Type has no boundary")


def form_fields(body: bytes, content_type: str, names: Iterable[str]) -> dict[str, str]:
    """The text fields ``names`` of the form (file parts are skipped, not decoded)."""
    delimiter = b"--" + boundary_of(content_type)
    wanted = set(names)
    out: dict[str, str] = {}
    if delimiter not in body:
        raise BadRequest("the multipart body has no part with the Content-Type's boundary")
    for part in body.split(delimiter)[1:]:
        if part.startswith(b"--"):
            break  # the closing delimiter
        head, sep, value = part.partition(b"\r\n\r\n")
        if not sep:
            continue
        match = _NAME.search(head)
        if match is None or _FILENAME.search(head):
            continue
        name = match.group(1).decode("utf-8", "replace")
        if name in wanted and name not in out:
            if value.endswith(b"\r\n"):
                value = value[:-2]
            if len(value) > _MAX_FIELD_BYTES:
                raise BadRequest(f"the form field `{name}` is larger than {_MAX_FIELD_BYTES} bytes",
                                 param=name)
            try:
                out[name] = value.decode()
            except UnicodeDecodeError:
                raise BadRequest(f"the form field `{name}` is not UTF-8", param=name) from None
    return out
