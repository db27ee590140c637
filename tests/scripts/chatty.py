"""One rank that prints a lot: ``--steps`` traced steps, each printing ``--lines`` lines of
1 KiB to stdout, then ``chatty: done``. For the training-output tests (a full disk under the
node's logs must cost only the logs)."""

import argparse

import traceml

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=20)
p.add_argument("--lines", type=int, default=100)
args = p.parse_args()
traceml.init()
line = "x" * 1023
for step in range(args.steps):
    with traceml.trace_step():
        for i in range(args.lines):
            print(f"{step:05d} {i:05d} {line[12:]}", flush=False)
print("chatty: done", flush=True)
