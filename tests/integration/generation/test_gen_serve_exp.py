"""`tandem gen serve --exp DIR` publishes its address where the launcher and controller look."""
from __future__ import annotations

import json

from gen_support import SHARED_MAX_RUNNING, SHARED_RANK, Api

from tandem.services.protocol import read_service


def test_serve_publishes_service_file_and_logs(shared_process, shared_exp, embedded_only):
    exp = shared_exp
    info = read_service(exp, f"gen-{SHARED_RANK}", timeout_s=10)
    assert info["url"] == shared_process.url and info["backend"] == "embedded"
    assert json.loads(exp.service_file(f"gen-{SHARED_RANK}").read_text())["pid"] == shared_process.proc.pid
    api = Api(info["url"], shared_process.api.api_key)
    assert api.get("/health")[0] == 200
    status, server_info = api.get("/get_server_info")
    assert status == 200 and server_info["max_running_requests"] == SHARED_MAX_RUNNING   # from the gen section
    assert exp.log_file("gen", SHARED_RANK).exists()
