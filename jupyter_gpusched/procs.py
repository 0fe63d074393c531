"""What the host's process table says: process identity and liveness, trees, ancestry, CPU use.

The one home of "is this still that process": :func:`started` and :func:`same_process` for a pid
with its start time, :func:`alive` for one that exited but was not reaped yet (a zombie holds no
GPU, serves no request), and :class:`OwnerId` / :func:`is_alive` for owners recorded with their
host. The arbiter believes only what it can check here. In hub mode every process id a server reports
is checked against this table (it must descend from that server's own process, whose owner the
broker verified), and "busy" needs CPU or GPU use that this table or NVML shows.

PID namespaces: NVML names processes by their host pid, while a process in a container (a
Kubernetes pod) knows itself by its pid in its own PID namespace. :func:`pid_namespace` says which
namespace a process lives in (the inode of ``/proc/<pid>/ns/pid``), :func:`namespace_pid` how a
process names itself, and :class:`PidNamespaces` maps a (namespace, pid) pair to the pid this
process sees, from ``/proc/<pid>/status`` (``NSpid``) and ``/proc/<pid>/ns/pid``.
:func:`pid_namespace_chain` lists the namespaces a process's namespace was made in (a namespace
made inside a pod is still the pod's), and :func:`pod_name` the pod a process runs in, where the
host can vouch for its name.
"""

from __future__ import annotations

import ctypes
import fcntl
import hmac
import os
import pwd
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Protocol

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


def ancestors(pid: int, limit: int = MAX_DEPTH) -> list[int]:
    """The parent of ``pid``, its parent, and so on, nearest first (at most ``limit``; pid 1 left out)."""
    out: list[int] = []
    current = pid
    while len(out) < limit:
        parent = _ppid(current)
        if parent is None or parent <= 1 or parent in out:
            break
        out.append(parent)
        current = parent
    return out


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


# -- PID namespaces ------------------------------------------------------------------------------

#: The inode of the host's (initial) PID namespace: Linux gives it this fixed number
#: (``PROC_PID_INIT_INO``), so a process can tell whether it runs in the host's PID namespace.
HOST_PID_NAMESPACE = 0xEFFFFFFC
#: What to do when the broker cannot see the processes of other PID namespaces.
HOST_PID_ADVICE = "run the broker in the host's PID namespace (hostPID: true in its pod)"


class PidNamespaceError(RuntimeError):
    """``/proc`` cannot tell which process a pid of a PID namespace is; the message says why."""


def _ns_inode(target: str) -> int:
    # The link reads "pid:[4026531836]"; the number is the namespace's inode.
    try:
        return int(target[target.index("[") + 1 : target.rindex("]")])
    except ValueError:
        raise PidNamespaceError(f"cannot read a PID namespace from {target!r}") from None


def pid_namespace(pid: int | None = None, proc: str = "/proc") -> int:
    """The PID namespace ``pid`` (default: this process) lives in: the inode of ``/proc/<pid>/ns/pid``.

    Two processes are in the same PID namespace exactly when these numbers are equal (on one host).

    Raises:
        ProcessLookupError: no process ``pid`` runs.
        PidNamespaceError: ``/proc`` cannot tell (no ``/proc``, or the process may not be inspected).
    """
    who = "self" if pid is None else str(pid)
    try:
        return _ns_inode(os.readlink(f"{proc}/{who}/ns/pid"))
    except FileNotFoundError:
        if pid is not None and not os.path.exists(f"{proc}/{pid}"):
            raise ProcessLookupError(f"no process {pid} runs here") from None
        raise PidNamespaceError(f"{proc}/{who}/ns/pid does not exist: this system does not show PID namespaces") from None
    except PermissionError:
        raise PidNamespaceError(
            f"cannot read the PID namespace of process {who} ({proc}/{who}/ns/pid: permission denied); "
            "the broker reads other users' processes as root"
        ) from None
    except OSError as exc:
        raise PidNamespaceError(f"cannot read the PID namespace of process {who}: {exc.strerror or exc}") from None


def own_pid_namespace() -> int:
    """This process's PID namespace, or 0 where the system does not say (no ``/proc``)."""
    try:
        return pid_namespace()
    except (PidNamespaceError, ProcessLookupError):
        return 0


def _read_nspid(path: str) -> tuple[int, ...] | None:
    """The ``NSpid`` entries of a status file (None: the kernel writes no such line)."""
    with open(path, "rb") as f:
        for line in f:
            if line.startswith(b"NSpid:"):
                return tuple(int(x) for x in line[6:].split())
    return None


