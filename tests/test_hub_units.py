"""Hub mode without a hub: the broker's view of remote kernels, and its command line.

The rules tested here decide when a lease of a kernel on another server is released: a kernel
whose server says it ended; one whose server stopped and whose processes are gone; one whose
server fell silent, unless its processes still hold a GPU (then it is reported as left behind).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import pytest

from jupyter_gpusched import procs
from jupyter_gpusched.hub.remote import HeartbeatError, RemoteKernels, parse_kernel_report


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Conn:
    def __init__(self) -> None:
        self.orders: list[tuple[str, str]] = []

    async def order(self, action: str, kernel_id: str) -> None:
        self.orders.append((action, kernel_id))


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def gpu():
    return set()


@pytest.fixture
def kernels(clock, gpu):
    return RemoteKernels("broker", heartbeat_timeout=10, launch_grace=60, clock=clock, gpu_pids=lambda: set(gpu))


@pytest.fixture
def child():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait(10)


def settle(pid: int, timeout: float = 10.0) -> None:
    """Wait until ``pid`` has started up and sleeps (its CPU time stops growing)."""
    deadline = time.monotonic() + timeout
    last = procs.runtime_ns([pid])
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = procs.runtime_ns([pid])
        if now == last:
            return
        last = now


class ServerProcess:
    """A stand-in single-user server: a real process with a real "kernel" child process."""

    def __init__(self, kernel_code: str = "import time; time.sleep(60)") -> None:
        code = (
            "import subprocess, sys, time\n"
            f"k = subprocess.Popen([sys.executable, '-c', {kernel_code!r}])\n"
            "print(k.pid, flush=True)\n"
            "time.sleep(60)\n"
        )
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        self.pid = self.proc.pid
        self.kernel_pid = int(self.proc.stdout.readline())
        if "sleep" in kernel_code:
            settle(self.kernel_pid)

    def close(self) -> None:
        for pid in (self.kernel_pid, self.pid):
            try:
                os.kill(pid, 9)
            except OSError:
                pass
        self.proc.wait(10)
        self.proc.stdout.close()


@pytest.fixture
def servers():
    made: list[ServerProcess] = []

    def make() -> ServerProcess:
        made.append(ServerProcess())
        return made[-1]

    yield make
    for server in made:
        server.close()


def connect(kernels, server_id, user, conn=None, pid=None):
    """Connect a server whose process (checked by the broker beforehand) is ``pid``: by default
    this test's own process, so that its children count as the server's kernels."""
    pid = pid or os.getpid()
    return kernels.connect(server_id, user, pid, conn or Conn(), pid_started=procs.started(pid))


def beat(kernels, server_id, **reports):
    return kernels.heartbeat(server_id, {kid: dict(info) for kid, info in reports.items()})


def test_a_reported_kernel_is_alive_and_ends_when_its_server_stops_reporting_it(kernels, clock, child):
    connect(kernels, "s1", "alice", Conn())
    assert beat(kernels, "s1", k1={"busy": True, "pid": child.pid, "pids": [child.pid]}) == []
    assert kernels.alive("k1") is True and kernels.user_of("k1") == "alice"
    assert kernels.activity()["k1"][0] is False, "said busy, but its process sleeps: not busy"
    assert kernels.kernel_pid("k1") == child.pid and kernels.process_tree("k1") == {child.pid}
    beat(kernels, "s1")
    assert kernels.alive("k1") is False and kernels.user_of("k1") == "alice"
    assert kernels.alive("never-seen") is None


def test_a_kernel_belongs_to_the_first_user_and_never_changes_hands(kernels):
    connect(kernels, "s1", "alice", Conn())
    connect(kernels, "s2", "mallory", Conn())
    beat(kernels, "s1", k1={})
    problems = beat(kernels, "s2", k1={"busy": True})
    assert problems and "another user" in problems[0]
    assert kernels.user_of("k1") == "alice"
    with pytest.raises(PermissionError):
        kernels.register("k1", "mallory", "s2")
    with pytest.raises(PermissionError):
        connect(kernels, "s1", "mallory", Conn())
    with pytest.raises(PermissionError):
        kernels.register("k9", "mallory", "s1")
    # An ended kernel's id stays its user's.
    beat(kernels, "s1")
    with pytest.raises(PermissionError):
        kernels.register("k1", "mallory", "s2")


def test_pids_of_another_users_kernel_are_not_taken(kernels, servers):
    a, m = servers(), servers()
    connect(kernels, "s1", "alice", pid=a.pid)
    connect(kernels, "s2", "mallory", pid=m.pid)
    assert beat(kernels, "s1", k1={"pid": a.kernel_pid}) == []
    problems = beat(kernels, "s2", k2={"pid": a.kernel_pid, "pids": [a.kernel_pid, 4242]})
    assert problems and "not a process of this server" in problems[0]
    kernels.process_trees()
    kernels.activity()
    assert kernels.kernel_pid("k2") is None and kernels.process_tree("k2") == set()
    assert kernels.process_tree("k1") == {a.kernel_pid}


def test_a_server_is_believed_only_about_its_own_processes(kernels, servers, clock):
    """A forged server (any process id it names) cannot claim processes it did not start: not
    another user's job, not the broker, not init, not its own server process."""
    mallory = servers()
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        connect(kernels, "s9", "mallory", pid=mallory.pid)
        for pid in (victim.pid, os.getpid(), 1, mallory.pid, 999_999):
            problems = beat(kernels, "s9", fake={"busy": True, "pid": pid})
            assert problems and "ignored" in problems[0], pid
            assert kernels.kernel_pid("fake") is None
        trees = kernels.process_trees()
        assert trees["fake"] == set()
        # Its own kernel's processes are found by the broker, children included; a list is ignored.
        assert beat(kernels, "s9", own={"pid": mallory.kernel_pid, "pids": list(range(2, 250))}) == []
        kernels.process_trees()
        kernels.activity()
        assert kernels.process_tree("own") == {mallory.kernel_pid}
    finally:
        victim.kill()
        victim.wait(10)


