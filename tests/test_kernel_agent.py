"""The kernel side against a small in-test HTTP server that speaks the ``api/gpusched`` contract.

The server is a real ``http.server`` on 127.0.0.1 with just enough state (GPUs, leases, a
scripted queue) to drive the client, the Python API, the ``%gpu`` magics through a real IPython
shell, the pre-run hook and the watcher.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from IPython.core.interactiveshell import InteractiveShell
from traitlets.config import Config

from jupyter_gpusched.kernel import agent as agent_mod
from jupyter_gpusched.kernel.agent import Agent, CellNotRun
from jupyter_gpusched.kernel.client import Client, GPUSchedError, NoServerError
from jupyter_gpusched.kernel.cuda import CudaState
from jupyter_gpusched.kernel.limits import LIMIT_VARS

KERNEL = "k-0001"
KERNEL_TOKEN = "kernel-secret"
SERVER_TOKEN = "server-secret"
GiB = 1024**3
UUIDS = ["GPU-0a0a0a0a-0000-0000-0000-000000000000", "GPU-1b1b1b1b-0000-0000-0000-000000000000"]


def iso(seconds_from_now: float = 0.0) -> str:
    moment = datetime.now(timezone.utc) + timedelta(seconds=seconds_from_now)
    return moment.isoformat().replace("+00:00", "Z")


# -- the fake server -------------------------------------------------------------------------
class FakeScheduler:
    """State and behaviour of the fake ``api/gpusched`` server."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.devices = [
            {
                "uuid": u,
                "index": i,
                "name": "NVIDIA H100 80GB HBM3",
                "memory_total": 80 * GiB,
                "memory_used": 0,
                "utilization": 0.0,
                "health": "ok",
                "processes": [],
            }
            for i, u in enumerate(UUIDS)
        ]
        self.leases: dict[str, dict] = {}
        self.positions: dict[str, list[int]] = {}  # kernel id -> positions to answer before a grant
        self.requests: list[tuple[str, str, dict, object]] = []
        self.no_inventory = False
        self.extension = True
        self.long_poll = False
        self.kernels = {KERNEL}
        self.max_keep = 7200
        self.freed_endpoint = True  # False: an older server without POST leases/{id}/freed
        self.freed: list[tuple[str, object]] = []  # (lease id, body) of free-cache acknowledgements
        self._next = 0
        self.usage: list[dict] = []  # the status's recent usage per user
        self.usage_half_life = 86400.0

    # helpers the tests use
    def lease_of(self, kernel_id: str = KERNEL) -> dict | None:
        live = [
            le for le in self.leases.values() if le["kernel_id"] == kernel_id and le["state"] != "released"
        ]
        return live[-1] if live else None

    def add_lease(self, kernel_id: str, state: str, devices: list[str], user: str = "alice", **extra) -> dict:
        self._next += 1
        lease = {
            "id": f"L{self._next}",
            "kernel_id": kernel_id,
            "user": user,
            "holder": user,
            "notebook": extra.pop("notebook", None),
            "count": len(devices) or 1,
            "devices": list(devices),
            "device_indices": [UUIDS.index(d) for d in devices],
            "memory": None,
            "mode": "exclusive",
            "state": state,
            "position": None,
            "granted_at": iso(),
            "last_active_at": iso(),
            "idle_seconds": 0,
            "reclaim_at": None,
            "reclaim_step": None,
            "keep_until": None,
            "reason": "",
        }
        lease.update(extra)
        self.leases[lease["id"]] = lease
        return lease

    def count(self, method: str, prefix: str = "") -> int:
        return sum(1 for m, p, _, _ in self.requests if m == method and p.startswith(prefix))

    def free_devices(self) -> list[str]:
        held = {
            d
            for le in self.leases.values()
            if le["state"] in ("active", "idle", "reclaiming")
            for d in le["devices"]
        }
        return [d["uuid"] for d in self.devices if d["uuid"] not in held and d["health"] == "ok"]

    def grant(self, lease: dict) -> bool:
        free = self.free_devices()
        if len(free) < lease["count"]:
            return False
        lease.update(
            state="active",
            devices=free[: lease["count"]],
            device_indices=[UUIDS.index(u) for u in free[: lease["count"]]],
            position=None,
            granted_at=iso(),
            reason="granted",
            reclaim_at=None,
            reclaim_step=None,
        )
        return True

    def status(self) -> dict:
        devices = []
        for dev in self.devices:
            ids = [
                le["id"]
                for le in self.leases.values()
                if dev["uuid"] in le["devices"] and le["state"] in ("active", "idle", "reclaiming")
            ]
            devices.append({**dev, "lease_ids": ids})
        queue = [
            {
                "lease_id": le["id"],
                "kernel_id": le["kernel_id"],
                "user": le["user"],
                "position": le["position"],
                "count": le["count"],
            }
            for le in self.leases.values()
            if le["state"] == "pending"
        ]
        return {
            "mode": "standalone",
            "backend": "simulated",
            "policy": "hybrid",
            "devices": devices,
            "leases": [le for le in self.leases.values() if le["state"] != "released"],
            "queue": queue,
            "checkpoint": {"available": False, "reason": "simulated"},
            "user": "alice",
            "is_admin": False,
            "config": {"usage_half_life": self.usage_half_life},
            "usage": self.usage,
        }

    # the endpoints
    def handle(self, method: str, path: str, query: dict, headers: dict, body: object) -> tuple[int, object]:
        if (
            headers.get("x-gpusched-token") != KERNEL_TOKEN
            and headers.get("authorization") != f"token {SERVER_TOKEN}"
        ):
            return 403, {"message": "Forbidden: this kernel's token is not valid", "reason": "forbidden"}
        if path.startswith("api/kernels/"):
            return (
                (200, {"id": path.rsplit("/", 1)[1]})
                if path.rsplit("/", 1)[1] in self.kernels
                else (404, None)
            )
        if not path.startswith("api/gpusched/") or not self.extension:
            return 404, b"<html><body>404: Not Found</body></html>"
        rest = path[len("api/gpusched/") :]
        if rest == "status" and method == "GET":
            return 200, self.status()
        if rest == "devices" and method == "GET":
            return 200, self.status()["devices"]
        if rest == "leases" and method == "GET":
            kid = query.get("kernel_id")
            return 200, [le for le in self.leases.values() if kid is None or le["kernel_id"] == kid]
        if rest == "leases" and method == "POST":
            return self.post_lease(body)
        parts = rest.split("/")
        if parts[0] == "leases" and len(parts) >= 2:
            lease = self.leases.get(parts[1])
            if lease is None:
                return 404, {"message": f"no lease {parts[1]}", "reason": "not found"}
            if len(parts) == 2 and method == "GET":
                return 200, lease
            if len(parts) == 2 and method == "DELETE":
                lease.update(state="released", devices=[], device_indices=[], reason="released by the kernel")
                return 204, None
            if len(parts) == 3 and parts[2] == "keep" and method == "POST":
                seconds = body.get("seconds")
                if seconds > self.max_keep:
                    return 400, {
                        "message": f"keep is limited to {self.max_keep} seconds on this server "
                        f"(asked for {seconds:.0f})",
                        "reason": "bad input",
                    }
                lease["keep_until"] = iso(seconds) if seconds else None
                return 200, lease
            if len(parts) == 3 and parts[2] == "freed" and method == "POST" and self.freed_endpoint:
                self.freed.append((lease["id"], body))
                return 200, lease
        return 404, {"message": "unknown endpoint", "reason": "not found"}

    def post_lease(self, body: dict) -> tuple[int, object]:
        count = body.get("count")
        if not isinstance(count, int) or count < 1:
            return 400, {"message": f"count must be at least 1 GPU, not {count!r}", "reason": "bad input"}
        if body.get("memory") is not None and body["memory"] > 80 * GiB:
            return 400, {
                "message": "memory 1.0 TiB per GPU is more than the largest GPU here (80.0 GiB)",
                "reason": "bad input",
            }
        if self.no_inventory:
            return 503, {"message": "this host has no GPUs to schedule", "reason": "no inventory"}
        kid = body["kernel_id"]
        mode = body.get("mode") or "exclusive"
        lease = self.lease_of(kid)
        if lease is not None and (lease["count"], lease["memory"], lease["mode"]) != (
            count,
            body.get("memory"),
            mode,
        ):
            return 409, {
                "message": f"kernel {kid} already has lease {lease['id']} ({lease['state']}) with "
                f"{lease['count']} GPU; release it first or use it",
                "reason": "conflict",
            }
        if lease is not None and lease["state"] in ("active", "idle", "reclaiming"):
            return 200, lease
        if lease is None:
            lease = self.add_lease(
                kid,
                "pending",
                [],
                user="alice",
                count=count,
                memory=body.get("memory"),
                mode=mode,
                reason="waiting for a GPU",
            )
            lease["count"] = count
        elif lease["state"] == "suspended":
            lease.update(state="pending", reason="waiting for a GPU to restore onto")
        script = self.positions.get(kid)
        if script:
            lease["position"] = script.pop(0)
            return 202, lease
        if script is not None and self.long_poll:
            lease["position"] = 1
            return 202, lease
        if self.grant(lease):
            return 201, lease
        lease["position"] = 1
        return 202, lease


