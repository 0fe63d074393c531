"""Invariants of the scheduling core over random histories.

A small arbiter drives :func:`plan` the way the real one does: claims are admitted, kernels run
and idle, time passes, users keep and release leases, GPUs are drained or lost, and after every
pass the decisions are carried out (a ``reclaim`` releases the lease, or suspends it for a
checkpoint). After every pass the invariants below must hold.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field, replace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jupyter_gpusched.core import (
    EXCLUSIVE,
    SHARED,
    Capabilities,
    Device,
    GiB,
    Health,
    KernelActivity,
    Lease,
    LeaseState,
    Plan,
    SchedConfig,
    SchedulingError,
    Step,
    admit,
    device_lost,
    keep,
    new_claim,
    plan,
    released,
    request_resume,
    step_done,
    step_failed,
    suspended,
)
from jupyter_gpusched.core.fairness import AGING_FACTOR
from jupyter_gpusched.core.placement import place

PROFILE = settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

USERS = ("u0", "u1", "u2", "u3")
IDLE_TIMEOUT = 30.0
MAX_KEEP = 600.0

# -- worlds and histories -----------------------------------------------------------------------


@dataclass(frozen=True)
class World:
    devices: tuple[Device, ...]
    cfg: SchedConfig
    caps: Capabilities


@st.composite
def worlds(draw) -> World:
    n = draw(st.integers(2, 4))
    layout = draw(st.sampled_from(["plain", "nvlink", "mixed", "mig"]))
    if layout == "plain":
        devices = [Device(f"G{i}", i, "A100") for i in range(n)]
    elif layout == "nvlink":
        devices = [Device(f"G{i}", i, "A100", group=f"nv{i * 2 // n}") for i in range(n)]
    elif layout == "mixed":
        devices = [
            Device(f"G{i}", i, "A100" if i % 2 else "L40", 80 * GiB if i % 2 else 40 * GiB) for i in range(n)
        ]
    else:
        devices = [
            Device("P0", 0, "A100", 80 * GiB),
            Device("M0", 1, "A100 3g.40gb", 40 * GiB, parent="P0"),
            Device("M1", 2, "A100 3g.40gb", 40 * GiB, parent="P0"),
        ] + [Device(f"G{i}", 3 + i, "A100") for i in range(n - 2)]
    cfg = SchedConfig(
        policy=draw(st.sampled_from(["static", "dynamic", "hybrid", "hybrid"])),
        idle_timeout=IDLE_TIMEOUT,
        contended_idle_timeout=10.0,
        release_timeout=draw(st.sampled_from([0.0, 300.0])),
        grace_period=draw(st.sampled_from([0.0, 20.0])),
        reclaim_fallback=draw(st.sampled_from(["restart", "shutdown", "none"])),
        max_keep=MAX_KEEP,
        quotas=draw(st.sampled_from([{}, {"*": 1}, {"user:u0": 2, "*": 1}, {"user:u0": 0, "*": 2}])),
        adaptive=draw(st.booleans()),
        backfill_wait=60.0,
        max_pending_per_user=draw(st.sampled_from([0, 0, 3])),
    )
    caps = Capabilities(checkpoint=draw(st.booleans()), remap=draw(st.booleans()))
    return World(tuple(devices), cfg, caps)


pick = st.integers(0, 63)
claims = st.tuples(
    st.just("claim"),
    st.sampled_from(USERS),
    st.sampled_from([1, 1, 1, 2, 3]),
    st.sampled_from([EXCLUSIVE, SHARED]),
    st.sampled_from([None, 10 * GiB, 30 * GiB, 50 * GiB]),
    st.integers(0, 1),
    st.one_of(st.none(), st.none(), st.none(), pick),  # sometimes from the kernel of an existing lease
)
activity = st.tuples(
    st.just("activity"), pick, st.booleans(), st.sampled_from([0, None, GiB]), st.sampled_from([None, 0.0, 50.0])
)
advance = st.tuples(st.just("advance"), st.sampled_from([1.0, 5.0, 11.0, 31.0, 61.0, 130.0, 301.0, 700.0]))
tick = st.tuples(st.just("tick"))
# Repeated branches are drawn more often: claims, ticks and time keep the host busy.
events = st.one_of(
    claims,
    tick,
    advance,
    activity,
    claims,
    advance,
    st.tuples(st.just("resume"), pick),
    st.tuples(st.just("release"), pick),
    activity,
    st.tuples(st.just("keep"), pick, st.sampled_from([0.0, 60.0, MAX_KEEP, MAX_KEEP + 1])),
    advance,
    st.tuples(st.just("resume"), pick),
    st.tuples(st.just("health"), pick, st.sampled_from([Health.OK, Health.DRAINED, Health.LOST])),
    st.tuples(st.just("fail-next-checkpoint")),
    tick,
)
histories = st.lists(events, min_size=20, max_size=80)

# -- the arbiter --------------------------------------------------------------------------------


def placeable(lease: Lease, devices, leases, caps: Capabilities):
    """Where ``lease`` could go among ``leases``, with the restore rules the arbiter promises."""
    if lease.home:
        if caps.remap:
            by_uuid = {d.uuid: d for d in devices}
            return place(lease, devices, leases, same_model_as=[by_uuid[u] for u in lease.home if u in by_uuid])
        return place(lease, devices, leases, only=lease.home)
    return place(lease, devices, leases)


@dataclass
class Arbiter:
    world: World
    devices: list[Device] = field(init=False)
    leases: dict[str, Lease] = field(default_factory=dict)
    activity: dict[str, KernelActivity] = field(default_factory=dict)
    now: float = 0.0
    trace: list = field(default_factory=list)
    accepted: list[str] = field(default_factory=list)
    granted: set[str] = field(default_factory=set)
    withdrawn: set[str] = field(default_factory=set)
    fail_checkpoint: bool = False
    failed_checkpoints: int = 0
    serial: int = 0

    def __post_init__(self) -> None:
        self.devices = list(self.world.devices)

    @property
    def cfg(self) -> SchedConfig:
        return self.world.cfg

    @property
    def caps(self) -> Capabilities:
        return self.world.caps

    def live(self) -> list[Lease]:
        return [le for le in self.leases.values() if le.live]

    def chosen(self, index: int, predicate=lambda le: True) -> Lease | None:
        candidates = [le for le in self.live() if predicate(le)]
        return candidates[index % len(candidates)] if candidates else None

    # -- events ---------------------------------------------------------------------------------
    def apply(self, event: tuple) -> None:
        kind = event[0]
        if kind == "claim":
            _, user, count, mode, memory, priority, same_kernel = event
            self.serial += 1
            lease_id = f"L{self.serial}"
            kernel_id = f"K{self.serial}"
            if same_kernel is not None and self.leases:
                kernel_id = list(self.leases.values())[same_kernel % len(self.leases)].kernel_id
            claim = new_claim(
                lease_id, kernel_id, user, self.now, count=count, memory=memory, mode=mode, priority=priority
            )
            try:
                admit(claim, self.devices, self.leases.values(), self.cfg)
            except SchedulingError:
                self.trace.append(("refused", lease_id))
                return
            clash = [le for le in self.live() if le.kernel_id == kernel_id]
            assert not clash, "admit() let a kernel have two live leases"
            self.leases[lease_id] = claim
            self.accepted.append(lease_id)
            self.activity.setdefault(kernel_id, KernelActivity(kernel_id))
        elif kind == "release":
            lease = self.chosen(event[1])
            if lease is not None:
                if lease.state == LeaseState.PENDING:
                    self.withdrawn.add(lease.id)
                self.leases[lease.id] = released(lease, self.now, "released by the user")
        elif kind == "activity":
            _, index, busy, memory, utilization = event
            lease = self.chosen(index)
            if lease is not None:
                self.activity[lease.kernel_id] = KernelActivity(
                    lease.kernel_id, busy=busy, gpu_memory=memory, gpu_utilization=utilization
                )
        elif kind == "advance":
            self.now += event[1]
        elif kind == "keep":
            _, index, seconds = event
            lease = self.chosen(index)
            if lease is not None:
                if seconds > self.cfg.max_keep:
                    try:
                        keep(lease, seconds, self.now, self.cfg)
                    except SchedulingError:
                        pass
                    else:
                        raise AssertionError("keep() beyond max_keep was accepted")
                else:
                    kept = keep(lease, seconds, self.now, self.cfg)
                    if lease.state == LeaseState.RECLAIMING and seconds > 0:
                        assert kept.state == LeaseState.ACTIVE or not kept.reclaim_step.disruptive
                    self.leases[lease.id] = kept
        elif kind == "resume":
            lease = self.chosen(event[1], lambda le: le.state == LeaseState.SUSPENDED)
            if lease is not None:
                self.leases[lease.id] = request_resume(lease, self.now)
        elif kind == "health":
            _, index, health = event
            device = self.devices[index % len(self.devices)]
            if device.health == Health.LOST:
                return  # a lost GPU does not come back
            self.devices[index % len(self.devices)] = replace(device, health=health)
            if health == Health.LOST:
                for lease in self.live():
                    if lease.holding and device.uuid in lease.devices:
                        self.leases[lease.id] = device_lost(lease, device.uuid, device.index, self.now)
        elif kind == "fail-next-checkpoint":
            self.fail_checkpoint = True
        elif kind == "tick":
            pass
        else:  # pragma: no cover - the strategy makes only the kinds above
            raise AssertionError(kind)

    # -- passes ---------------------------------------------------------------------------------
    def run_pass(self) -> Plan:
        inputs = {le.id: le for le in self.live()}
        result = plan(self.devices, self.leases.values(), self.activity, self.now, self.cfg, self.caps)
        check_pass(self, inputs, result)
        self.trace.append(result)
        self.leases.update({le.id: le for le in result.leases})
        for decision in result.decisions:
            if decision.kind == "grant":
                self.granted.add(decision.lease.id)
            if decision.kind == "reclaim":
                self.carry_out(self.leases[decision.lease.id])
        return result

    def carry_out(self, lease: Lease) -> None:
        step = lease.reclaim_step
        if step == Step.CHECKPOINT and self.fail_checkpoint:
            self.fail_checkpoint = False
            self.failed_checkpoints += 1
            self.leases[lease.id] = step_failed(lease, step, "the kernel uses UVM memory")
        elif step == Step.CHECKPOINT:
            self.leases[lease.id] = suspended(lease, self.now)
        elif step == Step.FREE_CACHE:
            self.leases[lease.id] = step_done(lease, step, "framework caches dropped")
        else:
            self.leases[lease.id] = released(lease, self.now, f"reclaimed: {step}")


# -- invariants ---------------------------------------------------------------------------------


def explicit_quota(cfg: SchedConfig, user: str) -> float:
    quotas = cfg.quotas
    return float(quotas.get(f"user:{user}", quotas["*"]))


def borrowed_ids(leases, cfg: SchedConfig) -> set[str]:
    """Holding leases beyond their user's explicit quota, newest first counted as borrowed."""
    by_user = defaultdict(list)
    for lease in leases:
        if lease.holding:
            by_user[lease.user].append(lease)
    out = set()
    for user, held in by_user.items():
        total = 0
        for lease in sorted(held, key=lambda le: (le.granted_at or 0.0, le.id)):
            total += lease.count
            if total > explicit_quota(cfg, user):
                out.add(lease.id)
    return out


