"""A server's heartbeat, read and checked before the broker folds any of it in.

Each single-user server sends the broker, every ``heartbeat_interval`` seconds, an object of its
kernels (kernel id -> its state). Nothing in it is believed as sent: every field is checked for
its type and bounds here (:class:`HeartbeatError` says what is wrong), and what the broker can
check itself (a kernel's processes) is only a hint that ``RemoteKernels`` verifies.
"""

from __future__ import annotations

from typing import Any

from ..api.input import ID_PATTERN

#: Bounds on what one heartbeat may carry (the broker's traits may set lower ones).
MAX_KERNELS = 128
MAX_PIDS = 256
MAX_NOTEBOOK = 512


class HeartbeatError(ValueError):
    """A heartbeat (or part of it) that does not make sense; the message says what."""


def check_kernels(kernels: Any, max_kernels: int) -> dict:
    """A heartbeat's ``kernels`` object, checked to be one and to hold at most ``max_kernels``
    entries; raises :class:`HeartbeatError`. Its entries are read with :func:`parse_kernel_report`."""
    if not isinstance(kernels, dict):
        raise HeartbeatError("kernels must be an object: kernel id -> its state")
    if len(kernels) > max_kernels:
        raise HeartbeatError(
            f"a heartbeat may report at most {max_kernels} kernels "
            "(c.GPUBroker.max_kernels_per_server)"
        )
    return kernels


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
