"""`reward.url` against a real HTTP server (http.server in a thread of this test): what is posted,
a reply read as a reward function's return value, and every way an endpoint fails — too slow
(each attempt cut at the timeout, then wrong_reward with the reason), a 500 then a 200 (the retry
succeeds), a 429, garbage or NaN in a 200, a 404 (not retried), nothing listening. Then the same
endpoint behind a real reward service."""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from reward_service_helpers import start_service, stop_service

from tandem.reward.config import RewardConfig
from tandem.reward.remote_reward import RemoteGrader, budget_s
from tandem.services.protocol import GradeItem, GradeRequest, free_port


class Endpoint(BaseHTTPRequestHandler):
    """Answers by path; counts the requests to each and keeps the bodies posted."""
    hits: dict[str, int] = {}
    bodies: list[dict] = []
    content_types: list[str] = []

    def log_message(self, *args):
        pass

    def _reply(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        n = Endpoint.hits[self.path] = Endpoint.hits.get(self.path, 0) + 1
        Endpoint.bodies.append(json.loads(body))
        Endpoint.content_types.append(self.headers["Content-Type"])
        if self.path == "/ok":
            self._reply(200, json.dumps({"reward": 3, "correct": True, "judge": "rm-7b"}).encode())
        elif self.path == "/slow":
            time.sleep(3)
            self._reply(200, b"4")
        elif self.path == "/flaky":
            self._reply(500, b"overloaded") if n == 1 else self._reply(200, b'{"reward": 1.5}')
        elif self.path == "/busy":
            self._reply(429, b"slow down") if n == 1 else self._reply(200, b"-2")
        elif self.path == "/always500":
            self._reply(503, b"down for maintenance")
        elif self.path == "/garbage":
            self._reply(200, b"<html>not json{")
        elif self.path == "/nan":
            self._reply(200, b'{"reward": NaN}')   # Python's json reads it: the check must not
        elif self.path == "/huge":
            self._reply(200, b"1e999")
        else:
            self._reply(404, b"no such route")


@pytest.fixture(scope="module")
def endpoint():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Endpoint)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(autouse=True)
def fresh_counts():
    Endpoint.hits.clear()
    Endpoint.bodies.clear()
    Endpoint.content_types.clear()


def _grade(url: str, response: str = "the answer", timeout_s: float = 1.0, retries: int = 2):
    g = RemoteGrader(RewardConfig(url=url, function_timeout_s=timeout_s, url_retries=retries))
    try:
        return g.grade("math", "What is 1+2?", response, {"id": "p1", "answer": "3"})
    finally:
        g.close()


def test_the_post_and_a_good_reply(endpoint):
    v = _grade(endpoint + "/ok")
    assert (v.reward, v.correct) == (3.0, True)
    assert v.details["grader"] == "url" and v.details["attempts"] == 1 and v.details["user"] == {"judge": "rm-7b"}
    assert Endpoint.bodies == [{"prompt": "What is 1+2?", "response": "the answer", "row": {"id": "p1", "answer": "3"}}]
    assert Endpoint.content_types == ["application/json"]


def test_a_slow_endpoint_times_out_on_every_attempt_then_earns_wrong_reward(endpoint):
    t0 = time.monotonic()
    v = _grade(endpoint + "/slow", timeout_s=0.5, retries=1)
    took = time.monotonic() - t0
    assert 1.0 <= took < 2.9          # two attempts of 0.5 s and a 0.5 s wait: not the 3 s of one reply
    assert took <= budget_s(RewardConfig(url="http://x", function_timeout_s=0.5, url_retries=1)) + 1.0
    assert (v.reward, v.correct) == (-5.0, False) and v.details["refused"] and v.details["limit"]
    assert "failed 2 attempt(s); the last: timeout: no reply within 0.5s" in v.details["reason"]
    assert "error" in v.details       # may pass: the verdict cache forgets it
    assert Endpoint.hits["/slow"] == 2


def test_a_500_then_a_200_succeeds_on_the_retry(endpoint):
    v = _grade(endpoint + "/flaky")
    assert v.reward == 1.5 and v.details["attempts"] == 2 and Endpoint.hits["/flaky"] == 2
    v = _grade(endpoint + "/busy")
    assert v.reward == -2.0 and v.details["attempts"] == 2


def test_an_endpoint_that_keeps_failing_is_tried_retries_plus_one_times(endpoint):
    v = _grade(endpoint + "/always500", retries=2)
    assert v.reward == -5.0 and Endpoint.hits["/always500"] == 3
    assert "failed 3 attempt(s); the last: HTTP 503: 'down for maintenance'" in v.details["reason"]
    assert "limit" not in v.details and "error" in v.details


@pytest.mark.parametrize("path, why", [
    ("/garbage", "reward.url answered something that is not JSON: '<html>not json{'"),
    ("/nan", "reward.url returned nan, not a finite number"),
    ("/huge", "reward.url returned inf, not a finite number"),
    ("/missing", "reward.url answered HTTP 404: 'no such route'"),
])
def test_a_bad_answer_is_refused_without_retrying(endpoint, path, why):
    v = _grade(endpoint + path)
    assert (v.reward, v.correct) == (-5.0, False) and why in v.details["reason"], v.details
    assert "error" not in v.details and Endpoint.hits[path] == 1


def test_nothing_listening_is_an_error_after_the_retries():
    t0 = time.monotonic()
    v = _grade(f"http://127.0.0.1:{free_port()}/reward", retries=1)
    assert time.monotonic() - t0 < 3.0
    assert v.reward == -5.0 and "failed 2 attempt(s)" in v.details["reason"] and "error" in v.details


def test_the_endpoint_behind_a_reward_service(endpoint, tmp_path):
    svc = start_service(tmp_path / "exp", ["reward.num_workers=1", f"reward.url={endpoint}/flaky",
                                           "reward.function_timeout_s=2", "reward.url_retries=1"])
    try:
        c = svc.client()
        try:
            verdicts = c.request(GradeRequest(items=[GradeItem(task="math", response="r", answer="3", question="q"),
                                                     GradeItem(task="math", response="r", answer="3", question="q")],
                                              deadline_s=30), timeout_s=40).verdicts
        finally:
            c.close()
        assert [v.reward for v in verdicts] == [1.5, 1.5]
        assert Endpoint.hits["/flaky"] == 2        # a 500 and its retry; the repeat was the cache's
        assert Endpoint.bodies[-1] == {"prompt": "q", "response": "r", "row": {"answer": "3"}}
        status = svc.status()
        assert (status["grader"], status["user_graded"], status["cached"]) == (f"url {endpoint}/flaky", 1, 1)
    finally:
        stop_service(svc)