def ns_pids(pid: int, proc: str = "/proc") -> tuple[int, ...]:
    """The pids of process ``pid`` in each PID namespace from this ``/proc``'s down to its own.

    The first is ``pid`` itself; the last is the pid the process has in its own namespace.

    Raises:
        ProcessLookupError: no process ``pid`` runs.
        PidNamespaceError: the kernel does not say (Linux before 4.1 has no ``NSpid``).
    """
    try:
        found = _read_nspid(f"{proc}/{pid}/status")
    except FileNotFoundError:
        raise ProcessLookupError(f"no process {pid} runs here") from None
    except (OSError, ValueError) as exc:
        raise PidNamespaceError(f"cannot read {proc}/{pid}/status: {exc}") from None
    if not found:
        raise PidNamespaceError(
            f"{proc}/{pid}/status has no NSpid line: mapping PID namespaces needs Linux 4.1 or later"
        )
    return found


def namespace_pid(pid: int, proc: str = "/proc") -> tuple[int, int]:
    """How process ``pid`` (as this process sees it) names itself: (its PID namespace, its pid there).

    Raises ProcessLookupError or :class:`PidNamespaceError`, as :func:`ns_pids` does.
    """
    ns = pid_namespace(pid, proc)
    return ns, ns_pids(pid, proc)[-1]


