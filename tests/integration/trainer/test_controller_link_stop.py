"""A stopping trainer does not wait out a dead controller.

The trainer tells the controller about dropped and refused groups with a request that waits up
to `trainer.ack_timeout_s` (`600 s`), following a restarted controller. A controller that died
for good (its announcement still names its port) answered nothing, and a trainer told to stop
meanwhile sat in that request past the launcher's `launcher.trainer_stop_s` and was SIGKILLed
before its last checkpoint. Real sockets: the controller's announced port has nobody on it.
"""
from __future__ import annotations

import threading
import time

from tandem.services.protocol import GroupsDropped, Shutdown, WeightsOnDisk, free_port, publish_service
from tandem.trainer.controller_link import ControllerLink


def test_a_request_to_a_dead_controller_ends_when_the_trainer_is_told_to_stop(exp, keys):
    publish_service(exp, "controller", {"address": f"tcp://127.0.0.1:{free_port()}"})
    shutdown = Shutdown()
    link = ControllerLink(exp, keys, shutdown, timeout_s=600.0)
    threading.Timer(1.0, shutdown.event.set).start()     # SIGTERM, a second into the wait
    t0 = time.monotonic()
    reply = link.request(GroupsDropped(["g"], "refused: test"), "groups_dropped")
    waited = time.monotonic() - t0
    link.close()
    assert reply is None
    assert 1.0 <= waited < 10.0, waited     # the stop, not the 600 s ack timeout


def test_a_weight_announcement_to_a_dead_controller_is_abandoned_when_stopping(exp, keys, caplog):
    """The step's publish during a stop: no ack, said as a stop, not as ten minutes of silence."""
    publish_service(exp, "controller", {"address": f"tcp://127.0.0.1:{free_port()}"})
    shutdown = Shutdown()
    shutdown.event.set()
    link = ControllerLink(exp, keys, shutdown, timeout_s=600.0)
    t0 = time.monotonic()
    out = link.weights_ready(WeightsOnDisk(version=3, path="/nowhere"))
    link.close()
    assert out["ack_ok"] is False and time.monotonic() - t0 < 10.0
    assert "weights v3: stopping without the controller's ack" in caplog.text