@pytest.fixture
def server():
    sched = FakeScheduler()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # keep the test output clean
            pass

        def _serve(self, method: str) -> None:
            parsed = urllib.parse.urlsplit(self.path)
            path = parsed.path.lstrip("/")
            query = dict(urllib.parse.parse_qsl(parsed.query))
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length)) if length else None
            headers = {k.lower(): v for k, v in self.headers.items()}
            with sched.lock:
                sched.requests.append((method, path, headers, body))
                status, payload = sched.handle(method, path, query, headers, body)
            if sched.long_poll and method == "POST" and status == 202:
                time.sleep(min(float(body.get("wait") or 0), 5.0))
            raw = (
                payload
                if isinstance(payload, bytes)
                else (b"" if payload is None else json.dumps(payload).encode())
            )
            self.send_response(status)
            self.send_header(
                "Content-Type", "text/html" if isinstance(payload, bytes) else "application/json"
            )
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def do_GET(self):
            self._serve("GET")

        def do_POST(self):
            self._serve("POST")

        def do_DELETE(self):
            self._serve("DELETE")

    class Server(ThreadingHTTPServer):
        def handle_error(self, request, client_address):
            pass  # a client that stopped waiting (an interrupted long-poll) is expected here

    httpd = Server(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    sched.url = f"http://127.0.0.1:{httpd.server_address[1]}/"
    yield sched
    httpd.shutdown()
    httpd.server_close()
    thread.join(5)


@pytest.fixture
def provisioned(server, monkeypatch):
    """The environment the provisioner gives a lazily bound kernel."""
    monkeypatch.setenv("JUPYTER_GPUSCHED_URL", server.url)
    monkeypatch.setenv("JUPYTER_GPUSCHED_TOKEN", KERNEL_TOKEN)
    monkeypatch.setenv("JUPYTER_GPUSCHED_KERNEL_ID", KERNEL)
    monkeypatch.setenv("JUPYTER_GPUSCHED_GPUS", "1")
    monkeypatch.setenv("JUPYTER_GPUSCHED_MEMORY", "")
    monkeypatch.setenv("JUPYTER_GPUSCHED_MODE", "exclusive")
    monkeypatch.setenv("JUPYTER_GPUSCHED_BIND", "lazy")
    monkeypatch.setenv("JUPYTER_GPUSCHED_POLL", "60")  # tests drive the watcher by hand
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv("NVIDIA_VISIBLE_DEVICES", "")
    for name in LIMIT_VARS:  # a shared lease's limits, put back as they were after each test
        monkeypatch.delenv(name, raising=False)
    return server


class Shown:
    """Records what the agent shows in cells: (text, display_id, update)."""

    def __init__(self) -> None:
        self.items: list[tuple[str, str | None, bool]] = []
        self.html: list[str | None] = []
        self.on_show = None

    def __call__(self, text, html_text=None, display_id=None, update=False):
        self.items.append((text, display_id, update))
        self.html.append(html_text)
        if self.on_show is not None:
            self.on_show(text)

    @property
    def texts(self) -> list[str]:
        return [t for t, _, _ in self.items]

    def joined(self) -> str:
        return "\n".join(self.texts)


@pytest.fixture
def shell():
    cfg = Config()
    cfg.HistoryManager.hist_file = ":memory:"
    ip = InteractiveShell.instance(config=cfg)
    yield ip
    if "jupyter_gpusched" in ip.extension_manager.loaded:
        ip.extension_manager.unload_extension("jupyter_gpusched")
    agent_mod.unload_ipython_extension(ip)


def load(shell, *, initialized: bool = False) -> tuple[Agent, Shown]:
    """Load the extension as IPython does and inject the CUDA probe and the display."""
    shell.extension_manager.load_extension("jupyter_gpusched")
    agent = agent_mod.get_agent(shell)
    shown = Shown()
    agent.output.display = shown
    agent.cuda_probe = lambda: CudaState(initialized, initialized, "injected")
    agent.free_caches = list
    agent.claims.min_poll_gap = 0.01
    return agent, shown


def run(shell, code: str):
    return shell.run_cell(code, store_history=True)


# -- the client --------------------------------------------------------------------------------
def test_client_sends_the_kernel_token_and_decodes_leases(server):
    client = Client(server.url, kernel_token=KERNEL_TOKEN, kernel_id=KERNEL)
    status, lease = client.claim(1, mode="exclusive", wait=0)
    assert status == 201 and lease["state"] == "active" and lease["devices"] == [UUIDS[0]]
    method, path, headers, body = server.requests[-1]
    assert (method, path) == ("POST", "api/gpusched/leases")
    assert headers["x-gpusched-token"] == KERNEL_TOKEN and "authorization" not in headers
    assert body == {"kernel_id": KERNEL, "count": 1, "mode": "exclusive", "wait": 0.0}
    assert client.leases(KERNEL)[0]["id"] == lease["id"]
    assert client.keep(lease["id"], 60)["keep_until"]
    client.release(lease["id"])
    assert client.lease(lease["id"])["state"] == "released"


def test_client_errors_carry_the_servers_message_and_status(server):
    client = Client(server.url, kernel_token=KERNEL_TOKEN, kernel_id=KERNEL)
    with pytest.raises(GPUSchedError) as err:
        client.claim(0)
    assert err.value.status == 400 and err.value.message == "count must be at least 1 GPU, not 0"
    server.no_inventory = True
    with pytest.raises(GPUSchedError, match="no GPUs to schedule") as err:
        client.claim(1)
    assert err.value.status == 503 and err.value.reason == "no inventory"
    bad = Client(server.url, kernel_token="wrong", kernel_id=KERNEL)
    with pytest.raises(GPUSchedError, match="token is not valid") as err:
        bad.status()
    assert err.value.status == 403
    server.extension = False
    with pytest.raises(GPUSchedError, match="does not run the GPU scheduler") as err:
        client.status()
    assert err.value.status == 404


def test_client_says_plainly_when_the_server_is_gone():
    client = Client("http://127.0.0.1:9/", kernel_token="t", kernel_id=KERNEL, timeout=2)
    with pytest.raises(GPUSchedError, match="Cannot reach the GPU scheduler") as err:
        client.status()
    assert err.value.status is None


def test_discovery_reads_runtime_files_and_uses_the_server_token(server, tmp_path):
    (tmp_path / "jpserver-1.json").write_text(
        json.dumps({"url": server.url, "token": SERVER_TOKEN, "pid": os.getpid(), "base_url": "/"})
    )
    client = Client.discover(kernel_id=KERNEL, runtime_dir=str(tmp_path))
    assert client.base_url == server.url and client.kernel_id == KERNEL
    client.status()
    assert server.requests[-1][2]["authorization"] == f"token {SERVER_TOKEN}"
    assert ("GET", f"api/kernels/{KERNEL}") in [(m, p) for m, p, _, _ in server.requests]


def test_discovery_says_when_no_server_runs_the_extension(server, tmp_path):
    with pytest.raises(NoServerError, match="No running Jupyter server was found"):
        Client.discover(kernel_id=KERNEL, runtime_dir=str(tmp_path))
    (tmp_path / "jpserver-2.json").write_text(
        json.dumps({"url": server.url, "token": SERVER_TOKEN, "pid": os.getpid()})
    )
    server.extension = False
    with pytest.raises(NoServerError, match=r"The Jupyter server that runs this kernel \(http.*\) does not run"):
        Client.discover(kernel_id=KERNEL, runtime_dir=str(tmp_path))


def test_discovery_passes_over_a_scheduler_that_does_not_run_this_kernel(server, tmp_path):
    # Another server on the host runs the extension, but not this kernel (nbconvert started it):
    # its GPUs are not this kernel's to see, and it would never grant this kernel one.
    (tmp_path / "jpserver-3.json").write_text(
        json.dumps({"url": server.url, "token": SERVER_TOKEN, "pid": os.getpid()})
    )
    server.kernels = {"someone-elses-kernel"}
    with pytest.raises(NoServerError, match="No running Jupyter server runs this kernel"):
        Client.discover(kernel_id=KERNEL, runtime_dir=str(tmp_path))
    assert not any(p.startswith("api/gpusched") for _, p, _, _ in server.requests)


@pytest.fixture
def no_scheduler(server, tmp_path, monkeypatch):
    """A kernel that no server with the extension runs, on a host where one server has it."""
    for name in ("URL", "TOKEN", "KERNEL_ID"):
        monkeypatch.delenv(f"JUPYTER_GPUSCHED_{name}", raising=False)
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path))
    (tmp_path / "jpserver-4.json").write_text(
        json.dumps({"url": server.url, "token": SERVER_TOKEN, "pid": os.getpid()})
    )
    server.kernels = {"someone-elses-kernel"}
    monkeypatch.setattr(agent_mod, "_kernel_id_from_connection_file", lambda: KERNEL)
    return server


