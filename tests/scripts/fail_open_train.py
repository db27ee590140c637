"""A small training loop that calls ``traceml.init()``, for the fail-open tests.

Trains ``--steps`` steps of a tiny model under ``traceml.trace_step`` with a planted
``--step-sleep`` (s) per step, then prints ``trained N steps`` and ``training ended at T``
(Unix s) so a test can measure how long the process takes to exit after training.
"""

import argparse
import time

from tiny_train import tiny_model, train

import traceml


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    args = parser.parse_args()

    traceml.init()
    train(*tiny_model(), args.steps, step_sleep_s=args.step_sleep)
    print(f"trained {args.steps} steps", flush=True)
    print(f"training ended at {time.time():.3f}", flush=True)


if __name__ == "__main__":
    main()
