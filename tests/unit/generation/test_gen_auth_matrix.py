"""SGLang 0.5.23's auth rule as the embedded server implements it (`rollout.server.auth.decide`),
level by level and key configuration, called directly. The same levels over real HTTP are in
tests/integration/generation/test_gen_contract.py.
"""
from __future__ import annotations

import pytest

from tandem.rollout.server.auth import AuthLevel, decide

API, ADMIN = "api-key-1", "admin-key-2"


@pytest.mark.parametrize("keys", [(None, None), ("a", None), (None, "m"), ("a", "m")])
def test_auth_decision_matrix(keys):
    """sglang/srt/utils/auth.py `decide_request_auth`, level by level and key configuration."""
    api_key, admin_key = keys

    def d(level, header, path="/x", method="POST"):
        return decide(method, path, header, api_key=api_key, admin_api_key=admin_key, level=level)
    for header in (None, "Bearer a", "Bearer m", "Bearer wrong", "bearer a", "Basic a", "Bearera"):
        token = header.split(" ", 1)[1] if header and " " in header and header.split()[0].lower() == "bearer" else None
        # NORMAL: the API key when there is one (the admin key does not open it); else open.
        assert d(AuthLevel.NORMAL, header) == (None if not api_key or token == api_key else 401), header
        # ADMIN_OPTIONAL: the admin key when there is one (the API key is refused), else the API key.
        want = admin_key or api_key
        assert d(AuthLevel.ADMIN_OPTIONAL, header) == (None if not want or token == want else 401), header
        # ADMIN_FORCE: 403 without an admin key on the server.
        assert d(AuthLevel.ADMIN_FORCE, header) == (403 if not admin_key else None if token == admin_key else 401)
        for open_path in ("/health", "/health_generate", "/ready", "/metrics"):
            assert d(AuthLevel.ADMIN_FORCE, header, open_path, "GET") is None
        assert d(AuthLevel.ADMIN_FORCE, header, "/generate", "OPTIONS") is None
