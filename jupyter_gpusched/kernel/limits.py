"""A shared lease's memory share, set where the frameworks read it before the user's code runs.

A ``shared`` lease with a memory share places several kernels on one GPU by memory; nothing in
CUDA keeps a process within its share. What can be done:

- the frameworks' own settings, read when the framework starts: ``CUPY_GPU_MEMORY_LIMIT``
  (bytes), ``XLA_PYTHON_CLIENT_MEM_FRACTION`` with ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` (JAX),
  ``TF_FORCE_GPU_ALLOW_GROWTH=true`` (TensorFlow has no byte limit through its environment), and
  for PyTorch ``torch.cuda.set_per_process_memory_fraction`` for each visible GPU, queued with
  ``torch.cuda._lazy_call`` as soon as the user's code imports ``torch``: it runs when torch
  initializes CUDA, so importing torch neither initializes CUDA nor is done by us. These limits
  are advisory: the user's code may change them.
- MPS, where the server runs a control daemon for the GPU (``c.GPUSchedApp.mps``): the kernel is
  an MPS client with ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``, which the driver enforces, and
  ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``, its compute share: a claim names memory only, so the
  compute share is the memory share's part of the GPU's memory, in whole percent rounded up
  (at least 1): a kernel promised a fifth of the memory may use a fifth of the SMs.

The environment is set in the kernel process itself when the lease is bound (lazily, before the
first cell) and cleared when the lease is exclusive or ends; the provisioner sets the same
variables before a kernel bound at launch starts (:func:`limits_for` and
:meth:`Limits.environment` are shared by both).
"""

from __future__ import annotations

import importlib.abc
import json
import logging
import math
import os
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .states import HOLDING

log = logging.getLogger("jupyter_gpusched.kernel")

#: How the server tells its kernels about MPS (JSON, see :class:`MpsInfo`).
ENV_MPS = "JUPYTER_GPUSCHED_MPS"
#: The limit variables the provisioner set for a lease bound at launch (comma-separated): they
#: were not the kernel's own, so they are not restored when the limits end.
ENV_LIMITS_SET = "JUPYTER_GPUSCHED_LIMITS_SET"

CUPY_LIMIT = "CUPY_GPU_MEMORY_LIMIT"
XLA_FRACTION = "XLA_PYTHON_CLIENT_MEM_FRACTION"
XLA_PREALLOCATE = "XLA_PYTHON_CLIENT_PREALLOCATE"
TF_GROWTH = "TF_FORCE_GPU_ALLOW_GROWTH"
MPS_PIPE = "CUDA_MPS_PIPE_DIRECTORY"
MPS_LOG = "CUDA_MPS_LOG_DIRECTORY"
MPS_MEM_LIMIT = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
MPS_THREADS = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"

#: Every variable a shared lease's limits set (and that an exclusive lease or none clears).
LIMIT_VARS = (CUPY_LIMIT, XLA_FRACTION, XLA_PREALLOCATE, TF_GROWTH, MPS_PIPE, MPS_LOG, MPS_MEM_LIMIT, MPS_THREADS)


@dataclass(frozen=True)
class MpsInfo:
    """What the server says about MPS: ``state`` is ``running`` (with a daemon per GPU in
    ``daemons``: UUID to ``{"pipe", "log"}`` directories), or ``off``, ``absent``, ``hub``,
    ``failed``, ``unavailable``; ``reason`` says why in words. ``unknown``: nothing was said
    (a kernel not started by the provisioner)."""

    state: str = "unknown"
    reason: str = "this kernel was not started by the GPU scheduler's provisioner, so it runs no MPS client"
    daemons: Mapping[str, Mapping[str, str]] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps({"state": self.state, "reason": self.reason, "daemons": dict(self.daemons)})

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> MpsInfo:
        env = os.environ if environ is None else environ
        text = env.get(ENV_MPS, "").strip()
        if not text:
            return cls()
        try:
            data = json.loads(text)
            daemons = {
                str(uuid): {"pipe": str(d["pipe"]), "log": str(d["log"])}
                for uuid, d in (data.get("daemons") or {}).items()
            }
            return cls(str(data.get("state") or "unknown"), str(data.get("reason") or ""), daemons)
        except (ValueError, TypeError, KeyError, AttributeError):
            log.warning("%s=%r is not what the server writes; no MPS for this kernel", ENV_MPS, text)
            return cls(reason=f"{ENV_MPS} could not be read")


