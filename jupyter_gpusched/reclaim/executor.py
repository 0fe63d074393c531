"""The reclaim ladder carried out: release, checkpoint, free-cache, restart and shutdown.

The core decides which step a lease is due for (``core/ladder.py``) and when (``reclaim_at``);
the arbiter persists that decision. :class:`ReclaimExecutor` then carries the step out and writes
its outcome through its host, the arbiter: :class:`~.host.ReclaimHost` is all it uses of it
(:meth:`~.host.ReclaimHost.update` writes a lease, one ledger transaction each). Everything in
flight lives here: the steps being carried out, the restores under way, and the free-cache
requests waiting for the kernel's acknowledgement.

Every checkpoint taken is recorded in the ledger before anything else happens, and each is
restored whatever becomes of its lease (:meth:`restore_orphans`).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Callable, Iterable, Mapping

from .. import cgroups, core, procs
from ..arbiter.base import ArbiterEvent, Conflict, notice
from ..core import Lease, LeaseState, Step, ladder
from ..core import lifecycle
from ..core.placement import device_map
from ..devices.base import InventoryUnavailable
from ..ledger import Checkpoint
from ..core.lifecycle import lock_timed_out
from . import fit
from .checkpoint import CheckpointError, CheckpointUnsupported, LockTimeout, RestoreNoRoom

if TYPE_CHECKING:
    from .host import ReclaimHost

log = logging.getLogger("jupyter_gpusched")

#: How long a free-cache step waits for the kernel to say it dropped its caches (seconds).
FREE_CACHE_WAIT = 60.0

_IDLE_RELEASE = "released while idle: the kernel held no GPU memory; its next cell asks again"


class ReclaimExecutor:
    """Carries out the reclaim steps the core decided, for the leases of one arbiter (its host)."""

    def __init__(self, host: ReclaimHost) -> None:
        self.host = host
        #: Lease ids whose step is being carried out now.
        self.inflight: set[str] = set()
        #: Lease id -> the task restoring its checkpoint onto the GPUs it was just granted
        #: (asked through :meth:`restoring` and :meth:`restored`).
        self._restores: dict[str, asyncio.Task] = {}
        #: Lease id -> when its kernel was asked to drop its framework caches.
        self.cache_asked: dict[str, float] = {}
        #: Orphaned checkpoints already said to wait for their GPU (pid, start time, holder).
        self._orphans_told: set[tuple[int, float, str]] = set()
        self._tasks: set[asyncio.Task] = set()

    async def stop(self) -> None:
        tasks = list(self._tasks) + list(self._restores.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    def busy(self, lease_id: str) -> bool:
        """Whether a step or a restore of this lease is under way."""
        return lease_id in self.inflight or lease_id in self._restores

    def restoring(self, lease_id: str | None = None) -> bool:
        """Whether the restore of this lease (None: of any lease) is under way."""
        return bool(self._restores) if lease_id is None else lease_id in self._restores

    async def restored(self, lease_id: str, timeout: float | None) -> None:
        """Wait until the restore of this lease, if one is under way, is over (at most
        ``timeout`` seconds; None: as long as it takes). Its outcome is the lease's to say."""
        task = self._restores.get(lease_id)
        if task is not None:
            await asyncio.wait({task}, timeout=timeout)

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- the ladder -----------------------------------------------------------------------------
    def carry_out_due(self, leases: Iterable[Lease]) -> None:
        """Start the step of every reclaiming lease of this host whose ``reclaim_at`` has come."""
        now = self.host.clock()
        for lease in leases:
            if lease.state != LeaseState.RECLAIMING or lease.reclaim_step is None:
                continue
            if lease.reclaim_at is not None and lease.reclaim_at > now:
                continue
            if lease.id in self.inflight or lease.id in self.cache_asked or not self.host.mine(lease):
                continue
            self.inflight.add(lease.id)
            self._spawn(self.carry_out(lease))

    async def carry_out(self, lease: Lease) -> None:
        step = lease.reclaim_step
        try:
            if step == Step.RELEASE:
                await self._release_idle(lease, step)
            elif step == Step.CHECKPOINT:
                await self.checkpoint(lease)
            elif step == Step.FREE_CACHE:
                self.ask_to_free_cache(lease)
            elif step in (Step.RESTART, Step.SHUTDOWN):
                await self.end_kernel(lease, step)
        except Exception:  # noqa: BLE001 - one failed reclaim must not stop the loop
            log.exception("lease %s of kernel %s: %s failed", lease.id, lease.kernel_id, step)
        finally:
            self.inflight.discard(lease.id)

    async def _release_idle(self, lease: Lease, step: Step) -> None:
        done = await self.host.update(lease, _if_still(step, lambda cur, now: core.released(cur, now, _IDLE_RELEASE)))
        if done is not None:
            self.reclaimed(done, Step.RELEASE, "released", _IDLE_RELEASE, lease.devices)

    async def end_kernel(self, lease: Lease, step: Step) -> None:
        """``restart`` or ``shutdown``: the lease is released first, then the kernel goes."""
        verb = "restarted" if step == Step.RESTART else "shut down"
        why = f"reclaimed: the kernel was {verb} to free its GPU: {lease.reason}"
        done = await self.host.update(lease, _if_still(step, lambda cur, now: core.released(cur, now, why)))
        if done is None:
            return
        self.reclaimed(done, step, "reclaimed", why, lease.devices)
        kernels = self.host.kernels
        if kernels is not None:
            if step == Step.RESTART:
                await kernels.restart(lease.kernel_id)
            else:
                await kernels.shutdown(lease.kernel_id)

    # -- free-cache: asked of the kernel, acknowledged by it ------------------------------------
    def ask_to_free_cache(self, lease: Lease) -> None:
        """Tell the kernel (its agent watches the lease, and this notice) to drop its caches."""
        self.cache_asked[lease.id] = self.host.clock()
        self.host.publish(ArbiterEvent("notice", notice=notice("free_cache", lease, lease.reason)))

    async def cache_freed(self, lease: Lease, frameworks: tuple[str, ...]) -> Lease | None:
        """The kernel says it dropped its caches: the step is done, the ladder goes on from it."""
        if lease.state != LeaseState.RECLAIMING or lease.reclaim_step != Step.FREE_CACHE:
            raise Conflict(f"lease {lease.id} is not asked to free its caches (it is {lease.state.value})")
        self.cache_asked.pop(lease.id, None)
        why = (
            f"framework caches dropped ({', '.join(frameworks)})" if frameworks
            else "the kernel had no framework cache to drop"
        )
        log.info("lease %s of kernel %s: %s", lease.id, lease.kernel_id, why)
        return await self.host.update(
            lease, _if_still(Step.FREE_CACHE, lambda cur, now: core.step_done(cur, Step.FREE_CACHE, why))
        )

    async def expire_cache_requests(self) -> None:
        """A kernel that has not answered within ``FREE_CACHE_WAIT``: the ladder goes on without it."""
        now = self.host.clock()
        for lease_id, asked in list(self.cache_asked.items()):
            if now - asked < FREE_CACHE_WAIT:
                continue
            del self.cache_asked[lease_id]
            lease = self.host.live_lease(lease_id)
            if lease is None:
                continue
            why = f"the kernel did not say within {FREE_CACHE_WAIT:.0f} s that it dropped its caches"
            log.info("lease %s of kernel %s: %s", lease.id, lease.kernel_id, why)
            await self.host.update(
                lease, _if_still(Step.FREE_CACHE, lambda cur, now: core.step_done(cur, Step.FREE_CACHE, why))
            )

    # -- checkpoint and restore -----------------------------------------------------------------
    def gpu_pids(self, lease: Lease) -> list[int]:
        """The kernel's processes that use the lease's own GPUs: the only ones a reclaim touches.

        The kernel's process tree is what the kernel host found (in hub mode, checked to descend
        from its user's server); a process elsewhere, or on another GPU, is never acted on.
        """
        host = self.host
        tree = host.trees.get(lease.kernel_id) or (
            host.kernels.process_tree(lease.kernel_id) if host.kernels else set()
        )
        return fit.gpu_pids(lease, host.state.snapshot, tree)

    async def checkpoint(self, lease: Lease) -> None:
        host = self.host
        if host.kernels is not None and host.kernels.executing(lease.kernel_id):
            # A cell began after the pass saw the kernel idle: its CUDA calls would meet a
            # checkpointed process. The kernel keeps its GPU; the next pass looks again.
            why = "checkpoint called off: the kernel is running a cell"
            log.info("lease %s of kernel %s: %s", lease.id, lease.kernel_id, why)
            await host.update(lease, _if_still(Step.CHECKPOINT, lambda cur, now: core.called_off(cur, now, why)))
            return
        pids = self.gpu_pids(lease)
        if not pids:
            # Nothing of the kernel's on its GPUs (its memory went since the pass): nothing to keep.
            await self._release_idle(lease, Step.CHECKPOINT)
            return
        held = lease.memory_held
        over = self.over_budget(lease, pids)
        if over is not None:
            log.info("lease %s of kernel %s: not checkpointed: %s", lease.id, lease.kernel_id, over)
            await host.update(lease, lambda cur, now: core.step_skipped(cur, Step.CHECKPOINT, over))
            return
        taken: list[Checkpoint] = []
        try:
            moved_total = 0
            for pid in pids:
                started = procs.started(pid)
                if started is None:
                    continue
                moved = await asyncio.to_thread(host.checkpointer.checkpoint, pid)
                moved_total += moved or 0
                record = Checkpoint(pid, started, lease.id, lease.kernel_id, tuple(lease.devices), moved, host.clock())
                await asyncio.to_thread(self._record, record)
                taken.append(record)
        except LockTimeout as exc:
            why = lock_timeout_reason(exc.timeout_ms)
            log.info("lease %s of kernel %s: %s (%s)", lease.id, lease.kernel_id, why, exc)
            for record in taken:  # put back what was already taken: all or nothing
                await self.restore_one(record, None, lease)
            await host.update(lease, _if_still(Step.CHECKPOINT, lambda cur, now: lock_timed_out(cur, now, why)))
            return
        except CheckpointUnsupported as exc:
            why = self.cannot_serve(lease, exc)
            log.warning("lease %s of kernel %s: not checkpointed: %s (%s)", lease.id, lease.kernel_id, why, exc)
            for record in taken:
                await self.restore_one(record, None, lease)
            await host.update(lease, lambda cur, now: core.step_skipped(cur, Step.CHECKPOINT, why))
            return
        except CheckpointError as exc:
            why = str(exc)
            log.warning("lease %s of kernel %s: checkpoint failed: %s", lease.id, lease.kernel_id, why)
            for record in taken:  # put back what was already taken: all or nothing
                await self.restore_one(record, None, lease)
            await host.update(lease, lambda cur, now: core.step_failed(cur, Step.CHECKPOINT, why))
            return
        memory = moved_total or held
        done = await host.update(lease, _if_still(Step.CHECKPOINT, lambda cur, now: core.suspended(cur, now, memory)))
        if done is None:
            # The lease changed under us (released meanwhile): put the state back where it was.
            for record in taken:
                await self.restore_one(record, None, lease)
            return
        log.info(
            "lease %s of kernel %s suspended: GPU state of pids %s checkpointed (%s) from %s",
            lease.id,
            lease.kernel_id,
            [r.pid for r in taken],
            core.format_bytes(memory),
            ",".join(lease.devices),
        )
        self.reclaimed(done, Step.CHECKPOINT, "suspended", done.reason)

    def cannot_serve(self, lease: Lease, exc: CheckpointUnsupported) -> str:
        """The checkpointer refused ``lease``'s GPUs for good: the arbiter's capabilities keep
        that, so that no pass takes the checkpoint step there again and every forecast says so.
        Returns why, in words for the user."""
        host = self.host
        uuids = exc.uuids or tuple(lease.devices)
        by_uuid = {d.uuid: d for d in host.state.snapshot}
        refusals = {}
        for uuid in uuids:
            device = by_uuid.get(uuid)
            if device is not None and device.parent_uuid is not None:
                refusals[uuid] = ladder.mig_refusal(device.to_core())
            else:
                refusals[uuid] = f"the checkpointer cannot serve GPU {device.index if device else uuid}: {exc}"
        caps = host.caps
        host.caps = replace(caps, no_checkpoint={**caps.no_checkpoint, **refusals})
        return refusals[uuids[0]] if uuids else str(exc)

    def over_budget(self, lease: Lease, pids: list[int]) -> str | None:
        """Why checkpointing ``pids`` must not be done now, or None: it would take the host's
        checkpoints over ``checkpoint_host_memory``, or a process's share would not fit in what
        its memory cgroup (a pod's limit) leaves it, where the checkpoint would get it killed.
        Sizes are what the processes hold on the lease's GPUs now (the pass decided on the last
        figure seen, which may have grown since)."""
        host = self.host
        sizes = fit.held_on_lease(lease, pids, host.state.snapshot)
        over = fit.over_host_budget(lease, sizes, host.cfg.checkpoint_host_memory, host.state.leases)
        if over is not None:
            return over
        return fit.over_cgroup(sizes, {pid: cgroups.memory_room(pid) for pid in sizes})

    def _record(self, record: Checkpoint) -> None:
        with self.host.ledger.transaction(self.host.clock()) as tx:
            tx.add_checkpoint(record)

    def _drop(self, record: Checkpoint) -> None:
        with self.host.ledger.transaction(self.host.clock()) as tx:
            tx.drop_checkpoint(record.pid, record.create_time)

    def start_restore(self, lease: Lease) -> None:
        """A suspended lease was granted GPUs again: restore its processes onto them."""
        self._restores[lease.id] = self._spawn(self.restore(lease))

    async def restore_one(self, record: Checkpoint, device_map: Mapping[str, str] | None, lease: Lease) -> bool:
        """Restore one checkpointed process (if it still runs) and forget its checkpoint.

        Returns False if it was not restored. A restore that found too little free GPU memory
        (:class:`RestoreNoRoom`) left the process checkpointed: its checkpoint is kept, to be
        restored when there is room. Any other failure forgets it, as the driver gives no second
        try (the process's GPU state is lost then, and the log says so).
        """
        return await self._restore_record(record, device_map, lease) in (_RESTORED, _GONE)

    async def _restore_record(self, record: Checkpoint, device_map: Mapping[str, str] | None, lease: Lease) -> str:
        """:meth:`restore_one`, saying what became of the process: restored, gone (it ended, so
        there was nothing to restore), no room (still checkpointed) or lost."""
        keep = False
        try:
            if not procs.same_process(record.pid, record.create_time):
                return _GONE
            await asyncio.to_thread(self.host.checkpointer.restore, record.pid, device_map)
            return _RESTORED
        except RestoreNoRoom as exc:
            keep = True
            log.warning(
                "lease %s of kernel %s: pid %s stays checkpointed, the restore found too little GPU memory: %s",
                lease.id, lease.kernel_id, record.pid, exc,
            )
            return _NO_ROOM
        except CheckpointError as exc:
            log.error(
                "lease %s of kernel %s: restoring pid %s failed, its GPU state is lost: %s",
                lease.id, lease.kernel_id, record.pid, exc,
            )
            return _LOST
        finally:
            if not keep:
                await asyncio.to_thread(self._drop, record)

    async def _snapshot(self):
        """The GPUs as they are now (a restore decides on them), or as last seen."""
        backend = self.host.backend
        if backend is None:
            return self.host.state.snapshot
        try:
            return await asyncio.to_thread(backend.snapshot)
        except InventoryUnavailable:
            return self.host.state.snapshot

    def why_not_here(self, lease: Lease, snapshot) -> tuple[dict[str, str] | None, str | None]:
        """The device map for restoring ``lease`` onto the GPUs it was granted, or why it cannot
        go there (the driver's rules: same model, every GPU mapped; a checkpointer that cannot
        remap restores only onto the GPUs the checkpoint came from)."""
        models = {d.uuid: d.name for d in snapshot}
        mapping = device_map(lease.home, lease.devices, models)
        if mapping is None:
            return None, (
                "waiting: the GPUs it was granted do not match the GPUs its checkpoint came from one for one "
                "by model, as a restore onto other GPUs needs"
            )
        moved = any(old != new for old, new in mapping.items())
        if moved and not self.host.checkpointer.remap:
            return None, (
                "waiting for the GPU it was checkpointed from to be free: this server's checkpointer "
                "cannot restore onto another GPU"
            )
        return mapping, None

    async def restore(self, lease: Lease) -> None:
        """Restore a resumed lease's processes onto the GPUs it was granted, if the checkpoint
        fits there; otherwise it waits again (its checkpoint kept). Whatever happens, the lease
        says so before the claim waiting on it is answered, and nothing escapes this task."""
        host = self.host
        try:
            await self._restore(lease)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - a restore's failure must reach the lease, not the loop
            log.exception("lease %s of kernel %s: the restore failed unexpectedly", lease.id, lease.kernel_id)
            why = "waiting: the restore could not be carried out this time (see the server log); it is tried again"
            try:
                await self._defer(lease, why)
            except Exception:  # noqa: BLE001
                log.exception("lease %s of kernel %s: could not write that the restore waits", lease.id, lease.kernel_id)
        finally:
            self._restores.pop(lease.id, None)
            host.wake(lease.id)

    async def _defer(self, lease: Lease, why: str) -> None:
        log.info("lease %s of kernel %s: restore onto %s waits: %s", lease.id, lease.kernel_id, ",".join(lease.devices), why)
        await self.host.update(lease, _if_granted(lease, lambda cur, now: lifecycle.restore_deferred(cur, now, why)))

    async def _restore(self, lease: Lease) -> None:
        host = self.host
        records = await asyncio.to_thread(host.ledger.checkpoints, lease.id)
        snapshot = await self._snapshot()
        mapping, why = self.why_not_here(lease, snapshot)
        if why is None:
            live = [r for r in records if procs.same_process(r.pid, r.create_time)]
            why = fit.room_short(snapshot, fit.restore_needs(lease, live))
        if why is not None:
            await self._defer(lease, why)
            return
        failed: list[int] = []
        restored: list[Checkpoint] = []
        for record in records:
            outcome = await self._restore_record(record, mapping, lease)
            if outcome == _NO_ROOM:
                # All or nothing: the processes already back go back to the host with this one.
                await self._checkpoint_again(restored, lease)
                await self._defer(lease, fit.room_short(await self._snapshot(), fit.restore_needs(lease, [record])) or (
                    "waiting for room to restore: the GPU had too little free memory for its checkpoint when it "
                    "came to it; it is restored once enough memory is free"
                ))
                return
            if outcome == _LOST:
                failed.append(record.pid)
            elif outcome == _RESTORED:
                restored.append(record)
        if failed:
            why = f"restore failed, the kernel's GPU state is lost (pids {failed})"
            log.error("lease %s of kernel %s: %s", lease.id, lease.kernel_id, why)
            await host.update(lease, lambda cur, now: core.released(cur, now, why))
            host.publish(ArbiterEvent("notice", notice=notice("lost", lease, why)))
            return
        log.info(
            "lease %s of kernel %s restored onto %s (pids %s)",
            lease.id,
            lease.kernel_id,
            ",".join(lease.devices),
            [r.pid for r in records],
        )
        host.publish(ArbiterEvent("notice", notice=notice("resumed", lease, lease.reason)))

    async def _checkpoint_again(self, records: list[Checkpoint], lease: Lease) -> None:
        """Put processes just restored back to the host (their lease waits again)."""
        for record in records:
            try:
                moved = await asyncio.to_thread(self.host.checkpointer.checkpoint, record.pid)
            except CheckpointError as exc:
                log.error(
                    "lease %s of kernel %s: pid %s was restored but could not be checkpointed again: %s",
                    lease.id, lease.kernel_id, record.pid, exc,
                )
                continue
            again = replace(record, memory=moved if moved is not None else record.memory, taken_at=self.host.clock())
            await asyncio.to_thread(self._record, again)

    async def restore_orphans(self) -> None:
        """Every checkpoint this ledger took is restored, whatever became of its lease.

        A suspended lease's processes wait for their kernel's next cell. Any other checkpoint
        (its lease released by the user, by a disconnect or a crash, or the arbiter restarted
        halfway) is restored onto the GPU it came from, if its process still runs, once no other
        lease holds that GPU and its free memory holds the checkpoint with a margin: a GPU
        granted to another kernel meanwhile is never given a second kernel's memory, and a GPU
        whose memory others use is not restored into. Until then the checkpoint waits (its
        process stays frozen); a process that ended meanwhile only has its checkpoint forgotten.
        """
        host = self.host
        records = await asyncio.to_thread(host.ledger.checkpoints)
        if not records:
            return
        live = {lease.id: lease for lease in host.state.leases}
        snapshot = None
        for record in records:
            lease = live.get(record.lease_id)
            waiting = lease is not None and (
                lease.state == LeaseState.SUSPENDED or (lease.home and lease.state == LeaseState.PENDING)
            )
            if waiting or self.busy(record.lease_id):
                continue
            running = procs.same_process(record.pid, record.create_time)
            held_by = _holders(record, live.values())
            if held_by and running:
                key = (record.pid, record.create_time, held_by[0].id)
                if key not in self._orphans_told:
                    self._orphans_told.add(key)
                    log.info(
                        "lease %s of kernel %s is no longer suspended: pid %s stays checkpointed until %s is "
                        "free (lease %s of kernel %s holds it now)",
                        record.lease_id, record.kernel_id, record.pid, ",".join(record.devices),
                        held_by[0].id, held_by[0].kernel_id,
                    )
                continue
            gone = host.known_lease(record.lease_id)
            owner = gone or lease or _placeholder(record)
            if running:
                if snapshot is None:
                    snapshot = await self._snapshot()
                short = fit.room_short(snapshot, fit.orphan_needs(record, owner))
                if short is not None:
                    key = (record.pid, record.create_time, "room")
                    if key not in self._orphans_told:
                        self._orphans_told.add(key)
                        log.info(
                            "lease %s of kernel %s is no longer suspended: pid %s stays checkpointed until %s has "
                            "room for it (%s)",
                            record.lease_id, record.kernel_id, record.pid, ",".join(record.devices), short,
                        )
                    continue
            ok = await self.restore_one(record, None, owner)
            if ok and running:
                snapshot = None  # the restore took memory: look again before the next one
                log.warning(
                    "lease %s of kernel %s is no longer suspended: restored pid %s onto %s so that it is not left frozen",
                    record.lease_id, record.kernel_id, record.pid, ",".join(record.devices),
                )

    # -- outcomes -------------------------------------------------------------------------------
    def reclaimed(self, lease: Lease, step: Step, kind: str, message: str, devices: Iterable[str] = ()) -> None:
        devices = ",".join(devices) or ",".join(lease.home) or "-"
        log.info("reclaim: lease %s of kernel %s: %s from %s: %s", lease.id, lease.kernel_id, step.value, devices, message)
        if self.host.metrics is not None:
            self.host.metrics.reclaimed(step.value)
        self.host.publish(ArbiterEvent("notice", notice=notice(kind, lease, message)))