def check_pass(arb: Arbiter, inputs: dict[str, Lease], result: Plan) -> None:
    cfg, caps, now = arb.cfg, arb.caps, arb.now
    by_uuid = {d.uuid: d for d in arb.devices}
    parents = {d.parent for d in arb.devices if d.parent}
    after = list(result.leases)

    # Never two exclusive leases (or an exclusive and a shared one) on one device, never more
    # memory promised on a device than it has.
    for device in arb.devices:
        on = [le for le in after if le.holding and device.uuid in le.devices]
        exclusive = [le for le in on if le.mode == EXCLUSIVE]
        assert len(exclusive) <= 1, f"two exclusive leases on {device.uuid}: {exclusive}"
        assert not exclusive or len(on) == 1, f"an exclusive lease shares {device.uuid}: {on}"
        assert sum(le.promised_memory(device) for le in on) <= device.memory_total

    for lease in after:
        if lease.holding:
            assert len(lease.devices) == len(set(lease.devices)) == lease.count
        else:
            assert lease.devices == ()

    grants = [d.lease for d in result.decisions if d.kind == "grant"]
    for lease in grants:
        assert inputs[lease.id].state == LeaseState.PENDING
        for uuid in lease.devices:
            device = by_uuid[uuid]
            assert device.health == Health.OK, f"granted {device.health} {uuid}"
            assert uuid not in parents, f"granted a whole GPU that is split into MIG instances: {uuid}"
            assert lease.memory is None or lease.memory <= device.memory_total
        if lease.home and not caps.remap:
            assert set(lease.devices) == set(lease.home), "restored away from home without remapping"
        if lease.home and caps.remap:
            models = {by_uuid[u].name for u in lease.home}
            assert {by_uuid[u].name for u in lease.devices} <= models, "restored onto another model"

    for decision in result.decisions:
        if decision.kind not in ("notice", "reclaim"):
            continue
        lease = decision.lease
        before = inputs[lease.id]
        assert cfg.policy != "static", "the static policy took a GPU back"
        assert lease.holding
        assert not lease.busy, "a reclaim was decided for a kernel that is running"
        assert lease.keep_until is None or lease.keep_until <= now, "a kept lease was reclaimed"
        step = lease.reclaim_step
        assert step is not None
        if decision.kind == "notice":
            assert step.disruptive and lease.reclaim_at == now + cfg.grace_period
        elif step.disruptive:
            assert lease.reclaim_at is not None and lease.reclaim_at <= now
            if cfg.grace_period > 0:
                assert before.state == LeaseState.RECLAIMING and before.reclaim_step == step, (
                    "a restart or shutdown was carried out without notice"
                )
        if step == Step.RESTART or step == Step.SHUTDOWN:
            assert cfg.reclaim_fallback == step.value

    if cfg.policy == "hybrid" and "*" in cfg.quotas:
        check_quotas(arb, inputs, result)