def test_busy_counts_only_with_evidence(clock, servers):
    """A server's word that its kernel is busy counts only while the kernel's processes run on
    the CPU (or use a GPU), and not forever without the GPU."""
    wall = Clock()
    gpu_use: dict[int, float] = {}
    kernels = RemoteKernels(
        "broker", heartbeat_timeout=10, clock=clock, wall_clock=wall, gpu_use=lambda: dict(gpu_use),
        max_busy_without_gpu=100.0,
    )
    server = servers()
    connect(kernels, "s1", "bob", pid=server.pid)
    # A sleeping process, reported busy with activity "now", every time: never busy for the broker.
    for _ in range(3):
        wall.now += 5
        clock.now += 5
        beat(kernels, "s1", k={"busy": True, "pid": server.kernel_pid, "last_busy_at": wall.now, "started_at": 1.0})
        kernels.process_trees()
        busy, last, _ = kernels.activity()["k"]
        assert busy is False and last is None
    # The same kernel on the GPU: busy it is.
    gpu_use[server.kernel_pid] = 80.0
    busy, last, _ = kernels.activity()["k"]
    assert busy is True and last == wall.now
    # A kernel that really runs on the CPU: busy, but only up to max_busy_without_gpu.
    spinner = ServerProcess("while True: pass")
    try:
        connect(kernels, "s2", "bob", pid=spinner.pid)
        results = []
        for _ in range(30):
            wall.now += 5
            clock.now += 5
            beat(kernels, "s2", c={"busy": True, "pid": spinner.kernel_pid, "last_busy_at": wall.now})
            beat(kernels, "s1", k={"busy": False, "pid": server.kernel_pid})
            kernels.process_trees()
            time.sleep(0.02)
            kernels.process_trees()
            results.append(kernels.activity()["c"][0])
        assert results[1] is True, "a kernel that computes is busy"
        assert results[-1] is False, "claimed busy for 150 s without the GPU: no longer"
    finally:
        spinner.close()


def test_a_claimed_kernel_is_alive_while_it_launches(kernels, clock):
    connect(kernels, "s1", "alice", Conn())
    kernels.register("k1", "alice", "s1")
    beat(kernels, "s1")  # a heartbeat sent before the kernel existed
    assert kernels.alive("k1") is True
    clock.now += 61
    assert kernels.alive("k1") is False


