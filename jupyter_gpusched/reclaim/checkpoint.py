"""Suspending a kernel's GPU state to host memory and back (the ladder's checkpoint step, core/ladder.py).

Three ways, found once at start-up:

* the CUDA driver checkpoint API (``cuCheckpointProcessLock/Checkpoint/Restore/Unlock``, driver
  570 or newer) through ``cuda.bindings.driver`` when that package is installed;
* else the ``cuda-checkpoint`` utility when it is on ``PATH``;
* on simulated GPUs, the simulated backend's own checkpoint.

The process keeps running on the CPU throughout: only its GPU memory and contexts move. UVM and IPC
memory cannot be checkpointed; the driver then refuses and the ladder falls through. Nor can a
process on a MIG instance (NVIDIA/cuda-checkpoint#42): the core skips the step there
(``core/ladder.py``), and a refusal that names the GPU (:class:`CheckpointUnsupported`) keeps the
step from being tried on it again. A lock waits for GPU work already submitted for at most
``lock_timeout_ms``; when it gives up (:class:`LockTimeout`) nothing was checkpointed, the kernel
runs on and keeps its lease, and a later pass may try again.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import shutil
import subprocess
from typing import Iterator, Mapping

log = logging.getLogger(__name__)

#: The driver release that brought the checkpoint API (CUDA 12.8).
MIN_DRIVER_API = 12080
#: How long the driver may wait for in-flight GPU work before a lock gives up (milliseconds).
LOCK_TIMEOUT_MS = 30_000


#: ``CUDA_ERROR_TIMEOUT``: what ``cuCheckpointProcessLock`` returns when the process's GPU work did
#: not finish within the lock's timeout.
CUDA_ERROR_TIMEOUT = 909


class CheckpointError(RuntimeError):
    """A checkpoint or restore was refused or failed; the message says why."""


class LockTimeout(CheckpointError):
    """The lock gave up: the process's GPU work did not pause within ``timeout_ms``. Nothing was
    checkpointed and the process runs on, unharmed; a later try may succeed."""

    def __init__(self, message: str, timeout_ms: int) -> None:
        super().__init__(message)
        self.timeout_ms = timeout_ms


class CheckpointUnsupported(CheckpointError):
    """The checkpointer cannot serve the GPUs ``uuids`` (a MIG instance, NVIDIA/cuda-checkpoint#42):
    no checkpoint of any process there can succeed, so none should be tried again."""

    def __init__(self, message: str, uuids: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.uuids = tuple(uuids)


class RestoreNoRoom(CheckpointError):
    """A restore found too little free memory on a target GPU; the process stays checkpointed
    and can be restored once there is room (the simulated backend rolls such a restore back).
    On a real driver (580) a process whose restore ran out of memory may refuse every later
    restore (NVIDIA/cuda-checkpoint#44): the next try then fails with a plain CheckpointError,
    which is why the server restores only where the checkpoint fits with a margin."""


#: CUresult of a driver call that ran out of device memory.
CUDA_ERROR_OUT_OF_MEMORY = 2


@contextlib.contextmanager
def _as_checkpoint_error(what: str) -> Iterator[None]:
    """Any exception but a CheckpointError leaves as one, saying what was being done: a
    checkpointer's callers handle CheckpointError alone."""
    try:
        yield
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - a checkpointer fails only with CheckpointError
        raise CheckpointError(f"{what}: {type(exc).__name__}: {exc}") from exc


class Checkpointer:
    """Suspends and restores one process's GPU state."""

    available: bool = False
    reason: str = "no checkpoint support"
    remap: bool = False
    #: How long a lock waits for the process's GPU work already submitted (milliseconds).
    lock_timeout_ms: int = LOCK_TIMEOUT_MS

    def checkpoint(self, pid: int) -> int | None:  # pragma: no cover - interface
        """Move ``pid``'s GPU state to host memory; return bytes moved where known."""
        raise CheckpointError(self.reason)

    def restore(self, pid: int, device_map: Mapping[str, str] | None = None) -> None:  # pragma: no cover
        """Bring ``pid``'s GPU state back, onto other devices if ``device_map`` says so."""
        raise CheckpointError(self.reason)


class Unavailable(Checkpointer):
    def __init__(self, reason: str) -> None:
        self.reason = reason


class SimulatedCheckpointer(Checkpointer):
    """Checkpoint on the simulated backend: the process's simulated memory moves to the host."""

    def __init__(self, backend) -> None:
        self.backend = backend
        self.available, self.reason = backend.checkpoint_support()
        self.remap = True

    def checkpoint(self, pid: int) -> int | None:
        from ..devices.base import DeviceLost
        from ..devices.simulated.state import SimulatedCheckpointUnsupported, SimulatedCudaError, SimulatedLockTimeout

        with _as_checkpoint_error(f"checkpoint of process {pid}"):
            try:
                return self.backend.checkpoint(pid, lock_timeout=self.lock_timeout_ms / 1000)
            except SimulatedLockTimeout as exc:
                raise LockTimeout(str(exc), self.lock_timeout_ms) from None
            except SimulatedCheckpointUnsupported as exc:
                raise CheckpointUnsupported(str(exc), exc.uuids) from None
            except (SimulatedCudaError, DeviceLost) as exc:
                raise CheckpointError(str(exc)) from None

    def restore(self, pid: int, device_map: Mapping[str, str] | None = None) -> None:
        from ..devices.simulated import SimulatedOutOfMemory

        with _as_checkpoint_error(f"restore of process {pid}"):
            try:
                self.backend.restore(pid, dict(device_map) if device_map else None)
            except SimulatedOutOfMemory as exc:
                # As the driver answers CUDA_ERROR_OUT_OF_MEMORY; the simulated restore is all or
                # nothing, so the process is still checkpointed.
                raise RestoreNoRoom(f"restore of process {pid}: {exc}") from exc


class DriverCheckpointer(Checkpointer):
    """The CUDA driver checkpoint API through ``cuda.bindings.driver``."""

    def __init__(self, driver, lock_timeout_ms: int = LOCK_TIMEOUT_MS) -> None:
        self.driver = driver
        self.available = True
        self.reason = "CUDA driver checkpoint API (cuda.bindings)"
        self.lock_timeout_ms = lock_timeout_ms
        self.remap = hasattr(driver, "CUcheckpointGpuPair")

    def _call(self, name: str, *args) -> None:
        with _as_checkpoint_error(f"{name} for process {args[0] if args else '?'}"):
            result = getattr(self.driver, name)(*args)
            err = result[0] if isinstance(result, tuple) else result
            code = int(err)
        if code == CUDA_ERROR_OUT_OF_MEMORY and name == "cuCheckpointProcessRestore":
            raise RestoreNoRoom(f"{name} failed: {err!r}")
        if code != 0:
            raise CheckpointError(f"{name} failed: {err!r}")

    def lock(self, pid: int) -> None:
        """Lock ``pid``'s CUDA calls once its GPU work already submitted is done.

        Raises:
            LockTimeout: that work did not finish within ``lock_timeout_ms``; the process runs on.
        """
        with _as_checkpoint_error(f"cuCheckpointProcessLock for process {pid}"):
            lock_args = self.driver.CUcheckpointLockArgs()
            lock_args.timeoutMs = self.lock_timeout_ms
            result = self.driver.cuCheckpointProcessLock(pid, lock_args)
            err = result[0] if isinstance(result, tuple) else result
            code = int(err)
        if code == CUDA_ERROR_TIMEOUT:
            raise LockTimeout(
                f"cuCheckpointProcessLock timed out after {self.lock_timeout_ms} ms: process {pid}'s GPU work "
                "did not finish", self.lock_timeout_ms,
            )
        if code != 0:
            raise CheckpointError(f"cuCheckpointProcessLock failed: {err!r}")

    def checkpoint(self, pid: int) -> int | None:
        self.lock(pid)
        try:
            self._call("cuCheckpointProcessCheckpoint", pid, None)
        except CheckpointError:
            self._call("cuCheckpointProcessUnlock", pid, None)
            raise
        return None

    def restore(self, pid: int, device_map: Mapping[str, str] | None = None) -> None:
        args = None
        # The buffers behind the map's UUIDs: alive until the driver has read them.
        keep: list = []
        if device_map and any(old != new for old, new in device_map.items()):
            if not self.remap:
                raise CheckpointError("this driver cannot restore onto another GPU")
            with _as_checkpoint_error(f"the GPU map for process {pid}"):
                args = self._remap_args(device_map, keep)
        self._call("cuCheckpointProcessRestore", pid, args)
        del keep
        self._call("cuCheckpointProcessUnlock", pid, None)

    def _remap_args(self, device_map: Mapping[str, str], keep: list):
        pairs = []
        for old, new in device_map.items():
            pair = self.driver.CUcheckpointGpuPair()
            pair.oldUuid = _cu_uuid(self.driver, old, keep)
            pair.newUuid = _cu_uuid(self.driver, new, keep)
            pairs.append(pair)
        args = self.driver.CUcheckpointRestoreArgs()
        args.gpuPairs = pairs
        args.gpuPairsCount = len(pairs)
        keep.append(pairs)
        return args


def _cu_uuid(driver, text: str, keep: list):
    """``driver.CUuuid`` of a ``GPU-xxxxxxxx-...`` UUID. Its ``bytes`` cannot be set (cuda-bindings
    13 has no setter): the struct is built over a 16-byte buffer, which ``keep`` holds alive."""
    raw = bytes.fromhex(text.split("-", 1)[1].replace("-", ""))
    if len(raw) != 16:
        raise CheckpointError(f"{text!r} is not a GPU UUID")
    buf = ctypes.create_string_buffer(raw, 16)
    keep.append(buf)
    return driver.CUuuid(ctypes.addressof(buf))


class UtilityCheckpointer(Checkpointer):
    """The ``cuda-checkpoint`` utility."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.available = True
        self.reason = f"cuda-checkpoint utility at {path}"
        self.remap = False

    def _run(self, action: str, pid: int) -> None:
        cmd = [self.path, "--action", action, "--pid", str(pid)]
        if action == "lock":
            cmd += ["--timeout", str(self.lock_timeout_ms)]
        with _as_checkpoint_error(" ".join(cmd[1:])):
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
        if done.returncode != 0:
            said = done.stderr.strip()
            message = f"cuda-checkpoint --action {action} --pid {pid}: {said}"
            # The utility reports the driver's error by name or in words.
            if action == "lock" and any(w in said.lower() for w in ("timeout", "timed out", "cuda_error_timeout")):
                raise LockTimeout(message, self.lock_timeout_ms)
            raise CheckpointError(message)

    def checkpoint(self, pid: int) -> int | None:
        self._run("lock", pid)
        try:
            self._run("checkpoint", pid)
        except CheckpointError:
            self._run("unlock", pid)
            raise
        return None

    def restore(self, pid: int, device_map: Mapping[str, str] | None = None) -> None:
        if device_map and any(old != new for old, new in device_map.items()):
            raise CheckpointError("cuda-checkpoint cannot restore onto another GPU here")
        self._run("restore", pid)
        self._run("unlock", pid)


def _driver_api() -> tuple[object | None, str]:
    try:
        from cuda.bindings import driver  # type: ignore[import-not-found]
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return None, "cuda.bindings is not installed"
    if not hasattr(driver, "cuCheckpointProcessCheckpoint"):
        return None, "the installed cuda.bindings has no checkpoint API"
    try:
        (err,) = driver.cuInit(0)
        if int(err) != 0:
            return None, f"cuInit failed: {err!r}"
        err, version = driver.cuDriverGetVersion()
        if int(err) != 0:
            return None, f"cuDriverGetVersion failed: {err!r}"
    except Exception as exc:  # noqa: BLE001 - the driver library may be missing entirely
        return None, f"the CUDA driver could not be loaded: {exc}"
    if version < MIN_DRIVER_API:
        return None, f"the CUDA driver is too old for checkpoints (API {version}, needs {MIN_DRIVER_API})"
    return driver, ""


def detect(backend, mode: str = "auto") -> Checkpointer:
    """The best available checkpointer for ``backend``, or one that says why there is none."""
    if mode == "off":
        return Unavailable("checkpoint is off in the configuration")
    if backend is None:
        return Unavailable("there is no GPU inventory")
    if getattr(backend, "name", "") == "simulated":
        checkpointer = SimulatedCheckpointer(backend)
        log.info("checkpoint: %s", checkpointer.reason)
        return checkpointer
    driver, why = _driver_api()
    if driver is not None:
        checkpointer: Checkpointer = DriverCheckpointer(driver)
    elif shutil.which("cuda-checkpoint"):
        checkpointer = UtilityCheckpointer(shutil.which("cuda-checkpoint") or "cuda-checkpoint")
    else:
        checkpointer = Unavailable(f"{why}, and cuda-checkpoint is not on PATH")
    log.info("checkpoint: %s", checkpointer.reason)
    return checkpointer
