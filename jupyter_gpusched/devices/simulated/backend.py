"""The simulated backend: the device interface over configured GPUs, and scripting the host."""

from __future__ import annotations

import logging
import os
import sqlite3
import time
from typing import Any, Mapping

from ... import procs
from ...core.units import format_bytes
from ..base import LOST, OK, DeviceBackend, DeviceSnapshot, GPUProcess, InventoryUnavailable
from .config import DEFAULT_SEED, STATE_ENV, SimulatedDevice, default_state_path, parse_devices
from .state import (
    Processes,
    SimulatedCheckpointUnsupported,
    SimulatedCudaError,
    SimulatedLockTimeout,
    UnsafeStateFile,
    as_bytes,
    as_percent,
    check_usable,
    device_row,
    drop_dead,
    init_state,
    place,
    transaction,
)

__all__ = ["FIELDS", "SimulatedBackend"]

# The package's one logger, named as before the simulated backend became a package.
log = logging.getLogger("jupyter_gpusched.devices.simulated")

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


class SimulatedBackend(DeviceBackend):
    """Configured GPUs whose processes and faults live in a shared SQLite file.

    Like NVML, the backend names processes by the pid it sees (the host pid, when it runs in the
    host's PID namespace), whatever PID namespace they run in: :meth:`snapshot` reports them so,
    and :meth:`checkpoint`, :meth:`restore`, :meth:`remove_process` and the other methods that
    take a pid take that one.

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
        self.processes = Processes()
        try:
            init_state(self.state_path, self.devices, allow_shared)
        except UnsafeStateFile as exc:
            raise InventoryUnavailable(str(exc)) from None
        except (OSError, sqlite3.Error) as exc:
            raise InventoryUnavailable(
                f"the simulated GPU state file {self.state_path} cannot be used ({exc}); "
                "point c.GPUSchedApp.simulated_state_path at a writable place"
            ) from None
        log.info("simulated backend: %s device(s), state in %s", len(self.devices), self.state_path)
        # A file shared with other users' kernels keeps one connection open while the backend
        # lives: SQLite then never deletes and makes again its side files (-wal, -shm), and a
        # kernel of one user never meets, in the moment between their creation and their chmod,
        # a side file another user's kernel just made that it may only read.
        self._keeper: sqlite3.Connection | None = None
        if allow_shared:
            self._keeper = sqlite3.connect(self.state_path, timeout=30, check_same_thread=False)
            self._keeper.execute("SELECT count(*) FROM devices").fetchone()

    def close(self) -> None:
        if self._keeper is not None:
            self._keeper.close()
            self._keeper = None

    def env(self) -> dict[str, str]:
        """Environment a kernel needs to use these simulated GPUs."""
        return {STATE_ENV: self.state_path}

    # -- the interface -----------------------------------------------------------------------

    def snapshot(self) -> tuple[DeviceSnapshot, ...]:
        try:
            with transaction(self.state_path, write=False) as conn:
                states = {r["uuid"]: r for r in conn.execute("SELECT uuid, lost, utilization FROM devices")}
                rows = list(conn.execute("SELECT pid, ns, started, uuid, memory, utilization FROM processes"))
                faults = {r["field"] for r in conn.execute("SELECT field FROM faults")}
            # Liveness is checked outside the transaction: psutil is slow next to SQLite.
            running = self.processes.running({(r["pid"], r["ns"], r["started"]) for r in rows})
            if any(host is None for host in running.values()):
                with transaction(self.state_path, write=True) as conn:
                    drop_dead(conn, self.processes)
        except (sqlite3.Error, SimulatedCudaError, procs.PidNamespaceError) as exc:
            raise InventoryUnavailable(
                f"the simulated GPU state file {self.state_path} cannot be read ({exc})"
            ) from None

        # Each process under the pid this backend sees, as NVML names it; processes that do not
        # run, or whose namespace cannot be seen from here, are left out.
        by_device: dict[str, list[tuple[int, sqlite3.Row]]] = {}
        for row in rows:
            host = running.get((row["pid"], row["ns"], row["started"]))
            if host is not None:
                by_device.setdefault(row["uuid"], []).append((host, row))

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
                memory_used = sum(r["memory"] for c in children for _, r in by_device.get(c.uuid, ()))
                utilization = None
            else:
                listed = sorted(by_device.get(dev.uuid, ()), key=lambda item: item[0])
                mine = [r for _, r in listed]
                processes = tuple(
                    GPUProcess(
                        pid=host,
                        memory_used=None if "process_memory" in faults else int(r["memory"]),
                        utilization=None if "process_utilization" in faults else float(r["utilization"]),
                    )
                    for host, r in listed
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

    def _key(self, pid: int) -> tuple[str, tuple[int, ...]]:
        """The SQL condition (and its values) on the rows of the process this backend sees as ``pid``."""
        inner, ns = self.processes.identity(pid)
        if self.processes.mine(ns):
            return "pid = ? AND ns IN (?, 0)", (inner, ns)
        return "pid = ? AND ns = ?", (inner, ns)

    def add_process(self, uuid: str, pid: int, memory: int | str, utilization: float = 0.0) -> None:
        """Process ``pid`` takes ``memory`` more bytes on ``uuid`` and keeps it ``utilization`` % busy.

        Raises:
            ValueError: ``pid`` is not a running process, or ``uuid`` unknown.
            SimulatedOutOfMemory: it does not fit.
            DeviceLost: the device is lost.
        """
        self._device(uuid)
        size, share = as_bytes(memory), as_percent(utilization, "utilization")
        started = procs.started(pid)
        if started is None:
            raise ValueError(f"process {pid} is not running; simulated GPU memory needs a live process")
        inner, ns = self.processes.identity(pid)
        with transaction(self.state_path, write=True) as conn:
            drop_dead(conn, self.processes)
            place(conn, uuid, inner, started, size, share, ns=ns)
        log.info("simulated GPU %s: process %s holds %s more at %s%%", uuid, pid, format_bytes(size), share)

    def set_process(
        self, uuid: str, pid: int, memory: int | str | None = None, utilization: float | None = None
    ) -> None:
        """Set what ``pid`` holds on ``uuid`` and how busy it keeps it (``None``: unchanged)."""
        self._device(uuid)
        size = as_bytes(memory) if memory is not None else None
        share = as_percent(utilization, "utilization") if utilization is not None else None
        where, key = self._key(pid)
        with transaction(self.state_path, write=True) as conn:
            row = conn.execute(f"SELECT * FROM processes WHERE {where} AND uuid = ?", (*key, uuid)).fetchone()
            if row is None:
                raise ValueError(f"process {pid} has nothing on simulated GPU {uuid}; use add_process")
            match = (row["pid"], row["ns"], uuid)
            if size is not None and size > row["memory"]:
                place(conn, uuid, row["pid"], None, size - row["memory"], None, ns=row["ns"])  # growing must fit
            elif size is not None:
                conn.execute("UPDATE processes SET memory = ? WHERE pid = ? AND ns = ? AND uuid = ?", (size, *match))
            if share is not None:
                conn.execute(
                    "UPDATE processes SET utilization = ? WHERE pid = ? AND ns = ? AND uuid = ?", (share, *match)
                )
        log.info("simulated GPU %s: process %s set to memory %s, utilization %s", uuid, pid, memory, utilization)

    def remove_process(self, pid: int) -> int:
        """Process ``pid`` lets go of all its GPU memory (and any checkpoint); returns bytes freed."""
        where, key = self._key(pid)
        with transaction(self.state_path, write=True) as conn:
            row = conn.execute(f"SELECT COALESCE(SUM(memory), 0) FROM processes WHERE {where}", key).fetchone()
            freed = int(row[0])
            conn.execute(f"DELETE FROM processes WHERE {where}", key)
            conn.execute(f"DELETE FROM checkpoints WHERE {where}", key)
        log.info("simulated GPUs: process %s removed, %s freed", pid, format_bytes(freed))
        return int(freed)

    def set_utilization(self, uuid: str, percent: float | None) -> None:
        """Script the device's utilization; ``None`` goes back to the sum over its processes."""
        self._device(uuid)
        share = as_percent(percent, "utilization") if percent is not None else None
        with transaction(self.state_path, write=True) as conn:
            conn.execute("UPDATE devices SET utilization = ? WHERE uuid = ?", (share, uuid))
        log.info("simulated GPU %s: utilization scripted to %s", uuid, share)

    def lose(self, uuid: str) -> None:
        """The GPU falls off the bus (a MIG parent takes its instances with it)."""
        self._device(uuid)
        with transaction(self.state_path, write=True) as conn:
            conn.execute("UPDATE devices SET lost = 1 WHERE uuid = ?", (uuid,))
        log.warning("simulated GPU %s is lost", uuid)

    def restore_device(self, uuid: str) -> None:
        """The lost GPU is back (after a reset)."""
        self._device(uuid)
        with transaction(self.state_path, write=True) as conn:
            conn.execute("UPDATE devices SET lost = 0 WHERE uuid = ?", (uuid,))
        log.info("simulated GPU %s is back", uuid)

    def unsupported(self, field_name: str) -> None:
        """The "driver" stops reporting ``field_name`` (one of :data:`FIELDS`): it reads ``None``."""
        if field_name not in FIELDS:
            raise ValueError(f"{field_name!r} is not a field that can be unsupported; use one of {', '.join(FIELDS)}")
        with transaction(self.state_path, write=True) as conn:
            conn.execute("INSERT OR IGNORE INTO faults (field) VALUES (?)", (field_name,))
        log.info("simulated GPUs: %s no longer reported", field_name)

    def supported(self, field_name: str) -> None:
        """Undo :meth:`unsupported`."""
        with transaction(self.state_path, write=True) as conn:
            conn.execute("DELETE FROM faults WHERE field = ?", (field_name,))

    # -- checkpoint and restore --------------------------------------------------------------

    def checkpoint(self, pid: int, lock_timeout: float | None = None) -> int:
        """Move ``pid``'s GPU memory to the host; the devices no longer show the process.

        As the driver does, the lock first waits for the process's GPU work in flight (what
        ``simulated.launch`` started) for up to ``lock_timeout`` seconds (``None``: as long as it
        takes), and a process on a MIG instance is refused (NVIDIA/cuda-checkpoint#42).

        Returns:
            Bytes moved (0 if it held nothing).

        Raises:
            SimulatedCheckpointUnsupported: some of its memory is on a MIG instance; nothing moved.
            SimulatedLockTimeout: its GPU work in flight outlasted ``lock_timeout``; nothing moved,
                and the process runs on.
            DeviceLost: some of its memory is on a lost GPU and cannot be copied out.
        """
        where, key = self._key(pid)
        with transaction(self.state_path, write=False) as conn:
            held = list(conn.execute(f"SELECT uuid, work_until FROM processes WHERE {where}", key))
        mig = tuple(sorted({r["uuid"] for r in held if self._is_mig(r["uuid"])}))
        if mig:
            what = "is a MIG instance" if len(mig) == 1 else "are MIG instances"
            raise SimulatedCheckpointUnsupported(
                f"checkpoint of process {pid} refused (simulated driver): {', '.join(mig)} {what}, "
                "and MIG instances cannot be checkpointed",
                mig,
            )
        self._lock(pid, max((r["work_until"] or 0.0 for r in held), default=0.0), lock_timeout)
        with transaction(self.state_path, write=True) as conn:
            rows = list(conn.execute(f"SELECT * FROM processes WHERE {where}", key))
            for row in rows:
                check_usable(conn, device_row(conn, row["uuid"]))
            conn.executemany(
                "INSERT INTO checkpoints (pid, ns, started, uuid, memory, utilization) VALUES (?, ?, ?, ?, ?, ?)"
                " ON CONFLICT (pid, ns, uuid) DO UPDATE SET memory = memory + excluded.memory",
                [(r["pid"], r["ns"], r["started"], r["uuid"], r["memory"], r["utilization"]) for r in rows],
            )
            conn.execute(f"DELETE FROM processes WHERE {where}", key)
        moved = sum(int(r["memory"]) for r in rows)
        for row in rows:
            log.info(
                "simulated GPU %s: process %s checkpointed, %s moved to host",
                row["uuid"],
                pid,
                format_bytes(row["memory"]),
            )
        return moved

    def _is_mig(self, uuid: str) -> bool:
        device = self._by_uuid.get(uuid)
        return device is not None and device.parent_uuid is not None

    @staticmethod
    def _lock(pid: int, work_until: float, timeout: float | None) -> None:
        """Wait, as ``cuCheckpointProcessLock`` does, for work in flight until ``work_until``
        (wall-clock seconds), giving up after ``timeout`` seconds."""
        left = work_until - time.time()
        if left <= 0:
            return
        if timeout is not None and left > timeout:
            time.sleep(max(timeout, 0.0))
            raise SimulatedLockTimeout(
                f"lock of process {pid} timed out after {timeout:g} s (simulated driver): "
                f"its GPU work runs {left - timeout:.1f} s longer"
            )
        time.sleep(left)

    def checkpointed(self, pid: int) -> int:
        """Bytes of ``pid``'s GPU memory held on the host by a checkpoint."""
        where, key = self._key(pid)
        with transaction(self.state_path, write=False) as conn:
            return int(conn.execute(f"SELECT COALESCE(SUM(memory), 0) FROM checkpoints WHERE {where}", key).fetchone()[0])

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
        where, key = self._key(pid)
        with transaction(self.state_path, write=True) as conn:
            rows = list(conn.execute(f"SELECT * FROM checkpoints WHERE {where}", key))
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
                # place raises on a misfit and the transaction rolls back: no half-restored process.
                place(conn, new, row["pid"], row["started"], int(row["memory"]), float(row["utilization"]), ns=row["ns"])
            conn.execute(f"DELETE FROM checkpoints WHERE {where}", key)
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

