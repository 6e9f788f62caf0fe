"""Each role's own key (services/protocol/keys.py) and what it lets a sender do: the identities
an experiment's keys hold, who may send which op (transport.may_send), whose worker ids a sender
may use (speaks_for), tickets signed for one worker, and what the trainer refuses of a sample
before it reaches a group (trainer/trajectory_check.py). No sockets: the same rules over real
sockets, role processes and a flood are in tests/integration/controller/test_role_separation.py."""
from __future__ import annotations

import os
import stat

import numpy as np
import pytest

from tandem.services.controller.senders import SENDERS
from tandem.services.protocol import ADMIN, Trajectory, generate_keys, load_keys, ticket_mac, worker_identity
from tandem.services.protocol.keys import BASE_IDENTITIES, experiment_identity
from tandem.services.protocol.senders import may_send, speaks_for
from tandem.trainer.buffer import validate
from tandem.trainer.trajectory_check import TrajectoryCheck


def test_every_role_has_its_own_private_key(tmp_path):
    old = os.umask(0o022)
    try:
        keys = generate_keys(tmp_path / "keys", [worker_identity(0), worker_identity(1)])
    finally:
        os.umask(old)
    assert keys.identity == ADMIN
    names = {p.name for p in (tmp_path / "keys").iterdir()}
    for who in (*BASE_IDENTITIES, "rollout-0", "rollout-1"):
        assert {f"{who}.key", f"{who}.key_secret"} <= names, who
    assert "tickets.secret" in names
    assert {stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "keys").iterdir()} == {0o600}
    publics = {load_keys(tmp_path / "keys", who).public for who in (*BASE_IDENTITIES, "rollout-0", "rollout-1")}
    assert len(publics) == len(BASE_IDENTITIES) + 2          # all different
    worker = load_keys(tmp_path / "keys", "rollout-0")
    # every client checks the servers by the `service` key, which only servers hold the secret of
    assert worker.server_public == keys.server_public == load_keys(tmp_path / "keys", "service").public
    again = generate_keys(tmp_path / "keys")                  # a resume keeps them
    assert again.public == keys.public and experiment_identity(tmp_path / "keys") == (
        tmp_path / "keys" / "launcher.key").read_bytes()
    with pytest.raises(FileNotFoundError, match="no key for 'rollout-7'"):
        load_keys(tmp_path / "keys", "rollout-7")


@pytest.mark.parametrize("op, who, allowed", [
    ("admit", "rollout-3", True), ("admit", "trainer", False), ("admit", "eval", False),
    ("heartbeat", "rollout-0", True), ("pick_server", "eval", True), ("pick_server", "reward", False),
    ("trainer_resumed", "trainer", True), ("trainer_resumed", "rollout-0", False),
    ("groups_dropped", "rollout-0", False), ("register_server", "rollout-0", False),
    ("register_server", "trainer", False), ("launch_started", "rollout-1", False),
    ("register_server", ADMIN, True), ("status", "rollout-0", True), ("admit", None, False),
])
def test_who_may_send_what_to_the_controller(op, who, allowed):
    assert may_send(who, SENDERS.get(op)) is allowed


def test_a_worker_speaks_for_itself_only():
    assert speaks_for("rollout-1", "rollout-1-4242") and speaks_for("rollout-1", "rollout-1")
    assert not speaks_for("rollout-1", "rollout-11-4242")   # not a prefix of another rank
    assert not speaks_for("rollout-1", "rollout-2-4242") and not speaks_for("trainer", "rollout-2-1")
    assert speaks_for(ADMIN, "rollout-2-1")


def _sample(**kw) -> Trajectory:
    base = dict(group_id="3-7", sample_idx=0, group_size=2, prompt_ids=np.array([1, 2], np.int32),
                output_ids=np.array([3, 4], np.int32), output_logprobs=np.zeros(2, np.float32),
                output_versions=np.zeros(2, np.int32), admit_version=5, reward=1.0, finish_reason="stop",
                task="math", timings={}, prompt_key="1:40")
    return Trajectory(**{**base, **kw})


def test_a_sample_is_refused_unless_its_ticket_was_granted_to_its_sender(tmp_path):
    keys = tmp_path / "keys"
    generate_keys(keys, ["rollout-1", "rollout-2"])
    mac = ticket_mac(keys, "3-7", 5, "rollout-1")
    assert mac != ticket_mac(keys, "3-7", 5, "rollout-2") != ticket_mac(keys, "3-8", 5, "rollout-1")
    assert mac != ticket_mac(keys, "3-7", 6, "rollout-1")
    check = TrajectoryCheck(keys, vocab_size=100)
    good = _sample(ticket_mac=mac)
    assert check.refusal(good, "rollout-1") is None
    assert check.refusal(good, ADMIN) is None                                   # the user's own tools
    assert "not admitted to rollout-2" in check.refusal(good, "rollout-2")      # another worker's group
    assert "not admitted to rollout-1" in check.refusal(_sample(), "rollout-1")  # never admitted (no ticket)
    assert "not admitted" in check.refusal(_sample(ticket_mac=mac, admit_version=4), "rollout-1")
    assert "not rollout-1's" in check.refusal(_sample(ticket_mac=mac, prompt_key="2:40"), "rollout-1")
    assert "does not send trajectories" in check.refusal(good, "trainer")
    assert "does not send trajectories" in check.refusal(good, None)


@pytest.mark.parametrize("where, ids, why", [
    ("output_ids", [3, 10**9], "output token id 1000000000 outside the vocabulary [0, 100)"),
    ("prompt_ids", [-1, 2], "prompt token id -1 outside the vocabulary [0, 100)"),
    ("output_ids", [3, 100], "output token id 100 outside the vocabulary"),
])
def test_a_token_the_model_has_no_embedding_for_is_refused(where, ids, why):
    t = _sample(**{where: np.array(ids, np.int32 if max(ids) < 2**31 else np.int64)})
    assert why in validate(t, vocab_size=100)
    assert validate(_sample(output_ids=np.array([3, 99], np.int32)), vocab_size=100) is None
    assert validate(t) is None or "vocabulary" not in validate(t)   # without a vocabulary: not checked
