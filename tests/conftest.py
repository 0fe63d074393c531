"""Shared fixtures: a real Jupyter server with the extension on simulated GPUs, and a clock."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import urllib.request
import subprocess
import socket
import signal
import uuid
from pathlib import Path

import pytest

pytest_plugins = ("pytest_jupyter.jupyter_server",)

ROOT = Path(__file__).resolve().parent.parent


def trace_path() -> Path:
    """The NotebookOS trace: beside the checkout if present, else the copy in the repository."""
    beside = ROOT.parent / "shared" / "traces" / "notebookos-adobe-2021-06-01-02.json"
    return beside if beside.exists() else ROOT / "traces" / "notebookos-adobe-2021-06-01-02.json"


class FakeClock:
    """A clock that moves only when told to; starts at the real time."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture(autouse=True)
def _environment_kept():
    """Each test starts from the environment the run began with, and leaves it so: a test that
    runs the kernel agent in this process (its limits keeper writes the frameworks' variables)
    must not hand those variables to the kernels that later tests start."""
    before = dict(os.environ)
    yield
    if os.environ != before:
        os.environ.clear()
        os.environ.update(before)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def sched_config():
    """Scheduling traits for a test server; tests override by updating the dict."""
    return {
        "backend": "simulated",
        "simulated_devices": 2,
        "idle_timeout": 300.0,
        "contended_idle_timeout": 60.0,
        "release_timeout": 3600.0,
        "grace_period": 60.0,
        "poll_interval": 0.5,
    }


@pytest.fixture
def jp_server_config(sched_config, tmp_path):
    cfg = dict(sched_config)
    cfg.setdefault("ledger_path", str(tmp_path / "ledger.sqlite"))
    return {
        "ServerApp": {"jpserver_extensions": {"jupyter_gpusched": True}, "allow_root": True},
        "GPUSchedApp": cfg,
    }


@pytest.fixture
def gpu_kernelspec(jp_data_dir):
    """A kernelspec named ``gpu`` that starts IPython kernels through gpusched-provisioner."""

    def make(name: str = "gpu", **config) -> str:
        spec_dir = jp_data_dir / "kernels" / name
        spec_dir.mkdir(parents=True, exist_ok=True)
        prov = {"gpus": 1, "bind": "lazy", **config}
        spec = {
            "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": f"Python (GPU {name})",
            "language": "python",
            "metadata": {
                "kernel_provisioner": {"provisioner_name": "gpusched-provisioner", "config": prov}
            },
        }
        (spec_dir / "kernel.json").write_text(json.dumps(spec))
        return name

    return make


@pytest.fixture
def jp_serverapp(jp_serverapp, jp_asyncio_loop):
    """The test server, with extensions started as ``jupyter server`` starts them.

    At the end, kernels still starting or restarting (a reclaim's restart that a test does not
    wait for) are given time to be ready first: the server's shutdown of a kernel whose ``ready``
    is not done yet raises InvalidStateError in jupyter_client and fails the test's teardown."""
    jp_asyncio_loop.run_until_complete(jp_serverapp.extension_manager.start_all_extensions())
    yield jp_serverapp

    async def settle() -> None:
        km = jp_serverapp.kernel_manager
        deadline = time.monotonic() + 30.0
        for kernel_id in list(km.list_kernel_ids()):
            try:
                ready = km.get_kernel(kernel_id).ready
            except KeyError:
                continue
            while not ready.done() and time.monotonic() < deadline:
                await asyncio.sleep(0.1)

    try:
        jp_asyncio_loop.run_until_complete(settle())
    except Exception:  # noqa: BLE001 - best effort: the server's own cleanup follows
        pass


@pytest.fixture
def arbiter(jp_serverapp):
    from jupyter_gpusched.server import registry

    reg = registry.current()
    assert reg is not None, "the extension did not start"
    return reg.arbiter


@pytest.fixture
def use_clock(arbiter, clock):
    """Put the server's arbiter and kernel watcher on the fake clock."""
    arbiter.clock = clock
    if arbiter.kernels is not None:
        arbiter.kernels.clock = clock
    return clock


