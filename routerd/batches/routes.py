"""The HTTP routes of the Batch API: ``/v1/files`` and ``/v1/batches``, OpenAI's shapes.

Each route authenticates its caller as the completion routes do (:func:`routerd.ingress.auth.authenticate`)
and answers only about that tenant's files and batches: another tenant's is 404, as one that never was.
Errors are OpenAI's (``{"error": {"message", "type", "param", "code"}}``, a string code).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from aiohttp import BodyPartReader, web

from ..errors import RouterdError
from ..ingress.auth import authenticate
from ..surface import ROUTES, Body
from ..tenants.service import Tenancy
from .runner import BatchRunner
from .wire import ApiError, batch_object, file_object, listing

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_FIELD_MAX = 4096  # a form field other than the file
# A batch's endpoint: every one the queue takes (a line is a queue job), so batches follow the queue's wire.
ENDPOINTS: tuple[str, ...] = tuple(p for p, r in ROUTES.items() if r.body is Body.JSON)


def add_batch_routes(app: web.Application, runner: BatchRunner, tenancy: Tenancy) -> None:
    """Register the routes on ``app`` (called by routerd/ingress/http.py's ``build_app``)."""
    routes = _Routes(runner, tenancy)
    app.router.add_post("/v1/files", _openai(routes.upload))
    app.router.add_get("/v1/files", _openai(routes.list_files))
    app.router.add_get("/v1/files/{id}", _openai(routes.get_file))
    app.router.add_get("/v1/files/{id}/content", _openai(routes.content))
    app.router.add_delete("/v1/files/{id}", _openai(routes.delete_file))
    app.router.add_post("/v1/batches", _openai(routes.create_batch))
    app.router.add_get("/v1/batches", _openai(routes.list_batches))
    app.router.add_get("/v1/batches/{id}", _openai(routes.get_batch))
    app.router.add_post("/v1/batches/{id}/cancel", _openai(routes.cancel_batch))


def _openai(handler: Handler) -> Handler:
    """The routes' errors in OpenAI's shape (routerd's own, an auth refusal say, included)."""
    async def wrapped(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as e:
            return web.json_response(e.body(), status=e.status)
        except RouterdError as e:
            return web.json_response(ApiError(e.status, e.message, param=e.param,
                                              type_=_type(e.status)).body(), status=e.status)

    return wrapped


def _type(status: int) -> str:
    return {401: "authentication_error", 403: "permission_error", 404: "invalid_request_error",
            429: "rate_limit_error"}.get(status, "invalid_request_error" if status < 500 else "server_error")


def _limit(request: web.Request, default: int, most: int) -> int:
    raw = request.query.get("limit", str(default))
    try:
        n = int(raw)
    except ValueError:
        raise ApiError(400, f"limit must be an integer, not {raw[:50]!r}", param="limit") from None
    if not 1 <= n <= most:
        raise ApiError(400, f"limit must be between 1 and {most}", param="limit")
    return n


class _Routes:
    def __init__(self, runner: BatchRunner, tenancy: Tenancy) -> None:
        self.files = runner.files
        self.batches = runner.store
        self.runner = runner
        self.tenancy = tenancy

    def _tenant(self, request: web.Request) -> str:
        return authenticate(request, self.tenancy.directory).name

    # files ---------------------------------------------------------------------------------------
    async def upload(self, request: web.Request) -> web.Response:
        tenant = self._tenant(request)
        if not request.content_type.startswith("multipart/"):
            raise ApiError(400, "POST /v1/files takes multipart/form-data with fields purpose and file")
        reader = await request.multipart()
        form: dict[str, str] = {}
        stored: dict[str, str] | None = None
        while (part := await reader.next()) is not None:
            if not isinstance(part, BodyPartReader):
                raise ApiError(400, "nested multipart is not a file upload")
            if part.name == "file" and stored is None:
                purpose = form.get("purpose", "batch")  # said after the file: checked below
                stored = await self.files.upload(tenant, part.filename or "upload.jsonl", purpose,
                                                 _pieces(part), expires_after_s=_expiry(form))
            elif part.name:
                value = await part.read_chunk(_FIELD_MAX + 1)
                if len(value) > _FIELD_MAX:
                    raise ApiError(400, f"form field {part.name[:50]!r} is too long")
                form[part.name] = value.decode(errors="replace")
        if stored is None:
            raise ApiError(400, "no file in the form (a field named 'file')", param="file")
        if form.get("purpose", "") != "batch":
            await self.files.delete(tenant, stored["id"])
            raise ApiError(400, f"purpose must be 'batch', not {form.get('purpose', '')[:50]!r}",
                           param="purpose")
        return web.json_response(file_object(stored))

    async def list_files(self, request: web.Request) -> web.Response:
        tenant = self._tenant(request)
        found, more = await self.files.page(tenant, after=request.query.get("after"),
                                            limit=_limit(request, 10_000, 10_000),
                                            purpose=request.query.get("purpose"))
        return web.json_response(listing([file_object(h) for h in found], more))

    async def _file(self, request: web.Request) -> tuple[str, dict[str, str]]:
        tenant = self._tenant(request)
        file_id = request.match_info["id"]
        h = await self.files.meta(tenant, file_id)
        if self.files.expired(h):
            if int(h.get("batches", "0")) == 0:
                await self.files.delete(tenant, file_id)
            raise ApiError(404, f"File {file_id} has expired", param="id", code="file_expired")
        return tenant, h

    async def get_file(self, request: web.Request) -> web.Response:
        _, h = await self._file(request)
        return web.json_response(file_object(h))

    async def content(self, request: web.Request) -> web.StreamResponse:
        _, h = await self._file(request)
        resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream",
                                           "Content-Length": h.get("bytes", "0")})
        await resp.prepare(request)
        async for piece in self.files.content(h):
            await resp.write(piece)
        await resp.write_eof()
        return resp

    async def delete_file(self, request: web.Request) -> web.Response:
        tenant = self._tenant(request)
        file_id = request.match_info["id"]
        await self.files.delete(tenant, file_id)
        return web.json_response({"id": file_id, "object": "file", "deleted": True})

    # batches -------------------------------------------------------------------------------------
    async def create_batch(self, request: web.Request) -> web.Response:
        tenant = self._tenant(request)
        try:
            body = json.loads(await request.read())
        except (ValueError, UnicodeDecodeError):
            raise ApiError(400, "the body must be a JSON object") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object")
        endpoint = body.get("endpoint")
        if endpoint not in ENDPOINTS:
            raise ApiError(400, f"endpoint must be one of {', '.join(ENDPOINTS)} (the endpoints routerd "
                                "serves)", param="endpoint")
        if body.get("completion_window") != "24h":
            raise ApiError(400, "completion_window must be '24h'", param="completion_window")
        metadata = body.get("metadata")
        if metadata is not None and not (
                isinstance(metadata, dict) and len(metadata) <= 16
                and all(isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
                        for k, v in metadata.items())):
            raise ApiError(400, "metadata must be an object of at most 16 string keys (≤ 64 characters) "
                                "to string values (≤ 512)", param="metadata")
        file_id = body.get("input_file_id")
        if not isinstance(file_id, str) or not file_id:
            raise ApiError(400, "input_file_id is required", param="input_file_id")
        try:
            h = await self.files.meta(tenant, file_id)
        except ApiError:
            raise ApiError(404, f"No such File object: {file_id[:100]}", param="input_file_id",
                           code="file_not_found") from None
        if self.files.expired(h):
            raise ApiError(400, f"File {file_id} has expired", param="input_file_id", code="file_expired")
        if h.get("purpose") != "batch":
            raise ApiError(400, f"File {file_id} has purpose {h.get('purpose')!r}, not 'batch'",
                           param="input_file_id")
        batch = await self.batches.create(tenant, h, endpoint, self.runner.config.batches.window_s, metadata)
        return web.json_response(batch_object(batch))

    async def get_batch(self, request: web.Request) -> web.Response:
        h = await self.batches.of_tenant(self._tenant(request), request.match_info["id"])
        return web.json_response(batch_object(h))

    async def list_batches(self, request: web.Request) -> web.Response:
        tenant = self._tenant(request)
        found, more = await self.batches.page(tenant, after=request.query.get("after"),
                                              limit=_limit(request, 20, 100))
        return web.json_response(listing([batch_object(h) for h in found], more))

    async def cancel_batch(self, request: web.Request) -> web.Response:
        h = await self.batches.cancel(self._tenant(request), request.match_info["id"])
        return web.json_response(batch_object(h))


async def _pieces(part: BodyPartReader) -> AsyncIterator[bytes]:
    while piece := await part.read_chunk(256 * 1024):
        yield piece


def _expiry(form: dict[str, Any]) -> int | None:
    """OpenAI's ``expires_after[anchor]=created_at`` and ``expires_after[seconds]`` (1 hour .. 30 days)."""
    raw = form.get("expires_after[seconds]")
    if raw is None:
        return None
    if form.get("expires_after[anchor]", "created_at") != "created_at":
        raise ApiError(400, "expires_after[anchor] must be 'created_at'", param="expires_after")
    try:
        seconds = int(raw)
    except ValueError:
        raise ApiError(400, "expires_after[seconds] must be an integer", param="expires_after") from None
    if not 1 <= seconds <= 30 * 86_400:
        raise ApiError(400, "expires_after[seconds] must be between 1 and 2592000", param="expires_after")
    return seconds