def test_a_stopped_servers_kernels_go_with_their_processes(kernels, clock, child):
    conn = Conn()
    connect(kernels, "s1", "alice", conn)
    beat(kernels, "s1", k1={"pid": child.pid, "pids": [child.pid]})
    kernels.disconnect("s1", conn)
    assert kernels.alive("k1") is True, "just disconnected: the kernel's process still runs"
    assert kernels.activity()["k1"][0] is False
    child.kill()
    child.wait(10)
    assert kernels.alive("k1") is False


def test_a_silent_servers_kernels_keep_their_leases_only_while_on_a_gpu(kernels, clock, gpu, child):
    connect(kernels, "s1", "alice", Conn())
    beat(kernels, "s1", k1={"pid": child.pid, "pids": [child.pid]})
    clock.now += 5
    assert kernels.alive("k1") is True
    clock.now += 10  # silent past the timeout, the socket never closed
    assert kernels.alive("k1") is False, "not on a GPU: its lease can go"
    gpu.add(child.pid)
    assert kernels.alive("k1") is True, "its process still holds a GPU: left behind, reported"
    stranded = kernels.stranded()
    assert stranded == [{"pid": child.pid, "kernel_id": "k1", "user": "alice", "server_id": "s1"}]
    assert kernels.servers()[0]["connected"] is False


def test_orders_go_to_the_kernels_server(kernels):
    conn = Conn()
    connect(kernels, "s1", "alice", conn)
    beat(kernels, "s1", k1={})
    asyncio.run(kernels.restart("k1"))
    asyncio.run(kernels.shutdown("k1"))
    assert conn.orders == [("restart", "k1"), ("shutdown", "k1")]
    kernels.disconnect("s1", conn)
    with pytest.raises(RuntimeError, match="not connected"):
        asyncio.run(kernels.restart("k1"))


@pytest.mark.parametrize(
    "kernel_id, info, words",
    [
        ("../x", {}, "not a kernel id"),
        ("k1", [], "must be an object"),
        ("k1", {"pid": "12"}, "pid must be"),
        ("k1", {"pid": -1}, "pid must be"),
        ("k1", {"pids": "1,2"}, "pids must be"),
        ("k1", {"pids": list(range(1, 5000))}, "at most"),
        ("k1", {"last_busy_at": "yesterday"}, "last_busy_at"),
        ("k1", {"notebook": "x" * 2000}, "notebook"),
    ],
)
def test_malformed_heartbeat_entries_are_refused(kernel_id, info, words):
    with pytest.raises(HeartbeatError, match=words):
        parse_kernel_report(kernel_id, info)


def test_a_malformed_heartbeat_leaves_the_rest_alone(kernels):
    connect(kernels, "s1", "alice", Conn())
    with pytest.raises(HeartbeatError):
        kernels.heartbeat("s1", ["k1"])
    with pytest.raises(HeartbeatError):
        kernels.heartbeat("unknown", {})
    problems = beat(kernels, "s1", k1={"pid": "x"}, k2={})
    assert len(problems) == 1 and kernels.alive("k2") is True


def test_the_broker_command_returns_an_exit_status(tmp_path, capsys):
    from jupyter_gpusched.cli import main

    assert main(["broker", "--help"]) == 0
    assert main(["broker", "--GPUBroker.policy=greedy"]) == 2
    assert "policy" in capsys.readouterr().err
    assert main(["broker", f"--config={tmp_path / 'missing.py'}"]) == 2
    assert main(["broker", "--GPUBroker.heartbeat_interval=30", "--GPUBroker.heartbeat_timeout=10"]) == 2


def test_the_broker_reads_its_settings_from_the_hub_config(tmp_path):
    from jupyter_gpusched.hub.broker import GPUBroker

    config = tmp_path / "jupyterhub_config.py"
    config.write_text(
        "c = get_config()\n"
        "c.JupyterHub.services = [{'name': 'gpusched'}]\n"
        "c.GPUBroker.quotas = {'group:staff': 2, '*': 1}\n"
        "c.GPUBroker.max_pending_per_user = 7\n"
        "c.GPUBroker.policy = 'dynamic'\n"
    )
    app = GPUBroker()
    app.initialize([f"--config={config}", "--GPUBroker.policy=hybrid"])
    cfg = app.sched_config()
    assert cfg.quotas == {"group:staff": 2, "*": 1} and cfg.max_pending_per_user == 7
    assert cfg.policy == "hybrid", "the command line wins over the file"
    os.environ.pop("JUPYTERHUB_SERVICE_URL", None)
    assert app.listen_address() == ("127.0.0.1", 10101)
    assert app.prefix == "/services/gpusched/"