def test_without_a_scheduler_every_magic_and_call_says_so_and_none_shows_gpus(shell, no_scheduler):
    agent, shown = load(shell)
    for line in ("%gpu", "%gpu status --all", "%gpu keep 30m", "%gpu panel", "%gpu release"):
        assert run(shell, line).success, line
    text = shown.joined()
    assert len(shown.texts) == 5 and all(t.startswith("No GPU scheduler for this kernel") for t in shown.texts)
    # Why, and what to do, is said once (the first time), not at every magic.
    assert text.count("No running Jupyter server runs this kernel") == 1
    assert "there is no GPU to keep" in text and "there is no GPU to release" in text
    assert "H100" not in text and "free" not in text
    result = run(shell, "%gpu acquire")
    assert isinstance(result.error_in_exec, NoServerError)

    from jupyter_gpusched import gpu

    assert gpu.has_scheduler is False
    for call in (gpu.status, gpu.acquire, gpu.release, lambda: gpu.keep("10m")):
        with pytest.raises(NoServerError, match="No running Jupyter server runs this kernel"):
            call()
    with pytest.raises(NoServerError), gpu.lease(1):
        pass
    # The host's other scheduler was never asked about GPUs, and ordinary cells still run.
    assert not any(p.startswith("api/gpusched") for _, p, _, _ in no_scheduler.requests)
    assert run(shell, "x = 1").success and agent.lease is None


