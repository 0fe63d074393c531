"""The reclaim executor on a host of the test's own: no Jupyter server, no arbiter.

The host below has only what :class:`~jupyter_gpusched.reclaim.host.ReclaimHost` lists (and a few
helpers for the test): should the executor use anything more of its host, these tests fail. The
ledger is a real one in ``tmp_path``, the GPUs simulated, and the kernels' processes real child
processes that hold simulated GPU memory; the checkpoint and restore are the simulated driver's.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from dataclasses import replace

import pytest

from conftest import FakeClock
from jupyter_gpusched import core
from jupyter_gpusched.arbiter.local import LocalArbiter
from jupyter_gpusched.core import Capabilities, Lease, LeaseState, SchedConfig, Step, new_claim
from jupyter_gpusched.devices.simulated import SimulatedBackend
from jupyter_gpusched.ledger import Ledger
from jupyter_gpusched.reclaim.checkpoint import SimulatedCheckpointer
from jupyter_gpusched.reclaim.executor import ReclaimExecutor
from jupyter_gpusched.reclaim.host import ReclaimHost

GiB = 1024**3


class View:
    """The host's last view: the GPUs and the live leases."""

    def __init__(self) -> None:
        self.snapshot: tuple = ()
        self.leases: tuple[Lease, ...] = ()


class Kernels:
    """What the executor asks of the kernels: whether one runs a cell, its process tree."""

    server_id = "test"

    def __init__(self) -> None:
        self.trees: dict[str, set[int]] = {}
        self.running: set[str] = set()
        self.ended: list[tuple[str, str]] = []

    def executing(self, kernel_id: str) -> bool:
        return kernel_id in self.running

    def process_tree(self, kernel_id: str) -> set[int]:
        return self.trees.get(kernel_id, set())

    async def restart(self, kernel_id: str) -> None:
        self.ended.append(("restart", kernel_id))

    async def shutdown(self, kernel_id: str) -> None:
        self.ended.append(("shutdown", kernel_id))


class Host:
    """A reclaim host: a real ledger, simulated GPUs, a fake clock; lease writes as the arbiter
    makes them (re-read under the write lock, ``fn`` applied, version raised)."""

    metrics = None

    def __init__(self, tmp_path, cfg: SchedConfig, devices) -> None:
        self.cfg = cfg
        self.clock = FakeClock()
        self.ledger = Ledger(tmp_path / "ledger.sqlite")
        self.backend = SimulatedBackend(devices, state_path=str(tmp_path / "sim.sqlite"))
        self.checkpointer = SimulatedCheckpointer(self.backend)
        self.caps = Capabilities(checkpoint=True, remap=self.checkpointer.remap)
        self.kernels = Kernels()
        self.state = View()
        self.trees: dict[str, set[int]] = {}
        self.events: list = []
        self.woken: list[str] = []

    # -- ReclaimHost ------------------------------------------------------------------------
    async def update(self, lease, fn):
        with self.ledger.transaction(self.clock()) as tx:
            current = tx.lease(lease.id)
            if current is None:
                return None
            new = fn(current, tx.now)
            if new is None or new == current:
                return None
            if new.version <= current.version:
                new = replace(new, version=current.version + 1)
            tx.put(new, current)
        self.state.leases = tuple(new if le.id == new.id else le for le in self.state.leases if new.live or le.id != new.id)
        return new

    def publish(self, event) -> None:
        self.events.append(event)

    def mine(self, lease) -> bool:
        return True

    def wake(self, lease_id: str) -> None:
        self.woken.append(lease_id)

    def live_lease(self, lease_id: str):
        return next((le for le in self.state.leases if le.id == lease_id), None)

    def known_lease(self, lease_id: str):
        return self.live_lease(lease_id) or self.ledger.lease(lease_id)

    # -- for the test -----------------------------------------------------------------------
    @property
    def gpu(self) -> str:
        return self.backend.devices[0].uuid

    def look(self) -> None:
        """The GPUs as a tick would see them."""
        self.state.snapshot = self.backend.snapshot()

    def put(self, lease: Lease) -> Lease:
        with self.ledger.transaction(self.clock()) as tx:
            tx.put(lease)
        self.state.leases = (*[le for le in self.state.leases if le.id != lease.id], lease)
        return lease

    def notices(self, kind: str) -> list[dict]:
        return [e.notice for e in self.events if e.type == "notice" and e.notice["kind"] == kind]

    def close(self) -> None:
        self.backend.close()
        self.ledger.close()


