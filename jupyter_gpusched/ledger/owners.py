"""Owning processes: a pid with its start time and host, so that a reused pid is not mistaken."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING

import psutil

if TYPE_CHECKING:
    from .rows import Owner

__all__ = ["START_TIME_TOLERANCE", "OwnerId", "is_alive"]

#: Two start times closer than this are one process: /proc/stat's boot time can move by a second.
START_TIME_TOLERANCE = 1.0


@dataclass(frozen=True)
class OwnerId:
    """A process, identified so that a reused pid is not mistaken for it.

    ``create_time`` is the process start time as psutil reports it (seconds since the epoch).
    """

    pid: int
    create_time: float
    hostname: str

    @classmethod
    def current(cls) -> OwnerId:
        """This process."""
        return cls.of_pid(os.getpid())

    @classmethod
    def of_pid(cls, pid: int) -> OwnerId:
        """The process running as ``pid`` on this host now (``psutil.NoSuchProcess`` if none)."""
        return cls(pid, psutil.Process(pid).create_time(), socket.gethostname())


def is_alive(owner: OwnerId | Owner) -> bool:
    """Whether the owning process still runs.

    Alive means a process with that pid exists, is not a zombie, and started when the recorded
    one did. A process on another host, or one this user may not inspect, counts as alive:
    only a process known to be gone may lose its leases.
    """
    # An Owner carries its OwnerId; rows.py imports this module, so no isinstance check here.
    ident: OwnerId = getattr(owner, "process", owner)
    if ident.hostname != socket.gethostname():
        return True
    try:
        proc = psutil.Process(ident.pid)
        started = proc.create_time()
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
    except psutil.NoSuchProcess:  # ZombieProcess is one too
        return False
    except psutil.AccessDenied:
        return True
    return abs(started - ident.create_time) < START_TIME_TOLERANCE
