"""The arbiter: core + ledger + devices + reclaim, driven by a reconcile loop.

:class:`Arbiter` is the one interface the REST handlers, the kernel provisioner and the events
websocket use. :class:`LocalArbiter` runs everything in this process (standalone mode, and inside
the hub broker); the hub client implements the same interface over HTTP.

Every decision comes from :func:`jupyter_gpusched.core.plan`, run inside one ledger transaction so
that several processes sharing a ledger never grant one GPU twice. The arbiter persists the plan,
then carries out what it decided: checkpoints, restores, restarts. Blocking work (NVML, SQLite,
checkpoints) runs in threads, off the event loop.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import os
import time
import uuid as uuidlib
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Mapping, Protocol

import psutil

from . import core
from .core import Capabilities, KernelActivity, Lease, LeaseState, SchedConfig, Step
from .devices.base import DeviceBackend, DeviceSnapshot, InventoryUnavailable
from . import procs
from .ledger import Checkpoint, Ledger, LedgerError, OwnerId, is_alive
from .reclaim.checkpoint import CheckpointError, Checkpointer, Unavailable
from .api.views import Principal, ViewContext, device_json, iso, lease_json, queue_json

log = logging.getLogger("jupyter_gpusched")

#: The longest a claim call waits for a grant before answering 202 with a position.
MAX_WAIT = 30.0


class ArbiterError(Exception):
    """A request that cannot be served; ``status`` is the HTTP status, ``message`` for a person."""

    status = 400
    reason = "Bad Request"

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status


class BadRequest(ArbiterError):
    status, reason = 400, "Bad Request"


class Forbidden(ArbiterError):
    status, reason = 403, "Forbidden"


class NotFound(ArbiterError):
    status, reason = 404, "Not Found"


class Conflict(ArbiterError):
    status, reason = 409, "Conflict"


class NoInventory(ArbiterError):
    status, reason = 503, "Service Unavailable"


@dataclass(frozen=True)
class ClaimResult:
    """The lease after a claim, and whether it was granted now (201), waits (202) or existed (200)."""

    status: int
    lease: dict


@dataclass(frozen=True)
class ArbiterEvent:
    """Something changed. The websocket shapes it for each viewer (see :mod:`views`)."""

    type: str  # "lease" | "device" | "notice"
    lease: Lease | None = None
    device: DeviceSnapshot | None = None
    notice: Mapping[str, Any] | None = None
    #: The event already shaped for this server's user (hub mode: the broker shapes it).
    payload: Mapping[str, Any] | None = None


class KernelHost(Protocol):
    """The kernels this arbiter can see and act on (a Jupyter server's kernel manager)."""

    server_id: str

    def activity(self) -> Mapping[str, tuple[bool, float | None, float | None]]:
        """Kernel id -> (executing now, last moment it executed, when that execution began)."""

    def alive(self, kernel_id: str) -> bool | None:
        """Whether the kernel still exists here (None: not a kernel of this host)."""

    def restarting(self, kernel_id: str) -> bool:
        """Whether the kernel is being restarted on purpose (its lease stays)."""

    def kernel_pid(self, kernel_id: str) -> int | None:
        """The kernel's main process."""

    def process_tree(self, kernel_id: str) -> set[int]:
        """The kernel's process and its descendants."""

    def notebook(self, kernel_id: str) -> str | None:
        """The notebook path of the kernel's session, where known."""

    def user_of(self, kernel_id: str) -> str | None:
        """The user a kernel belongs to, where this host knows it (None: unknown)."""

    async def restart(self, kernel_id: str) -> None: ...

    async def shutdown(self, kernel_id: str) -> None: ...


class Arbiter(abc.ABC):
    """What every front end of the scheduler talks to."""

    mode: str = "standalone"

    async def start(self) -> None:  # pragma: no cover - default no-op
        """Start background work."""

    async def stop(self) -> None:  # pragma: no cover - default no-op
        """Stop background work."""

    @abc.abstractmethod
    async def status(self, who: Principal) -> dict: ...

    @abc.abstractmethod
    async def devices(self, who: Principal) -> list[dict]: ...

    @abc.abstractmethod
    async def leases(self, who: Principal, kernel_id: str | None = None) -> list[dict]: ...

    @abc.abstractmethod
    async def lease(self, who: Principal, lease_id: str) -> dict: ...

    @abc.abstractmethod
    async def claim(
        self,
        who: Principal,
        kernel_id: str,
        count: int | None = None,
        memory: int | None = None,
        mode: str | None = None,
        priority: int = 0,
        wait: float = 0.0,
    ) -> ClaimResult: ...

    @abc.abstractmethod
    async def release(self, who: Principal, lease_id: str) -> None: ...

    @abc.abstractmethod
    async def keep(self, who: Principal, lease_id: str, seconds: float) -> dict: ...

    @abc.abstractmethod
    async def drain(self, who: Principal, uuid: str, drained: bool, reason: str = "") -> dict: ...

    @abc.abstractmethod
    async def kernel_ended(self, kernel_id: str, reason: str) -> None: ...

    @abc.abstractmethod
    async def kernel_started(self, kernel_id: str, user: str, pid: int | None) -> None: ...

    def subscribe(self, listener: Callable[[ArbiterEvent], None]) -> None:
        self._listeners().add(listener)

    def unsubscribe(self, listener: Callable[[ArbiterEvent], None]) -> None:
        self._listeners().discard(listener)

    def _listeners(self) -> set:
        if not hasattr(self, "_listener_set"):
            self._listener_set: set = set()
        return self._listener_set

    def publish(self, event: ArbiterEvent) -> None:
        for listener in list(self._listeners()):
            try:
                listener(event)
            except Exception:  # noqa: BLE001 - one bad listener must not stop the others
                log.exception("event listener failed")


@dataclass
class _State:
    """The last view of the world, for answering reads without touching the ledger."""

    snapshot: tuple[DeviceSnapshot, ...] = ()
    leases: tuple[Lease, ...] = ()
    queue: tuple[str, ...] = ()
    drained: Mapping[str, str] = field(default_factory=dict)
    process_kernels: dict[int, str] = field(default_factory=dict)
    unleased: tuple[dict, ...] = ()


class LocalArbiter(Arbiter):
    """Scheduling in this process: the ledger file, the GPUs of this host and its kernels."""

    def __init__(
        self,
        *,
        cfg: SchedConfig,
        ledger: Ledger,
        backend: DeviceBackend | None,
        checkpointer: Checkpointer | None = None,
        kernels: KernelHost | None = None,
        clock: Callable[[], float] = time.time,
        poll_interval: float = 2.0,
        backend_note: str = "",
        mode: str = "standalone",
        show_holders: bool = True,
        metrics: Any = None,
        unleased_processes: str = "report",
    ) -> None:
        self.cfg = cfg
        self.unleased_policy = unleased_processes
        self._unleased_seen: set[int] = set()
        self.ledger = ledger
        self.backend = backend
        self.checkpointer = checkpointer or Unavailable("no checkpointer configured")
        self.caps = Capabilities(
            checkpoint=self.checkpointer.available,
            checkpoint_reason=self.checkpointer.reason,
            remap=self.checkpointer.remap,
        )
        self.kernels = kernels
        self.server_id = kernels.server_id if kernels is not None else uuidlib.uuid4().hex
        self.clock = clock
        self.poll_interval = poll_interval
        self.backend_note = backend_note
        self.mode = mode
        self.show_holders = show_holders
        self.metrics = metrics
        self.state = _State()
        self._activity: dict[str, KernelActivity] = {}
        self._waiters: dict[str, asyncio.Event] = {}
        self._inflight: set[str] = set()
        self._restores: dict[str, asyncio.Task] = {}
        self._cache_asked: dict[str, float] = {}
        self._task: asyncio.Task | None = None
        self._tick_lock = asyncio.Lock()
        self._background: set[asyncio.Task] = set()
        self._tree_cache: dict[str, set[int]] = {}
        self._kernel_gaps: dict[str, tuple[float, ...]] = {}
        self._suspects: set[str] = set()

    # -- lifecycle -------------------------------------------------------------------------
    @property
    def backend_name(self) -> str:
        return self.backend.name if self.backend is not None else "none"

    async def start(self) -> None:
        await self.tick()
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        for task in list(self._background) + list(self._restores.values()):
            task.cancel()
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval)
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the loop must outlive one bad tick
                log.exception("GPU reconcile tick failed; trying again in %ss", self.poll_interval)

    # -- observing -------------------------------------------------------------------------
    async def _refresh_devices(self) -> tuple[DeviceSnapshot, ...]:
        if self.backend is None:
            return ()
        try:
            snap = await asyncio.to_thread(self.backend.snapshot)
        except InventoryUnavailable as exc:
            log.warning("GPU inventory unavailable this tick: %s", exc)
            return self.state.snapshot
        before = {d.uuid: d for d in self.state.snapshot}
        self.state.snapshot = snap
        for device in snap:
            old = before.get(device.uuid)
            if old is None or _device_changed(old, device):
                self.publish(ArbiterEvent("device", device=device))
            if old is not None and old.health != "lost" and device.health == "lost":
                log.warning("GPU %s (%s) was lost", device.index, device.uuid)
        return snap

    def _trees(self) -> dict[str, set[int]]:
        batch = getattr(self.kernels, "process_trees", None)
        if batch is not None:
            return batch()
        return {kid: self.kernels.process_tree(kid) for kid in self.kernels.activity()}

    def _observe(self, snap: Iterable[DeviceSnapshot], trees: Mapping[str, set[int]]) -> dict[str, KernelActivity]:
        """Kernel activity from the kernel host, with GPU use mapped through process trees."""
        if self.kernels is None:
            return {}
        now = self.clock()
        states = self.kernels.activity()
        self._tree_cache = dict(trees)
        pid_kernel: dict[int, str] = {}
        for kernel_id in states:
            for pid in trees.get(kernel_id, ()):
                pid_kernel[pid] = kernel_id
        memory: dict[str, int] = {}
        util: dict[str, float | None] = {}
        unleased = []
        held = {lease.kernel_id: set(lease.devices) for lease in self.state.leases if lease.holding}
        for device in snap:
            for proc in device.processes:
                kernel_id = pid_kernel.get(proc.pid)
                if kernel_id is None:
                    unleased.append({"pid": proc.pid, "device": device.uuid, "memory_used": proc.memory_used})
                    continue
                if device.uuid not in held.get(kernel_id, ()):
                    # A kernel of this host on a GPU it holds no lease for: reported, never counted
                    # as its lease's use (and never checkpointed with it).
                    unleased.append(
                        {"pid": proc.pid, "device": device.uuid, "memory_used": proc.memory_used, "kernel_id": kernel_id}
                    )
                    continue
                memory[kernel_id] = memory.get(kernel_id, 0) + (proc.memory_used or 0)
                if proc.utilization is not None:
                    util[kernel_id] = (util.get(kernel_id) or 0.0) + proc.utilization
                else:
                    util.setdefault(kernel_id, None)
        self.state.process_kernels = pid_kernel
        self.state.unleased = tuple(unleased)
        activity = {}
        for kernel_id, (busy, last_busy_at, started_at) in states.items():
            activity[kernel_id] = KernelActivity(
                kernel_id=kernel_id,
                busy=busy,
                last_busy_at=min(last_busy_at, now) if last_busy_at is not None else None,
                started_at=started_at,
                gpu_utilization=util.get(kernel_id),
                gpu_memory=memory.get(kernel_id, 0) if self.backend is not None else None,
            )
        self._activity = activity
        return activity

    # -- the reconcile tick ----------------------------------------------------------------
    async def tick(self) -> core.Plan:
        """Observe, plan in one transaction, persist, then carry out what was decided."""
        async with self._tick_lock:
            snap = await self._refresh_devices()
            refresh = getattr(self.kernels, "refresh_notebooks", None)
            if refresh is not None:
                await refresh()
            trees = await asyncio.to_thread(self._trees) if self.kernels is not None else {}
            activity = self._observe(snap, trees)
            plan, before, notices, _ = await asyncio.to_thread(self._plan_tx, activity, None)
            await self._after_plan(plan, before, notices)
            await self._finish_cache_requests()
            await self._restore_orphans()
            if self.unleased_policy == "kill":
                for notice in await asyncio.to_thread(self._kill_unleased):
                    self.publish(ArbiterEvent("notice", notice=notice))
            return plan

    async def replan(self) -> core.Plan:
        """A scheduling pass on what the last tick saw (after a release, say): no device scan."""
        async with self._tick_lock:
            plan, before, notices, _ = await asyncio.to_thread(self._plan_tx, self._activity, None)
            await self._after_plan(plan, before, notices)
            return plan

    def _devices(self, drained: Mapping[str, str]) -> list[core.Device]:
        return [d.to_core(drained=d.uuid in drained) for d in self.state.snapshot]

    def _plan_tx(
        self,
        activity: Mapping[str, KernelActivity],
        change: Callable[[Any, list[Lease], list[core.Device]], Any] | None,
    ) -> tuple[core.Plan, dict[str, Lease], list[dict], Any]:
        """One transaction: reap the dead, apply ``change`` (a claim, say), plan, persist."""
        notices: list[dict | ArbiterEvent] = []
        with self.ledger.transaction(self.clock()) as tx:
            now = tx.now
            drained = tx.drained()
            devices = self._devices(drained)
            leases = tx.leases()
            before = {lease.id: lease for lease in leases}
            leases = self._reap(tx, leases, now, devices, notices)
            leases = self._resume_running(tx, leases, activity, now)
            outcome = change(tx, leases, devices) if change is not None else None
            if outcome is not None:
                leases = tx.leases()
            plan = core.plan(devices, leases, activity, now, self.cfg, self.caps)
            for lease_id in plan.changed:
                tx.put(plan.lease(lease_id))
            self._own_new_kernels(tx, plan.leases)
            all_live = list(plan.leases)
            self.state.leases = tuple(all_live)
            self.state.queue = plan.queue
            self.state.drained = dict(drained)
        return plan, before, notices, outcome

    def _reap(self, tx, leases: list[Lease], now: float, devices, notices: list[dict | ArbiterEvent]) -> list[Lease]:
        """Release leases whose kernels are gone and leases on lost GPUs."""
        owners = tx.owners()
        lost = {d.uuid: d for d in devices if d.health == core.Health.LOST}
        out = []
        suspects: set[str] = set()
        for lease in leases:
            owner = owners.get(lease.id)
            gone: str | None = None
            ours = self.kernels is not None and (owner is None or owner.server_id == self.server_id)
            if ours and self.kernels.restarting(lease.kernel_id):
                pass  # a deliberate restart keeps the lease; the new process takes it over
            elif ours and self.kernels.alive(lease.kernel_id) is False:
                gone = "the kernel has shut down"
            elif owner is not None and not is_alive(owner):
                # A kernel of ours whose process just exited may be in a deliberate restart that
                # this tick raced with: it is released only if still gone at the next tick.
                if not ours or lease.id in self._suspects:
                    gone = f"the kernel's process {owner.process.pid} is gone"
                else:
                    suspects.add(lease.id)
            if gone is not None:
                done = core.released(lease, now, f"released: {gone}")
                tx.put(done)
                self._remember(done)
                log.info("lease %s of kernel %s released: %s", lease.id, lease.kernel_id, gone)
                # This runs in a worker thread: the event is published on the loop, after the plan.
                notices.append(ArbiterEvent("lease", lease=done))
                continue
            on_lost = [u for u in lease.devices if u in lost]
            if on_lost and lease.holding:
                device = lost[on_lost[0]]
                done = core.device_lost(lease, device.uuid, device.index, now)
                tx.put(done)
                log.warning("lease %s of kernel %s: GPU %s lost", lease.id, lease.kernel_id, device.uuid)
                notices.append(
                    {"kind": "lost", "lease_id": lease.id, "kernel_id": lease.kernel_id, "message": done.reason}
                )
                continue
            out.append(lease)
        self._suspects = suspects
        return out

    def _resume_running(self, tx, leases: list[Lease], activity: Mapping[str, KernelActivity], now: float) -> list[Lease]:
        """A suspended kernel that runs code anyway (a cell the agent did not see) is restored."""
        out = []
        for lease in leases:
            seen = activity.get(lease.kernel_id)
            if lease.state == LeaseState.SUSPENDED and seen is not None and seen.busy:
                lease = core.request_resume(lease, now)
                tx.put(lease)
                log.info("lease %s of kernel %s: the kernel runs while suspended; restoring", lease.id, lease.kernel_id)
            out.append(lease)
        return out

    def _own_new_kernels(self, tx, leases: Iterable[Lease]) -> None:
        """Let the kernel's own process own its lease once it runs (it outlives this server)."""
        if self.kernels is None:
            return
        owners = tx.owners()
        for lease in leases:
            owner = owners.get(lease.id)
            if owner is None or owner.server_id != self.server_id:
                continue
            pid = self.kernels.kernel_pid(lease.kernel_id)
            if pid is None or owner.process.pid == pid:
                continue
            try:
                process = OwnerId.of_pid(pid)
            except Exception:  # noqa: BLE001 - the kernel may be exiting right now
                continue
            tx.set_owner(lease.id, lease.kernel_id, self.server_id, process)
            adopted = getattr(self.kernels, "adopted", None)
            if adopted is not None:
                adopted(lease.kernel_id)

    async def _after_plan(self, plan: core.Plan, before: Mapping[str, Lease], notices: list[dict | ArbiterEvent]) -> None:
        now = self.clock()
        for decision in plan.decisions:
            lease = decision.lease
            old = before.get(lease.id)
            if decision.kind == "grant":
                waited = now - (old.queued_at if old else lease.queued_at)
                log.info(
                    "lease %s of kernel %s (%s) %s %s after %.1fs in the queue (%s)",
                    lease.id,
                    lease.kernel_id,
                    lease.user,
                    "restoring onto" if lease.home else "granted",
                    _gpus(lease, self.state.snapshot),
                    waited,
                    decision.reason,
                )
                if self.metrics is not None:
                    self.metrics.waited(waited)
                if lease.home and self._mine(lease):
                    self._restores[lease.id] = asyncio.create_task(self._restore(lease))
                else:
                    notices.append(_notice("granted", lease, f"Granted {_gpus(lease, self.state.snapshot)}"))
            elif decision.kind == "notice":
                log.info(
                    "lease %s of kernel %s: reclaim announced for %s: %s",
                    lease.id,
                    lease.kernel_id,
                    lease.reclaim_at,
                    decision.reason,
                )
                notices.append(_notice("reclaim_warning", lease, decision.reason))
            elif decision.kind == "cancel":
                log.info("lease %s of kernel %s: %s", lease.id, lease.kernel_id, decision.reason)
                notices.append(_notice("reclaim_cancelled", lease, decision.reason))
            elif decision.kind == "idle":
                log.debug("lease %s of kernel %s: %s", lease.id, lease.kernel_id, decision.reason)
            elif decision.kind == "queue" and (old is None or old.state != LeaseState.PENDING):
                notice = _notice("queued", lease, lease.reason)
                if decision.position is not None:
                    notice["position"] = decision.position
                log.info(
                    "lease %s of kernel %s (%s) queued at position %s: %s",
                    lease.id, lease.kernel_id, lease.user, decision.position, lease.reason,
                )
                notices.append(notice)
        # A claim written in this pass's transaction is already pending when the core plans, so
        # the plan neither lists it as changed nor decides to queue it: tell viewers here.
        decided = {d.lease.id for d in plan.decisions}
        changed = list(plan.changed)
        for lease in plan.leases:
            if lease.id in before or lease.id in plan.changed:
                continue
            changed.append(lease.id)
            if lease.state == LeaseState.PENDING and lease.id not in decided:
                notice = _notice("queued", lease, lease.reason)
                if lease.id in plan.queue:
                    notice["position"] = plan.queue.index(lease.id) + 1
                log.info(
                    "lease %s of kernel %s (%s) queued at position %s: %s",
                    lease.id, lease.kernel_id, lease.user, notice.get("position"), lease.reason,
                )
                notices.append(notice)
        for lease_id in changed:
            lease = plan.lease(lease_id)
            self.publish(ArbiterEvent("lease", lease=lease))
            if lease is not None and lease.state != LeaseState.PENDING:
                self._wake(lease_id)
        for notice in notices:
            self.publish(notice if isinstance(notice, ArbiterEvent) else ArbiterEvent("notice", notice=notice))
        self._carry_out_due(plan.leases)
        if self.metrics is not None:
            self.metrics.update(self.state.snapshot, plan.leases, plan.queue)

    def _mine(self, lease: Lease) -> bool:
        return self.kernels is not None and self.kernels.alive(lease.kernel_id) is not None

    def _wake(self, lease_id: str) -> None:
        event = self._waiters.get(lease_id)
        if event is not None:
            event.set()

    # -- carrying out reclaims -------------------------------------------------------------
    def _carry_out_due(self, leases: Iterable[Lease]) -> None:
        now = self.clock()
        for lease in leases:
            if lease.state != LeaseState.RECLAIMING or lease.reclaim_step is None:
                continue
            if lease.reclaim_at is not None and lease.reclaim_at > now:
                continue
            if lease.id in self._inflight or not self._mine(lease):
                continue
            self._inflight.add(lease.id)
            task = asyncio.create_task(self._carry_out(lease))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _update(self, lease: Lease, fn: Callable[[Lease, float], Lease | None]) -> Lease | None:
        """Re-read ``lease`` under the write lock and write ``fn(lease)`` if it still applies."""

        def run() -> Lease | None:
            with self.ledger.transaction(self.clock()) as tx:
                current = tx.lease(lease.id)
                if current is None:
                    return None
                new = fn(current, tx.now)
                if new is None or new == current:
                    return None
                if new.version <= current.version:
                    new = replace(new, version=current.version + 1)
                tx.put(new)
                return new

        new = await asyncio.to_thread(run)
        self._remember(new)
        if new is not None:
            self.state.leases = tuple(new if le.id == new.id else le for le in self.state.leases if new.live or le.id != new.id)
            self.publish(ArbiterEvent("lease", lease=new))
            self._wake(new.id)
        return new

    def _gpu_pids(self, lease: Lease) -> list[int]:
        """The kernel's processes that use the lease's own GPUs: the only ones a reclaim touches.

        The kernel's process tree is what the kernel host found (in hub mode, checked to descend
        from its user's server); a process elsewhere, or on another GPU, is never acted on.
        """
        tree = self._tree_cache.get(lease.kernel_id) or (
            self.kernels.process_tree(lease.kernel_id) if self.kernels else set()
        )
        pids = []
        for device in self.state.snapshot:
            if device.uuid in lease.devices:
                pids.extend(p.pid for p in device.processes if p.pid in tree)
        return sorted(set(pids))

    async def _carry_out(self, lease: Lease) -> None:
        step = lease.reclaim_step
        try:
            still = lambda cur, now: cur.state == LeaseState.RECLAIMING and cur.reclaim_step == step  # noqa: E731
            if step == Step.RELEASE:
                why = "released while idle: the kernel held no GPU memory; its next cell asks again"
                done = await self._update(lease, lambda cur, now: core.released(cur, now, why) if still(cur, now) else None)
                if done is not None:
                    self._reclaimed(done, step, "released", why, lease.devices)
            elif step == Step.CHECKPOINT:
                await self._checkpoint(lease, still)
            elif step == Step.FREE_CACHE:
                self._cache_asked[lease.id] = self.clock()
                self.publish(ArbiterEvent("notice", notice=_notice("free_cache", lease, lease.reason)))
            elif step in (Step.RESTART, Step.SHUTDOWN):
                verb = "restarted" if step == Step.RESTART else "shut down"
                why = f"reclaimed: the kernel was {verb} to free its GPU: {lease.reason}"
                done = await self._update(lease, lambda cur, now: core.released(cur, now, why) if still(cur, now) else None)
                if done is None:
                    return
                self._reclaimed(done, step, "reclaimed", why, lease.devices)
                if self.kernels is not None:
                    if step == Step.RESTART:
                        await self.kernels.restart(lease.kernel_id)
                    else:
                        await self.kernels.shutdown(lease.kernel_id)
        except Exception:  # noqa: BLE001 - one failed reclaim must not stop the loop
            log.exception("lease %s of kernel %s: %s failed", lease.id, lease.kernel_id, step)
        finally:
            self._inflight.discard(lease.id)

    async def _checkpoint(self, lease: Lease, still) -> None:
        pids = self._gpu_pids(lease)
        if not pids:
            # Nothing of the kernel's on its GPUs (its memory went since the pass): nothing to keep.
            why = "released while idle: the kernel held no GPU memory; its next cell asks again"
            done = await self._update(lease, lambda cur, now: core.released(cur, now, why) if still(cur, now) else None)
            if done is not None:
                self._reclaimed(done, Step.RELEASE, "released", why, lease.devices)
            return
        held = lease.memory_held
        taken: list[Checkpoint] = []
        try:
            moved_total = 0
            for pid in pids:
                started = procs.started(pid)
                if started is None:
                    continue
                moved = await asyncio.to_thread(self.checkpointer.checkpoint, pid)
                moved_total += moved or 0
                record = Checkpoint(pid, started, lease.id, lease.kernel_id, tuple(lease.devices), moved, self.clock())
                await asyncio.to_thread(self._record_checkpoint, record)
                taken.append(record)
        except CheckpointError as exc:
            why = str(exc)
            log.warning("lease %s of kernel %s: checkpoint failed: %s", lease.id, lease.kernel_id, why)
            for record in taken:  # put back what was already taken: all or nothing
                await self._restore_one(record, None, lease)
            await self._update(lease, lambda cur, now: core.step_failed(cur, Step.CHECKPOINT, why))
            return
        memory = moved_total or held
        done = await self._update(
            lease, lambda cur, now: core.suspended(cur, now, memory) if still(cur, now) else None
        )
        if done is None:
            # The lease changed under us (released meanwhile): put the state back where it was.
            for record in taken:
                await self._restore_one(record, None, lease)
            return
        log.info(
            "lease %s of kernel %s suspended: GPU state of pids %s checkpointed (%s) from %s",
            lease.id,
            lease.kernel_id,
            [r.pid for r in taken],
            core.format_bytes(memory),
            ",".join(lease.devices),
        )
        self._reclaimed(done, Step.CHECKPOINT, "suspended", done.reason)

    def _record_checkpoint(self, record: Checkpoint) -> None:
        with self.ledger.transaction(self.clock()) as tx:
            tx.add_checkpoint(record)

    def _drop_checkpoint(self, record: Checkpoint) -> None:
        with self.ledger.transaction(self.clock()) as tx:
            tx.drop_checkpoint(record.pid, record.create_time)

    async def _restore_one(self, record: Checkpoint, device_map: Mapping[str, str] | None, lease: Lease) -> bool:
        """Restore one checkpointed process (if it still runs) and forget its checkpoint.

        Returns False if the restore failed; the checkpoint is forgotten either way, as the driver
        gives no second try (the process's GPU state is lost then, and the log says so).
        """
        try:
            if procs.same_process(record.pid, record.create_time):
                await asyncio.to_thread(self.checkpointer.restore, record.pid, device_map)
            return True
        except CheckpointError as exc:
            log.error(
                "lease %s of kernel %s: restoring pid %s failed, its GPU state is lost: %s",
                lease.id, lease.kernel_id, record.pid, exc,
            )
            return False
        finally:
            await asyncio.to_thread(self._drop_checkpoint, record)

    async def _restore_orphans(self) -> None:
        """Every checkpoint this ledger took is restored, whatever became of its lease.

        A suspended lease's processes wait for their kernel's next cell. Any other checkpoint
        (its lease released by the user, by a disconnect or a crash, or the arbiter restarted
        halfway) is restored now, onto the GPU it came from, if its process still runs.
        """
        records = await asyncio.to_thread(self.ledger.checkpoints)
        if not records:
            return
        live = {lease.id: lease for lease in self.state.leases}
        for record in records:
            lease = live.get(record.lease_id)
            waiting = lease is not None and (
                lease.state == LeaseState.SUSPENDED or (lease.home and lease.state == LeaseState.PENDING)
            )
            if waiting or record.lease_id in self._restores or record.lease_id in self._inflight:
                continue
            gone = self._find_quiet(record.lease_id)
            ok = await self._restore_one(record, None, gone or lease or _placeholder(record))
            if ok and procs.same_process(record.pid, record.create_time):
                log.warning(
                    "lease %s of kernel %s is no longer suspended: restored pid %s onto %s so that it is not left frozen",
                    record.lease_id, record.kernel_id, record.pid, ",".join(record.devices),
                )

    def _find_quiet(self, lease_id: str) -> Lease | None:
        try:
            return self._find(lease_id)
        except NotFound:
            return None

    def _reclaimed(self, lease: Lease, step: Step, kind: str, message: str, devices: Iterable[str] = ()) -> None:
        devices = ",".join(devices) or ",".join(lease.home) or "-"
        log.info("reclaim: lease %s of kernel %s: %s from %s: %s", lease.id, lease.kernel_id, step.value, devices, message)
        if self.metrics is not None:
            self.metrics.reclaimed(step.value)
        self.publish(ArbiterEvent("notice", notice=_notice(kind, lease, message)))

    async def _restore(self, lease: Lease) -> None:
        device_map = dict(zip(lease.home, lease.devices))
        records = await asyncio.to_thread(self.ledger.checkpoints, lease.id)
        failed = []
        try:
            for record in records:
                if not await self._restore_one(record, device_map, lease):
                    failed.append(record.pid)
        finally:
            self._restores.pop(lease.id, None)
        if failed:
            why = f"restore failed, the kernel's GPU state is lost (pids {failed})"
            log.error("lease %s of kernel %s: %s", lease.id, lease.kernel_id, why)
            await self._update(lease, lambda cur, now: core.released(cur, now, why))
            self.publish(ArbiterEvent("notice", notice=_notice("lost", lease, why)))
        else:
            log.info(
                "lease %s of kernel %s restored onto %s (pids %s)",
                lease.id,
                lease.kernel_id,
                ",".join(lease.devices),
                [r.pid for r in records],
            )
            self.publish(ArbiterEvent("notice", notice=_notice("resumed", lease, lease.reason)))
        self._wake(lease.id)

    async def _finish_cache_requests(self) -> None:
        now = self.clock()
        for lease_id, asked in list(self._cache_asked.items()):
            if now - asked < 2 * self.poll_interval:
                continue
            del self._cache_asked[lease_id]
            lease = next((le for le in self.state.leases if le.id == lease_id), None)
            if lease is not None:
                await self._update(
                    lease, lambda cur, now: core.step_done(cur, Step.FREE_CACHE, "framework caches dropped")
                )

    def _kill_unleased(self) -> list[dict]:
        """Enforcement: end GPU processes of this Unix user that no lease covers.

        Only processes that the inventory lists on a GPU this tick, that belong to this server's
        Unix user, and that are not inside the process tree of any live lease's kernel (kernels
        of other servers on the same ledger included) are ended, and only when seen so at two
        ticks in a row (a kernel may be between its grant and this tick's view). A kernel of this
        server that uses a GPU it holds no lease for is told first, in its notebook; its process
        on that GPU is ended at the next tick if it is still there. Returns the notices to send.
        """
        notices: list[dict] = []
        foreign = {item["pid"] for item in self.state.unleased if not item.get("kernel_id")}
        outside = {item["pid"]: item for item in self.state.unleased if item.get("kernel_id")}
        if not foreign and not outside:
            self._unleased_seen = set()
            return notices
        protected: set[int] = set()
        live = {lease.id for lease in self.state.leases}
        owner_roots = [owner.process.pid for lease_id, owner in self.ledger.owners().items() if lease_id in live]
        leased_kernels = {lease.kernel_id for lease in self.state.leases}
        for kernel_id, tree in self._tree_cache.items():
            if kernel_id in leased_kernels:
                protected |= tree
        if owner_roots:
            for tree in procs.process_trees(dict(enumerate(owner_roots))).values():
                protected |= tree
        me = os.getpid()
        suspects = {pid for pid in foreign - protected if pid != me and not procs.descends_from(me, pid)}
        suspects |= {pid for pid in outside if pid != me}
        due = suspects & self._unleased_seen
        self._unleased_seen = suspects
        for pid in sorted(suspects - due):
            item = outside.get(pid)
            if item is None:
                continue
            gpu = next((d.index for d in self.state.snapshot if d.uuid == item["device"]), item["device"])
            notices.append(
                {
                    "kind": "outside_lease",
                    "lease_id": None,
                    "kernel_id": item["kernel_id"],
                    "user": "",
                    "message": (
                        f"Process {pid} of this kernel uses GPU {gpu}, which the kernel holds no lease for: "
                        "it will be ended at the next check (unleased_processes = 'kill'). "
                        "Ask for that GPU with %gpu acquire instead."
                    ),
                    "reclaim_at": None,
                    "state": None,
                }
            )
            log.warning(
                "kernel %s: process %s uses GPU %s outside its lease; told the kernel, ending it at the next check",
                item["kernel_id"], pid, item["device"],
            )
        for pid in sorted(due):
            if pid not in {item["pid"] for item in self.state.unleased}:
                continue  # no longer on a GPU
            try:
                proc = psutil.Process(pid)
                if proc.uids().real != os.getuid():
                    continue
                proc.terminate()
            except psutil.Error:
                continue
            why = "it uses a GPU outside its kernel's lease" if pid in outside else "it holds GPU memory without a lease"
            log.warning("ended GPU process %s: %s (unleased_processes = 'kill')", pid, why)
        return notices

    # -- reads -----------------------------------------------------------------------------
    def view_context(self) -> ViewContext:
        notebooks = {}
        if self.kernels is not None:
            for lease in self.state.leases:
                name = self.kernels.notebook(lease.kernel_id)
                if name:
                    notebooks[lease.kernel_id] = name
        positions = {lid: i for i, lid in enumerate(self.state.queue, start=1)}
        kernel_users = {lease.kernel_id: lease.user for lease in self.state.leases}
        if self.kernels is not None:
            for kernel_id in set(self.state.process_kernels.values()) - set(kernel_users):
                user = self.kernels.user_of(kernel_id)
                if user is not None:
                    kernel_users[kernel_id] = user
        return ViewContext(
            now=self.clock(),
            positions=positions,
            notebooks=notebooks,
            drained=self.state.drained,
            process_kernels=self.state.process_kernels,
            kernel_users=kernel_users,
            cfg=self.cfg,
            leases=self.state.leases,
            caps=self.caps,
            devices=self._devices(self.state.drained),
        )

    def _index_of(self) -> dict[str, int]:
        return {d.uuid: d.index for d in self.state.snapshot}

    def _need_inventory(self) -> None:
        if self.backend is None:
            raise NoInventory(
                f"no GPU inventory on this server ({self.backend_note or 'no backend'}); "
                "set c.GPUSchedApp.backend = 'simulated' to try it without GPUs"
            )

    def render_lease(self, lease: Lease, who: Principal, ctx: ViewContext | None = None) -> dict:
        return lease_json(lease, self._viewer(who), ctx or self.view_context(), self._index_of())

    def render_device(self, device: DeviceSnapshot, who: Principal, ctx: ViewContext | None = None) -> dict:
        return device_json(device, self.state.leases, self._viewer(who), ctx or self.view_context())

    def _viewer(self, who: Principal) -> Principal:
        if who.show_holders == self.show_holders:
            return who
        return replace(who, show_holders=self.show_holders)

    async def status(self, who: Principal) -> dict:
        ctx = self.view_context()
        by_id = {lease.id: lease for lease in self.state.leases}
        queue = [by_id[lid] for lid in self.state.queue if lid in by_id]
        viewer = self._viewer(who)
        return {
            "mode": self.mode,
            "backend": self.backend_name,
            "backend_note": self.backend_note,
            "policy": self.cfg.policy,
            "user": who.user,
            "is_admin": who.admin,
            "checkpoint": {"available": self.caps.checkpoint, "reason": self.caps.checkpoint_reason},
            "devices": [self.render_device(d, viewer, ctx) for d in self.state.snapshot],
            "leases": [self.render_lease(le, viewer, ctx) for le in self.state.leases],
            "queue": queue_json(queue, viewer),
            "unleased_processes": list(self.state.unleased) if who.admin else [],
            "config": {
                "idle_timeout": self.cfg.idle_timeout,
                "contended_idle_timeout": self.cfg.contended_idle_timeout,
                "release_timeout": self.cfg.release_timeout,
                "grace_period": self.cfg.grace_period,
                "reclaim_fallback": self.cfg.reclaim_fallback,
                "max_keep": self.cfg.max_keep,
                "poll_interval": self.poll_interval,
            },
            "time": iso(ctx.now),
        }

    async def devices(self, who: Principal) -> list[dict]:
        ctx = self.view_context()
        return [self.render_device(d, who, ctx) for d in self.state.snapshot]

    async def leases(self, who: Principal, kernel_id: str | None = None) -> list[dict]:
        ctx = self.view_context()
        viewer = self._viewer(who)
        out = []
        for lease in self.state.leases:
            if kernel_id is not None and (lease.kernel_id != kernel_id or not viewer.sees(lease)):
                continue
            out.append(self.render_lease(lease, viewer, ctx))
        return out

    def _find(self, lease_id: str) -> Lease:
        for lease in self.state.leases:
            if lease.id == lease_id:
                return lease
        found = self.ledger.lease(lease_id)
        if found is None:
            raise NotFound(f"no lease {lease_id!r}")
        return found

    async def lease(self, who: Principal, lease_id: str) -> dict:
        lease = self._find(lease_id)
        if who.kernel_id is not None and lease.kernel_id != who.kernel_id:
            raise Forbidden("a kernel's token can only read that kernel's own lease")
        return self.render_lease(lease, who)

    # -- writes ----------------------------------------------------------------------------
    async def claim(
        self,
        who: Principal,
        kernel_id: str,
        count: int | None = None,
        memory: int | None = None,
        mode: str | None = None,
        priority: int = 0,
        wait: float = 0.0,
    ) -> ClaimResult:
        if who.kernel_id is not None and who.kernel_id != kernel_id:
            raise Forbidden("a kernel's token can only ask for that kernel's own lease")
        self._need_inventory()
        if self.kernels is not None and not self.kernels.alive(kernel_id):
            raise NotFound(f"no running kernel {kernel_id!r} on this server")
        owner_pid = self.kernels.kernel_pid(kernel_id) if self.kernels is not None else None

        def change(tx, leases: list[Lease], devices: list[core.Device]):
            now = tx.now
            mine = [le for le in leases if le.kernel_id == kernel_id and le.live]
            if mine:
                lease = mine[0]
                if lease.user != who.user and not who.admin:
                    raise Forbidden(f"kernel {kernel_id} belongs to another user")
                asked = (count, memory, mode)
                have = (lease.count, lease.memory, lease.mode)
                if any(a is not None and a != h for a, h in zip(asked, have)):
                    index = {d.uuid: d.index for d in self.state.snapshot}
                    held = sorted(index[u] for u in lease.devices if u in index)
                    label = (
                        f"GPU{'s' if len(held) > 1 else ''} {', '.join(map(str, held))}" if held
                        else f"a claim for {lease.count} GPU(s)"
                    )
                    raise Conflict(
                        f"this kernel already holds {label} ({lease.mode}, {lease.state.value}); release it "
                        "first (`%gpu release`) to ask for a different one"
                    )
                if lease.state == LeaseState.SUSPENDED:
                    tx.put(core.request_resume(lease, now))
                    return ("resume", lease.id)
                if lease.holding:
                    tx.put(core.touch(lease, now))
                    return ("existing", lease.id)
                return ("pending", lease.id)
            claim = core.new_claim(
                uuidlib.uuid4().hex,
                kernel_id,
                who.user,
                now,
                count=1 if count is None else count,
                memory=memory,
                mode=mode or core.EXCLUSIVE,
                priority=priority,
                groups=who.groups,
                gaps=self._history(kernel_id),
            )
            core.admit(claim, devices, leases, self.cfg)
            tx.put(claim)
            process = None
            if owner_pid is not None:
                try:
                    process = OwnerId.of_pid(owner_pid)
                except Exception:  # noqa: BLE001 - fall back to this server owning it
                    process = None
            tx.set_owner(claim.id, kernel_id, self.server_id, process)
            log.info(
                "lease %s: kernel %s (%s) asks for %s GPU(s)%s, %s",
                claim.id,
                kernel_id,
                who.user,
                claim.count,
                f" with {core.format_bytes(memory)} each" if memory else "",
                claim.mode,
            )
            return ("new", claim.id)

        async with self._tick_lock:
            try:
                plan, before, notices, outcome = await asyncio.to_thread(self._plan_tx, self._activity, change)
            except core.ConflictError as exc:
                raise Conflict(str(exc)) from exc
            except core.SchedulingError as exc:
                if "no GPUs" in str(exc) or "drained or lost" in str(exc):
                    raise NoInventory(str(exc)) from exc
                raise BadRequest(str(exc)) from exc
            except LedgerError as exc:
                raise ArbiterError(str(exc), 503) from exc
            await self._after_plan(plan, before, notices)
        how, lease_id = outcome
        return await self._answer(who, lease_id, how, wait)

    def _history(self, kernel_id: str) -> tuple[float, ...]:
        """Idle spells of the kernel's earlier lease, so that learning survives a release."""
        return self._kernel_gaps.get(kernel_id, ())

    def _remember(self, lease: Lease | None) -> None:
        if lease is not None and lease.gaps and not lease.live:
            self._kernel_gaps[lease.kernel_id] = lease.gaps

    async def _answer(self, who: Principal, lease_id: str, how: str, wait: float) -> ClaimResult:
        wait = max(0.0, min(float(wait or 0.0), MAX_WAIT))
        deadline = time.monotonic() + wait
        while True:
            restore = self._restores.get(lease_id)
            if restore is not None:
                await asyncio.wait({restore}, timeout=max(0.0, deadline - time.monotonic()) or None)
            lease = self._find(lease_id)
            if lease.holding and lease_id not in self._restores:
                status = 200 if how == "existing" else 201
                return ClaimResult(status, self.render_lease(lease, who))
            if not lease.live:
                raise Conflict(f"lease {lease_id} was released: {lease.reason}")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return ClaimResult(202, self.render_lease(lease, who))
            event = self._waiters.setdefault(lease_id, asyncio.Event())
            event.clear()
            try:
                await asyncio.wait_for(event.wait(), timeout=remaining)
            except asyncio.TimeoutError:
                pass

    def _own(self, who: Principal, lease_id: str) -> Lease:
        lease = self._find(lease_id)
        if not who.owns(lease):
            if who.kernel_id is not None:
                raise Forbidden("a kernel's token can only act on that kernel's own lease")
            raise Forbidden(f"lease {lease_id} belongs to another user")
        return lease

    async def release(self, who: Principal, lease_id: str) -> None:
        lease = self._own(who, lease_id)
        by = f"kernel {who.kernel_id}" if who.kernel_id else who.user
        why = f"released by {by}"
        if not lease.live:
            return
        done = await self._update(lease, lambda cur, now: core.released(cur, now, why))
        if done is not None:
            log.info("lease %s of kernel %s %s", lease.id, lease.kernel_id, why)
            if who.kernel_id is None and lease.user != who.user:
                self.publish(ArbiterEvent("notice", notice=_notice("released", done, f"Your GPU lease was {why}")))
        await self.replan()

    async def keep(self, who: Principal, lease_id: str, seconds: float) -> dict:
        lease = self._own(who, lease_id)
        try:
            core.keep(lease, seconds, self.clock(), self.cfg)  # validate before writing
        except core.ConflictError as exc:
            raise Conflict(str(exc)) from exc
        except core.SchedulingError as exc:
            raise BadRequest(str(exc)) from exc
        done = await self._update(lease, lambda cur, now: core.keep(cur, seconds, now, self.cfg))
        lease = done or self._find(lease_id)
        log.info("lease %s of kernel %s kept for %ss by %s", lease.id, lease.kernel_id, seconds, who.user)
        if done is not None and lease.keep_until is not None:
            self.publish(ArbiterEvent("notice", notice=_notice("kept", lease, f"Kept for {core.format_duration(seconds)}")))
        return self.render_lease(lease, who)

    async def cache_freed(self, who: Principal, lease_id: str, frameworks: tuple[str, ...]) -> dict:
        """The kernel dropped its framework caches, as the ``free-cache`` step asked."""
        lease = self._own(who, lease_id)
        if lease.state != LeaseState.RECLAIMING or lease.reclaim_step != Step.FREE_CACHE:
            raise Conflict(f"lease {lease_id} is not asked to free its caches (it is {lease.state.value})")
        self._cache_asked.pop(lease.id, None)
        why = (
            f"framework caches dropped ({', '.join(frameworks)})" if frameworks
            else "the kernel had no framework cache to drop"
        )
        log.info("lease %s of kernel %s: %s", lease.id, lease.kernel_id, why)
        done = await self._update(
            lease,
            lambda cur, now: core.step_done(cur, Step.FREE_CACHE, why)
            if cur.state == LeaseState.RECLAIMING and cur.reclaim_step == Step.FREE_CACHE else None,
        )
        return self.render_lease(done or self._find(lease_id), who)

    async def drain(self, who: Principal, uuid: str, drained: bool, reason: str = "") -> dict:
        if not who.admin:
            raise Forbidden("only an administrator can drain or undrain a GPU")
        device = next((d for d in self.state.snapshot if d.uuid == uuid), None)
        if device is None:
            raise NotFound(f"no GPU with uuid {uuid!r} on this host")

        def run() -> None:
            with self.ledger.transaction(self.clock()) as tx:
                tx.set_drained(uuid, drained, reason or f"by {who.user}")

        await asyncio.to_thread(run)
        log.info("GPU %s (%s) %s by %s", device.index, uuid, "drained" if drained else "undrained", who.user)
        await self.replan()
        return self.render_device(device, who)

    async def kernel_started(self, kernel_id: str, user: str, pid: int | None) -> None:
        """A kernel process now runs: hand its leases to it (they survive this server)."""
        await self.replan()

    async def kernel_ended(self, kernel_id: str, reason: str) -> None:
        leases = [le for le in self.state.leases if le.kernel_id == kernel_id and le.live]
        for lease in leases:
            done = await self._update(lease, lambda cur, now: core.released(cur, now, f"released: {reason}"))
            if done is not None:
                log.info("lease %s of kernel %s released: %s", lease.id, kernel_id, reason)

    async def lease_for_kernel(self, kernel_id: str) -> Lease | None:
        for lease in self.state.leases:
            if lease.kernel_id == kernel_id and lease.live:
                return lease
        return None