# -- the pre-run hook ----------------------------------------------------------------------------
def test_first_cell_binds_lazily_to_the_granted_gpu(shell, provisioned):
    _agent, shown = load(shell)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
    result = run(shell, "import os; seen = os.environ['CUDA_VISIBLE_DEVICES']")
    assert result.success
    assert shell.user_ns["seen"] == UUIDS[0]
    assert os.environ["NVIDIA_VISIBLE_DEVICES"] == UUIDS[0]
    assert provisioned.lease_of()["state"] == "active"
    assert any("This kernel uses GPU 0" in t for t in shown.texts)


def test_cells_on_an_active_lease_only_read_it(shell, provisioned):
    _agent, _shown = load(shell)
    run(shell, "a = 1")
    before = len(provisioned.requests)
    for i in range(20):
        assert run(shell, f"b = {i}").success
    made = provisioned.requests[before:]
    # One read of the kernel's own lease per cell (it may have been checkpointed since), no writes.
    assert [(m, p) for m, p, _, _ in made] == [("GET", "api/gpusched/leases")] * 20


def test_a_lease_checkpointed_since_the_last_read_is_restored_before_the_cell(shell, provisioned):
    agent, shown = load(shell)
    run(shell, "a = 1")
    assert agent.lease["state"] == "active"
    # The server checkpoints the kernel a moment after the agent last read its lease: the next
    # cell must not run CUDA code on the checkpointed state, it asks for the restore first.
    provisioned.lease_of().update(state="suspended", devices=[], device_indices=[],
                                  reason="suspended: GPU state checkpointed to host memory")
    before = len(provisioned.requests)
    assert run(shell, "b = 2").success
    assert provisioned.count("POST", "api/gpusched/leases") >= 1
    assert ("POST", "api/gpusched/leases") in [(m, p) for m, p, _, _ in provisioned.requests[before:]]
    assert provisioned.lease_of()["state"] == "active"
    assert any(t.startswith("Restored this kernel's GPU state onto GPU") for t in shown.texts)


def test_gpu_magics_cells_do_not_take_a_gpu(shell, provisioned):
    _agent, _shown = load(shell)
    run(shell, "%gpu status")
    assert provisioned.count("POST") == 0
    assert provisioned.lease_of() is None


def test_waiting_shows_a_live_queue_position_then_binds(shell, provisioned):
    provisioned.positions[KERNEL] = [3, 2, 1]
    _agent, shown = load(shell)
    result = run(shell, "ran = True")
    assert result.success and shell.user_ns["ran"] is True
    waits = [(t, d, u) for t, d, u in shown.items if t.startswith("Waiting for a GPU")]
    assert [w[0].split(":")[1].split("(")[0].strip() for w in waits] == [
        "position 3 in the queue",
        "position 2 in the queue",
        "position 1 in the queue",
    ]
    ids = {d for _, d, _ in waits}
    assert len(ids) == 1 and None not in ids  # one display, updated in place
    assert [u for _, _, u in waits] == [False, True, True]
    final = [t for t, d, _ in shown.items if d in ids][-1]
    assert final == "Got GPU 0."  # served within a second: no "after 0s in the queue"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == UUIDS[0]


def test_a_long_wait_says_how_long_and_lists_the_gpus_in_index_order(shell, provisioned, monkeypatch):
    provisioned.positions[KERNEL] = [2, 1]
    plain_grant = provisioned.grant

    def grant_in_reverse(lease):
        # The server lists the devices in its own order; index 1 first here.
        if not plain_grant(lease):
            return False
        lease.update(devices=UUIDS[::-1], device_indices=[1, 0])
        return True

    monkeypatch.setattr(provisioned, "grant", grant_in_reverse)
    agent, shown = load(shell)
    ticks = iter(range(1_000_000, 2_000_000, 4))
    agent.clock = lambda: float(next(ticks))
    agent.acquire(2)
    waited = [t for t in shown.texts if t.startswith("Got ")]
    assert len(waited) == 1 and re.fullmatch(r"Got GPUs 0, 1 after \d+s in the queue\.", waited[0]), waited
    assert shown.texts[-1] == f"This kernel holds GPUs 0, 1 ({UUIDS[0]}, {UUIDS[1]})."
    # cuda:0 is GPU 0: the kernel sees its GPUs in index order.
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ",".join(UUIDS)


