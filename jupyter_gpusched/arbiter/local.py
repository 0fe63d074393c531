"""``LocalArbiter``: the scheduler in this process (standalone, and inside the hub broker).

A reconcile tick observes (``observe.py``), plans in one ledger transaction (:meth:`_plan_tx`,
which calls :func:`jupyter_gpusched.core.plan` and writes what changed), then, back on the event
loop, applies the plan: it tells viewers, wakes waiting claims and hands due reclaim steps to the
:class:`~jupyter_gpusched.reclaim.executor.ReclaimExecutor`. Several processes sharing a ledger
never grant one GPU twice, as every decision is made inside the transaction. Blocking work
(NVML, SQLite, /proc) runs in worker threads; those return values and never touch this object's
state, which only the event loop changes.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid as uuidlib
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Sequence

from .. import core
from ..api.input import Claim
from ..api.views import Principal
from ..core import Capabilities, KernelActivity, Lease, LeaseState, SchedConfig
from ..core import ladder as core_ladder
from ..core import usage as core_usage
from ..core.placement import STRAY_SLACK
from ..devices.base import DeviceBackend, DeviceSnapshot, InventoryUnavailable
from ..ledger import Ledger, LedgerError, LedgerWouldBlock, OwnerId
from ..reclaim.checkpoint import Checkpointer, Unavailable
from ..reclaim import executor as reclaim_executor
from . import announce, enforce
from .base import MAX_WAIT, Arbiter, ArbiterEvent, ClaimResult, KernelHost, notice
from .base import BadRequest, Conflict, Forbidden, LedgerUnavailable, NoInventory, NotFound
from .claims import ClaimRequest, write_claims
from .claims import Host as ClaimHost
from .observe import Observation, core_devices, device_changed, held_by_kernel, observe
from .policy import AccessPolicy
from .reap import Reaper
from .reads import LocalReads

log = logging.getLogger("jupyter_gpusched")

#: Seconds between two prunings of the ledger's history, and leases pruned per transaction.
PRUNE_EVERY = 600.0
PRUNE_BATCH = 500


@dataclass
class _State:
    """The last view of the world, for answering reads without touching the ledger."""

    snapshot: tuple[DeviceSnapshot, ...] = ()
    leases: tuple[Lease, ...] = ()
    queue: tuple[str, ...] = ()
    drained: Mapping[str, str] = field(default_factory=dict)
    process_kernels: Mapping[int, str] = field(default_factory=dict)
    unleased: tuple[dict, ...] = ()
    #: Recent usage per subject after the last pass (``core.usage``), the fair queue's keys of
    #: the claims that pass left waiting, the usage it ordered them by, and when it ran.
    usage: Mapping[str, core_usage.Accrued] = field(default_factory=dict)
    keys: Mapping[str, tuple] = field(default_factory=dict)
    recent: Mapping[str, float] = field(default_factory=dict)
    planned_at: float = 0.0


@dataclass(frozen=True)
class _Planned:
    """What one planning transaction decided, for the event loop to apply."""

    plan: core.Plan
    before: Mapping[str, Lease]
    notices: list
    drained: Mapping[str, str]
    #: Leases the transaction released (their idle history is remembered for the kernel).
    released: tuple[Lease, ...] = ()
    #: Leases whose suspected-dead kernel is checked again at the next tick.
    suspects: frozenset[str] = frozenset()
    outcome: Any = None
    #: Recent usage per subject as written by the transaction, and the transaction's time.
    usage: Mapping[str, core_usage.Accrued] = field(default_factory=dict)
    at: float = 0.0


class LocalArbiter(LocalReads, Arbiter):
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
        policy: AccessPolicy | None = None,
        history_days: float = 0.0,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.unleased_policy = unleased_processes
        self.policy = policy or AccessPolicy()
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
        self.reclaims = reclaim_executor.ReclaimExecutor(self)
        #: Each kernel's process tree as last observed (reclaims act within it only).
        self.trees: Mapping[str, set[int]] = {}
        self._activity: Mapping[str, KernelActivity] = {}
        #: Kernels whose host said at the last look that they run a cell (see _said_running).
        self._running: frozenset[str] = frozenset()
        self._waiters: dict[str, asyncio.Event] = {}
        self._task: asyncio.Task | None = None
        self._tick_lock = asyncio.Lock()
        self._kernel_gaps: dict[str, tuple[float, ...]] = {}
        self._kernel_owners: dict[str, OwnerId] = {}
        #: Which leases end because their kernel is gone (arbiter/reap.py).
        self.reaper = Reaper(lambda: self.kernels, lambda: self.server_id)
        #: Leases written outside a planning pass (a reclaim step, a release) since the last plan
        #: was applied: a plan read before such a write must not put the older record back.
        self._written: dict[str, Lease] = {}
        self._unleased_seen: frozenset[int] = frozenset()
        #: Claims waiting for the next planning pass, and the task that writes them.
        self._claims: list[tuple[ClaimRequest, asyncio.Future]] = []
        self._claims_writer: asyncio.Task | None = None
        #: Released leases older than this many days leave the ledger (0: none ever do).
        self.history_days = history_days
        self._pruned_at: float | None = None

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
        if self._claims_writer is not None:
            self._claims_writer.cancel()
        await self.reclaims.stop()

    def close(self) -> None:
        if self.backend is not None:
            self.backend.close()
        self.ledger.close()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval)
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the loop must outlive one bad tick
                log.exception("GPU reconcile tick failed; trying again in %ss", self.poll_interval)

    # -- the reconcile tick ----------------------------------------------------------------
    async def tick(self) -> core.Plan:
        """Observe, plan in one transaction, persist, then carry out what was decided."""
        async with self._tick_lock:
            snap = await self._refresh_devices()
            seen = await self._observe(snap)
            # A worker thread: the tick reaps, which reads each lease owner's process.
            planned = await asyncio.to_thread(self._plan_tx, seen.activity, None)
            await self._apply(planned)
            await self.reclaims.expire_cache_requests()
            await self.reclaims.restore_orphans()
            await self._prune_history()
            if self.unleased_policy == "kill":
                await self._enforce()
            return planned.plan

    async def replan(self) -> core.Plan:
        """A scheduling pass on what the last tick saw (after a release, say): no device scan."""
        async with self._tick_lock:
            planned = await self._tx(self._plan_tx, self._activity, None)
            await self._apply(planned)
            return planned.plan

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
            if old is None or device_changed(old, device):
                self.publish(ArbiterEvent("device", device=device))
            if old is not None and old.health != "lost" and device.health == "lost":
                log.warning("GPU %s (%s) was lost", device.index, device.uuid)
        return snap

    async def _observe(self, snap: tuple[DeviceSnapshot, ...]) -> Observation:
        if self.kernels is None:
            seen = Observation()
        else:
            await self.kernels.refresh_notebooks()
            trees = await asyncio.to_thread(self.kernels.process_trees)
            seen = observe(
                self.kernels.activity(), trees, snap, self.state.leases, self.clock(),
                has_inventory=self.backend is not None,
            )
        self.trees = seen.trees
        self._running = self._said_running(seen.activity)
        self.state.process_kernels = seen.process_kernels
        self.state.unleased = seen.unleased
        self._activity = seen.activity
        return seen

    def _said_running(self, activity: Mapping[str, KernelActivity]) -> frozenset[str]:
        """Kernels whose host says they run a cell now, believed or not (a hub broker believes
        a server's word only with evidence): between two otherwise equal idle leases the plan
        takes the other one. A host without ``said_running`` counts its word as busy already."""
        said = getattr(self.kernels, "said_running", None)
        if said is None:
            return frozenset()
        out = set()
        for kernel_id in activity:
            try:
                if said(kernel_id):
                    out.add(kernel_id)
            except Exception:  # noqa: BLE001 - a hint for the plan, never a reason to fail the tick
                log.debug("could not ask whether kernel %s runs a cell", kernel_id, exc_info=True)
        return frozenset(out)

    async def _tx(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn``, one short ledger transaction, on the event loop when the ledger's write
        lock is free at once (the common case: no thread hand-off, no wait for the interpreter
        lock); in a worker thread when another thread or process holds it. ``fn`` takes
        ``wait`` and does nothing before its transaction begins."""
        try:
            return fn(*args, wait=False, **kwargs)
        except LedgerWouldBlock:
            return await asyncio.to_thread(fn, *args, wait=True, **kwargs)

    def _plan_tx(
        self,
        activity: Mapping[str, KernelActivity],
        change: Callable[[Any, list[Lease], list[core.Device]], Any] | None,
        *,
        reap: bool = True,
        wait: bool = True,
    ) -> _Planned:
        """One transaction: reap the dead (unless ``reap`` is False: claims leave that to the
        tick), apply ``change``, plan, persist. It returns what the event loop then applies."""
        notices: list[dict | ArbiterEvent] = []
        with self.ledger.transaction(self.clock(), wait=wait) as tx:
            now = tx.now
            drained = tx.drained()
            devices = core_devices(self.state.snapshot, drained, self.state.unleased)
            leases = tx.leases()
            before = {lease.id: lease for lease in leases}
            if reap:
                leases, released, suspects = self.reaper.reap(tx, leases, now, devices, notices)
            else:
                released, suspects = [], set(self.reaper.suspects)
            leases = self._resume_running(tx, leases, activity, now)
            outcome = change(tx, leases, devices) if change is not None else None
            if outcome is not None:
                leases = tx.leases()
            # Recent usage, accrued up to now with what each user and group held since the last
            # pass (of any process on this ledger), orders the queue after quota.
            half_life = self.cfg.usage_half_life
            book = core_usage.Book(tx.usage()) if half_life > 0 else None
            recent = book.recent(now, half_life) if book is not None else None
            # The checkpoint step is skipped on MIG instances (core/ladder.py, serving).
            caps = core_ladder.serving(self.caps, devices)
            plan = core.plan(devices, leases, activity, now, self.cfg, caps, usage=recent, running=self._running)
            read = {lease.id: lease for lease in leases}
            for lease_id in plan.changed:
                # As read in this transaction: no need to read it again.
                tx.put(plan.lease(lease_id), read.get(lease_id, ...))
            records_after: Mapping[str, core_usage.Accrued] = {}
            if book is not None:
                written = book.advance(plan.leases, devices, now, half_life)
                tx.write_usage(written, book.forget(now, half_life))
                records_after = book.records
            self.reaper.adopt(tx, plan.leases)
        return _Planned(
            plan, before, notices, dict(drained), tuple(released), frozenset(suspects), outcome, records_after, now
        )

    def _resume_running(self, tx, leases: list[Lease], activity: Mapping[str, KernelActivity], now: float) -> list[Lease]:
        """A suspended kernel that runs code anyway (a cell the agent did not see, or one that a
        checkpoint overtook) asks for its GPU back: it waits in the queue like any claim and is
        restored when granted. Its host's word that a cell runs is enough here (a hub broker
        counts it busy only with evidence): asking again takes nothing from anyone."""
        out = []
        for lease in leases:
            seen = activity.get(lease.kernel_id)
            runs = seen is not None and (seen.busy or lease.kernel_id in self._running)
            if lease.state == LeaseState.SUSPENDED and runs:
                lease = core.request_resume(lease, now)
                tx.put(lease)
                log.info("lease %s of kernel %s: the kernel runs while suspended; restoring", lease.id, lease.kernel_id)
            out.append(lease)
        return out

    async def _apply(self, planned: _Planned) -> None:
        """On the event loop: take the plan as the state, tell viewers, wake claims, reclaim."""
        plan, before, notices = planned.plan, planned.before, list(planned.notices)
        written, self._written = self._written, {}
        leases = _newest(plan.leases, written)
        self.state.leases = leases
        self.state.queue = plan.queue
        self.state.drained = planned.drained
        self.state.usage = planned.usage
        self.state.keys = plan.keys
        self.state.recent = plan.usage
        self.state.planned_at = planned.at
        self.reaper.suspects = planned.suspects
        for lease in planned.released:
            self._remember(lease)
        now = self.clock()
        for decision in plan.decisions:
            announce.tell(self, decision, before.get(decision.lease.id), now, notices)
        # A claim written in this pass's transaction is already pending when the core plans, so
        # the plan neither lists it as changed nor decides to queue it: tell viewers here.
        decided = {d.lease.id for d in plan.decisions}
        changed = list(plan.changed)
        for lease in plan.leases:
            if lease.id in before or lease.id in plan.changed:
                continue
            changed.append(lease.id)
            if lease.state == LeaseState.PENDING and lease.id not in decided:
                position = plan.queue.index(lease.id) + 1 if lease.id in plan.queue else None
                notices.append(announce.queued(lease, position))
        for lease_id in changed:
            lease = _later(plan.lease(lease_id), written)
            self.publish(ArbiterEvent("lease", lease=lease))
            if lease is not None and lease.state != LeaseState.PENDING:
                self.wake(lease_id)
        for item in notices:
            self.publish(item if isinstance(item, ArbiterEvent) else ArbiterEvent("notice", notice=item))
        self.reclaims.carry_out_due(leases)
        if self.metrics is not None:
            self.metrics.update(self.state.snapshot, leases, plan.queue)

    async def _prune_history(self) -> None:
        """At most every ``PRUNE_EVERY`` seconds, released leases past ``history_days`` go, in batches."""
        now = self.clock()
        if self.history_days <= 0 or (self._pruned_at is not None and now - self._pruned_at < PRUNE_EVERY):
            return
        self._pruned_at = now
        older_than = now - self.history_days * 86400.0
        try:
            total = await asyncio.to_thread(self.ledger.prune_all, older_than, PRUNE_BATCH)
        except LedgerError as exc:
            log.warning("could not prune the ledger's history this time: %s", exc)
            return
        if total:
            log.info("ledger: %d released lease(s) older than %s days pruned with their history", total, self.history_days)

    async def _enforce(self) -> None:
        live = {lease.id for lease in self.state.leases}

        def decide() -> enforce.Verdict:
            owner_pids = [owner.process.pid for lease_id, owner in self.ledger.owners().items() if lease_id in live]
            return enforce.suspects(
                self.state.unleased, self.state.leases, owner_pids, self.trees, self.state.snapshot, self._unleased_seen
            )

        verdict = await asyncio.to_thread(decide)
        self._unleased_seen = verdict.seen
        await asyncio.to_thread(enforce.end, verdict.due)
        for item in verdict.notices:
            self.publish(ArbiterEvent("notice", notice=item))

    # -- what the reclaim executor uses (reclaim/host.py, ReclaimHost) --------------------
    def mine(self, lease: Lease) -> bool:
        """Whether ``lease``'s kernel is one of this arbiter's (its reclaims are carried out here)."""
        return self.kernels is not None and self.kernels.alive(lease.kernel_id) is not None

    def wake(self, lease_id: str) -> None:
        """Wake a claim waiting on ``lease_id``."""
        event = self._waiters.get(lease_id)
        if event is not None:
            event.set()

    def live_lease(self, lease_id: str) -> Lease | None:
        return next((le for le in self.state.leases if le.id == lease_id), None)

    def known_lease(self, lease_id: str) -> Lease | None:
        """A lease, live or from the ledger's history (None: never heard of)."""
        return self.live_lease(lease_id) or self.ledger.lease(lease_id)

    async def update(self, lease: Lease, fn: Callable[[Lease, float], Lease | None]) -> Lease | None:
        """Re-read ``lease`` under the write lock and write ``fn(lease)`` if it still applies."""
        new = await self._tx(self._write, lease.id, fn)
        self._remember(new)
        if new is not None:
            self._written[new.id] = new
            self.state.leases = tuple(new if le.id == new.id else le for le in self.state.leases if new.live or le.id != new.id)
            self.publish(ArbiterEvent("lease", lease=new))
            self.wake(new.id)
        return new

    def _write(self, lease_id: str, fn: Callable[[Lease, float], Lease | None], *, wait: bool = True) -> Lease | None:
        with self.ledger.transaction(self.clock(), wait=wait) as tx:
            current = tx.lease(lease_id)
            if current is None:
                return None
            new = fn(current, tx.now)
            if new is None or new == current:
                return None
            if new.version <= current.version:
                new = replace(new, version=current.version + 1)
            tx.put(new, current)
            if new.devices != current.devices or new.holding != current.holding:
                self._settle_usage(tx)
            return new

    def _settle_usage(self, tx) -> None:
        """Accrue recent usage up to now in ``tx`` after a write that took or gave back GPUs
        outside a pass (a release, a suspend), so that what is no longer held stops counting now,
        not at the next pass (which may come only after a restart)."""
        half_life = self.cfg.usage_half_life
        if half_life <= 0:
            return
        devices = [d.to_core() for d in self.state.snapshot]
        book = core_usage.Book(tx.usage())
        tx.write_usage(book.advance(tx.leases(), devices, tx.now, half_life))

    # -- lookups ---------------------------------------------------------------------------
    def _need_inventory(self) -> None:
        if self.backend is None:
            raise NoInventory(
                f"no GPU inventory on this server ({self.backend_note or 'no backend'}); "
                "set c.GPUSchedApp.backend = 'simulated' to try it without GPUs"
            )

    def _find(self, lease_id: str) -> Lease:
        found = self.known_lease(lease_id)
        if found is None:
            raise NotFound(f"no lease {lease_id!r}")
        return found

    # -- writes ----------------------------------------------------------------------------
    async def claim(self, who: Principal, ask: Claim) -> ClaimResult:
        undo = self.policy.admit_claim(who, ask.kernel_id, ask.priority)
        try:
            return await self._claim(who, ask)
        except Exception:
            if undo is not None:
                undo()
            raise

    async def _claim(self, who: Principal, ask: Claim) -> ClaimResult:
        self._need_inventory()
        kernel_id = ask.kernel_id
        if self.kernels is not None and not self.kernels.alive(kernel_id):
            raise NotFound(f"no running kernel {kernel_id!r} on this server")
        if self.kernels is not None and who.kernel_id == kernel_id:
            self.kernels.asking(kernel_id)
        pid = self.kernels.kernel_pid(kernel_id) if self.kernels is not None else None
        request = ClaimRequest(who, ask, owner_pid=pid, owner=self._owner_of(kernel_id, pid), gaps=self._kernel_gaps.get(kernel_id, ()))
        answer: asyncio.Future = asyncio.get_running_loop().create_future()
        self._claims.append((request, answer))
        if self._claims_writer is None or self._claims_writer.done():
            self._claims_writer = asyncio.create_task(self._write_claims())
        how, lease_id = await answer
        return await self._answer(who, lease_id, how, ask.wait)

    def _owner_of(self, kernel_id: str, pid: int | None) -> OwnerId | None:
        """The identity (pid and start time) of a kernel's process, read once per process: a
        kernel claims again and again, and its process changes only when it restarts."""
        if pid is None:
            return None
        known = self._kernel_owners.get(kernel_id)
        if known is not None and known.pid == pid:
            return known
        try:
            owner = OwnerId.of_pid(pid)
        except Exception:  # noqa: BLE001 - gone already: write_claim lets the server own it
            return None
        if len(self._kernel_owners) >= 4096:
            self._kernel_owners.clear()
        self._kernel_owners[kernel_id] = owner
        return owner

    async def _write_claims(self) -> None:
        """Claims that arrive while a pass runs share the next one: one transaction, one plan.

        Under load (a class pressing Run at once) a claim then costs about one ledger write of
        its own instead of waiting for every claim ahead of it to have its own pass.
        """
        while self._claims:
            async with self._tick_lock:
                batch, self._claims = self._claims, []
                index = {d.uuid: d.index for d in self.state.snapshot}
                change = functools.partial(write_claims, [r for r, _ in batch], ClaimHost(self.server_id, index, self.cfg))
                try:
                    planned = await self._tx(self._plan_tx, self._activity, change, reap=False)
                except Exception as exc:  # noqa: BLE001 - every claim of the batch hears why
                    error = LedgerUnavailable(str(exc)) if isinstance(exc, LedgerError) else exc
                    for _, answer in batch:
                        if not answer.done():
                            answer.set_exception(error)
                    continue
                try:
                    await self._apply(planned)
                finally:
                    # The claims are written whatever became of telling viewers: answer them.
                    self._answer_batch(batch, planned.outcome)

    @staticmethod
    def _answer_batch(batch: list, outcomes: list) -> None:
        for (_, answer), outcome in zip(batch, outcomes):
            if answer.done():
                continue
            if isinstance(outcome, Exception):
                answer.set_exception(outcome)
            else:
                answer.set_result(outcome)

    def _remember(self, lease: Lease | None) -> None:
        """Idle spells of the kernel's released lease, so that learning survives a release."""
        if lease is not None and lease.gaps and not lease.live:
            self._kernel_gaps[lease.kernel_id] = lease.gaps

    async def _answer(self, who: Principal, lease_id: str, how: str, wait: float) -> ClaimResult:
        wait = max(0.0, min(float(wait or 0.0), MAX_WAIT))
        deadline = time.monotonic() + wait
        while True:
            await self.reclaims.restored(lease_id, max(0.0, deadline - time.monotonic()) or None)
            lease = self._find(lease_id)
            if lease.holding and not self.reclaims.restoring(lease_id):
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
        self.policy.caller(who)
        lease = self._find(lease_id)
        self.policy.act_on(who, lease)
        return lease

    async def release(self, who: Principal, lease_id: str, memory_held: str = "release") -> dict | None:
        lease = self._own(who, lease_id)
        by = f"kernel {who.kernel_id}" if who.kernel_id else who.user
        why = f"released by {by}"
        if not lease.live:
            return None
        held = await self.held_now(lease)
        if held and memory_held == "keep":
            log.info("lease %s of kernel %s kept at release: its processes hold GPU memory", lease.id, lease.kernel_id)
            return announce.release_answer(False, lease, held, self.render_lease(lease, who))
        done = await self.update(lease, lambda cur, now: core.released(cur, now, why))
        if done is not None:
            log.info("lease %s of kernel %s %s", lease.id, lease.kernel_id, why)
            if who.kernel_id is None and lease.user != who.user:
                self.publish(ArbiterEvent("notice", notice=notice("released", done, f"Your GPU lease was {why}")))
        if self.state.queue:
            await self.replan()  # someone waits (on any server of this ledger): grant them now
        if not held:
            return None
        log.warning(
            "lease %s of kernel %s released while its processes hold %s of GPU memory; it counts as taken",
            lease.id, lease.kernel_id, core.format_bytes(sum(p["memory_used"] for p in held)),
        )
        lease = done or self._find(lease_id)
        return announce.release_answer(True, lease, held, self.render_lease(lease, who))

    async def held_now(self, lease: Lease) -> list[dict]:
        """What ``lease``'s kernel holds on its GPUs now, read afresh from the GPUs' process
        lists: the processes on a GPU where they hold more than a CUDA context left behind
        (``placement.STRAY_SLACK``), the memory a release would leave behind. Empty for a lease
        that holds no GPU, and where the GPUs or the kernels cannot be read."""
        if not lease.holding or self.backend is None or self.kernels is None:
            return []
        try:
            snap = await asyncio.to_thread(self.backend.snapshot)
        except InventoryUnavailable:
            snap = self.state.snapshot
        try:
            trees = await asyncio.to_thread(self.kernels.process_trees)
        except Exception:  # noqa: BLE001 - a release must not fail because a process scan did
            log.warning("kernel %s: could not read its processes at release", lease.kernel_id, exc_info=True)
            return []
        found = held_by_kernel(snap, trees.get(lease.kernel_id) or set(), lease.devices)
        per_gpu: dict[str, int] = {}
        for item in found:
            per_gpu[item["device"]] = per_gpu.get(item["device"], 0) + item["memory_used"]
        return [item for item in found if per_gpu[item["device"]] > STRAY_SLACK]

    async def keep(self, who: Principal, lease_id: str, seconds: float) -> dict:
        lease = self._own(who, lease_id)
        try:
            core.keep(lease, seconds, self.clock(), self.cfg)  # validate before writing
        except core.ConflictError as exc:
            raise Conflict(str(exc)) from exc
        except core.SchedulingError as exc:
            raise BadRequest(str(exc)) from exc
        done = await self.update(lease, lambda cur, now: core.keep(cur, seconds, now, self.cfg))
        lease = done or self._find(lease_id)
        log.info("lease %s of kernel %s kept for %ss by %s", lease.id, lease.kernel_id, seconds, who.user)
        if done is not None and lease.keep_until is not None:
            self.publish(ArbiterEvent("notice", notice=notice("kept", lease, f"Kept for {core.format_duration(seconds)}")))
        return self.render_lease(lease, who)

    async def cache_freed(self, who: Principal, lease_id: str, frameworks: tuple[str, ...]) -> dict:
        lease = self._own(who, lease_id)
        done = await self.reclaims.cache_freed(lease, frameworks)
        return self.render_lease(done or self._find(lease_id), who)

    async def drain(self, who: Principal, uuid: str, drained: bool, reason: str = "") -> dict:
        if not who.admin:
            raise Forbidden("only an administrator can drain or undrain a GPU")
        device = next((d for d in self.state.snapshot if d.uuid == uuid), None)
        if device is None:
            raise NotFound(f"no GPU with uuid {uuid!r} on this host")
        await asyncio.to_thread(self._write_drained, uuid, drained, reason or f"by {who.user}")
        log.info("GPU %s (%s) %s by %s", device.index, uuid, "drained" if drained else "undrained", who.user)
        await self.replan()
        return self.render_device(device, who)

    def _write_drained(self, uuid: str, drained: bool, reason: str) -> None:
        with self.ledger.transaction(self.clock()) as tx:
            tx.set_drained(uuid, drained, reason)

    async def kernel_started(self, kernel_id: str, user: str, pid: int | None) -> None:
        """A kernel process now runs: hand its leases to it (they survive this server)."""
        await self.replan()

    async def kernel_ended(self, kernel_id: str, reason: str) -> None:
        leases = [le for le in self.state.leases if le.kernel_id == kernel_id and le.live]
        for lease in leases:
            done = await self.update(lease, lambda cur, now: core.released(cur, now, f"released: {reason}"))
            if done is not None:
                log.info("lease %s of kernel %s released: %s", lease.id, kernel_id, reason)


def _later(lease: Lease | None, written: Mapping[str, Lease]) -> Lease | None:
    """``lease`` as written since (versions only grow), or as it is where nothing was."""
    later = written.get(lease.id) if lease is not None else None
    return later if later is not None and later.version > lease.version else lease


def _newest(planned: Sequence[Lease], written: Mapping[str, Lease]) -> tuple[Lease, ...]:
    """A plan's leases, each as written since its transaction where it was: a reclaim step that
    suspended or released a lease while the pass ran in its thread stays done (and a checkpoint
    just taken is not mistaken for an orphan and restored)."""
    out = []
    for lease in planned:
        later = _later(lease, written)
        if later is lease or later.live:
            out.append(later)
    return tuple(out)
