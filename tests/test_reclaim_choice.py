"""The broker's bad run of two computing kernels and a third that waits, step by step.

alice and bob each hold a GPU with 1 GiB on it and compute; carol's first cell waits. In the bad
run the broker checkpointed bob while his cell still ran (alice's had just ended), granted his GPU
to carol, restored bob's frozen process onto that same GPU once his lease was gone, and ended
alice's lease as "the kernel has shut down" while her kernel lived. Each step is replayed here on
a real arbiter, real processes and simulated GPUs, with a kernel host the test scripts and a clock
that moves only when told to.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest

from conftest import FakeClock
from jupyter_gpusched.api.input import Claim
from jupyter_gpusched.api.views import Principal
from jupyter_gpusched.arbiter.local import LocalArbiter
from jupyter_gpusched.core import LeaseState, SchedConfig, Step
from jupyter_gpusched.devices.simulated import SimulatedBackend
from jupyter_gpusched.ledger import Ledger
from jupyter_gpusched.reclaim.checkpoint import SimulatedCheckpointer

GiB = 1024**3


class Host:
    """A kernel host the test scripts: each kernel's process, what its server says, whether the
    host still knows it."""

    server_id = "host"

    def __init__(self) -> None:
        self.pids: dict[str, int | None] = {}
        #: Kernel id -> (counted busy, last busy at, began at), as the host reports it.
        self.states: dict[str, tuple[bool, float | None, float | None]] = {}
        #: Kernels whose server says they run a cell now, believed or not.
        self.said: set[str] = set()
        self.forgotten: set[str] = set()

    def add(self, kernel_id: str, pid: int | None) -> None:
        self.pids[kernel_id] = pid
        self.states[kernel_id] = (False, None, None)

    def activity(self):
        return {k: v for k, v in self.states.items() if k not in self.forgotten}

    def said_running(self, kernel_id: str) -> bool:
        return kernel_id in self.said

    def alive(self, kernel_id: str):
        if kernel_id in self.forgotten:
            return False
        return True if kernel_id in self.pids else None

    def executing(self, kernel_id: str) -> bool:
        return False

    def asking(self, kernel_id: str) -> None:
        pass

    def restarting(self, kernel_id: str) -> bool:
        return False

    def adopted(self, kernel_id: str) -> None:
        pass

    def kernel_pid(self, kernel_id: str):
        return None if kernel_id in self.forgotten else self.pids.get(kernel_id)

    def process_tree(self, kernel_id: str) -> set[int]:
        pid = self.kernel_pid(kernel_id)
        return {pid} if pid else set()

    def process_trees(self) -> dict[str, set[int]]:
        return {k: self.process_tree(k) for k in self.pids}

    def notebook(self, kernel_id: str):
        return None

    async def refresh_notebooks(self) -> None:
        pass

    def user_of(self, kernel_id: str):
        return None

    async def restart(self, kernel_id: str) -> None:
        pass

    async def shutdown(self, kernel_id: str) -> None:
        pass


class Scene:
    def __init__(self, tmp_path, cfg: SchedConfig) -> None:
        self.clock = FakeClock()
        self.backend = SimulatedBackend(2, state_path=str(tmp_path / "sim.sqlite"))
        self.host = Host()
        self.arb = LocalArbiter(
            cfg=cfg, ledger=Ledger(tmp_path / "ledger.sqlite"), backend=self.backend,
            checkpointer=SimulatedCheckpointer(self.backend), kernels=self.host, clock=self.clock,
        )
        self.procs: dict[str, subprocess.Popen] = {}

    def kernel(self, name: str) -> str:
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        self.procs[name] = proc
        kernel_id = f"k-{name}"
        self.host.add(kernel_id, proc.pid)
        return kernel_id

    async def claim(self, name: str) -> dict:
        result = await self.arb.claim(Principal(user=name), Claim(kernel_id=f"k-{name}"))
        return result.lease

    def lease(self, lease_id: str):
        return self.arb.ledger.lease(lease_id)

    def on_gpu(self, uuid: str) -> set[int]:
        return {p.pid for d in self.backend.snapshot() if d.uuid == uuid for p in d.processes}

    def close(self) -> None:
        for proc in self.procs.values():
            proc.kill()
            proc.wait(10)
        self.arb.close()


@pytest.fixture
def scene(tmp_path):
    made: list[Scene] = []

    def make(cfg: SchedConfig = SchedConfig()) -> Scene:
        where = tmp_path / str(len(made))
        where.mkdir()
        made.append(Scene(where, cfg))
        return made[-1]

    yield make
    for s in made:
        s.close()


async def _suspend(s: Scene, lease_id: str) -> None:
    """Checkpoint ``lease_id`` now, as the core decides for an idle lease someone waits for."""

    def due(cur, now):
        return replace(cur, state=LeaseState.RECLAIMING, reclaim_step=Step.CHECKPOINT, reclaim_at=now, reason="wanted")

    await s.arb.reclaims.checkpoint(await s.arb.update(s.arb.live_lease(lease_id), due))
    assert s.lease(lease_id).state == LeaseState.SUSPENDED


async def test_a_checkpoint_whose_lease_ended_waits_while_its_gpu_is_granted_to_another(scene):
    s = scene()
    await s.arb.tick()
    for name in ("alice", "bob"):
        s.kernel(name)
    alice, bob = await s.claim("alice"), await s.claim("bob")
    gpu_b = bob["devices"][0]
    s.backend.add_process(alice["devices"][0], s.procs["alice"].pid, GiB)
    s.backend.add_process(gpu_b, s.procs["bob"].pid, GiB)
    await s.arb.tick()
    await _suspend(s, bob["id"])
    s.kernel("carol")
    carol = await s.claim("carol")
    assert carol["state"] == "active" and carol["devices"] == [gpu_b]

    # bob's suspended lease ends (his kernel released it): his checkpoint is an orphan now.
    await s.arb.release(Principal(user="bob", kernel_id="k-bob"), bob["id"])
    for _ in range(2):
        s.clock.advance(1)
        await s.arb.tick()
    bob_pid = s.procs["bob"].pid
    assert bob_pid not in s.on_gpu(gpu_b), "never restored onto the GPU carol holds"
    assert s.backend.checkpointed(bob_pid) == GiB
    assert len(s.arb.ledger.checkpoints()) == 1

    # carol lets go of it: bob's process gets its memory back where it was.
    await s.arb.release(Principal(user="carol"), carol["id"])
    s.clock.advance(1)
    await s.arb.tick()
    assert bob_pid in s.on_gpu(gpu_b) and s.backend.checkpointed(bob_pid) == 0
    assert s.arb.ledger.checkpoints() == []
    await s.arb.stop()


async def test_an_orphaned_checkpoint_of_a_process_that_ended_is_forgotten(scene):
    s = scene()
    await s.arb.tick()
    s.kernel("alice"), s.kernel("bob")
    await s.claim("alice")
    bob = await s.claim("bob")
    s.backend.add_process(bob["devices"][0], s.procs["bob"].pid, GiB)
    await s.arb.tick()
    await _suspend(s, bob["id"])
    s.kernel("carol")
    assert (await s.claim("carol"))["devices"] == bob["devices"]
    await s.arb.release(Principal(user="bob", kernel_id="k-bob"), bob["id"])
    s.procs["bob"].kill()
    s.procs["bob"].wait(10)
    s.clock.advance(1)
    await s.arb.tick()
    assert s.arb.ledger.checkpoints() == []
    await s.arb.stop()


async def test_a_lease_ends_as_shut_down_only_once_the_kernels_process_is_gone(scene):
    s = scene()
    await s.arb.tick()
    s.kernel("alice")
    alice = await s.claim("alice")
    pid = s.procs["alice"].pid
    s.backend.add_process(alice["devices"][0], pid, GiB)
    await s.arb.tick()

    # The host loses track of alice's kernel (its server's registry dropped it), while the
    # kernel's process runs on and holds its GPU memory: the lease stays hers.
    s.host.forgotten.add("k-alice")
    for _ in range(3):
        s.clock.advance(1)
        await s.arb.tick()
    assert s.lease(alice["id"]).state in (LeaseState.ACTIVE, LeaseState.IDLE), s.lease(alice["id"]).reason

    # The process ends: now the kernel has shut down.
    s.procs["alice"].kill()
    s.procs["alice"].wait(10)
    s.clock.advance(1)
    await s.arb.tick()
    done = s.lease(alice["id"])
    assert done.state == LeaseState.RELEASED and done.reason == "released: the kernel has shut down"
    await s.arb.stop()


async def test_a_kernel_the_host_says_ended_without_a_known_process_is_released_at_once(scene):
    s = scene()
    await s.arb.tick()
    s.host.add("k-carol", None)  # no process known: the lease is owned by this server
    carol = await s.claim("carol")
    s.host.forgotten.add("k-carol")
    s.clock.advance(1)
    await s.arb.tick()
    assert s.lease(carol["id"]).reason == "released: the kernel has shut down"
    await s.arb.stop()


async def test_the_idle_kernel_is_checkpointed_not_the_one_whose_server_says_it_runs_a_cell(scene):
    """The bad run's first step. bob's server says his cell runs, but the host does not count it
    (no evidence, as a hub broker may find); alice's cell has just ended. carol waits: alice's
    lease is checkpointed once it is past the contended threshold, and bob keeps his GPU."""
    s = scene(SchedConfig(idle_timeout=3.0, contended_idle_timeout=2.0, adaptive=False, quotas={"*": 0.5}))
    await s.arb.tick()
    for name in ("alice", "bob"):
        s.kernel(name)
    alice, bob = await s.claim("alice"), await s.claim("bob")
    s.backend.add_process(alice["devices"][0], s.procs["alice"].pid, GiB)
    s.backend.add_process(bob["devices"][0], s.procs["bob"].pid, GiB)
    start = s.clock()
    s.host.states["k-alice"] = (True, start, start)
    s.host.states["k-bob"] = (True, start, start)
    await s.arb.tick()
    s.kernel("carol")
    carol = await s.claim("carol")
    assert carol["state"] == "pending"

    # From t=1 bob's server says his cell runs but the host does not count it; alice's cell
    # ends at t=2.5. At t=3 bob has counted idle for 2 s (the contended threshold), alice 0.5 s.
    s.clock.advance(1)
    s.host.said.add("k-bob")
    s.host.states["k-bob"] = (False, start, None)
    await s.arb.tick()
    s.clock.advance(1.5)
    s.host.states["k-alice"] = (False, s.clock(), None)
    await s.arb.tick()
    for _ in range(5):
        s.clock.advance(0.5)
        await s.arb.tick()
        await _settle(s)
    assert s.lease(bob["id"]).state in (LeaseState.ACTIVE, LeaseState.IDLE), s.lease(bob["id"]).reason
    assert s.lease(alice["id"]).state == LeaseState.SUSPENDED, s.lease(alice["id"]).reason
    assert s.lease(carol["id"]).devices == tuple(alice["devices"])
    await s.arb.stop()


async def _settle(s: Scene) -> None:
    """Let the steps the tick handed to the executor finish."""
    import asyncio

    for _ in range(100):
        if not s.arb.reclaims.inflight and not s.arb.reclaims.restoring():
            return
        await asyncio.sleep(0.01)


async def test_a_kernel_checkpointed_mid_cell_asks_for_its_gpu_back_on_its_servers_word(scene):
    """Where a checkpoint did land mid-cell, the kernel's cell needs its GPU again: its server's
    word that the cell runs is enough to queue the restore (the host does not count it busy)."""
    s = scene(SchedConfig(idle_timeout=3.0, contended_idle_timeout=2.0, adaptive=False, quotas={"*": 0.5}))
    await s.arb.tick()
    s.kernel("bob")
    bob = await s.claim("bob")
    pid = s.procs["bob"].pid
    s.backend.add_process(bob["devices"][0], pid, GiB)
    await s.arb.tick()
    await _suspend(s, bob["id"])
    s.host.said.add("k-bob")  # his server says the cell runs; no evidence, so not counted busy
    s.clock.advance(1)
    await s.arb.tick()
    await _settle(s)
    lease = s.lease(bob["id"])
    assert lease.state == LeaseState.ACTIVE, lease.reason
    assert s.backend.checkpointed(pid) == 0 and pid in s.on_gpu(lease.devices[0])
    await s.arb.stop()