def test_no_wait_returns_at_once_with_the_position(shell, provisioned):
    provisioned.positions[KERNEL] = [2, 2, 2]
    agent, shown = load(shell)
    result = run(shell, "%gpu acquire --no-wait")
    assert result.success
    assert provisioned.count("POST", "api/gpusched/leases") == 1
    assert provisioned.requests[-1][3]["wait"] == 0
    assert "position 2 in the queue" in shown.joined()
    assert agent.lease["state"] == "pending"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""


def test_a_background_grant_is_announced_and_bound_at_the_next_cell(shell, provisioned):
    provisioned.positions[KERNEL] = [2]
    agent, shown = load(shell)
    run(shell, "%gpu acquire --no-wait")
    provisioned.grant(provisioned.lease_of())
    agent.watch_once()
    assert "Granted GPU 0" in shown.joined()
    run(shell, "x = 1")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == UUIDS[0]


def test_a_limited_wait_that_runs_out_withdraws_the_claim(shell, provisioned):
    provisioned.positions[KERNEL] = [4] * 1000
    agent, _shown = load(shell)
    agent.claims.long_poll = 0.05
    with pytest.raises(GPUSchedError, match="No GPU became free within") as err:
        agent.acquire(1, wait=0.3)
    assert "position 4" in err.value.message and "withdrawn" in err.value.message
    assert provisioned.count("DELETE") == 1
    assert provisioned.lease_of() is None


def test_interrupting_a_wait_withdraws_the_claim_and_skips_the_cell(shell, provisioned):
    provisioned.positions[KERNEL] = []
    provisioned.long_poll = True  # the server holds each claim request, as a real long-poll does
    _agent, _shown = load(shell)
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        result = run(shell, "ran_interrupted = True")
    finally:
        timer.cancel()
    assert "ran_interrupted" not in shell.user_ns
    assert isinstance(result.error_before_exec, CellNotRun)
    assert "request was withdrawn" in str(result.error_before_exec)
    assert provisioned.count("DELETE") == 1 and provisioned.lease_of() is None
    # The next cell asks again, as a cell after an interrupt should.
    provisioned.long_poll = False
    provisioned.positions.pop(KERNEL)
    assert run(shell, "ran_interrupted = True").success
    assert os.environ["CUDA_VISIBLE_DEVICES"] == UUIDS[0]


def test_a_suspended_lease_is_restored_before_the_next_cell(shell, provisioned):
    _agent, shown = load(shell, initialized=True)
    monkey_env = UUIDS[1]
    os.environ["CUDA_VISIBLE_DEVICES"] = monkey_env
    provisioned.add_lease(KERNEL, "suspended", [], reason="suspended: GPU state checkpointed")
    result = run(shell, "y = 2")
    assert result.success
    lease = provisioned.lease_of()
    assert lease["state"] == "active"
    assert any(t.startswith("Restored this kernel's GPU state onto GPU 0") for t in shown.texts)
    # The restore moved the CUDA context itself: no "restart the kernel" message.
    assert "restart the kernel" not in shown.joined()


def test_a_lease_taken_back_by_release_is_asked_for_again(shell, provisioned):
    agent, shown = load(shell)
    run(shell, "a = 1")
    first = provisioned.lease_of()
    first.update(state="released", devices=[], reason="idle for 400s (past 300s); it held no GPU memory")
    agent.watch_once()
    assert "GPU lease ended: GPU 0: idle for 400s" in shown.joined()
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
    assert run(shell, "b = 2").success
    assert provisioned.lease_of()["id"] != first["id"]
    assert os.environ["CUDA_VISIBLE_DEVICES"] == UUIDS[0]


def test_initialized_cuda_is_explained_instead_of_rebound(shell, provisioned):
    _agent, shown = load(shell, initialized=True)
    os.environ["CUDA_VISIBLE_DEVICES"] = UUIDS[1]
    provisioned.add_lease("other", "active", [UUIDS[1]], user="bob")
    assert run(shell, "z = 3").success
    assert os.environ["CUDA_VISIBLE_DEVICES"] == UUIDS[1]  # unchanged: too late to change
    text = shown.joined()
    assert (
        f"CUDA is already initialized in this kernel on {UUIDS[1]}; the new lease is on GPU 0 ({UUIDS[0]})"
        in text
    )
    assert "restart the kernel to use it" in text
    run(shell, "z = 4")
    assert shown.joined().count("CUDA is already initialized") == 1  # said once, not every cell


def test_load_ext_kernels_do_not_bind_or_call_the_server_on_their_own(shell, server, monkeypatch):
    for name in ("URL", "TOKEN", "KERNEL_ID"):
        monkeypatch.delenv(f"JUPYTER_GPUSCHED_{name}", raising=False)
    agent, _shown = load(shell)
    assert not agent.settings.auto_bind
    assert run(shell, "x = 1").success
    assert server.requests == [] and not agent.watching


def test_a_server_refusal_before_a_cell_is_one_line_and_the_cell_still_runs(shell, provisioned):
    provisioned.no_inventory = True
    _agent, shown = load(shell)
    assert run(shell, "x = 1").success
    assert shown.texts == ["GPU scheduler: this host has no GPUs to schedule. This cell runs without a GPU."]
    before = provisioned.count("POST")
    run(shell, "x = 2")  # backs off instead of asking again at every cell
    assert provisioned.count("POST") == before


