"""A server's token goes only to the real broker: its Unix socket, or HTTPS with a verified certificate.

The broker runs in this process (as in ``test_hub_broker.py``: the hub's token check is the one
stand-in); "another user" is a real process running under another uid (``nobody``), which
tries what a hostile local user would: take the broker's address while it is down.
"""

from __future__ import annotations

import asyncio
import datetime
import functools
import os
import pwd
import socket
import ssl
import stat
import subprocess
import sys
import textwrap
import threading
import urllib.parse

import pytest

from jupyter_gpusched import transport
from jupyter_gpusched.api.input import Claim
from jupyter_gpusched.api.views import Principal
from jupyter_gpusched.arbiter.remote import BrokerClient, BrokerUnavailable
from jupyter_gpusched.hub.broker import GPUBroker

from hub_util import free_port
from test_hub_broker import FakeKernels, Setup, until

NOBODY = pwd.getpwnam("nobody").pw_uid
#: An interpreter every user may run (this environment's may live in a private directory).
SYSTEM_PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
AS_ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not AS_ROOT, reason="another user's process needs root to start")


def sync(coro_fn):
    """Run an async test on its own event loop (as the other broker tests do)."""

    @functools.wraps(coro_fn)
    def run(*args, **kwargs):
        return asyncio.run(coro_fn(*args, **kwargs))

    return run


def unix_url(path) -> str:
    return "http+unix://" + urllib.parse.quote(str(path), safe="") + "/services/gpusched/"


def as_nobody():
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)


# -- broker URLs ----------------------------------------------------------------------------------
def test_broker_urls_are_read_with_their_transport():
    a = transport.parse_broker_url("http+unix://%2Frun%2Fgpusched%2Fbroker.sock/services/gpusched")
    assert a.socket_path == "/run/gpusched/broker.sock"
    assert a.base == "http://gpusched-broker/services/gpusched/" and not a.tls
    assert a.websocket_url("api/x") == "ws://gpusched-broker/services/gpusched/api/x"
    assert transport.parse_broker_url("unix+http://%2Frun%2Fb.sock/p/").socket_path == "/run/b.sock"
    s = transport.parse_broker_url("https://10.0.0.5:8765/services/gpusched/")
    assert s.tls and s.socket_path is None and s.websocket_url("x").startswith("wss://10.0.0.5:8765/")
    assert transport.parse_broker_url("http://127.0.0.1:10101/services/gpusched/").loopback_http
    assert not transport.parse_broker_url("http://10.0.0.5:1/").loopback_http
    for bad, words in [
        ("", "empty"),
        ("ftp://x/", r"use http\+unix://"),
        ("http+unix://run%2Fb.sock/", "absolute"),
        ("http+unix://%2F" + "x" * 200 + "/", "at most 107 bytes"),
        ("http:///nohost/", "names no host"),
    ]:
        with pytest.raises(ValueError, match=words):
            transport.parse_broker_url(bad)


def test_a_bad_broker_url_stops_the_server_with_the_reason():
    from jupyter_gpusched.server.app import GPUSchedApp
    from traitlets import TraitError

    with pytest.raises(TraitError, match="use http\\+unix://"):
        GPUSchedApp(broker_url="tcp://127.0.0.1:1/")


# -- the socket's path ------------------------------------------------------------------------------
def _listening_socket(path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(path))
    sock.listen(8)
    return sock


@needs_root
def test_only_a_socket_nobody_else_could_have_made_is_trusted(tmp_path):
    safe = tmp_path / "run"
    safe.mkdir(mode=0o755)
    os.chmod(safe, 0o755)
    good = _listening_socket(safe / "broker.sock")
    try:
        transport.check_socket(str(safe / "broker.sock"))
    finally:
        good.close()

    with pytest.raises(transport.UntrustedBroker, match="the broker is not running"):
        transport.check_socket(str(safe / "missing.sock"))

    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)  # like /tmp: anyone may create a name there
    sock = _listening_socket(shared / "broker.sock")
    try:
        with pytest.raises(transport.UntrustedBroker, match="may be written by other users"):
            transport.check_socket(str(shared / "broker.sock"))
    finally:
        sock.close()

    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, NOBODY, NOBODY)
    sock = _listening_socket(theirs / "broker.sock")
    os.chown(theirs / "broker.sock", NOBODY, NOBODY)
    try:
        # Their own directory and socket: fine for them, not for a server that trusts only root.
        with pytest.raises(transport.UntrustedBroker, match="does not run the broker"):
            transport.check_socket(str(theirs / "broker.sock"), owners=set())
    finally:
        sock.close()

    planted = safe / "planted.sock"
    sock = _listening_socket(planted)
    os.chown(planted, NOBODY, NOBODY)
    try:
        with pytest.raises(transport.UntrustedBroker, match="the socket .* belongs to nobody"):
            transport.check_socket(str(planted))
    finally:
        sock.close()

    os.symlink(safe, tmp_path / "link")
    with pytest.raises(transport.UntrustedBroker, match="symbolic link"):
        transport.check_socket(str(tmp_path / "link" / "broker.sock"))


