"""The broker's admin page: no framing by other sites, and a confirmation before every change.

The page handlers run in a real tornado application with XSRF cookies, in front of a recording
broker; the hub login is a stub that knows a few users (the real hub is in test_hub.py).
"""

from __future__ import annotations

import asyncio
import re
from http.cookies import SimpleCookie
from types import SimpleNamespace
from urllib.parse import urlencode

import pytest
from jupyterhub.services.auth import HubOAuth
from tornado import web
from tornado.httpclient import AsyncHTTPClient, HTTPRequest
from tornado.httpserver import HTTPServer

from conftest import free_port
from jupyter_gpusched.hub import page

PREFIX = "/services/gpusched/"
SCOPE = "access:services!service=gpusched"
USERS = {
    "tok-root": {"kind": "user", "name": "root", "admin": True, "groups": [], "scopes": [SCOPE]},
    "tok-alice": {"kind": "user", "name": "alice", "admin": False, "groups": [], "scopes": [SCOPE]},
}
UUID0, UUID1 = "GPU-aaaa", "GPU-bbbb"


class StubHubOAuth(HubOAuth):
    """The broker's hub login, except that users come from a table instead of the hub.

    The XSRF rules are the hub's own: a user here is signed in as through the login cookie, so a
    form must carry the page's token.
    """

    async def get_user(self, handler, sync=True):
        header = handler.request.headers.get("Authorization", "")
        model = USERS.get(header[6:].strip()) if header.startswith("token ") else None
        return dict(model) if model else None

    def check_scopes(self, required, model):
        return set(required) & set(model.get("scopes", []))


class RecordingBroker:
    """Answers status as the broker would and records every change asked of it."""

    def __init__(self) -> None:
        self.changes: list[tuple] = []
        self.drained: set[str] = set()
        self.extra: dict = {}

    async def status(self, who):
        devices = [
            {
                "uuid": uuid, "index": i, "name": "Simulated H100 80GB", "memory_total": 80 * 2**30,
                "memory_used": 0, "utilization": 0.0, "health": "drained" if uuid in self.drained else "ok",
                "lease_ids": ["lease-alice-1"] if i == 0 else [], "processes": [],
            }
            for i, uuid in enumerate((UUID0, UUID1))
        ]
        lease = {
            "id": "lease-alice-1", "user": "alice", "kernel_id": "k1" if who.user == "alice" else None,
            "notebook": "train.ipynb", "state": "active", "device_indices": [0], "count": 1,
            "idle_seconds": None, "reason": "granted", "mine": who.user == "alice",
        }
        return {
            "policy": "hybrid", "backend": "simulated", "time": "2025-01-01T00:00:00Z", "devices": devices,
            "leases": [lease], "queue": [], "unleased_processes": [], "stranded_processes": [], "servers": [],
            **self.extra,
        }

    async def drain(self, who, uuid, drained, reason=""):
        self.changes.append(("drain" if drained else "undrain", who.user, uuid))
        (self.drained.add if drained else self.drained.discard)(uuid)
        return {}

    async def release(self, who, lease_id):
        self.changes.append(("release", who.user, lease_id))


class Site:
    """The page's routes (as the broker registers them) served on a local port."""

    def __init__(self) -> None:
        self.broker = RecordingBroker()
        hub_auth = StubHubOAuth(api_token="not-used", base_url=PREFIX, access_scopes={SCOPE}, login_url="")
        app = SimpleNamespace(broker=self.broker, hub_auth=hub_auth, prefix=PREFIX, show_holders=True)
        self.app = app
        kw = {"app": app}
        self.web_app = web.Application(
            [
                (PREFIX.rstrip("/") + "/?", page.PageHandler, kw),
                (PREFIX + r"admin/devices/(?P<uuid>[A-Za-z0-9_\-]+)/(?P<action>drain|undrain)", page.DrainFormHandler, kw),
                (PREFIX + r"admin/leases/(?P<lease_id>[A-Za-z0-9_\-]+)/release", page.ReleaseFormHandler, kw),
            ],
            cookie_secret="x" * 32,
            xsrf_cookies=True,
        )
        self.port = free_port()
        self.cookies: dict[str, str] = {}

    async def __aenter__(self) -> Site:
        self.server = HTTPServer(self.web_app)
        self.server.listen(self.port, "127.0.0.1")
        self.http = AsyncHTTPClient(force_instance=True)
        return self

    async def __aexit__(self, *exc) -> None:
        self.http.close()
        self.server.stop()

    async def fetch(self, path: str, token: str = "tok-root", method: str = "GET", form: dict | None = None):
        headers = {"Authorization": f"token {token}"}
        if self.cookies:
            headers["Cookie"] = "; ".join(f"{k}={v}" for k, v in self.cookies.items())
        body = None
        if method == "POST":
            headers["Content-Type"] = "application/x-www-form-urlencoded"
            body = urlencode(form or {})
        r = await self.http.fetch(
            HTTPRequest(f"http://127.0.0.1:{self.port}{PREFIX}{path}", method=method, headers=headers, body=body,
                        follow_redirects=False),
            raise_error=False,
        )
        for value in r.headers.get_list("Set-Cookie"):
            for name, morsel in SimpleCookie(value).items():
                self.cookies[name] = morsel.value
        return r