def _device_changed(old: DeviceSnapshot, new: DeviceSnapshot) -> bool:
    """Changes worth telling the browser about (not every percent of utilization)."""
    def coarse(d: DeviceSnapshot):
        return (
            d.health,
            None if d.utilization is None else round(d.utilization / 5),
            None if d.memory_used is None else d.memory_used >> 26,
            tuple(sorted(p.pid for p in d.processes)),
        )

    return coarse(old) != coarse(new)


def _gpus(lease: Lease, snapshot: Iterable[DeviceSnapshot]) -> str:
    index = {d.uuid: d for d in snapshot}
    names = [f"GPU {index[u].index} ({index[u].name})" if u in index else u for u in lease.devices]
    return ", ".join(names) or "no GPU"


def _placeholder(record: Checkpoint) -> Lease:
    """A stand-in lease for log lines about a checkpoint whose lease is no longer in the ledger."""
    return core.Lease(id=record.lease_id, kernel_id=record.kernel_id, user="", count=1)


def _notice(kind: str, lease: Lease, message: str) -> dict:
    return {
        "kind": kind,
        "lease_id": lease.id,
        "kernel_id": lease.kernel_id,
        "user": lease.user,
        "message": message,
        "reclaim_at": lease.reclaim_at,
        "state": lease.state.value,
    }