# -- magics ------------------------------------------------------------------------------------
def test_status_magic_shows_the_lease_the_gpus_and_the_queue(shell, provisioned, capsys):
    provisioned.add_lease("other", "active", [UUIDS[1]], user="bob", notebook="work/train.ipynb")
    agent, _shown = load(shell)
    agent.output.display = agent_mod._ipython_display  # the real display path, printed by the shell
    run(shell, "a = 1")
    capsys.readouterr()
    run(shell, "%gpu status --all")
    out = capsys.readouterr().out
    assert "This kernel holds GPU 0 (1 GPU, exclusive): active." in out
    assert "Queue: nobody is waiting." in out
    lines = out.splitlines()
    assert any(
        line.startswith("0    NVIDIA H100 80GB HBM3") and line.endswith("this kernel") for line in lines
    )
    assert any(line.startswith("1    NVIDIA H100") and line.endswith("bob (train.ipynb)") for line in lines)
    assert "Scheduler: mode standalone, backend simulated, policy hybrid" in out
    assert "Nobody used a GPU recently." in out


def test_status_all_shows_each_users_recent_usage(shell, provisioned, capsys):
    provisioned.usage = [
        {"user": "bob", "gpu_hours": 41.234, "quota": 2.0, "held": 1.0},
        {"user": "alice", "gpu_hours": 3.04, "quota": 1.0, "held": 0.5},
    ]
    agent, _shown = load(shell)
    agent.output.display = agent_mod._ipython_display
    run(shell, "a = 1")
    capsys.readouterr()
    run(shell, "%gpu status --all")
    lines = capsys.readouterr().out.splitlines()
    start = lines.index("Recent GPU usage (half-life 1 day):")
    assert lines[start + 1].split() == ["User", "GPU-hours", "Quota", "Holds", "now"]
    assert lines[start + 2].split() == ["bob", "41.2", "2", "1"]
    assert lines[start + 3].split() == ["alice", "3.0", "1", "0.5"]
    # Plain %gpu stays short; a server that does not track usage shows no table.
    run(shell, "%gpu")
    assert "Recent GPU usage" not in capsys.readouterr().out
    provisioned.usage_half_life = 0
    run(shell, "%gpu status --all")
    assert "Recent GPU usage" not in capsys.readouterr().out


def test_a_lazy_kernel_says_it_gets_its_gpu_at_its_first_cell(shell, provisioned, capsys):
    agent, _shown = load(shell)
    agent.output.display = agent_mod._ipython_display
    run(shell, "%gpu")
    out = capsys.readouterr().out
    assert out.startswith("GPU: at first cell. This kernel asks for its GPU (1 GPU, exclusive) before its first cell runs.")
    assert "holds no GPU" not in out and provisioned.count("POST") == 0
    run(shell, "a = 1")
    run(shell, "%gpu release")
    capsys.readouterr()
    run(shell, "%gpu")
    assert capsys.readouterr().out.startswith("This kernel holds no GPU.")  # it asks for none by itself now


def test_status_says_what_idle_will_do_and_what_a_shared_lease_uses(shell, provisioned, capsys):
    agent, _shown = load(shell)
    agent.output.display = agent_mod._ipython_display
    run(shell, "a = 1")
    at = time.time() + 58 * 60 + 20
    provisioned.lease_of().update(
        mode="shared",
        memory=8 * GiB,
        memory_held=2 * GiB,
        last_active_at=iso(-5),
        idle_seconds=5,
        idle_forecast={
            "step": "checkpoint",
            "at": datetime.fromtimestamp(at, timezone.utc).isoformat().replace("+00:00", "Z"),
            "contended_at": iso(55),
            "contended_by": "anyone",
            "reason": "checkpointed after 1h00m00s idle with nobody waiting",
        },
    )
    provisioned.devices[0]["memory_used"] = None  # a GPU whose use the driver does not report
    capsys.readouterr()
    run(shell, "%gpu")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "This kernel holds GPU 0 (1 GPU, 8.0 GiB each, shared): active, uses 2.0 GiB of its 8.0 GiB share."
    hhmm = time.strftime("%H:%M", time.localtime(at))
    # A standalone server has one user: whoever waits is another of their kernels.
    assert lines[1] == f"Idle: checkpointed at {hhmm} (in 58 min) if still idle; after 60 s idle if another of your kernels waits."
    row = next(line for line in lines if line.startswith("0 "))
    assert "2.0 GiB (this kernel) / 80.0 GiB" in row and "?" not in row


@pytest.mark.parametrize(
    "line, message",
    [
        ("%gpu acquire --memory 1TiB", "more than the largest GPU here"),
        ("%gpu acquire 2", "This kernel holds GPU 0 (exclusive); %gpu release first to ask for a different GPU."),
        ("%gpu acquire 0", "count must be a whole number of GPUs, at least 1"),
        ("%gpu acquire --memory lots", "memory must be a size such as '16GiB'"),
        ("%gpu keep 3h", "keep is limited to 7200 seconds on this server"),
        ("%gpu frobnicate", "%gpu has no sub-command 'frobnicate'"),
    ],
)
def test_errors_are_one_clear_line(shell, provisioned, capsys, line, message):
    _agent, _shown = load(shell)
    run(shell, "a = 1")  # holds one GPU now
    capsys.readouterr()
    result = run(shell, line)
    out = capsys.readouterr()
    text = out.out + out.err
    assert not result.success
    assert message in text
    assert "Traceback" not in text and "File " not in text
    assert len([ln for ln in text.splitlines() if ln.strip()]) <= 3  # the message (and a usage line)


def test_no_inventory_error_is_one_line(shell, provisioned, capsys):
    provisioned.no_inventory = True
    _agent, _shown = load(shell)
    result = run(shell, "%gpu acquire")
    out = capsys.readouterr().out
    assert isinstance(result.error_in_exec, GPUSchedError) and result.error_in_exec.status == 503
    assert "GPUSchedError" in out and "this host has no GPUs to schedule" in out and "Traceback" not in out