def test_the_broker_refuses_a_socket_directory_others_can_write(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(ValueError, match="unsafe.*may be written by other users"):
        transport.prepare_socket_dir(str(shared / "broker.sock"))
    made = tmp_path / "new" / "run"
    transport.prepare_socket_dir(str(made / "broker.sock"))
    assert stat.S_IMODE(os.stat(made).st_mode) == 0o755


# -- the broker on its socket -----------------------------------------------------------------------
class SocketSetup(Setup):
    def __init__(self, tmp_path, **traits) -> None:
        self.sock_path = tmp_path / "run" / "broker.sock"
        super().__init__(tmp_path, unix_socket=str(self.sock_path), **traits)
        self.url = unix_url(self.sock_path)


def _recorder(path, out: list, ready: threading.Event, stop: threading.Event):
    """Another user's listener: accepts connections on ``path`` and keeps every byte it is sent."""

    def run():
        srv = socket.socket(socket.AF_UNIX)
        srv.bind(str(path))
        srv.listen(16)
        srv.settimeout(0.2)
        ready.set()
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except socket.timeout:
                continue
            conn.settimeout(1)
            try:
                out.append(conn.recv(65536))
            except OSError:
                pass
            conn.close()
        srv.close()

    return threading.Thread(target=run, daemon=True)


@needs_root
@sync
async def test_servers_reach_the_broker_through_its_socket_and_nobody_else_can_take_it(tmp_path):
    os.chmod(tmp_path, 0o755)  # so that "another user" can reach the socket's directory
    setup = SocketSetup(tmp_path)
    app = await setup.start_broker()
    try:
        assert stat.S_ISSOCK(os.lstat(setup.sock_path).st_mode)
        assert stat.S_IMODE(os.stat(setup.sock_path.parent).st_mode) == 0o755
        client, kernels = await setup.server("alice")
        await until(lambda: client.connected, 10, "the server to connect through the socket")
        result = await client.claim(Principal(user="alice"), Claim(kernel_id=kernels.ids[0], count=1))
        assert result.status == 201 and result.lease["state"] == "active"

        # The broker stops (a crash, an upgrade): its socket goes with it.
        await setup.stop_broker()
        assert not os.path.lexists(setup.sock_path)
        await until(lambda: not client.connected, 10, "the server to notice")
        with pytest.raises(BrokerUnavailable, match="broker is not running .*keeps trying"):
            await client.status(Principal(user="alice"))

        # Another user tries to take the broker's address: the directory is not theirs.
        attempt = subprocess.run(
            [SYSTEM_PYTHON, "-c", textwrap.dedent(f"""
                import socket
                s = socket.socket(socket.AF_UNIX)
                try:
                    s.bind({str(setup.sock_path)!r})
                except PermissionError as e:
                    print("refused:", e.strerror)
                else:
                    print("bound")
            """)],
            preexec_fn=as_nobody, capture_output=True, text=True, timeout=30,
        )
        assert attempt.stdout.strip() == "refused: Permission denied", attempt

        # A claim made meanwhile waits for the server to be connected again, instead of a refusal.
        waiting = asyncio.ensure_future(
            client.claim(Principal(user="alice"), Claim(kernel_id=kernels.ids[0], count=1, wait=20.0))
        )
        await asyncio.sleep(0.5)
        assert not waiting.done()

        # The broker comes back on the same socket; the server reconnects on its own.
        await setup.start_broker()
        await until(lambda: client.connected, 30, "the server to reconnect by itself")
        answered = await asyncio.wait_for(waiting, 30)
        assert answered.status == 200 and answered.lease["state"] in ("active", "idle"), "the same lease, kept"
        status = await client.status(Principal(user="alice"))
        assert [lease["id"] for lease in status["leases"]] == [answered.lease["id"]], "the lease survived the restart"
    finally:
        await setup.close()


@needs_root
@sync
async def test_a_socket_someone_else_could_have_made_gets_no_token(tmp_path):
    """The broker's URL names a socket in a directory every user can write (an admin's mistake, or
    a directory the broker never made): another user got there first. The server sends nothing."""
    os.chmod(tmp_path, 0o755)
    shared = tmp_path / "tmp"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    path = shared / "broker.sock"
    received: list[bytes] = []
    ready, stop = threading.Event(), threading.Event()
    listener = _recorder(path, received, ready, stop)
    listener.start()
    assert ready.wait(10)
    os.chown(path, NOBODY, NOBODY)
    kernels = FakeKernels(1)
    client = BrokerClient(unix_url(path), kernels=kernels, user="alice", token="tok-alice-secret")
    try:
        await client.start()
        await asyncio.sleep(1.5)  # a few reconnect attempts
        with pytest.raises(BrokerUnavailable) as err:
            await client.status(Principal(user="alice"))
        assert "cannot be verified" in err.value.message and "may be written by other users" in err.value.message
        assert "sends it nothing" in err.value.message
        assert not client.connected
        assert received == [], "no connection reached the impostor's socket"
    finally:
        stop.set()
        await client.stop()
        kernels.close()
        listener.join(5)


# -- HTTPS with a verified certificate ------------------------------------------------------------
def _certificates(tmp_path):
    """A CA, the broker's certificate signed by it, and an impostor's self-signed one."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    import ipaddress

    now = datetime.datetime.now(datetime.timezone.utc)

    def name(cn):
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def write(key, cert, stem):
        (tmp_path / f"{stem}.key").write_bytes(
            key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
        )
        (tmp_path / f"{stem}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return str(tmp_path / f"{stem}.crt"), str(tmp_path / f"{stem}.key")

    def cert(subject, issuer, key, signer, ca):
        b = (
            x509.CertificateBuilder().subject_name(name(subject)).issuer_name(name(issuer))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if not ca:
            b = b.add_extension(
                x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False
            )
        return b.sign(signer, hashes.SHA256())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = cert("gpusched test CA", "gpusched test CA", ca_key, ca_key, True)
    ca_crt, _ = write(ca_key, ca, "ca")
    key = ec.generate_private_key(ec.SECP256R1())
    broker = write(key, cert("broker", "gpusched test CA", key, ca_key, False), "broker")
    other_key = ec.generate_private_key(ec.SECP256R1())
    impostor = write(other_key, cert("broker", "broker", other_key, other_key, False), "impostor")
    return ca_crt, broker, impostor


@sync
async def test_https_broker_is_verified_and_an_impostor_gets_no_token(tmp_path):
    ca, (crt, key), (bad_crt, bad_key) = _certificates(tmp_path)
    setup = Setup(tmp_path, ssl_certfile=crt, ssl_keyfile=key)
    setup.traits["url"] = f"https://127.0.0.1:{setup.port}"
    setup.url = f"https://127.0.0.1:{setup.port}/services/gpusched/"
    await setup.start_broker()
    kernels = FakeKernels(1)
    client = BrokerClient(setup.url, kernels=kernels, user="alice", token="tok-alice", ca_file=ca)
    try:
        await client.start()
        await until(lambda: client.connected, 10, "the server to connect over verified TLS")
        result = await client.claim(Principal(user="alice"), Claim(kernel_id=kernels.ids[0], count=1))
        assert result.status == 201
    finally:
        await client.stop()
        kernels.close()
        await setup.stop_broker()

    # The broker is gone; someone else listens on its port with a certificate of their own.
    received: list[bytes] = []
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(bad_crt, bad_key)
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", setup.port))
    srv.listen(16)
    srv.settimeout(0.2)
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except socket.timeout:
                continue
            try:
                tls = ctx.wrap_socket(conn, server_side=True)
                tls.settimeout(1)
                received.append(tls.recv(65536))
            except (OSError, ssl.SSLError):
                pass
            finally:
                conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    kernels = FakeKernels(1)
    client = BrokerClient(setup.url, kernels=kernels, user="alice", token="tok-alice-secret", ca_file=ca)
    try:
        await client.start()
        with pytest.raises(BrokerUnavailable) as err:
            await client.status(Principal(user="alice"))
        assert "cannot be verified" in err.value.message and "certificate" in err.value.message
        assert not any(b"tok-alice-secret" in data for data in received)
        assert not any(received), "the impostor read nothing: the handshake failed before any request"
        assert client.untrusted and "certificate" in client.untrusted
    finally:
        stop.set()
        await client.stop()
        kernels.close()
        thread.join(5)
        srv.close()


@sync
async def test_the_broker_keeps_serving_its_socket_while_its_tcp_port_is_taken(tmp_path):
    setup = SocketSetup(tmp_path)
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", setup.port))
    squatter.listen(1)
    try:
        await setup.start_broker()
        client, kernels = await setup.server("alice")
        await until(lambda: client.connected, 10, "the server to connect through the socket")
        status = await client.status(Principal(user="alice"))
        assert status["mode"] == "hub"
    finally:
        squatter.close()
        await setup.close()
