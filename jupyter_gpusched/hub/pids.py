"""Which processes the broker takes for a server's and a kernel's, and while they are still them.

A server names its own process when it connects and each kernel's process in its heartbeats; the
broker believes none of it until it has checked. A server in a PID namespace of its own (a
Kubernetes pod) names pids of that namespace, mapped here to the host's
(:class:`~jupyter_gpusched.procs.PidNamespaces`); a kernel's process must descend from its
server's process; and a pid is a kernel's process only while it started when the process the
broker found did (every look checks, so a pid reused between two heartbeats is never taken for
the kernel's). A server's pod is the one the broker finds its process in
(:func:`~jupyter_gpusched.procs.pod_name`): the host name a server reports is checked against it.
"""

from __future__ import annotations

import logging
from typing import Callable

import psutil

from .. import procs
from .registry import RemoteKernel, RemoteServer

log = logging.getLogger("jupyter_gpusched.broker")


def running(pid: int, started: float | None = None) -> bool:
    """Whether ``pid`` runs (and, given ``started``, is still the process that started then)."""
    try:
        proc = psutil.Process(pid)
        with proc.oneshot():
            if proc.status() == psutil.STATUS_ZOMBIE:
                return False
            return started is None or abs(proc.create_time() - started) < 1.0
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True


def gone(pid: int) -> bool:
    """Whether ``pid`` has exited (or is a zombie); cheap, as it runs for every lease on every pass."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return True
    except OSError:
        return not running(pid)  # no /proc here: ask psutil
    state = stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3]
    return state in (b"Z", b"X")


def is_current(kernel: RemoteKernel, pid: int) -> bool:
    """Whether ``pid`` is still the process of ``kernel`` that the broker found (it runs, and
    started when that one did: a pid reused since is another process)."""
    if pid == kernel.pid:
        started = kernel.pid_started
    elif pid in kernel.tree:
        started = kernel.tree_started.get(pid)
    else:
        return False
    return started is not None and procs.same_process(pid, started)


def current_pids(kernel: RemoteKernel) -> set[int]:
    """The kernel's processes that are still the ones the broker found (checked now)."""
    return {p for p in kernel.all_pids() if is_current(kernel, p)}


def running_pids(kernel: RemoteKernel) -> set[int]:
    """The kernel's processes that still run, as long as its own process does."""
    out = set()
    if kernel.pid is not None and running(kernel.pid, kernel.pid_started):
        out.add(kernel.pid)
        out.update(
            p for p in kernel.tree
            if p != kernel.pid and kernel.tree_started.get(p) is not None and running(p, kernel.tree_started[p])
        )
    return out


def same_server_process(server: RemoteServer, pid: int | None, pid_started: float | None, pid_ns: int | None) -> bool:
    """Whether the process a (re)connecting server names is the one that spoke for it before."""
    same_start = (server.pid_started is None) == (pid_started is None) and (
        pid_started is None or abs(server.pid_started - pid_started) < procs.START_TIME_TOLERANCE
    )
    return server.pid == pid and same_start and server.pid_ns == pid_ns


def check_kernel_pid(server: RemoteServer, kernel: RemoteKernel, pid: int) -> str | None:
    """None if host pid ``pid`` may be this kernel's process, else why not."""
    if kernel.pid == pid and kernel.pid_started is not None and procs.same_process(pid, kernel.pid_started):
        return None  # checked before: the same process still
    if server.pid is None:
        return f"kernel {kernel.kernel_id}: process {pid} ignored: the server did not name its own process"
    if not procs.same_process(server.pid, server.pid_started):
        return f"kernel {kernel.kernel_id}: process {pid} ignored: the server's own process is gone"
    if not procs.descends_from(pid, server.pid):
        return f"kernel {kernel.kernel_id}: process {pid} ignored: it is not a process of this server"
    return None


def adopt(kernel: RemoteKernel, pid: int | None) -> None:
    """Start watching ``pid`` (checked) as the kernel's process, unless it is the same process
    as before: its start time, its tree, and the CPU time it has used so far."""
    if pid != kernel.pid or (pid is not None and not procs.same_process(pid, kernel.pid_started)):
        # Another process (or the same pid, reused by a new process, checked above as one).
        kernel.pid_started = procs.started(pid) if pid else None
        kernel.tree = frozenset({pid}) if pid else frozenset()
        kernel.tree_started = {pid: kernel.pid_started} if pid else {}
        # The CPU baseline is read now, not at the next sample: a first cell that runs in
        # between (it often follows the kernel's start at once) would otherwise leave no trace.
        kernel.runtime_ns = procs.runtime_ns([pid]) if pid else None