def _mps_size(size: int) -> str:
    """``16G`` or ``12288M`` (whole MiB, rounded down): the units MPS reads."""
    mib = size // (1024 * 1024)
    if mib >= 1024 and mib % 1024 == 0:
        return f"{mib // 1024}G"
    return f"{max(mib, 1)}M"


@dataclass(frozen=True)
class Limits:
    """The memory share of one shared lease and what enforces it.

    Attributes:
        memory: bytes per GPU.
        devices: the lease's GPUs (UUIDs), in the order CUDA numbers them.
        totals: each GPU's memory in bytes (None where unknown).
        mps: the MPS daemon's ``{"pipe", "log"}`` directories when the kernel is its client.
        mps_note: why the kernel is not an MPS client (empty when it is).
    """

    memory: int
    devices: tuple[str, ...]
    totals: tuple[int | None, ...] = ()
    mps: Mapping[str, str] | None = None
    mps_note: str = ""

    @property
    def fraction(self) -> float | None:
        """The share as a fraction of the smallest GPU's memory (None if no total is known)."""
        known = [t for t in self.totals if t]
        if not known:
            return None
        return min(1.0, self.memory / min(known))

    @property
    def thread_percentage(self) -> int | None:
        """The MPS compute share: the memory share as a percentage of the GPU's memory, rounded
        up to a whole percent, 1 to 100 (None where the GPU's memory is unknown)."""
        known = [t for t in self.totals if t]
        if not known:
            return None
        total = min(known)
        return max(1, min(100, -(-self.memory * 100 // total)))

    def environment(self) -> dict[str, str]:
        """The frameworks' (and MPS's) own variables for this share."""
        env = {CUPY_LIMIT: str(self.memory), XLA_PREALLOCATE: "false", TF_GROWTH: "true"}
        fraction = self.fraction
        if fraction is not None:
            # Rounded down, so that JAX's pool never exceeds the share.
            env[XLA_FRACTION] = f"{max(math.floor(fraction * 10000) / 10000, 0.0001):.4f}"
        if self.mps is not None:
            env[MPS_PIPE] = self.mps["pipe"]
            env[MPS_LOG] = self.mps["log"]
            env[MPS_MEM_LIMIT] = ",".join(f"{i}={_mps_size(self.memory)}" for i in range(len(self.devices)))
            threads = self.thread_percentage
            if threads is not None:
                env[MPS_THREADS] = str(threads)
        return env

    def enforcers(self) -> list[str]:
        """What keeps the kernel within its share, in words."""
        out = []
        if self.mps is not None:
            out.append("MPS pinned device memory limit")
        out += ["PyTorch per-process fraction", "CuPy"]
        if self.fraction is not None:
            out.append("JAX")
        return out

    def describe(self) -> str:
        """``memory limit 16.0 GiB per GPU: ... (...)`` for ``%gpu status``."""
        from .render import format_bytes

        frameworks = ", ".join(e for e in self.enforcers() if not e.startswith("MPS"))
        if self.mps is not None:
            threads = self.thread_percentage
            compute = (
                f" and {threads}% of the GPU's compute (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE)"
                if threads is not None
                else " (no compute share: the GPU's memory is unknown)"
            )
            how = f"MPS pinned device memory limit{compute} (enforced by the driver); {frameworks} (their own limits)"
        else:
            how = f"{frameworks} (advisory: the frameworks' own limits; {self.mps_note})"
        return (
            f"Memory limit {format_bytes(self.memory)} per GPU: {how}. "
            "TensorFlow only grows its memory on demand."
        )


def limits_for(
    lease: Mapping[str, Any] | None,
    totals: Mapping[str, int | None],
    mps: MpsInfo,
) -> Limits | None:
    """The limits of ``lease`` (None: an exclusive lease, a whole GPU, or no GPU).

    Args:
        lease: the lease as the server shows it (``mode``, ``memory``, ``devices``).
        totals: each GPU's memory in bytes, by UUID.
        mps: what the server said about MPS.
    """
    if not lease or lease.get("mode") != "shared" or not lease.get("memory"):
        return None
    devices = tuple(lease.get("devices") or ())
    if not devices:
        return None
    memory = int(lease["memory"])
    daemon = None
    if mps.state != "running":
        note = mps.reason or "no MPS"
    elif len(devices) != 1:
        note = "MPS serves single-GPU leases only: one MPS server per GPU"
    elif devices[0] not in mps.daemons:
        note = "no MPS daemon for this GPU"
    else:
        daemon, note = mps.daemons[devices[0]], ""
    return Limits(memory, devices, tuple(totals.get(u) for u in devices), daemon, note)


def totals_of(devices: Any) -> dict[str, int | None]:
    """Each GPU's memory by UUID, from the server's device list."""
    return {d.get("uuid"): d.get("memory_total") for d in devices or () if isinstance(d, Mapping)}


# -- PyTorch: the fraction, queued for when torch initializes CUDA ------------------------------
class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``callback(module)`` once the module named ``name`` has been imported by anyone.

    The module is found and loaded by the finders after this one as usual; only its loader's
    ``exec_module`` is wrapped, and the module's own ``__loader__`` is left as it was.
    """

    def __init__(self, name: str, callback: Callable[[Any], None]):
        self.name = name
        self.callback = callback
        self._local = threading.local()

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.name or getattr(self._local, "busy", False):
            return None
        self._local.busy = True
        try:
            spec = None
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
        finally:
            self._local.busy = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _LoaderThen(spec.loader, self.callback)
        return spec


class _LoaderThen(importlib.abc.Loader):
    def __init__(self, loader: Any, callback: Callable[[Any], None]):
        self.loader = loader
        self.callback = callback

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        # The module sees its real loader (resources, source lookups), not this wrapper.
        module.__loader__ = self.loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        try:
            self.callback(module)
        except Exception:  # noqa: BLE001 - the user's import must never fail because of us
            log.exception("after importing %s", getattr(module, "__name__", "?"))

    def __getattr__(self, name: str) -> Any:
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)


class Keeper:
    """The kernel's limits, kept in step with its lease (owned by the agent).

    Args:
        environ: the kernel's environment as it started (what the provisioner set).
        devices: the server's GPUs (``GET api/gpusched/devices``), for their memory.
    """

    def __init__(self, environ: Mapping[str, str], devices: Callable[[], Any]):
        self._devices = devices
        self.mps = MpsInfo.from_environment(environ)
        #: What each limit variable was before any lease set it (restored when limits end).
        ours = {name for name in environ.get(ENV_LIMITS_SET, "").split(",") if name}
        #: Whether the provisioner set a lease's limits before the kernel started.
        self.set_at_launch = bool(ours)
        self.original = {name: None if name in ours else os.environ.get(name) for name in LIMIT_VARS}
        #: The limits in force (None: none).
        self.current: Limits | None = None
        self._applied_for: tuple | None = None
        self._totals: dict[str, int | None] = {}
        self._finder: _AfterImport | None = None
        #: Whether the fraction is queued in torch for its CUDA initialization.
        self.torch_queued = False
        #: The fractions torch was given at its CUDA initialization, by device ordinal.
        self.torch_applied: dict[int, float] = {}
        self._lock = threading.Lock()

    # -- the environment ------------------------------------------------------------------------
    def apply(self, lease: Mapping[str, Any] | None) -> Limits | None:
        """Set the limits of ``lease`` (or clear them for an exclusive lease or none)."""
        key = None
        if lease:
            key = (lease.get("id"), tuple(lease.get("devices") or ()), lease.get("memory"), lease.get("mode"))
        if key == self._applied_for and key is not None:
            return self.current
        limits = limits_for(lease, self.totals(lease), self.mps) if lease else None
        with self._lock:
            self._set_environment(limits)
            self.current = limits
            self._applied_for = key
        if limits is not None:
            log.info(
                "lease %s: memory limit %s bytes per GPU on %s (%s)",
                lease.get("id") if lease else None,
                limits.memory,
                ",".join(limits.devices),
                ", ".join(limits.enforcers()),
            )
            self.install_torch_hook()
        return limits

    def clear(self) -> None:
        """No limits: the lease is exclusive or over."""
        with self._lock:
            self._set_environment(None)
            self.current = None
            self._applied_for = None

    def _set_environment(self, limits: Limits | None) -> None:
        wanted = limits.environment() if limits is not None else {}
        for name in LIMIT_VARS:
            value = wanted.get(name, self.original.get(name))
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value

    def totals(self, lease: Mapping[str, Any] | None) -> dict[str, int | None]:
        """The memory of the lease's GPUs, asked of the server once per GPU."""
        devices = tuple((lease or {}).get("devices") or ())
        if lease and lease.get("mode") == "shared" and lease.get("memory"):
            if any(u not in self._totals for u in devices):
                try:
                    self._totals.update(totals_of(self._devices()))
                except Exception as err:  # noqa: BLE001 - without totals JAX's fraction is left out
                    log.warning("could not read the GPUs' memory for the limits: %s", err)
        return {u: self._totals.get(u) for u in devices}

    def describe(self, lease: Mapping[str, Any] | None, devices: Any) -> str | None:
        """The ``%gpu status`` line on the limits of ``lease`` (None: no limits)."""
        if not lease or lease.get("state") not in HOLDING:
            return None
        limits = limits_for(lease, totals_of(devices), self.mps)
        if limits is None:
            return None
        text = limits.describe()
        if self.torch_applied:
            text += " PyTorch's fraction is applied."
        elif self.torch_queued:
            text += " PyTorch's fraction is queued for its CUDA initialization."
        return text

    # -- PyTorch ----------------------------------------------------------------------------------
    def install_torch_hook(self) -> None:
        """Queue the fraction in torch when (or, if already imported, now that) it is imported."""
        if self._finder is None:
            self._finder = _AfterImport("torch", self._torch_imported)
            sys.meta_path.insert(0, self._finder)
        torch = sys.modules.get("torch")
        if torch is not None and not self.torch_queued:
            self._torch_imported(torch)

    def uninstall_torch_hook(self) -> None:
        if self._finder is not None and self._finder in sys.meta_path:
            sys.meta_path.remove(self._finder)
        self._finder = None

    def _torch_imported(self, torch: Any) -> None:
        cuda = getattr(torch, "cuda", None)
        lazy_call = getattr(cuda, "_lazy_call", None)
        if lazy_call is None:
            log.warning("this torch has no torch.cuda._lazy_call; its memory fraction is not set")
            return
        if self.torch_queued:
            return
        # Queued, never called now: set_per_process_memory_fraction would initialize CUDA.
        lazy_call(self.apply_torch_fraction)
        self.torch_queued = True
        log.info("torch imported: the memory fraction is queued for its CUDA initialization")

    def apply_torch_fraction(self) -> None:
        """Run by torch as it initializes CUDA: each visible GPU's fraction of the share.

        Computed from torch's own view of each GPU's memory, which its fraction is of. Never
        raises: an error here would fail torch's CUDA initialization.
        """
        limits = self.current
        if limits is None:
            return
        try:
            import torch

            for ordinal in range(min(torch.cuda.device_count(), len(limits.devices))):
                total = torch.cuda.get_device_properties(ordinal).total_memory
                fraction = min(1.0, limits.memory / total) if total else 1.0
                torch.cuda.set_per_process_memory_fraction(fraction, ordinal)
                self.torch_applied[ordinal] = fraction
        except Exception:  # noqa: BLE001 - see above
            log.exception("setting PyTorch's memory fraction failed")