def check_quotas(arb: Arbiter, inputs: dict[str, Lease], result: Plan) -> None:
    cfg, now = arb.cfg, arb.now
    before = [le for le in inputs.values()]

    # A lease within its user's quota is taken back only after release_timeout, or sooner for
    # another claim of the same user (the quota protects a user from others, not one of their
    # notebooks from another).
    if not cfg.adaptive:
        borrowed = borrowed_ids(before, cfg)
        waiting_users = {le.user for le in before if le.state == LeaseState.PENDING}
        for decision in result.decisions:
            lease = decision.lease
            if decision.kind in ("notice", "reclaim") and lease.id not in borrowed:
                idle_for = lease.idle_seconds(now)
                assert (cfg.release_timeout > 0 and idle_for >= cfg.release_timeout) or (
                    lease.user in waiting_users and idle_for >= cfg.contended_idle_timeout
                ), f"lease {lease.id} within quota reclaimed after {idle_for}s idle"

    # A claim that keeps its user within quota and fits on free GPUs is not passed over for a
    # claim of another user that borrows (unless that one has waited long enough to age).
    held = defaultdict(int)
    for lease in result.leases:
        if lease.holding:
            held[lease.user] += lease.count
    waiting = [le for le in result.leases if le.state == LeaseState.PENDING]
    holding = [le for le in before if le.holding]
    for decision in result.decisions:
        if decision.kind != "grant":
            continue
        grant = decision.lease
        user_held_before = sum(le.count for le in holding if le.user == grant.user)
        borrows = user_held_before + grant.count > explicit_quota(cfg, grant.user)
        aged = now - inputs[grant.id].queued_at >= cfg.backfill_wait * AGING_FACTOR
        if borrows and not aged:
            for claim in waiting:
                within = held[claim.user] + claim.count <= explicit_quota(cfg, claim.user)
                if claim.user != grant.user and within:
                    assert placeable(claim, arb.devices, holding, arb.caps) is None, (
                        f"{claim.id} of {claim.user} (within quota) waits while {grant.id} of "
                        f"{grant.user} borrows"
                    )
        holding.append(grant)


