"""A remote reward endpoint (`reward.url`): the other form of a user's reward, for a reward model
or a checker served elsewhere (as OpenRLHF's remote reward model URL).

Each item is one `POST <url>` with the JSON body `{"prompt", "response", "row"}`; a 2xx reply's
JSON body is read exactly as a reward function's return value (reward/user_function.py:
a number, or `{"reward": x, "correct": b, ...details}`), with the same refusals. An attempt
may take `reward.function_timeout_s` (connecting, sending, the whole reply); a connection error,
a timeout, a 429 or a 5xx is tried again, `reward.url_retries` times, 0.5 s, 1 s, 2 s ... (at
most 4 s) apart. Anything else — another status, a reply that is not JSON, one over 1 MiB — is
not retried: asking again would get the same answer. When every attempt failed the item gets
wrong_reward with `details.error` (the verdict cache forgets it: the endpoint may be back for
the next identical item).

aiohttp (a dependency already: the rollout's generation client) is run on one event loop per
grader worker, which keeps its connections open between items.
"""
from __future__ import annotations

import asyncio
import json

from tandem.reward.config import RewardConfig
from tandem.reward.user_function import refused, verdict_from
from tandem.services.protocol import Verdict

MAX_REPLY_BYTES = 1 << 20
SHOWN = 200  # characters of a bad reply kept in the reason
WHO = "reward.url"


def backoff_s(attempt: int) -> float:
    """Seconds to wait before attempt number `attempt` (1 = the first retry)."""
    return min(4.0, 0.5 * 2 ** (attempt - 1))


def budget_s(cfg: RewardConfig) -> float:
    """The longest one item can take: every attempt timing out, and the waits between them."""
    retries = cfg.url_retries
    return (retries + 1) * cfg.function_timeout_s + sum(backoff_s(k) for k in range(1, retries + 1))


def _snippet(body: bytes) -> str:
    text = body[:SHOWN].decode("utf-8", errors="replace")
    return repr(text) + ("..." if len(body) > SHOWN else "")


class RemoteGrader:
    """`grade(task, prompt, response, row)` → a Verdict from the endpoint, or a refusal."""

    def __init__(self, cfg: RewardConfig):
        self.cfg = cfg
        self._loop = asyncio.new_event_loop()
        self._session = None
        self.base = {"grader": "url", "source": cfg.url}

    def grade(self, task: str, prompt: str, response: str, row: dict) -> Verdict:
        return self._loop.run_until_complete(self._grade(task, prompt, response, row))

    def close(self) -> None:
        if self._session is not None:
            self._loop.run_until_complete(self._session.close())
        self._loop.close()

    async def _post(self, body: bytes) -> tuple[int, bytes]:
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession()
        timeout = aiohttp.ClientTimeout(total=self.cfg.function_timeout_s)
        async with self._session.post(self.cfg.url, data=body, timeout=timeout, allow_redirects=False,
                                      headers={"Content-Type": "application/json"}) as resp:
            return resp.status, await resp.content.read(MAX_REPLY_BYTES + 1)

    async def _grade(self, task: str, prompt: str, response: str, row: dict) -> Verdict:
        import aiohttp

        base = {"task": task, **self.base}
        cfg = self.cfg
        body = json.dumps({"prompt": prompt, "response": response, "row": row}, default=repr).encode()
        attempts, last, timed_out = cfg.url_retries + 1, "", False
        for k in range(attempts):
            if k:
                await asyncio.sleep(backoff_s(k))
            try:
                status, reply = await self._post(body)
            except TimeoutError:
                last, timed_out = f"timeout: no reply within {cfg.function_timeout_s:g}s", True
                continue
            except (aiohttp.ClientError, OSError) as e:
                last, timed_out = f"{type(e).__name__}: {e}", False
                continue
            if status == 429 or status >= 500:
                last, timed_out = f"HTTP {status}: {_snippet(reply)}", False
                continue
            tried = {**base, "attempts": k + 1}
            if not 200 <= status < 300:
                return refused(cfg, tried, f"{WHO} answered HTTP {status}: {_snippet(reply)}")
            if len(reply) > MAX_REPLY_BYTES:
                return refused(cfg, tried, f"{WHO} answered over {MAX_REPLY_BYTES} bytes")
            try:
                value = json.loads(reply)
            except (ValueError, UnicodeDecodeError):
                return refused(cfg, tried, f"{WHO} answered something that is not JSON: {_snippet(reply)}")
            return verdict_from(value, cfg, tried, WHO)
        return refused(cfg, {**base, "attempts": attempts},
                       f"{WHO} failed {attempts} attempt(s); the last: {last}", error=True, limit=timed_out)
