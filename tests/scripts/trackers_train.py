"""A 2-rank run (gloo, CPU, no collective in the loop) that logs TraceML's figures to W&B
(offline), MLflow (its tracking URI from the environment) and TensorBoard through
``traceml.integrations``, as docs/trackers.md shows.

Rank 1 sleeps ``--slow-ms`` more per step than rank 0 (a straggler). Rank 0 makes the three
trackers (live every ``--every-s``); after step index ``--hold-at`` it waits, outside every
step, until each tracker has logged that step (``hold-at + 1`` steps completed), so every
tracker has one live point at a known step. Rank 0 also logs to a TensorBoard writer whose
every write fails (a full disk), held for until it failed twice; rank 1 asks for a TensorBoard
log in ``tensorboard-rank1`` (a rank that logs nothing: no directory). At the end rank 1
flushes its telemetry (``traceml.shutdown()``) before a barrier, so rank 0's final figures
cover every step; rank 0 then finishes the trackers and writes ``ids.json`` in ``--out``: the
W&B run's directory, the MLflow run's id, the TensorBoard log directory.
"""

import argparse
import json
import time
from pathlib import Path

import torch.distributed as dist
from tiny_train import tiny_model, train

import traceml
from traceml.integrations import tensorboard as tm_tensorboard


class FullDiskWriter:
    """A ``SummaryWriter`` whose every write fails as on a full disk; counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def add_scalar(self, *args, **kwargs) -> None:
        self.calls += 1
        raise OSError(28, "No space left on device")

    add_text = add_scalar

    def flush(self) -> None:
        pass


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--hold-at", type=int, default=19)
    p.add_argument("--every-s", type=float, default=0.5)
    p.add_argument("--step-ms", type=float, default=20.0)
    p.add_argument("--slow-ms", type=float, default=30.0)
    args = p.parse_args()
    out = Path(args.out)

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    trackers = []
    full_disk = FullDiskWriter()
    if rank == 0:
        import mlflow
        import wandb

        from traceml.integrations import mlflow as tm_mlflow
        from traceml.integrations import wandb as tm_wandb

        run = wandb.init(project="traceml-trackers", dir=str(out), mode="offline")
        mlflow_run = mlflow.start_run()
        trackers = [
            tm_wandb.track(run, every_s=args.every_s),
            tm_mlflow.track(every_s=args.every_s),
            tm_tensorboard.track(out / "tensorboard", every_s=args.every_s),
        ]
        broken = tm_tensorboard.track(full_disk, every_s=args.every_s)
    else:
        broken = tm_tensorboard.track(out / "tensorboard-rank1", every_s=args.every_s)

    def hold(i: int) -> None:
        if i != args.hold_at or not trackers:
            return
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and (
            any(t.logged_step != i + 1 for t in trackers) or full_disk.calls < 2
        ):
            time.sleep(0.05)

    model, optimizer = tiny_model()
    sleep_ms = args.step_ms + (args.slow_ms if rank == 1 else 0.0)
    train(model, optimizer, args.steps, step_sleep_s=sleep_ms / 1000.0, after_step=hold)

    if rank != 0:
        broken.finish()
        traceml.shutdown()
    dist.barrier()
    if rank == 0:
        for tracker in [*trackers, broken]:
            tracker.finish()
        (out / "ids.json").write_text(
            json.dumps(
                {
                    "wandb_dir": run.dir,
                    "mlflow_run_id": mlflow_run.info.run_id,
                    "tensorboard_dir": str(out / "tensorboard"),
                }
            )
        )
        run.finish()
        mlflow.end_run()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