# -- the properties -----------------------------------------------------------------------------


def replay(world: World, history) -> Arbiter:
    """Apply the history; a pass runs on every tick and whenever time moves, as the arbiter's
    reconcile loop does (so several claims and releases can land between two passes)."""
    arb = Arbiter(world)
    for event in history:
        arb.apply(event)
        if event[0] in ("tick", "advance"):
            arb.run_pass()
    arb.run_pass()
    return arb


@PROFILE
@given(worlds(), histories)
def test_invariants_hold_after_every_pass(world, history):
    replay(world, history)


@settings(PROFILE, max_examples=60)
@given(worlds(), histories)
def test_the_same_history_gives_the_same_decisions(world, history):
    assert replay(world, history).trace == replay(world, history).trace


def could_ever_fit(arb: Arbiter, lease: Lease) -> bool:
    return placeable(lease, arb.devices, (), arb.caps) is not None


@PROFILE
@given(worlds(), histories, st.booleans())
def test_every_admitted_claim_is_granted_once_the_others_let_go(world, history, reclaim):
    """After any history, kernels stop computing: every claim that still fits is served.

    Either the users release their leases (``reclaim`` False) or the kernels just sit idle and the
    scheduler takes the GPUs back on its own (where the policy and the ladder allow it).
    """
    cfg = world.cfg
    arb = replay(world, history)
    arb.fail_checkpoint = False
    # With reclaim_fallback 'none', an idle lease is taken back only by a checkpoint; one whose
    # checkpoint failed stays until its kernel lets go, as documented.
    gentle_only = cfg.reclaim_fallback == "none"
    can_take_back = (
        cfg.policy != "static"
        and cfg.release_timeout > 0
        and (not gentle_only or (world.caps.checkpoint and not arb.failed_checkpoints))
    )
    reclaim = reclaim and can_take_back
    for kernel_id in list(arb.activity):
        arb.activity[kernel_id] = KernelActivity(kernel_id, busy=False, gpu_memory=GiB, gpu_utilization=0.0)
    for _ in range(120):
        if not reclaim:
            for lease in arb.live():
                if lease.holding:
                    arb.leases[lease.id] = released(lease, arb.now, "released by the user")
        arb.now += 100.0
        arb.run_pass()
        waiting = [le for le in arb.live() if le.state == LeaseState.PENDING and could_ever_fit(arb, le)]
        if not waiting:
            break
    starved = [
        arb.leases[lid]
        for lid in arb.accepted
        if lid not in arb.granted and lid not in arb.withdrawn and could_ever_fit(arb, arb.leases[lid])
    ]
    assert not starved, f"never granted: {starved}"


