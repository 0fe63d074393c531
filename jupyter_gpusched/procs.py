"""What the host's process table says: process trees, ancestry, start times and CPU use.

The arbiter believes only what it can check here. In hub mode every process id a server reports
is checked against this table (it must descend from that server's own process, whose owner the
broker verified), and "busy" needs CPU or GPU use that this table or NVML shows.
"""

from __future__ import annotations

import hmac
import os
import pwd
from typing import Iterable, Mapping

import psutil

#: How far up the tree an ancestry check walks before it gives up (a deeper tree is refused).
MAX_DEPTH = 64


def started(pid: int) -> float | None:
    """The process's start time (seconds since the epoch), or None if it does not run."""
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def same_process(pid: int, create_time: float | None, tolerance: float = 1.0) -> bool:
    """Whether ``pid`` runs and is the process that started at ``create_time`` (not a reused pid)."""
    now = started(pid)
    return now is not None and (create_time is None or abs(now - create_time) < tolerance)


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
