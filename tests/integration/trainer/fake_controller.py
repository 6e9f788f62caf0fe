"""A controller stand-in for the trainer tests, run as its own process (one ZAP handler per
process admits one experiment's key): answers weights_on_disk / weights_broadcast with weights_ack.

    python fake_controller.py EXP_DIR HOLD_VERSIONS   (e.g. "1,2" or "")

Answers `status` with the ledger counter the trainer reads each step (`rejected`, from the
file <exp>/fake-controller/rejected, 0 without it). Appends every received version to <exp>/fake-controller/received (trainer_resumed messages to
.../resumed as "version groups_held"); the ack of a held version
waits until the file <exp>/fake-controller/release-<version> exists. <exp>/fake-controller/events
lists "received N" and "answered N" in the order they happened. For weights_broadcast it
joins the weight group as rank 1 with the shared rendezvous (`services.protocol.weight_group`,
SGLang's /init_weights_update_group contract) the generation servers use, receives
every tensor, and saves them to <exp>/fake-controller/broadcast-v<N>.pt before acking.
"""
from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from tandem.services.protocol import (
    ExpDir,
    Ok,
    RequestServer,
    StatusReply,
    WeightsAck,
    WeightsBroadcast,
    load_keys,
    publish_service,
)


async def main(exp: ExpDir, hold: set[int]) -> None:
    state = exp.root / "fake-controller"
    state.mkdir(exist_ok=True)

    async def on_ready(body):
        with open(state / "received", "a") as f:
            f.write(f"{body.version}\n")
        with open(state / "events", "a") as f:
            f.write(f"received {body.version}\n")
        if isinstance(body, WeightsBroadcast):
            await asyncio.to_thread(receive, body, state / f"broadcast-v{body.version}.pt")
        while body.version in hold and not (state / f"release-{body.version}").exists():
            await asyncio.sleep(0.02)
        with open(state / "events", "a") as f:
            f.write(f"answered {body.version}\n")
        return WeightsAck(version=body.version, ok=True, failed_servers=[], timings={"update_s": 0.01})

    async def on_resumed(body):
        with open(state / "resumed", "a") as f:
            f.write(f"{body.version} {body.groups_held}\n")
        return Ok(detail="rebased")

    async def on_status(_body):
        f = state / "rejected"
        return StatusReply(state={"role": "controller", "rejected": int(f.read_text()) if f.exists() else 0})

    server = RequestServer(load_keys(exp.keys), {"weights_on_disk": on_ready, "weights_broadcast": on_ready,
                                                 "trainer_resumed": on_resumed, "status": on_status})
    publish_service(exp, "controller", {"address": server.address})
    await server.serve_forever()


def receive(ready, out: Path) -> None:
    import torch
    import torch.distributed as dist

    from tandem.services.protocol.weight_group import join_weight_group, leave_weight_group

    pg = join_weight_group(ready.master_address, ready.master_port, 1, ready.world_size, ready.group_name,
                           backend="gloo", timeout_s=60)
    got = {}
    for name, dtype, shape in zip(ready.names, ready.dtypes, ready.shapes, strict=True):
        t = torch.empty(shape, dtype=getattr(torch, dtype))
        dist.broadcast(t, src=0, group=pg)
        got[name] = t
    leave_weight_group(pg)
    torch.save(got, out)


if __name__ == "__main__":
    hold = {int(v) for v in sys.argv[2].split(",") if v} if len(sys.argv) > 2 else set()
    asyncio.run(main(ExpDir(Path(sys.argv[1])), hold))
