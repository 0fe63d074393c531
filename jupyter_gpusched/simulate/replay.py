"""Replay a trace through the real scheduling core on a virtual clock.

The replay is event driven: trace events (a session starts or stops, a cell is ready, a cell ends,
a checkpoint finishes) are processed in time order, and after each instant the simulator, acting
as the arbiter, runs one :func:`jupyter_gpusched.core.plan` pass, carries out its decisions and
comes back at ``Plan.next_wakeup``. Nothing here decides who gets a GPU: the core does.

How sessions use GPUs, per policy:

* ``dynamic`` / ``hybrid``: lazy binding. A session's first cell claims its lease of
  ``session.gpus`` GPUs; every cell (even a CPU-only one: a kernel cannot know ahead whether a cell
  touches the GPU) needs that lease. The kernel is busy while a cell runs and keeps the last cell's
  GPU memory between cells. A ``checkpoint`` reclaim suspends the lease (the GPUs stay busy until
  the checkpoint is written); the next cell asks for it back and waits for the grant plus the
  restore (memory / bandwidth + a fixed cost). ``restart`` / ``shutdown`` lose the kernel's state
  (a disruption) and the next cell claims anew.
* ``static``: the lease is claimed when the session starts and held until it stops.
* ``oracle`` (baseline, not a core policy): GPUs held exactly while a cell with ``gpus > 0`` runs,
  the cell's own ``gpus``; restores are free; cells queue only when the host is full (each GPU
  cell is a claim in the core's ``static`` queue: first come, first served, smaller claims may
  pass a blocked one for ``backfill_wait``).
* ``cull`` (baseline): static binding plus jupyter_server's idle culler: a kernel idle for
  ``cull_timeout`` is shut down, freeing its GPUs; the next cell the user runs finds it gone (a
  disruption), starts a new kernel and waits for GPUs again.

With ``ReplayOptions.gpus_per_node`` the host is a cluster of nodes, each scheduled on its own
(see :mod:`.nodes`): a session's server is placed on a node when it starts, and its leases only use
that node's GPUs.

A cell's delay is the time from its start in the trace to when it really starts (queue wait plus
restore, plus any delay passed on by the cells before it: a session runs its cells one after
another, each ``duration`` long, the next one at the later of its trace start and the previous
cell's end). A session stops at the later of its trace stop and its last cell's end.
"""

from __future__ import annotations

import heapq
from dataclasses import replace

from ..core import idle
from ..core.ladder import checkpoint_bytes
from ..core import usage as core_usage
from ..core.lifecycle import new_claim, request_resume, step_done, suspended
from ..core.model import Device, KernelActivity, Lease, LeaseState, Step
from ..core.scheduler import plan
from ..core.nodes import choose_node
from . import nodes as cluster
from . import users as user_delays
from .options import CHECKPOINT_FIXED_S, CHECKPOINT_GBPS, GB, ReplayOptions, SimulationError
from .progress import Progress, wanted
from .results import METRICS, POLICIES, Result
from .stats import percentile
from .trace import Session, Trace

__all__ = [
    "CHECKPOINT_FIXED_S", "CHECKPOINT_GBPS", "GB", "METRICS", "POLICIES", "ReplayOptions", "Result",
    "SimulationError", "percentile", "simulate",
]

# Events at one instant are handled in this order: what frees GPUs before what asks for them.
_END, _SUSPENDED, _CULL, _STOP, _START, _READY, _WAKE, _RETURN = range(8)


class _Abort(Exception):
    """A replay stopped early because its outcome was already decided (capacity search)."""