@st.composite
def quota_worlds(draw) -> World:
    n = draw(st.integers(2, 3))
    devices = tuple(Device(f"G{i}", i, "A100", group=f"nv{i * 2 // n}") for i in range(n))
    cfg = SchedConfig(
        policy="hybrid",
        idle_timeout=IDLE_TIMEOUT,
        contended_idle_timeout=10.0,
        release_timeout=300.0,
        grace_period=20.0,
        max_keep=MAX_KEEP,
        quotas=draw(st.sampled_from([{"*": 1}, {"user:u0": 2, "*": 1}, {"user:u0": 0, "*": 2}])),
        adaptive=False,
        backfill_wait=60.0,
    )
    return World(devices, cfg, Capabilities(checkpoint=draw(st.booleans())))


busy_claims = st.tuples(
    st.just("claim"),
    st.sampled_from(USERS[:3]),
    st.sampled_from([1, 1, 2, 3]),
    st.sampled_from([EXCLUSIVE, EXCLUSIVE, SHARED]),
    st.sampled_from([None, 30 * GiB, 50 * GiB]),
    st.integers(0, 1),
    st.none(),
)
contended_histories = st.lists(
    st.one_of(
        busy_claims,
        tick,
        busy_claims,
        st.tuples(st.just("release"), pick),
        busy_claims,
        tick,
        st.tuples(st.just("activity"), pick, st.just(True), st.just(GiB), st.just(None)),
        st.tuples(st.just("advance"), st.sampled_from([5.0, 11.0, 31.0])),
    ),
    min_size=10,
    max_size=50,
)