def xsrf_of(text: str) -> str:
    return re.search(r'name="_xsrf" value="([^"]+)"', text).group(1)


def run(coro):
    return asyncio.run(coro)


def assert_not_frameable(r):
    assert "frame-ancestors 'none'" in r.headers.get("Content-Security-Policy", "")
    assert r.headers.get("X-Frame-Options") == "DENY"


def test_no_page_may_be_framed_by_another_site():
    async def scenario():
        async with Site() as site:
            for path, token in (("", "tok-root"), ("", "tok-alice"), (f"admin/devices/{UUID0}/drain", "tok-root")):
                r = await site.fetch(path, token)
                assert r.code == 200, r.body
                assert_not_frameable(r)
            # Error pages too: a refused drain, an unknown GPU.
            r = await site.fetch(f"admin/devices/{UUID0}/drain", "tok-alice")
            assert r.code == 403
            assert_not_frameable(r)
            r = await site.fetch("admin/devices/GPU-nope/drain")
            assert r.code == 404
            assert_not_frameable(r)

    run(scenario())


@pytest.mark.parametrize(
    "path, change, question",
    [
        (f"admin/devices/{UUID1}/drain", ("drain", "root", UUID1), "Drain GPU 1?"),
        ("admin/leases/lease-alice-1/release", ("release", "root", "lease-alice-1"), "Release this lease?"),
    ],
)
def test_a_change_happens_only_after_its_confirmation(path, change, question):
    async def scenario():
        async with Site() as site:
            main = (await site.fetch("")).body.decode()
            # The button on the page only opens the confirmation; it carries no token to post.
            assert f'<form method="get" action="{PREFIX}{path}">' in main
            assert "onclick" not in main and "<script" not in main

            asked = await site.fetch(path)
            text = asked.body.decode()
            assert asked.code == 200 and question in text and "Cancel" in text
            assert 'name="confirm" value="yes"' in text
            assert site.broker.changes == []

            # A post without the confirmation (an old page, a stray click) only asks again.
            r = await site.fetch(path, method="POST", form={"_xsrf": xsrf_of(text)})
            assert r.code == 200 and question in r.body.decode()
            assert site.broker.changes == []
            # Without the XSRF token nothing happens either.
            r = await site.fetch(path, method="POST", form={"confirm": "yes"})
            assert r.code == 403 and site.broker.changes == []

            r = await site.fetch(path, method="POST", form={"_xsrf": xsrf_of(text), "confirm": "yes"})
            assert r.code == 302 and r.headers["Location"] == PREFIX
            assert site.broker.changes == [change]

    run(scenario())


def test_a_gpu_process_without_a_lease_names_its_user_server_and_pod():
    async def scenario():
        async with Site() as site:
            site.broker.extra = {
                "unleased_processes": [
                    {"pid": 4242, "device": UUID1, "memory_used": 2 << 30, "kernel_id": None, "unix_user": "jovyan",
                     "server_id": "srv-bob-0123456789", "user": "bob", "pod": "jupyter-bob"},
                ],
                "servers": [
                    {"user": "bob", "server_id": "srv-bob-0123456789", "pid": 7, "pod": "jupyter-bob",
                     "connected": True, "silent_seconds": 0.5, "kernels": []},
                ],
            }
            r = await site.fetch("")
            assert r.code == 200
            text = r.body.decode()
            unleased = text.split("GPU processes without a lease", 1)[1].split("</table>", 1)[0]
            assert "<td>4242</td><td>jovyan</td><td>GPU 1</td><td>2.0 GiB</td><td>bob</td>" in unleased
            assert "<code>srv-bob-0123</code></td><td>jupyter-bob</td>" in unleased
            servers = text.split("Single-user servers", 1)[1].split("</table>", 1)[0]
            assert "<td>bob</td><td><code>srv-bob-0123</code></td><td>jupyter-bob</td><td>7</td>" in servers

    run(scenario())


