"""The servers and kernels the broker knows, and whose each kernel id is.

State of :class:`~jupyter_gpusched.hub.remote.RemoteKernels` lives here, in one
:class:`Registry`: every server by id, every kernel by id, kernels that ended (remembered for
:data:`ENDED_MEMORY`, so that a late claim for one is refused) and the users the ledger recorded
for kernels when the broker started.

A kernel belongs to the hub user of its live lease, else to the user the ledger recorded for it,
else to the user whose server reported it (or claimed a GPU for it) first: a kernel id never
changes hands (:meth:`Registry.user_of`). Within one user, a kernel stays with the server that
reports it while that server still has it (:meth:`Registry.holds`); another of the user's servers
that reports it is refused (:meth:`Registry.take`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol

from .. import procs
from ..api.input import ID_PATTERN

log = logging.getLogger("jupyter_gpusched.broker")

#: How long an ended kernel is remembered (so that a late claim for it is refused).
ENDED_MEMORY = 3600.0


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

    def forget_processes(self) -> None:
        """What was found of its processes is void (another process speaks for its server, or
        another server has it now)."""
        self.pid, self.pid_started, self.tree, self.tree_started = None, None, frozenset(), {}
        self.reported_pid = None


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


def silent_for(server: RemoteServer | None, now: float) -> float:
    """Seconds since the server last spoke (infinite for a server the broker does not know)."""
    return float("inf") if server is None else now - server.last_seen


def connected(server: RemoteServer | None, now: float, heartbeat_timeout: float) -> bool:
    """Whether the server has its websocket open and spoke within ``heartbeat_timeout``."""
    return server is not None and server.connection is not None and silent_for(server, now) <= heartbeat_timeout


class OnceLog:
    """Warnings logged once per key (a server that repeats a bad report is not logged each time)."""

    def __init__(self) -> None:
        self.seen: set[str] = set()

    def warn(self, key: str, message: str, *args: Any) -> None:
        if key not in self.seen:
            if len(self.seen) > 10_000:
                self.seen.clear()
            self.seen.add(key)
            log.warning(message, *args)

    def first(self, key: str) -> bool:
        """Whether ``key`` is new (and note it)."""
        if key in self.seen:
            return False
        self.seen.add(key)
        return True


class Registry:
    """Every server and kernel the broker knows, and whose each kernel id is."""

    def __init__(self) -> None:
        self.servers: dict[str, RemoteServer] = {}
        self.kernels: dict[str, RemoteKernel] = {}
        #: Kernels that ended: kernel id -> (user, when).
        self.ended: dict[str, tuple[str, float]] = {}
        #: Whose each kernel is as the ledger records it (kernel id -> (user, when read)).
        self.recorded: dict[str, tuple[str, float]] = {}
        #: The user of a kernel's live lease, if it has one (the broker sets it: the arbiter's leases).
        self.lease_user: Callable[[str], str | None] = lambda kernel_id: None

    def user_of(self, kernel_id: str) -> str | None:
        """The hub user a kernel belongs to, if the broker knows (or remembers) it.

        The user of the kernel's live lease first, then what the ledger recorded when the broker
        started (:meth:`remember_users`), then the user whose server reported it.
        """
        leased = self.lease_user(kernel_id)
        if leased is not None:
            return leased
        recorded = self.recorded.get(kernel_id)
        if recorded is not None:
            return recorded[0]
        kernel = self.kernels.get(kernel_id)
        if kernel is not None:
            return kernel.user
        ended = self.ended.get(kernel_id)
        return ended[0] if ended is not None else None

    def remember_users(self, users: Mapping[str, str], now: float) -> None:
        """Whose each kernel is, as the ledger records it (kernel id -> hub user), read when the
        broker starts: no server's report can take those kernel ids from their users. Remembered
        for :data:`ENDED_MEMORY` seconds, or until the kernel's own user's server reports it."""
        for kernel_id, user in users.items():
            if kernel_id not in self.kernels:
                self.recorded[kernel_id] = (user, now)
        if users:
            log.info("the ledger records the users of %d kernel(s)", len(users))

    def expire(self, now: float) -> None:
        """Forget ended kernels and recorded users older than :data:`ENDED_MEMORY`."""
        for memory in (self.ended, self.recorded):
            for kernel_id, (_, at) in list(memory.items()):
                if now - at > ENDED_MEMORY:
                    del memory[kernel_id]

    def open_server(self, server_id: str, user: str, now: float, max_servers_per_user: int) -> RemoteServer:
        """The server ``server_id`` of ``user``, which is opening its websocket (new if unknown).

        Raises PermissionError if the id is another user's, :class:`TooMany` past the bound on
        servers per user.
        """
        server = self.servers.get(server_id)
        if server is not None and server.user != user:
            raise PermissionError(f"server id {server_id} belongs to another user")
        if server is None or server.connection is None:
            live = [s for s in self.servers.values() if s.user == user and s.connection is not None]
            if len(live) >= max_servers_per_user:
                raise TooMany(
                    f"{user} has {len(live)} servers connected to the GPU broker already, the most allowed "
                    f"(c.GPUBroker.max_servers_per_user)"
                )
        if server is None:
            server = self.servers[server_id] = RemoteServer(server_id, user, now)
        return server

    def holds(self, kernel: RemoteKernel) -> bool:
        """Whether the server a kernel is with still has it: the server reported it and is
        connected, or its process still runs (a server that only lost its connection comes back)."""
        server = self.servers.get(kernel.server_id)
        if server is None or kernel.kernel_id not in server.kernels:
            return False
        if server.connection is not None:
            return kernel.reported
        return kernel.reported and server.pid is not None and procs.same_process(server.pid, server.pid_started)

    def take(
        self, kernel_id: str, server: RemoteServer, now: float, warn: Callable[..., None]
    ) -> tuple[RemoteKernel | None, str | None]:
        """The kernel ``server`` reports as ``kernel_id``, now with that server; or None and why
        the report is refused (another user's kernel, or another server's that still has it).

        Refused for the newcomer only: the owner's kernel, lease and heartbeats stay. ``warn``
        is called with a key, a message and its arguments (logged once per key).
        """
        server_id = server.server_id
        kernel = self.kernels.get(kernel_id)
        owner = kernel.user if kernel is not None else self.user_of(kernel_id)
        if owner is not None and owner != server.user:
            warn(
                f"user:{kernel_id}:{server_id}",
                "server %s of %s reported kernel %s, which is %s's; ignored",
                server_id, server.user, kernel_id, owner,
            )
            return None, f"kernel {kernel_id} belongs to another user"
        if kernel is None:
            self.ended.pop(kernel_id, None)
            self.recorded.pop(kernel_id, None)
            kernel = self.kernels[kernel_id] = RemoteKernel(kernel_id, server.user, server_id, now)
        elif kernel.server_id != server_id and self.holds(kernel):
            warn(
                f"server:{kernel_id}:{server_id}",
                "server %s of %s reported kernel %s of its server %s, which still runs; ignored",
                server_id, server.user, kernel_id, kernel.server_id,
            )
            return None, f"kernel {kernel_id} is another server's (server {kernel.server_id})"
        if kernel.server_id != server_id:
            old = self.servers.get(kernel.server_id)
            if old is not None:
                old.kernels.pop(kernel_id, None)
            kernel.server_id = server_id
            kernel.forget_processes()
        server.kernels[kernel_id] = kernel
        return kernel, None

    def register(self, kernel_id: str, user: str, server_id: str, now: float) -> None:
        """A server claims a GPU for a kernel it has not reported yet (it is being launched)."""
        if not ID_PATTERN.match(kernel_id) or not ID_PATTERN.match(server_id):
            raise ValueError("kernel and server ids are letters, digits, '-' and '_'")
        owner = self.user_of(kernel_id)
        if owner is not None and owner != user:
            raise PermissionError(f"kernel {kernel_id} belongs to another user")
        server = self.servers.get(server_id)
        if server is None:
            server = self.servers[server_id] = RemoteServer(server_id, user, now)
        elif server.user != user:
            raise PermissionError(f"server id {server_id} belongs to another user")
        kernel = self.kernels.get(kernel_id)
        if kernel is None:
            self.ended.pop(kernel_id, None)
            kernel = self.kernels[kernel_id] = RemoteKernel(kernel_id, user, server_id, now)
            server.kernels[kernel_id] = kernel

    def unregister(self, kernel_id: str) -> None:
        """Undo :meth:`register` for a kernel no server has reported (its claim was refused)."""
        kernel = self.kernels.get(kernel_id)
        if kernel is None or kernel.reported:
            return
        del self.kernels[kernel_id]
        server = self.servers.get(kernel.server_id)
        if server is not None:
            server.kernels.pop(kernel_id, None)

    def forget(self, kernel_id: str, now: float) -> RemoteKernel | None:
        """Drop a kernel that ended (remembered as ended from ``now``); the kernel, or None if
        the broker did not know it."""
        kernel = self.kernels.pop(kernel_id, None)
        if kernel is None:
            return None
        server = self.servers.get(kernel.server_id)
        if server is not None:
            server.kernels.pop(kernel_id, None)
        self.ended[kernel_id] = (kernel.user, now)
        return kernel