@PROFILE
@given(quota_worlds(), contended_histories)
def test_quotas_hold_when_the_host_is_contended(world, history):
    replay(world, history)


# -- adaptive idle timeouts ---------------------------------------------------------------------

from jupyter_gpusched.core import idle  # noqa: E402

TIMEOUT_CFG = SchedConfig(idle_timeout=300.0, release_timeout=3600.0)
spells = st.floats(min_value=idle.MIN_GAP, max_value=100_000.0, allow_nan=False)
# Short: no pause past the earliest early point plus idle_timeout.
short_spells = st.floats(min_value=idle.MIN_GAP, max_value=300.0 * (1 + idle.FLOOR), allow_nan=False)
other_kernels = st.lists(st.lists(spells, max_size=12), max_size=40)


def kernel_lease(lease_id, gaps):
    return Lease(lease_id, f"k-{lease_id}", "u0", state=LeaseState.ACTIVE, devices=("G0",), gaps=tuple(gaps))


@PROFILE
@given(own=st.lists(short_spells, max_size=idle.HISTORY), others=other_kernels)
def test_a_kernel_whose_own_pauses_are_short_is_never_taken_back_early(own, others):
    lease = kernel_lease("me", own)
    host = [lease, *(kernel_lease(f"o{i}", gaps) for i, gaps in enumerate(others))]
    found = idle.timeouts(lease, idle.host_prior(host), TIMEOUT_CFG)
    assert found.idle_after == TIMEOUT_CFG.idle_timeout
    assert found.keep_after == TIMEOUT_CFG.release_timeout


@PROFILE
@given(own=st.lists(spells, max_size=idle.HISTORY), others=other_kernels, where=st.integers(0, 40))
def test_early_timeouts_come_only_from_a_kernels_own_history_counted_once(own, others, where):
    lease = kernel_lease("me", own)
    rest = [kernel_lease(f"o{i}", gaps) for i, gaps in enumerate(others)]
    with_it = idle.timeouts(lease, idle.host_prior([*rest[:where], lease, *rest[where:]]), TIMEOUT_CFG)
    # The host's history pads the kernel's own; it never counts the kernel's spells a second time.
    assert with_it == idle.timeouts(lease, idle.host_prior(rest), TIMEOUT_CFG)
    # A gentle step before release_timeout, or idle before idle_timeout, only for a kernel that has
    # itself once paused that long and then a further idle_timeout.
    longest = max(own, default=0.0)
    if with_it.keep_after is not None and with_it.keep_after < TIMEOUT_CFG.release_timeout:
        assert longest > with_it.keep_after + TIMEOUT_CFG.idle_timeout
    if with_it.idle_after < TIMEOUT_CFG.idle_timeout:
        assert longest > with_it.idle_after + TIMEOUT_CFG.idle_timeout
    assert with_it.idle_after <= (with_it.keep_after or float("inf"))
