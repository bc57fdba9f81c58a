"""The one check of a request body, for both ways in (an HTTP request's body and a queue job's
``body``): per route, in :mod:`routerd.surface.heads`; re-exported here for the ways in."""

from __future__ import annotations

from ..openai import ChatHead, ChatMessage, CompletionHead
from ..surface.heads import Read, read_body, read_head

__all__ = ["ChatHead", "ChatMessage", "CompletionHead", "Read", "read_body", "read_head"]
