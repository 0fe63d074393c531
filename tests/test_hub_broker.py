"""The broker and its servers in one process, with the hub's token check stubbed out.

``test_hub.py`` runs all of it for real (JupyterHub, proxy, servers, kernels). Here the broker
(``GPUBroker``, its HTTP API and websockets) runs in this process and talks to ``BrokerClient``
objects, as the single-user servers do, whose kernels are stand-ins backed by real processes;
the one thing not real is the hub's answer to "whose token is this?". That makes it quick to
test what the full run cannot reach cheaply: a reclaim carried out by an order to the kernel's
server, events shaped per user, a server that goes away, a broker restart.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import uuid

import pytest
from tornado.httpclient import AsyncHTTPClient, HTTPRequest
from tornado.websocket import WebSocketHandler
from traitlets.config import Config

from jupyter_gpusched.arbiter import Forbidden
from jupyter_gpusched.hub.broker import GPUBroker
from jupyter_gpusched.arbiter.remote import BrokerClient
from jupyter_gpusched.ledger import Ledger
from jupyter_gpusched.api.input import Claim
from jupyter_gpusched.api.views import Principal

from hub_util import free_port

SCOPE = "access:services!service=gpusched"
USERS = {
    "tok-alice": {"kind": "user", "name": "alice", "admin": False, "groups": [], "scopes": [SCOPE]},
    "tok-bob": {"kind": "user", "name": "bob", "admin": False, "groups": ["staff"], "scopes": [SCOPE]},
    "tok-root": {"kind": "user", "name": "root", "admin": True, "groups": [], "scopes": [SCOPE]},
    "tok-noscope": {"kind": "user", "name": "eve", "admin": False, "groups": [], "scopes": ["self"]},
}


class StubHubAuth:
    """The part of HubAuth the broker's API uses, answering from a table instead of the hub."""

    access_scopes = {SCOPE}

    def get_token(self, handler, in_cookie=True):
        header = handler.request.headers.get("Authorization", "")
        if header.lower().startswith("token "):
            return header[6:].strip()
        if isinstance(handler, WebSocketHandler):
            return handler.get_argument("token", None)
        return None

    async def user_for_token(self, token, use_cache=True, session_id="", *, sync=True):
        model = USERS.get(token)
        return dict(model) if model else None

    def check_scopes(self, required, model):
        return set(required) & set(model.get("scopes", []))


class FakeKernels:
    """A server's kernels: real sleeping processes that record the orders carried out on them."""

    def __init__(self, count: int = 1) -> None:
        self.server_id = uuid.uuid4().hex
        self.procs = {str(uuid.uuid4()): self._spawn() for _ in range(count)}
        self.busy: dict[str, bool] = {}
        self.orders: list[tuple[str, str]] = []

    @staticmethod
    def _spawn() -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])

    @property
    def ids(self) -> list[str]:
        return list(self.procs)

    def activity(self):
        now = time.time()
        return {kid: (self.busy.get(kid, False), now if self.busy.get(kid) else None, None) for kid in self.procs}

    def alive(self, kernel_id):
        return True if kernel_id in self.procs else None

    def restarting(self, kernel_id):
        return False

    def kernel_pid(self, kernel_id):
        proc = self.procs.get(kernel_id)
        return proc.pid if proc else None

    def process_tree(self, kernel_id):
        pid = self.kernel_pid(kernel_id)
        return {pid} if pid else set()

    def process_trees(self):
        return {kid: self.process_tree(kid) for kid in self.procs}

    def notebook(self, kernel_id):
        return f"{kernel_id[:4]}.ipynb"

    async def refresh_notebooks(self):
        return None

    def adopted(self, kernel_id):
        return None

    def user_of(self, kernel_id):
        return None

    async def restart(self, kernel_id):
        self.orders.append(("restart", kernel_id))
        old = self.procs[kernel_id]
        old.kill()
        old.wait(10)
        self.procs[kernel_id] = self._spawn()

    async def shutdown(self, kernel_id):
        self.orders.append(("shutdown", kernel_id))
        self.kill(kernel_id)

    def kill(self, kernel_id):
        proc = self.procs.pop(kernel_id)
        proc.kill()
        proc.wait(10)

    def close(self):
        for proc in self.procs.values():
            proc.kill()
            proc.wait(10)


