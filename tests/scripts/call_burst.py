"""One process of a burst of calls to an aggregator (tests/test_connect_burst.py).

``--channels`` connections to the aggregator at ``--target`` (one TCP connection each, as
separate nodes' launchers would hold), all made and ready first; then ``ready`` on stdout, and
on a line on stdin (the test's "go", told every process at once) each opens one ``Stream`` and
sends rank ``--first + i``'s one batch of run ``r`` (its identity and one step: the suite's
``helpers.batches``), then its ``closing`` message, and half-closes. Prints one JSON line:
how the calls ended, ``{"codes": {status name: calls}, "acked": calls whose batch was
acknowledged stored}``. A call is tried once: nothing is sent again. The run token is the
environment's (``TRACEML_RUN_TOKEN``); the open-files soft limit is raised to the hard limit
first, as the aggregator raises its own.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

import grpc

from traceml import wire
from traceml.core.transport import Credentials, call_metadata, open_aio_channel
from traceml_aggregator.server import raise_open_files_limit

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the suite's helpers
from helpers.batches import rank_batch, rank_identity  # noqa: E402


async def burst(args: argparse.Namespace) -> dict:
    credentials = Credentials.from_env()
    metadata = call_metadata(credentials.token)
    own_connection = [("grpc.use_local_subchannel_pool", 1)]
    channels = [
        open_aio_channel(args.target, credentials, own_connection) for _ in range(args.channels)
    ]
    await asyncio.gather(*(c.channel_ready() for c in channels))
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    codes: dict[str, int] = {}
    acked = 0

    async def call(i: int, channel) -> None:
        nonlocal acked
        stream = wire.AggregatorStub(channel).Stream(metadata=metadata)
        try:
            rank = args.first + i
            identity = rank_identity(rank, world_size=args.world_size)
            await stream.write(rank_batch(1, [0], rank=rank, identity=identity))
            ack = await stream.read()
            acked += ack != grpc.aio.EOF and ack.stored_seq == 1 and not ack.rejected
            await stream.write(wire.Batch(closing=True))
            await stream.done_writing()
            code = (await stream.code()).name
        except grpc.RpcError as exc:
            code = exc.code().name
        codes[code] = codes.get(code, 0) + 1

    await asyncio.gather(*(call(i, c) for i, c in enumerate(channels)))
    for channel in channels:
        await channel.close()
    return {"codes": codes, "acked": acked}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--first", type=int, required=True, help="the first channel's rank")
    p.add_argument("--channels", type=int, required=True)
    raise_open_files_limit()  # a connection is a descriptor, as on the aggregator's side
    print(json.dumps(asyncio.run(burst(p.parse_args()))), flush=True)


if __name__ == "__main__":
    main()
