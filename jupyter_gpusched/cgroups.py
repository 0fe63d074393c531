"""What a process's memory cgroups leave it: the room a checkpoint may take in host memory.

A checkpoint moves a kernel's GPU memory into its process's host memory, so a container (a
DockerSpawner container, a Kubernetes pod) with a memory limit must have room for it: the tightest
limit among the process's cgroup and its ancestors, less what they use (cgroup v2 and v1).
"""

from __future__ import annotations

#: Where the host's cgroup file systems are mounted (v2: one tree; v1: one per controller).
CGROUP_ROOT = "/sys/fs/cgroup"
#: cgroup v1 writes "no limit" as a huge number (the largest page-aligned long).
_V1_UNLIMITED = 1 << 60


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _stat(path: str, key: str) -> int:
    """One counter of a cgroup's ``memory.stat`` (0 where it cannot be read)."""
    try:
        with open(path) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
    except (OSError, ValueError):
        pass
    return 0


def memory_room(pid: int, proc: str = "/proc", root: str | None = None) -> int | None:
    """Bytes that ``pid``'s memory cgroup (and every cgroup above it) lets it still take: the
    least of limit minus usage along the way up. None where no limit applies or none can be read
    (no cgroup file system here, or another one's mount): a checkpoint is then not held back.

    A checkpoint moves the kernel's GPU memory into the kernel process's own host memory, so it
    counts against that process's limits, a Kubernetes pod's memory limit included.
    """
    root = CGROUP_ROOT if root is None else root
    try:
        with open(f"{proc}/{pid}/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    where = None
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if "memory" in controllers.split(","):
            where = (f"{root}/memory", path, "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
            break
        if hierarchy == "0" and controllers == "" and where is None:
            where = (root, path, "memory.max", "memory.current", "inactive_file")
    if where is None:
        return None
    base, path, limit_file, usage_file, cache_key = where
    parts = [p for p in path.split("/") if p and p not in (".", "..")]
    room = None
    for depth in range(len(parts), -1, -1):
        folder = "/".join([base, *parts[:depth]])
        limit = _read_int(f"{folder}/{limit_file}")
        if limit is None or limit >= _V1_UNLIMITED:
            continue
        # Usage counts the page cache, which the kernel gives back under pressure: what is in
        # use is usage less the inactive file cache (the working set, as the kubelet counts it).
        usage = (_read_int(f"{folder}/{usage_file}") or 0) - _stat(f"{folder}/memory.stat", cache_key)
        left = max(limit - max(usage, 0), 0)
        room = left if room is None else min(room, left)
    return room