def test_undrain_asks_too():
    async def scenario():
        async with Site() as site:
            site.broker.drained.add(UUID1)
            main = (await site.fetch("")).body.decode()
            assert f'action="{PREFIX}admin/devices/{UUID1}/undrain"' in main
            text = (await site.fetch(f"admin/devices/{UUID1}/undrain")).body.decode()
            assert "Undrain GPU 1?" in text
            r = await site.fetch(f"admin/devices/{UUID1}/undrain", method="POST", form={"_xsrf": xsrf_of(text)})
            assert r.code == 200 and site.broker.changes == []
            r = await site.fetch(
                f"admin/devices/{UUID1}/undrain", method="POST", form={"_xsrf": xsrf_of(text), "confirm": "yes"}
            )
            assert r.code == 302 and site.broker.changes == [("undrain", "root", UUID1)]

    run(scenario())


def test_a_user_confirms_only_the_release_of_their_own_lease():
    async def scenario():
        async with Site() as site:
            text = (await site.fetch("admin/leases/lease-alice-1/release", "tok-alice")).body.decode()
            assert "Release this lease?" in text and "train.ipynb" in text
            assert (await site.fetch(f"admin/devices/{UUID1}/drain", "tok-alice")).code == 403
            assert (await site.fetch("admin/leases/someone-else/release", "tok-alice")).code == 404
            assert site.broker.changes == []

    run(scenario())


@pytest.mark.parametrize("dra", [False, True], ids=["device-plugin", "dra"])
def test_the_admin_page_lists_every_node(tmp_path, monkeypatch, dra):
    """Two real node brokers (test_hub_broker's), sharing the gpusched service's token, and a
    third that was listed but does not run: node-a's page shows all three. In DRA mode, with a
    stand-in Kubernetes API (tests/kube_api.py) holding the nodes' claims, it also says what
    each node's GPU claim is."""
    from jupyter_gpusched import nodeclaims
    from jupyter_gpusched.api.input import Claim
    from jupyter_gpusched.api.views import Principal
    from test_hub_broker import Setup

    kube = None
    if dra:
        from kube_api import KubeAPI

        kube = KubeAPI()
        kube.start()
        monkeypatch.setenv("KUBECONFIG", str(kube.kubeconfig(tmp_path / "kubeconfig", namespace="jhub")))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        monkeypatch.setenv(nodeclaims.ENV_NAMESPACE, "jhub")
        monkeypatch.setenv(nodeclaims.ENV_DEVICE_CLASS, nodeclaims.DEFAULT_DEVICE_CLASS)
        for node, on in (("node-a", "node-a"), ("node-b", "node-9")):
            claim = nodeclaims.node_claim(node)
            claim["status"] = {"allocation": {
                "devices": {"results": [{"request": "gpus", "driver": "d", "pool": on, "device": "g0"}]},
                "nodeSelector": {"nodeSelectorTerms": [
                    {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [on]}]}
                ]},
            }, "reservedFor": [{"resource": "pods", "name": "jupyter-bob", "uid": "1"}]}
            kube.put(claim, "jhub")

    service_token = "gpusched-service-token"
    setups = {}
    for name in ("node-a", "node-b"):
        (tmp_path / name).mkdir()
        setups[name] = Setup(tmp_path / name, node_name=name, idle_timeout=300.0, quotas={"*": 1})
    silent = f"node-c=http://127.0.0.1:{free_port()}{PREFIX}"
    setups["node-a"].traits["node_brokers"] = ",".join([f"{n}={s.url}" for n, s in setups.items()] + [silent])

    async def scenario():
        a = await setups["node-a"].start_broker()
        b = await setups["node-b"].start_broker()
        http = AsyncHTTPClient(force_instance=True)
        try:
            # node-a's page signs users in from the table; node-b knows the service's token.
            a.hub_auth = StubHubOAuth(api_token=service_token, base_url=PREFIX, access_scopes={SCOPE}, login_url="")
            b.hub_auth.api_token = service_token
            client, kernels = await setups["node-b"].server("bob")
            assert (await client.claim(Principal("bob"), Claim(kernels.ids[0]))).status == 201

            async def page(token):
                r = await http.fetch(
                    HTTPRequest(setups["node-a"].url, headers={"Authorization": f"token {token}"}), raise_error=False
                )
                assert r.code == 200, r.body
                return r.body.decode()

            text = await page("tok-root")
            assert "Node <b>node-a</b>." in text
            nodes = text[text.index("<h2>Nodes</h2>"):]
            cells = r"</code></td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>"
            # node, then GPUs, free, reclaimable, leases, waiting
            assert re.search(r"node-a <span class='muted'>\(this node\)</span></td><td>1</td><td>1</td><td>0</td><td>0</td><td>0</td>", nodes)
            assert re.search(r"node-b<br><code class='muted'>" + re.escape(setups["node-b"].url) + cells.format(1, 0, 0, 1, 0), nodes)
            assert re.search(r"node-c<br><code class='muted'>[^<]+</code></td><td colspan='5' class='warn'>not answering", nodes)
            detail_b = nodes[nodes.index("<h3>node-b</h3>"):]
            assert "<td>held</td><td>bob</td>" in detail_b and "nobody waits" in detail_b
            assert "<h3>node-a</h3>" in nodes and "<h3>node-c</h3>" not in nodes

            if dra:
                claims = nodes[nodes.index("<h3>GPU claims</h3>"):]
                assert ("<tr><td>node-a</td><td class=''>claim gpusched-gpus-node-a: 1 GPU(s) of node node-a, "
                        "shared by 1 pod(s)</td></tr>") in claims
                assert re.search(r"<tr><td>node-b</td><td class='warn'>[^<]*allocated on node node-9, not on node node-b", claims)
                assert re.search(r"<tr><td>node-c</td><td class=''>no GPU claim yet", claims)
                assert {m for m, _ in kube.requests} == {"GET"}, "the page only reads claims"
            else:
                assert "GPU claims" not in nodes

            # The cluster view is for hub admins.
            assert "<h2>Nodes</h2>" not in await page("tok-alice")
        finally:
            http.close()
            for setup in setups.values():
                await setup.close()
            if kube is not None:
                kube.stop()

    run(scenario())