@pytest.fixture
def processes():
    """Real child processes (a kernel's), ended after the test."""
    started: list[subprocess.Popen] = []

    def start() -> int:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
        started.append(child)
        return child.pid

    yield start
    for child in started:
        child.kill()
        child.wait()


@pytest.fixture
def make_host(tmp_path):
    made: list[Host] = []

    def make(cfg: SchedConfig = SchedConfig(), devices=({"name": "H100", "memory": "80GiB"},)) -> Host:
        made.append(Host(tmp_path, cfg, list(devices)))
        return made[-1]

    yield make
    for host in made:
        host.close()


def _kernel(host: Host, processes, name: str, memory: int) -> tuple[str, int]:
    """A kernel whose process holds ``memory`` on the host's GPU."""
    pid = processes()
    kernel_id = f"k-{name}"
    host.kernels.trees[kernel_id] = {pid}
    host.trees[kernel_id] = {pid}
    host.backend.add_process(host.gpu, pid, memory)
    return kernel_id, pid


def _due_for_checkpoint(host: Host, name: str, kernel_id: str, seen: int) -> Lease:
    """A lease of ``kernel_id`` on the host's GPU, at the checkpoint step (as a pass leaves it;
    the pass saw ``seen`` bytes)."""
    now = host.clock()
    lease = replace(
        new_claim(name, kernel_id, "alice", now - 600),
        state=LeaseState.RECLAIMING, devices=(host.gpu,), granted_at=now - 600, memory_held=seen,
        reclaim_step=Step.CHECKPOINT, reclaim_at=now, reason="idle while someone waits", version=1,
    )
    return host.put(lease)


async def _settled(executor: ReclaimExecutor) -> None:
    for _ in range(500):
        if not executor.inflight and not executor.restoring():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the executor's steps did not finish")


async def _regranted(host: Host, lease_id: str) -> Lease:
    """The kernel runs a cell: its suspended lease asks again and is granted its GPU (the pass's part)."""
    lease = await host.update(host.live_lease(lease_id), lambda cur, now: core.request_resume(cur, now))

    def grant(cur: Lease, now: float) -> Lease:
        return replace(cur, state=LeaseState.ACTIVE, devices=cur.home, granted_at=now, reason="granted")

    return await host.update(lease, grant)


def test_the_arbiter_and_the_tests_host_are_both_reclaim_hosts(make_host, tmp_path):
    host = make_host()
    assert isinstance(host, ReclaimHost)
    arbiter = LocalArbiter(cfg=SchedConfig(), ledger=Ledger(tmp_path / "other.sqlite"), backend=None)
    try:
        assert isinstance(arbiter, ReclaimHost)
        assert arbiter.reclaims.host is arbiter
    finally:
        arbiter.close()


async def test_a_checkpoint_then_a_restore_of_a_real_process(make_host, processes):
    host = make_host()
    executor = ReclaimExecutor(host)
    kernel_id, pid = _kernel(host, processes, "a", 2 * GiB)
    host.look()
    lease = _due_for_checkpoint(host, "a", kernel_id, 2 * GiB)

    executor.carry_out_due([lease])
    await _settled(executor)
    stored = host.ledger.lease("a")
    assert stored.state == LeaseState.SUSPENDED, stored.reason
    assert stored.home == (host.gpu,) and stored.devices == () and stored.memory_held == 2 * GiB
    [record] = host.ledger.checkpoints()
    assert (record.pid, record.lease_id, record.memory, record.devices) == (pid, "a", 2 * GiB, (host.gpu,))
    assert host.backend.checkpointed(pid) == 2 * GiB
    assert host.backend.snapshot()[0].processes == (), "the GPU is free"
    assert [n["lease_id"] for n in host.notices("suspended")] == ["a"]

    granted = await _regranted(host, "a")
    host.woken.clear()
    executor.start_restore(granted)
    assert executor.restoring("a") and executor.busy("a")
    await executor.restored("a", timeout=30)
    assert not executor.restoring("a") and not executor.restoring()
    assert host.backend.checkpointed(pid) == 0
    [gpu] = host.backend.snapshot()
    assert [(p.pid, p.memory_used) for p in gpu.processes] == [(pid, 2 * GiB)]
    assert host.ledger.checkpoints() == []
    assert host.ledger.lease("a").state == LeaseState.ACTIVE
    assert [n["lease_id"] for n in host.notices("resumed")] == ["a"]
    assert host.woken == ["a"], "the claim waiting on the restore is woken"


