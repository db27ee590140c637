"""Python front end of the Slurm lab: a real multi-node Slurm cluster on this machine.

The lab itself is ``lab.sh`` next to this file (see ``README.md``); this module calls it
with :mod:`subprocess` and adds the few helpers the test suite needs::

    from tests.slurm_lab import SlurmLab, available

    ok, reason = available()
    if not ok:
        pytest.skip(reason)
    lab = SlurmLab()
    lab.start(mode="loopback", nodes=2, gpus_per_node=2)
    try:
        job = lab.sbatch(script, "--nodes=2", "--ntasks-per-node=1", "--gres=gpu:2",
                         "-o", str(tmp_path / "out.txt"))
        state, code = lab.wait(job, timeout=60)
    finally:
        lab.stop()
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Union

__all__ = ["SlurmLab", "SlurmLabError", "available", "LAB_SH", "DEFAULT_LAB_DIR"]

LAB_SH = Path(__file__).resolve().with_name("lab.sh")
DEFAULT_LAB_DIR = "/tmp/traceml-slurm-lab"

# Job states after which a job never runs again.
_FINAL_STATES = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
    "OUT_OF_MEMORY",
    "SPECIAL_EXIT",
    "REVOKED",
}

# Variables that describe an enclosing Slurm job/step.  When the test runner itself
# runs inside a Slurm job, they must not leak into the lab's client commands.
_JOB_VAR = re.compile(
    r"^SLURM_(JOB|STEP|NODEID|PROCID|LOCALID|NNODES|NTASKS|NPROCS|TASKS_PER_NODE|"
    r"CPUS|GPUS|MEM|SUBMIT|CLUSTER_NAME|TOPOLOGY|NODELIST|SRUN|PRIO|WORKING|GTIDS|"
    r"DISTRIBUTION|LAUNCH|UMASK|TASK_PID|SPANK|TRES|EXPORT_ENV|GET_USER_ENV|ARRAY)"
)

PathLike = Union[str, "os.PathLike[str]"]


class SlurmLabError(RuntimeError):
    """A lab command failed; the message carries the command's output."""


def available(mode: str = "loopback") -> tuple[bool, str]:
    """Tell whether the lab can run on this machine, without starting anything.

    Returns ``(True, "")`` or ``(False, reason)``, so a test can ``pytest.skip(reason)``.
    The lab needs Linux, root, bash, ``unshare``/``nsenter`` (util-linux), ``ip``
    (iproute2) and either the Slurm/munge binaries already installed or ``apt-get`` to
    install them.  ``SLURM_LAB_DISABLE=1`` in the environment forces ``False``.
    ``mode`` is accepted for symmetry with :meth:`SlurmLab.start`; every mode has the
    same requirements here.
    """
    if os.environ.get("SLURM_LAB_DISABLE", "") not in ("", "0"):
        return False, "SLURM_LAB_DISABLE is set"
    if not sys.platform.startswith("linux"):
        return False, f"the Slurm lab needs Linux (this is {sys.platform})"
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return False, "the Slurm lab needs root (it runs slurmd/slurmctld and uses namespaces)"
    if mode not in ("loopback", "netns"):
        return False, f"unknown lab mode {mode!r}"
    if not LAB_SH.is_file():
        return False, f"{LAB_SH} is missing"
    for tool in ("bash", "unshare", "nsenter", "flock", "ip", "ss"):
        if shutil.which(tool) is None:
            return False, f"'{tool}' is not installed"
    have_slurm = all(shutil.which(t) for t in ("slurmctld", "slurmd", "sbatch", "munged"))
    if not have_slurm and shutil.which("apt-get") is None:
        return False, "Slurm/munge are not installed and apt-get is missing to install them"
    return True, ""


