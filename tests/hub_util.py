"""A real JupyterHub for tests and benchmarks: the example config, free ports, its own directory.

The hub loads ``examples/jupyterhub_config.py`` as written, through a small wrapper that adds
what only a test needs: free ports, files in a scratch directory, the dummy authenticator, the
simple local-process spawner (servers run as the hub's own Unix user, with ``--allow-root``),
simulated GPUs for the broker (``c.GPUBroker.*``), and an admin service token to drive the hub's
REST API. It needs ``configurable-http-proxy`` on PATH, and ``requests`` (a test dependency, through
jupyterhub). The tests import it as ``hub_util`` (pytest puts ``tests/`` on ``sys.path``); the
benchmarks put ``tests/`` there themselves.

    with Hub(tmp_path, broker={"simulated_devices": 2}) as hub:
        hub.create_users(["alice", "bob"])
        hub.start_server("alice")
        code, status = hub.call("GET", hub.server_url("alice") + "api/gpusched/status", hub.token("alice"))
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterable

import psutil
import requests

#: The example configuration of this checkout (tests and benchmarks run from one).
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "jupyterhub_config.py"

_WRAPPER = '''\
# Written by tests/hub_util.py: the example config as written, plus what a test needs.
import json
import os

c = get_config()  # noqa: F821
load_subconfig({example!r})  # noqa: F821

# The broker reads its settings from this file (the example points it at itself).
for service in c.JupyterHub.services:
    if service.get("name") == "gpusched":
        service["command"] = [a for a in service["command"] if not a.startswith("--config=")] + ["--config=" + __file__]

c.JupyterHub.bind_url = "http://127.0.0.1:{proxy_port}"
c.JupyterHub.hub_ip = "127.0.0.1"
c.JupyterHub.hub_port = {hub_port}
c.ConfigurableHTTPProxy.api_url = "http://127.0.0.1:{proxy_api_port}"
c.JupyterHub.db_url = "sqlite:///" + {db!r}
c.JupyterHub.cookie_secret_file = {cookie_secret!r}
c.JupyterHub.pid_file = {pid_file!r}
c.JupyterHub.log_level = {log_level!r}
c.JupyterHub.authenticator_class = "dummy"
c.Authenticator.allow_all = True
c.Authenticator.admin_users = set({admins!r})
{spawner}
c.Spawner.start_timeout = 180
c.Spawner.http_timeout = 180
c.Spawner.environment.update(json.loads({environment!r}))
c.JupyterHub.services.append({{"name": "test-admin", "api_token": {admin_token!r}}})
c.JupyterHub.load_roles.append(
    {{
        "name": "test-admin",
        "scopes": [
            "admin:users", "admin:servers", "admin:groups", "tokens", "list:users", "read:users",
            "access:servers", "access:services",
        ],
        "services": ["test-admin"],
    }}
)
for name, value in json.loads({broker!r}).items():
    setattr(c.GPUBroker, name, value)
{extra}
'''


#: Servers as the hub's own Unix user (root here), each in a home of the test's own.
_SIMPLE_SPAWNER = """\
c.JupyterHub.spawner_class = "simple"
c.SimpleLocalProcessSpawner.home_dir_template = {homes!r} + "/{{username}}"
c.Spawner.args = ["--allow-root"]"""

#: JupyterHub's default spawner: each user's server runs as that Unix user, from an environment
#: an admin installed for everyone.
_LOCAL_PROCESS_SPAWNER = """\
c.JupyterHub.spawner_class = "localprocess"
c.Spawner.cmd = [{singleuser!r}]
c.Spawner.args = []"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


ROOT = Path(__file__).resolve().parents[1]
#: Where the environment for real users' servers is made: a path every user can read.
USERS_ENV_ROOT = Path(os.environ.get("GPUSCHED_TEST_USERS_ENV_ROOT", "/opt"))
#: The system's interpreter: an environment made from it is one every user can run (one made from
#: an interpreter under /root is not).
SYSTEM_PYTHON = "/usr/bin/python3"
_installed: dict[str, Path] = {}


