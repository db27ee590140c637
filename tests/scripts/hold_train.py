"""Trains ``--steps`` traced steps (tests/scripts/tiny_train.py), prints ``trained N steps``,
then holds the run open until ``--hold-file`` exists (at most ``--hold-max-sec``), so that a
test can read the live run's figures after its last step and before it ends."""

import argparse
import os
import time

from tiny_train import tiny_model, train

import traceml


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--hold-file", required=True)
    parser.add_argument("--hold-max-sec", type=float, default=300.0)
    args = parser.parse_args()

    traceml.init()
    train(*tiny_model(), args.steps)
    print(f"trained {args.steps} steps", flush=True)
    deadline = time.monotonic() + args.hold_max_sec
    while not os.path.exists(args.hold_file) and time.monotonic() < deadline:
        time.sleep(0.1)


if __name__ == "__main__":
    main()
