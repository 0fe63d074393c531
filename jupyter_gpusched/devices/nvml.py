"""The NVML backend: the host's NVIDIA GPUs through nvidia-ml-py.

Written the way nvitop talks to NVML: nothing is called at import; ``nvmlInit`` runs lazily under
a lock on first use; every call goes through one query function that looks the binding up by
name, so a symbol the driver (or the installed binding) lacks is logged once and answered with
``None``; versioned variants (``_v3``, ``_v2``) are probed newest first. No pynvml exception
leaves this module: a GPU that fell off the bus shows up with health ``"lost"``, a driver that
cannot be reached raises :class:`InventoryUnavailable`.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterable

import pynvml

from .base import LOST, DeviceBackend, DeviceLost, DeviceSnapshot, GPUProcess, InventoryUnavailable

log = logging.getLogger(__name__)

#: nvmlInit and nvmlShutdown change process-wide state; one lock for every backend instance.
_INIT_LOCK = threading.RLock()


def _errors(*names: str) -> tuple[type[BaseException], ...]:
    # Looked up by name: an older binding may lack some of the generated error classes.
    found = tuple(getattr(pynvml, name) for name in names if isinstance(getattr(pynvml, name, None), type))
    return found


_FUNCTION_NOT_FOUND = _errors("NVMLError_FunctionNotFound", "NVMLLibraryMismatchError")
_NOT_SUPPORTED = _errors("NVMLError_NotSupported")
_NOT_FOUND = _errors("NVMLError_NotFound")
_LOST = _errors("NVMLError_GpuIsLost", "NVMLError_ResetRequired")
_UNREACHABLE = _errors(
    "NVMLError_Uninitialized",
    "NVMLError_LibraryNotFound",
    "NVMLError_DriverNotLoaded",
    "NVMLError_LibRmVersionMismatch",
)
_NVML_ERROR = _errors("NVMLError")

#: "NVIDIA A100-SXM4-40GB MIG 3g.20gb" -> "3g.20gb"
_MIG_NAME = re.compile(r"\bMIG\s+(\d+g\.\d+gb(?:\+\w+)*)\s*$", re.IGNORECASE)
_SWITCH = "nvswitch"


def _architecture_names() -> dict[int, str]:
    names = {}
    for attr in dir(pynvml):
        if attr.startswith("NVML_DEVICE_ARCH_") and attr != "NVML_DEVICE_ARCH_UNKNOWN":
            value = getattr(pynvml, attr)
            if isinstance(value, int):
                names[value] = attr[len("NVML_DEVICE_ARCH_") :].title()
    return names


_ARCHITECTURES = _architecture_names()


# Outcomes of one NVML call.
_OK = "ok"
_MISSING = "missing"  # the driver or the binding lacks the function
_UNSUPPORTED = "unsupported"  # the function exists, this device does not do it
_NOTHING = "nothing"  # the call worked and found nothing (no MIG instance in a slot, no samples)
_FAILED = "failed"  # any other error


def _init_message(exc: BaseException) -> str:
    kind = type(exc).__name__
    if kind == "NVMLError_LibraryNotFound":
        return (
            "NVML (libnvidia-ml.so.1) was not found: this host has no NVIDIA driver, or its "
            "library is not on the loader path."
        )
    if kind == "NVMLError_DriverNotLoaded":
        return (
            "The NVIDIA kernel driver is not loaded (`nvidia-smi` fails too): load it, or reboot after "
            "installing it."
        )
    if kind == "NVMLError_NoPermission":
        return "No permission to open the NVIDIA devices (/dev/nvidia*): add this user to the group that owns them."
    if kind == "NVMLError_LibRmVersionMismatch":
        return (
            "The NVIDIA library and kernel driver versions differ (usually right after a driver "
            "upgrade): reboot, or reload the nvidia kernel module."
        )
    return f"NVML could not be initialized ({exc})."


def _bus_id(pci: Any) -> str | None:
    """``0000:3b:00.0``, the form sysfs uses, from an ``nvmlPciInfo_t``."""
    try:
        return f"{int(pci.domain):04x}:{int(pci.bus):02x}:{int(pci.device):02x}.0"
    except (AttributeError, TypeError, ValueError):
        return None


def _sysfs_numa_node(bus_id: str | None) -> int | None:
    # Older drivers lack nvmlDeviceGetNumaNodeId; the kernel knows the answer too.
    if not bus_id:
        return None
    try:
        with open(f"/sys/bus/pci/devices/{bus_id}/numa_node", encoding="ascii") as f:
            node = int(f.read().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


@dataclass(frozen=True)
class _Static:
    """Facts about a GPU that do not change while it is up."""

    name: str
    architecture: str | None
    numa_node: int | None
    bus_id: str | None


class _Unreadable(Exception):
    """A fact the snapshot cannot do without (uuid, memory size) could not be read."""


class NvmlBackend(DeviceBackend):
    """The host's NVIDIA GPUs and MIG instances, read through NVML."""

    name = "nvml"

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._initialized = False
        self._missing: set[str] = set()
        self._reported: set[tuple[str, str]] = set()
        self._static: dict[str, _Static] = {}
        #: Last good reading per driver index: what a lost GPU is reported as.
        self._last: dict[int, tuple[DeviceSnapshot, tuple[DeviceSnapshot, ...]]] = {}
        self._groups: dict[str, str | None] = {}
        self._sample_since: dict[str, int] = {}
        #: GPUs already reported lost, so that the warning comes once, not every tick.
        self._lost: set[str] = set()

    # -- the one way into NVML ---------------------------------------------------------------

    def _ensure_init(self) -> None:
        with _INIT_LOCK:
            if self._initialized:
                return
            try:
                pynvml.nvmlInit()
            except _NVML_ERROR as exc:
                raise InventoryUnavailable(_init_message(exc)) from None
            except OSError as exc:  # a broken library file rather than a missing one
                raise InventoryUnavailable(f"NVML could not be loaded ({exc}).") from None
            self._initialized = True
            log.debug("NVML initialized")

    def _call(self, func_name: str, *args: Any, key: str | None = None, **kwargs: Any) -> tuple[str, Any]:
        """Call ``pynvml.<func_name>`` and say how it went: ``(outcome, value)``.

        Raises:
            DeviceLost: the GPU behind the handle is gone.
            InventoryUnavailable: NVML itself is gone (shut down, driver unloaded).
        """
        key = key or func_name
        if key in self._missing:
            return _MISSING, None
        func = getattr(pynvml, func_name, None)
        if func is None:
            self._mark_missing(key, "the installed nvidia-ml-py lacks it")
            return _MISSING, None
        try:
            return _OK, func(*args, **kwargs)
        except _FUNCTION_NOT_FOUND:
            self._mark_missing(key, "the driver lacks it")
            return _MISSING, None
        except _LOST as exc:
            raise DeviceLost(f"the GPU stopped answering NVML ({exc})") from None
        except _UNREACHABLE as exc:
            with _INIT_LOCK:
                # Someone shut NVML down under us; initialize afresh on the next snapshot.
                self._initialized = False
            raise InventoryUnavailable(f"NVML stopped answering ({exc}); will retry.") from None
        except _NOT_SUPPORTED:
            return _UNSUPPORTED, None
        except _NOT_FOUND:
            return _NOTHING, None
        except _NVML_ERROR as exc:
            if getattr(exc, "value", None) == getattr(pynvml, "NVML_SUCCESS", 0):
                # Some list calls report "no entries" as an error carrying NVML_SUCCESS.
                return _NOTHING, None
            self._report_once(key, exc)
            return _FAILED, None
        except Exception as exc:  # noqa: BLE001 - a binding bug must not take the server down
            self._report_once(key, exc)
            return _FAILED, None

    def _query(self, func_name: str, *args: Any, **kwargs: Any) -> Any:
        """The value of one NVML call, or ``None`` when it has none to give."""
        return self._call(func_name, *args, **kwargs)[1]

    def _probe(self, variants: Iterable[tuple[str, str, dict[str, Any]]], *args: Any) -> tuple[str, Any]:
        """Try ``(key, function, kwargs)`` variants newest first; the first that answers wins."""
        outcome = _UNSUPPORTED
        for key, func_name, kwargs in variants:
            outcome, value = self._call(func_name, *args, key=key, **kwargs)
            if outcome in (_OK, _NOTHING):
                return outcome, value
        return outcome, None

    def _required(self, func_name: str, *args: Any) -> Any:
        outcome, value = self._call(func_name, *args)
        if outcome != _OK or value is None:
            raise _Unreadable(f"{func_name} gave no answer ({outcome})")
        return value

    def _mark_missing(self, key: str, why: str) -> None:
        if key not in self._missing:
            self._missing.add(key)
            log.debug("NVML function %s is not available (%s); its fields will be None", key, why)

    def _report_once(self, key: str, exc: BaseException) -> None:
        marker = (key, type(exc).__name__)
        if marker not in self._reported:
            self._reported.add(marker)
            log.debug("NVML call %s failed (%s: %s); its field will be None", key, type(exc).__name__, exc)

    # -- public ------------------------------------------------------------------------------

    def device_count(self) -> int:
        """Physical GPUs the driver reports (initializes NVML).

        Raises:
            InventoryUnavailable: NVML cannot be loaded or does not answer.
        """
        with self._lock:
            self._ensure_init()
            outcome, count = self._call("nvmlDeviceGetCount")
            if outcome != _OK:
                raise InventoryUnavailable(f"NVML could not count the GPUs ({outcome}).")
            return int(count)

    def snapshot(self) -> tuple[DeviceSnapshot, ...]:
        with self._lock:
            count = self.device_count()
            physical: list[DeviceSnapshot] = []
            children: list[DeviceSnapshot] = []
            healthy: list[tuple[DeviceSnapshot, Any]] = []
            for index in range(count):
                read = self._read_or_lost(index)
                if read is None:
                    continue
                parent, handle, kids = read
                physical.append(parent)
                children.extend(kids)
                if handle is not None:
                    healthy.append((parent, handle))
            self._update_topology(healthy)

            result = []
            for snap in physical:
                if not snap.lost:
                    snap = dataclasses.replace(snap, nvlink_group=self._groups.get(snap.uuid))
                result.append(snap)
            for offset, child in enumerate(children):
                result.append(dataclasses.replace(child, index=count + offset))
            for snap in result:
                if snap.parent_uuid is None and not snap.lost:
                    kids = tuple(c for c in result if c.parent_uuid == snap.uuid)
                    self._last[snap.index] = (snap, kids)
            return tuple(result)

    def checkpoint_support(self) -> tuple[bool, str]:
        return False, (
            "NVML only observes GPUs; moving a process's GPU memory to the host needs the CUDA "
            "driver checkpoint API"
        )

    def close(self) -> None:
        with _INIT_LOCK:
            if not self._initialized:
                return
            self._initialized = False
            try:
                pynvml.nvmlShutdown()
            except _NVML_ERROR as exc:
                log.debug("nvmlShutdown failed (%s); ignoring", exc)
            log.debug("NVML shut down")

    # -- reading one GPU ---------------------------------------------------------------------

    def _read_or_lost(self, index: int) -> tuple[DeviceSnapshot, Any, list[DeviceSnapshot]] | None:
        uuid: str | None = None
        try:
            handle = self._required("nvmlDeviceGetHandleByIndex", index)
            uuid = str(self._required("nvmlDeviceGetUUID", handle))
            parent, kids = self._read_physical(index, uuid, handle)
            if uuid in self._lost:
                self._lost.discard(uuid)
                log.info("GPU %s (index %s) answers again", uuid, index)
            return parent, handle, kids
        except _Unreadable as exc:
            log.warning("GPU at index %s (uuid %s) left out of the snapshot: %s", index, uuid, exc)
            return None
        except DeviceLost as exc:
            last = self._last.get(index)
            if last is None or (uuid is not None and last[0].uuid != uuid):
                log.warning(
                    "GPU at index %s (uuid %s) is lost and was never read before; left out: %s", index, uuid, exc
                )
                return None
            parent, kids = last
            if parent.uuid not in self._lost:
                self._lost.add(parent.uuid)
                log.warning("GPU %s (index %s) is lost: %s", parent.uuid, index, exc)
            return _as_lost(parent), None, [_as_lost(k) for k in kids]

    def _read_physical(self, index: int, uuid: str, handle: Any) -> tuple[DeviceSnapshot, list[DeviceSnapshot]]:
        static = self._static_facts(uuid, handle)
        total, used = self._memory(handle)
        mig_mode = self._query("nvmlDeviceGetMigMode", handle)
        mig_enabled = bool(mig_mode) and mig_mode[0] == getattr(pynvml, "NVML_DEVICE_MIG_ENABLE", 1)
        kids = self._read_mig(uuid, handle, static) if mig_enabled else []
        # With MIG on, processes live on the instances; listing them on the parent too would
        # count their memory twice.
        processes = () if mig_enabled else self._processes(uuid, handle)
        parent = DeviceSnapshot(
            uuid=uuid,
            index=index,
            name=static.name,
            memory_total=total,
            memory_used=used,
            utilization=self._utilization(handle),
            processes=processes,
            architecture=static.architecture,
            numa_node=static.numa_node,
        )
        return parent, kids

    def _read_mig(self, parent_uuid: str, handle: Any, parent: _Static) -> list[DeviceSnapshot]:
        kids = []
        for slot in range(int(self._query("nvmlDeviceGetMaxMigDeviceCount", handle) or 0)):
            mig_handle = self._query("nvmlDeviceGetMigDeviceHandleByIndex", handle, slot)
            if mig_handle is None:
                continue  # an empty slot
            try:
                uuid = str(self._required("nvmlDeviceGetUUID", mig_handle))
                total, used = self._memory(mig_handle)
            except _Unreadable as exc:
                log.warning("MIG instance %s of GPU %s left out of the snapshot: %s", slot, parent_uuid, exc)
                continue
            name = self._query("nvmlDeviceGetName", mig_handle)
            name = str(name) if name else parent.name
            match = _MIG_NAME.search(name)
            kids.append(
                DeviceSnapshot(
                    uuid=uuid,
                    index=-1,  # numbered after all physical GPUs by the caller
                    name=name,
                    memory_total=total,
                    memory_used=used,
                    utilization=self._utilization(mig_handle),
                    processes=self._processes(uuid, mig_handle),
                    architecture=parent.architecture,
                    numa_node=parent.numa_node,
                    # One CUDA process sees at most one MIG instance, so instances never form
                    # a group for multi-GPU claims.
                    nvlink_group=None,
                    parent_uuid=parent_uuid,
                    mig_profile=match.group(1) if match else None,
                )
            )
        return kids

    def _static_facts(self, uuid: str, handle: Any) -> _Static:
        cached = self._static.get(uuid)
        if cached is not None:
            return cached
        name = self._query("nvmlDeviceGetName", handle)
        arch = self._query("nvmlDeviceGetArchitecture", handle)
        bus_id = _bus_id(self._query("nvmlDeviceGetPciInfo", handle))
        numa = self._query("nvmlDeviceGetNumaNodeId", handle)
        if not isinstance(numa, int) or numa < 0:
            numa = _sysfs_numa_node(bus_id)
        static = _Static(
            name=str(name) if name else "NVIDIA GPU",
            architecture=_ARCHITECTURES.get(arch) if isinstance(arch, int) else None,
            numa_node=numa,
            bus_id=bus_id,
        )
        self._static[uuid] = static
        log.debug("GPU %s: %s, %s, NUMA node %s, PCI %s", uuid, static.name, static.architecture, numa, bus_id)
        return static

    def _memory(self, handle: Any) -> tuple[int, int | None]:
        variants = []
        if hasattr(pynvml, "nvmlMemory_v2"):
            # v2 leaves the driver's reserved memory out of "used".
            v2 = {"version": pynvml.nvmlMemory_v2}
            variants.append(("nvmlDeviceGetMemoryInfo_v2", "nvmlDeviceGetMemoryInfo", v2))
        variants.append(("nvmlDeviceGetMemoryInfo", "nvmlDeviceGetMemoryInfo", {}))
        outcome, info = self._probe(variants, handle)
        if outcome != _OK or info is None:
            raise _Unreadable(f"its memory size is unknown ({outcome})")
        used = getattr(info, "used", None)
        return int(info.total), int(used) if used is not None else None

    def _utilization(self, handle: Any) -> float | None:
        rates = self._query("nvmlDeviceGetUtilizationRates", handle)
        gpu = getattr(rates, "gpu", None)
        return float(gpu) if gpu is not None and 0 <= gpu <= 100 else None

    def _processes(self, uuid: str, handle: Any) -> tuple[GPUProcess, ...]:
        memory: dict[int, int | None] = {}
        for kind in ("Compute", "Graphics"):
            base = f"nvmlDeviceGet{kind}RunningProcesses"
            variants = [(f"{base}_v3", f"{base}_v3", {}), (f"{base}_v2", f"{base}_v2", {}), (base, base, {})]
            _, found = self._probe(variants, handle)
            for proc in found or ():
                pid = int(proc.pid)
                used = proc.usedGpuMemory
                used = int(used) if used is not None else None
                # A process with both a compute and a graphics context is listed twice.
                known = memory.get(pid)
                memory[pid] = used if known is None else max(known, used or 0)
        if not memory:
            return ()
        shares = self._process_utilization(uuid, handle)
        return tuple(
            GPUProcess(
                pid=pid,
                memory_used=used,
                # Samples exist for every process that ran kernels since the last reading, so a
                # listed process without one was idle: 0, not unknown.
                utilization=None if shares is None else shares.get(pid, 0.0),
            )
            for pid, used in sorted(memory.items())
        )

    def _process_utilization(self, uuid: str, handle: Any) -> dict[int, float] | None:
        """Peak SM share per pid since the last reading; ``None`` if the driver cannot tell."""
        now = int(time.time() * 1_000_000)
        since = self._sample_since.get(uuid, now - 1_000_000)
        variants = [
            ("nvmlDeviceGetProcessesUtilizationInfo", "nvmlDeviceGetProcessesUtilizationInfo", {}),
            ("nvmlDeviceGetProcessUtilization", "nvmlDeviceGetProcessUtilization", {}),
        ]
        outcome, samples = self._probe(variants, handle, since)
        if outcome not in (_OK, _NOTHING):
            return None
        self._sample_since[uuid] = now
        shares: dict[int, float] = {}
        for sample in samples or ():
            sm = int(sample.smUtil)
            if sm > 100:
                continue  # the driver's "no value" marker
            # The peak, not the mean: a kernel that computed at all in the window is not idle.
            shares[int(sample.pid)] = max(shares.get(int(sample.pid), 0.0), float(sm))
        return shares

    # -- topology ----------------------------------------------------------------------------

    def _update_topology(self, healthy: list[tuple[DeviceSnapshot, Any]]) -> None:
        # The wiring does not change while the host is up: work it out once per new set of GPUs.
        if all(snap.uuid in self._groups for snap, _ in healthy):
            return
        groups: dict[str, str | None] = {snap.uuid: None for snap, _ in healthy}
        index_of = {snap.uuid: snap.index for snap, _ in healthy}
        by_bus = {self._static[snap.uuid].bus_id: snap.uuid for snap, _ in healthy if self._static[snap.uuid].bus_id}

        links = _UnionFind()
        nvlinked: set[str] = set()
        for snap, handle in healthy:
            try:
                for peer in self._nvlink_peers(snap.uuid, handle, by_bus):
                    links.union(snap.uuid, peer)
                    nvlinked.add(snap.uuid)
                    if peer != _SWITCH:
                        nvlinked.add(peer)
            except DeviceLost as exc:
                log.warning("GPU %s stopped answering while reading its NVLinks: %s", snap.uuid, exc)
        self._name_groups(groups, links, nvlinked, index_of, "nvlink")

        pcie = _UnionFind()
        rest = [(snap, handle) for snap, handle in healthy if groups[snap.uuid] is None]
        pcie_linked: set[str] = set()
        for i, (a, ha) in enumerate(rest):
            for b, hb in rest[i + 1 :]:
                try:
                    level = self._query("nvmlDeviceGetTopologyCommonAncestor", ha, hb)
                except DeviceLost:
                    continue
                # At most a few PCIe switches apart, without crossing a host bridge.
                if isinstance(level, int) and level <= pynvml.NVML_TOPOLOGY_MULTIPLE:
                    pcie.union(a.uuid, b.uuid)
                    pcie_linked |= {a.uuid, b.uuid}
        self._name_groups(groups, pcie, pcie_linked, index_of, "pcie")

        self._groups.update(groups)
        for uuid, group in groups.items():
            log.debug("GPU %s: group %s", uuid, group)

    def _nvlink_peers(self, uuid: str, handle: Any, by_bus: dict[str, str]) -> list[str]:
        peers = []
        for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
            outcome, active = self._call("nvmlDeviceGetNvLinkState", handle, link)
            if outcome in (_MISSING, _UNSUPPORTED):
                break  # no NVLink on this GPU
            if outcome != _OK or not active:
                continue
            remote_type = self._query("nvmlDeviceGetNvLinkRemoteDeviceType", handle, link)
            if remote_type == getattr(pynvml, "NVML_NVLINK_DEVICE_TYPE_SWITCH", 2):
                peers.append(_SWITCH)  # every GPU on the NVSwitch fabric reaches every other
                continue
            remote = by_bus.get(_bus_id(self._query("nvmlDeviceGetNvLinkRemotePciInfo", handle, link)) or "")
            if remote is not None and remote != uuid:
                peers.append(remote)
        return peers

    @staticmethod
    def _name_groups(
        groups: dict[str, str | None], sets: _UnionFind, members: set[str], index_of: dict[str, int], kind: str
    ) -> None:
        components: dict[str, list[str]] = {}
        for uuid in members:
            components.setdefault(sets.find(uuid), []).append(uuid)
        for uuids in components.values():
            if len(uuids) < 2:
                continue  # a GPU alone on its link or switch is no group
            name = f"{kind}-{min(index_of[u] for u in uuids)}"
            for uuid in uuids:
                groups[uuid] = name


class _UnionFind:
    def __init__(self) -> None:
        self._parent: dict[str, str] = {}

    def find(self, item: str) -> str:
        parent = self._parent.setdefault(item, item)
        if parent != item:
            parent = self._parent[item] = self.find(parent)
        return parent

    def union(self, a: str, b: str) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self._parent[max(ra, rb)] = min(ra, rb)


def _as_lost(snap: DeviceSnapshot) -> DeviceSnapshot:
    return dataclasses.replace(snap, health=LOST, memory_used=None, utilization=None, processes=())
