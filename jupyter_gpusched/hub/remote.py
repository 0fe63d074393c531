"""The kernels of every single-user server, as the broker sees them through their heartbeats.

:class:`RemoteKernels` is the broker's :class:`~jupyter_gpusched.arbiter.KernelHost`: the same
``LocalArbiter`` that schedules one server's kernels in standalone mode schedules all servers'
kernels here. Each single-user server keeps a websocket open to the broker and sends a heartbeat
every ``heartbeat_interval`` seconds: its kernels, whether each is executing, when it last did,
and its process id. Orders (restart, shutdown) go back over the same websocket: the server owns
its kernels and runs as their Unix user, so it carries them out.

The broker believes only what it can check. A connection names its server's process, which must
be a server of the connection's hub user (see :func:`~jupyter_gpusched.procs.check_server_process`);
a kernel's process must descend from that server's process, and the broker finds the kernel's
children itself. Everything else is ignored and logged. "Busy" counts only while the kernel's
processes are seen using CPU or a GPU, and for at most ``max_busy_without_gpu`` seconds without
the GPU. What one user can make the broker hold is bounded: servers per user, kernels per server,
processes per kernel, and a server that stopped talking is forgotten after ``heartbeat_timeout``.

Servers in containers (Kubernetes pods) know their processes by the pids of their own PID
namespace, which they name when they connect; NVML and this broker (run with ``hostPID``) see host
pids. The server's pid and its kernels' pids are mapped to host pids before anything is checked
(:class:`~jupyter_gpusched.procs.PidNamespaces`), and everything here holds host pids. GPU processes
outside every lease are attributed to the server (and pod) they run under (:meth:`owner_of`).

A kernel belongs to the hub user the ledger records for it (the user of its live lease, or of one
released within :data:`ENDED_MEMORY`; see :meth:`remember_users`), else to the hub user whose
server reported it (or claimed a GPU for it) first; a kernel id never changes hands. So after a
broker restart, another user's server that reports a kernel id first cannot take it: the report
is refused and logged, and the owner's server is believed as before. Within one user, a kernel
stays with the server that reports it while that server's process runs: another of the user's
servers that reports it is refused in the same way, and its heartbeats never end the lease.

A server that falls silent keeps its leases while its kernels' processes live; once it has been
silent for ``heartbeat_timeout`` seconds its kernels count as gone unless their processes still
hold a GPU (those are reported, see :meth:`stranded`). A pid is a kernel's process only while it
started when the process the broker found did: every look checks, so a pid reused between two
heartbeats is never taken for the kernel's.

A server's pod is the one the broker finds its process in (:func:`~jupyter_gpusched.procs.pod_name`);
the host name a server reports is checked against it, and ignored where the broker finds none.

Its parts, each given only what it uses: ``heartbeat.py`` reads a heartbeat, ``registry.py``
holds the servers and kernels and whose each kernel id is, ``pids.py`` checks the processes the
servers name, ``admin.py`` answers the admin's views and ``evidence.py`` weighs a server's word
that a kernel is busy.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Iterable, Mapping

from .. import procs
from ..api.input import ID_PATTERN
from . import admin, evidence
from .heartbeat import MAX_KERNELS, MAX_NOTEBOOK, MAX_PIDS, HeartbeatError, check_kernels, parse_kernel_report
from .pids import PidChecks, adopt, current_pids, gone, is_current, running_pids, same_server_process
from .registry import (
    ENDED_MEMORY,
    Connection,
    OnceLog,
    Registry,
    RemoteKernel,
    RemoteServer,
    TooMany,
    connected,
    silent_for,
)

__all__ = [
    "CPU_EVIDENCE_NS",
    "ENDED_MEMORY",
    "EVIDENCE_WINDOW",
    "ID_PATTERN",
    "MAX_KERNELS",
    "MAX_NOTEBOOK",
    "MAX_PIDS",
    "Connection",
    "HeartbeatError",
    "RemoteKernel",
    "RemoteKernels",
    "RemoteServer",
    "TooMany",
    "parse_kernel_report",
]

log = logging.getLogger("jupyter_gpusched.broker")

#: CPU time (nanoseconds of a kernel's main threads) that counts as evidence the kernel ran code.
CPU_EVIDENCE_NS = 1_000_000
#: How long one piece of evidence backs a server's word that a kernel is busy (hub/evidence.py).
EVIDENCE_WINDOW = evidence.EVIDENCE_WINDOW


class RemoteKernels:
    """Every server's kernels, fed by heartbeats (a :class:`~jupyter_gpusched.arbiter.KernelHost`)."""

    def __init__(
        self,
        server_id: str,
        *,
        heartbeat_timeout: float = 30.0,
        launch_grace: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        gpu_pids: Callable[[], set[int]] = set,
        gpu_use: Callable[[], Mapping[int, float | None]] = dict,
        utilization_threshold: float = 5.0,
        max_servers_per_user: int = 8,
        max_kernels_per_server: int = MAX_KERNELS,
        max_processes_per_kernel: int = MAX_PIDS,
        max_busy_without_gpu: float = 3 * 3600.0,
        namespaces: procs.PidNamespaces | None = None,
        pod_name: Callable[[int], str | None] = procs.pod_name,
    ) -> None:
        #: The broker's own id: it owns every lease in its ledger.
        self.server_id = server_id
        self.heartbeat_timeout = heartbeat_timeout
        self.launch_grace = launch_grace
        self.clock = clock
        self.wall_clock = wall_clock
        self.gpu_pids = gpu_pids
        self.gpu_use = gpu_use
        self.utilization_threshold = utilization_threshold
        self.max_servers_per_user = max_servers_per_user
        self.max_kernels_per_server = max_kernels_per_server
        self.max_processes_per_kernel = max_processes_per_kernel
        self.max_busy_without_gpu = max_busy_without_gpu
        #: Servers, kernels and whose each kernel is: the state, in one place.
        self.registry = Registry()
        #: The checks of the processes servers name (PID namespaces, pods).
        self.pids = PidChecks(namespaces or procs.PidNamespaces(), pod_name)
        self._warnings = OnceLog()
        #: The latest sample of process trees and CPU use (taken off the event loop).
        self._sample: dict[str, tuple[int | None, dict[int, float | None], int]] = {}

    @property
    def _servers(self) -> dict[str, RemoteServer]:
        return self.registry.servers

    @property
    def _kernels(self) -> dict[str, RemoteKernel]:
        return self.registry.kernels

    @property
    def lease_user(self) -> Callable[[str], str | None]:
        """The user of a kernel's live lease, if it has one (the broker sets it: the arbiter's leases)."""
        return self.registry.lease_user

    @lease_user.setter
    def lease_user(self, value: Callable[[str], str | None]) -> None:
        self.registry.lease_user = value

    @property
    def namespaces(self) -> procs.PidNamespaces:
        """Maps pids of the servers' PID namespaces to the broker's."""
        return self.pids.namespaces

    def _warn_once(self, key: str, message: str, *args: Any) -> None:
        self._warnings.warn(key, message, *args)

    # -- servers ------------------------------------------------------------------------------
    def own_namespace(self, pid_ns: int | None) -> bool:
        """Whether a server that names PID namespace ``pid_ns`` (None: none) shares the broker's."""
        return self.pids.own_namespace(pid_ns)

    def server_process(self, pid: int, pid_ns: int | None) -> int:
        """The broker's (host) pid of the process a server names (see :meth:`PidChecks.server_process`).

        Raises:
            procs.NotTheirs: no such process in that namespace, or ``/proc`` cannot tell.
        """
        return self.pids.server_process(pid, pid_ns)

    def connect(
        self,
        server_id: str,
        user: str,
        pid: int | None,
        connection: Connection,
        pid_started: float | None = None,
        *,
        pid_ns: int | None = None,
        ns_pid: int | None = None,
        hostname: str | None = None,
    ) -> RemoteServer:
        """A server opened its websocket; ``pid`` is its process, already checked to be ``user``'s.

        ``pid`` is the broker's (host) pid; a server in another PID namespace names it
        ``pid_ns`` and its pid there ``ns_pid`` (see :meth:`server_process`); the kernel pids
        of its heartbeats are read in that namespace. ``hostname`` is the host name the server
        reports (in a pod, the pod's name): it is checked against the name of the pod the broker
        finds the server's process in, and ignored where the broker finds none.

        Raises PermissionError if the id is another user's, :class:`TooMany` past the bound on
        servers per user.
        """
        if self.own_namespace(pid_ns):
            pid_ns = ns_pid = None
        now = self.clock()
        server = self.registry.open_server(server_id, user, now, self.max_servers_per_user)
        if not same_server_process(server, pid, pid_started, pid_ns):
            # Another process now speaks for this server id: what the old one reported is void.
            for kernel in server.kernels.values():
                kernel.forget_processes()
        server.connection = connection
        server.connected_at = now
        server.last_seen = now
        server.pid = pid
        server.pid_started = pid_started if pid is not None else None
        server.pid_ns, server.ns_pid = pid_ns, ns_pid
        server.hostname = self.pids.checked_pod(server_id, user, pid, pid_ns, hostname)
        if pid_ns is None:
            log.info("server %s of %s connected (pid %s)", server_id, user, pid)
        else:
            log.info(
                "server %s of %s connected (pid %s; pid %s in PID namespace %s of %s)",
                server_id, user, pid, ns_pid, pid_ns, hostname or "a container",
            )
        return server

    def disconnect(self, server_id: str, connection: Connection) -> None:
        server = self._servers.get(server_id)
        if server is not None and server.connection is connection:
            server.connection = None
            log.info("server %s of %s disconnected", server_id, server.user)

    def connection(self, server_id: str) -> Connection | None:
        server = self._servers.get(server_id)
        return server.connection if server is not None else None

    def verified_server(self, server_id: str, user: str) -> bool:
        """Whether ``server_id`` is a connected server of ``user`` whose process was checked."""
        server = self._servers.get(server_id)
        return server is not None and server.user == user and server.connection is not None and server.pid is not None

    def heartbeat(self, server_id: str, kernels: Any) -> list[str]:
        """Fold a server's heartbeat in; returns a problem per kernel entry that was left out."""
        server = self._servers.get(server_id)
        if server is None:
            raise HeartbeatError(f"server {server_id} is not connected")
        check_kernels(kernels, self.max_kernels_per_server)
        now = self.clock()
        server.last_seen = now
        problems = []
        seen = set()
        for kernel_id, info in kernels.items():
            try:
                report = parse_kernel_report(kernel_id, info)
            except HeartbeatError as exc:
                problems.append(str(exc))
                continue
            kernel, problem = self.registry.take(kernel_id, server, now, self._warn_once)
            if kernel is None:
                problems.append(problem)
                continue
            seen.add(kernel_id)
            problem = self._update(server, kernel, report)
            if problem:
                problems.append(problem)
        for kernel_id, kernel in list(server.kernels.items()):
            if kernel_id in seen or kernel_id in kernels:
                # An entry that was refused (unreadable, say) is still the server's word that the
                # kernel exists: only a kernel left out of the heartbeat is forgotten.
                continue
            if kernel.reported or now - kernel.registered > self.launch_grace:
                self._forget(kernel_id, "its server no longer reports it")
        return problems

    def _update(self, server: RemoteServer, kernel: RemoteKernel, report: Mapping[str, Any]) -> str | None:
        problem = None
        reported = pid = report["pid"]
        if pid is not None:
            pid, problem = self.pids.kernel_process(server, kernel, pid)
            if problem is not None:
                self._warn_once(
                    f"pid:{server.server_id}:{kernel.kernel_id}:{reported}",
                    "server %s of %s: %s", server.server_id, server.user, problem,
                )
        adopt(kernel, pid)
        last = report["last_busy_at"]
        if report["busy"] or (last is not None and (kernel.last_busy_at is None or last > kernel.last_busy_at)):
            kernel.last_claim_at = self.wall_clock()
        kernel.reported = True
        kernel.busy = report["busy"]
        kernel.last_busy_at = last
        kernel.started_at = report["started_at"]
        kernel.pid = pid
        kernel.reported_pid = reported if pid is not None else None
        kernel.notebook = report["notebook"]
        kernel.restarting = report["restarting"]
        return problem

    def _forget(self, kernel_id: str, why: str) -> None:
        kernel = self.registry.forget(kernel_id, self.clock())
        if kernel is None:
            return
        self._sample.pop(kernel_id, None)
        log.info("kernel %s of %s is gone: %s", kernel_id, kernel.user, why)

    # -- claims -------------------------------------------------------------------------------
    def user_of(self, kernel_id: str) -> str | None:
        """The hub user a kernel belongs to, if the broker knows (or remembers) it (see
        :meth:`Registry.user_of`)."""
        return self.registry.user_of(kernel_id)

    def remember_users(self, users: Mapping[str, str]) -> None:
        """Whose each kernel is, as the ledger records it (kernel id -> hub user), read when the
        broker starts (see :meth:`Registry.remember_users`)."""
        self.registry.remember_users(users, self.clock())

    def known(self, kernel_id: str) -> bool:
        return kernel_id in self._kernels

    def register(self, kernel_id: str, user: str, server_id: str) -> None:
        """A server claims a GPU for a kernel it has not reported yet (it is being launched)."""
        self.registry.register(kernel_id, user, server_id, self.clock())

    def unregister(self, kernel_id: str) -> None:
        """Undo :meth:`register` for a kernel no server has reported (its claim was refused)."""
        self.registry.unregister(kernel_id)

    def ended(self, kernel_id: str, why: str = "its server says it ended") -> None:
        self._forget(kernel_id, why)

    # -- state ----------------------------------------------------------------------------------
    def _silent_for(self, server: RemoteServer | None, now: float) -> float:
        return silent_for(server, now)

    def _connected(self, server: RemoteServer | None, now: float) -> bool:
        return connected(server, now, self.heartbeat_timeout)

    def prune(self) -> None:
        """Forget long-ended kernels, kernels claimed for but never reported, and servers gone.

        A server that has not spoken for ``heartbeat_timeout`` seconds is forgotten with its
        kernels, except kernels whose processes still hold a GPU (left behind, see
        :meth:`stranded`): their leases stay until those processes end.
        """
        now = self.clock()
        self.registry.expire(now)
        for kernel_id, kernel in list(self._kernels.items()):
            if not kernel.reported and now - kernel.registered > self.launch_grace:
                self._forget(kernel_id, "no server ever reported it")
        for server_id, server in list(self._servers.items()):
            if self._silent_for(server, now) <= self.heartbeat_timeout or server.connection is not None:
                continue
            for kernel_id, kernel in list(server.kernels.items()):
                if kernel.reported and not self.alive(kernel_id):
                    self._forget(kernel_id, f"its server {server_id} stopped sending heartbeats")
            if not server.kernels:
                del self._servers[server_id]
                log.info("server %s of %s forgotten: silent for %.0fs", server_id, server.user, self._silent_for(server, now))

    # -- the admin's views ----------------------------------------------------------------------
    def servers(self) -> list[dict]:
        """The servers and their kernels, for the admin."""
        return admin.servers(self.registry, self.clock(), self.heartbeat_timeout)

    def connected_servers(self) -> list[frozenset[str]]:
        """The kernel ids of each server that speaks to the broker now (one set per server)."""
        return admin.connected_servers(self.registry, self.clock(), self.heartbeat_timeout)

    def owner_of(self, pid: int) -> dict[str, str | None]:
        """The server a host process runs under: ``server_id``, ``user``, ``pod`` (None: unknown);
        see :func:`~jupyter_gpusched.hub.admin.owner_of`."""
        return admin.owner_of(self.registry, pid)

    def stranded(self) -> list[dict]:
        """GPU processes of kernels whose server fell silent: left behind, for the admin to see."""
        now = self.clock()
        return admin.stranded(self.registry, now, self.heartbeat_timeout, self.gpu_pids(), self._warnings)

    # -- KernelHost ----------------------------------------------------------------------------
    def activity(self) -> Mapping[str, tuple[bool, float | None, float | None]]:
        """Each kernel's activity as far as the broker can confirm it.

        A server's word that a kernel is busy (or was busy at some moment) is weighed against what
        was seen of its processes by :func:`~jupyter_gpusched.hub.evidence.weigh`.
        """
        now = self.clock()
        wall = self.wall_clock()
        self._fold_sample(wall)
        use = self.gpu_use() if self._kernels else {}
        out = {}
        for kernel in self._kernels.values():
            gpu_now = any(
                (use.get(p) or 0.0) >= self.utilization_threshold
                for p in kernel.all_pids()
                if p in use and is_current(kernel, p)
            )
            verdict = evidence.weigh(
                evidence.Word(kernel.busy, kernel.last_busy_at, kernel.started_at, kernel.last_claim_at),
                evidence.Seen(kernel.cpu_seen_at, kernel.gpu_seen_at, gpu_now, kernel.claimed_since),
                connected=self._connected(self._servers.get(kernel.server_id), now),
                now=wall,
                heartbeat_timeout=self.heartbeat_timeout,
                max_busy_without_gpu=self.max_busy_without_gpu,
            )
            kernel.gpu_seen_at, kernel.claimed_since = verdict.gpu_seen_at, verdict.claimed_since
            if verdict.doubt is not None:
                self._warn_once(
                    f"busy:{kernel.kernel_id}:{verdict.doubt}",
                    "kernel %s of %s: its server says it is busy %s; counted as not busy",
                    kernel.kernel_id, kernel.user, verdict.doubt,
                )
            out[kernel.kernel_id] = (verdict.busy, verdict.last_busy_at, verdict.started_at)
        return out

    def _fold_sample(self, wall: float) -> None:
        """Take the latest process sample: each kernel's tree, and whether it used CPU since the last."""
        sample, self._sample = self._sample, {}
        for kernel_id, (pid, tree, runtime) in sample.items():
            kernel = self._kernels.get(kernel_id)
            if kernel is None or kernel.pid != pid or pid is None:
                continue
            kernel.tree = frozenset(tree)
            kernel.tree_started = tree
            if kernel.runtime_ns is not None and runtime - kernel.runtime_ns >= CPU_EVIDENCE_NS:
                kernel.cpu_seen_at = wall
            kernel.runtime_ns = runtime

    def alive(self, kernel_id: str) -> bool | None:
        kernel = self._kernels.get(kernel_id)
        if kernel is None:
            return False if kernel_id in self.registry.ended else None
        now = self.clock()
        server = self._servers.get(kernel.server_id)
        young = now - kernel.registered < self.launch_grace
        if self._connected(server, now):
            return kernel.reported or young
        running = running_pids(kernel)
        if self._silent_for(server, now) <= self.heartbeat_timeout:
            # Just disconnected (a restart of either side, a network blip): keep it while its
            # processes run; a server that stopped took its kernels with it.
            if kernel.all_pids():
                return bool(running)
            return True if young else None  # nothing to look at yet: not known to have ended
        # Silent for too long: only GPU processes left behind keep the lease.
        return bool(running & self.gpu_pids())

    def said_running(self, kernel_id: str) -> bool:
        """The connected server's word that the kernel runs a cell (no evidence asked).

        Not enough to count the kernel busy (see :meth:`executing`), but enough to choose an
        idle kernel over this one when a waiting claim could take either.
        """
        kernel = self._kernels.get(kernel_id)
        if kernel is None or not kernel.busy:
            return False
        return self._connected(self._servers.get(kernel.server_id), self.clock())

    def executing(self, kernel_id: str) -> bool:
        """Always False: a server's word that its kernel runs a cell is weighed against the
        evidence in :meth:`activity` at each pass, and must not call off a reclaim on its own
        (a server could keep a GPU that way forever)."""
        return False

    def asking(self, kernel_id: str) -> None:
        """Nothing: a kernel asks through its own server, whose heartbeats say whether it runs."""

    def restarting(self, kernel_id: str) -> bool:
        """Being restarted: its server says so, or still lists it while its process is gone.

        A restart kills the kernel's process between two heartbeats; the server's kernel manager
        keeps the kernel (and a new process takes over), so its lease stays.
        """
        kernel = self._kernels.get(kernel_id)
        if kernel is None:
            return False
        if kernel.restarting:
            return True
        server = self._servers.get(kernel.server_id)
        return (
            kernel.reported
            and kernel.pid is not None
            and self._connected(server, self.clock())
            and gone(kernel.pid)
        )

    def kernel_pid(self, kernel_id: str) -> int | None:
        """The kernel's process, while that pid is still it (None once it ended or was reused)."""
        kernel = self._kernels.get(kernel_id)
        if kernel is None or kernel.pid is None or not is_current(kernel, kernel.pid):
            return None
        return kernel.pid

    def process_tree(self, kernel_id: str) -> set[int]:
        """The kernel's processes that are still the ones found (each pid's start time checked)."""
        kernel = self._kernels.get(kernel_id)
        return current_pids(kernel) if kernel is not None else set()

    def process_trees(self) -> dict[str, set[int]]:
        """Every kernel's process tree, found from its checked process (run off the event loop).

        The trees and the CPU time of their processes are kept as a sample that the next
        :meth:`activity` folds in.
        """
        roots = {
            kid: kernel.pid
            for kid, kernel in list(self._kernels.items())
            if kernel.pid is not None and procs.same_process(kernel.pid, kernel.pid_started)
        }
        trees = procs.process_trees(roots, limit=self.max_processes_per_kernel)
        sample = {}
        for kid, tree in trees.items():
            started = {pid: procs.started(pid) for pid in tree}
            tree = {pid for pid, at in started.items() if at is not None}
            trees[kid] = tree
            sample[kid] = (roots[kid], {pid: started[pid] for pid in tree}, procs.runtime_ns(tree))
        self._sample = sample
        out: dict[str, set[int]] = {kid: set() for kid in self._kernels}
        out.update(trees)
        return out

    def notebook(self, kernel_id: str) -> str | None:
        kernel = self._kernels.get(kernel_id)
        return kernel.notebook if kernel is not None else None

    async def refresh_notebooks(self) -> None:
        """Notebook names come with each server's heartbeat: nothing to read here."""

    def adopted(self, kernel_id: str) -> None:
        """A restarted kernel's new process owns its lease: its server says so in its heartbeats."""

    def kernels_of(self, user: str) -> Iterable[str]:
        return [kid for kid, kernel in self._kernels.items() if kernel.user == user]

    async def _order(self, action: str, kernel_id: str) -> None:
        kernel = self._kernels.get(kernel_id)
        server = self._servers.get(kernel.server_id) if kernel is not None else None
        if server is None or server.connection is None:
            raise RuntimeError(f"cannot {action} kernel {kernel_id}: its server is not connected")
        log.info("kernel %s of %s: asking server %s to %s it", kernel_id, server.user, server.server_id, action)
        await server.connection.order(action, kernel_id)

    async def restart(self, kernel_id: str) -> None:
        await self._order("restart", kernel_id)

    async def shutdown(self, kernel_id: str) -> None:
        await self._order("shutdown", kernel_id)
