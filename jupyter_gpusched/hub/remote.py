"""The kernels of every single-user server, as the broker sees them through their heartbeats.

:class:`RemoteKernels` is the broker's :class:`~jupyter_gpusched.arbiter.KernelHost`: the same
``LocalArbiter`` that schedules one server's kernels in standalone mode schedules all servers'
kernels here. Each single-user server keeps a websocket open to the broker and sends a heartbeat
every ``heartbeat_interval`` seconds: its kernels, whether each is executing, when it last did,
its process id and the process ids of its children. Orders (restart, shutdown) go back over the
same websocket: the server owns its kernels and runs as their Unix user, so it carries them out.

A kernel belongs to the hub user whose server reported it (or claimed a GPU for it) first; a
kernel id never changes hands. A server that falls silent keeps its leases while its kernels'
processes live; once it has been silent for ``heartbeat_timeout`` seconds its kernels count as
gone unless their processes still hold a GPU (those are reported, see :meth:`stranded`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Protocol

import psutil

from ..api_input import ID_PATTERN

log = logging.getLogger("jupyter_gpusched.broker")

#: Bounds on what one heartbeat may carry.
MAX_KERNELS = 1000
MAX_PIDS = 4096
MAX_NOTEBOOK = 1024
#: How long an ended kernel is remembered (so that a late claim for it is refused).
ENDED_MEMORY = 3600.0


class HeartbeatError(ValueError):
    """A heartbeat (or part of it) that does not make sense; the message says what."""


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
    pid: int | None = None
    pid_started: float | None = None
    pids: frozenset[int] = frozenset()
    notebook: str | None = None
    restarting: bool = False

    def all_pids(self) -> set[int]:
        return set(self.pids) | ({self.pid} if self.pid else set())


@dataclass
class RemoteServer:
    server_id: str
    user: str
    last_seen: float
    pid: int | None = None
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
    """One kernel's entry of a heartbeat, checked; raises :class:`HeartbeatError`."""
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
        "pids": frozenset(p for p in (_pid(p, "pids[]") for p in pids) if p),
        "notebook": notebook,
        "restarting": bool(info.get("restarting", False)),
    }