def test_the_page_shows_each_users_recent_usage_and_why_a_claim_waits_where_it_does():
    async def scenario():
        async with Site() as site:
            site.broker.extra = {
                "config": {"usage_half_life": 86400.0},
                "usage": [
                    {"user": "alice", "gpu_hours": 41.23, "quota": 2.0, "held": 1.0},
                    {"user": "bob", "gpu_hours": 0.0, "quota": 1.0, "held": 0.0},
                ],
                "group_usage": [{"group": "ml", "gpu_hours": 41.23, "held": 1.0}],
                "queue": [
                    {"position": 1, "user": "bob", "count": 1, "waiting_since": "2025-01-01T00:00:00Z",
                     "lease_id": "lease-bob-1", "reason": "waiting for a GPU; 1st in line: within quota"},
                ],
            }
            text = (await site.fetch("")).body.decode()
            usage = text.split("<h2>Recent usage</h2>", 1)[1].split("</table>", 1)[0]
            assert "halving every 1 day" in usage
            assert "<tr><td>alice</td><td>41.2</td><td>2</td><td>1</td></tr>" in usage
            assert "<tr><td>bob</td><td>0.0</td><td>1</td><td>0</td></tr>" in usage
            assert "<tr><td>ml</td><td>41.2</td><td>1</td></tr>" in text
            queue = text.split("<h2>Queue</h2>", 1)[1].split("</table>", 1)[0]
            assert "<td>waiting for a GPU; 1st in line: within quota</td>" in queue
            # A broker that does not track usage shows no such section.
            site.broker.extra["config"] = {"usage_half_life": 0}
            assert "Recent usage" not in (await site.fetch("")).body.decode()

    run(scenario())