class KernelSession:
    """A real kernel started through the REST API, driven over its websocket."""

    def __init__(self, fetch, ws_fetch, kernel_id: str) -> None:
        self.fetch = fetch
        self.ws_fetch = ws_fetch
        self.id = kernel_id
        self.ws = None

    async def connect(self) -> None:
        self.ws = await self.ws_fetch("api", "kernels", self.id, "channels")

    @staticmethod
    def _message(msg_type: str, content: dict) -> dict:
        return {
            "header": {
                "msg_id": uuid.uuid4().hex,
                "msg_type": msg_type,
                "username": "test",
                "session": uuid.uuid4().hex,
                "version": "5.3",
                "date": "",
            },
            "parent_header": {},
            "metadata": {},
            "content": content,
            "channel": "shell",
            "buffers": [],
        }

    async def ready(self, timeout: float = 60.0) -> None:
        """Wait until the kernel answers a kernel_info_request (without running a cell)."""
        deadline = time.monotonic() + timeout
        while True:
            msg = self._message("kernel_info_request", {})
            await self.ws.write_message(json.dumps(msg))
            try:
                while True:
                    raw = await asyncio.wait_for(self.ws.read_message(), 2.0)
                    reply = json.loads(raw)
                    if reply["header"]["msg_type"] == "kernel_info_reply":
                        return
            except asyncio.TimeoutError:
                if time.monotonic() > deadline:
                    raise

    async def execute(self, code: str, timeout: float = 60.0) -> dict:
        """Run ``code``; return {"stdout", "stderr", "error", "display"} once the cell is done."""
        if self.ws is None:
            await self.connect()
        msg = self._message(
            "execute_request",
            {"code": code, "silent": False, "store_history": True, "allow_stdin": False},
        )
        msg_id = msg["header"]["msg_id"]
        await self.ws.write_message(json.dumps(msg))
        out = {"stdout": "", "stderr": "", "error": None, "display": []}
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"cell did not finish in {timeout}s: {code!r}; so far {out}")
            raw = await asyncio.wait_for(self.ws.read_message(), remaining)
            if raw is None:
                raise ConnectionError("kernel websocket closed")
            reply = json.loads(raw)
            if reply.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            kind = reply["header"]["msg_type"]
            content = reply["content"]
            if kind == "stream":
                out[content["name"]] += content["text"]
            elif kind == "error":
                out["error"] = f"{content['ename']}: {content['evalue']}"
            elif kind in ("display_data", "update_display_data", "execute_result"):
                out["display"].append(content.get("data", {}).get("text/plain", ""))
            elif kind == "status" and content["execution_state"] == "idle":
                return out

    async def close(self) -> None:
        if self.ws is not None:
            self.ws.close()


@pytest.fixture
def start_kernel(jp_fetch, jp_ws_fetch):
    """Start a real kernel of a kernelspec through the REST API."""
    sessions: list[KernelSession] = []

    async def start(name: str = "gpu") -> KernelSession:
        r = await jp_fetch("api", "kernels", method="POST", body=json.dumps({"name": name}))
        kernel_id = json.loads(r.body)["id"]
        session = KernelSession(jp_fetch, jp_ws_fetch, kernel_id)
        await session.connect()
        sessions.append(session)
        await session.ready()
        return session

    yield start
    for session in sessions:
        try:
            asyncio.get_event_loop().run_until_complete(session.close())
        except Exception:  # noqa: BLE001 - best effort
            pass


async def api(jp_fetch, *parts, method="GET", body=None, headers=None, **kwargs):
    """Call the REST API; return (status, json or None) without raising on HTTP errors."""
    from tornado.httpclient import HTTPClientError

    try:
        r = await jp_fetch(
            "api",
            "gpusched",
            *parts,
            method=method,
            body=None if body is None else (body if isinstance(body, (str, bytes)) else json.dumps(body)),
            headers=headers,
            allow_nonstandard_methods=True,
            **kwargs,
        )
        return r.code, (json.loads(r.body) if r.body else None)
    except HTTPClientError as exc:
        text = exc.response.body if exc.response is not None else b""
        try:
            return exc.code, json.loads(text) if text else None
        except ValueError:
            return exc.code, {"raw": text.decode(errors="replace")}


