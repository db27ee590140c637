"""The torchrun command line a node's launcher runs (``traceml.launcher.torchrun``)."""

from __future__ import annotations

import pytest

from traceml.core.rundir import RunDir
from traceml.launcher.config import LaunchConfig
from traceml.launcher.torchrun import TORCHRUN_LOG_DIR_ENV, torchrun_argv


@pytest.mark.parametrize("users", [None, "", "/scratch/elastic"])
def test_torchruns_log_dir_is_the_nodes_in_the_run_directory_unless_pet_log_dir_names_one(
    tmp_path, monkeypatch, users
):
    """Without ``--log-dir`` torchrun makes a ``/tmp/torchelastic_*`` directory for every run
    and leaves it (tests/test_e2e.py checks a real run's TMPDIR); a user's ``PET_LOG_DIR``
    (torchrun's own variable for the flag) stands."""
    if users is None:
        monkeypatch.delenv(TORCHRUN_LOG_DIR_ENV, raising=False)
    else:
        monkeypatch.setenv(TORCHRUN_LOG_DIR_ENV, users)
    argv = torchrun_argv(LaunchConfig(script="train.py"), RunDir(tmp_path / "run", 3))
    given = [a for a in argv if a.startswith("--log-dir")]
    if users:
        assert given == []
    else:  # a torchrun flag: before the script
        assert given == [f"--log-dir={tmp_path / 'run' / 'nodes' / 'node_3' / 'torchelastic'}"]
        assert argv.index(given[0]) < argv.index("train.py")
