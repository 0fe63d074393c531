"""What the host's process table says: process identity and liveness, trees, ancestry, CPU use.

The one home of "is this still that process": :func:`started` and :func:`same_process` for a pid
with its start time, :func:`alive` for one that exited but was not reaped yet (a zombie holds no
GPU, serves no request), and :class:`OwnerId` / :func:`is_alive` for owners recorded with their
host. The arbiter believes only what it can check here. In hub mode every process id a server reports
is checked against this table (it must descend from that server's own process, whose owner the
broker verified), and "busy" needs CPU or GPU use that this table or NVML shows.
"""

from __future__ import annotations

import hmac
import os
import pwd
import socket
from dataclasses import dataclass
from typing import Iterable, Mapping, Protocol

import psutil

#: How far up the tree an ancestry check walks before it gives up (a deeper tree is refused).
MAX_DEPTH = 64
#: Two start times closer than this are one process: /proc/stat's boot time can move by a second.
START_TIME_TOLERANCE = 1.0


def started(pid: int) -> float | None:
    """The process's start time (seconds since the epoch), or None if it does not run."""
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def same_process(pid: int, create_time: float | None, tolerance: float = START_TIME_TOLERANCE) -> bool:
    """Whether ``pid`` runs and is the process that started at ``create_time`` (not a reused pid)."""
    now = started(pid)
    return now is not None and (create_time is None or abs(now - create_time) < tolerance)


def alive(pid: int, create_time: float | None = None) -> bool:
    """Whether ``pid`` exists and has not exited, and (given ``create_time``) started then.

    A zombie (exited, not reaped yet) is not alive: it runs no code and the driver has freed its
    GPU contexts. A process this user may not inspect counts as alive, so that only a process
    known to be gone is treated as gone.
    """
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        return create_time is None or abs(proc.create_time() - create_time) < START_TIME_TOLERANCE
    except psutil.NoSuchProcess:  # ZombieProcess is one too
        return False
    except psutil.AccessDenied:
        return True
    except ValueError:  # a negative pid: no process has it
        return False


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


class _Owned(Protocol):
    """A record that names its process, such as a ledger ``Owner``."""

    @property
    def process(self) -> OwnerId: ...


def is_alive(owner: OwnerId | _Owned) -> bool:
    """Whether the owning process still runs.

    Alive means a process with that pid exists, is not a zombie, and started when the recorded
    one did. A process on another host, or one this user may not inspect, counts as alive:
    only a process known to be gone may lose its leases.
    """
    ident = owner if isinstance(owner, OwnerId) else owner.process
    if ident.hostname != socket.gethostname():
        return True
    return alive(ident.pid, ident.create_time)


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rfind(b")") + 2 :].split()[1])
    except (OSError, ValueError, IndexError):
        try:
            return psutil.Process(pid).ppid()
        except psutil.Error:
            return None


def descends_from(pid: int, ancestor: int) -> bool:
    """Whether ``pid`` is a (strict) descendant of ``ancestor``."""
    if pid == ancestor or pid <= 1:
        return False
    current = pid
    for _ in range(MAX_DEPTH):
        parent = _ppid(current)
        if parent is None or parent <= 0:
            return False
        if parent == ancestor:
            return True
        if parent == 1:
            return False
        current = parent
    return False


def process_trees(roots: Mapping[str, int], limit: int | None = None) -> dict[str, set[int]]:
    """Descendants of each root pid (itself included), from a single pass over all processes.

    ``limit`` bounds the size of each tree (the root and its nearest descendants are kept).
    """
    children: dict[int, list[int]] = {}
    for proc in psutil.process_iter(["pid", "ppid"]):
        info = proc.info
        children.setdefault(info["ppid"], []).append(info["pid"])
    out = {}
    for key, root in roots.items():
        tree, queue = {root}, [root]
        while queue and (limit is None or len(tree) < limit):
            for child in children.get(queue.pop(0), ()):
                if child not in tree:
                    tree.add(child)
                    queue.append(child)
                    if limit is not None and len(tree) >= limit:
                        break
        out[key] = tree
    return out


def runtime_ns(pids: Iterable[int]) -> int:
    """CPU time the main threads of ``pids`` have run, in nanoseconds (0 for processes gone).

    ``/proc/<pid>/schedstat`` counts in nanoseconds, so even a one-line cell shows (an idle
    IPython kernel's main thread does not run at all); elsewhere psutil's CPU times stand in.
    """
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/schedstat", "rb") as f:
                total += int(f.read().split()[0])
            continue
        except (OSError, ValueError, IndexError):
            pass
        try:
            times = psutil.Process(pid).cpu_times()
            total += int((times.user + times.system) * 1e9)
        except psutil.Error:
            pass
    return total


class NotTheirs(PermissionError):
    """A process that is not the asking user's (the message says why, for the log)."""


def check_server_process(pid: int, user: str, token: str) -> float:
    """Check that ``pid`` is a single-user server of hub user ``user`` holding ``token``.

    A server that JupyterHub spawned carries its API token in its environment: where the
    environment can be read, the token must be the one this connection presented (so nobody can
    name another user's server, nor any process but their own server). Where it cannot be read
    (the broker runs as another Unix user), the process must belong to the Unix user of the same
    name. Returns the process's start time; raises :class:`NotTheirs`.
    """
    try:
        proc = psutil.Process(pid)
        create_time = proc.create_time()
    except psutil.Error:
        raise NotTheirs(f"process {pid} does not run here") from None
    try:
        env = proc.environ()
    except psutil.AccessDenied:
        env = None
    except psutil.Error:
        raise NotTheirs(f"process {pid} does not run here") from None
    if env is not None and env:
        theirs = env.get("JUPYTERHUB_API_TOKEN", "")
        if not theirs or not hmac.compare_digest(theirs.encode(), token.encode()):
            raise NotTheirs(f"process {pid} is not a server started with this token")
        if env.get("JUPYTERHUB_USER") not in (None, user):
            raise NotTheirs(f"process {pid} is the server of another user")
        return create_time
    try:
        uid = pwd.getpwnam(user).pw_uid
    except KeyError:
        raise NotTheirs(
            f"cannot check process {pid}: its environment is unreadable and there is no Unix user {user!r}"
        ) from None
    try:
        if proc.uids().real != uid:
            raise NotTheirs(f"process {pid} does not belong to the Unix user {user!r}")
    except psutil.Error:
        raise NotTheirs(f"process {pid} does not run here") from None
    return create_time


def unix_user(pid: int) -> str | None:
    try:
        return psutil.Process(pid).username()
    except (psutil.Error, KeyError):
        return None


def my_uid() -> int:
    return os.getuid()