def _started(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


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
        gpu_pids: Callable[[], set[int]] = set,
    ) -> None:
        #: The broker's own id: it owns every lease in its ledger.
        self.server_id = server_id
        self.heartbeat_timeout = heartbeat_timeout
        self.launch_grace = launch_grace
        self.clock = clock
        self.gpu_pids = gpu_pids
        self._servers: dict[str, RemoteServer] = {}
        self._kernels: dict[str, RemoteKernel] = {}
        self._ended: dict[str, tuple[str, float]] = {}
        self._pid_kernel: dict[int, str] = {}
        self._warned: set[str] = set()

    # -- servers ------------------------------------------------------------------------------
    def connect(self, server_id: str, user: str, pid: int | None, connection: Connection) -> RemoteServer:
        """A server opened its websocket. Raises PermissionError if the id is another user's."""
        now = self.clock()
        server = self._servers.get(server_id)
        if server is not None and server.user != user:
            raise PermissionError(f"server id {server_id} belongs to another user")
        if server is None:
            server = self._servers[server_id] = RemoteServer(server_id, user, now)
        server.connection = connection
        server.connected_at = now
        server.last_seen = now
        server.pid = pid
        log.info("server %s of %s connected (pid %s)", server_id, user, pid)
        return server

    def disconnect(self, server_id: str, connection: Connection) -> None:
        server = self._servers.get(server_id)
        if server is not None and server.connection is connection:
            server.connection = None
            log.info("server %s of %s disconnected", server_id, server.user)

    def connection(self, server_id: str) -> Connection | None:
        server = self._servers.get(server_id)
        return server.connection if server is not None else None

    def heartbeat(self, server_id: str, kernels: Any) -> list[str]:
        """Fold a server's heartbeat in; returns a problem per kernel entry that was left out."""
        server = self._servers.get(server_id)
        if server is None:
            raise HeartbeatError(f"server {server_id} is not connected")
        if not isinstance(kernels, dict):
            raise HeartbeatError("kernels must be an object: kernel id -> its state")
        if len(kernels) > MAX_KERNELS:
            raise HeartbeatError(f"a heartbeat may report at most {MAX_KERNELS} kernels")
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
            if kernel is None:
                ended = self._ended.get(kernel_id)
                if ended is not None and ended[0] != server.user:
                    problems.append(f"kernel {kernel_id} belongs to another user")
                    continue
                self._ended.pop(kernel_id, None)
                kernel = self._kernels[kernel_id] = RemoteKernel(kernel_id, server.user, server_id, now)
            elif kernel.user != server.user:
                problems.append(f"kernel {kernel_id} belongs to another user")
                if kernel_id not in self._warned:
                    self._warned.add(kernel_id)
                    log.warning(
                        "server %s of %s reported kernel %s of %s; ignored",
                        server_id, server.user, kernel_id, kernel.user,
                    )
                continue
            if kernel.server_id != server_id:
                old = self._servers.get(kernel.server_id)
                if old is not None:
                    old.kernels.pop(kernel_id, None)
                kernel.server_id = server_id
            server.kernels[kernel_id] = kernel
            seen.add(kernel_id)
            self._update(kernel, report)
        for kernel_id, kernel in list(server.kernels.items()):
            if kernel_id in seen:
                continue
            if kernel.reported or now - kernel.registered > self.launch_grace:
                self._forget(kernel_id, "its server no longer reports it")
        return problems

    def _update(self, kernel: RemoteKernel, report: Mapping[str, Any]) -> None:
        pid = report["pid"]
        if pid != kernel.pid:
            kernel.pid_started = _started(pid) if pid else None
        # A process already reported for another user's kernel stays theirs.
        mine = set()
        for p in report["pids"] | ({pid} if pid else set()):
            holder = self._pid_kernel.get(p)
            other = self._kernels.get(holder) if holder is not None else None
            if other is not None and other.user != kernel.user:
                continue
            mine.add(p)
        if pid is not None and pid not in mine:
            pid = None
        for p in kernel.all_pids() - mine:
            if self._pid_kernel.get(p) == kernel.kernel_id:
                del self._pid_kernel[p]
        for p in mine:
            self._pid_kernel[p] = kernel.kernel_id
        kernel.reported = True
        kernel.busy = report["busy"]
        kernel.last_busy_at = report["last_busy_at"]
        kernel.started_at = report["started_at"]
        kernel.pid = pid
        kernel.pids = frozenset(mine)
        kernel.notebook = report["notebook"]
        kernel.restarting = report["restarting"]

    def _forget(self, kernel_id: str, why: str) -> None:
        kernel = self._kernels.pop(kernel_id, None)
        if kernel is None:
            return
        server = self._servers.get(kernel.server_id)
        if server is not None:
            server.kernels.pop(kernel_id, None)
        for p in kernel.all_pids():
            if self._pid_kernel.get(p) == kernel_id:
                del self._pid_kernel[p]
        self._ended[kernel_id] = (kernel.user, self.clock())
        log.info("kernel %s of %s is gone: %s", kernel_id, kernel.user, why)

    # -- claims -------------------------------------------------------------------------------
    def user_of(self, kernel_id: str) -> str | None:
        """The hub user a kernel belongs to, if the broker knows (or remembers) it."""
        kernel = self._kernels.get(kernel_id)
        if kernel is not None:
            return kernel.user
        ended = self._ended.get(kernel_id)
        return ended[0] if ended is not None else None

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
        out.update(p for p in kernel.pids if p != kernel.pid and _running(p))
        return out

    def prune(self) -> None:
        """Forget long-ended kernels, kernels claimed for but never reported, and servers gone with nothing left."""
        now = self.clock()
        for kernel_id, (_, at) in list(self._ended.items()):
            if now - at > ENDED_MEMORY:
                del self._ended[kernel_id]
        for kernel_id, kernel in list(self._kernels.items()):
            if not kernel.reported and now - kernel.registered > self.launch_grace:
                self._forget(kernel_id, "no server ever reported it")
        for server_id, server in list(self._servers.items()):
            if server.connection is None and not server.kernels and self._silent_for(server, now) > self.heartbeat_timeout:
                del self._servers[server_id]

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
                    "connected": self._connected(server, now),
                    "silent_seconds": round(self._silent_for(server, now), 1),
                    "kernels": sorted(server.kernels),
                }
            )
        return out

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
                if _running(pid):
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
        now = self.clock()
        out = {}
        for kernel in self._kernels.values():
            live = self._connected(self._servers.get(kernel.server_id), now)
            out[kernel.kernel_id] = (kernel.busy and live, kernel.last_busy_at, kernel.started_at)
        return out

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
            return young
        # Silent for too long: only GPU processes left behind keep the lease.
        return bool(running & self.gpu_pids())

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
        kernel = self._kernels.get(kernel_id)
        return kernel.pid if kernel is not None else None

    def process_tree(self, kernel_id: str) -> set[int]:
        kernel = self._kernels.get(kernel_id)
        return kernel.all_pids() if kernel is not None else set()

    def process_trees(self) -> dict[str, set[int]]:
        return {kid: kernel.all_pids() for kid, kernel in self._kernels.items()}

    def notebook(self, kernel_id: str) -> str | None:
        kernel = self._kernels.get(kernel_id)
        return kernel.notebook if kernel is not None else None

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
