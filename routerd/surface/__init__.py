"""Per-route knowledge: which routes routerd serves and what each one is (:mod:`.routes`), how a body is
read for its fleet and for routing (:mod:`.heads`, :mod:`.multipart`), how its named-event stream is
read (:mod:`.events`) and what its errors look like (:mod:`.errors`). Both ways in and the request
path read it; it decides nothing about where a request goes."""

from .errors import engine_error_body, error_body_json, stream_error
from .events import EventReader
from .heads import Read, read_body, read_head
from .routes import ROUTES, Body, ErrorShape, Family, Route, StreamShape, passthrough_route, route_for

__all__ = ["ROUTES", "Body", "ErrorShape", "EventReader", "Family", "Read", "Route", "StreamShape",
           "engine_error_body", "error_body_json", "passthrough_route", "read_body", "read_head",
           "route_for", "stream_error"]