class SlurmLab:
    """A handle on the lab whose state lives in ``lab_dir``.

    ``lab_dir`` defaults to ``$SLURM_LAB_DIR`` or ``/tmp/traceml-slurm-lab``.  Only one
    lab can run per machine (fixed ports, netns and bridge names), whatever the dir.
    Usable as a context manager: ``with SlurmLab().start() as lab: ...`` stops it on exit.
    """

    def __init__(self, lab_dir: PathLike | None = None) -> None:
        self.lab_dir = Path(lab_dir or os.environ.get("SLURM_LAB_DIR") or DEFAULT_LAB_DIR)
        self._vars: dict[str, str] | None = None

    # ------------------------------------------------------------------ lifecycle
    @staticmethod
    def available(mode: str = "loopback") -> tuple[bool, str]:
        """Same as the module-level :func:`available`."""
        return available(mode)

    def start(
        self,
        mode: str = "loopback",
        nodes: int = 2,
        gpus_per_node: int = 2,
        timeout: float = 600,
    ) -> SlurmLab:
        """Start the lab (stopping a previous one first) and wait until all nodes are idle.

        Installs the Debian packages with apt-get on first use (~5-12 s), then takes
        ~3-4 s.  ``mode`` is ``"loopback"`` (all nodes share the host's network stack)
        or ``"netns"`` (one network namespace per node on a bridge; jobs then reach the
        test runner at :attr:`host_addr`, not 127.0.0.1).  Raises :class:`SlurmLabError`
        with lab.sh's output (including log tails) on failure.  Returns ``self``.
        """
        self._vars = None
        self._lab(
            "start",
            "--mode",
            mode,
            "--nodes",
            str(int(nodes)),
            "--gpus-per-node",
            str(int(gpus_per_node)),
            timeout=timeout,
        )
        return self

    def stop(self, timeout: float = 120) -> None:
        """Stop everything the lab started (idempotent; a no-op when nothing runs).

        Kills the lab's daemons by pid file and every process left in the nodes'
        namespaces (job processes included), and removes the netns/veth/bridge.  The
        logs stay in ``<lab_dir>/log``.
        """
        self._vars = None
        self._lab("stop", timeout=timeout)

    def status(self) -> tuple[bool, str]:
        """Return ``(running, text)``: whether all lab daemons are alive, and lab.sh's report."""
        proc = self._lab("status", check=False, timeout=60)
        return proc.returncode == 0, proc.stdout + proc.stderr

    def is_running(self) -> bool:
        """True when the lab's daemons are all alive."""
        return self.status()[0]

    def selftest(self, timeout: float = 300) -> str:
        """Run ``lab.sh selftest`` (real jobs on every node); return its output or raise."""
        return self._lab("selftest", timeout=timeout).stdout

    def __enter__(self) -> SlurmLab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ environment
    def lab_vars(self) -> dict[str, str]:
        """Only the lab's own variables, as printed by ``lab.sh env``.

        ``SLURM_CONF`` (the one the Slurm client commands need), ``SLURM_LAB_DIR``,
        ``SLURM_LAB_MODE``, ``SLURM_LAB_NODES``, ``SLURM_LAB_GPUS_PER_NODE`` and
        ``SLURM_LAB_HOST_ADDR``.  Raises :class:`SlurmLabError` when the lab is not started.
        Cached until this handle's next :meth:`start`/:meth:`stop`.
        """
        if self._vars is not None:
            return dict(self._vars)
        out = self._lab("env", timeout=30).stdout
        result: dict[str, str] = {}
        for line in out.splitlines():
            words = shlex.split(line)
            if len(words) == 2 and words[0] == "export" and "=" in words[1]:
                key, value = words[1].split("=", 1)
                result[key] = value
        if "SLURM_CONF" not in result:
            raise SlurmLabError(f"lab.sh env printed no SLURM_CONF:\n{out}")
        self._vars = result
        return dict(result)

    def env(self, base: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
        """A complete environment for ``sbatch``/``srun``/``squeue``/``scontrol`` on the lab.

        A copy of ``base`` (default ``os.environ``) without the ``SLURM_*`` variables of an
        enclosing job, plus :meth:`lab_vars` (``SLURM_CONF`` above all), plus ``extra``.
        ``sbatch`` passes its environment on to the job, so ``srun`` inside batch scripts
        finds ``SLURM_CONF`` too.
        """
        src = dict(os.environ if base is None else base)
        env = {k: v for k, v in src.items() if not _JOB_VAR.match(k)}
        env.update(self.lab_vars())
        env.update(extra)
        return env

    @property
    def slurm_conf(self) -> Path:
        """Path of the lab's slurm.conf (valid once the lab has been started)."""
        return self.lab_dir / "etc" / "slurm.conf"

    @property
    def log_dir(self) -> Path:
        """Directory with slurmctld.log, slurmd-nodeN.log and munged.log."""
        return self.lab_dir / "log"

    @property
    def host_addr(self) -> str:
        """Address at which jobs reach a server the test runner binds on 0.0.0.0.

        ``127.0.0.1`` in loopback mode, ``10.77.0.1`` (the bridge) in netns mode.
        """
        return self.lab_vars()["SLURM_LAB_HOST_ADDR"]

    # ------------------------------------------------------------------ jobs
    def run(
        self,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        cwd: PathLike | None = None,
        timeout: float = 60,
        check: bool = True,
    ) -> subprocess.CompletedProcess:
        """Run a Slurm client command (``["squeue", "-h"]``, ...) against the lab.

        ``env`` entries are laid over :meth:`env`.  Output is captured as text.  Raises
        :class:`SlurmLabError` on a non-zero exit when ``check`` is true.
        """
        full_env = self.env(**dict(env or {}))
        proc = subprocess.run(
            list(argv),
            env=full_env,
            cwd=None if cwd is None else str(cwd),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and proc.returncode != 0:
            raise SlurmLabError(
                f"{shlex.join(argv)} exited {proc.returncode}\n"
                f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
            )
        return proc

    def sbatch(
        self,
        script_path: PathLike,
        *args: str,
        env: Mapping[str, str] | None = None,
        cwd: PathLike | None = None,
        timeout: float = 60,
        script_args: Iterable[str] = (),
    ) -> int:
        """Submit a batch script; return its job id.

        ``args`` are sbatch options and go before the script (``"--nodes=2"``,
        ``"-o", "/tmp/x.out"``, ``"--wait"``...); ``script_args`` go after it.
        ``env`` entries are laid over :meth:`env` and reach the job (sbatch exports its
        environment).  ``cwd`` becomes the job's working directory unless ``--chdir`` is
        given; the filesystem is shared, so output files land where ``-o`` says.
        ``timeout`` bounds the sbatch command itself (raise it when passing ``--wait``).
        """
        argv = ["sbatch", "--parsable", *args, str(script_path), *script_args]
        proc = self.run(argv, env=env, cwd=cwd, timeout=timeout, check=False)
        match = re.search(r"^(\d+)(;\S+)?\s*$", proc.stdout, re.MULTILINE)
        if match is None:
            raise SlurmLabError(
                f"{shlex.join(argv)} exited {proc.returncode} without a job id\n"
                f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
            )
        return int(match.group(1))

    def job_info(self, job_id: int) -> dict[str, str]:
        """``scontrol -o show job <id>`` as a dict (``JobState``, ``ExitCode``, ``NodeList``...).

        Finished jobs stay visible for 10 minutes (``MinJobAge=600``).  Raises
        :class:`SlurmLabError` when the job is unknown.
        """
        proc = self.run(
            ["scontrol", "-o", "show", "job", str(int(job_id))], check=False, timeout=30
        )
        if proc.returncode != 0 or "JobId=" not in proc.stdout:
            raise SlurmLabError(
                f"scontrol show job {job_id} failed ({proc.returncode}): {proc.stdout}{proc.stderr}"
            )
        info: dict[str, str] = {}
        for token in proc.stdout.split():
            key, sep, value = token.partition("=")
            if sep and key not in info:
                info[key] = value
        return info

    def wait(self, job_id: int, timeout: float = 120, poll: float = 0.25) -> tuple[str, int]:
        """Poll ``scontrol show job`` until the job ends; return ``(state, exit_code)``.

        ``state`` is the final ``JobState`` (``"COMPLETED"``, ``"FAILED"``,
        ``"CANCELLED"``, ``"TIMEOUT"``...).  ``exit_code`` is the batch script's exit
        status, or 128+N when it was killed by signal N.  Raises :class:`TimeoutError`
        (with the last job record) if the job has not ended after ``timeout`` seconds.
        Faster than ``sbatch --wait``, which polls after 2 s, 10 s, 42 s...
        """
        deadline = time.monotonic() + timeout
        info: dict[str, str] = {}
        while True:
            try:
                info = self.job_info(job_id)
            except SlurmLabError:
                # Right after submission the controller may not answer yet; retry.
                if time.monotonic() > deadline:
                    raise
                time.sleep(poll)
                continue
            state = info.get("JobState", "")
            if state in _FINAL_STATES:
                code, _, sig = info.get("ExitCode", "0:0").partition(":")
                exit_code = 128 + int(sig) if sig and int(sig) != 0 else int(code or 0)
                return state, exit_code
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"Slurm job {job_id} still {state or '?'} after {timeout}s: {info}"
                )
            time.sleep(poll)

    def cancel(self, job_id: int) -> None:
        """``scancel`` a job (no error if it has already ended)."""
        self.run(["scancel", str(int(job_id))], check=False, timeout=30)

    # ------------------------------------------------------------------ internals
    def _lab(self, *args: str, timeout: float, check: bool = True) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if not _JOB_VAR.match(k)}
        env["SLURM_LAB_DIR"] = str(self.lab_dir)
        try:
            proc = subprocess.run(
                ["bash", str(LAB_SH), *args],
                env=env,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired as exc:
            out, err = (
                x.decode(errors="replace") if isinstance(x, bytes) else (x or "")
                for x in (exc.stdout, exc.stderr)
            )
            raise SlurmLabError(
                f"lab.sh {' '.join(args)} did not finish within {timeout}s\n"
                f"stdout:\n{out}\nstderr:\n{err}"
            ) from exc
        if check and proc.returncode != 0:
            raise SlurmLabError(
                f"lab.sh {' '.join(args)} exited {proc.returncode}\n"
                f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
            )
        return proc