class PidNamespaces:
    """Pids of other PID namespaces, as this process sees them (the host pid, for a broker run
    with ``hostPID``).

    ``host_pid(ns, pid)`` is ``pid`` itself for this process's own namespace. For another it reads
    a map of every process's innermost namespace and pid, made by one pass over ``/proc``; the map
    is kept, each answer from it is confirmed against the process itself (two small reads), and it
    is made again only when a lookup misses (at most once every ``min_rescan`` seconds).
    Safe to use from several threads.

    Args:
        proc: where procfs is mounted.
        min_rescan: seconds between two passes over ``/proc`` that misses may cause.
        clock: a monotonic clock (for tests).
    """

    #: How many namespaces are remembered as seen (past that, the oldest are forgotten).
    MAX_SEEN = 65536

    def __init__(self, proc: str = "/proc", min_rescan: float = 0.5, clock: Callable[[], float] = time.monotonic) -> None:
        self.proc = proc
        self.min_rescan = min_rescan
        self.clock = clock
        self._lock = threading.Lock()
        self._map: dict[int, dict[int, int]] = {}
        self._seen: dict[int, None] = {}
        self._scanned_at: float | None = None
        self._denied = 0
        self._no_nspid = False
        #: Passes made over ``/proc`` (for tests and the log).
        self.scans = 0

    @property
    def own(self) -> int:
        """This process's PID namespace (0 where the system does not say)."""
        return own_pid_namespace()

    @property
    def in_host_namespace(self) -> bool:
        """Whether this process runs in the host's PID namespace (and so sees every process)."""
        return self.own == HOST_PID_NAMESPACE

    def scan(self) -> None:
        """One pass over ``/proc``: each process's innermost namespace and its pid there."""
        own = self.own
        found: dict[int, dict[int, int]] = {}
        denied = 0
        no_nspid = False
        try:
            names = os.listdir(self.proc)
        except OSError as exc:
            raise PidNamespaceError(f"cannot list {self.proc}: {exc.strerror or exc}") from None
        for name in names:
            if not name.isdigit():
                continue
            try:
                ns = _ns_inode(os.readlink(f"{self.proc}/{name}/ns/pid"))
                if ns == own:
                    found.setdefault(ns, {})[int(name)] = int(name)
                    continue
                entries = _read_nspid(f"{self.proc}/{name}/status")
            except FileNotFoundError:
                continue  # it exited meanwhile
            except PermissionError:
                # Its namespace may not be read; its status may: one NSpid entry means it is
                # in this /proc's own namespace, which needs no mapping.
                try:
                    entries = _read_nspid(f"{self.proc}/{name}/status")
                except (OSError, ValueError):
                    entries = None
                if not entries or len(entries) > 1:
                    denied += 1
                continue
            except (OSError, ValueError, PidNamespaceError):
                continue
            if not entries:
                no_nspid = True
                continue
            found.setdefault(ns, {})[entries[-1]] = int(name)
        with self._lock:
            self._map = found
            for ns in found:
                self._seen.pop(ns, None)
                self._seen[ns] = None
            while len(self._seen) > self.MAX_SEEN:
                del self._seen[next(iter(self._seen))]
            self._denied = denied
            self._no_nspid = no_nspid
            self._scanned_at = self.clock()
            self.scans += 1

    def _confirmed(self, host: int, ns: int, pid: int) -> bool:
        try:
            return pid_namespace(host, self.proc) == ns and ns_pids(host, self.proc)[-1] == pid
        except (ProcessLookupError, PidNamespaceError):
            return False

    def _cached(self, ns: int, pid: int) -> int | None:
        with self._lock:
            host = self._map.get(ns, {}).get(pid)
        return host if host is not None and self._confirmed(host, ns, pid) else None

    def host_pids(self, ns: int, pids: Iterable[int]) -> dict[int, int]:
        """Our pid for each of ``pids`` of namespace ``ns`` that runs now (the others are left out).

        At most one pass over ``/proc`` for them all.

        Raises:
            PidNamespaceError: ``/proc`` cannot tell, such as a namespace this process cannot see
                while it runs outside the host's PID namespace (:data:`HOST_PID_ADVICE`).
        """
        pids = list(pids)
        if ns == self.own or ns == 0:
            return {pid: pid for pid in pids}
        out = {pid: host for pid in pids if (host := self._cached(ns, pid)) is not None}
        missing = [pid for pid in pids if pid not in out]
        if not missing:
            return out
        with self._lock:
            due = self._scanned_at is None or self.clock() - self._scanned_at >= self.min_rescan
        if due:
            self.scan()
            out.update((pid, host) for pid in missing if (host := self._cached(ns, pid)) is not None)
        if len(out) < len(pids):
            self._cannot_tell(ns)
        return out

    def host_pid(self, ns: int, pid: int) -> int | None:
        """Our pid for process ``pid`` of PID namespace ``ns``; None if no such process runs now.

        Raises:
            PidNamespaceError: as :meth:`host_pids`.
        """
        return self.host_pids(ns, [pid]).get(pid)

    def seen(self, ns: int) -> bool:
        """Whether a pass over ``/proc`` ever found a process in namespace ``ns``."""
        with self._lock:
            return ns in self._seen

    def _cannot_tell(self, ns: int) -> None:
        """Raise if a miss in ``ns`` does not mean the process is gone; return if it does."""
        with self._lock:
            visible, seen = ns in self._map, ns in self._seen
            denied, no_nspid = self._denied, self._no_nspid
        if visible:
            return
        if no_nspid:
            raise PidNamespaceError(
                f"{self.proc}/<pid>/status has no NSpid line: mapping PID namespaces needs Linux 4.1 or later"
            )
        if denied:
            raise PidNamespaceError(
                f"cannot find PID namespace {ns}: {denied} processes in {self.proc} may not be inspected "
                "(permission denied); the broker reads other users' processes as root"
            )
        if seen or self.in_host_namespace:
            return  # every process of it has exited
        raise PidNamespaceError(
            f"PID namespace {ns} cannot be seen from this process's PID namespace ({self.own}), "
            f"which is not the host's: {HOST_PID_ADVICE}"
        )

    def describe_missing(self, ns: int, pid: int) -> str:
        """Why ``pid`` of namespace ``ns`` was not found, in words (after a lookup returned None)."""
        with self._lock:
            visible = ns in self._map
        if visible:
            return f"no process {pid} runs in PID namespace {ns}"
        return f"no process runs in PID namespace {ns} (a process cannot name its pid {pid} there)"


# -- a process's pod: its namespaces, and the host name of its UTS namespace ----------------------

#: ``ioctl`` requests on a namespace's file (``linux/nsfs.h``): the user namespace that owns it,
#: and the PID namespace its PID namespace was made in (Linux 4.9).
NS_GET_USERNS = 0xB701
NS_GET_PARENT = 0xB702
CLONE_NEWUTS = 0x04000000
#: Linux nests PID namespaces 32 deep at most.
MAX_PID_NESTING = 32


