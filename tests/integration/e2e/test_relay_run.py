"""`tandem run` with `gen.weight_relay: true`: two embedded servers, each with its own relay
directory (`gen.relay_dir` with `{rank}`: each server a node of its own, as the miniature plays
nodes), so every version goes trainer directory -> gen-0's relay -> gen-1's relay, and each server
loads its own node's copy. Every role is a real process; the relays talk real TCP."""
from __future__ import annotations

import json

from local_run import finish, leftovers, steps, tandem, write_config

from tandem.launcher.audit import audit
from tandem.services.protocol import ExpDir, read_metrics


def test_a_relayed_run_trains_every_version_from_node_copies_and_leaves_none(tmp_path, tiny_model_dir):
    cfg = write_config(tmp_path / "exp.yaml", tiny_model_dir, "relay")
    relay_dir = tmp_path / "relay-{rank}"
    # launcher.cpus.pin=false: this machine's 2 CPUs cannot give two servers and a trainer CPUs of their own.
    out = finish(tandem("run", cfg, "gen.num_servers=2", "gen.weight_relay=true", f"gen.relay_dir={relay_dir}",
                        "launcher.cpus.pin=false"))
    exp = ExpDir(tmp_path / "relay")
    assert "step 4/4" in out, out[-3000:]
    assert len(steps(exp)) == 4
    result = audit(exp)
    assert result.lost == [] and result.trained_twice == [] and result.trained == 8, result
    services = [json.loads((exp.root / "services" / f"gen-{r}.json").read_text()) for r in (0, 1)]
    assert all(s["relay"].startswith("127.0.0.1:") for s in services)
    assert services[0]["relay_node"] != services[1]["relay_node"]
    assert str(tmp_path / "relay-0") in services[0]["relay_node"]
    syncs = [r for r in read_metrics(exp, "controller") if r.get("event") == "weight_sync"]
    # Every published version went through the relays to both servers (none failed).
    assert {s["version"] for s in syncs} >= {1, 2, 3, 4}
    assert all("relay" in s["phases"] and not s["failed"] and len(s["updated"]) == 2 for s in syncs), syncs
    # The trainer's own directory is untouched; the node copies are gone with the servers.
    assert (exp.weights / "v4").is_dir()
    assert not [p for r in (0, 1) for p in (tmp_path / f"relay-{r}").rglob("v*")]
    assert leftovers(exp) == []
