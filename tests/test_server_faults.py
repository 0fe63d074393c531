"""Faults: kernels killed, servers killed and restarted, GPUs lost mid-lease."""

from __future__ import annotations

import json
import os
import signal
import time

import psutil
import pytest

from conftest import ServerProcess, api, free_port as _free_port
from jupyter_gpusched.ledger import Ledger


async def _kernel(jp_fetch) -> str:
    r = await jp_fetch("api", "kernels", method="POST", body=json.dumps({"name": "python3"}))
    return json.loads(r.body)["id"]


async def test_kernel_killed_frees_its_lease_within_two_ticks(jp_fetch, arbiter):
    k1, k2 = await _kernel(jp_fetch), await _kernel(jp_fetch)
    _, lease1 = await api(jp_fetch, "leases", method="POST", body={"kernel_id": k1})
    _, lease2 = await api(jp_fetch, "leases", method="POST", body={"kernel_id": k2})
    assert lease1["state"] == lease2["state"] == "active"
    k3 = await _kernel(jp_fetch)
    code, waiting = await api(jp_fetch, "leases", method="POST", body={"kernel_id": k3})
    assert code == 202

    pid = arbiter.kernels.kernel_pid(k1)
    os.kill(pid, signal.SIGKILL)
    psutil.Process(pid).wait(timeout=10) if psutil.pid_exists(pid) else None
    for _ in range(2):
        await arbiter.tick()
    _, got = await api(jp_fetch, "leases", lease1["id"])
    assert got["state"] == "released"
    assert "gone" in got["reason"] or "shut down" in got["reason"]
    _, got3 = await api(jp_fetch, "leases", waiting["id"])
    assert got3["state"] == "active" and got3["devices"] == lease1["devices"]
    assert arbiter.ledger.check() == []


async def test_lost_gpu_releases_its_leases_and_new_claims_go_elsewhere(jp_fetch, arbiter):
    k1 = await _kernel(jp_fetch)
    _, lease1 = await api(jp_fetch, "leases", method="POST", body={"kernel_id": k1})
    lost_uuid = lease1["devices"][0]
    notices = []
    arbiter.subscribe(lambda event: notices.append(event.notice) if event.type == "notice" else None)

    arbiter.backend.lose(lost_uuid)
    await arbiter.tick()

    _, got = await api(jp_fetch, "leases", lease1["id"])
    assert got["state"] == "released" and "lost" in got["reason"]
    assert any(n["kind"] == "lost" and n["kernel_id"] == k1 for n in notices)
    _, status = await api(jp_fetch, "status")
    assert {d["uuid"]: d["health"] for d in status["devices"]}[lost_uuid] == "lost"

    # The kernel asks again and lands on the healthy GPU; a second kernel now waits.
    code, again = await api(jp_fetch, "leases", method="POST", body={"kernel_id": k1})
    assert code == 201 and again["devices"] != [lost_uuid]
    k2 = await _kernel(jp_fetch)
    code, pending = await api(jp_fetch, "leases", method="POST", body={"kernel_id": k2})
    assert code == 202


