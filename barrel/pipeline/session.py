"""Which conversation a request belongs to, for KV reuse across turns.

A session header if sent (x-conversation-id, or a router's x-session-id or
x-smg-routing-key), else metadata.user_id (Anthropic), else a hash of
the model and the first user message: a stable id without any cooperation from the
client, since every turn of a conversation repeats its first user message.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from barrel.engine.types import SessionId

_EXPLICIT = re.compile(r"^[A-Za-z0-9._:@\-]{1,128}$")


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
    return json.dumps(content, sort_keys=True, default=str)


def derive_session(
    model: str,
    messages: Sequence[Mapping[str, Any]],
    conversation_id: str | None = None,
    user_id: str | None = None,
) -> SessionId:
    for explicit in (conversation_id, user_id):
        if explicit and _EXPLICIT.match(explicit):
            return SessionId(explicit)
    first = next((m for m in messages if m.get("role") == "user"), None)
    h = hashlib.sha256(model.encode())
    h.update(b"\0")
    h.update(_text(first.get("content") if first else "").encode())
    return SessionId("h-" + base64.urlsafe_b64encode(h.digest()[:12]).decode().rstrip("="))