async def test_a_checkpoint_over_the_host_budget_is_not_taken_and_says_why(make_host, processes):
    host = make_host(SchedConfig(checkpoint_host_memory=GiB))
    executor = ReclaimExecutor(host)
    kernel_id, pid = _kernel(host, processes, "a", 2 * GiB)
    host.look()
    # The pass decided on 512 MiB; the kernel holds 2 GiB now, and the executor goes by that.
    lease = _due_for_checkpoint(host, "a", kernel_id, GiB // 2)

    executor.carry_out_due([lease])
    await _settled(executor)
    stored = host.ledger.lease("a")
    assert stored.state == LeaseState.IDLE and Step.CHECKPOINT in stored.tried_steps
    assert stored.reason == (
        "checkpoint not taken: a checkpoint of 2.0 GiB would not fit in the host memory left for checkpoints "
        "(1.0 GiB left of what the checkpoint_host_memory setting allows)"
    )
    assert host.ledger.checkpoints() == [] and host.backend.checkpointed(pid) == 0
    [gpu] = host.backend.snapshot()
    assert [(p.pid, p.memory_used) for p in gpu.processes] == [(pid, 2 * GiB)], "its GPU memory is left alone"
    assert host.notices("suspended") == []


async def test_a_checkpoint_is_called_off_when_the_kernel_runs_a_cell(make_host, processes):
    host = make_host()
    executor = ReclaimExecutor(host)
    kernel_id, pid = _kernel(host, processes, "a", 2 * GiB)
    host.look()
    host.kernels.running.add(kernel_id)
    executor.carry_out_due([_due_for_checkpoint(host, "a", kernel_id, 2 * GiB)])
    await _settled(executor)
    stored = host.ledger.lease("a")
    assert stored.state != LeaseState.RECLAIMING and "the kernel is running a cell" in stored.reason
    assert host.backend.checkpointed(pid) == 0 and host.ledger.checkpoints() == []


async def test_a_restore_that_does_not_fit_waits_with_its_checkpoint_kept_then_goes_through(make_host, processes):
    host = make_host()
    executor = ReclaimExecutor(host)
    kernel_id, pid = _kernel(host, processes, "a", 60 * GiB)
    host.look()
    executor.carry_out_due([_due_for_checkpoint(host, "a", kernel_id, 60 * GiB)])
    await _settled(executor)
    assert host.ledger.lease("a").state == LeaseState.SUSPENDED

    # Another process takes 30 GiB of the 80: 50 GiB are free, too little for the 60 GiB checkpoint.
    other = processes()
    host.backend.add_process(host.gpu, other, 30 * GiB)
    granted = await _regranted(host, "a")
    executor.start_restore(granted)
    await executor.restored("a", timeout=30)
    stored = host.ledger.lease("a")
    assert stored.state == LeaseState.PENDING and stored.home == (host.gpu,) and stored.devices == ()
    assert stored.reason.startswith(
        "waiting for room to restore: GPU 0 has 50.0 GiB free, too little for its 60.0 GiB checkpoint"
    ), stored.reason
    assert [r.pid for r in host.ledger.checkpoints("a")] == [pid], "the checkpoint is kept"
    assert host.backend.checkpointed(pid) == 60 * GiB
    assert host.notices("resumed") == [] and "a" in host.woken

    # The other process lets go: granted again, the restore goes through.
    host.backend.remove_process(other)
    lease = await host.update(host.live_lease("a"), lambda cur, now: replace(
        cur, state=LeaseState.ACTIVE, devices=cur.home, granted_at=now, reason="granted"
    ))
    executor.start_restore(lease)
    await executor.restored("a", timeout=30)
    assert host.backend.checkpointed(pid) == 0 and host.ledger.checkpoints() == []
    assert [n["lease_id"] for n in host.notices("resumed")] == ["a"]