def test_a_node_that_is_broken_or_not_asked_is_named_so_and_the_page_still_answers(monkeypatch):
    """Whatever the cluster view hands the page (a summary nobody checked, none with a reason,
    none at all), the admin page answers 200 and says what is wrong with each node."""
    from jupyter_gpusched import kubernetes

    device = {"index": 0, "uuid": "GPU-a-0", "name": "Simulated H100 80GB", "memory_total": 80 * 2**30,
              "health": "ok", "state": "free", "users": []}
    good = {
        "node": "node-a", "time": "2025-01-01T00:00:00Z", "policy": "hybrid", "backend": "simulated", "gpus": 1,
        "free": 1, "reclaimable": 0, "pending": 0, "leases": 0, "devices": [device], "queue": [],
    }
    silent = "http://127.0.0.1:9/services/gpusched/"
    monkeypatch.setitem(
        kubernetes._reports, silent, kubernetes.NodeReport(None, kubernetes.BROKEN, "its answer is not JSON")
    )
    nodes = [
        {"name": "node-a", "url": None, "this": True, "summary": good},
        {"name": "node-b", "url": "http://10.0.0.2:8765/services/gpusched/", "this": False,
         "summary": {**good, "node": "node-b", "devices": [1]}},
        {"name": "node-c", "url": "http://10.0.0.3:8765/services/gpusched/", "this": False, "summary": None,
         "state": "not asked", "problem": "plain http to 10.0.0.3, which is not this host's loopback address"},
        {"name": "node-d", "url": silent, "this": False, "summary": None},
        {"name": "node-e", "url": "http://127.0.0.1:10/services/gpusched/", "this": False, "summary": None},
        {"name": "node-f", "url": "http://127.0.0.1:11/services/gpusched/", "this": False, "summary": None,
         "state": "not answering", "problem": "HTTP 500: <script>alert(1)</script>"},
    ]

    async def cluster():
        return {"nodes": nodes, "error": None}

    async def scenario():
        async with Site() as site:
            site.app.cluster = cluster
            r = await site.fetch("")
            assert r.code == 200, r.body
            text = r.body.decode()
            rows = {m.group(1): m.group(2) for m in re.finditer(r"<tr><td>(node-\w)(?: <span[^<]*</span>)?(?:<br><code[^<]*</code>)?</td>(.*?)</tr>", text)}
            assert rows["node-a"].startswith("<td>1</td><td>1</td>")
            assert rows["node-b"] == "<td colspan='5' class='warn'>broken: not a node summary: devices/0: 1 is not of type &#x27;object&#x27;</td>"
            assert rows["node-c"] == (
                "<td colspan='5' class='warn'>not asked: plain http to 10.0.0.3, which is not this host&#x27;s loopback address</td>"
            )
            assert rows["node-d"] == "<td colspan='5' class='warn'>broken: its answer is not JSON</td>"
            assert rows["node-e"] == "<td colspan='5' class='warn'>not answering</td>"
            assert rows["node-f"] == (
                "<td colspan='5' class='warn'>not answering: HTTP 500: &lt;script&gt;alert(1)&lt;/script&gt;</td>"
            )
            assert "<h3>node-a</h3>" in text and "<h3>node-b</h3>" not in text and "<script>" not in text
            # A user who is no admin sees no nodes at all.
            assert "<h2>Nodes</h2>" not in (await site.fetch("", token="tok-alice")).body.decode()

    run(scenario())


def test_in_dra_mode_the_nodes_section_says_what_each_nodes_gpu_claim_is():
    device = {"index": 0, "uuid": "GPU-a-0", "name": "Simulated H100 80GB", "memory_total": 80 * 2**30,
              "health": "ok", "state": "free", "users": []}
    good = {
        "node": "node-a", "time": "2025-01-01T00:00:00Z", "policy": "hybrid", "backend": "simulated", "gpus": 1,
        "free": 1, "reclaimable": 0, "pending": 0, "leases": 0, "devices": [device], "queue": [],
    }
    nodes = [
        {"name": "node-a", "url": None, "this": True, "summary": good,
         "claim": {"text": "claim gpusched-gpus-node-a: 1 GPU(s) of node node-a, shared by 2 pod(s)", "problem": False}},
        {"name": "node-b", "url": "http://10.0.0.2:8765/services/gpusched/", "this": False,
         "summary": {**good, "node": "node-b"},
         "claim": {"text": "claim gpusched-gpus-node-b is allocated on node node-9, not on node node-b <b>", "problem": True}},
    ]

    async def cluster():
        return {"nodes": nodes, "error": None, "claims_error": None}

    async def broken_claims():
        return {"nodes": nodes, "error": None, "claims_error": "the GPU claims cannot be listed: Forbidden (HTTP 403)"}

    async def scenario():
        async with Site() as site:
            site.app.cluster = cluster
            text = (await site.fetch("")).body.decode()
            assert "<tr><td>node-a</td><td class=''>claim gpusched-gpus-node-a: 1 GPU(s) of node node-a, shared by 2 pod(s)</td></tr>" in text
            assert ("<tr><td>node-b</td><td class='warn'>claim gpusched-gpus-node-b is allocated on node node-9, "
                    "not on node node-b &lt;b&gt;</td></tr>") in text
            site.app.cluster = broken_claims
            text = (await site.fetch("")).body.decode()
            assert "The nodes' GPU claims could not be read: the GPU claims cannot be listed: Forbidden (HTTP 403)" in text

    run(scenario())