def real_users_unavailable() -> str | None:
    """Why servers cannot run as real Unix accounts here (None: they can)."""
    if os.geteuid() != 0:
        return "real Unix accounts need root (useradd, and a hub that starts servers as other users)"
    if shutil.which("useradd") is None:
        return "useradd is not installed"
    if not os.access(SYSTEM_PYTHON, os.X_OK):
        return f"{SYSTEM_PYTHON} is missing: no interpreter every user may run"
    return None


def unix_users(names: Iterable[str]) -> dict[str, int]:
    """Real Unix accounts with homes (``useradd -m``), made where missing; their uids."""
    import pwd

    uids = {}
    for name in names:
        try:
            uids[name] = pwd.getpwnam(name).pw_uid
        except KeyError:
            subprocess.run(["useradd", "-m", "-s", "/bin/bash", name], check=True, capture_output=True)
            uids[name] = pwd.getpwnam(name).pw_uid
    return uids


def users_environment() -> Path:
    """An environment every user can run, with this checkout's package installed as an admin would.

    Made from the system interpreter under ``/opt``; its dependencies are installed once per set of
    declared dependencies (a hash names the folder), and this checkout's wheel again in each test
    session, so the servers run the code under test.
    """
    import hashlib

    key = hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + SYSTEM_PYTHON.encode()).hexdigest()[:12]
    env = USERS_ENV_ROOT / f"gpusched-test-users-{key}"
    if key in _installed:
        return _installed[key]
    pip = [str(env / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    wheel_dir = Path(tempfile.mkdtemp(prefix="gpusched-wheel-"))
    try:
        # The lab extension was built by the checkout's own install; the wheel takes it as it is.
        subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheel_dir), str(ROOT)],
            check=True, capture_output=True, env={**os.environ, "HATCH_BUILD_NO_HOOKS": "true"},
        )
        (wheel,) = wheel_dir.glob("jupyter_gpusched-*.whl")
        if not (env / ".complete").exists():
            shutil.rmtree(env, ignore_errors=True)
            subprocess.run([SYSTEM_PYTHON, "-m", "venv", str(env)], check=True, capture_output=True)
            subprocess.run(pip + [f"{wheel}[hub]"], check=True, capture_output=True)
            (env / ".complete").write_text("dependencies installed\n")
        subprocess.run(pip + ["--no-deps", "--force-reinstall", str(wheel)], check=True, capture_output=True)
    except subprocess.CalledProcessError as exc:
        raise HubError(f"could not make the users' environment {env}: {exc}\n{exc.stderr}") from None
    finally:
        shutil.rmtree(wheel_dir, ignore_errors=True)
    subprocess.run(["chmod", "-R", "a+rX", str(env)], check=True)
    _installed[key] = env
    return env


class HubError(RuntimeError):
    """The hub did not do what the test needed; the message includes the end of its log."""


