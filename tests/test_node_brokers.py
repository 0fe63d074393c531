"""Whom the hub and the node brokers trust: the service token and users' servers go only to
listed brokers that are verified, and a node summary is believed only when it is one.

The brokers here are tiny tornado servers on this machine that answer ``GET
{prefix}api/gpusched/node`` as they are told (a good summary, a malformed one, 8 GPUs that do not
exist) and record every connection and every token they get; the https ones have certificates
made by the test (``cryptography``), by the CA the hub trusts or by another. One real node
broker (``test_hub_broker.Setup``) serves the admin page that lists a broken node.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import ipaddress
import json
import re
import socket
import ssl
from types import SimpleNamespace

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from jupyterhub.objects import Hub
from jupyterhub.spawner import LocalProcessSpawner
from jupyterhub.utils import maybe_future
from tornado import web
from tornado.httpclient import AsyncHTTPClient, HTTPRequest
from tornado.httpserver import HTTPServer
from tornado.netutil import bind_sockets
from traitlets.config import Config

from jupyter_gpusched import kubernetes
from jupyter_gpusched.kubernetes import BrokerTrust, NodeBroker, choose_node, node_reports

from test_hub_page import PREFIX, SCOPE, StubHubOAuth

TOKEN = "gpusched-service-token"
TRUST_ENV = (
    kubernetes.ENV_CA, kubernetes.ENV_CLIENT_CERT, kubernetes.ENV_CLIENT_KEY, kubernetes.ENV_ALLOW_HTTP,
    kubernetes.ENV_HUB_CA, kubernetes.ENV_HUB_CERT, kubernetes.ENV_HUB_KEY, kubernetes.ENV_SERVER_CA,
)


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    for name in TRUST_ENV + (kubernetes.ENV_NODE_BROKERS, kubernetes.ENV_TOKEN, "KUBERNETES_SERVICE_HOST"):
        monkeypatch.delenv(name, raising=False)


def summary(node: str, gpus: int = 1, free: int = 1, **extra) -> dict:
    """A node summary as a broker answers it (every field of the OpenAPI document)."""
    devices = [
        {"index": i, "uuid": f"GPU-{node}-{i}", "name": "Simulated H100 80GB", "memory_total": 80 * 2**30,
         "health": "ok", "state": "free" if i < free else "held", "users": [] if i < free else ["bob"]}
        for i in range(gpus)
    ]
    return {
        "node": node, "time": "2025-01-01T00:00:00Z", "policy": "hybrid", "backend": "simulated",
        "gpus": gpus, "free": free, "reclaimable": 0, "pending": 0, "pending_gpus": 0,
        "leases": gpus - free, "servers": 0, "servers_without_lease": 0, "devices": devices, "queue": [],
        **extra,
    }


# -- tiny node brokers -------------------------------------------------------------------------
class NodeAPI(web.RequestHandler):
    def initialize(self, broker: FakeBroker) -> None:
        self.broker = broker

    def get(self) -> None:
        self.broker.tokens.append(self.request.headers.get("Authorization"))
        body = self.broker.body
        self.set_header("Content-Type", "application/json")
        self.finish(body if isinstance(body, bytes) else json.dumps(body))


class FakeBroker:
    """A "node broker" that answers its summary with ``body`` and records every token and connection."""

    def __init__(self, name: str, body, address: str = "127.0.0.1", ssl_context: ssl.SSLContext | None = None) -> None:
        self.name, self.body = name, body
        self.tokens: list[str | None] = []
        self.connections = 0
        app = web.Application([(PREFIX + kubernetes.NODE_PATH, NodeAPI, {"broker": self})])
        broker = self

        class Counting(HTTPServer):
            def handle_stream(self, stream, address):
                broker.connections += 1
                return super().handle_stream(stream, address)

        self.server = Counting(app, ssl_options=ssl_context)
        sockets = bind_sockets(0, address, family=socket.AF_INET)
        self.server.add_sockets(sockets)
        port = sockets[0].getsockname()[1]
        scheme = "https" if ssl_context else "http"
        self.url = f"{scheme}://{address}:{port}{PREFIX}"

    @property
    def entry(self) -> str:
        return f"{self.name}={self.url}"

    def stop(self) -> None:
        self.server.stop()


# -- certificates ------------------------------------------------------------------------------
class CA:
    """A certificate authority of the test's own; its certificate is ``self.path``."""

    def __init__(self, tmp_path, name: str) -> None:
        self.dir = tmp_path / name
        self.dir.mkdir()
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = dt.datetime.now(dt.timezone.utc)
        public = self.key.public_key()
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(self.name).issuer_name(self.name).public_key(public)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(hours=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                              key_encipherment=False, data_encipherment=False, key_agreement=False,
                              encipher_only=False, decipher_only=False),
                critical=True,
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
            .sign(self.key, hashes.SHA256())
        )
        self.path = self.dir / "ca.crt"
        self.path.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, name: str, ip: str = "127.0.0.1") -> tuple[str, str]:
        """A certificate for ``ip`` (server and client use) and its key: their files."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.timezone.utc)
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(self.name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(ip))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
            )
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()), critical=False
            )
            .sign(self.key, hashes.SHA256())
        )
        cert_path, key_path = self.dir / f"{name}.crt", self.dir / f"{name}.key"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_path.write_bytes(
            key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
        )
        return str(cert_path), str(key_path)

    def server_context(self, name: str, client_ca: CA | None = None) -> ssl.SSLContext:
        """TLS for a broker with a certificate of this CA; ``client_ca``: it asks for a client
        certificate of that CA (mutual TLS, as JupyterHub's internal_ssl services do)."""
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(*self.issue(name))
        if client_ca is not None:
            context.load_verify_locations(str(client_ca.path))
            context.verify_mode = ssl.CERT_REQUIRED
        return context


def spawner_env(environment: dict | None = None):
    c = Config()
    c.Spawner.environment = dict(environment or {})
    c.Spawner.pre_spawn_hook = kubernetes.choose_broker
    return LocalProcessSpawner(config=c, user=SimpleNamespace(name="carol", id=1, url="/user/carol/"), hub=Hub())


async def chosen(environment: dict | None = None) -> dict:
    spawner = spawner_env(environment)
    await maybe_future(spawner.run_pre_spawn_hook())
    return dict(spawner.environment)


def non_loopback_address() -> str | None:
    """An address of this machine that is not its loopback address (None: it has none)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.255", 9))  # no packet is sent: this only picks the outgoing address
            address = s.getsockname()[0]
        except OSError:
            return None
    return None if ipaddress.ip_address(address).is_loopback else address


# -- a summary is checked before anything reads it ---------------------------------------------
MALFORMED = {
    "devices-not-objects": (summary("liar", gpus=1, free=1) | {"devices": [1]}, r"devices/0: 1 is not of type 'object'"),
    "count-a-string": (summary("liar") | {"free": "8"}, r"free: '8' is not of type 'integer'"),
    "count-negative": (summary("liar") | {"pending": -1}, r"pending: -1 is less than the minimum of 0"),
    "count-a-bool": (summary("liar") | {"leases": True}, r"leases: True is not of type 'integer'"),
    "missing-field": ({k: v for k, v in summary("liar").items() if k != "gpus"}, r"'gpus' is a required property"),
    "gpus-that-are-not-there": (summary("liar") | {"gpus": 8, "free": 8}, r"8 GPUs, but 1 listed"),
    "more-free-than-gpus": (summary("liar", gpus=2, free=2) | {"reclaimable": 1}, r"2 free and 1 reclaimable GPUs of 2"),
    "a-list": ([1, 2], r"is not of type 'object'"),
    "not-json": (b"<html>hello</html>", r"its answer is not JSON"),
    "huge-name": (summary("liar") | {"node": "x" * 5000}, r"node: .* is too long"),
}


@pytest.mark.parametrize("body, reason", MALFORMED.values(), ids=MALFORMED.keys())
def test_a_broker_that_answers_no_node_summary_is_broken(body, reason):
    async def scenario():
        liar = FakeBroker("liar", body)
        try:
            reports = await node_reports([NodeBroker("liar", liar.url)], TOKEN)
        finally:
            liar.stop()
        report = reports["liar"]
        assert report.summary is None and report.state == kubernetes.BROKEN
        assert re.search(reason, report.problem), report.problem
        assert len(report.problem) <= 330

    asyncio.run(scenario())
    assert kubernetes.summary_problem(summary("good", gpus=2, free=1)) is None
    # Fields a newer broker adds do not break it; a summary of an older one without them neither.
    assert kubernetes.summary_problem(summary("good") | {"added_later": {"x": 1}}) is None
    older = {k: v for k, v in summary("good").items() if k not in ("pending_gpus", "servers", "servers_without_lease")}
    assert kubernetes.summary_problem(older) is None


def test_the_admin_page_answers_200_and_shows_a_malformed_node_as_broken(tmp_path):
    """A real node broker lists a good peer and one whose summary has ``devices: [1]``: its
    admin page answers 200, shows the good one and names the bad one broken, with why."""
    from test_hub_broker import Setup

    async def scenario():
        good = FakeBroker("node-b", summary("node-b", gpus=2, free=1))
        bad = FakeBroker("node-c", summary("node-c", gpus=1, free=1) | {"devices": [1]})
        setup = Setup(tmp_path, node_name="node-a", node_brokers=f"{good.entry},{bad.entry}")
        http = AsyncHTTPClient(force_instance=True)
        try:
            app = await setup.start_broker()
            app.hub_auth = StubHubOAuth(api_token=TOKEN, base_url=PREFIX, access_scopes={SCOPE}, login_url="")
            for _ in range(2):  # the second time, the broken node is not news: the same page
                r = await http.fetch(
                    HTTPRequest(setup.url, headers={"Authorization": "token tok-root"}), raise_error=False
                )
                assert r.code == 200, r.body
                text = r.body.decode()
                nodes = text[text.index("<h2>Nodes</h2>"):]
                assert re.search(
                    r"node-c<br><code class='muted'>[^<]+</code></td><td colspan='5' class='warn'>broken: "
                    r"not a node summary: devices/0: 1 is not of type &#x27;object&#x27;</td>",
                    nodes,
                ), nodes
                assert re.search(r"node-b<br><code class='muted'>[^<]+</code></td><td>2</td><td>1</td>", nodes)
                assert "<h3>node-b</h3>" in nodes and "<h3>node-c</h3>" not in nodes
            assert bad.tokens == [f"token {TOKEN}", f"token {TOKEN}"]  # listed by the admin: asked
        finally:
            http.close()
            await setup.close()
            good.stop()
            bad.stop()

    asyncio.run(scenario())


# -- only listed, verified brokers with a good summary are chosen ------------------------------
def test_choose_node_never_picks_a_summary_whose_counts_are_not_counts():
    good = {"node": "good", "gpus": 2, "free": 1, "reclaimable": 0, "pending": 0, "leases": 1}
    for broken in (
        {**good, "free": 8},  # more free than there are GPUs
        {**good, "gpus": "8", "free": 8},
        {**good, "gpus": True},
        {**good, "free": -3},
        {**good, "gpus": None},
        [8, 8],
        "8 free GPUs",
    ):
        assert choose_node({"liar": broken}) is None
        assert choose_node({"liar": broken, "good": good}) == "good"


def test_choose_broker_takes_only_a_listed_verified_broker_with_a_good_summary(monkeypatch, caplog):
    """A good broker with one free GPU; a listed liar with 8 "free" GPUs and ``devices: [1]``;
    a listed broker on another host over plain http with 8 free GPUs; a broker nobody listed with
    8 free GPUs. Only the good one is chosen, and only listed brokers on this host hear the token
    (the other host's does once the admin allows plain http to it)."""
    address = non_loopback_address()

    async def scenario():
        good = FakeBroker("good", summary("good", gpus=2, free=1))
        liar = FakeBroker("liar", summary("liar", gpus=8, free=8) | {"devices": [1]})
        unlisted = FakeBroker("unlisted", summary("unlisted", gpus=8, free=8))
        remote = FakeBroker("remote", summary("remote", gpus=8, free=8), address=address) if address else None
        listed = [good, liar] + ([remote] if remote else [])
        try:
            monkeypatch.setenv(kubernetes.ENV_TOKEN, TOKEN)
            monkeypatch.setenv(kubernetes.ENV_NODE_BROKERS, ",".join(b.entry for b in listed))
            env = await chosen({"JUPYTER_GPUSCHED_BROKER_URL": "http://unchosen/"})
            assert env["JUPYTER_GPUSCHED_BROKER_URL"] == good.url and env["GPUSCHED_NODE"] == "good"
            assert kubernetes.ENV_SERVER_CA not in env  # an http broker: nothing to verify it with
            assert good.tokens == [f"token {TOKEN}"] and liar.tokens == [f"token {TOKEN}"]
            assert unlisted.connections == 0
            if remote is not None:
                assert remote.connections == 0  # not even a connection: the token never left
                report = kubernetes.last_report(remote.url)
                assert report.state == kubernetes.NOT_ASKED and f"plain http to {address}" in report.problem
                # The admin allows plain http to that network: it is asked, and its 8 free GPUs win.
                network = ipaddress.ip_network(f"{address}/24", strict=False)
                monkeypatch.setenv(kubernetes.ENV_ALLOW_HTTP, f"gpu-x.example, {network}")
                env = await chosen()
                assert env["JUPYTER_GPUSCHED_BROKER_URL"] == remote.url
                assert remote.tokens == [f"token {TOKEN}"]
            # The liar stays unchosen whatever it claims, and nothing is chosen when only it is left.
            monkeypatch.setenv(kubernetes.ENV_NODE_BROKERS, liar.entry)
            assert "JUPYTER_GPUSCHED_BROKER_URL" not in await chosen()
            assert unlisted.connections == 0
        finally:
            for broker in (good, liar, unlisted, remote):
                if broker is not None:
                    broker.stop()

    caplog.set_level("INFO")
    asyncio.run(scenario())
    messages = [r.getMessage() for r in caplog.records]
    assert any(re.search(r"GPU broker of node liar \(.*\) is broken: not a node summary: devices/0", m) for m in messages)
    assert any("none preferred (1 node broker(s), none answered; 1 broken)" in m for m in messages)
    if address:
        assert any(re.search(r"GPU broker of node remote \(.*\) is not asked: plain http to", m) for m in messages)


def test_the_plain_http_rule():
    trust = BrokerTrust()
    for url in ("http://127.0.0.1:8765/p/", "http://127.0.0.5:1/", "http://[::1]:1/", "http://localhost:1/",
                "https://10.0.0.5:8765/p/", "https://gpu-a.example/p/"):
        assert trust.refusal(url) is None, url
    for url in ("http://10.0.0.5:8765/p/", "http://gpu-a:8765/", "http://[fd00::5]:1/", "http://localhost.evil.example/"):
        assert "the service token is not sent" in trust.refusal(url), url
    allowed = BrokerTrust(allow_http=kubernetes.parse_allow_http("10.0.0.0/24 , GPU-A,fd00::/64"))
    assert allowed.allow_http == ("10.0.0.0/24", "gpu-a", "fd00::/64")
    assert allowed.refusal("http://10.0.0.5:8765/p/") is None and allowed.refusal("http://gpu-a:1/") is None
    assert allowed.refusal("http://[fd00::5]:1/") is None
    assert allowed.refusal("http://10.0.1.5:8765/p/") and allowed.refusal("http://gpu-b:1/")
    assert BrokerTrust(allow_http=("*",)).refusal("http://anywhere.example:1/") is None
    with pytest.raises(ValueError, match="GPUSCHED_BROKER_ALLOW_HTTP: 'gpu-a/b' is not a host name"):
        kubernetes.parse_allow_http("ok.example gpu-a/b")


def test_the_trust_settings(monkeypatch, tmp_path):
    ca = CA(tmp_path, "hub-ca")
    cert, key = ca.issue("hub")
    assert BrokerTrust.from_environment() == BrokerTrust()
    # JupyterHub's internal_ssl files, as it gives them to a service, are the default ...
    monkeypatch.setenv(kubernetes.ENV_HUB_CA, str(ca.path))
    monkeypatch.setenv(kubernetes.ENV_HUB_CERT, cert)
    monkeypatch.setenv(kubernetes.ENV_HUB_KEY, key)
    assert BrokerTrust.from_environment() == BrokerTrust(str(ca.path), cert, key)
    # ... and the broker's own settings win.
    other = CA(tmp_path, "admin-ca")
    monkeypatch.setenv(kubernetes.ENV_CA, str(other.path))
    assert BrokerTrust.from_environment().ca_file == str(other.path)
    monkeypatch.setenv(kubernetes.ENV_CLIENT_CERT, cert)
    with pytest.raises(ValueError, match="GPUSCHED_BROKER_CERT and GPUSCHED_BROKER_KEY go together"):
        BrokerTrust.from_environment()
    monkeypatch.delenv(kubernetes.ENV_CLIENT_CERT)
    monkeypatch.setenv(kubernetes.ENV_CA, str(tmp_path / "missing.crt"))
    with pytest.raises(ValueError, match="CA file .*missing.crt is not a file"):
        BrokerTrust.from_environment()

    async def scenario():
        # Wrong settings: nobody is asked, and it says why.
        broker = FakeBroker("node-b", summary("node-b"))
        try:
            report = (await node_reports([NodeBroker("node-b", broker.url)], TOKEN))["node-b"]
        finally:
            broker.stop()
        assert report.state == kubernetes.NOT_ASKED and "missing.crt is not a file" in report.problem
        assert broker.connections == 0

    asyncio.run(scenario())


def test_discovered_brokers_take_the_configured_scheme():
    pods = {"items": [{"metadata": {}, "spec": {"nodeName": "gpu-a"}, "status": {"phase": "Running", "hostIP": "10.0.0.1"}}]}
    assert kubernetes._brokers_of_pods(pods, 8765, PREFIX, "https") == [NodeBroker("gpu-a", f"https://10.0.0.1:8765{PREFIX}")]


# -- https: the token goes only to a broker whose certificate is verified ----------------------
def test_the_token_goes_only_to_a_broker_whose_certificate_is_verified(monkeypatch, tmp_path):
    """The good broker's certificate is signed by the CA the hub trusts; the impostor's, for the
    same address, by another CA, and it reports 8 free GPUs. The impostor never gets a request
    (the token travels only after the handshake), is shown as broken and is never chosen."""
    hub_ca, other_ca = CA(tmp_path, "hub-ca"), CA(tmp_path, "impostor-ca")

    async def scenario():
        good = FakeBroker("good", summary("good", gpus=2, free=1), ssl_context=hub_ca.server_context("good"))
        impostor = FakeBroker(
            "impostor", summary("impostor", gpus=8, free=8), ssl_context=other_ca.server_context("impostor")
        )
        brokers = [NodeBroker("good", good.url), NodeBroker("impostor", impostor.url)]
        try:
            # Without a CA file, the system's CAs verify: neither is believed, nobody gets the token.
            reports = await node_reports(brokers, TOKEN)
            assert {n: r.state for n, r in reports.items()} == {"good": "broken", "impostor": "broken"}
            assert "its certificate is not verified by the system's trusted CAs" in reports["good"].problem
            assert good.tokens == [] and impostor.tokens == []

            monkeypatch.setenv(kubernetes.ENV_CA, str(hub_ca.path))
            reports = await node_reports(brokers, TOKEN)
            assert reports["good"].state == kubernetes.OK and reports["good"].summary["free"] == 1
            assert reports["impostor"].state == kubernetes.BROKEN and reports["impostor"].summary is None
            assert f"its certificate is not verified by the CA file {hub_ca.path}" in reports["impostor"].problem
            assert "the service token was not sent" in reports["impostor"].problem
            assert good.tokens == [f"token {TOKEN}"] and impostor.tokens == []

            monkeypatch.setenv(kubernetes.ENV_TOKEN, TOKEN)
            monkeypatch.setenv(kubernetes.ENV_NODE_BROKERS, f"{good.entry},{impostor.entry}")
            env = await chosen()
            assert env["JUPYTER_GPUSCHED_BROKER_URL"] == good.url
            # The server verifies the broker with the same CA (unless its environment names one).
            assert env[kubernetes.ENV_SERVER_CA] == str(hub_ca.path)
            assert (await chosen({kubernetes.ENV_SERVER_CA: "/own/ca.crt"}))[kubernetes.ENV_SERVER_CA] == "/own/ca.crt"
            assert impostor.tokens == []

            # JupyterHub's internal_ssl CA, when the broker's own is not set.
            monkeypatch.delenv(kubernetes.ENV_CA)
            monkeypatch.setenv(kubernetes.ENV_HUB_CA, str(hub_ca.path))
            reports = await node_reports(brokers, TOKEN)
            assert reports["good"].state == kubernetes.OK and reports["impostor"].state == kubernetes.BROKEN
            assert impostor.tokens == []
        finally:
            good.stop()
            impostor.stop()

    asyncio.run(scenario())


def test_a_broker_that_asks_for_a_client_certificate_gets_the_configured_one(monkeypatch, tmp_path):
    """Mutual TLS, as JupyterHub's internal_ssl services ask: without a client certificate the
    broker answers nothing; with one of its CA it answers."""
    ca = CA(tmp_path, "internal-ca")

    async def scenario():
        broker = FakeBroker("node-b", summary("node-b"), ssl_context=ca.server_context("node-b", client_ca=ca))
        brokers = [NodeBroker("node-b", broker.url)]
        try:
            monkeypatch.setenv(kubernetes.ENV_CA, str(ca.path))
            report = (await node_reports(brokers, TOKEN))["node-b"]
            assert report.state != kubernetes.OK and broker.tokens == []
            cert, key = ca.issue("hub")
            monkeypatch.setenv(kubernetes.ENV_CLIENT_CERT, cert)
            monkeypatch.setenv(kubernetes.ENV_CLIENT_KEY, key)
            report = (await node_reports(brokers, TOKEN))["node-b"]
            assert report.state == kubernetes.OK and broker.tokens == [f"token {TOKEN}"]
        finally:
            broker.stop()

    asyncio.run(scenario())


def test_a_broker_that_sends_too_much_is_broken(monkeypatch):
    monkeypatch.setattr(kubernetes, "MAX_SUMMARY_BYTES", 4096)

    async def scenario():
        broker = FakeBroker("node-b", summary("node-b") | {"padding": "x" * 10000})
        try:
            report = (await node_reports([NodeBroker("node-b", broker.url)], TOKEN))["node-b"]
        finally:
            broker.stop()
        assert report.state == kubernetes.BROKEN and "more than 4096 bytes" in report.problem

    asyncio.run(scenario())
