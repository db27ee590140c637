"""Training with an idle phase of more than a minute (a checkpoint save, an evaluation), for
the keepalive test: ``--steps`` steps, sleeping ``--idle-sec`` seconds after step ``--idle-after``
(outside any step). Prints ``trained N steps``.
"""

import argparse
import time

from tiny_train import tiny_model, train

import traceml


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--idle-after", type=int, default=3)
    parser.add_argument("--idle-sec", type=float, default=70.0)
    args = parser.parse_args()

    traceml.init()

    def idle(i: int) -> None:
        if i + 1 == args.idle_after:
            time.sleep(args.idle_sec)

    train(*tiny_model(), args.steps, after_step=idle)
    print(f"trained {args.steps} steps", flush=True)


if __name__ == "__main__":
    main()
