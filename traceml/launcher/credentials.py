"""The run token and TLS CA of one node's launch: made or found, then exported.

Node 0 takes the token it was given (``--run-token``, ``TRACEML_RUN_TOKEN``) or makes a random
one, and writes it to ``<run dir>/run_token`` (mode 0600, atomically) before its aggregator
starts, so that every node sharing the run directory finds it there. A node r > 0 without a
token of its own waits for that file, within the same window as for node 0's aggregator
(``TRACEML_AGGREGATOR_WAIT_SEC``), and refuses a file other users can read.

Either way the launcher then exports ``TRACEML_RUN_TOKEN`` (and ``TRACEML_TLS_CA``) in its own
environment: its own calls (claims, node sampler, finalization, live views), its aggregator
and its torchrun's ranks inherit them from there, never through a command line.
"""

from __future__ import annotations

import os
import time

from traceml import settings
from traceml.core import transport
from traceml.core.rundir import RunDir
from traceml.launcher.config import LaunchConfig


def prepare_owner(config: LaunchConfig, run_dir: RunDir) -> None:
    """Node 0: fix the token (given, else new), write the token file, export both.

    Raises:
        OSError: the token file cannot be written.
    """
    config.run_token = config.run_token or transport.new_token()
    transport.write_token_file(run_dir.token_file, config.run_token)
    export(config)


def obtain(config: LaunchConfig, run_dir: RunDir, deadline_monotonic: float) -> str:
    """Node r > 0: the token given, else node 0's token file (waited for until the deadline);
    exported. Returns "" when done, else one line that says why there is no token.
    """
    if not config.run_token:
        try:
            token = transport.wait_token_file(run_dir.token_file, deadline_monotonic)
        except transport.TokenFileError as exc:
            return str(exc)
        if token is None:
            return (
                f"no run token: {run_dir.token_file} did not appear (node 0 writes it there when "
                f"--logs-dir is shared); give every node the same {settings.RUN_TOKEN.name}"
            )
        config.run_token = token
    export(config)
    return ""


def obtain_now(config: LaunchConfig, run_dir: RunDir, wait_s: float) -> str:
    """:func:`obtain` with a deadline ``wait_s`` from now."""
    return obtain(config, run_dir, time.monotonic() + wait_s)


def export(config: LaunchConfig) -> None:
    """Put the token and the CA path in this process's environment (see the module doc)."""
    if config.run_token:
        os.environ[settings.RUN_TOKEN.name] = config.run_token
    if config.tls_ca is not None:
        os.environ[settings.TLS_CA.name] = str(config.tls_ca)
