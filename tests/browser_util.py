"""A real ``jupyter lab`` process on simulated GPUs, and JupyterLab page helpers for Playwright."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
KERNEL_NAME = "python3-gpu"
KERNEL_DISPLAY_NAME = "Python 3 (1 GPU)"


def chromium_path() -> str | None:
    """The Chromium the browser tests drive, or ``None`` if there is none."""
    if os.access(CHROMIUM, os.X_OK):
        return CHROMIUM
    return shutil.which("chromium") or shutil.which("chromium-browser")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.25) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail saying ``what`` never happened."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while True:
        try:
            value = predicate()
            if value:
                return value
        except (OSError, ValueError, KeyError) as err:
            last_error = err
        if time.monotonic() > deadline:
            extra = f" (last error: {last_error})" if last_error else ""
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}{extra}")
        time.sleep(interval)


class LabServer:
    """``jupyter lab`` with the extension on simulated GPUs and a ``python3-gpu`` kernelspec.

    Everything it writes (runtime files, settings, workspaces, the ledger, notebooks) stays under
    ``root``. ``extra`` adds command-line options (e.g. short reclaim timeouts). ``app`` is the
    module started: ``jupyterlab`` (``jupyter lab``) or ``notebook`` (``jupyter notebook``, 7).
    """

    def __init__(
        self, root: Path, extra: tuple[str, ...] = (), devices: int = 2, app: str = "jupyterlab"
    ) -> None:
        self.root = Path(root)
        self.notebooks = self.root / "notebooks"
        self.notebooks.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.token = "browser-test-token"
        self.url = f"http://127.0.0.1:{self.port}/"
        env = dict(os.environ)
        env.update(
            JUPYTER_RUNTIME_DIR=str(self.root / "runtime"),
            JUPYTER_CONFIG_DIR=str(self.root / "config"),
            JUPYTER_DATA_DIR=str(self.root / "data"),
            JUPYTER_PLATFORM_DIRS="1",
        )
        env.pop("JUPYTER_PATH", None)
        self.env = env
        self._install_kernelspec()
        self._quiet_lab()
        self.log_path = self.root / "jupyterlab.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [
                sys.executable, "-m", app,
                f"--port={self.port}", "--ip=127.0.0.1", "--no-browser", "--allow-root",
                f"--IdentityProvider.token={self.token}",
                f"--ServerApp.root_dir={self.notebooks}",
                "--GPUSchedApp.backend=simulated",
                f"--GPUSchedApp.simulated_devices={devices}",
                f"--GPUSchedApp.ledger_path={self.root / 'ledger.sqlite'}",
                "--GPUSchedApp.poll_interval=0.5",
                *extra,
            ],
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            wait_for(self._up, 90, f"JupyterLab on port {self.port} to answer")
        except AssertionError:
            self.stop()
            raise AssertionError(f"{app} did not start; its log:\n{self.log_text()}") from None

    # -- setup ------------------------------------------------------------------------------
    def _install_kernelspec(self) -> None:
        """The kernelspec a user would install: ``jupyter gpusched kernelspec install``."""
        subprocess.run(
            [
                sys.executable, "-m", "jupyter_gpusched.cli", "kernelspec", "install",
                "--name", KERNEL_NAME, "--gpus", "1", "--bind", "lazy",
                "--display-name", KERNEL_DISPLAY_NAME,
                "--prefix", str(self.root / "prefix"),
            ],
            env=self.env,
            check=True,
            capture_output=True,
        )
        self.env["JUPYTER_PATH"] = str(self.root / "prefix" / "share" / "jupyter")
        spec = self.root / "prefix" / "share" / "jupyter" / "kernels" / KERNEL_NAME / "kernel.json"
        assert spec.exists(), f"kernelspec install wrote nothing at {spec}"
        self._serve_checkout_frontend()

    def _serve_checkout_frontend(self) -> None:
        """Serve the lab extension as built in this checkout (``jlpm build:prod`` writes it to
        ``jupyter_gpusched/labextension``), not a copy an earlier ``pip install`` left in the
        environment: JupyterLab takes the first extension of a name along ``JUPYTER_PATH``."""
        built = ROOT / "jupyter_gpusched" / "labextension"
        if not (built / "package.json").exists():
            return  # not built here: the installed copy is what there is
        where = self.root / "prefix" / "share" / "jupyter" / "labextensions"
        where.mkdir(parents=True, exist_ok=True)
        name = json.loads((built / "package.json").read_text())["name"]
        (where / name).symlink_to(built, target_is_directory=True)

    def _quiet_lab(self) -> None:
        """No news or update checks: they would need the network and cover the notifications."""
        labconfig = self.root / "config" / "labconfig"
        labconfig.mkdir(parents=True, exist_ok=True)
        (labconfig / "page_config.json").write_text(
            json.dumps({"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True}})
        )

    def _up(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"JupyterLab exited with {self.proc.returncode}:\n{self.log_text()}")
        try:
            self.call("GET", "api/gpusched/status")
            return True
        except (OSError, urllib.error.HTTPError):
            return False

    # -- REST -------------------------------------------------------------------------------
    def call(self, method: str, path: str, body: Any = None) -> Any:
        req = urllib.request.Request(
            self.url + path,
            data=None if body is None else json.dumps(body).encode(),
            method=method,
            headers={"Authorization": f"token {self.token}", "Content-Type": "application/json"},
        )
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(req, timeout=30) as resp:
            raw = resp.read()
            return json.loads(raw) if raw else None

    def status(self) -> dict:
        return self.call("GET", "api/gpusched/status")

    def kernels(self) -> list[dict]:
        return self.call("GET", "api/kernels")

    def sessions(self) -> list[dict]:
        return self.call("GET", "api/sessions")

    def kernel_of(self, notebook: str) -> str | None:
        """The id of the kernel of the session whose path is ``notebook``."""
        for session in self.sessions():
            if session.get("path") == notebook and session.get("kernel"):
                return session["kernel"]["id"]
        return None

    def lease_of(self, kernel_id: str) -> dict | None:
        for lease in self.status()["leases"]:
            if lease["kernel_id"] == kernel_id and lease["state"] != "released":
                return lease
        return None

    def page_url(self, workspace: str) -> str:
        return f"{self.url}lab/workspaces/{workspace}?reset&token={self.token}"

    def log_text(self) -> str:
        try:
            self.log.flush()
        except ValueError:
            pass
        return self.log_path.read_text(errors="replace")[-6000:]

    # -- teardown ---------------------------------------------------------------------------
    def stop(self) -> None:
        """Shut every kernel down, then the server; kill what does not stop."""
        if self.proc.poll() is None:
            try:
                for kernel in self.kernels():
                    try:
                        self.call("DELETE", f"api/kernels/{kernel['id']}")
                    except OSError:
                        pass
            except OSError:
                pass
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        # Kernels run in sessions of their own and exit when the server they poll is gone.
        self.log.close()


# -- fixtures shared by the browser test modules (import them there) ---------------------------
# pytest-jupyter's autouse fixtures make and close an asyncio loop around every test; Playwright's
# sync API runs its own loop in this thread, which they would close. Nothing here needs theirs:
# the server under test is a separate process.
@pytest.fixture(autouse=True)
def jp_asyncio_loop():
    yield None


@pytest.fixture(autouse=True)
def jp_server_cleanup():
    yield


@pytest.fixture(scope="module")
def chromium() -> str:
    path = chromium_path()
    if path is None:
        pytest.skip(
            "Chromium not found at /usr/bin/chromium even after scripts/test.d/10-chromium.sh "
            "(it installs it with apt-get as root): cannot drive JupyterLab in a browser"
        )
    return path


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    """Where screenshots go: ``docs/screenshots`` (the README shows them) when
    ``GPUSCHED_UPDATE_SCREENSHOTS=1``, else a temporary directory."""
    if os.environ.get("GPUSCHED_UPDATE_SCREENSHOTS") == "1":
        where = ROOT / "docs" / "screenshots"
        where.mkdir(parents=True, exist_ok=True)
        return where
    return tmp_path_factory.mktemp("screenshots")


@contextlib.contextmanager
def browser_page(chromium: str, width: int = 1400, height: int = 900):
    """A fresh Chromium page (Playwright's sync API)."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:  # pragma: no cover - the test extra and the setup script install it
        pytest.fail("playwright is not installed: pip install playwright (never `playwright install`)")
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(viewport={"width": width, "height": height})
            context.set_default_timeout(30_000)
            yield context.new_page()
            context.close()
        finally:
            browser.close()


def toasts(page, has_text):
    """The notifications on screen whose text matches ``has_text`` (a string or a pattern)."""
    return page.locator(".jp-toastContainer .Toastify__toast").filter(has_text=has_text)


# -- JupyterLab page helpers --------------------------------------------------------------------
def open_lab(page, server: LabServer, workspace: str) -> None:
    """Open a fresh workspace and wait until the launcher is on screen."""
    page.goto(server.page_url(workspace))
    page.locator(".jp-Launcher").first.wait_for(state="visible", timeout=90_000)


def new_gpu_notebook(page, server: LabServer, name: str) -> str:
    """Create a notebook from the launcher with the GPU kernel and rename it to ``name``.

    Returns its kernel id once the kernel is idle with a connection: before that an early
    Shift+Enter can be dropped.
    """
    before = {s["id"] for s in server.sessions()}
    if page.locator(".jp-Launcher:visible").count() == 0:
        page.locator(".lm-DockPanel-tabBar .lm-TabBar-addButton").first.click()
    launcher = page.locator(".jp-Launcher:visible")
    launcher.wait_for(timeout=30_000)
    card = launcher.locator('.jp-LauncherCard[data-category="Notebook"]').filter(
        has_text=KERNEL_DISPLAY_NAME
    )
    card.first.click()
    session = wait_for(
        lambda: next((s for s in server.sessions() if s["id"] not in before and s.get("kernel")), None),
        60,
        "the new notebook's session",
    )
    kernel_id = session["kernel"]["id"]
    page.locator(".jp-NotebookPanel:visible .jp-Notebook").wait_for(timeout=30_000)
    if session["path"] != name:
        rename_current(page, name)
        wait_for(lambda: server.kernel_of(name) == kernel_id, 30, f"the session to follow {name}")
    wait_for(
        lambda: any(
            k["id"] == kernel_id and k["execution_state"] == "idle" and k.get("connections", 0) >= 1
            for k in server.kernels()
        ),
        90,
        f"the kernel of {name} to be idle and connected",
    )
    return kernel_id


def rename_current(page, name: str) -> None:
    """File > Rename Notebook..., as a user renames the notebook in front of them."""
    page.locator(".lm-MenuBar-itemLabel", has_text="File").click()
    page.locator(".lm-Menu-itemLabel", has_text="Rename Notebook").click()
    field = page.locator(".jp-Dialog input")
    field.fill(name)
    page.locator(".jp-Dialog .jp-mod-accept").click()
    page.locator(".jp-Dialog").wait_for(state="detached", timeout=10_000)
    page.locator(f'.lm-DockPanel-tabBar .lm-TabBar-tab.lm-mod-current:has-text("{name}")').wait_for(
        timeout=10_000
    )


def activate(page, name: str) -> None:
    """Bring the notebook tab ``name`` to the front."""
    page.locator(".lm-DockPanel-tabBar .lm-TabBar-tab", has_text=name).first.click()
    page.locator(f'.lm-DockPanel-tabBar .lm-TabBar-tab.lm-mod-current:has-text("{name}")').wait_for(
        timeout=10_000
    )


def run_cell(page, code: str) -> None:
    """Type ``code`` into the active notebook's last cell and run it with Shift+Enter."""
    notebook = page.locator(".jp-NotebookPanel:visible")
    cell = notebook.locator(".jp-Cell").last
    editor = cell.locator(".cm-content")
    editor.click()
    page.keyboard.press("ControlOrMeta+a")
    page.keyboard.type(code)
    page.keyboard.press("Shift+Enter")
