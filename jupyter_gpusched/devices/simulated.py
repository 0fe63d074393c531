"""Simulated GPUs: the full device interface without a GPU.

The devices come from configuration; who holds what on them lives in a small SQLite file, so that
other processes (kernels, a second server, a test) can use the simulated GPUs much like CUDA::

    # in a kernel started with CUDA_VISIBLE_DEVICES=GPU-... and JUPYTER_GPUSCHED_SIM_STATE=...
    from jupyter_gpusched.devices import simulated
    simulated.allocate("16GiB")      # like torch.empty(...) on cuda:0; OOM past memory_total
    simulated.set_utilization(90)    # "computing"
    simulated.free()                 # like the process letting go of its context

The backend object also scripts the host for tests: device utilization, lost GPUs, fields the
"driver" does not support, and checkpoint/restore of a process's GPU memory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import sqlite3
import uuid as uuidlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import psutil

from .. import files
from ..core.model import GiB
from ..core.units import format_bytes, parse_memory
from .base import LOST, OK, DeviceBackend, DeviceLost, DeviceSnapshot, GPUProcess, InventoryUnavailable

log = logging.getLogger(__name__)

#: The state file a kernel process finds its simulated GPUs in.
STATE_ENV = "JUPYTER_GPUSCHED_SIM_STATE"
STATE_FILE = "gpusched-sim.sqlite"

#: Says what it is: nothing here is a real GPU. The model ("H100") still drives architecture
#: detection and "same model" restores.
DEFAULT_NAME = "Simulated H100 80GB"
#: The setting that lets an admin share the state file with other users' kernels.
ALLOW_SHARED_SETTING = "c.GPUSchedApp.allow_shared_state_files (c.GPUBroker.allow_shared_state_files for the broker)"
DEFAULT_MEMORY = 80 * GiB
#: Host-independent, so that every process with the same configuration agrees on the UUIDs.
DEFAULT_SEED = "jupyter-gpusched"
_NAMESPACE = uuidlib.uuid5(uuidlib.NAMESPACE_OID, "jupyter-gpusched.simulated")

#: Fields that ``unsupported()`` can switch off, as a driver that lacks them would.
FIELDS = (
    "memory_used",
    "utilization",
    "process_memory",
    "process_utilization",
    "architecture",
    "numa_node",
    "nvlink_group",
)

_ENTRY_KEYS = {"name", "memory", "mig", "nvlink_group", "architecture", "numa_node"}
_MIG_PROFILE = re.compile(r"^(\d)g\.(\d+)gb(\+me)?$")
#: A GPU has seven compute slices to share among its MIG instances.
_MIG_SLICES = 7
_ARCH_BY_NAME = (
    (re.compile(r"\b(G?B[123]00)\b"), "Blackwell"),
    (re.compile(r"\b(G?H[12]00|H800|H20)\b"), "Hopper"),
    (re.compile(r"\b(L40S?|L4|L20|RTX \d+ Ada)\b"), "Ada"),
    (re.compile(r"\b(A100|A800|A40|A30|A16|A10|A2|RTX A\d+)\b"), "Ampere"),
    (re.compile(r"\b(T4|RTX [68]000)\b"), "Turing"),
    (re.compile(r"\b(V100|TITAN V)\b"), "Volta"),
    (re.compile(r"\b(P100|P40|P4)\b"), "Pascal"),
)

_SCHEMA_VERSION = 1
_SCHEMA = """
CREATE TABLE IF NOT EXISTS devices (
    uuid TEXT PRIMARY KEY,
    idx INTEGER NOT NULL,
    name TEXT NOT NULL,
    memory_total INTEGER NOT NULL,
    parent_uuid TEXT,
    has_mig INTEGER NOT NULL DEFAULT 0,
    lost INTEGER NOT NULL DEFAULT 0,
    utilization REAL
);
CREATE TABLE IF NOT EXISTS processes (
    pid INTEGER NOT NULL,
    started REAL,
    uuid TEXT NOT NULL,
    memory INTEGER NOT NULL DEFAULT 0,
    utilization REAL NOT NULL DEFAULT 0,
    PRIMARY KEY (pid, uuid)
);
CREATE TABLE IF NOT EXISTS checkpoints (
    pid INTEGER NOT NULL,
    started REAL,
    uuid TEXT NOT NULL,
    memory INTEGER NOT NULL,
    utilization REAL NOT NULL DEFAULT 0,
    PRIMARY KEY (pid, uuid)
);
CREATE TABLE IF NOT EXISTS faults (field TEXT PRIMARY KEY);
"""
_TABLES = frozenset({"devices", "processes", "checkpoints", "faults"})


class SimulatedCudaError(RuntimeError):
    """What CUDA would have refused, said plainly."""


class SimulatedOutOfMemory(SimulatedCudaError):
    """An allocation past the simulated GPU's memory."""