class Hub:
    """One JupyterHub process (with its proxy, the broker and the users' servers)."""

    def __init__(
        self,
        workdir: str | os.PathLike,
        *,
        broker: dict[str, Any] | None = None,
        admins: Iterable[str] = ("admin",),
        environment: dict[str, str] | None = None,
        extra_config: str = "",
        example: Path = EXAMPLE,
        log_level: str = "INFO",
        hub_environment: dict[str, str] | None = None,
        users_env: Path | None = None,
    ) -> None:
        """``environment``: what every single-user server gets (``c.Spawner.environment``);
        ``hub_environment``: what the hub process itself gets (its config and hooks read it);
        ``users_env``: an environment from :func:`users_environment`: then the servers run as the
        hub users' own Unix accounts (JupyterHub's default spawner; see :func:`unix_users`)."""
        self.dir = Path(workdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.users_env = users_env
        self.python = str(users_env / "bin" / "python") if users_env else sys.executable
        self.proxy_port = free_port()
        self.hub_port = free_port()
        self.proxy_api_port = free_port()
        self.broker_port = free_port()
        # The broker's socket: a short path (a Unix socket's has at most 107 bytes) in a directory
        # of the hub's user that every user may enter.
        self.socket_dir = Path(tempfile.mkdtemp(prefix="gpusched-run-"))
        os.chmod(self.socket_dir, 0o755)
        self.broker_socket = str(self.socket_dir / "broker.sock")
        self.admin_token = secrets.token_hex(16)
        self.ledger_path = str(self.dir / "gpusched.sqlite")
        if users_env is None:
            self.shared_dir = None
            self.sim_state = str(self.dir / "gpusched-sim.sqlite")
            self.kernels_dir = self.dir / "share" / "jupyter"
        else:
            # What every user's server and kernels read (kernelspecs) or write (the simulated GPUs,
            # as a real driver is shared); the hub's own files stay in the private workdir.
            self.shared_dir = Path(tempfile.mkdtemp(prefix="gpusched-hub-"))
            os.chmod(self.shared_dir, 0o755)
            sim_dir = self.shared_dir / "sim"
            sim_dir.mkdir()
            os.chmod(sim_dir, 0o1777)
            self.sim_state = str(sim_dir / "gpusched-sim.sqlite")
            fd = os.open(self.sim_state, os.O_CREAT | os.O_WRONLY, 0o666)
            os.close(fd)
            os.chmod(self.sim_state, 0o666)
            self.kernels_dir = self.shared_dir / "share" / "jupyter"
        broker_config = {
            "backend": "simulated",
            "simulated_devices": 2,
            "ledger_path": self.ledger_path,
            "simulated_state_path": self.sim_state,
            "poll_interval": 0.5,
            "heartbeat_interval": 1.0,
            "heartbeat_timeout": 6.0,
            **({"allow_shared_state_files": True} if users_env else {}),
            **(broker or {}),
        }
        env = {
            "JUPYTER_GPUSCHED_SIM_STATE": self.sim_state,
            "JUPYTER_PATH": str(self.kernels_dir),
            "JUPYTER_PLATFORM_DIRS": "1",
            **(environment or {}),
        }
        self.config = self.dir / "jupyterhub_config.py"
        (self.dir / "homes").mkdir(exist_ok=True)
        self.config.write_text(
            _WRAPPER.format(
                example=str(example),
                proxy_port=self.proxy_port,
                hub_port=self.hub_port,
                proxy_api_port=self.proxy_api_port,
                db=str(self.dir / "jupyterhub.sqlite"),
                cookie_secret=str(self.dir / "jupyterhub_cookie_secret"),
                pid_file=str(self.dir / "jupyterhub.pid"),
                log_level=log_level,
                admins=sorted(admins),
                spawner=(
                    _LOCAL_PROCESS_SPAWNER.format(singleuser=str(users_env / "bin" / "jupyterhub-singleuser"))
                    if users_env else _SIMPLE_SPAWNER.format(homes=str(self.dir / "homes"))
                ),
                environment=json.dumps(env),
                admin_token=self.admin_token,
                broker=json.dumps(broker_config),
                extra=extra_config,
            )
        )
        self.public_url = f"http://127.0.0.1:{self.proxy_port}/"
        self.hub_api_url = f"http://127.0.0.1:{self.hub_port}/hub/api/"
        self.broker_url = self.public_url + "services/gpusched/"
        self.hub_environment = dict(hub_environment or {})
        self.proc: subprocess.Popen | None = None
        self.log_path = self.dir / "hub.log"
        self._log = None
        self._tokens: dict[str, str] = {}
        self._session = requests.Session()

    # -- kernelspecs --------------------------------------------------------------------------------
    def add_kernelspec(self, name: str = "gpu", **config: Any) -> str:
        """A kernelspec every user's server sees, started through gpusched-provisioner."""
        spec_dir = self.kernels_dir / "kernels" / name
        spec_dir.mkdir(parents=True, exist_ok=True)
        spec = {
            "argv": [self.python, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": f"Python (GPU, {name})",
            "language": "python",
            "metadata": {
                "kernel_provisioner": {
                    "provisioner_name": "gpusched-provisioner",
                    "config": {"gpus": 1, "bind": "lazy", **config},
                }
            },
        }
        (spec_dir / "kernel.json").write_text(json.dumps(spec))
        return name

    # -- process ----------------------------------------------------------------------------------
    def start(self, timeout: float = 120.0) -> None:
        env = dict(os.environ)
        env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
        if shutil.which("configurable-http-proxy", path=env["PATH"]) is None:
            raise HubError("configurable-http-proxy is not on PATH (npm install -g configurable-http-proxy)")
        env["GPUSCHED_BROKER_URL"] = f"http://127.0.0.1:{self.broker_port}"
        env["GPUSCHED_BROKER_SOCKET"] = self.broker_socket
        env.pop("JUPYTERHUB_API_TOKEN", None)
        env.update(self.hub_environment)
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jupyterhub", "-f", str(self.config)],
            cwd=self.dir,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.wait_for(lambda: self._ok(self.hub_api_url), timeout, "the hub's API")
        self.wait_broker(timeout)

    def _ok(self, url: str, token: str | None = None) -> bool:
        try:
            r = self._session.get(url, headers=self._auth(token), timeout=5)
        except requests.RequestException:
            return False
        return r.status_code == 200

    def wait_broker(self, timeout: float = 120.0) -> None:
        """Until the broker answers, then through the proxy."""
        direct = f"http://127.0.0.1:{self.broker_port}/services/gpusched/api/gpusched/status"
        self.wait_for(lambda: self._ok(direct, self.admin_token), timeout, "the GPU broker to listen")
        self.wait_for(
            lambda: self._ok(self.broker_url + "api/gpusched/status", self.admin_token), timeout, "the GPU broker"
        )

    def wait_for(self, predicate, timeout: float, what: str, interval: float = 0.25) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise HubError(f"the hub exited ({self.proc.returncode}) while waiting for {what}\n{self.log_tail()}")
            value = predicate()
            if value:
                return value
            if time.monotonic() > deadline:
                raise HubError(f"timed out after {timeout:.0f}s waiting for {what}\n{self.log_tail()}")
            time.sleep(interval)

    def log_tail(self, lines: int = 80) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def descendants(self) -> list[psutil.Process]:
        if self.proc is None:
            return []
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            return []

    def broker_process(self) -> psutil.Process | None:
        for proc in self.descendants():
            try:
                cmdline = proc.cmdline()
            except psutil.Error:
                continue
            if "jupyter_gpusched.cli" in cmdline and "broker" in cmdline:
                return proc
        return None

    def stop(self) -> None:
        """Stop the hub (it stops the broker, the proxy and the servers); kill what remains."""
        if self.proc is None:
            return
        left = self.descendants()
        if self.proc.poll() is None:
            for user in list(self._tokens):
                try:
                    self.hub("DELETE", f"users/{user}/server", timeout=30)
                except requests.RequestException:
                    pass
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        gone, alive = psutil.wait_procs(left, timeout=10)
        for proc in alive:
            try:
                proc.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(alive, timeout=5)
        if self._log is not None:
            self._log.close()
        self._session.close()
        self.proc = None
        shutil.rmtree(self.socket_dir, ignore_errors=True)
        if self.shared_dir is not None:
            if os.environ.get("GPUSCHED_TEST_KEEP"):
                print("kept", self.shared_dir)
            else:
                shutil.rmtree(self.shared_dir, ignore_errors=True)

    def __enter__(self) -> Hub:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- HTTP ---------------------------------------------------------------------------------
    @staticmethod
    def _auth(token: str | None) -> dict[str, str]:
        return {"Authorization": f"token {token}"} if token else {}

    def call(
        self,
        method: str,
        url: str,
        token: str | None = None,
        body: Any = None,
        headers: dict[str, str] | None = None,
        timeout: float = 60.0,
        raw: bytes | str | None = None,
    ) -> tuple[int, Any]:
        """One HTTP call; returns (status, JSON or None) without raising on HTTP errors."""
        h = {**self._auth(token), **(headers or {})}
        data = raw
        if body is not None:
            h.setdefault("Content-Type", "application/json")
            data = json.dumps(body)
        r = self._session.request(method, url, headers=h, data=data, timeout=timeout, allow_redirects=False)
        try:
            return r.status_code, r.json() if r.content else None
        except ValueError:
            return r.status_code, {"raw": r.text}

    def hub(self, method: str, path: str, body: Any = None, timeout: float = 60.0) -> tuple[int, Any]:
        """The hub's REST API with the admin token."""
        return self.call(method, self.hub_api_url + path, self.admin_token, body, timeout=timeout)

    def broker(self, method: str, path: str, token: str | None, body: Any = None, **kw: Any) -> tuple[int, Any]:
        """The broker's REST API (``api/gpusched/<path>``) through the proxy."""
        return self.call(method, self.broker_url + "api/gpusched/" + path, token, body, **kw)

    def server(self, user: str, method: str, path: str, body: Any = None, token: str | None = None, **kw: Any):
        """A user's single-user server (``<server>/<path>``) through the proxy, as that user."""
        return self.call(method, self.server_url(user) + path, token or self.token(user), body, **kw)

    def server_url(self, user: str) -> str:
        return f"{self.public_url}user/{user}/"

    # -- users and servers ---------------------------------------------------------------------
    def create_users(self, names: Iterable[str]) -> None:
        names = list(names)
        code, data = self.hub("POST", "users", {"usernames": names})
        if code not in (201, 409):
            raise HubError(f"could not create users {names}: {code} {data}")

    def add_to_group(self, group: str, users: Iterable[str]) -> None:
        code, data = self.hub("POST", f"groups/{group}", {"users": list(users)})
        if code == 409:
            code, data = self.hub("POST", f"groups/{group}/users", {"users": list(users)})
        if code not in (200, 201):
            raise HubError(f"could not fill group {group}: {code} {data}")

    def token(self, user: str) -> str:
        """An API token of ``user`` (with all of the user's own permissions)."""
        token = self._tokens.get(user)
        if token is None:
            code, data = self.hub("POST", f"users/{user}/tokens", {"note": "gpusched test", "expires_in": 7200})
            if code != 201:
                raise HubError(f"could not make a token for {user}: {code} {data}")
            token = self._tokens[user] = data["token"]
        return token

    def start_server(self, user: str, timeout: float = 180.0) -> None:
        self.token(user)
        code, data = self.hub("POST", f"users/{user}/server")
        if code not in (201, 202, 400):
            raise HubError(f"could not start {user}'s server: {code} {data}\n{self.log_tail()}")

        self.wait_for(lambda: self._ready(user), timeout, f"{user}'s server", interval=0.5)

    def start_servers(self, users: Iterable[str], timeout: float = 240.0) -> None:
        """Start several users' servers at once and wait until all are ready."""
        users = list(users)
        for user in users:
            self.token(user)
            code, data = self.hub("POST", f"users/{user}/server")
            if code not in (201, 202, 400):
                raise HubError(f"could not start {user}'s server: {code} {data}\n{self.log_tail()}")
        for user in users:
            self.wait_for(lambda user=user: self._ready(user), timeout, f"{user}'s server", interval=0.5)

    def _ready(self, user: str) -> bool:
        _, model = self.hub("GET", f"users/{user}")
        server = (model or {}).get("servers", {}).get("")
        return bool(server and server.get("ready"))

    def stop_server(self, user: str, timeout: float = 120.0) -> None:
        code, data = self.hub("DELETE", f"users/{user}/server", timeout=timeout)
        if code not in (202, 204):
            raise HubError(f"could not stop {user}'s server: {code} {data}")

        def stopped() -> bool:
            _, model = self.hub("GET", f"users/{user}")
            return not (model or {}).get("servers", {}).get("")

        self.wait_for(stopped, timeout, f"{user}'s server to stop", interval=0.5)


class Kernel:
    """A real kernel on a user's server, driven over its websocket through the proxy."""

    def __init__(self, hub: Hub, user: str, kernel_id: str) -> None:
        import websocket as wsclient  # websocket-client, a jupyter_server dependency

        self.hub, self.user, self.id = hub, user, kernel_id
        url = hub.server_url(user).replace("http://", "ws://") + f"api/kernels/{kernel_id}/channels"
        self.ws = wsclient.create_connection(url, header=[f"Authorization: token {hub.token(user)}"], timeout=30)
        self.session = secrets.token_hex(8)
        self._replies: dict[str, dict] = {}

    def _send(self, msg_type: str, content: dict) -> str:
        msg_id = secrets.token_hex(8)
        self.ws.send(
            json.dumps(
                {
                    "header": {"msg_id": msg_id, "msg_type": msg_type, "username": self.user, "session": self.session,
                               "version": "5.3", "date": ""},
                    "parent_header": {}, "metadata": {}, "content": content, "channel": "shell", "buffers": [],
                }
            )
        )
        self._replies[msg_id] = {"stdout": "", "stderr": "", "error": None, "display": [], "done": False}
        return msg_id

    def _pump(self, timeout: float) -> None:
        import websocket as wsclient

        self.ws.settimeout(timeout)
        try:
            raw = self.ws.recv()
        except wsclient.WebSocketTimeoutException:
            return
        msg = json.loads(raw)
        out = self._replies.get((msg.get("parent_header") or {}).get("msg_id"))
        if out is None:
            return
        kind, content = msg["header"]["msg_type"], msg.get("content", {})
        if kind == "stream":
            out[content["name"]] += content["text"]
        elif kind == "error":
            out["error"] = f"{content['ename']}: {content['evalue']}"
        elif kind in ("display_data", "update_display_data", "execute_result"):
            out["display"].append(content.get("data", {}).get("text/plain", ""))
        elif kind == "status" and content.get("execution_state") == "idle":
            out["done"] = True
        elif kind == "kernel_info_reply":
            out["done"] = True

    def ready(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            msg_id = self._send("kernel_info_request", {})
            until = time.monotonic() + 3
            while time.monotonic() < until:
                self._pump(0.5)
                if self._replies[msg_id]["done"]:
                    return
        raise HubError(f"{self.user}'s kernel {self.id} did not answer in {timeout:.0f}s\n{self.hub.log_tail()}")

    def submit(self, code: str) -> str:
        """Start running ``code``; returns the request id for :meth:`result`."""
        return self._send("execute_request", {"code": code, "silent": False, "store_history": True, "allow_stdin": False})

    def result(self, msg_id: str, timeout: float = 120.0) -> dict:
        deadline = time.monotonic() + timeout
        out = self._replies[msg_id]
        while not out["done"]:
            if time.monotonic() > deadline:
                raise HubError(f"cell of {self.user}'s kernel did not finish in {timeout:.0f}s; so far {out}")
            self._pump(0.5)
        return out

    def done(self, msg_id: str) -> bool:
        self._pump(0.05)
        return self._replies[msg_id]["done"]

    def execute(self, code: str, timeout: float = 120.0) -> dict:
        return self.result(self.submit(code), timeout)

    def close(self) -> None:
        try:
            self.ws.close()
        except Exception:  # noqa: BLE001 - closing anyway
            pass


def start_kernel(hub: Hub, user: str, name: str = "gpu") -> Kernel:
    code, data = hub.server(user, "POST", "api/kernels", {"name": name})
    if code != 201:
        raise HubError(f"could not start a {name} kernel for {user}: {code} {data}\n{hub.log_tail()}")
    kernel = Kernel(hub, user, data["id"])
    kernel.ready()
    return kernel
