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
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Protocol

import psutil

from .. import procs
from ..api.input import ID_PATTERN
from . import evidence

log = logging.getLogger("jupyter_gpusched.broker")

#: Bounds on what one heartbeat may carry (the broker's traits may set lower ones).
MAX_KERNELS = 128
MAX_PIDS = 256
MAX_NOTEBOOK = 512
#: How long an ended kernel is remembered (so that a late claim for it is refused).
ENDED_MEMORY = 3600.0
#: CPU time (nanoseconds of a kernel's main threads) that counts as evidence the kernel ran code.
CPU_EVIDENCE_NS = 1_000_000
#: How long one piece of evidence backs a server's word that a kernel is busy (hub/evidence.py).
EVIDENCE_WINDOW = evidence.EVIDENCE_WINDOW


class HeartbeatError(ValueError):
    """A heartbeat (or part of it) that does not make sense; the message says what."""


class TooMany(PermissionError):
    """A user went over one of the broker's bounds (servers, kernels)."""


class Connection(Protocol):
    """A server's websocket, as the broker uses it."""

    async def order(self, action: str, kernel_id: str) -> None: ...


@dataclass
class RemoteKernel:
    kernel_id: str
    user: str
    server_id: str
    registered: float
    reported: bool = False
    busy: bool = False
    last_busy_at: float | None = None
    started_at: float | None = None
    #: The kernel's process (host pid), once checked to descend from its server's process.
    pid: int | None = None
    #: The pid its server reported for it, in the server's PID namespace.
    reported_pid: int | None = None
    pid_started: float | None = None
    #: The kernel's process and its descendants, as the broker found them, and when each started
    #: (a pid is the same process only while its start time is: checked at every look).
    tree: frozenset[int] = frozenset()
    tree_started: Mapping[int, float | None] = field(default_factory=dict)
    notebook: str | None = None
    restarting: bool = False
    #: Evidence, in seconds since the epoch: when its processes last used CPU, and a GPU.
    runtime_ns: int | None = None
    cpu_seen_at: float | None = None
    gpu_seen_at: float | None = None
    #: When the server began claiming activity without the GPU being used (None: not now).
    claimed_since: float | None = None
    last_claim_at: float | None = None

    def all_pids(self) -> set[int]:
        return set(self.tree) | ({self.pid} if self.pid else set())


@dataclass
class RemoteServer:
    server_id: str
    user: str
    last_seen: float
    #: The server's process, as the broker sees it (host pid).
    pid: int | None = None
    pid_started: float | None = None
    #: The server's PID namespace when it is not the broker's (a container's), and its pid there.
    pid_ns: int | None = None
    ns_pid: int | None = None
    #: The name of its pod (container), as the broker found it (see :func:`procs.pod_name`); the
    #: host name a server reports is only checked against it, never believed on its own.
    hostname: str | None = None
    connection: Connection | None = None
    connected_at: float | None = None
    kernels: dict[str, RemoteKernel] = field(default_factory=dict)


