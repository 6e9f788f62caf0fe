"""A restarted service comes back at the address its clients already hold.

The controller and the reward service announce `tcp://host:port` in `<exp>/services/<role>.json`
(on one machine, `ipc://<dir>/<role>`: the same path after a restart, see transport.bind);
workers and the trainer keep that address. When the service restarts (a crash, a resubmitted
job on the same node) it binds the announced port again, so clients reconnect to it without
re-reading anything; only when that port is taken does it take a new one (clients then
re-resolve the announcement).
"""
from __future__ import annotations

import logging

import zmq

from .expdir import ExpDir, previous_port
from .keys import CurveKeys
from .transport import Handler, RequestServer

log = logging.getLogger(__name__)


def serve_at_previous_address(exp: ExpDir, role: str, keys: CurveKeys, handlers: dict[str, Handler],
                              host: str, port: int = 0, **server_options) -> RequestServer:
    """A RequestServer (with `server_options`) on `port` if set (failing if taken), else on the
    previous process's port, else on a free one."""
    server_options.setdefault("name", role)   # a Unix socket's name when the launcher gives a directory
    if port:
        return RequestServer(keys, handlers, host=host, port=port, **server_options)
    previous = previous_port(exp, role)
    if previous:
        try:
            return RequestServer(keys, handlers, host=host, port=previous, **server_options)
        except zmq.ZMQError as e:
            log.info("previous port %d of %s unavailable (%s); taking a new one", previous, role, e)
    return RequestServer(keys, handlers, host=host, port=0, **server_options)