# -- a real server process, killed and started again ------------------------------------------
def _wait_for(predicate, timeout=20.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.slow
def test_server_killed_and_restarted_reconciles_the_ledger(tmp_path):
    """Server A is killed; its kernels die with it. Server B shares the ledger and lives on.

    A new server on the same ledger releases A's leases (their owners are gone) and keeps B's
    (their owner lives).
    """
    ledger_path = str(tmp_path / "ledger.sqlite")
    a = ServerProcess(tmp_path, ledger_path, _free_port())
    b = ServerProcess(tmp_path, ledger_path, _free_port())
    restarted = None
    try:
        _, ka = a.call("POST", "api/kernels", {"name": "python3"})
        _, kb = b.call("POST", "api/kernels", {"name": "python3"})
        _, lease_a = a.call("POST", "api/gpusched/leases", {"kernel_id": ka["id"]})
        _, lease_b = b.call("POST", "api/gpusched/leases", {"kernel_id": kb["id"]})
        assert lease_a["state"] == lease_b["state"] == "active"
        owners = Ledger(ledger_path).owners()
        pid_a = owners[lease_a["id"]].process.pid
        assert pid_a != a.proc.pid, "the kernel process, not the server, owns the lease"

        a.kill()
        # The kernel notices its parent is gone and exits.
        _wait_for(
            lambda: not psutil.pid_exists(pid_a) or psutil.Process(pid_a).status() == psutil.STATUS_ZOMBIE,
            timeout=30,
            what="server A's kernel to exit",
        )
        restarted = ServerProcess(tmp_path, ledger_path, _free_port())

        def states():
            return {le.id: le.state.value for le in Ledger(ledger_path).leases(live_only=False)}

        _wait_for(lambda: states()[lease_a["id"]] == "released", what="the dead kernel's lease to be released")
        assert states()[lease_b["id"]] == "active"
        assert Ledger(ledger_path).check() == []

        # The freed GPU goes to a kernel of the restarted server.
        _, kernel = restarted.call("POST", "api/kernels", {"name": "python3"})
        code, lease = restarted.call("POST", "api/gpusched/leases", {"kernel_id": kernel["id"]})
        assert code == 201 and lease["devices"] == lease_a["devices"]
        assert Ledger(ledger_path).check() == []
    finally:
        for server in (a, b, restarted):
            if server is not None:
                server.stop()


@pytest.mark.slow
def test_two_servers_share_one_ledger_without_double_grants(tmp_path):
    ledger_path = str(tmp_path / "ledger.sqlite")
    a = ServerProcess(tmp_path, ledger_path, _free_port())
    b = ServerProcess(tmp_path, ledger_path, _free_port())
    try:
        results = []
        for server in (a, b, a, b):
            _, kernel = server.call("POST", "api/kernels", {"name": "python3"})
            results.append(server.call("POST", "api/gpusched/leases", {"kernel_id": kernel["id"]}))
        granted = [lease for code, lease in results if code == 201]
        waiting = [lease for code, lease in results if code == 202]
        assert len(granted) == 2 and len(waiting) == 2
        assert {d for lease in granted for d in lease["devices"]} == set(granted[0]["devices"]) | set(granted[1]["devices"])
        assert len({d for lease in granted for d in lease["devices"]}) == 2
        # Release on server a: the first waiter (on server a) gets it, whichever server ticks.
        a.call("DELETE", f"api/gpusched/leases/{granted[0]['id']}")

        def active():
            leases = Ledger(ledger_path).leases()
            return [le for le in leases if le.state.value == "active"]

        _wait_for(lambda: len(active()) == 2, what="the waiting claim to be granted")
        assert Ledger(ledger_path).check() == []
    finally:
        a.stop()
        b.stop()


@pytest.mark.parametrize("sched_config", [{"backend": "simulated", "simulated_devices": 2, "unleased_processes": "kill"}])
async def test_kill_policy_ends_gpu_processes_without_a_lease(jp_fetch, arbiter, sched_config):
    import subprocess
    import sys

    kernel_id = await _kernel(jp_fetch)
    _, lease = await api(jp_fetch, "leases", method="POST", body={"kernel_id": kernel_id})
    leased_pid = arbiter.kernels.kernel_pid(kernel_id)
    rogue = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        arbiter.backend.add_process(lease["devices"][0], leased_pid, "1GiB")
        arbiter.backend.add_process(lease["devices"][0], rogue.pid, "2GiB")
        await arbiter.tick()
        _, status = await api(jp_fetch, "status")
        assert [p["pid"] for p in status["unleased_processes"]] == [rogue.pid]
        assert rogue.poll() is None, "reported at the first tick, not ended yet"
        await arbiter.tick()
        assert rogue.wait(timeout=10) is not None
        assert psutil.pid_exists(leased_pid), "the leased kernel is untouched"
        _, got = await api(jp_fetch, "leases", lease["id"])
        assert got["state"] == "active"
    finally:
        if rogue.poll() is None:
            rogue.kill()


@pytest.mark.parametrize("sched_config", [{"backend": "simulated", "simulated_devices": 2, "unleased_processes": "kill"}])
async def test_kill_policy_tells_a_kernel_that_uses_a_gpu_beside_its_lease_then_ends_that_process(
    jp_fetch, arbiter, sched_config
):
    """A kernel of this server on a GPU it holds no lease for is reported with its kernel id; in
    kill mode its process there gets a notice first and is ended at the next check. Processes of
    leased kernels on their own GPUs, and processes no longer on a GPU, are never ended."""
    import subprocess
    import sys

    kernel_id = await _kernel(jp_fetch)
    other = await _kernel(jp_fetch)
    _, lease = await api(jp_fetch, "leases", method="POST", body={"kernel_id": kernel_id})
    mine, spare = lease["devices"][0], next(d.uuid for d in arbiter.state.snapshot if d.uuid not in lease["devices"])
    kernel_pid = arbiter.kernels.kernel_pid(kernel_id)
    # A process of this user outside every kernel, on the other GPU for a moment only.
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    notices = []
    arbiter.subscribe(lambda event: notices.append(event.notice) if event.type == "notice" else None)
    try:
        arbiter.backend.add_process(mine, kernel_pid, "1GiB")
        # A kernel without any lease that uses a GPU: its own process there.
        other_pid = arbiter.kernels.kernel_pid(other)
        arbiter.backend.add_process(spare, other_pid, "1GiB")
        arbiter.backend.add_process(spare, worker.pid, "1GiB")
        await arbiter.tick()
        _, status = await api(jp_fetch, "status")
        by_pid = {p["pid"]: p for p in status["unleased_processes"]}
        assert by_pid[other_pid]["kernel_id"] == other and by_pid[other_pid]["device"] == spare
        assert worker.pid in by_pid and kernel_pid not in by_pid
        told = [n for n in notices if n["kind"] == "outside_lease"]
        assert [n["kernel_id"] for n in told] == [other] and "GPU" in told[0]["message"]
        assert psutil.pid_exists(other_pid) and worker.poll() is None, "told first, not ended yet"
        # The worker leaves the GPU before the next check: it is spared.
        arbiter.backend.remove_process(worker.pid)
        await arbiter.tick()
        psutil.Process(other_pid).wait(timeout=10)
        assert worker.poll() is None, "no longer on a GPU: spared"
        assert psutil.pid_exists(kernel_pid), "the leased kernel on its own GPU is untouched"
        _, got = await api(jp_fetch, "leases", lease["id"])
        assert got["state"] == "active"
    finally:
        if worker.poll() is None:
            worker.kill()


async def test_a_checkpoint_left_behind_is_restored_at_the_next_pass(jp_fetch, arbiter):
    """The ledger remembers every checkpoint taken; one whose lease is gone (the arbiter stopped
    between the checkpoint and the release, say) is restored onto its GPU at the next pass, so no
    process stays frozen."""
    import subprocess
    import sys

    from jupyter_gpusched.ledger import Checkpoint

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        uuid = arbiter.state.snapshot[0].uuid
        arbiter.backend.add_process(uuid, proc.pid, "1GiB")
        moved = arbiter.backend.checkpoint(proc.pid)
        assert moved == 1 << 30 and arbiter.backend.checkpointed(proc.pid) == moved
        with arbiter.ledger.transaction() as tx:
            tx.add_checkpoint(
                Checkpoint(proc.pid, psutil.Process(proc.pid).create_time(), "gone-lease", "gone-kernel", (uuid,), moved, tx.now)
            )
        await arbiter.tick()
        assert arbiter.backend.checkpointed(proc.pid) == 0
        held = {p.pid: p.memory_used for d in arbiter.backend.snapshot() for p in d.processes}
        assert held.get(proc.pid) == 1 << 30, "its GPU memory is back where it was"
        assert arbiter.ledger.checkpoints() == []
    finally:
        proc.kill()
        proc.wait(10)


@pytest.mark.parametrize(
    ("setting", "said"),
    [
        ("--GPUSchedApp.usage_half_life=-1", "usage_half_life must be 0 (usage not tracked) or a finite number"),
        ("--GPUSchedApp.checkpoint_host_memory=lots", "checkpoint_host_memory must be a number of bytes"),
        ("--GPUSchedApp.policy=bogus", "policy must be one of"),
    ],
)
def test_a_bad_setting_stops_the_server_instead_of_running_on_defaults(tmp_path, setting, said):
    """The extension's other settings (here the simulated backend and the ledger) must not be
    dropped for defaults while the server goes on: it does not start, and says why."""
    import subprocess
    import sys

    ledger = tmp_path / "ledger.sqlite"
    env = dict(os.environ, JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"), JUPYTER_CONFIG_DIR=str(tmp_path / "config"))
    done = subprocess.run(
        [sys.executable, "-m", "jupyter", "server", "--no-browser", "--allow-root", f"--port={_free_port()}",
         "--GPUSchedApp.backend=simulated", f"--GPUSchedApp.ledger_path={ledger}", setting],
        capture_output=True, text=True, timeout=120, env=env, stdin=subprocess.DEVNULL,
    )
    assert done.returncode != 0
    assert "GPU scheduler: bad configuration:" in done.stderr and said in done.stderr, done.stderr[-2000:]
    assert "The server does not start." in done.stderr
    assert not ledger.exists()
    assert not (tmp_path / "runtime" / "gpusched.sqlite").exists()
