"""Node 0's own CPU a relay message, without gRPC: the aggregator's work that ``ingest.py``
measures together with the transport's (issue 26's 1-step/s case).

In one process: the aggregator as ``traceml-aggregator`` wires it
(:class:`traceml_aggregator.server.Aggregator`: its real store, writer thread, run state, hang
watch, live aggregates and node sessions), no port bound. ``--nodes`` simulated node relays,
each one concurrent ``Relay`` call straight into the service's handler, with ``ingest.py``'s
messages, parsed before the clock starts: per message the 8 ranks' batches of ``--records``
steps each and the node sampler's batch (2 system samples), and the node's heartbeat (the
nodes are expected, as the sessions' claims make them). One message in flight a node, the
next once its ``RelayDown`` came, as fast as they are answered. Every node's first message
(its ranks' identities) goes before the clock; then ``--messages`` more a node are timed, the
cyclic collector set as a serving aggregator sets it (:func:`traceml.core.heap.serving_heap`):
the process's CPU (event loop and writer thread) per message and per rank batch, the cyclic
collector's work in it, and the steps stored and folded into the live aggregates, each checked
exactly against what was sent.

Beside ``ingest.py --wire relay --transport-floor`` (the same messages through gRPC, and gRPC
alone) this splits node 0's CPU a ``RelayUp`` into the transport's and the aggregator's own.
With ``--baseline DIR`` (another TraceML source tree with ``Aggregator``) it runs there too,
the two alternating ``--rounds`` times, each in a fresh process. Usage::

    PYTHONPATH=. python benchmarks/node0_cost.py [--nodes 1000] [--messages 10] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import ROOT, in_tree  # noqa: E402
from ingest import (  # noqa: E402
    NODE_RANKS,
    NODE_SAMPLES,
    RUN,
    node_messages,
    relayed_heartbeat,
    step_blocks,
)


class _Context:
    """What the service's handlers read of a gRPC call's context, for calls made in process:
    an abort raises."""

    async def abort(self, code, details: str):
        raise RuntimeError(f"{code}: {details}")


def measure(nodes: int, messages: int, records: int) -> dict:
    """The timed phase's figures with the tree this process imports (see the module)."""
    from traceml import wire
    from traceml.core.heap import serving_heap
    from traceml_aggregator.server import Aggregator, ServerConfig

    world = nodes * NODE_RANKS
    blocks = step_blocks(messages, records)
    ups = []
    for node in range(nodes):
        encoded, _ = node_messages(node, world, blocks, NODE_SAMPLES)
        beat = relayed_heartbeat(node)
        ups.append(
            [
                wire.RelayUp.FromString(b"".join(f for _, f in frames.values()) + beat)
                for frames in encoded
            ]
        )

    async def run(run_dir: Path) -> dict:
        config = ServerConfig(run_dir=run_dir, run_name=RUN, world_size=world, nnodes=nodes)
        aggregator = Aggregator(config)
        aggregator.service.sessions.expect(range(nodes))
        aggregator.writer.start()
        # as serve() does: fold in what the store held (nothing), so the batches stored from
        # now on are folded into the live aggregates as they commit, not held for it
        await aggregator.live.catch_up(aggregator.replay, aggregator.writer)
        started, first_answered = asyncio.Event(), asyncio.Semaphore(0)

        async def node_ups(node: int):
            yield ups[node][0]
            first_answered.release()
            await started.wait()
            for up in ups[node][1:]:
                yield up

        async def relay(node: int) -> None:
            async for _ in aggregator.service.Relay(node_ups(node), _Context()):
                pass  # every step's storing is checked in the store afterwards

        calls = [asyncio.ensure_future(relay(n)) for n in range(nodes)]
        for _ in range(nodes):
            await first_answered.acquire()
        await asyncio.sleep(0)  # the last first answer's writes done
        with serving_heap() as collections:  # as serve() does once it serves
            cpu, wall = time.process_time(), time.perf_counter()
            started.set()
            await asyncio.gather(*calls)
            cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        await aggregator.writer.drain(10.0)
        (stored,) = aggregator.store.query("SELECT count(*) FROM steps", by_name=False)[0]
        folded = sum(rl.steps_stored for rl in aggregator.live.ranks.values())
        await aggregator.writer.close()
        aggregator.live.close()
        timed = nodes * messages
        return {
            "us_per_message": cpu / timed * 1e6,
            "us_per_rank_batch": cpu / (timed * NODE_RANKS) * 1e6,
            "wall_s": wall,
            "cpu_s": cpu,
            "stored_steps": stored,
            "folded_steps": folded,
            "collections": str(collections),
        }

    with tempfile.TemporaryDirectory() as directory:
        return asyncio.run(run(Path(directory)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--messages", type=int, default=10, help="timed messages a node")
    parser.add_argument("--records", type=int, default=2, help="steps a rank's batch")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--baseline", type=Path, help="another TraceML source tree")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # one run
    args = parser.parse_args()
    if args.json:
        print(json.dumps(measure(args.nodes, args.messages, args.records)))
        return 0
    trees = {"this": ROOT} | ({"baseline": args.baseline.resolve()} if args.baseline else {})
    sent = args.nodes * NODE_RANKS * args.messages * args.records
    per_message: dict[str, list[float]] = {name: [] for name in trees}
    for _ in range(args.rounds):
        for name, tree in trees.items():
            r = in_tree(tree, [__file__, "--json", *sys.argv[1:]])
            per_message[name].append(r["us_per_message"])
            print(
                f"{name}: {r['us_per_message']:.0f} µs of CPU a relay message, "
                f"{r['us_per_rank_batch']:.1f} µs a rank's batch ({r['cpu_s']:.2f} s of CPU in "
                f"{r['wall_s']:.2f} s); steps stored {r['stored_steps']} and folded into the "
                f"live aggregates {r['folded_steps']} of {sent}; cyclic GC: {r['collections']}",
                flush=True,
            )
            if r["stored_steps"] != sent or r["folded_steps"] != sent:
                print(f"error: {name} did not store and fold every step sent once")
                return 1
    if args.baseline:
        this, base = (statistics.median(per_message[n]) for n in ("this", "baseline"))
        print(
            f"medians: this {this:.0f}, baseline {base:.0f} µs a message; ratio {this / base:.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