@dataclass(frozen=True)
class SimulatedDevice:
    """One configured simulated GPU or MIG instance."""

    uuid: str
    index: int
    name: str
    memory_total: int
    architecture: str | None = None
    numa_node: int | None = None
    nvlink_group: str | None = None
    parent_uuid: str | None = None
    mig_profile: str | None = None


# -- configuration -----------------------------------------------------------------------------


def gpu_uuid(index: int, seed: str = DEFAULT_SEED) -> str:
    """The UUID of simulated GPU ``index``: the same on every host for the same seed."""
    return f"GPU-{uuidlib.uuid5(_NAMESPACE, f'{seed}/gpu/{index}')}"


def mig_uuid(index: int, slot: int, seed: str = DEFAULT_SEED) -> str:
    """The UUID of MIG instance ``slot`` of simulated GPU ``index``."""
    return f"MIG-{uuidlib.uuid5(_NAMESPACE, f'{seed}/gpu/{index}/mig/{slot}')}"


def _architecture(name: str) -> str | None:
    for pattern, arch in _ARCH_BY_NAME:
        if pattern.search(name):
            return arch
    return None


def parse_devices(config: Any, seed: str = DEFAULT_SEED) -> tuple[SimulatedDevice, ...]:
    """The simulated devices described by ``config``.

    Args:
        config: an int N (N GPUs like an 80 GB H100) or a list of dicts with ``name``,
            ``memory`` (bytes or "80GiB"), and optionally ``mig`` (profiles such as
            ``["3g.40gb", "4g.40gb"]``), ``nvlink_group``, ``architecture``, ``numa_node``.
        seed: makes the UUIDs; the same seed and index always give the same UUID.

    Raises:
        ValueError: the configuration is not one of those shapes; the message says what is off.
    """
    if isinstance(config, str) and config.strip().isdigit():
        config = int(config)
    if isinstance(config, bool):
        raise ValueError("simulated_devices must be a number of GPUs or a list of {name, memory, mig}")
    if isinstance(config, int):
        if config < 0:
            raise ValueError(f"simulated_devices must be 0 or more GPUs, not {config}")
        config = [{} for _ in range(config)]
    if not isinstance(config, Sequence) or isinstance(config, str):
        raise ValueError(
            f"simulated_devices must be a number of GPUs or a list of {{name, memory, mig}}, not {config!r}"
        )

    physical: list[SimulatedDevice] = []
    instances: list[SimulatedDevice] = []
    for index, entry in enumerate(config):
        where = f"simulated_devices[{index}]"
        if not isinstance(entry, Mapping):
            raise ValueError(f"{where} must be a dict such as {{'name': ..., 'memory': '80GiB'}}, not {entry!r}")
        unknown = set(entry) - _ENTRY_KEYS
        if unknown:
            raise ValueError(f"{where} has unknown keys {sorted(unknown)}; use {sorted(_ENTRY_KEYS)}")
        name = str(entry.get("name") or DEFAULT_NAME)
        memory = parse_memory(entry.get("memory"), f"{where}.memory") or DEFAULT_MEMORY
        numa = entry.get("numa_node")
        if numa is not None and (isinstance(numa, bool) or not isinstance(numa, int) or numa < 0):
            raise ValueError(f"{where}.numa_node must be a NUMA node number, not {numa!r}")
        group = entry.get("nvlink_group")
        device = SimulatedDevice(
            uuid=gpu_uuid(index, seed),
            index=index,
            name=name,
            memory_total=memory,
            architecture=entry.get("architecture") or _architecture(name),
            numa_node=numa,
            nvlink_group=str(group) if group is not None else None,
        )
        physical.append(device)
        instances.extend(_mig_instances(device, entry.get("mig") or (), seed, where))
    count = len(physical)
    return tuple(physical) + tuple(
        dataclasses.replace(inst, index=count + offset) for offset, inst in enumerate(instances)
    )


def _mig_instances(parent: SimulatedDevice, profiles: Any, seed: str, where: str) -> list[SimulatedDevice]:
    if isinstance(profiles, str) or not isinstance(profiles, Sequence):
        raise ValueError(f"{where}.mig must be a list of MIG profiles such as ['3g.40gb', '4g.40gb']")
    slices = memory = 0
    instances = []
    for slot, profile in enumerate(profiles):
        match = _MIG_PROFILE.match(str(profile))
        if not match:
            raise ValueError(f"{where}.mig[{slot}] must be a MIG profile such as '3g.40gb', not {profile!r}")
        size = int(match.group(2)) * GiB
        slices += int(match.group(1))
        memory += size
        instances.append(
            SimulatedDevice(
                uuid=mig_uuid(parent.index, slot, seed),
                index=-1,
                name=f"{parent.name} MIG {profile}",
                memory_total=size,
                architecture=parent.architecture,
                numa_node=parent.numa_node,
                # One CUDA process sees at most one MIG instance: instances form no group.
                nvlink_group=None,
                parent_uuid=parent.uuid,
                mig_profile=str(profile),
            )
        )
    if slices > _MIG_SLICES:
        raise ValueError(f"{where}.mig uses {slices} compute slices; a GPU has {_MIG_SLICES}")
    if memory > parent.memory_total:
        raise ValueError(
            f"{where}.mig needs {format_bytes(memory)}, more than the GPU's {format_bytes(parent.memory_total)}"
        )
    return instances