# -- a real server process ---------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A real ``jupyter server`` process with the extension on 2 simulated GPUs."""

    def __init__(self, tmp_path, ledger: str, port: int, extra: tuple[str, ...] = ()) -> None:
        self.port = port
        self.token = "test-token"
        env = dict(os.environ)
        env["JUPYTER_RUNTIME_DIR"] = str(tmp_path / "runtime")
        env["JUPYTER_CONFIG_DIR"] = str(tmp_path / "config")
        env["JUPYTER_DATA_DIR"] = str(tmp_path / "data")
        self.log = open(tmp_path / f"server-{port}-{time.monotonic_ns()}.log", "w")
        self.proc = subprocess.Popen(
            [
                sys.executable, "-m", "jupyter_server",
                f"--port={port}", "--ip=127.0.0.1", "--no-browser", "--allow-root",
                f"--IdentityProvider.token={self.token}",
                f"--ServerApp.root_dir={tmp_path}",
                "--ServerApp.jpserver_extensions={'jupyter_gpusched': True}",
                "--GPUSchedApp.backend=simulated",
                "--GPUSchedApp.simulated_devices=2",
                f"--GPUSchedApp.ledger_path={ledger}",
                "--GPUSchedApp.poll_interval=0.5",
                *extra,
            ],
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                self.call("GET", "api/gpusched/status")
                return
            except OSError:
                time.sleep(0.3)
        raise RuntimeError(f"server on port {port} did not start")

    def call(self, method: str, path: str, body=None):
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/{path}",
            data=None if body is None else json.dumps(body).encode(),
            method=method,
            headers={"Authorization": f"token {self.token}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=30) as resp:
            raw = resp.read()
            return resp.status, json.loads(raw) if raw else None

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()



#: The one-minute tier (``-m unit``): the modules of the core, the ledger, the simulator, notices,
#: views and the pure parts of the kernel side and the broker. Their tests that start a Jupyter
#: server, a hub or a browser, or are marked slow, are left out of it (and so is
#: test_simulate_scaling.py, which times replays of growing traces).
UNIT_MODULES = frozenset({
    # core
    "test_core_gentle", "test_core_over_share", "test_core_placement", "test_core_properties",
    "test_core_scheduler", "test_core_units", "test_core_usage", "test_checkpoint_budget",
    "test_checkpoint_lock_core", "test_forecast", "test_mig_core", "test_reclaim_choice_core",
    "test_restore_core", "test_unleased_memory_core",
    # ledger
    "test_ledger", "test_ledger_retention",
    # simulate
    "test_simulate", "test_simulate_checkpoints", "test_simulate_nodes", "test_simulate_users",
    # notices and views
    "test_kernel_notices", "test_kernel_before_cell", "test_viewer_privacy",
    # the reclaim executor without a server, and its pure parts
    "test_reclaim_executor_host", "test_reclaim_fit",
    # the kernel side's and the broker's pure parts
    "test_panel", "test_shared_limits", "test_reclaim_choice_kernel", "test_hub_evidence", "test_hub_registry",
})
#: Fixtures that start a Jupyter server: a test that uses one is not a unit test.
SERVER_FIXTURES = frozenset({"jp_fetch", "jp_ws_fetch", "jp_serverapp", "arbiter", "start_kernel"})
NOT_UNIT_MARKERS = ("slow", "hub", "browser", "gpu")


def _mark_unit(items) -> None:
    unit = pytest.mark.unit
    for item in items:
        module = item.module.__name__.rpartition(".")[2] if getattr(item, "module", None) else ""
        if (
            module in UNIT_MODULES
            and SERVER_FIXTURES.isdisjoint(getattr(item, "fixturenames", ()))
            and not any(item.get_closest_marker(name) for name in NOT_UNIT_MARKERS)
        ):
            item.add_marker(unit)


def pytest_collection_modifyitems(config, items):
    _mark_unit(items)
    # Real-GPU tests run only when asked for with -m gpu.
    if "gpu" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="needs a real NVIDIA GPU; run with -m gpu")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


os.environ.setdefault("JUPYTER_PLATFORM_DIRS", "1")


async def live_lease(jp_fetch, kernel_id: str) -> dict:
    """The one live lease of ``kernel_id``, through the REST API."""
    code, leases = await api(jp_fetch, "leases", params={"kernel_id": kernel_id})
    assert code == 200
    live = [le for le in leases if le["state"] != "released"]
    assert len(live) == 1, leases
    return live[0]
