"""No avoidable disruption: a restart or shutdown is never carried out while a step that keeps
every kernel's state (releasing a lease that holds no GPU memory, a checkpoint within the host's
budget) would serve the same waiting claim.

Random hosts whose GPUs are all held, kernels that go idle at random times, and one claim that
waits; the passes run as the arbiter runs them and their decisions are carried out.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jupyter_gpusched.core import (
    Capabilities,
    Device,
    GiB,
    KernelActivity,
    LeaseState,
    SchedConfig,
    Step,
    admit,
    new_claim,
    plan,
    released,
    suspended,
)
from jupyter_gpusched.core.ladder import checkpoint_bytes, choose_step

IDLE = 30.0
HORIZON = 400.0
TICK = 5.0


@st.composite
def hosts(draw):
    n = draw(st.integers(2, 4))
    memory = draw(st.lists(st.sampled_from([0, 2 * GiB, 6 * GiB, 8 * GiB]), min_size=n, max_size=n))
    # When each kernel stops running cells (None: it runs them all along).
    idle_at = draw(st.lists(st.one_of(st.none(), st.integers(0, 40).map(lambda x: x * TICK)), min_size=n, max_size=n))
    claim_at = draw(st.integers(0, 20).map(lambda x: x * TICK))
    checkpoint = draw(st.booleans())
    budget = draw(st.sampled_from([None, 4 * GiB, 10 * GiB]))
    fallback = draw(st.sampled_from(["restart", "shutdown"]))
    return n, memory, idle_at, claim_at, checkpoint, budget, fallback


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hosts())
def test_no_restart_or_shutdown_while_a_gentler_step_would_serve_the_same_claim(host):
    n, memory, idle_at, claim_at, checkpoint, budget, fallback = host
    devices = [Device(f"G{i}", i, "A100") for i in range(n)]
    cfg = SchedConfig(
        adaptive=False, policy="dynamic", idle_timeout=IDLE, contended_idle_timeout=IDLE, grace_period=60.0,
        release_timeout=3600.0, checkpoint_host_memory=budget, reclaim_fallback=fallback,
    )
    caps = Capabilities(checkpoint=checkpoint, checkpoint_reason="" if checkpoint else "no checkpoint here")
    leases, activity = {}, {}
    for i in range(n):
        lease = new_claim(f"l{i}", f"k{i}", f"u{i}", 0.0)
        admit(lease, devices, leases.values(), cfg)
        leases[lease.id] = lease
    now, claimed = 0.0, False
    while now <= HORIZON:
        if not claimed and now >= claim_at:
            claim = new_claim("w", "kw", "waiter", now)
            admit(claim, devices, leases.values(), cfg)
            leases["w"] = claim
            claimed = True
        for i in range(n):
            busy = idle_at[i] is None or now < idle_at[i]
            activity[f"k{i}"] = KernelActivity(f"k{i}", busy=busy, gpu_memory=memory[i])
        live = [le for le in leases.values() if le.state != LeaseState.RELEASED]
        result = plan(devices, live, activity, now, cfg, caps)
        leases.update({le.id: le for le in result.leases})
        # What a gentle step could have freed at this pass, as the pass saw the host.
        room = None if budget is None else budget - checkpoint_bytes(list(result.leases))
        for decision in result.decisions:
            if decision.kind != "reclaim":
                continue
            lease = leases[decision.lease.id]
            step = lease.reclaim_step
            if step is not None and step.disruptive:
                waiting = leases.get("w")
                assert waiting is not None and waiting.state == LeaseState.PENDING, "a disruptive step serves a claim"
                for other in result.leases:
                    if other.id == lease.id or not other.holding or other.busy:
                        continue
                    if other.idle_seconds(now) < IDLE:
                        continue
                    gentle, _ = choose_step(other, cfg, caps, room)
                    assert gentle is None or gentle.disruptive, (
                        f"{lease.id} got {step} at {now} while {other.id} could be taken with {gentle}"
                    )
            # Carried out as the arbiter would.
            if step == Step.CHECKPOINT:
                leases[lease.id] = suspended(lease, now)
            else:
                leases[lease.id] = released(lease, now, f"reclaimed: {step}")
        now += TICK
    if any(at is not None and at + IDLE + 60.0 + 2 * TICK <= HORIZON for at in idle_at) and claim_at + 2 * TICK <= HORIZON:
        assert leases["w"].granted_at is not None, "the claim is served once a kernel is idle long enough"
