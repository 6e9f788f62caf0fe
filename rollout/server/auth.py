"""Who may call which route: SGLang 0.5.23's two keys and three auth levels, as an aiohttp middleware.

A generation server holds two secrets. The API key lets rollout workers generate and read the
server's information; the admin key, when one is set, is the only key that unlocks the routes
that change the server (pause, continue, abort, weight updates, flush). Keeping them apart means
a leaked worker key cannot swap the weights. The rules are the pinned release's
(`sglang/srt/utils/auth.py`, `decide_request_auth`; the levels are attached to routes in
`entrypoints/http_server.py`):

- health, readiness and metrics paths (prefixes `/health`, `/ready`, `/metrics`) and `OPTIONS`
  are always open, so probes need no secret;
- NORMAL routes need the API key when one is set (the admin key is *not* accepted for them);
  with only an admin key, they are open;
- ADMIN_OPTIONAL routes need the admin key when one is set (the API key is refused), else the
  API key when one is set, else nothing;
- ADMIN_FORCE routes need the admin key and answer 403 when the server has none (no route the
  embedded server serves has this level; it is kept so the table is the release's whole rule);
- a route the server does not know is judged as NORMAL (so without the key it is a 401, not a 404).

Keys are compared with `secrets.compare_digest` (constant time). A refusal is 401
`{"error": "Unauthorized"}` or 403 `{"error": "Forbidden"}`.
"""
from __future__ import annotations

import enum
import secrets

from aiohttp import web

OPEN_PREFIXES = ("/health", "/ready", "/metrics")


class AuthLevel(enum.Enum):
    NORMAL = "normal"
    ADMIN_OPTIONAL = "admin_optional"
    ADMIN_FORCE = "admin_force"


def _bearer_matches(header: str | None, expected: str) -> bool:
    if not header:
        return False
    scheme, _, token = header.partition(" ")
    if not _ or scheme.lower() != "bearer":
        return False
    return secrets.compare_digest(token.encode(), expected.encode())


def decide(method: str, path: str, authorization: str | None, *, api_key: str | None,
           admin_api_key: str | None, level: AuthLevel) -> int | None:
    """None when the call may proceed, else the HTTP status to refuse it with (401 or 403)."""
    if method == "OPTIONS" or path.startswith(OPEN_PREFIXES):
        return None
    if level is AuthLevel.ADMIN_FORCE:
        if not admin_api_key:
            return 403
        return None if _bearer_matches(authorization, admin_api_key) else 401
    if level is AuthLevel.ADMIN_OPTIONAL:
        key = admin_api_key or api_key
        if not key:
            return None
        return None if _bearer_matches(authorization, key) else 401
    if api_key:
        return None if _bearer_matches(authorization, api_key) else 401
    return None


def middleware(*, api_key: str | None, admin_api_key: str | None, levels: dict[str, AuthLevel]):
    """An aiohttp middleware applying `decide`; `levels` maps a route path to its level."""

    @web.middleware
    async def check(request, handler):
        level = levels.get(request.path, AuthLevel.NORMAL)
        refused = decide(request.method, request.path, request.headers.get("Authorization"),
                         api_key=api_key, admin_api_key=admin_api_key, level=level)
        if refused is not None:
            return web.json_response({"error": "Unauthorized" if refused == 401 else "Forbidden"},
                                     status=refused)
        return await handler(request)
    return check