def default_state_path() -> str:
    """``$JUPYTER_GPUSCHED_SIM_STATE``, else a file in the Jupyter runtime directory."""
    path = os.environ.get(STATE_ENV)
    if path:
        return path
    try:
        from jupyter_core.paths import jupyter_runtime_dir

        directory = jupyter_runtime_dir()
    except ImportError:  # pragma: no cover - jupyter_core comes with jupyter_server
        import tempfile

        directory = os.path.join(tempfile.gettempdir(), f"jupyter-gpusched-{os.getuid()}")
    return os.path.join(directory, STATE_FILE)


# -- the state file ----------------------------------------------------------------------------


def _connect(path: str, create: bool) -> sqlite3.Connection:
    if create:
        conn = sqlite3.connect(path, timeout=30, isolation_level=None, check_same_thread=False)
    else:
        if os.path.islink(path):
            raise SimulatedCudaError(f"the simulated GPU state {path} is a symbolic link; it is not followed")
        if not os.path.exists(path):
            raise SimulatedCudaError(
                f"no simulated GPUs at {path}: start a jupyter-gpusched server with the simulated backend first"
            )
        uri = Path(os.path.abspath(path)).as_uri() + "?mode=rw"
        conn = sqlite3.connect(uri, uri=True, timeout=30, isolation_level=None, check_same_thread=False)
    conn.row_factory = sqlite3.Row
    return conn


@contextlib.contextmanager
def _transaction(path: str, write: bool, create: bool = False) -> Iterator[sqlite3.Connection]:
    """One transaction; writers take the lock up front so read-check-write stays atomic."""
    conn = _connect(path, create)
    try:
        conn.execute("BEGIN IMMEDIATE" if write else "BEGIN")
        try:
            yield conn
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")
    finally:
        conn.close()


class UnsafeStateFile(Exception):
    """The state file is not one the simulated backend may create or write."""


def _open_state(path: str, allow_shared: bool) -> None:
    """Create the state file (0600), or check the one there; refuse anything not ours.

    Raises:
        UnsafeStateFile: a link, another user's or a shared file (unless ``allow_shared``), or a
            SQLite file of another application; it was left untouched.
    """
    setting = "simulated_state_path"
    try:
        checked = files.prepare(path, setting=setting)
        if checked.header and checked.header != b"SQLite format 3\x00":
            raise files.UnsafeFile("is not a SQLite database", f"set {setting} to another file")
        files.check_private(checked, setting=setting, allow_shared=allow_shared, allow_setting=ALLOW_SHARED_SETTING)
        conn = _connect(path, create=True)
        try:
            files.confirm_same(checked)
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            names = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            tables = {n for n in names if not n.startswith("sqlite_")}
            if version not in (0, _SCHEMA_VERSION) or (version == 0 and tables) or tables - _TABLES:
                raise files.UnsafeFile(
                    "is a SQLite database of something else"
                    + (f" (it has tables {', '.join(sorted(tables - _TABLES))})" if tables - _TABLES else ""),
                    f"set {setting} to another file",
                )
            # WAL lets kernels write their allocations while the server reads a snapshot.
            conn.execute("PRAGMA journal_mode=WAL")
        finally:
            conn.close()
    except files.UnsafeFile as exc:
        raise UnsafeStateFile(
            f"the simulated GPU state file {path} {exc.problem}. It was left untouched."
            + (f" {exc.advice}." if exc.advice else "")
        ) from None


