"""A minimal role for transport tests: a CURVE RequestServer in its own process that answers
`status` with a counter and publishes itself in <exp>/services/echo.json. A restarted one binds
its predecessor's port, as the controller and the reward service do; with `--hang` it never
answers (a process about to die with requests in flight)."""
import asyncio
import sys

from tandem.services.protocol import (
    ExpDir,
    StatusReply,
    load_keys,
    publish_service,
    serve_at_previous_address,
)


async def main(exp_dir: str, hang: bool) -> None:
    exp = ExpDir(exp_dir)
    served = {"n": 0}

    async def status(_body):
        if hang:
            await asyncio.Event().wait()
        served["n"] += 1
        return StatusReply(state={"served": served["n"]})

    server = serve_at_previous_address(exp, "echo", load_keys(exp.keys), {"status": status}, host="127.0.0.1")
    publish_service(exp, "echo", {"address": server.address})
    await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], "--hang" in sys.argv[2:]))