class PidChecks:
    """The checks that need to know the host's PID namespaces and pods."""

    def __init__(self, namespaces: procs.PidNamespaces, pod_name: Callable[[int], str | None]) -> None:
        #: Maps pids of the servers' PID namespaces to the broker's.
        self.namespaces = namespaces
        #: The pod a host process runs in, where the host can vouch for its name.
        self.pod_name = pod_name

    def own_namespace(self, pid_ns: int | None) -> bool:
        """Whether a server that names PID namespace ``pid_ns`` (None: none) shares the broker's."""
        return pid_ns is None or pid_ns == self.namespaces.own

    def server_process(self, pid: int, pid_ns: int | None) -> int:
        """The broker's (host) pid of the process a server names as ``pid`` of namespace ``pid_ns``.

        ``pid_ns`` None, or the broker's own namespace: ``pid`` itself. Nothing is believed yet:
        the caller checks the process it gets (:func:`~jupyter_gpusched.procs.check_server_process`).

        Raises:
            procs.NotTheirs: no such process in that namespace, or ``/proc`` cannot tell (the
                message says why, such as a broker that does not run with ``hostPID``).
        """
        if pid_ns is None or self.own_namespace(pid_ns):
            return pid
        try:
            host = self.namespaces.host_pid(pid_ns, pid)
        except procs.PidNamespaceError as exc:
            raise procs.NotTheirs(f"cannot find process {pid} of PID namespace {pid_ns}: {exc}") from None
        if host is None:
            raise procs.NotTheirs(self.namespaces.describe_missing(pid_ns, pid))
        return host

    def checked_pod(
        self, server_id: str, user: str, pid: int | None, pid_ns: int | None, claimed: str | None
    ) -> str | None:
        """The pod a server runs in: the one the broker finds its process in (None: not in a pod
        of its own, or none the broker can vouch for), whatever host name it reported."""
        if pid is None or pid_ns is None:
            return None
        try:
            known = self.pod_name(pid)
        except Exception:  # noqa: BLE001 - a pod's name is for the admin's view only
            log.exception("could not read the pod of process %s (server %s of %s)", pid, server_id, user)
            known = None
        if claimed is not None and known is not None and claimed != known:
            log.warning(
                "server %s of %s says it runs in pod %s, but its process %s is in pod %s; %s is shown",
                server_id, user, claimed, pid, known, known,
            )
        elif claimed is not None and known is None:
            log.info(
                "server %s of %s says it runs in pod %s; ignored: the broker cannot tell the pod of its process %s",
                server_id, user, claimed, pid,
            )
        return known

    def host_pid(self, server: RemoteServer, kernel: RemoteKernel, pid: int) -> tuple[int | None, str | None]:
        """The host pid of kernel process ``pid`` as its server reported it (in its namespace),
        or None and why not."""
        if server.pid_ns is None:
            return pid, None
        if (
            pid == kernel.reported_pid
            and kernel.pid is not None
            and kernel.pid_started is not None
            and procs.same_process(kernel.pid, kernel.pid_started)
        ):
            return kernel.pid, None  # mapped before: the same process still
        try:
            host = self.namespaces.host_pid(server.pid_ns, pid)
        except procs.PidNamespaceError as exc:
            return None, f"kernel {kernel.kernel_id}: process {pid} ignored: {exc}"
        if host is None:
            why = self.namespaces.describe_missing(server.pid_ns, pid)
            return None, f"kernel {kernel.kernel_id}: process {pid} ignored: {why} (the server's)"
        return host, None

    def kernel_process(self, server: RemoteServer, kernel: RemoteKernel, reported: int) -> tuple[int | None, str | None]:
        """The host pid of the process a server reports for its kernel (``reported``, in the
        server's namespace), once checked to be a process of that server; or None and why not."""
        pid, problem = self.host_pid(server, kernel, reported)
        if pid is not None:
            problem = check_kernel_pid(server, kernel, pid)
        return (None, problem) if problem is not None else (pid, None)