def _open_ns(pid: int, kind: str, proc: str = "/proc") -> int:
    """A file descriptor of process ``pid``'s namespace ``kind`` (``pid``, ``uts``, ``user``, ``mnt``)."""
    try:
        return os.open(f"{proc}/{pid}/ns/{kind}", os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        if not os.path.exists(f"{proc}/{pid}"):
            raise ProcessLookupError(f"no process {pid} runs here") from None
        raise PidNamespaceError(f"{proc}/{pid}/ns/{kind} does not exist: this system does not show namespaces") from None
    except PermissionError:
        raise PidNamespaceError(
            f"cannot read the namespaces of process {pid} (permission denied); the broker reads other "
            "users' processes as root"
        ) from None
    except OSError as exc:
        raise PidNamespaceError(f"cannot read the namespaces of process {pid}: {exc.strerror or exc}") from None


def _own_ns(kind: str) -> int:
    try:
        return os.stat(f"/proc/self/ns/{kind}").st_ino
    except OSError:
        return 0


def pid_namespace_chain(pid: int, proc: str = "/proc") -> list[int]:
    """The PID namespaces process ``pid`` lives in: its own first, then each one its namespace was
    made in, up to (not including) this process's own namespace.

    A process of a pod has one entry (the pod's namespace); a process in a PID namespace made
    inside a pod has two or more, the pod's last. Where the kernel cannot say which namespace
    another was made in (before Linux 4.9), only its own.

    Raises ProcessLookupError or :class:`PidNamespaceError`, as :func:`pid_namespace` does.
    """
    own = own_pid_namespace()
    fd = _open_ns(pid, "pid", proc)
    out: list[int] = []
    try:
        for _ in range(MAX_PID_NESTING + 1):
            inode = os.fstat(fd).st_ino
            if inode == own:
                break
            out.append(inode)
            try:
                parent = fcntl.ioctl(fd, NS_GET_PARENT)
            except OSError:
                break  # above this process's own namespace (EPERM), or an older kernel (ENOTTY)
            os.close(fd)
            fd = parent
    finally:
        os.close(fd)
    return out


def _owner_userns(fd: int) -> int | None:
    """The inode of the user namespace that owns the namespace open as ``fd`` (None: unknown)."""
    try:
        owner = fcntl.ioctl(fd, NS_GET_USERNS)
    except OSError:
        return None
    try:
        return os.fstat(owner).st_ino
    finally:
        os.close(owner)


def _uts_nodename(fd: int) -> str | None:
    """The host name of the UTS namespace open as ``fd``, read from a thread that joins it
    (needs ``CAP_SYS_ADMIN``; None without). The thread ends with it: nothing else changes."""
    out: list[str | None] = [None]

    def read() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, CLONE_NEWUTS) == 0:
            out[0] = os.uname().nodename

    thread = threading.Thread(target=read, name="gpusched-uts", daemon=True)
    thread.start()
    thread.join(5.0)
    return out[0]


def pod_name(pid: int, proc: str = "/proc") -> str | None:
    """The name of the pod (container) process ``pid`` runs in, where the host can tell: the host
    name of its UTS namespace. None where it shares this process's UTS namespace (no pod of its
    own), or where its name is not the host's to vouch for.

    Only a name that nobody but the host's privileged users (the container runtime) could have set
    counts: the process must be in this process's user namespace, and its UTS namespace owned by it
    (a user who makes a user namespace of their own may name its UTS namespace as they like, and
    mount any file over ``/etc/hostname``). The name is read by joining the UTS namespace (root with
    ``CAP_SYS_ADMIN``), else from the pod's ``/etc/hostname`` as the process sees it (the file
    the kubelet mounts there, which the process's users cannot change; the host's own file is no
    pod's), else not at all.
    """
    try:
        uts = _open_ns(pid, "uts", proc)
    except (ProcessLookupError, PidNamespaceError):
        return None
    try:
        if os.fstat(uts).st_ino == _own_ns("uts"):
            return None
        own_user = _own_ns("user")
        try:
            user = os.stat(f"{proc}/{pid}/ns/user").st_ino
        except OSError:
            return None
        if not own_user or user != own_user or _owner_userns(uts) != own_user:
            return None
        name = _uts_nodename(uts)
    finally:
        os.close(uts)
    if name is None:
        try:
            mnt = _open_ns(pid, "mnt", proc)
        except (ProcessLookupError, PidNamespaceError):
            return None
        try:
            if _owner_userns(mnt) != own_user:
                return None
        finally:
            os.close(mnt)
        try:
            with open(f"{proc}/{pid}/root/etc/hostname", "rb") as f:
                theirs = os.fstat(f.fileno())
                name = f.read(256).decode("ascii", "replace").strip()
        except OSError:
            return None
        try:
            ours = os.stat("/etc/hostname")
        except OSError:
            ours = None
        if ours is not None and (ours.st_dev, ours.st_ino) == (theirs.st_dev, theirs.st_ino):
            return None  # the host's own file: no pod's name
    return name or None