def _init_state(path: str, devices: Sequence[SimulatedDevice], allow_shared: bool = False) -> None:
    _open_state(path, allow_shared)
    parents = {d.parent_uuid for d in devices if d.parent_uuid}
    with _transaction(path, write=True, create=True) as conn:
        # executescript would commit first; run the statements inside this transaction instead.
        for statement in _SCHEMA.split(";"):
            if statement.strip():
                conn.execute(statement)
        conn.execute(f"PRAGMA user_version = {_SCHEMA_VERSION}")
        known = {row["uuid"] for row in conn.execute("SELECT uuid FROM devices")}
        wanted = {d.uuid for d in devices}
        stale = known - wanted
        if stale:
            log.warning("simulated GPU state %s described other GPUs; replacing %s", path, sorted(stale))
            conn.executemany("DELETE FROM devices WHERE uuid = ?", [(u,) for u in stale])
        for d in devices:
            # Keep faults scripted by another process that shares the file (lost, utilization).
            conn.execute(
                "INSERT INTO devices (uuid, idx, name, memory_total, parent_uuid, has_mig) VALUES (?, ?, ?, ?, ?, ?)"
                " ON CONFLICT (uuid) DO UPDATE SET idx = excluded.idx, name = excluded.name,"
                " memory_total = excluded.memory_total, parent_uuid = excluded.parent_uuid,"
                " has_mig = excluded.has_mig",
                (d.uuid, d.index, d.name, d.memory_total, d.parent_uuid, int(d.uuid in parents)),
            )