def test_keep_and_release_magics(shell, provisioned):
    _agent, shown = load(shell)
    run(shell, "a = 1")
    assert run(shell, "%gpu keep 30m").success
    method, path, _, body = provisioned.requests[-1]
    assert method == "POST" and path.endswith("/keep") and body == {"seconds": 1800.0}
    assert "GPU 0 is kept for 30m00s" in shown.joined()
    assert run(shell, "%gpu release").success
    assert provisioned.requests[-1][0] == "DELETE"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
    # Code is marked up as code in HTML, and shown without backticks as text.
    assert "Released GPU 0." in shown.joined() and "until you run %gpu acquire." in shown.joined()
    assert "`" not in shown.joined() and "until you run <code>%gpu acquire</code>." in shown.html[-1]
    # An explicit release sticks: the next cell does not take the GPU again.
    posts = provisioned.count("POST")
    run(shell, "b = 2")
    assert provisioned.count("POST") == posts and provisioned.lease_of() is None


# -- the Python API ---------------------------------------------------------------------------
def test_python_api(shell, provisioned, monkeypatch):
    monkeypatch.setenv("JUPYTER_GPUSCHED_GPUS", "0")  # no auto-binding: the API does it all
    _agent, _shown = load(shell)
    from jupyter_gpusched import gpu

    lease = gpu.acquire(1, memory="16GiB", mode="shared", wait=None)
    assert lease["state"] == "active" and os.environ["CUDA_VISIBLE_DEVICES"] == UUIDS[0]
    claim = next(r for r in reversed(provisioned.requests) if r[0] == "POST")
    assert claim[3]["memory"] == 16 * GiB and claim[3]["mode"] == "shared"
    # The shared lease's share, where CuPy reads it.
    assert os.environ["CUPY_GPU_MEMORY_LIMIT"] == str(16 * GiB)
    status = gpu.status()
    assert status["lease"]["id"] == lease["id"] and status["kernel_id"] == KERNEL
    assert status["devices"][0]["lease_ids"] == [lease["id"]]
    assert gpu.keep("10m")["keep_until"]
    assert gpu.release()["state"] == "released"
    assert "CUPY_GPU_MEMORY_LIMIT" not in os.environ
    with gpu.lease(2) as held:
        assert held["devices"] == UUIDS
        assert os.environ["CUDA_VISIBLE_DEVICES"] == ",".join(UUIDS)
    assert provisioned.lease_of() is None and os.environ["CUDA_VISIBLE_DEVICES"] == ""
    with pytest.raises(ValueError, match="mode must be"):
        gpu.acquire(1, mode="sometimes")


def test_lease_context_releases_on_error(shell, provisioned, monkeypatch):
    monkeypatch.setenv("JUPYTER_GPUSCHED_GPUS", "0")
    load(shell)
    from jupyter_gpusched import gpu

    with pytest.raises(RuntimeError), gpu.lease(1):
        raise RuntimeError("boom")
    assert provisioned.lease_of() is None


# -- the watcher --------------------------------------------------------------------------------
def test_watcher_counts_down_a_reclaim_and_says_when_it_is_off(shell, provisioned):
    agent, shown = load(shell)
    run(shell, "a = 1")
    lease = provisioned.lease_of()
    lease.update(
        state="reclaiming",
        reclaim_at=iso(55.4),
        reclaim_step="restart",
        reason="borrowed, idle and bob's claim L9 is waiting",
    )
    shown.items.clear()
    agent.watch_once()
    text, display_id, update = shown.items[-1]
    assert text.startswith(
        "GPU 0 will be taken back in 55 s because borrowed, idle and bob's claim L9 is waiting; "
        "run %gpu keep 30m to keep it."
    )
    assert "run <code>%gpu keep 30m</code> to keep it" in shown.html[-1]
    assert "the kernel restarts" in text and not update
    lease["reclaim_at"] = iso(52.4)
    agent.watch_once()
    assert shown.items[-1][0].startswith("GPU 0 will be taken back in 52 s")
    assert shown.items[-1][1] == display_id and shown.items[-1][2] is True
    lease.update(
        state="active", reclaim_at=None, reclaim_step=None, reason="reclaim cancelled: kept by the user"
    )
    agent.watch_once()
    assert shown.items[-1] == (
        "GPU 0: the reclaim is off (reclaim cancelled: kept by the user).",
        display_id,
        True,
    )


def test_watcher_notices_checkpoint_lost_gpu_and_free_cache(shell, provisioned):
    agent, shown = load(shell)
    freed = []
    agent.free_caches = lambda: freed.append(1) or ["torch"]
    run(shell, "a = 1")
    lease = provisioned.lease_of()
    lease.update(state="reclaiming", reclaim_at=iso(), reclaim_step="free-cache", reason="over its memory")
    agent.watch_once()
    agent.watch_once()
    assert freed == [1]  # once per reclaim, not once per poll
    assert "Freed cached GPU memory (torch) on GPU 0 because over its memory." in shown.texts
    lease.update(
        state="suspended",
        devices=[],
        device_indices=[],
        reclaim_at=None,
        reclaim_step=None,
        reason="suspended: GPU state checkpointed to host memory; the next cell restores it",
    )
    agent.watch_once()
    assert "GPU state checkpointed; the next cell restores it." in shown.texts[-1]
    run(shell, "b = 1")  # restores
    assert provisioned.lease_of()["state"] == "active"
    provisioned.lease_of().update(
        state="released",
        devices=[],
        reason=f"GPU 0 ({UUIDS[0]}) was lost; the kernel's GPU state on it is gone",
    )
    agent.watch_once()
    assert shown.texts[-1].startswith(f"GPU lost: GPU 0: GPU 0 ({UUIDS[0]}) was lost")


