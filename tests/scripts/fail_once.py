"""A job whose rank ``--fail-rank`` fails in the first attempt only (for the restart test).

Run with ``traceml run ... --max-restarts 1``. Attempt 0 (``TORCHELASTIC_RESTART_COUNT=0``):
every rank traces ``--first-steps`` steps, waits ``--settle-sec`` so that their telemetry is
flushed (tests set ``TRACEML_FLUSH_INTERVAL_SEC`` well below it), then the failing rank raises
while the others wait to be stopped by torchrun. Attempt 1: every rank traces ``--steps`` steps
and exits 0, except rank ``--hang-rank`` (when given), which sleeps forever after
``--hang-after`` steps (a hang of the second attempt).

Each attempt first joins a gloo process group, which is all it uses it for: the ranks never
wait for each other in training. In attempt 1 rank ``--fail-rank`` joins ``--late-join-sec``
late, so its peers reach ``init_process_group`` first: the restart under which torchrun's
store must not hand them attempt 0's addresses.
"""

import argparse
import datetime
import os
import time

import torch.distributed as dist
from tiny_train import tiny_model, train

import traceml

#: Each step's sleep, s.
STEP_SLEEP_S = 0.01
#: How long a rank may wait for its peers in ``init_process_group``, s (torch's default is
#: 30 min: a join that cannot succeed fails the attempt instead of hanging the test).
JOIN_TIMEOUT_S = 60


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--first-steps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--fail-rank", type=int, default=1)
    parser.add_argument("--settle-sec", type=float, default=1.5)
    parser.add_argument("--hang-rank", type=int, default=-1)
    parser.add_argument("--hang-after", type=int, default=2)
    parser.add_argument("--late-join-sec", type=float, default=2.0)
    args = parser.parse_args()
    traceml.init()
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if attempt > 0 and int(os.environ["RANK"]) == args.fail_rank:
        time.sleep(args.late_join_sec)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=JOIN_TIMEOUT_S))
    model, optimizer = tiny_model()
    if attempt == 0:
        train(model, optimizer, args.first_steps, step_sleep_s=STEP_SLEEP_S)
        time.sleep(args.settle_sec)
        if int(os.environ["RANK"]) == args.fail_rank:
            raise RuntimeError("planted failure in the first attempt")
        time.sleep(120)  # stopped by torchrun when the failing rank's group restarts
    if int(os.environ["RANK"]) == args.hang_rank:
        train(model, optimizer, args.hang_after, step_sleep_s=STEP_SLEEP_S)
        while True:
            time.sleep(3600)
    train(model, optimizer, args.steps, step_sleep_s=STEP_SLEEP_S)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