def lock_timeout_reason(timeout_ms: int) -> str:
    """What the lease says after a checkpoint whose lock timed out."""
    within = f"{timeout_ms} ms" if timeout_ms < 1000 else core.format_duration(timeout_ms / 1000)
    return (
        f"not checkpointed: the kernel's GPU work did not pause within {within} "
        "(the checkpoint lock timed out); the kernel keeps its GPU and runs on, unharmed, and a checkpoint "
        "may be tried again once it has been idle long enough again"
    )


def _if_still(step: Step, fn: Callable[[Lease, float], Lease | None]) -> Callable[[Lease, float], Lease | None]:
    """``fn`` applied only while the lease is still at ``step`` of its reclaim (nothing changed it)."""

    def apply(cur: Lease, now: float) -> Lease | None:
        if cur.state == LeaseState.RECLAIMING and cur.reclaim_step == step:
            return fn(cur, now)
        return None

    return apply


_RESTORED, _GONE, _NO_ROOM, _LOST = "restored", "gone", "no room", "lost"


def _if_granted(lease: Lease, fn: Callable[[Lease, float], Lease | None]) -> Callable[[Lease, float], Lease | None]:
    """``fn`` applied only while the lease still holds the GPUs its restore was granted."""

    def apply(cur: Lease, now: float) -> Lease | None:
        if cur.holding and cur.devices == lease.devices and cur.home:
            return fn(cur, now)
        return None

    return apply


def _holders(record: Checkpoint, leases: Iterable[Lease]) -> list[Lease]:
    """Live leases other than the checkpoint's own that hold a GPU it was taken from."""
    mine = set(record.devices)
    return [
        lease for lease in leases
        if lease.id != record.lease_id and lease.holding and not mine.isdisjoint(lease.devices)
    ]


def _placeholder(record: Checkpoint) -> Lease:
    """A stand-in lease for log lines about a checkpoint whose lease is no longer in the ledger."""
    return core.Lease(id=record.lease_id, kernel_id=record.kernel_id, user="", count=1)


