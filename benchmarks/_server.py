"""A real ``jupyter server`` with the GPU scheduler on simulated GPUs, for the REST benchmarks.

The server runs as a subprocess in a throwaway Jupyter home (runtime, config and data dirs, the
ledger and the log all under one temporary directory), with two kernelspecs of our own beside the
stock ``python3``: ``gpusched-lazy`` and ``gpusched-launch`` (``gpusched-provisioner``, 1 GPU).
:class:`Connection` is a small keep-alive HTTP/1.1 client on asyncio streams: one per simulated
user, so that what a benchmark measures is the server rather than connection setup.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

TOKEN = "benchmark-token"

#: Kernelspecs written into the server's data dir: name -> provisioner config.
GPU_KERNELSPECS = {
    "gpusched-lazy": {"gpus": 1, "bind": "lazy"},
    "gpusched-launch": {"gpus": 1, "bind": "launch"},
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank ``q`` percentile (0-100) of ``values``; NaN when there are none."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def jsonable(value):
    """``value`` with NaN (a percentile of no samples) as None, so that the output is strict JSON."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


class JupyterServer:
    """``python -m jupyter_server`` with ``jupyter_gpusched`` enabled, in its own temporary home.

    Args:
        gpus: simulated GPUs.
        extra_args: more command-line options, e.g. ``--GPUSchedApp.poll_interval=1``.
        keep: leave the temporary directory (log, ledger) in place after :meth:`stop`.
        profile: run the server under cProfile and write its stats there (the event loop's
            thread only; work sent to threads is not in it).
    """

    def __init__(
        self, gpus: int, extra_args: list[str] | None = None, keep: bool = False, profile: str | None = None
    ) -> None:
        self.gpus = gpus
        self.keep = keep
        self.home = Path(tempfile.mkdtemp(prefix="gpusched-bench-"))
        self.ledger_path = self.home / "ledger.sqlite"
        self.log_path = self.home / "server.log"
        self.port = free_port()
        self.token = TOKEN
        self.url = f"http://127.0.0.1:{self.port}"
        self.extra_args = list(extra_args or [])
        self.profile = os.path.abspath(profile) if profile else None
        self.proc: subprocess.Popen | None = None
        self._log = None
        self._write_kernelspecs()

    def _write_kernelspecs(self) -> None:
        for name, config in GPU_KERNELSPECS.items():
            spec_dir = self.home / "data" / "kernels" / name
            spec_dir.mkdir(parents=True, exist_ok=True)
            spec = {
                "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": f"Python ({name})",
                "language": "python",
                "metadata": {"kernel_provisioner": {"provisioner_name": "gpusched-provisioner", "config": config}},
            }
            (spec_dir / "kernel.json").write_text(json.dumps(spec, indent=1))

    def start(self, timeout: float = 90.0) -> float:
        """Start the server and wait until the scheduler answers; returns the seconds it took."""
        env = dict(os.environ)
        for var, sub in (("JUPYTER_RUNTIME_DIR", "runtime"), ("JUPYTER_CONFIG_DIR", "config"),
                         ("JUPYTER_DATA_DIR", "data")):
            env[var] = str(self.home / sub)
        python = [sys.executable, "-m", "cProfile", "-o", self.profile] if self.profile else [sys.executable]
        argv = [
            *python, "-m", "jupyter_server",
            f"--port={self.port}", "--ip=127.0.0.1", "--no-browser", "--allow-root",
            f"--IdentityProvider.token={self.token}",
            f"--ServerApp.root_dir={self.home}",
            "--ServerApp.jpserver_extensions={'jupyter_gpusched': True}",
            "--GPUSchedApp.backend=simulated",
            f"--GPUSchedApp.simulated_devices={self.gpus}",
            f"--GPUSchedApp.ledger_path={self.ledger_path}",
            *self.extra_args,
        ]
        started = time.perf_counter()
        self._log = open(self.log_path, "w")  # noqa: SIM115 - the server writes to it until stop()
        self.proc = subprocess.Popen(
            argv, env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}; see {self.log_path}")
            try:
                self.call("GET", "/api/gpusched/status")
                return time.perf_counter() - started
            except (OSError, urllib.error.URLError):
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"the server did not answer within {timeout:g}s; see {self.log_path}")

    def call(self, method: str, path: str, body=None, timeout: float = 60.0):
        """A blocking request; returns ``(status, parsed JSON or None)``."""
        req = urllib.request.Request(
            self.url + path,
            data=None if body is None else json.dumps(body).encode(),
            method=method,
            headers={"Authorization": f"token {self.token}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
            return resp.status, json.loads(raw) if raw else None

    def stop(self, timeout: float = 60.0) -> float:
        """SIGTERM, wait (the server shuts its kernels down), SIGKILL if it hangs; returns seconds."""
        started = time.perf_counter()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        if self._log is not None:
            self._log.close()
            self._log = None
        return time.perf_counter() - started

    def cleanup(self) -> bool:
        """Remove the temporary home unless ``keep`` or the log shows errors; True if removed."""
        if self.keep or self.log_has_errors():
            return False
        shutil.rmtree(self.home, ignore_errors=True)
        return True

    def log_has_errors(self) -> bool:
        return any(text.startswith(("[E", "[C", "Traceback")) or "died" in text for text, _ in self.log_findings())

    def log_findings(self) -> list[tuple[str, int]]:
        """Warnings, errors and tracebacks from the server log, as (message, count), most first.

        Timestamps and ids (kernel, lease, hex) are blanked so that repeats of one message count
        together.
        """
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return []
        found: Counter[str] = Counter()
        for line in lines:
            if "received signal 15, stopping" in line:
                continue  # our own SIGTERM in stop()
            if re.match(r"\[[WEC] ", line) or line.startswith("Traceback") or re.match(r"\w*(Error|Exception):", line):
                text = re.sub(r"^\[([WEC]) [\d\-: .]+", r"[\1 ", line)
                text = re.sub(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", "<id>", text)
                text = re.sub(r"\b[0-9a-f]{12,}\b", "<hex>", text)
                text = re.sub(r"\d+(\.\d+)?ms", "<t>ms", text)
                found[text[:300]] += 1
        return found.most_common()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None


class Connection:
    """One keep-alive HTTP/1.1 connection to the server, for one request at a time."""

    def __init__(self, host: str, port: int, token: str) -> None:
        self.host = host
        self.port = port
        self._head = (
            f"Host: {host}:{port}\r\nAuthorization: token {token}\r\n"
            "Content-Type: application/json\r\nConnection: keep-alive\r\n"
        )
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    @classmethod
    def to(cls, server: JupyterServer) -> Connection:
        return cls("127.0.0.1", server.port, server.token)

    async def _connect(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)

    async def request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        """Send one request and read the whole response; returns ``(status, body)``."""
        if self.writer is None:
            await self._connect()
        payload = body or b""
        self.writer.write(
            f"{method} {path} HTTP/1.1\r\n{self._head}Content-Length: {len(payload)}\r\n\r\n".encode() + payload
        )
        status_line = await self.reader.readline()
        if not status_line:
            # The server closed an idle connection: reconnect once and resend.
            await self.close()
            return await self.request(method, path, body)
        status = int(status_line.split()[1])
        length, chunked, close = None, False, False
        while True:
            line = await self.reader.readline()
            if line in (b"\r\n", b"\n", b""):
                break
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"transfer-encoding" and b"chunked" in value.lower():
                chunked = True
            elif name == b"connection" and value.strip().lower() == b"close":
                close = True
        if chunked:
            parts = []
            while True:
                size = int((await self.reader.readline()).split(b";")[0], 16)
                if size == 0:
                    await self.reader.readline()
                    break
                parts.append(await self.reader.readexactly(size))
                await self.reader.readline()
            data = b"".join(parts)
        elif length:
            data = await self.reader.readexactly(length)
        else:
            data = b""
        if close:
            await self.close()
        return status, data

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            try:
                await self.writer.wait_closed()
            except OSError:
                pass
        self.reader = self.writer = None


def print_log_findings(server: JupyterServer, limit: int = 12, file=sys.stdout) -> None:
    found = server.log_findings()
    if not found:
        print("server log: no warnings or errors", file=file)
        return
    total = sum(n for _, n in found)
    print(f"server log: {total} warning/error lines ({len(found)} distinct):", file=file)
    for text, n in found[:limit]:
        print(f"  {n:>6} x {text}", file=file)
    if server.keep or server.log_has_errors():
        print(f"  full log (kept): {server.log_path}", file=file)
