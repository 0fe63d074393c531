"""Fair share with memory: recent usage decayed with a half-life, in the queue and in reclaims."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jupyter_gpusched.core import (
    SHARED,
    Device,
    GiB,
    KernelActivity,
    Lease,
    LeaseState,
    SchedConfig,
    SchedulingError,
    new_claim,
    plan,
)
from jupyter_gpusched.core import fairness, usage
from jupyter_gpusched.core.usage import Accrued

PROFILE = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DAY = 86400.0
NOW = 1_000_000.0


def gpus(n: int) -> tuple[Device, ...]:
    return tuple(Device(f"G{i}", i) for i in range(n))


def holding(lease_id: str, user: str, devices: tuple[str, ...], *, idle_since: float, groups=()) -> Lease:
    return replace(
        new_claim(lease_id, f"k-{lease_id}", user, 0.0, count=len(devices), groups=tuple(groups)),
        state=LeaseState.IDLE,
        devices=devices,
        granted_at=1.0,
        last_active_at=idle_since,
        version=1,
    )


def pending(lease_id: str, user: str, at: float, *, groups=(), priority: int = 0) -> Lease:
    return new_claim(lease_id, f"k-{lease_id}", user, at, groups=tuple(groups), priority=priority)


# -- the decay -----------------------------------------------------------------------------------


@PROFILE
@given(
    used=st.floats(0, 1e9, allow_nan=False),
    half_life=st.floats(1.0, 1e7, allow_nan=False),
)
def test_usage_halves_in_one_half_life(used, half_life):
    assert usage.decay(used, 0.0, half_life, half_life) == pytest.approx(used / 2, rel=1e-9, abs=1e-9)
    # And through the records, as the arbiter and the simulator keep them.
    records = {"user:a": Accrued(used, 0.0, NOW)}
    left = used / 2 if used / 2 >= usage.FORGET_BELOW else 0.0  # under a GPU-second: forgotten
    assert usage.recent(records, NOW + half_life, half_life)["user:a"] == pytest.approx(left, rel=1e-9, abs=1e-9)


@PROFILE
@given(
    used=st.floats(0, 1e7, allow_nan=False),
    held=st.floats(0, 16, allow_nan=False),
    half_life=st.floats(60.0, 1e6, allow_nan=False),
    steps=st.lists(st.floats(0.0, 5e4, allow_nan=False), min_size=1, max_size=8),
)
def test_integration_is_exact_however_the_time_is_cut(used, held, half_life, steps):
    """Many short passes or one long one: the same usage (what an exact integral gives)."""
    one = usage.decay(used, held, sum(steps), half_life)
    many = used
    for dt in steps:
        many = usage.decay(many, held, dt, half_life)
    assert many == pytest.approx(one, rel=1e-9, abs=1e-6)
    # Held long enough, usage tends to held * h / ln 2 (the GPU-seconds of one "mean lifetime").
    assert usage.decay(0.0, held, 60 * half_life, half_life) == pytest.approx(held * half_life / math.log(2), rel=1e-9)


def test_a_book_counts_users_groups_and_shared_fractions():
    devices = (Device("G0", 0, memory_total=80 * GiB), Device("G1", 1, memory_total=80 * GiB))
    whole = holding("a", "alice", ("G0",), idle_since=0.0, groups=("ml",))
    half = replace(
        holding("b", "bob", ("G1",), idle_since=0.0, groups=("ml", "nlp")), mode=SHARED, memory=40 * GiB
    )
    book = usage.Book()
    written = book.advance([whole, half], devices, NOW, DAY)
    assert written == book.records == {
        "user:alice": Accrued(0.0, 1.0, NOW),
        "user:bob": Accrued(0.0, 0.5, NOW),
        "group:ml": Accrued(0.0, 1.5, NOW),
        "group:nlp": Accrued(0.0, 0.5, NOW),
    }
    # Holding the same, nothing is written: each record stays exact as it is.
    assert book.advance([whole, half], devices, NOW + 60, DAY) == {}
    # An hour later alice used a bit under one GPU-hour (it decays while it accrues).
    recent = book.recent(NOW + 3600, DAY)
    assert recent["user:alice"] == pytest.approx(usage.decay(0.0, 1.0, 3600, DAY))
    assert 3500 < recent["user:alice"] < 3600
    assert recent["group:ml"] == pytest.approx(1.5 * recent["user:alice"])
    written = book.advance([], devices, NOW + 3600, DAY)
    assert set(written) == set(book.records) and all(r.held == 0 and r.as_of == NOW + 3600 for r in written.values())
    assert book.recent(NOW + 3600, DAY)["user:alice"] == pytest.approx(recent["user:alice"])
    # Long after, what is left counts as 0, and leaves the book when swept.
    assert book.recent(NOW + 60 * DAY, DAY)["user:alice"] == 0.0
    assert sorted(book.forget(NOW + 60 * DAY, DAY)) == ["group:ml", "group:nlp", "user:alice", "user:bob"]
    assert book.records == {}
    # With the half-life at 0 nothing is kept.
    assert usage.Book().advance([whole], devices, NOW, 0.0) == {}
    assert dict(usage.recent({"user:a": Accrued(9.0, 1.0, NOW)}, NOW, 0.0)) == {}


def test_negative_half_life_is_refused():
    with pytest.raises(SchedulingError, match="usage_half_life must be 0"):
        SchedConfig(usage_half_life=-1)
    with pytest.raises(SchedulingError, match="usage_half_life"):
        SchedConfig(usage_half_life=math.inf)


# -- the queue -----------------------------------------------------------------------------------


@st.composite
def contests(draw):
    """Users who each hold the same GPUs and wait with one claim alike in all but recent usage."""
    n_users = draw(st.integers(2, 4))
    held_each = draw(st.integers(0, 1))
    free = draw(st.integers(0, n_users - 1))
    quota = draw(st.sampled_from([None, 1, 2]))
    policy = draw(st.sampled_from(["hybrid", "dynamic"]))
    used = draw(st.lists(st.floats(0, 1e6, allow_nan=False), min_size=n_users, max_size=n_users))
    names = draw(st.permutations([f"u{i}" for i in range(n_users)]))
    return n_users, held_each, free, quota, policy, used, names


@PROFILE
@given(contests())
def test_more_recent_usage_never_goes_ahead_of_less(contest):
    n_users, held_each, free, quota, policy, used, names = contest
    devices = gpus(n_users * held_each + free)
    leases = []
    for i, user in enumerate(names):
        for j in range(held_each):
            index = i * held_each + j
            leases.append(holding(f"h{index}", user, (f"G{index}",), idle_since=NOW))  # idle just now
        leases.append(pending(f"p-{user}", user, NOW - 10))
    cfg = SchedConfig(policy=policy, quotas={"*": quota} if quota is not None else {})
    recent = {f"user:{user}": u for user, u in zip(names, used)}
    activity = {le.kernel_id: KernelActivity(le.kernel_id) for le in leases}
    result = plan(devices, leases, activity, NOW, cfg, usage=recent)
    granted = [d.lease.user for d in result.decisions if d.kind == "grant"]
    waiting = [result.lease(lid).user for lid in result.queue]
    order = granted + waiting
    assert sorted(order) == sorted(names)
    for ahead, behind in zip(order, order[1:]):
        assert recent[f"user:{ahead}"] <= recent[f"user:{behind}"], (order, recent)


@PROFILE
@given(
    usage_values=st.lists(st.floats(0, 1e6, allow_nan=False), min_size=3, max_size=3),
    priorities=st.lists(st.integers(-2, 2), min_size=3, max_size=3),
    ages=st.lists(st.floats(0, 1e3, allow_nan=False), min_size=3, max_size=3),
)
def test_half_life_zero_orders_exactly_as_without_usage(usage_values, priorities, ages):
    devices = gpus(2)
    users = ("a", "b", "c")
    leases = [holding("h0", "a", ("G0",), idle_since=NOW), holding("h1", "b", ("G1",), idle_since=NOW)]
    leases += [pending(f"p{i}", u, NOW - ages[i], priority=priorities[i]) for i, u in enumerate(users)]
    cfg = SchedConfig(usage_half_life=0)
    recent = {f"user:{u}": v for u, v in zip(users, usage_values)}
    with_usage = plan(devices, leases, {}, NOW, cfg, usage=recent)
    without = plan(devices, leases, {}, NOW, cfg)
    assert with_usage == without
    # With usage on and nobody having used anything, the order is the same as well.
    assert plan(devices, leases, {}, NOW, SchedConfig(), usage={}).queue == without.queue


@st.composite
def histories(draw):
    """Who held how many GPUs for how long, then who waits."""
    steps = draw(
        st.lists(
            st.tuples(st.floats(1, 2e5, allow_nan=False), st.lists(st.integers(0, 2), min_size=3, max_size=3)),
            min_size=1,
            max_size=6,
        )
    )
    waiting = draw(st.lists(st.sampled_from(["a", "b", "c"]), min_size=1, max_size=6))
    groups = draw(st.lists(st.sampled_from([(), ("ml",), ("ml", "nlp")]), min_size=3, max_size=3))
    return steps, waiting, groups


def _replay(steps, waiting, groups, shuffle: random.Random | None):
    users = ("a", "b", "c")
    devices = gpus(6)
    records: dict[str, Accrued] = {}
    now = NOW
    cfg = SchedConfig(quotas={"*": 1})
    for dt, counts in steps:
        held = []
        free = iter(d.uuid for d in devices)
        for user, count, grp in zip(users, counts, groups):
            if count:
                held.append(holding(f"{user}{now}", user, tuple(next(free) for _ in range(count)), idle_since=now, groups=grp))
        if shuffle is not None:
            shuffle.shuffle(held)
            records = dict(shuffle.sample(list(records.items()), len(records)))
        book = usage.Book(records)
        book.advance(held, devices, now, cfg.usage_half_life)
        records = book.records
        now += dt
    claims = [pending(f"w{i}", user, now - 5, groups=groups[users.index(user)]) for i, user in enumerate(waiting)]
    if shuffle is not None:
        shuffle.shuffle(claims)
    # Every GPU held by someone else: everyone waits, in fair order.
    wall = [holding("wall", "z", tuple(d.uuid for d in devices), idle_since=now)]
    recent = usage.recent(records, now, cfg.usage_half_life)
    result = plan(devices, wall + claims, {"k-wall": KernelActivity("k-wall", busy=True)}, now, cfg, usage=recent)
    by_id = {le.id: le for le in result.leases}
    reasons = fairness.explain([by_id[i] for i in result.queue], result.keys, result.usage, now, cfg)
    return result.queue, reasons


@PROFILE
@given(histories(), st.integers(0, 2**32))
def test_the_same_history_gives_the_same_order(history, seed):
    steps, waiting, groups = history
    first = _replay(steps, waiting, groups, None)
    assert _replay(steps, waiting, groups, None) == first
    # The order in which leases and records happen to be listed changes nothing.
    assert _replay(steps, waiting, groups, random.Random(seed)) == first


def test_queue_reason_names_the_factor():
    devices = gpus(2)
    leases = [
        holding("h0", "zed", ("G0",), idle_since=NOW),
        holding("h1", "zed", ("G1",), idle_since=NOW),
        pending("p-alice", "alice", NOW - 30),
        pending("p-bob", "bob", NOW - 20),
        pending("p-carol", "carol", NOW - 10),
    ]
    activity = {le.kernel_id: KernelActivity(le.kernel_id, busy=True) for le in leases[:2]}
    cfg = SchedConfig(quotas={"*": 1})
    recent = {"user:alice": 41.2 * 3600, "user:bob": 3600.0, "user:carol": 0.0}
    result = plan(devices, leases, activity, NOW, cfg, usage=recent)
    by_id = {le.id: le for le in result.leases}
    assert [by_id[i].user for i in result.queue] == ["carol", "bob", "alice"]
    reasons = fairness.explain([by_id[i] for i in result.queue], result.keys, result.usage, NOW, cfg)
    assert reasons["p-carol"] == "1st in line: within quota; carol used no GPU time recently (half-life 1 day)"
    assert reasons["p-alice"] == (
        "3rd in line: within quota; alice used 41.2 GPU-hours recently (half-life 1 day); "
        "ahead of it: 2 claims of users who used less of their quota recently"
    )
    # A larger guarantee allows more use: with a quota of 100 GPUs alice's 41 hours weigh least.
    cfg = SchedConfig(quotas={"*": 1, "user:alice": 100})
    result = plan(devices, leases, activity, NOW, cfg, usage=recent)
    assert [result.lease(i).user for i in result.queue] == ["carol", "alice", "bob"]


def test_group_usage_breaks_a_tie_between_users():
    devices = gpus(1)
    leases = [
        holding("h0", "zed", ("G0",), idle_since=NOW),
        pending("p-a", "a", NOW - 30, groups=("busy",)),
        pending("p-b", "b", NOW - 10, groups=("quiet",)),
    ]
    activity = {"k-h0": KernelActivity("k-h0", busy=True)}
    recent = {"group:busy": 50 * 3600.0, "group:quiet": 3600.0}
    result = plan(devices, leases, activity, NOW, SchedConfig(quotas={"*": 1}), usage=recent)
    assert [result.lease(i).user for i in result.queue] == ["b", "a"]
    reasons = fairness.explain(
        [result.lease(i) for i in result.queue], result.keys, result.usage, NOW, SchedConfig(quotas={"*": 1})
    )
    assert "1 claim of a user whose group used less of its quota recently" in reasons["p-a"]


# -- reclaims ------------------------------------------------------------------------------------


def test_the_heaviest_users_borrowed_lease_is_reclaimed_first():
    # alice and bob each hold one GPU within quota and one borrowed; bob's borrowed one has been
    # idle longer, but alice used far more lately: hers is taken back for carol.
    devices = gpus(4)
    leases = [
        holding("a-own", "alice", ("G0",), idle_since=NOW - 5000),
        holding("a-borrowed", "alice", ("G1",), idle_since=NOW - 600),
        holding("b-own", "bob", ("G2",), idle_since=NOW - 5000),
        holding("b-borrowed", "bob", ("G3",), idle_since=NOW - 3000),
        pending("p-carol", "carol", NOW - 10),
    ]
    leases[0] = replace(leases[0], granted_at=0.5)
    leases[2] = replace(leases[2], granted_at=0.5)
    cfg = SchedConfig(quotas={"*": 1}, release_timeout=0)
    recent = {"user:alice": 80 * 3600.0, "user:bob": 2 * 3600.0}
    result = plan(devices, leases, {}, NOW, cfg, usage=recent)
    reclaimed = [d for d in result.decisions if d.kind in ("reclaim", "notice")]
    assert [d.lease.id for d in reclaimed] == ["a-borrowed"]
    assert "alice used 80.0 GPU-hours recently" in reclaimed[0].reason
    # Without usage (half-life 0) the longest idle borrowed lease goes, as before.
    result = plan(devices, leases, {}, NOW, replace(cfg, usage_half_life=0), usage=recent)
    assert [d.lease.id for d in result.decisions if d.kind in ("reclaim", "notice")] == ["b-borrowed"]
