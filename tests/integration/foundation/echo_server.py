"""A minimal role for transport tests: a CURVE RequestServer in its own process that answers
`status` with a counter and publishes itself in <exp>/services/echo.json."""
import asyncio
import sys

from services.protocol import ExpDir, RequestServer, StatusReply, load_keys, publish_service


async def main(exp_dir: str) -> None:
    exp = ExpDir(exp_dir)
    served = {"n": 0}

    def status(_body):
        served["n"] += 1
        return StatusReply(state={"served": served["n"]})

    server = RequestServer(load_keys(exp.keys), {"status": status})
    publish_service(exp, "echo", {"address": server.address})
    await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