def _optional_time(value: Any, name: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or value < 0:
        raise HeartbeatError(f"{name} must be a time in seconds since the epoch or null")
    return float(value)


def _pid(value: Any, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0 or value > 2**31:
        raise HeartbeatError(f"{name} must be a process id or null")
    return value


def parse_kernel_report(kernel_id: Any, info: Any) -> dict:
    """One kernel's entry of a heartbeat, checked; raises :class:`HeartbeatError`.

    A ``pids`` list is accepted for compatibility (bounded), but never believed: the broker
    finds a kernel's processes itself.
    """
    if not isinstance(kernel_id, str) or not ID_PATTERN.match(kernel_id):
        raise HeartbeatError(f"kernel id {str(kernel_id)[:40]!r} is not a kernel id")
    if not isinstance(info, dict):
        raise HeartbeatError(f"kernel {kernel_id}: its entry must be an object")
    pids = info.get("pids") or []
    if not isinstance(pids, list) or len(pids) > MAX_PIDS:
        raise HeartbeatError(f"kernel {kernel_id}: pids must be a list of at most {MAX_PIDS} process ids")
    notebook = info.get("notebook")
    if notebook is not None and (not isinstance(notebook, str) or len(notebook) > MAX_NOTEBOOK):
        raise HeartbeatError(f"kernel {kernel_id}: notebook must be a path of at most {MAX_NOTEBOOK} characters")
    return {
        "busy": bool(info.get("busy", False)),
        "last_busy_at": _optional_time(info.get("last_busy_at"), "last_busy_at"),
        "started_at": _optional_time(info.get("started_at"), "started_at"),
        "pid": _pid(info.get("pid"), "pid"),
        "notebook": notebook,
        "restarting": bool(info.get("restarting", False)),
    }


def _running(pid: int, started: float | None = None) -> bool:
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


def _gone(pid: int) -> bool:
    """Whether ``pid`` has exited (or is a zombie); cheap, as it runs for every lease on every pass."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return True
    except OSError:
        return not _running(pid)  # no /proc here: ask psutil
    state = stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3]
    return state in (b"Z", b"X")


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
        #: Maps pids of the servers' PID namespaces to the broker's.
        self.namespaces = namespaces or procs.PidNamespaces()
        #: The pod a host process runs in, where the host can vouch for its name.
        self.pod_name = pod_name
        self._servers: dict[str, RemoteServer] = {}
        self._kernels: dict[str, RemoteKernel] = {}
        self._ended: dict[str, tuple[str, float]] = {}
        #: Whose each kernel is as the ledger records it (kernel id -> (user, when read)).
        self._recorded: dict[str, tuple[str, float]] = {}
        #: The user of a kernel's live lease, if it has one (the broker sets it: the arbiter's leases).
        self.lease_user: Callable[[str], str | None] = lambda kernel_id: None
        self._warned: set[str] = set()
        #: The latest sample of process trees and CPU use (taken off the event loop).
        self._sample: dict[str, tuple[int | None, dict[int, float | None], int]] = {}

    def _warn_once(self, key: str, message: str, *args: Any) -> None:
        if key not in self._warned:
            if len(self._warned) > 10_000:
                self._warned.clear()
            self._warned.add(key)
            log.warning(message, *args)

    # -- servers ------------------------------------------------------------------------------
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
        server = self._servers.get(server_id)
        if server is not None and server.user != user:
            raise PermissionError(f"server id {server_id} belongs to another user")
        if server is None or server.connection is None:
            live = [s for s in self._servers.values() if s.user == user and s.connection is not None]
            if len(live) >= self.max_servers_per_user:
                raise TooMany(
                    f"{user} has {len(live)} servers connected to the GPU broker already, the most allowed "
                    f"(c.GPUBroker.max_servers_per_user)"
                )
        if server is None:
            server = self._servers[server_id] = RemoteServer(server_id, user, now)
        same_start = (server.pid_started is None) == (pid_started is None) and (
            pid_started is None or abs(server.pid_started - pid_started) < procs.START_TIME_TOLERANCE
        )
        if server.pid != pid or not same_start or server.pid_ns != pid_ns:
            # Another process now speaks for this server id: what the old one reported is void.
            for kernel in server.kernels.values():
                kernel.pid, kernel.pid_started, kernel.tree, kernel.tree_started = None, None, frozenset(), {}
                kernel.reported_pid = None
        server.connection = connection
        server.connected_at = now
        server.last_seen = now
        server.pid = pid
        server.pid_started = pid_started if pid is not None else None
        server.pid_ns, server.ns_pid = pid_ns, ns_pid
        server.hostname = self._checked_pod(server_id, user, pid, pid_ns, hostname)
        if pid_ns is None:
            log.info("server %s of %s connected (pid %s)", server_id, user, pid)
        else:
            log.info(
                "server %s of %s connected (pid %s; pid %s in PID namespace %s of %s)",
                server_id, user, pid, ns_pid, pid_ns, hostname or "a container",
            )
        return server

    def _checked_pod(
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
        if not isinstance(kernels, dict):
            raise HeartbeatError("kernels must be an object: kernel id -> its state")
        if len(kernels) > self.max_kernels_per_server:
            raise HeartbeatError(
                f"a heartbeat may report at most {self.max_kernels_per_server} kernels "
                "(c.GPUBroker.max_kernels_per_server)"
            )
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
            kernel = self._kernels.get(kernel_id)
            owner = kernel.user if kernel is not None else self.user_of(kernel_id)
            if owner is not None and owner != server.user:
                # Refused for the newcomer only: the owner's kernel, lease and heartbeats stay.
                problems.append(f"kernel {kernel_id} belongs to another user")
                self._warn_once(
                    f"user:{kernel_id}:{server_id}",
                    "server %s of %s reported kernel %s, which is %s's; ignored",
                    server_id, server.user, kernel_id, owner,
                )
                continue
            if kernel is None:
                self._ended.pop(kernel_id, None)
                self._recorded.pop(kernel_id, None)
                kernel = self._kernels[kernel_id] = RemoteKernel(kernel_id, server.user, server_id, now)
            elif kernel.server_id != server_id and self._holds(kernel):
                problems.append(f"kernel {kernel_id} is another server's (server {kernel.server_id})")
                self._warn_once(
                    f"server:{kernel_id}:{server_id}",
                    "server %s of %s reported kernel %s of its server %s, which still runs; ignored",
                    server_id, server.user, kernel_id, kernel.server_id,
                )
                continue
            if kernel.server_id != server_id:
                old = self._servers.get(kernel.server_id)
                if old is not None:
                    old.kernels.pop(kernel_id, None)
                kernel.server_id = server_id
                kernel.pid, kernel.pid_started, kernel.tree, kernel.tree_started = None, None, frozenset(), {}
                kernel.reported_pid = None
            server.kernels[kernel_id] = kernel
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

    def _holds(self, kernel: RemoteKernel) -> bool:
        """Whether the server a kernel is with still has it: the server reported it and is
        connected, or its process still runs (a server that only lost its connection comes back)."""
        server = self._servers.get(kernel.server_id)
        if server is None or kernel.kernel_id not in server.kernels:
            return False
        if server.connection is not None:
            return kernel.reported
        return kernel.reported and server.pid is not None and procs.same_process(server.pid, server.pid_started)

    def _check_pid(self, server: RemoteServer, kernel: RemoteKernel, pid: int) -> str | None:
        """None if ``pid`` may be this kernel's process, else why not."""
        if kernel.pid == pid and kernel.pid_started is not None and procs.same_process(pid, kernel.pid_started):
            return None  # checked before: the same process still
        if server.pid is None:
            return f"kernel {kernel.kernel_id}: process {pid} ignored: the server did not name its own process"
        if not procs.same_process(server.pid, server.pid_started):
            return f"kernel {kernel.kernel_id}: process {pid} ignored: the server's own process is gone"
        if not procs.descends_from(pid, server.pid):
            return f"kernel {kernel.kernel_id}: process {pid} ignored: it is not a process of this server"
        return None

    def _host_pid(self, server: RemoteServer, kernel: RemoteKernel, pid: int) -> tuple[int | None, str | None]:
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

    def _update(self, server: RemoteServer, kernel: RemoteKernel, report: Mapping[str, Any]) -> str | None:
        problem = None
        reported = pid = report["pid"]
        if pid is not None:
            pid, problem = self._host_pid(server, kernel, pid)
            if pid is not None:
                problem = self._check_pid(server, kernel, pid)
            if problem is not None:
                self._warn_once(
                    f"pid:{server.server_id}:{kernel.kernel_id}:{reported}",
                    "server %s of %s: %s", server.server_id, server.user, problem,
                )
                pid = None
        if pid != kernel.pid or (pid is not None and not procs.same_process(pid, kernel.pid_started)):
            # Another process (or the same pid, reused by a new process, checked above as one).
            kernel.pid_started = procs.started(pid) if pid else None
            kernel.tree = frozenset({pid}) if pid else frozenset()
            kernel.tree_started = {pid: kernel.pid_started} if pid else {}
            # The CPU baseline is read now, not at the next sample: a first cell that runs in
            # between (it often follows the kernel's start at once) would otherwise leave no trace.
            kernel.runtime_ns = procs.runtime_ns([pid]) if pid else None
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
        kernel = self._kernels.pop(kernel_id, None)
        if kernel is None:
            return
        server = self._servers.get(kernel.server_id)
        if server is not None:
            server.kernels.pop(kernel_id, None)
        self._sample.pop(kernel_id, None)
        self._ended[kernel_id] = (kernel.user, self.clock())
        log.info("kernel %s of %s is gone: %s", kernel_id, kernel.user, why)

    # -- claims -------------------------------------------------------------------------------
    def user_of(self, kernel_id: str) -> str | None:
        """The hub user a kernel belongs to, if the broker knows (or remembers) it.

        The user of the kernel's live lease first, then what the ledger recorded when the broker
        started (:meth:`remember_users`), then the user whose server reported it.
        """
        leased = self.lease_user(kernel_id)
        if leased is not None:
            return leased
        recorded = self._recorded.get(kernel_id)
        if recorded is not None:
            return recorded[0]
        kernel = self._kernels.get(kernel_id)
        if kernel is not None:
            return kernel.user
        ended = self._ended.get(kernel_id)
        return ended[0] if ended is not None else None

    def remember_users(self, users: Mapping[str, str]) -> None:
        """Whose each kernel is, as the ledger records it (kernel id -> hub user), read when the
        broker starts: no server's report can take those kernel ids from their users. Remembered
        for :data:`ENDED_MEMORY` seconds, or until the kernel's own user's server reports it."""
        now = self.clock()
        for kernel_id, user in users.items():
            if kernel_id not in self._kernels:
                self._recorded[kernel_id] = (user, now)
        if users:
            log.info("the ledger records the users of %d kernel(s)", len(users))

    def known(self, kernel_id: str) -> bool:
        return kernel_id in self._kernels

    def register(self, kernel_id: str, user: str, server_id: str) -> None:
        """A server claims a GPU for a kernel it has not reported yet (it is being launched)."""
        if not ID_PATTERN.match(kernel_id) or not ID_PATTERN.match(server_id):
            raise ValueError("kernel and server ids are letters, digits, '-' and '_'")
        owner = self.user_of(kernel_id)
        if owner is not None and owner != user:
            raise PermissionError(f"kernel {kernel_id} belongs to another user")
        now = self.clock()
        server = self._servers.get(server_id)
        if server is None:
            server = self._servers[server_id] = RemoteServer(server_id, user, now)
        elif server.user != user:
            raise PermissionError(f"server id {server_id} belongs to another user")
        kernel = self._kernels.get(kernel_id)
        if kernel is None:
            self._ended.pop(kernel_id, None)
            kernel = self._kernels[kernel_id] = RemoteKernel(kernel_id, user, server_id, now)
            server.kernels[kernel_id] = kernel

    def unregister(self, kernel_id: str) -> None:
        """Undo :meth:`register` for a kernel no server has reported (its claim was refused)."""
        kernel = self._kernels.get(kernel_id)
        if kernel is None or kernel.reported:
            return
        del self._kernels[kernel_id]
        server = self._servers.get(kernel.server_id)
        if server is not None:
            server.kernels.pop(kernel_id, None)

    def ended(self, kernel_id: str, why: str = "its server says it ended") -> None:
        self._forget(kernel_id, why)

    # -- state ----------------------------------------------------------------------------------
    def _silent_for(self, server: RemoteServer | None, now: float) -> float:
        return float("inf") if server is None else now - server.last_seen

    def _connected(self, server: RemoteServer | None, now: float) -> bool:
        return server is not None and server.connection is not None and self._silent_for(server, now) <= self.heartbeat_timeout

    def _running_pids(self, kernel: RemoteKernel) -> set[int]:
        out = set()
        if kernel.pid is not None and _running(kernel.pid, kernel.pid_started):
            out.add(kernel.pid)
            out.update(
                p for p in kernel.tree
                if p != kernel.pid and kernel.tree_started.get(p) is not None and _running(p, kernel.tree_started[p])
            )
        return out

    @staticmethod
    def _is_current(kernel: RemoteKernel, pid: int) -> bool:
        """Whether ``pid`` is still the process of ``kernel`` that the broker found (it runs, and
        started when that one did: a pid reused since is another process)."""
        if pid == kernel.pid:
            started = kernel.pid_started
        elif pid in kernel.tree:
            started = kernel.tree_started.get(pid)
        else:
            return False
        return started is not None and procs.same_process(pid, started)

    def _current_pids(self, kernel: RemoteKernel) -> set[int]:
        """The kernel's processes that are still the ones the broker found (checked now)."""
        return {p for p in kernel.all_pids() if self._is_current(kernel, p)}

    def prune(self) -> None:
        """Forget long-ended kernels, kernels claimed for but never reported, and servers gone.

        A server that has not spoken for ``heartbeat_timeout`` seconds is forgotten with its
        kernels, except kernels whose processes still hold a GPU (left behind, see
        :meth:`stranded`): their leases stay until those processes end.
        """
        now = self.clock()
        for memory in (self._ended, self._recorded):
            for kernel_id, (_, at) in list(memory.items()):
                if now - at > ENDED_MEMORY:
                    del memory[kernel_id]
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

    def servers(self) -> list[dict]:
        """The servers and their kernels, for the admin."""
        now = self.clock()
        out = []
        for server in sorted(self._servers.values(), key=lambda s: (s.user, s.server_id)):
            out.append(
                {
                    "server_id": server.server_id,
                    "user": server.user,
                    "pid": server.pid,
                    "pod": self._pod(server),
                    "connected": self._connected(server, now),
                    "silent_seconds": round(self._silent_for(server, now), 1),
                    "kernels": sorted(server.kernels),
                }
            )
        return out

    def connected_servers(self) -> list[frozenset[str]]:
        """The kernel ids of each server that speaks to the broker now (one set per server)."""
        now = self.clock()
        return [frozenset(s.kernels) for s in self._servers.values() if self._connected(s, now)]

    @staticmethod
    def _pod(server: RemoteServer) -> str | None:
        """The pod (container) a server runs in: its host name, for a server in a PID namespace
        of its own; None for one that shares the broker's."""
        return server.hostname if server.pid_ns is not None else None

    def owner_of(self, pid: int) -> dict[str, str | None]:
        """The server a host process runs under: ``server_id``, ``user``, ``pod`` (None: unknown).

        A process belongs to a server when it is in one of its kernels' trees (and is still the
        process found there: its start time is checked), descends from the server's process, or
        lives in the PID namespace of a server in a namespace of its own, or in a namespace made
        inside that one (a process of its pod).
        """
        for kernel in self._kernels.values():
            if pid in kernel.all_pids() and self._is_current(kernel, pid):
                server = self._servers.get(kernel.server_id)
                if server is not None:
                    return self._owner_fields(server)
        by_pid = {server.pid: server for server in self._servers.values() if server.pid is not None}
        for candidate in [pid, *procs.ancestors(pid)]:
            server = by_pid.get(candidate)
            if server is not None and procs.same_process(candidate, server.pid_started):
                return self._owner_fields(server)
        pods = [server for server in self._servers.values() if server.pid_ns is not None]
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
                        return self._owner_fields(server)
        return {"server_id": None, "user": None, "pod": None}

    def _owner_fields(self, server: RemoteServer) -> dict[str, str | None]:
        return {"server_id": server.server_id, "user": server.user, "pod": self._pod(server)}

    def stranded(self) -> list[dict]:
        """GPU processes of kernels whose server fell silent: left behind, for the admin to see."""
        now = self.clock()
        on_gpu = self.gpu_pids()
        out = []
        for kernel in self._kernels.values():
            server = self._servers.get(kernel.server_id)
            if self._silent_for(server, now) <= self.heartbeat_timeout:
                continue
            for pid in sorted(kernel.all_pids() & on_gpu):
                if _running(pid) and self._is_current(kernel, pid):
                    out.append({"pid": pid, "kernel_id": kernel.kernel_id, "user": kernel.user, "server_id": kernel.server_id})
        for item in out:
            key = f"stranded:{item['pid']}"
            if key not in self._warned:
                self._warned.add(key)
                log.warning(
                    "GPU process %s of kernel %s (%s) is left behind: its server %s stopped sending heartbeats",
                    item["pid"], item["kernel_id"], item["user"], item["server_id"],
                )
        return out

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
                if p in use and self._is_current(kernel, p)
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
            return False if kernel_id in self._ended else None
        now = self.clock()
        server = self._servers.get(kernel.server_id)
        young = now - kernel.registered < self.launch_grace
        if self._connected(server, now):
            return kernel.reported or young
        running = self._running_pids(kernel)
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
            and _gone(kernel.pid)
        )

    def kernel_pid(self, kernel_id: str) -> int | None:
        """The kernel's process, while that pid is still it (None once it ended or was reused)."""
        kernel = self._kernels.get(kernel_id)
        if kernel is None or kernel.pid is None or not self._is_current(kernel, kernel.pid):
            return None
        return kernel.pid

    def process_tree(self, kernel_id: str) -> set[int]:
        """The kernel's processes that are still the ones found (each pid's start time checked)."""
        kernel = self._kernels.get(kernel_id)
        return self._current_pids(kernel) if kernel is not None else set()

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
