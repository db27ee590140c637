"""Who this process is in the job, from the environment torchrun (or the launcher) exports."""

from __future__ import annotations

import dataclasses
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
    #: The rank and world size are those of a process group the script built itself
    #: (:meth:`from_process_group`), not torchrun's.
    own_process_group: bool = False

    @classmethod
    def from_env(cls, environ=None) -> RankInfo:
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

    def from_process_group(self) -> RankInfo:
        """This identity, or the rank and world size of the default process group when one is
        initialised and disagrees with torchrun's variables.

        That happens in processes the script starts itself (``torch.multiprocessing.spawn``
        under ``traceml run --nproc-per-node=1``): every child inherits torchrun's ``RANK=0``
        and builds its own group, so the group's rank is the one that tells the children
        apart. Their local rank and local world size become the group's too (spawned
        children share the node), and ``own_process_group`` is set: the aggregator then
        takes the group's world as the run's (see ``traceml_aggregator/script_world.py``).
        """
        try:
            import torch.distributed as dist

            if not (dist.is_available() and dist.is_initialized()):
                return self
            rank, world_size = dist.get_rank(), dist.get_world_size()
        except Exception:
            return self
        if (rank, world_size) == (self.rank, self.world_size):
            return self
        return dataclasses.replace(
            self,
            rank=rank,
            world_size=world_size,
            local_rank=rank,
            local_world_size=world_size,
            own_process_group=True,
        )
