"""``python -m traceml.launcher.torchrun_main ARGS``: torchrun, plus a record of how each rank ended.

This is ``torch.distributed.run.main`` itself (same argument parsing, same rendezvous, same
exit codes), wrapped to catch torchrun's typed failure, :class:`ChildFailedError`, whose
``failures`` map each failed global rank to its exit code, signal and error-file message. They
are written as JSON to ``$TRACEML_RANK_ENDS_FILE`` for the launcher, which reports them to the
aggregator, and then the exception continues exactly as under plain torchrun.
"""

from __future__ import annotations

import json
import os
import sys

#: Environment variable naming the JSON file this wrapper writes (set by the launcher).
RANK_ENDS_FILE_ENV = "TRACEML_RANK_ENDS_FILE"


def _write_failures(path: str, failures: dict) -> None:
    ranks = []
    for rank, failure in sorted(failures.items()):
        code = failure.exitcode
        ranks.append(
            {
                "rank": int(rank),
                "local_rank": int(failure.local_rank),
                "exit_code": code if code >= 0 else None,
                "signal": -code if code < 0 else None,
                "reason": str(failure.message or "")[:1000],
            }
        )
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"failed": ranks}, f)
    os.replace(tmp, path)


def main() -> None:
    """Run torchrun with ``sys.argv[1:]``; record failed ranks; re-raise like torchrun."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    path = os.environ.pop(RANK_ENDS_FILE_ENV, "")
    try:
        torchrun_main(sys.argv[1:])
    except ChildFailedError as exc:
        if path:
            try:
                _write_failures(path, exc.failures)
            except OSError as err:
                print(f"traceml: cannot record rank failures: {err}", file=sys.stderr)
        raise


if __name__ == "__main__":
    main()
