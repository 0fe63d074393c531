"""The kernel side: a fake CUDA for this process, over the state file the server shares.

What user code calls inside a kernel (``simulated.allocate("16GiB")`` and the rest); the devices
it may use come from ``CUDA_VISIBLE_DEVICES``, the state file from ``$JUPYTER_GPUSCHED_SIM_STATE``.
The process is recorded as it knows itself, its pid in its own PID namespace with that namespace
(a kernel in a container cannot know its host pid); the backend reports it under its host pid,
as the driver does.

A call that needs the GPU while the process is checkpointed waits for its restore, as the
driver's calls do, instead of failing: a checkpoint that lands while a cell runs must not break
the cell. The kernel agent says (:func:`on_checkpointed`) how to ask for the lease back, and the
call asks at once; a process without one is told that it is checkpointed.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import time
from typing import Callable

from ... import procs
from ...core.units import format_bytes
from .config import STATE_ENV
from .state import (
    Processes,
    SimulatedCudaError,
    as_bytes,
    as_percent,
    drop_dead,
    held_bytes,
    place,
    transaction,
)

__all__ = [
    "allocate",
    "free",
    "launch",
    "memory_allocated",
    "on_checkpointed",
    "set_utilization",
    "visible_devices",
]

# The package's one logger, named as before the simulated backend became a package.
log = logging.getLogger("jupyter_gpusched.devices.simulated")


#: This process's view of the processes in the state file (one, so that /proc is read sparingly).
_processes: Processes | None = None
#: Asks for this process's checkpointed GPU state back and returns once it is restored (or
#: raises why it cannot be): the kernel agent's, where one runs.
_resume: Callable[[], None] | None = None
#: How long a call of a checkpointed process waits for its restore before it fails (seconds).
RESTORE_WAIT = 600.0
#: Seconds between two looks at the state file while waiting.
RESTORE_POLL = 0.1


class _Checkpointed(Exception):
    """The process is checkpointed (internal: the call waits for its restore and tries again)."""


def on_checkpointed(resume: Callable[[], None] | None) -> None:
    """Say how this process asks for its checkpointed GPU state back (``None``: it does not).

    ``resume`` is called when code needs the GPU while the process is checkpointed; it should
    ask the scheduler for the lease back and return once the state is restored.
    """
    global _resume
    _resume = resume


def _me() -> tuple[int, int]:
    """This process as the state file records it: (its pid, its PID namespace)."""
    return os.getpid(), procs.own_pid_namespace()


def _view() -> Processes:
    global _processes
    if _processes is None:
        _processes = Processes(warn=False)
    return _processes


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
    with transaction(_state_path(), write=False) as conn:
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


def _checkpointed(conn: sqlite3.Connection, pid: int, ns: int) -> bool:
    return conn.execute("SELECT 1 FROM checkpoints WHERE pid = ? AND ns = ?", (pid, ns)).fetchone() is not None


def _not_checkpointed(conn: sqlite3.Connection, pid: int, ns: int) -> None:
    if _checkpointed(conn, pid, ns):
        raise _Checkpointed()


def _wait_for_restore(path: str, pid: int, ns: int) -> None:
    """Ask for this process's GPU state back and block, as the driver does, until it is restored.

    Raises:
        SimulatedCudaError: nobody here can ask for it back (no kernel agent said how), or it was
            not restored within :data:`RESTORE_WAIT` seconds.
    """
    resume = _resume
    if resume is None:
        raise SimulatedCudaError(f"process {pid} is checkpointed: its GPU memory is on the host until it is restored")
    log.info("simulated GPUs: process %s is checkpointed and needs its GPU; asking for it back", pid)
    resume()
    deadline = time.monotonic() + RESTORE_WAIT
    while True:
        with transaction(path, write=False) as conn:
            if not _checkpointed(conn, pid, ns):
                return
        if time.monotonic() > deadline:
            raise SimulatedCudaError(
                f"process {pid} is checkpointed: its GPU memory is on the host, and it was not restored "
                f"within {RESTORE_WAIT:.0f} s"
            )
        time.sleep(RESTORE_POLL)


def _on_the_gpu(
    device: int | str | None, write: Callable[[sqlite3.Connection, str, int, int], None], *, tidy: bool = False
) -> str:
    """``write(conn, uuid, pid, ns)`` in one transaction on the state file, once this process is not
    checkpointed (the device is resolved again after a restore); returns the device's UUID.

    ``tidy``: forget the memory of processes that exited first, as an allocation does.
    """
    path = _state_path()
    pid, ns = _me()
    while True:
        uuid = _resolve(device)
        try:
            with transaction(path, write=True) as conn:
                if tidy:
                    drop_dead(conn, _view())
                _not_checkpointed(conn, pid, ns)
                write(conn, uuid, pid, ns)
            return uuid
        except _Checkpointed:
            _wait_for_restore(path, pid, ns)


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
    size = as_bytes(nbytes)

    def take(conn: sqlite3.Connection, uuid: str, pid: int, ns: int) -> None:
        place(conn, uuid, pid, procs.started(pid), size, None, ns=ns)

    uuid = _on_the_gpu(device, take, tidy=True)
    log.debug("simulated GPU %s: process %s allocated %s", uuid, os.getpid(), format_bytes(size))
    return uuid


def free(nbytes: int | str | None = None, device: int | str | None = None) -> int:
    """Give back simulated GPU memory; returns the bytes freed.

    ``free()`` lets go of everything on every device, as a process does when it releases its
    CUDA context; ``free(n)`` gives back up to ``n`` bytes on ``device`` (default the first
    visible one) and keeps the context.
    """
    pid, ns = _me()
    path = _state_path()
    if nbytes is None and device is None:
        with transaction(path, write=True) as conn:
            freed = held_bytes(conn, "processes", pid=pid, ns=ns)
            conn.execute("DELETE FROM processes WHERE pid = ? AND ns = ?", (pid, ns))
            return freed
    if nbytes is None:
        uuid = _resolve(device)
        with transaction(path, write=True) as conn:
            freed = held_bytes(conn, "processes", pid=pid, ns=ns, uuid=uuid)
            conn.execute("DELETE FROM processes WHERE pid = ? AND ns = ? AND uuid = ?", (pid, ns, uuid))
            return freed
    size = as_bytes(nbytes)
    uuid = _resolve(device)
    with transaction(path, write=True) as conn:
        row = conn.execute(
            "SELECT memory FROM processes WHERE pid = ? AND ns = ? AND uuid = ?", (pid, ns, uuid)
        ).fetchone()
        held = row["memory"] if row else 0
        freed = min(held, size)
        conn.execute(
            "UPDATE processes SET memory = memory - ? WHERE pid = ? AND ns = ? AND uuid = ?", (freed, pid, ns, uuid)
        )
    return int(freed)


def set_utilization(percent: float, device: int | str | None = None) -> None:
    """Say how busy this process keeps ``device`` (percent of the GPU), as its kernels would."""
    share = as_percent(percent, "utilization")

    def use(conn: sqlite3.Connection, uuid: str, pid: int, ns: int) -> None:
        place(conn, uuid, pid, procs.started(pid), 0, share, ns=ns)

    _on_the_gpu(device, use)


def launch(seconds: float, device: int | str | None = None) -> str:
    """Launch GPU work that runs for ``seconds`` on ``device``, as a CUDA kernel launch does: the
    call returns at once and the work stays in flight. A checkpoint's lock waits for it (up to its
    timeout), as the driver's lock waits for work already submitted. The utilization the GPU
    reports is what :func:`set_utilization` says, not changed by this.

    Returns:
        The UUID of the device the work runs on.
    """
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds >= 0:
        raise ValueError(f"seconds must be 0 or more, not {seconds!r}")
    until = time.time() + float(seconds)

    def submit(conn: sqlite3.Connection, uuid: str, pid: int, ns: int) -> None:
        place(conn, uuid, pid, procs.started(pid), 0, None, ns=ns)
        conn.execute(
            "UPDATE processes SET work_until = MAX(COALESCE(work_until, 0), ?) WHERE pid = ? AND ns = ? AND uuid = ?",
            (until, pid, ns, uuid),
        )

    return _on_the_gpu(device, submit)


def memory_allocated(device: int | str | None = None) -> int:
    """Bytes this process holds on ``device`` (default the first visible one)."""
    uuid = _resolve(device)
    pid, ns = _me()
    with transaction(_state_path(), write=False) as conn:
        row = conn.execute(
            "SELECT memory FROM processes WHERE pid = ? AND ns = ? AND uuid = ?", (pid, ns, uuid)
        ).fetchone()
    return int(row["memory"]) if row else 0
