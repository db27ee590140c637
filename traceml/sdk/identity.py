"""Who this process is in the job, from the environment torchrun (or the launcher) exports."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass


class IdentityError(ValueError):
    """A torchrun variable is present but not a valid integer."""


def _int_env(environ, name: str, default: int) -> int:
    raw = environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError as exc:
        raise IdentityError(f"{name}={raw!r} is not an integer") from exc


@dataclass(frozen=True)
class RankInfo:
    """A training process's place in the job.

    Without torchrun (a plain ``python train.py``) it is rank 0 of a world of 1.
    """

    rank: int
    local_rank: int
    node_rank: int
    world_size: int
    local_world_size: int
    restart_count: int
    hostname: str
    pid: int

    @classmethod
    def from_env(cls, environ=None) -> "RankInfo":
        """Read ``RANK``, ``LOCAL_RANK``, ``GROUP_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``
        and ``TORCHELASTIC_RESTART_COUNT``.

        Raises:
            IdentityError: a variable is set to something that is not an integer.
        """
        env = os.environ if environ is None else environ
        return cls(
            rank=_int_env(env, "RANK", 0),
            local_rank=_int_env(env, "LOCAL_RANK", 0),
            node_rank=_int_env(env, "GROUP_RANK", 0),
            world_size=_int_env(env, "WORLD_SIZE", 1),
            local_world_size=_int_env(env, "LOCAL_WORLD_SIZE", 1),
            restart_count=_int_env(env, "TORCHELASTIC_RESTART_COUNT", 0),
            hostname=socket.gethostname(),
            pid=os.getpid(),
        )