def _started(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def _alive(pid: int, started: float | None) -> bool:
    """Whether ``pid`` is still the process that took the memory (not a reused pid)."""
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False  # it exited; the driver frees a context at exit, not at reaping
        return started is None or abs(proc.create_time() - started) < 1.0
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True


def _drop_dead(conn: sqlite3.Connection) -> set[int]:
    """Forget the GPU memory of processes that exited, as the driver does."""
    dead = {
        (row["pid"], row["started"])
        for row in conn.execute(
            "SELECT DISTINCT pid, started FROM processes UNION SELECT DISTINCT pid, started FROM checkpoints"
        )
        if not _alive(row["pid"], row["started"])
    }
    for pid, started in dead:
        # Matched on the start time too: a new process that reused the pid keeps its own memory.
        match = (pid, started)
        for row in conn.execute("SELECT uuid, memory FROM processes WHERE pid = ? AND started IS ?", match):
            log.info("simulated GPU %s: process %s exited; %s freed", row["uuid"], pid, format_bytes(row["memory"]))
        conn.execute("DELETE FROM processes WHERE pid = ? AND started IS ?", match)
        conn.execute("DELETE FROM checkpoints WHERE pid = ? AND started IS ?", match)
    return {pid for pid, _ in dead}


def _device_row(conn: sqlite3.Connection, uuid: str) -> sqlite3.Row:
    row = conn.execute("SELECT * FROM devices WHERE uuid = ?", (uuid,)).fetchone()
    if row is None:
        raise SimulatedCudaError(f"{uuid} is not a simulated GPU on this host")
    return row


def _check_usable(conn: sqlite3.Connection, row: sqlite3.Row) -> None:
    lost = bool(row["lost"])
    if row["parent_uuid"] and not lost:
        lost = bool(_device_row(conn, row["parent_uuid"])["lost"])
    if lost:
        raise DeviceLost(f"simulated GPU {row['uuid']} is lost (fell off the bus)", uuid=row["uuid"])
    if row["has_mig"]:
        raise SimulatedCudaError(
            f"simulated GPU {row['uuid']} is in MIG mode: CUDA runs on its MIG instances, not on the GPU itself"
        )


def _held(conn: sqlite3.Connection, table: str, **match: Any) -> int:
    """Bytes in ``processes`` or ``checkpoints`` rows matching ``match`` (column = value)."""
    where = " AND ".join(f"{column} = ?" for column in match)
    query = f"SELECT COALESCE(SUM(memory), 0) FROM {table} WHERE {where}"
    return int(conn.execute(query, tuple(match.values())).fetchone()[0])


def _place(
    conn: sqlite3.Connection, uuid: str, pid: int, started: float | None, nbytes: int, utilization: float | None
) -> None:
    """Add ``nbytes`` for ``pid`` on ``uuid``, refusing what would not fit (the OOM check)."""
    row = _device_row(conn, uuid)
    _check_usable(conn, row)
    used = _held(conn, "processes", uuid=uuid)
    if used + nbytes > row["memory_total"]:
        mine = _held(conn, "processes", uuid=uuid, pid=pid)
        raise SimulatedOutOfMemory(
            f"CUDA out of memory (simulated): tried to allocate {format_bytes(nbytes)} on {uuid}, which has "
            f"{format_bytes(row['memory_total'])} in all, {format_bytes(used)} in use "
            f"({format_bytes(mine)} by process {pid}) and {format_bytes(row['memory_total'] - used)} free"
        )
    conn.execute(
        "INSERT INTO processes (pid, started, uuid, memory, utilization) VALUES (?, ?, ?, ?, COALESCE(?, 0))"
        " ON CONFLICT (pid, uuid) DO UPDATE SET memory = memory + excluded.memory,"
        " utilization = COALESCE(?, utilization)",
        (pid, started, uuid, nbytes, utilization, utilization),
    )


def _percent(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 100:
        raise ValueError(f"{what} must be a percentage between 0 and 100, not {value!r}")
    return float(value)


def _bytes(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(f"cannot allocate a negative number of bytes ({value})")
        return value
    size = parse_memory(value, "nbytes")
    if size is None:
        raise ValueError("nbytes must be a size such as '16GiB' or a number of bytes")
    return size


# -- the kernel side: a fake CUDA for this process ---------------------------------------------


def _state_path() -> str:
    path = os.environ.get(STATE_ENV)
    if not path:
        raise SimulatedCudaError(
            f"{STATE_ENV} is not set: this process was not started by a jupyter-gpusched server "
            "running the simulated backend"
        )
    return path


def visible_devices() -> list[str]:
    """UUIDs of the simulated GPUs this process may use, in ``CUDA_VISIBLE_DEVICES`` order.

    Raises:
        SimulatedCudaError: no device is visible, as CUDA would find none.
    """
    raw = os.environ.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        raise SimulatedCudaError(
            "no CUDA device: CUDA_VISIBLE_DEVICES is not set, so this process holds no GPU lease; "
            "ask for one first (`%gpu acquire`)"
        )
    entries = [e.strip() for e in raw.split(",") if e.strip()]
    if not entries or entries[0] in ("-1", "NoDevFiles"):
        raise SimulatedCudaError(
            "no CUDA device: CUDA_VISIBLE_DEVICES is empty, so this process holds no GPU; "
            "ask for one first (`%gpu acquire`)"
        )
    with _transaction(_state_path(), write=False) as conn:
        rows = list(conn.execute("SELECT uuid, idx, parent_uuid FROM devices"))
    by_index = {str(r["idx"]): r["uuid"] for r in rows if r["parent_uuid"] is None}
    known = {r["uuid"] for r in rows}
    uuids = []
    for entry in entries:
        uuid = by_index.get(entry, entry)
        if uuid not in known:
            # CUDA stops at the first entry it does not recognise.
            break
        uuids.append(uuid)
    if not uuids:
        raise SimulatedCudaError(f"no CUDA device: CUDA_VISIBLE_DEVICES={raw!r} names no simulated GPU on this host")
    return uuids


def _resolve(device: int | str | None) -> str:
    visible = visible_devices()
    if device is None:
        return visible[0]
    if isinstance(device, int) and not isinstance(device, bool):
        if not 0 <= device < len(visible):
            raise SimulatedCudaError(f"invalid device ordinal {device}: this process sees {len(visible)} GPU(s)")
        return visible[device]
    if device not in visible:
        raise SimulatedCudaError(f"{device} is not visible to this process (CUDA_VISIBLE_DEVICES={','.join(visible)})")
    return str(device)


def _not_checkpointed(conn: sqlite3.Connection, pid: int) -> None:
    if conn.execute("SELECT 1 FROM checkpoints WHERE pid = ?", (pid,)).fetchone():
        raise SimulatedCudaError(f"process {pid} is checkpointed: its GPU memory is on the host until it is restored")


def allocate(nbytes: int | str, device: int | str | None = None) -> str:
    """Take ``nbytes`` of simulated GPU memory for this process.

    Args:
        nbytes: bytes, or a size such as "16GiB".
        device: a CUDA ordinal among the visible devices, a visible UUID, or ``None`` for the
            first visible device.

    Returns:
        The UUID of the device the memory is on.

    Raises:
        SimulatedOutOfMemory: it does not fit, counting what every process holds.
        SimulatedCudaError: no visible device, or the device cannot run CUDA.
        DeviceLost: the device is lost.
    """
    size = _bytes(nbytes)
    uuid = _resolve(device)
    pid = os.getpid()
    with _transaction(_state_path(), write=True) as conn:
        _drop_dead(conn)
        _not_checkpointed(conn, pid)
        _place(conn, uuid, pid, _started(pid), size, None)
    log.debug("simulated GPU %s: process %s allocated %s", uuid, pid, format_bytes(size))
    return uuid


def free(nbytes: int | str | None = None, device: int | str | None = None) -> int:
    """Give back simulated GPU memory; returns the bytes freed.

    ``free()`` lets go of everything on every device, as a process does when it releases its
    CUDA context; ``free(n)`` gives back up to ``n`` bytes on ``device`` (default the first
    visible one) and keeps the context.
    """
    pid = os.getpid()
    path = _state_path()
    if nbytes is None and device is None:
        with _transaction(path, write=True) as conn:
            freed = _held(conn, "processes", pid=pid)
            conn.execute("DELETE FROM processes WHERE pid = ?", (pid,))
            return freed
    if nbytes is None:
        uuid = _resolve(device)
        with _transaction(path, write=True) as conn:
            freed = _held(conn, "processes", pid=pid, uuid=uuid)
            conn.execute("DELETE FROM processes WHERE pid = ? AND uuid = ?", (pid, uuid))
            return freed
    size = _bytes(nbytes)
    uuid = _resolve(device)
    with _transaction(path, write=True) as conn:
        row = conn.execute("SELECT memory FROM processes WHERE pid = ? AND uuid = ?", (pid, uuid)).fetchone()
        held = row["memory"] if row else 0
        freed = min(held, size)
        conn.execute("UPDATE processes SET memory = memory - ? WHERE pid = ? AND uuid = ?", (freed, pid, uuid))
    return int(freed)


def set_utilization(percent: float, device: int | str | None = None) -> None:
    """Say how busy this process keeps ``device`` (percent of the GPU), as its kernels would."""
    share = _percent(percent, "utilization")
    uuid = _resolve(device)
    pid = os.getpid()
    with _transaction(_state_path(), write=True) as conn:
        _not_checkpointed(conn, pid)
        _place(conn, uuid, pid, _started(pid), 0, share)


def memory_allocated(device: int | str | None = None) -> int:
    """Bytes this process holds on ``device`` (default the first visible one)."""
    uuid = _resolve(device)
    with _transaction(_state_path(), write=False) as conn:
        row = conn.execute("SELECT memory FROM processes WHERE pid = ? AND uuid = ?", (os.getpid(), uuid)).fetchone()
    return int(row["memory"]) if row else 0


# -- the backend -------------------------------------------------------------------------------


class SimulatedBackend(DeviceBackend):
    """Configured GPUs whose processes and faults live in a shared SQLite file.

    Args:
        devices: an int or a list of dicts (see :func:`parse_devices`).
        state_path: the SQLite file; ``None``: :func:`default_state_path`. It is created 0600;
            a link there, or a file of another application, is refused.
        seed: makes the UUIDs.
        allow_shared: accept a state file that other users may read or write (their kernels use
            these GPUs too); otherwise such a file is refused.
    """

    name = "simulated"

    def __init__(
        self, devices: Any = 4, state_path: str | None = None, seed: str = DEFAULT_SEED, *, allow_shared: bool = False
    ) -> None:
        self.devices = parse_devices(devices, seed)
        self.state_path = os.path.abspath(str(state_path or default_state_path()))
        self._by_uuid = {d.uuid: d for d in self.devices}
        try:
            _init_state(self.state_path, self.devices, allow_shared)
        except UnsafeStateFile as exc:
            raise InventoryUnavailable(str(exc)) from None
        except (OSError, sqlite3.Error) as exc:
            raise InventoryUnavailable(
                f"the simulated GPU state file {self.state_path} cannot be used ({exc}); "
                "point c.GPUSchedApp.simulated_state_path at a writable place"
            ) from None
        log.info("simulated backend: %s device(s), state in %s", len(self.devices), self.state_path)

    def env(self) -> dict[str, str]:
        """Environment a kernel needs to use these simulated GPUs."""
        return {STATE_ENV: self.state_path}

    # -- the interface -----------------------------------------------------------------------

    def snapshot(self) -> tuple[DeviceSnapshot, ...]:
        try:
            with _transaction(self.state_path, write=False) as conn:
                states = {r["uuid"]: r for r in conn.execute("SELECT uuid, lost, utilization FROM devices")}
                rows = list(conn.execute("SELECT pid, started, uuid, memory, utilization FROM processes"))
                faults = {r["field"] for r in conn.execute("SELECT field FROM faults")}
            # Liveness is checked outside the transaction: psutil is slow next to SQLite.
            alive = {(r["pid"], r["started"]): _alive(r["pid"], r["started"]) for r in rows}
            if not all(alive.values()):
                with _transaction(self.state_path, write=True) as conn:
                    _drop_dead(conn)
        except (sqlite3.Error, SimulatedCudaError) as exc:
            raise InventoryUnavailable(
                f"the simulated GPU state file {self.state_path} cannot be read ({exc})"
            ) from None

        by_device: dict[str, list[sqlite3.Row]] = {}
        for row in rows:
            if alive[(row["pid"], row["started"])]:
                by_device.setdefault(row["uuid"], []).append(row)

        def lost(uuid: str) -> bool:
            state = states.get(uuid)
            return bool(state and state["lost"])

        result = []
        for dev in self.devices:
            is_lost = lost(dev.uuid) or (dev.parent_uuid is not None and lost(dev.parent_uuid))
            children = [d for d in self.devices if d.parent_uuid == dev.uuid]
            memory_used: int | None
            utilization: float | None
            processes: tuple[GPUProcess, ...] = ()
            if is_lost:
                memory_used = utilization = None
            elif children:
                # In MIG mode the parent reports the memory of all instances and no utilization,
                # as NVML does; its processes are listed on the instances.
                memory_used = sum(r["memory"] for c in children for r in by_device.get(c.uuid, ()))
                utilization = None
            else:
                mine = sorted(by_device.get(dev.uuid, ()), key=lambda r: r["pid"])
                processes = tuple(
                    GPUProcess(
                        pid=r["pid"],
                        memory_used=None if "process_memory" in faults else int(r["memory"]),
                        utilization=None if "process_utilization" in faults else float(r["utilization"]),
                    )
                    for r in mine
                )
                memory_used = sum(int(r["memory"]) for r in mine)
                scripted = states[dev.uuid]["utilization"] if dev.uuid in states else None
                busy = min(100.0, float(sum(r["utilization"] for r in mine)))
                utilization = float(scripted) if scripted is not None else busy
            result.append(
                DeviceSnapshot(
                    uuid=dev.uuid,
                    index=dev.index,
                    name=dev.name,
                    memory_total=dev.memory_total,
                    memory_used=None if "memory_used" in faults else memory_used,
                    utilization=None if "utilization" in faults else utilization,
                    health=LOST if is_lost else OK,
                    processes=processes,
                    architecture=None if "architecture" in faults else dev.architecture,
                    numa_node=None if "numa_node" in faults else dev.numa_node,
                    nvlink_group=None if "nvlink_group" in faults else dev.nvlink_group,
                    parent_uuid=dev.parent_uuid,
                    mig_profile=dev.mig_profile,
                )
            )
        return tuple(result)

    def checkpoint_support(self) -> tuple[bool, str]:
        return True, "simulated GPUs support checkpoint"

    # -- scripting the host ------------------------------------------------------------------

    def _device(self, uuid: str) -> SimulatedDevice:
        try:
            return self._by_uuid[uuid]
        except KeyError:
            raise ValueError(f"{uuid} is not one of this backend's simulated GPUs") from None

    def add_process(self, uuid: str, pid: int, memory: int | str, utilization: float = 0.0) -> None:
        """Process ``pid`` takes ``memory`` more bytes on ``uuid`` and keeps it ``utilization`` % busy.

        Raises:
            ValueError: ``pid`` is not a running process, or ``uuid`` unknown.
            SimulatedOutOfMemory: it does not fit.
            DeviceLost: the device is lost.
        """
        self._device(uuid)
        size, share = _bytes(memory), _percent(utilization, "utilization")
        started = _started(pid)
        if started is None:
            raise ValueError(f"process {pid} is not running; simulated GPU memory needs a live process")
        with _transaction(self.state_path, write=True) as conn:
            _drop_dead(conn)
            _place(conn, uuid, pid, started, size, share)
        log.info("simulated GPU %s: process %s holds %s more at %s%%", uuid, pid, format_bytes(size), share)

    def set_process(
        self, uuid: str, pid: int, memory: int | str | None = None, utilization: float | None = None
    ) -> None:
        """Set what ``pid`` holds on ``uuid`` and how busy it keeps it (``None``: unchanged)."""
        self._device(uuid)
        size = _bytes(memory) if memory is not None else None
        share = _percent(utilization, "utilization") if utilization is not None else None
        with _transaction(self.state_path, write=True) as conn:
            row = conn.execute("SELECT memory FROM processes WHERE pid = ? AND uuid = ?", (pid, uuid)).fetchone()
            if row is None:
                raise ValueError(f"process {pid} has nothing on simulated GPU {uuid}; use add_process")
            if size is not None and size > row["memory"]:
                _place(conn, uuid, pid, None, size - row["memory"], None)  # growing must fit
            elif size is not None:
                conn.execute("UPDATE processes SET memory = ? WHERE pid = ? AND uuid = ?", (size, pid, uuid))
            if share is not None:
                conn.execute("UPDATE processes SET utilization = ? WHERE pid = ? AND uuid = ?", (share, pid, uuid))
        log.info("simulated GPU %s: process %s set to memory %s, utilization %s", uuid, pid, memory, utilization)

    def remove_process(self, pid: int) -> int:
        """Process ``pid`` lets go of all its GPU memory (and any checkpoint); returns bytes freed."""
        with _transaction(self.state_path, write=True) as conn:
            freed = _held(conn, "processes", pid=pid)
            conn.execute("DELETE FROM processes WHERE pid = ?", (pid,))
            conn.execute("DELETE FROM checkpoints WHERE pid = ?", (pid,))
        log.info("simulated GPUs: process %s removed, %s freed", pid, format_bytes(freed))
        return int(freed)

    def set_utilization(self, uuid: str, percent: float | None) -> None:
        """Script the device's utilization; ``None`` goes back to the sum over its processes."""
        self._device(uuid)
        share = _percent(percent, "utilization") if percent is not None else None
        with _transaction(self.state_path, write=True) as conn:
            conn.execute("UPDATE devices SET utilization = ? WHERE uuid = ?", (share, uuid))
        log.info("simulated GPU %s: utilization scripted to %s", uuid, share)

    def lose(self, uuid: str) -> None:
        """The GPU falls off the bus (a MIG parent takes its instances with it)."""
        self._device(uuid)
        with _transaction(self.state_path, write=True) as conn:
            conn.execute("UPDATE devices SET lost = 1 WHERE uuid = ?", (uuid,))
        log.warning("simulated GPU %s is lost", uuid)

    def restore_device(self, uuid: str) -> None:
        """The lost GPU is back (after a reset)."""
        self._device(uuid)
        with _transaction(self.state_path, write=True) as conn:
            conn.execute("UPDATE devices SET lost = 0 WHERE uuid = ?", (uuid,))
        log.info("simulated GPU %s is back", uuid)

    def unsupported(self, field_name: str) -> None:
        """The "driver" stops reporting ``field_name`` (one of :data:`FIELDS`): it reads ``None``."""
        if field_name not in FIELDS:
            raise ValueError(f"{field_name!r} is not a field that can be unsupported; use one of {', '.join(FIELDS)}")
        with _transaction(self.state_path, write=True) as conn:
            conn.execute("INSERT OR IGNORE INTO faults (field) VALUES (?)", (field_name,))
        log.info("simulated GPUs: %s no longer reported", field_name)

    def supported(self, field_name: str) -> None:
        """Undo :meth:`unsupported`."""
        with _transaction(self.state_path, write=True) as conn:
            conn.execute("DELETE FROM faults WHERE field = ?", (field_name,))

    # -- checkpoint and restore --------------------------------------------------------------

    def checkpoint(self, pid: int) -> int:
        """Move ``pid``'s GPU memory to the host; the devices no longer show the process.

        Returns:
            Bytes moved (0 if it held nothing).

        Raises:
            DeviceLost: some of its memory is on a lost GPU and cannot be copied out.
        """
        with _transaction(self.state_path, write=True) as conn:
            rows = list(conn.execute("SELECT * FROM processes WHERE pid = ?", (pid,)))
            for row in rows:
                _check_usable(conn, _device_row(conn, row["uuid"]))
            conn.executemany(
                "INSERT INTO checkpoints (pid, started, uuid, memory, utilization) VALUES (?, ?, ?, ?, ?)"
                " ON CONFLICT (pid, uuid) DO UPDATE SET memory = memory + excluded.memory",
                [(r["pid"], r["started"], r["uuid"], r["memory"], r["utilization"]) for r in rows],
            )
            conn.execute("DELETE FROM processes WHERE pid = ?", (pid,))
        moved = sum(int(r["memory"]) for r in rows)
        for row in rows:
            log.info(
                "simulated GPU %s: process %s checkpointed, %s moved to host",
                row["uuid"],
                pid,
                format_bytes(row["memory"]),
            )
        return moved

    def checkpointed(self, pid: int) -> int:
        """Bytes of ``pid``'s GPU memory held on the host by a checkpoint."""
        with _transaction(self.state_path, write=False) as conn:
            return _held(conn, "checkpoints", pid=pid)

    def restore(self, pid: int, uuid_map: Mapping[str, str] | None = None) -> int:
        """Put a checkpointed process's GPU memory back, all of it or none.

        Args:
            pid: the checkpointed process.
            uuid_map: old UUID -> new UUID for memory that should land on another GPU of the same
                model; devices not in the map get their memory back where it was.

        Returns:
            Bytes restored (0 if nothing was checkpointed).

        Raises:
            ValueError: a target is not a GPU of the same model.
            SimulatedOutOfMemory: a target has no room for it.
            DeviceLost: a target is lost.
        """
        uuid_map = dict(uuid_map or {})
        with _transaction(self.state_path, write=True) as conn:
            rows = list(conn.execute("SELECT * FROM checkpoints WHERE pid = ?", (pid,)))
            for row in rows:
                old = row["uuid"]
                new = uuid_map.get(old, old)
                target = self._device(new)
                source = self._by_uuid.get(old)
                if source is not None and (source.name, source.memory_total) != (target.name, target.memory_total):
                    raise ValueError(
                        f"cannot restore process {pid} from {old} ({source.name}) onto {new} ({target.name}): "
                        "a checkpoint goes back onto the same GPU model"
                    )
                # _place raises on a misfit and the transaction rolls back: no half-restored process.
                _place(conn, new, pid, row["started"], int(row["memory"]), float(row["utilization"]))
            conn.execute("DELETE FROM checkpoints WHERE pid = ?", (pid,))
        restored = sum(int(r["memory"]) for r in rows)
        for row in rows:
            log.info(
                "simulated GPU %s: process %s restored, %s back from host (was on %s)",
                uuid_map.get(row["uuid"], row["uuid"]),
                pid,
                format_bytes(row["memory"]),
                row["uuid"],
            )
        return restored