def simulate(
    trace: Trace,
    policy: str,
    gpus: int,
    options: ReplayOptions | None = None,
    *,
    abort_after_late: int | None = None,
    late_after_s: float = 5.0,
    abort_on_disruption: bool = False,
    progress: bool | None = None,
    label: str = "",
) -> Result | None:
    """Replay ``trace`` under ``policy`` on a host of ``gpus`` GPUs.

    ``abort_after_late``: stop and return ``None`` as soon as that many cells waited more than
    ``late_after_s``; ``abort_on_disruption``: likewise at the first disruption (both for searches
    that only need to know whether a host size is good enough). ``progress``: draw a progress bar
    on stderr for a replay that takes more than a few seconds (``None``: when stderr is a
    terminal), headed ``label`` (default: the policy and the host size).
    """
    if policy not in POLICIES:
        raise SimulationError(f"policy must be one of {', '.join(POLICIES)}, not {policy!r}")
    replay = _Replay(trace, policy, gpus, options or ReplayOptions())
    replay.abort_after_late = abort_after_late
    replay.late_after_s = late_after_s
    replay.abort_on_disruption = abort_on_disruption
    bar = Progress(label or f"{policy} on {gpus} GPUs", enabled=wanted() if progress is None else progress)
    replay.progress = bar if bar.enabled else None
    try:
        return replay.run()
    except _Abort:
        return None
    finally:
        bar.close()


class _Kernel:
    """What the simulated arbiter knows of one session's kernel."""

    __slots__ = (
        "session",
        "index",
        "lease_id",
        "claims",
        "waiting",
        "running",
        "memory",
        "util",
        "last_busy_at",
        "restore",
        "resuming",
        "stop_due",
        "stopped",
        "culled",
        "cull_token",
        "gaps",
        "last_active_at",
        "node",
        "ready_at",
    )

    def __init__(self, session: Session) -> None:
        self.session = session
        self.index = 0  # next cell to run
        self.lease_id: str | None = None
        self.claims = 0
        self.waiting = False  # a cell is ready and waits for the lease
        self.running = False  # a cell runs (or its GPU state is being restored)
        self.memory = 0  # bytes the kernel's processes hold on the GPU
        self.util: float | None = None
        self.last_busy_at: float | None = None
        self.restore = 0.0  # restore time the waiting cell will pay once granted
        self.resuming = False
        self.stop_due = False
        self.stopped = False
        self.culled = False
        self.cull_token = 0
        # Idle history of a kernel whose lease was released, for its next claim.
        self.gaps: tuple[float, ...] = ()
        self.last_active_at: float | None = None
        self.node: _Node | None = None  # where its server runs, from its start on
        # When a restore begun on the user's return is done (its next cell waits until then).
        self.ready_at = 0.0

    @property
    def id(self) -> str:
        return self.session.id


class _Node:
    """One node: its GPUs, the live leases its broker schedules, its servers and GPUs held."""

    __slots__ = (
        "index",
        "name",
        "devices",
        "leases",
        "wake_gen",
        "servers",
        "sessions",
        "held",
        "held_since",
        "held_seconds",
        "checkpoint_bytes",
        "usage",
        "swept_at",
    )

    def __init__(self, index: int, name: str, devices: tuple[Device, ...]) -> None:
        self.index = index
        self.name = name
        self.devices = devices
        self.leases: dict[str, Lease] = {}
        self.wake_gen = 0
        self.servers: set[str] = set()  # the kernels (one server each) of the sessions running on it now
        self.checkpoint_bytes = 0  # host memory its checkpoints hold, as of its last pass
        self.sessions = 0  # sessions ever placed on it
        self.held = 0
        self.held_since = 0.0
        self.held_seconds = 0.0
        # Recent usage per user and group, as the node broker's ledger keeps it (core.usage).
        self.usage = core_usage.Book()
        self.swept_at = 0.0

    def change_held(self, now: float, delta: int) -> None:
        self.held_seconds += self.held * (now - self.held_since)
        self.held += delta
        self.held_since = now


