"""torchrun's log directory and rendezvous store under a node's launcher
(``traceml.launcher.torchrun``)."""

from __future__ import annotations

import errno
import tempfile

import pytest

from traceml.core.rundir import RunDir
from traceml.launcher.config import LaunchConfig
from traceml.launcher.torchrun import (
    TORCHRUN_LOG_DIR_ENV,
    UNSHARED_RDZV_STORE_ENV,
    TorchrunProcess,
    worker_env,
)

pytestmark = [pytest.mark.slow, pytest.mark.torchrun]


@pytest.mark.parametrize(
    ("users", "full"), [(None, False), ("", False), ("elastic", False), (None, True)]
)
def test_torchruns_log_dir_is_the_launchers_own_and_goes_with_torchrun(
    tmp_path, monkeypatch, users, full
):
    """Without ``--log-dir`` torchrun makes a ``/tmp/torchelastic_*`` directory for every run
    and leaves it (tests/test_e2e.py checks a whole run's TMPDIR): the launcher gives it a
    directory of its own in TMPDIR and removes it once torchrun exited; a user's
    ``PET_LOG_DIR`` (``users``, torchrun's own variable for the flag) stands, and stays. When
    the launcher cannot make one (``full``: ENOSPC), torchrun runs as plain torchrun does."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))  # torchrun's
    monkeypatch.setattr(tempfile, "tempdir", str(temp))  # this process's (read once, cached)
    if full:

        def no_space(**_):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(tempfile, "mkdtemp", no_space)
    if users is None:
        monkeypatch.delenv(TORCHRUN_LOG_DIR_ENV, raising=False)
    else:
        monkeypatch.setenv(TORCHRUN_LOG_DIR_ENV, users and str(tmp_path / users))
    script = tmp_path / "train.py"
    script.write_text("print('trained')\n")
    run_dir = RunDir(tmp_path / "run", 0)
    run_dir.create(owner=False)
    torchrun = TorchrunProcess(LaunchConfig(script=str(script), auto_instrument=False), run_dir)
    with open(tmp_path / "out", "wb") as out:
        torchrun.start(consoles=(out, out))
        given = [a for a in torchrun.process.args if a.startswith("--log-dir")]
        if users or full:
            assert (given, torchrun.log_dir) == ([], None)
        else:
            (made,) = temp.iterdir()
            assert made.name.startswith("traceml-torchrun-")
            assert (given, torchrun.log_dir) == ([f"--log-dir={made}"], str(made))
        assert torchrun.wait(120) == 0, (tmp_path / "out").read_text()
    left = [p.name.split("_")[0] for p in temp.iterdir()]
    assert left == (["torchelastic"] if full else [])  # plain torchrun's own, when it picked
    if users:  # the user's, kept as torchrun left it
        assert (tmp_path / users).is_dir()
    assert b"trained" in (tmp_path / "out").read_bytes()


@pytest.mark.parametrize(
    ("nnodes", "master_port", "max_restarts", "users", "expected"),
    [
        (1, None, 1, None, "1"),  # one node that restarts: a store per attempt
        (1, None, 0, None, None),  # no restart: torchrun's default
        (1, 29500, 1, None, None),  # static rendezvous: torch's switch does not apply to it
        (2, 29500, 1, None, None),
        (1, None, 1, "0", "0"),  # the user's own setting stands
        (1, None, 1, "", "1"),  # an empty one is torch's default: shared
    ],
)
def test_a_single_node_that_restarts_gets_a_rendezvous_store_per_attempt(
    tmp_path, monkeypatch, nnodes, master_port, max_restarts, users, expected
):
    """torch 2.13's c10d rendezvous keeps one store for every attempt, and a restarted rank
    that joins its process group before its peer reads the peer's old address
    (tests/test_restart.py restarts a gloo job that fails so without the switch)."""
    if users is None:
        monkeypatch.delenv(UNSHARED_RDZV_STORE_ENV, raising=False)
    else:
        monkeypatch.setenv(UNSHARED_RDZV_STORE_ENV, users)
    config = LaunchConfig(
        script="train.py",
        nnodes=nnodes,
        master_port=master_port,
        max_restarts=max_restarts,
        run_name="r",
    )
    env = worker_env(config, RunDir(tmp_path / "run", 0))
    assert env.get(UNSHARED_RDZV_STORE_ENV) == expected
