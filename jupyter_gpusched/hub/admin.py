"""What the broker's admin sees of the servers: each server and its kernels, GPU processes left
behind by servers that fell silent, and which server (user, pod) a GPU process runs under.

Read-only views over the :class:`~jupyter_gpusched.hub.registry.Registry`; every pid they show
is checked to still be the process the broker found (:func:`~jupyter_gpusched.hub.pids.is_current`).
"""

from __future__ import annotations

import logging

from .. import procs
from .pids import is_current, running
from .registry import OnceLog, Registry, RemoteServer, connected, silent_for

log = logging.getLogger("jupyter_gpusched.broker")


def pod(server: RemoteServer) -> str | None:
    """The pod (container) a server runs in: its host name, for a server in a PID namespace
    of its own; None for one that shares the broker's."""
    return server.hostname if server.pid_ns is not None else None


def owner_fields(server: RemoteServer) -> dict[str, str | None]:
    return {"server_id": server.server_id, "user": server.user, "pod": pod(server)}


def servers(registry: Registry, now: float, heartbeat_timeout: float) -> list[dict]:
    """The servers and their kernels, for the admin."""
    out = []
    for server in sorted(registry.servers.values(), key=lambda s: (s.user, s.server_id)):
        out.append(
            {
                "server_id": server.server_id,
                "user": server.user,
                "pid": server.pid,
                "pod": pod(server),
                "connected": connected(server, now, heartbeat_timeout),
                "silent_seconds": round(silent_for(server, now), 1),
                "kernels": sorted(server.kernels),
            }
        )
    return out


def connected_servers(registry: Registry, now: float, heartbeat_timeout: float) -> list[frozenset[str]]:
    """The kernel ids of each server that speaks to the broker now (one set per server)."""
    return [frozenset(s.kernels) for s in registry.servers.values() if connected(s, now, heartbeat_timeout)]


def owner_of(registry: Registry, pid: int) -> dict[str, str | None]:
    """The server a host process runs under: ``server_id``, ``user``, ``pod`` (None: unknown).

    A process belongs to a server when it is in one of its kernels' trees (and is still the
    process found there: its start time is checked), descends from the server's process, or
    lives in the PID namespace of a server in a namespace of its own, or in a namespace made
    inside that one (a process of its pod).
    """
    for kernel in registry.kernels.values():
        if pid in kernel.all_pids() and is_current(kernel, pid):
            server = registry.servers.get(kernel.server_id)
            if server is not None:
                return owner_fields(server)
    by_pid = {server.pid: server for server in registry.servers.values() if server.pid is not None}
    for candidate in [pid, *procs.ancestors(pid)]:
        server = by_pid.get(candidate)
        if server is not None and procs.same_process(candidate, server.pid_started):
            return owner_fields(server)
    pods = [server for server in registry.servers.values() if server.pid_ns is not None]
    if pods:
        # Its own PID namespace, and those it was made in: a namespace made inside a pod
        # (under any process of it) is still that pod's.
        try:
            chain = procs.pid_namespace_chain(pid)
        except (ProcessLookupError, procs.PidNamespaceError):
            chain = []
        latest = sorted(pods, key=lambda s: -(s.connected_at or 0.0))
        for ns in chain:
            for server in latest:
                if server.pid_ns == ns:
                    return owner_fields(server)
    return {"server_id": None, "user": None, "pod": None}


def stranded(
    registry: Registry, now: float, heartbeat_timeout: float, on_gpu: set[int], warnings: OnceLog
) -> list[dict]:
    """GPU processes of kernels whose server fell silent: left behind, for the admin to see.

    Each is logged once (a warning), the first time it is found.
    """
    out = []
    for kernel in registry.kernels.values():
        server = registry.servers.get(kernel.server_id)
        if silent_for(server, now) <= heartbeat_timeout:
            continue
        for pid in sorted(kernel.all_pids() & on_gpu):
            if running(pid) and is_current(kernel, pid):
                out.append({"pid": pid, "kernel_id": kernel.kernel_id, "user": kernel.user, "server_id": kernel.server_id})
    for item in out:
        if warnings.first(f"stranded:{item['pid']}"):
            log.warning(
                "GPU process %s of kernel %s (%s) is left behind: its server %s stopped sending heartbeats",
                item["pid"], item["kernel_id"], item["user"], item["server_id"],
            )
    return out