class _Replay:
    def __init__(self, trace: Trace, policy: str, gpus: int, options: ReplayOptions) -> None:
        self.trace = trace
        self.policy = policy
        self.options = options
        core_policy = policy if policy in ("dynamic", "hybrid") else "static"
        self.cfg = replace(options.config, policy=core_policy)
        self.caps = options.capabilities
        self.lazy = policy in ("dynamic", "hybrid")
        self.cull_timeout = options.effective_cull_timeout if policy == "cull" else 0.0
        need = trace.largest_claim(per_cell=policy == "oracle")
        if gpus < max(need, 1):
            raise SimulationError(
                f"a host of {gpus} GPUs cannot run this trace: a "
                f"{'cell' if policy == 'oracle' else 'session'} asks for {need} GPUs at once"
            )
        self.gpus = gpus
        per_node = options.gpus_per_node
        if per_node is None:
            self.nodes = [_Node(0, "", self._devices(gpus, ""))]
        else:
            if gpus % per_node:
                raise SimulationError(f"{gpus} GPUs are not a whole number of nodes of {per_node} GPUs")
            # A session's server, and so each of its claims, stays on one node.
            need = trace.largest_claim()
            if per_node < need:
                raise SimulationError(
                    f"nodes of {per_node} GPUs cannot run this trace: a session asks for {need} GPUs at once"
                )
            names = cluster.node_names(gpus // per_node)
            self.nodes = [_Node(i, name, self._devices(per_node, name)) for i, name in enumerate(names)]
        self.by_name = {node.name: node for node in self.nodes}
        self.changed: set[int] = set()
        self.last_placed = len(self.nodes) - 1
        self.kernels = {s.id: _Kernel(s) for s in trace.gpu_sessions}
        if len(self.kernels) != len(trace.gpu_sessions):
            raise SimulationError("session ids in the trace are not unique")
        self.activity: dict[str, KernelActivity] = {}
        self.events: list[tuple] = []
        self.seq = 0
        self.held = 0
        self.held_line: list[tuple[float, int]] = [(0.0, 0)]
        self.busy_changes: list[tuple[float, int]] = []
        self.delays: dict[str, list[float]] = {k: [] for k in self.kernels}
        #: The restore part of each of those delays (seconds; 0 where no restore came first).
        self.restored: dict[str, list[float]] = {k: [] for k in self.kernels}
        self.disruptions = 0
        #: Bytes that checkpoints hold on every node together (as of each node's last pass).
        self.checkpoint_bytes = 0
        self.peak_checkpoint_bytes = 0
        self.suspends = 0
        self.restores = 0
        self.passes = 0
        self.late = 0
        self.abort_after_late: int | None = None
        self.late_after_s = 5.0
        self.abort_on_disruption = False
        self.progress: Progress | None = None

    def _devices(self, count: int, node: str) -> tuple[Device, ...]:
        prefix = f"GPU-sim-{node}-" if node else "GPU-sim-"
        memory = self.options.device_memory
        return tuple(
            Device(uuid=f"{prefix}{i:04d}", index=i, name="simulated GPU", memory_total=memory) for i in range(count)
        )

    # -- the event loop ----------------------------------------------------------------------
    def push(self, at: float, kind: int, kernel: _Kernel | None, data: object = None) -> None:
        self.seq += 1
        heapq.heappush(self.events, (at, kind, self.seq, kernel, data))

    def run(self) -> Result:
        # A session's first events enter the queue only when the replay reaches its start, so
        # that the queue holds what is under way, not the whole trace. They keep the sequence
        # numbers they would have had if queued at the outset (session by session in trace order,
        # before any event pushed during the replay), so events at one instant run in the same
        # order either way.
        self.seq = 3 * len(self.kernels)
        upcoming = sorted(
            (kernel.session.start, 3 * i, kernel) for i, kernel in enumerate(self.kernels.values())
        )
        handlers = {
            _END: self.on_end,
            _SUSPENDED: self.on_suspended,
            _CULL: self.on_cull,
            _STOP: self.on_stop,
            _START: self.on_start,
            _READY: self.on_ready,
            _RETURN: self.on_return,
        }
        first = upcoming[0][0] if upcoming else 0.0
        last = max((k.session.stop for k in self.kernels.values()), default=0.0)
        events = self.events
        arriving = 0
        instants = 0
        while events or arriving < len(upcoming):
            # Admit every session that starts by the next queued instant (or the next session's
            # start, if nothing is queued).
            while arriving < len(upcoming) and (not events or upcoming[arriving][0] <= events[0][0]):
                start, seq, kernel = upcoming[arriving]
                arriving += 1
                session = kernel.session
                heapq.heappush(events, (start, _START, seq, kernel, None))
                heapq.heappush(events, (session.stop, _STOP, seq + 1, kernel, None))
                if session.cells:
                    heapq.heappush(events, (session.cells[0].start, _READY, seq + 2, kernel, None))
            now = events[0][0]
            instants += 1
            if self.progress is not None and instants % 256 == 0:
                self.progress.update(now - first, last - first)
            # The nodes whose brokers have something new to look at, at this instant.
            changed = self.changed
            while events and events[0][0] == now:
                _, kind, _, kernel, data = heapq.heappop(events)
                if kind == _WAKE:
                    node, gen = data
                    if gen == node.wake_gen:
                        changed.add(node.index)
                elif handlers[kind](kernel, now, data) is not False and kernel.node is not None:
                    changed.add(kernel.node.index)
            self.settle_changed(now)
        return self.result()

    def settle_changed(self, now: float) -> None:
        """A pass of every broker with something new to look at, in node order."""
        for index in sorted(self.changed):
            self.settle(self.nodes[index], now)
        self.changed.clear()

    def settle(self, node: _Node, now: float) -> None:
        """Scheduling passes of ``node``'s broker at ``now`` until nothing that was freed can be granted."""
        # The static queue is first come, first served: usage would change nothing there.
        half_life = self.cfg.usage_half_life if self.cfg.policy != "static" else 0.0
        for _ in range(64):
            # As the arbiter's planning transaction: usage accrued up to now orders the queue,
            # and what the pass leaves held accrues from now on.
            recent = node.usage.recent(now, half_life) if half_life > 0 else None
            result = plan(node.devices, node.leases.values(), self.activity, now, self.cfg, self.caps, usage=recent)
            if half_life > 0:
                node.usage.advance(result.leases, node.devices, now, half_life)
                if now - node.swept_at >= half_life:
                    # Housekeeping only: a record forgotten here already counted as 0.
                    node.usage.forget(now, half_life)
                    node.swept_at = now
            self.passes += 1
            node.leases = leases = {lease.id: lease for lease in result.leases}
            freed = False
            for decision in result.decisions:
                if decision.kind == "grant":
                    self.on_grant(leases[decision.lease.id], now)
                elif decision.kind == "reclaim":
                    freed |= self.on_reclaim(leases[decision.lease.id], now)
            if not (freed and result.queue):
                break
        # Checkpoints grow only by what a pass decides: the peak is seen here.
        before = node.checkpoint_bytes
        node.checkpoint_bytes = checkpoint_bytes(node.leases.values())
        if node.checkpoint_bytes > before:
            self.checkpoint_bytes += node.checkpoint_bytes - before
            self.peak_checkpoint_bytes = max(self.peak_checkpoint_bytes, self.checkpoint_bytes)
        else:
            self.checkpoint_bytes -= before - node.checkpoint_bytes
        node.wake_gen += 1
        if result.next_wakeup is not None:
            self.push(result.next_wakeup, _WAKE, None, (node, node.wake_gen))

    # -- bookkeeping ---------------------------------------------------------------------------
    def change_held(self, now: float, delta: int, node: _Node) -> None:
        node.change_held(now, delta)
        self.held += delta
        if self.held_line[-1][0] == now:
            self.held_line[-1] = (now, self.held)
        else:
            self.held_line.append((now, self.held))

    def observe(self, kernel: _Kernel) -> None:
        """What the kernel looks like to the arbiter's monitor from now on."""
        self.activity[kernel.id] = KernelActivity(
            kernel.id,
            busy=kernel.running,
            last_busy_at=kernel.last_busy_at,
            gpu_utilization=kernel.util if kernel.running else 0.0,
            gpu_memory=kernel.memory,
        )

    def disrupted(self) -> None:
        self.disruptions += 1
        if self.abort_on_disruption:
            raise _Abort

    # -- claims and releases --------------------------------------------------------------------
    def claim(self, kernel: _Kernel, now: float, count: int) -> None:
        gaps = kernel.gaps
        if self.lazy and kernel.last_active_at is not None:
            gaps = _with_spell(gaps, now - kernel.last_active_at)
        lease_id = f"{kernel.id}#{kernel.claims}"
        kernel.claims += 1
        kernel.node.leases[lease_id] = new_claim(lease_id, kernel.id, kernel.session.user, now, count=count, gaps=gaps)
        kernel.lease_id = lease_id
        kernel.restore = 0.0
        kernel.resuming = False

    def release(self, kernel: _Kernel, now: float) -> bool:
        """Release the kernel's lease, if any; return whether GPUs were freed."""
        lease = kernel.node.leases.pop(kernel.lease_id, None) if kernel.lease_id else None
        kernel.lease_id = None
        if lease is None:
            return False
        # Its idle history outlives it, for the kernel's next claim.
        kernel.gaps = lease.gaps
        kernel.last_active_at = lease.last_active_at
        if lease.holding:
            self.change_held(now, -lease.count, kernel.node)
            return True
        return False

    def resume(self, kernel: _Kernel, lease: Lease, now: float) -> None:
        resumed = request_resume(lease, now)
        # request_resume moves ``last_active_at`` without recording the idle spell that ends
        # here; record it, or the adaptive timeouts would only ever learn the short pauses.
        if resumed.gaps == lease.gaps and lease.last_active_at is not None:
            resumed = replace(resumed, gaps=_with_spell(lease.gaps, now - lease.last_active_at))
        lease = resumed
        kernel.node.leases[lease.id] = lease
        kernel.restore = self.options.restore_seconds(lease.memory_held, lease.count)
        kernel.resuming = True

    # -- cells -----------------------------------------------------------------------------------
    def start_cell(self, kernel: _Kernel, now: float, delay: float = 0.0) -> None:
        cell = kernel.session.cells[kernel.index]
        begins = now + delay
        kernel.waiting = False
        kernel.running = True
        kernel.memory = int(cell.vram_gb * GB)
        kernel.util = cell.utilization
        kernel.cull_token += 1
        waited = begins - cell.start
        self.delays[kernel.id].append(waited)
        self.restored[kernel.id].append(delay)
        if waited > self.late_after_s:
            self.late += 1
            if self.abort_after_late is not None and self.late >= self.abort_after_late:
                raise _Abort
        ends = begins + cell.duration
        if cell.gpus > 0:
            self.busy_changes.append((begins, cell.gpus))
            self.busy_changes.append((ends, -cell.gpus))
        self.push(ends, _END, kernel)
        self.observe(kernel)

    def on_ready(self, kernel: _Kernel, now: float, _data: object = None) -> None:
        cell = kernel.session.cells[kernel.index]
        kernel.waiting = True
        if self.policy == "oracle":
            if cell.gpus > 0:
                self.claim(kernel, now, cell.gpus)
            else:
                self.start_cell(kernel, now)
            return
        if kernel.culled:
            # The culler shut the kernel down: the user finds it gone and starts a new one.
            kernel.culled = False
            self.disrupted()
        lease = kernel.node.leases.get(kernel.lease_id) if kernel.lease_id else None
        if lease is None:
            self.claim(kernel, now, kernel.session.gpus)
        elif lease.state == LeaseState.SUSPENDED:
            self.resume(kernel, lease, now)
        elif lease.state == LeaseState.PENDING:
            pass  # the grant starts the cell
        elif lease.state == LeaseState.RECLAIMING and lease.reclaim_step == Step.CHECKPOINT:
            pass  # the checkpoint finishes first, then the cell asks for the lease back
        else:
            # A restore begun when the user came back may still be under way.
            self.start_cell(kernel, now, max(0.0, kernel.ready_at - now))

    def on_end(self, kernel: _Kernel, now: float, _data: object = None) -> None:
        kernel.running = False
        kernel.last_busy_at = now
        cells = kernel.session.cells
        kernel.index += 1
        if self.policy == "oracle" and kernel.lease_id:
            kernel.memory = 0
            self.release(kernel, now)
        if self.cull_timeout > 0 and kernel.lease_id:
            self.push(now + self.cull_timeout, _CULL, kernel, kernel.cull_token)
        if kernel.index < len(cells):
            ready = max(cells[kernel.index].start, now)
            lead = self.options.return_lead
            if lead > 0 and self.lazy and ready - lead > now:
                self.push(ready - lead, _RETURN, kernel, kernel.index)
            if ready == now:
                self.on_ready(kernel, now)
            else:
                self.push(ready, _READY, kernel)
        elif kernel.stop_due:
            self.on_stop(kernel, now)
        if not kernel.stopped:
            self.observe(kernel)

    def on_return(self, kernel: _Kernel, now: float, index: object) -> bool:
        """The user is back at the notebook before its next cell: a suspended lease is resumed
        now if a GPU is free for it and nobody waits (the signal never takes a GPU from anyone)."""
        if kernel.stopped or kernel.index != index or kernel.waiting or not kernel.lease_id:
            return False
        node = kernel.node
        lease = node.leases.get(kernel.lease_id)
        if lease is None or lease.state != LeaseState.SUSPENDED:
            return False
        if any(le.state == LeaseState.PENDING for le in node.leases.values()):
            return False
        if len(node.devices) - node.held < lease.count:
            return False
        self.resume(kernel, lease, now)
        return True

    # -- session lifetime and the culler -------------------------------------------------------
    def on_start(self, kernel: _Kernel, now: float, _data: object = None) -> bool:
        if kernel.stopped:
            return False  # a session without cells that stopped the instant it started
        node = self.place(kernel, now)
        kernel.node = node
        node.servers.add(kernel.id)
        node.sessions += 1
        if self.lazy or self.policy == "oracle":
            return False  # nothing to claim before the first cell
        self.claim(kernel, now, kernel.session.gpus)
        return True

    def place(self, kernel: _Kernel, now: float) -> _Node:
        """The node the session's server starts on."""
        if len(self.nodes) == 1:
            return self.nodes[0]
        chosen = None
        if self.options.placement == "hook":
            # The brokers plan as soon as anything changes: the summaries the hook reads already
            # count what happened before the spawn at this instant.
            self.settle_changed(now)
            summaries = {
                node.name: cluster.summary(node.devices, node.leases.values(), now, self.cfg, self.caps, node.servers)
                for node in self.nodes
            }
            name = choose_node(summaries, kernel.session.gpus)
            chosen = self.by_name[name] if name is not None else None
        if chosen is None:
            chosen = self.nodes[cluster.spread([len(node.servers) for node in self.nodes], self.last_placed)]
        self.last_placed = chosen.index
        return chosen

    def on_stop(self, kernel: _Kernel, now: float, _data: object = None) -> None:
        if kernel.running or kernel.waiting or kernel.index < len(kernel.session.cells):
            kernel.stop_due = True  # the user is still running (delayed) cells
            return
        kernel.stopped = True
        if kernel.node is not None:
            self.release(kernel, now)
            kernel.node.servers.discard(kernel.id)
        self.activity.pop(kernel.id, None)

    def on_cull(self, kernel: _Kernel, now: float, token: object) -> bool:
        lease = kernel.node.leases.get(kernel.lease_id) if kernel.lease_id else None
        if token != kernel.cull_token or kernel.running or kernel.waiting or lease is None or not lease.holding:
            return False
        self.release(kernel, now)
        kernel.culled = True
        kernel.memory = 0
        self.observe(kernel)
        return True

    # -- carrying out the core's decisions -----------------------------------------------------
    def on_grant(self, lease: Lease, now: float) -> None:
        kernel = self.kernels[lease.kernel_id]
        self.change_held(now, lease.count, kernel.node)
        if kernel.resuming:
            self.restores += 1
        restore, kernel.restore, kernel.resuming = kernel.restore, 0.0, False
        kernel.ready_at = now + restore
        if kernel.waiting:
            self.start_cell(kernel, now, restore)
        elif self.cull_timeout > 0:
            kernel.cull_token += 1  # a freshly launched kernel is idle from now
            self.push(now + self.cull_timeout, _CULL, kernel, kernel.cull_token)

    def on_reclaim(self, lease: Lease, now: float) -> bool:
        """Carry out ``lease.reclaim_step``; return whether GPUs were freed at once."""
        kernel = self.kernels[lease.kernel_id]
        step = lease.reclaim_step
        if step == Step.CHECKPOINT:
            self.suspends += 1
            done = now + self.options.checkpoint_seconds(lease.memory_held, lease.count)
            self.push(done, _SUSPENDED, kernel, lease.id)
            return False
        if step == Step.FREE_CACHE:
            kernel.node.leases[lease.id] = step_done(lease, step, "framework caches dropped")
            return False
        if step is not None and step.disruptive:
            self.disrupted()
            kernel.memory = 0  # a new kernel process holds nothing yet
            self.observe(kernel)
        return self.release(kernel, now)

    def on_suspended(self, kernel: _Kernel, now: float, lease_id: object) -> bool:
        lease = kernel.node.leases.get(lease_id)  # type: ignore[arg-type]
        if lease is None or lease.state != LeaseState.RECLAIMING:
            return False  # released meanwhile (the session stopped)
        lease = suspended(lease, now)
        kernel.node.leases[lease.id] = lease
        self.change_held(now, -lease.count, kernel.node)
        if kernel.waiting:
            self.resume(kernel, lease, now)
        return True

    # -- the outcome -------------------------------------------------------------------------------
    def result(self) -> Result:
        held_seconds = 0.0
        for (t0, level), (t1, _) in zip(self.held_line, self.held_line[1:]):
            held_seconds += level * (t1 - t0)
        peak = max(level for _, level in self.held_line)
        busy_seconds = self.trace.busy_gpu_seconds()
        busy_line: list[tuple[float, int]] = [(0.0, 0)]
        level = 0
        for t, delta in sorted(self.busy_changes, key=lambda c: (c[0], c[1])):
            level += delta
            if busy_line[-1][0] == t:
                busy_line[-1] = (t, level)
            else:
                busy_line.append((t, level))
        delays = tuple(d for kernel in self.kernels for d in self.delays[kernel])
        per_user = user_delays.by_user(
            (kernel.session.user, kernel.session.gpus, delay, restored)
            for kernel_id, kernel in self.kernels.items()
            for delay, restored in zip(self.delays[kernel_id], self.restored[kernel_id])
        )
        return Result(
            policy=self.policy,
            gpus=self.gpus,
            gpu_hours_held=held_seconds / 3600.0,
            gpu_hours_busy=busy_seconds / 3600.0,
            efficiency=busy_seconds / held_seconds if held_seconds > 0 else None,
            cell_delay_p50_s=percentile(delays, 50),
            cell_delay_p95_s=percentile(delays, 95),
            cell_delay_p99_s=percentile(delays, 99),
            disruptions=self.disruptions,
            suspends=self.suspends,
            restores=self.restores,
            peak_gpus_held=peak,
            peak_checkpoint_host_gb=self.peak_checkpoint_bytes / GB,
            user_delay_p95_max_s=max((u.p95_s for u in per_user.values()), default=0.0),
            users=tuple(sorted(per_user.values(), key=lambda u: u.user)),
            held=tuple(self.held_line),
            busy=tuple(busy_line),
            delays=delays,
            passes=self.passes,
            **self.cluster(),
        )

    def cluster(self) -> dict:
        """The cluster's fields of the result (none for one pool of GPUs)."""
        per_node = self.options.gpus_per_node
        if per_node is None:
            return {}
        end = self.held_line[-1][0]
        return {
            "nodes": len(self.nodes),
            "gpus_per_node": per_node,
            "placement": self.options.placement,
            "node_gpu_hours_held": tuple(
                (node.held_seconds + node.held * (end - node.held_since)) / 3600.0 for node in self.nodes
            ),
            "node_sessions": tuple(node.sessions for node in self.nodes),
        }


def _with_spell(gaps: tuple[float, ...], spell: float) -> tuple[float, ...]:
    if spell < idle.MIN_GAP:
        return gaps
    return (*gaps, spell)[-idle.HISTORY :]