def test_kernels_claimed_for_but_never_reported_are_forgotten(kernels, clock):
    kernels.register("ghost", "mallory", "nowhere")
    kernels.register("refused", "mallory", "nowhere")
    kernels.unregister("refused")
    assert kernels.user_of("refused") is None
    assert kernels.alive("ghost") is True
    clock.now += 61
    kernels.prune()
    assert kernels.alive("ghost") is False and not kernels.known("ghost")
    clock.now += 11
    kernels.prune()
    assert kernels.servers() == []


def test_a_kernel_whose_process_died_but_is_still_listed_is_restarting(kernels, child):
    conn = Conn()
    connect(kernels, "s1", "alice", conn)
    beat(kernels, "s1", k1={"pid": child.pid, "pids": [child.pid]})
    assert kernels.restarting("k1") is False
    child.kill()
    child.wait(10)
    assert kernels.restarting("k1") is True, "the server restarts it: a new process takes over"
    assert kernels.alive("k1") is True
    new = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        beat(kernels, "s1", k1={"pid": new.pid, "pids": [new.pid]})
        assert kernels.restarting("k1") is False and kernels.kernel_pid("k1") == new.pid
        beat(kernels, "s1", k1={"restarting": True, "pid": new.pid})
        assert kernels.restarting("k1") is True
    finally:
        new.kill()
        new.wait(10)


def test_a_reused_pid_is_not_shown_as_the_kernels_process_between_heartbeats(kernels, servers, gpu):
    """Each look at a kernel's processes checks their start times: a pid that now belongs to a
    process started at another time (the kernel's ended and its pid was reused) is not the
    kernel's, even before the next heartbeat says so."""
    server = servers()
    connect(kernels, "s1", "alice", pid=server.pid)
    assert beat(kernels, "s1", k1={"pid": server.kernel_pid}) == []
    kernels.process_trees()
    kernels.activity()
    assert kernels.kernel_pid("k1") == server.kernel_pid
    assert kernels.process_tree("k1") == {server.kernel_pid}
    assert kernels.owner_of(server.kernel_pid)["server_id"] == "s1"
    # As if the kernel's process had ended and its pid gone to a new process: the pid's process
    # now started at another time than the one the broker found.
    kernel = kernels._kernels["k1"]
    kernel.pid_started -= 60
    kernel.tree_started = {server.kernel_pid: kernel.pid_started}
    gpu.add(server.kernel_pid)
    assert kernels.kernel_pid("k1") is None
    assert kernels.process_tree("k1") == set()
    assert kernels.owner_of(server.kernel_pid)["server_id"] == "s1", "still a process under alice's server"
    assert kernels.process_trees()["k1"] == set(), "no tree walked from a pid that is another process now"
    clock_now = kernels.clock()
    kernels.clock = lambda: clock_now + 20  # the server falls silent
    assert kernels.stranded() == [], "not the kernel's process left behind"
    # The next heartbeat names the pid again: checked as a new process of the server, it is taken.
    kernels.clock = lambda: clock_now
    assert beat(kernels, "s1", k1={"pid": server.kernel_pid}) == []
    assert kernels.kernel_pid("k1") == server.kernel_pid


def test_a_child_of_a_kernel_reused_as_a_pid_is_not_the_kernels(kernels, servers):
    server = servers()
    connect(kernels, "s1", "alice", pid=server.pid)
    beat(kernels, "s1", k1={"pid": server.kernel_pid})
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        kernel = kernels._kernels["k1"]
        # The tree once held a child whose pid a stranger's process now has (it started later).
        kernel.tree = frozenset({server.kernel_pid, stranger.pid})
        kernel.tree_started = {server.kernel_pid: kernel.pid_started, stranger.pid: procs.started(stranger.pid) - 60}
        assert kernels.process_tree("k1") == {server.kernel_pid}
        assert kernels.owner_of(stranger.pid)["server_id"] is None
    finally:
        stranger.kill()
        stranger.wait(10)