async def until(predicate, timeout: float = 20.0, what: str = "a condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


class Setup:
    def __init__(self, tmp_path, **traits) -> None:
        self.tmp_path = tmp_path
        self.port = free_port()
        self.traits = {
            "backend": "simulated",
            "simulated_devices": 1,
            "ledger_path": str(tmp_path / "ledger.sqlite"),
            "simulated_state_path": str(tmp_path / "sim.sqlite"),
            "poll_interval": 0.1,
            "heartbeat_interval": 0.2,
            "heartbeat_timeout": 2.0,
            "idle_timeout": 0.5,
            "contended_idle_timeout": 0.2,
            "grace_period": 0.3,
            "checkpoint": "off",
            "quotas": {"*": 0},
            "url": f"http://127.0.0.1:{self.port}",
            "prefix": "/services/gpusched/",
            # Every "server" here is this test process, which no hub spawned with its token: the
            # broker takes the process it names (and checks kernels descend from it).
            "verify_server_processes": False,
            **traits,
        }
        self.url = f"http://127.0.0.1:{self.port}/services/gpusched/"
        self.app: GPUBroker | None = None
        self.clients: list[BrokerClient] = []
        self.kernels: list[FakeKernels] = []

    async def start_broker(self) -> GPUBroker:
        app = GPUBroker(config=Config({"GPUBroker": dict(self.traits)}))
        app.initialize([])
        await app.setup()
        app.hub_auth = StubHubAuth()
        self.app = app
        return app

    async def stop_broker(self) -> None:
        if self.app is not None:
            await self.app.teardown()
            self.app = None

    async def server(self, user: str, kernels: int = 1, listen: list | None = None) -> tuple[BrokerClient, FakeKernels]:
        fake = FakeKernels(kernels)
        client = BrokerClient(self.url, kernels=fake, user=user, token=f"tok-{user}")
        if listen is not None:
            client.subscribe(lambda event: listen.append(event.payload))
        await client.start()
        self.clients.append(client)
        self.kernels.append(fake)
        return client, fake

    async def close(self) -> None:
        for client in self.clients:
            await client.stop()
        await self.stop_broker()
        for fake in self.kernels:
            fake.close()


def run(coro):
    return asyncio.run(coro)


@pytest.fixture
def setup(tmp_path):
    return Setup(tmp_path)


def lease_by_kernel(app: GPUBroker, kernel_id: str):
    return next((le for le in app.arbiter.state.leases if le.kernel_id == kernel_id and le.live), None)


def test_a_reclaim_is_an_order_carried_out_by_the_kernels_server(setup):
    async def scenario():
        app = await setup.start_broker()
        try:
            alice_events: list = []
            bob_events: list = []
            alice, alice_kernels = await setup.server("alice", listen=alice_events)
            bob, bob_kernels = await setup.server("bob", listen=bob_events)
            ka, kb = alice_kernels.ids[0], bob_kernels.ids[0]
            # alice's kernel holds memory on the GPU: no gentle step, the fallback restarts it.
            app.arbiter.backend.add_process(app.arbiter.state.snapshot[0].uuid, alice_kernels.kernel_pid(ka), "1GiB")
            granted = await alice.claim(Principal("alice"), Claim(ka))
            assert granted.status == 201
            waiting = await bob.claim(Principal("bob"), Claim(kb))
            assert waiting.status == 202 and waiting.lease["position"] == 1
            await until(lambda: ("restart", ka) in alice_kernels.orders, 20, "the broker's restart order")
            assert bob_kernels.orders == []
            await until(lambda: (le := lease_by_kernel(app, kb)) is not None and le.holding, 20, "bob's grant")
            assert lease_by_kernel(app, ka) is None
            # Each server heard what concerns its user: alice the warning and the restart, with her
            # kernel named; bob his grant, and alice's lease only as another user's.
            await until(lambda: any(e.get("kind") == "reclaimed" for e in alice_events), 5, "alice's notice")
            kinds = [e.get("kind") for e in alice_events if e["type"] == "notice"]
            assert "reclaim_warning" in kinds and "reclaimed" in kinds
            assert all(e.get("kernel_id") != ka for e in bob_events if e["type"] == "notice")
            theirs = [e["lease"] for e in bob_events if e["type"] == "lease" and e["lease"]["id"] == granted.lease["id"]]
            assert theirs and all(le["user"] == "another user" and le["kernel_id"] is None for le in theirs)
            assert any(e["type"] == "lease" and e["lease"]["kernel_id"] == kb for e in bob_events)
            with Ledger(setup.traits["ledger_path"]) as ledger:
                assert ledger.check() == []
        finally:
            await setup.close()

    run(scenario())


def test_events_go_only_to_servers_that_listen(setup):
    async def scenario():
        app = await setup.start_broker()
        try:
            heard: list = []
            alice, fake = await setup.server("alice", listen=heard)
            quiet, quiet_fake = await setup.server("bob")
            await alice.claim(Principal("alice"), Claim(fake.ids[0]))
            await until(lambda: heard, 5, "events for a listening server")
            sockets = {s.who.user: s for s in app.broker.sockets}
            assert sockets["alice"].listening and not sockets["bob"].listening
        finally:
            await setup.close()

    run(scenario())


def test_a_server_that_goes_away_releases_once_its_kernels_are_gone(setup):
    async def scenario():
        app = await setup.start_broker()
        try:
            alice, fake = await setup.server("alice", kernels=2)
            k1, k2 = fake.ids
            await alice.claim(Principal("alice"), Claim(k1))
            await until(lambda: app.kernels.kernel_pid(k1) is not None, 5, "the heartbeat with the pid")
            await alice.stop()
            await until(lambda: not app.kernels.servers()[0]["connected"], 5, "the server to be gone")
            await asyncio.sleep(0.5)
            assert lease_by_kernel(app, k1) is not None, app.arbiter.ledger.leases(live_only=False)
            fake.kill(k1)
            await until(lambda: lease_by_kernel(app, k1) is None, 10, "the lease to be released")
            released = app.arbiter.ledger.leases(live_only=False)[-1]
            assert "shut down" in released.reason or "is gone" in released.reason
        finally:
            await setup.close()

    run(scenario())


def test_the_broker_restarts_with_its_ledger_and_servers_reconnect(setup):
    async def scenario():
        app = await setup.start_broker()
        try:
            alice, fake = await setup.server("alice")
            result = await alice.claim(Principal("alice"), Claim(fake.ids[0]))
            lease_id = result.lease["id"]
            await until(lambda: app.kernels.kernel_pid(fake.ids[0]) is not None, 5, "the pid")
            await asyncio.sleep(0.3)  # one more pass: the kernel's process now owns the lease
            await setup.stop_broker()
            app = await setup.start_broker()
            assert lease_by_kernel(app, fake.ids[0]).id == lease_id, "the ledger kept the lease"
            await until(lambda: alice.connected and app.kernels.known(fake.ids[0]), 20, "alice's server back")
            again = await alice.claim(Principal("alice"), Claim(fake.ids[0]))
            assert again.status == 200 and again.lease["id"] == lease_id
        finally:
            await setup.close()

    run(scenario())


def test_the_api_refuses_whoever_the_hub_does_not_vouch_for(setup):
    async def scenario():
        await setup.start_broker()
        http = AsyncHTTPClient(force_instance=True)
        try:
            async def call(token, method="GET", path="status", body=None):
                headers = {"Authorization": f"token {token}"} if token else {}
                r = await http.fetch(
                    HTTPRequest(setup.url + "api/gpusched/" + path, method=method, headers=headers, body=body),
                    raise_error=False,
                )
                return r.code, json.loads(r.body) if r.body else None

            assert (await call(None))[0] == 403
            code, body = await call("tok-noscope")
            assert code == 403 and "lacks the scope" in body["message"]
            code, body = await call("tok-alice")
            assert code == 200 and body["user"] == "alice" and body["is_admin"] is False and "servers" not in body
            code, body = await call("tok-root")
            assert code == 200 and body["is_admin"] is True and body["servers"] == []
            client, fake = await setup.server("alice")
            with pytest.raises(Forbidden):
                await client.claim(Principal("alice", kernel_id="other"), Claim(fake.ids[0]))
        finally:
            http.close()
            await setup.close()

    run(scenario())


def test_after_a_restart_another_users_server_cannot_take_a_kernel_id(setup):
    """Alice's server reports bob's kernel id first after a broker restart, then drops it: bob's
    lease stays, bob's server is believed about it, and bob can still claim for it."""

    async def scenario():
        app = await setup.start_broker()
        try:
            alice, alice_kernels = await setup.server("alice")
            bob, bob_kernels = await setup.server("bob")
            ka, kb = alice_kernels.ids[0], bob_kernels.ids[0]
            granted = await bob.claim(Principal("bob"), Claim(kb))
            assert granted.status == 201
            await until(lambda: app.kernels.kernel_pid(kb) is not None, 5, "bob's kernel's pid")
            await asyncio.sleep(0.3)  # one more pass: the kernel's process owns the lease
            await setup.stop_broker()
            await bob.stop()
            # Alice saw bob's kernel id (show_holders); her server now reports it as its own.
            alice_kernels.procs[kb] = alice_kernels._spawn()
            app = await setup.start_broker()
            await until(lambda: alice.connected and app.kernels.known(ka), 20, "alice's server back")
            await asyncio.sleep(0.5)  # a few more of alice's heartbeats
            assert app.kernels.user_of(kb) == "bob"
            mine = [s for s in app.kernels.servers() if s["user"] == "alice"]
            assert mine and mine[0]["kernels"] == [ka], "alice's report of bob's kernel was refused"
            alice_kernels.kill(kb)  # and dropped from her heartbeats
            await asyncio.sleep(0.6)
            assert lease_by_kernel(app, kb) is not None, "bob's lease outlives alice's heartbeats"
            # Bob's server comes back: believed about its kernel, and bob can claim.
            bob = BrokerClient(setup.url, kernels=bob_kernels, user="bob", token="tok-bob")
            setup.clients.append(bob)
            await bob.start()
            await until(lambda: app.kernels.kernel_pid(kb) == bob_kernels.kernel_pid(kb), 20, "bob's heartbeat")
            theirs = [s for s in app.kernels.servers() if s["user"] == "bob"]
            assert theirs[0]["kernels"] == [kb] and theirs[0]["server_id"] == bob_kernels.server_id
            await asyncio.sleep(0.5)
            lease = lease_by_kernel(app, kb)
            assert lease is not None and lease.id == granted.lease["id"] and lease.holding
            again = await bob.claim(Principal("bob"), Claim(kb))
            assert again.status == 200 and again.lease["id"] == granted.lease["id"]
            with pytest.raises(Exception) as refused:
                await alice.claim(Principal("alice"), Claim(kb))
            assert "no running kernel" in str(refused.value)
        finally:
            await setup.close()

    run(scenario())