def test_the_agent_acknowledges_a_free_cache_step_with_what_it_freed(shell, provisioned):
    agent, shown = load(shell)
    agent.free_caches = lambda: ["torch"]
    run(shell, "a = 1")
    lease = provisioned.lease_of()
    lease.update(state="reclaiming", reclaim_at=iso(), reclaim_step="free-cache", reason="over its memory")
    agent.watch_once()
    agent.watch_once()
    assert provisioned.freed == [(lease["id"], {"frameworks": ["torch"]})]  # once per reclaim
    method, path, headers, _ = next(r for r in provisioned.requests if r[1].endswith("/freed"))
    assert (method, path) == ("POST", f"api/gpusched/leases/{lease['id']}/freed")
    assert headers["x-gpusched-token"] == KERNEL_TOKEN
    # The next reclaim's request is acknowledged too, also when nothing was freed.
    agent.free_caches = list
    lease["reclaim_at"] = iso(1)
    agent.watch_once()
    assert provisioned.freed[-1] == (lease["id"], {"frameworks": []})
    assert "Freed cached GPU memory (torch) on GPU 0 because over its memory." in shown.texts


def test_a_server_without_the_acknowledgement_endpoint_changes_nothing(shell, provisioned):
    provisioned.freed_endpoint = False  # answers 404, as a server from before the endpoint does
    agent, shown = load(shell)
    agent.free_caches = lambda: ["torch"]
    run(shell, "a = 1")
    provisioned.lease_of().update(
        state="reclaiming", reclaim_at=iso(), reclaim_step="free-cache", reason="over its memory"
    )
    agent.watch_once()
    assert provisioned.count("POST", f"api/gpusched/leases/{provisioned.lease_of()['id']}/freed") == 1
    assert "Freed cached GPU memory (torch) on GPU 0 because over its memory." in shown.texts
    assert not any("GPU scheduler" in t for t in shown.texts)
    assert run(shell, "b = 2").success


def test_watcher_thread_polls_without_executing_and_stops_on_unload(shell, provisioned, monkeypatch):
    monkeypatch.setenv("JUPYTER_GPUSCHED_POLL", "0.2")
    agent, _shown = load(shell)
    assert agent.watching
    count = shell.execution_count
    deadline = time.monotonic() + 5
    while provisioned.count("GET", "api/gpusched/leases") < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert provisioned.count("GET", "api/gpusched/leases") >= 3
    assert shell.execution_count == count
    shell.extension_manager.unload_extension("jupyter_gpusched")
    assert not agent.watching
    polls = provisioned.count("GET")
    time.sleep(0.6)
    assert provisioned.count("GET") == polls
    assert "gpu" not in shell.magics_manager.magics["line"]


# -- imports ------------------------------------------------------------------------------------
def test_the_kernel_side_imports_no_server_code():
    code = (
        "import sys\n"
        "import jupyter_gpusched.kernel.agent, jupyter_gpusched.kernel.magics\n"
        "from jupyter_gpusched import gpu, load_ipython_extension\n"
        "bad = [m for m in ('tornado', 'jupyter_server', 'pynvml', 'ipywidgets', 'jupyter_gpusched.server',"
        " 'jupyter_gpusched.core') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_panel_magic_shows_one_live_panel_that_stops_with_the_extension(shell, provisioned):
    agent, _shown = load(shell)
    run(shell, "a = 1")
    assert run(shell, "%gpu panel --interval 0.05").success
    panel = agent.panel_obj
    assert panel is not None and panel.polling
    assert "this kernel" in panel.rows[UUIDS[0]].holder.value
    assert run(shell, "%gpu panel").success and agent.panel_obj is panel  # shown again, not a second one
    deadline = time.monotonic() + 5
    # fetch_count counts reads begun: wait for the server to have answered them too.
    while (
        panel.fetch_count < 3 or provisioned.count("GET", "api/gpusched/status") < 3
    ) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert provisioned.count("GET", "api/gpusched/status") >= 3
    shell.extension_manager.unload_extension("jupyter_gpusched")
    assert panel.stopped and panel.wait_stopped()
    polls = provisioned.count("GET", "api/gpusched/status")
    time.sleep(0.2)
    assert provisioned.count("GET", "api/gpusched/status") == polls


def test_the_hook_reports_a_loss_it_sees_first_and_binds_the_new_gpu(shell, provisioned):
    agent, shown = load(shell)
    run(shell, "a = 1")
    provisioned.devices[0]["health"] = "lost"
    provisioned.lease_of().update(
        state="released",
        devices=[],
        reason=f"GPU 0 ({UUIDS[0]}) was lost; the kernel's GPU state on it is gone",
    )
    cached = agent.leases.view()  # the cached lease is old: the hook reads it again
    agent.leases.set({**cached.lease, "state": "idle"}, read_at=cached.read_at - 3600)
    assert run(shell, "b = 2").success
    texts = shown.texts
    lost = next(i for i, t in enumerate(texts) if t.startswith("GPU lost: GPU 0"))
    uses = next(i for i, t in enumerate(texts) if t.startswith("This kernel uses GPU 1"))
    assert lost < uses
    assert os.environ["CUDA_VISIBLE_DEVICES"] == UUIDS[1]


def test_cuda_probe_reads_the_process_maps(tmp_path):
    from jupyter_gpusched.kernel import cuda

    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f01 r-xp 00000000 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n"
        "7f02-7f03 r-xp 00000000 08:01 2 /usr/lib/x86_64-linux-gnu/libcuda.so.570.86.15\n"
    )
    assert cuda.libcuda_path(str(maps)) == "/usr/lib/x86_64-linux-gnu/libcuda.so.570.86.15"
    maps.write_text("7f00-7f01 r-xp 00000000 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n")
    assert cuda.libcuda_path(str(maps)) is None
    if "torch" not in sys.modules and cuda.libcuda_path() is None:
        assert cuda.probe() == CudaState(False, False, "the CUDA driver library is not loaded")
    assert cuda.free_framework_caches() == [] or "torch" in sys.modules or "cupy" in sys.modules
