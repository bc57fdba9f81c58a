"""Responses-API records and OpenAI's Conversations API, kept by routerd (Redis, or memory without it) so
that a conversation outlives the engine that served it and continues on any instance behind any
routerd: the store (:mod:`.store`), a request made whole from it (:mod:`.chain`), the stored routes
(:mod:`.routes`)."""

from .chain import Turn, prepare
from .routes import ConversationRoutes
from .store import (
    ConversationRecord,
    MemoryStore,
    RedisStore,
    ResponseRecord,
    Store,
    StoreUnavailable,
    UnknownId,
)

__all__ = ["ConversationRecord", "ConversationRoutes", "MemoryStore", "RedisStore", "ResponseRecord", "Store",
           "StoreUnavailable", "Turn", "UnknownId", "prepare"]
