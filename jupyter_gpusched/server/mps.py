"""MPS control daemons, one per GPU, for the kernels of shared leases (``c.GPUSchedApp.mps``).

A kernel whose shared lease is on one GPU becomes a client of that GPU's MPS control daemon (its
``CUDA_MPS_PIPE_DIRECTORY``), with ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` set to its share: the
driver then refuses allocations beyond it; and ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` set to its
compute share, its memory share's part of the GPU in whole percent rounded up (see
``kernel/limits.py``, which sets both for the provisioner and the kernel agent). Each daemon is started with ``nvidia-cuda-mps-control
-d`` and the GPU's UUID in ``CUDA_VISIBLE_DEVICES`` (so clients name the GPU by UUID, as the
kernel agent does), its pipe and log directories under the server's runtime directory, and
stopped with ``quit`` on its standard input. The daemon starts an MPS server only when a first
client connects, so an idle daemon costs nothing on the GPU.

Never in hub mode: an MPS server runs as one Unix user, and the control daemon makes the clients
of another user wait until that server has no client left; kernels of different users cannot
share one MPS server. There (and wherever MPS is off or absent) the frameworks' own limits are
all a shared lease gets, and the kernels are told why (:meth:`MPS.info`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

log = logging.getLogger("jupyter_gpusched.mps")

CONTROL = "nvidia-cuda-mps-control"
#: What each daemon is given to start or stop, in seconds.
TIMEOUT = 15.0
MODES = ("auto", "off")


@dataclass(frozen=True)
class Daemon:
    """One GPU's control daemon: where its pipes and logs are."""

    uuid: str
    pipe_directory: str
    log_directory: str

    def environment(self, base: Mapping[str, str]) -> dict[str, str]:
        """The daemon's environment: ``base`` with its GPU and its directories."""
        env = dict(base)
        env.update(
            {
                "CUDA_VISIBLE_DEVICES": self.uuid,
                "CUDA_MPS_PIPE_DIRECTORY": self.pipe_directory,
                "CUDA_MPS_LOG_DIRECTORY": self.log_directory,
            }
        )
        return env

    @property
    def pid_file(self) -> str:
        return os.path.join(self.pipe_directory, f"{CONTROL}.pid")


#: The longest socket name the daemon makes in its pipe directory, and the most a Unix socket's
#: path may hold (``sun_path``: 108 bytes with its final NUL).
LONGEST_SOCKET = "control_privileged"
MAX_SOCKET_PATH = 107


#: What a private pipe folder's name begins with (``tempfile.mkdtemp`` adds 8 random characters).
SHORT_PREFIX = "gpusched-mps-"


def short_root() -> str:
    """A new folder of this user's for the daemons' pipes, with a short path (in the temp directory).

    Made by :func:`tempfile.mkdtemp`: 0700, under a name nobody can guess, and made by this call
    alone (it fails rather than take a folder that exists), so another user cannot make it first
    nor point it elsewhere. Where the temp directory's own path is too long for the sockets,
    ``/tmp``. Checked once more after it is made: a link, a folder not this user's or open to
    others is refused.
    """
    # The longest path the daemon binds: the folder, a GPU's digest, "pipe" and its socket.
    room = len(os.path.join(SHORT_PREFIX + "x" * 8, "x" * 12, "pipe", LONGEST_SOCKET)) + 1
    bases = [b for b in dict.fromkeys((tempfile.gettempdir(), "/tmp")) if len(b) + room <= MAX_SOCKET_PATH]
    if not bases:
        raise OSError(f"the temp directory {tempfile.gettempdir()} has too long a path for the MPS pipes' sockets")
    root = tempfile.mkdtemp(prefix=SHORT_PREFIX, dir=bases[0])
    info = os.lstat(root)
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise OSError(f"{root} is not a private folder of this user's; the MPS pipes cannot go there")
    return root


class MPS:
    """The server's MPS daemons.

    Args:
        setting: ``"auto"`` (daemons where ``nvidia-cuda-mps-control`` is on PATH) or ``"off"``.
        root: the folder for each GPU's pipe and log directories (under the runtime directory).
        hub: this server asks a hub's broker for GPUs (no MPS then; see the module's docstring).
        backend: the GPU backend's name (MPS only for real GPUs).
        which: finds the program on PATH.
        environ: the environment the daemons start from.
    """

    def __init__(
        self,
        setting: str,
        root: str,
        *,
        hub: bool = False,
        backend: str = "nvml",
        which=shutil.which,
        environ: Mapping[str, str] | None = None,
    ):
        self.setting = setting
        self.root = root
        self.environ = dict(os.environ if environ is None else environ)
        self.daemons: dict[str, Daemon] = {}
        self.control: str | None = None
        #: The private folder for the pipes where ``root`` is too deep for sockets (made once).
        self.short_root: str | None = None
        if setting == "off":
            self.state, self.reason = "off", "MPS is off (c.GPUSchedApp.mps = 'off')"
        elif hub:
            self.state = "hub"
            self.reason = (
                "no MPS in hub mode: one MPS server cannot serve kernels of different users"
            )
        else:
            self.control = which(CONTROL)
            if self.control is None:
                self.state, self.reason = "absent", f"no MPS on this host: {CONTROL} is not on PATH"
            elif backend != "nvml":
                self.state, self.reason = "unavailable", f"no MPS for {backend} GPUs"
                self.control = None
            else:
                self.state, self.reason = "starting", "the MPS daemons are starting"

    @property
    def wanted(self) -> bool:
        """Whether daemons are to be started (MPS on, its program found, real GPUs)."""
        return self.control is not None

    def daemon_for(self, uuid: str) -> Daemon:
        """Where ``uuid``'s daemon keeps its pipes and logs.

        A short digest names each GPU's folder: the pipe directory holds Unix sockets, whose
        paths must stay under about 100 bytes.
        """
        name = hashlib.sha256(uuid.encode()).hexdigest()[:12]
        base = os.path.join(self.root, name)
        if len(os.path.join(base, "pipe", LONGEST_SOCKET)) > MAX_SOCKET_PATH:
            # A deep runtime directory: the daemon could not bind its sockets there.
            try:
                if self.short_root is None:
                    self.short_root = short_root()
                base = os.path.join(self.short_root, name)
            except OSError as err:
                log.warning("MPS: %s", err)
        return Daemon(uuid, os.path.join(base, "pipe"), os.path.join(base, "log"))

    def start_command(self) -> list[str]:
        return [self.control or CONTROL, "-d"]

    def stop_command(self) -> tuple[list[str], bytes]:
        """The command and its standard input (``echo quit | nvidia-cuda-mps-control``)."""
        return [self.control or CONTROL], b"quit\n"

    def running(self, daemon: Daemon) -> bool:
        """Whether a control daemon already serves ``daemon``'s pipe directory."""
        try:
            with open(daemon.pid_file, encoding="ascii") as fh:
                pid = int(fh.read().strip())
            os.kill(pid, 0)
        except (OSError, ValueError):
            return False
        return True

    def start(self, uuids: Iterable[str]) -> None:
        """Start a control daemon for each GPU (blocking: run it off the event loop)."""
        if not self.wanted:
            log.info("GPU scheduler: %s; shared leases get the frameworks' own memory limits", self.reason)
            return
        failed: list[str] = []
        for uuid in uuids:
            daemon = self.daemon_for(uuid)
            try:
                for folder in (daemon.pipe_directory, daemon.log_directory):
                    os.makedirs(folder, mode=0o700, exist_ok=True)
                if self.running(daemon):
                    log.info("MPS control daemon for %s already runs (%s)", uuid, daemon.pipe_directory)
                    self.daemons[uuid] = daemon
                    continue
                done = subprocess.run(
                    self.start_command(),
                    env=daemon.environment(self.environ),
                    capture_output=True,
                    timeout=TIMEOUT,
                    check=False,
                )
            except (OSError, subprocess.SubprocessError) as err:
                failed.append(f"{uuid}: {err}")
                continue
            if done.returncode != 0:
                said = (done.stderr or done.stdout or b"").decode(errors="replace").strip()
                failed.append(f"{uuid}: exit {done.returncode}{': ' + said if said else ''}")
                continue
            log.info("MPS control daemon started for %s (%s)", uuid, daemon.pipe_directory)
            self.daemons[uuid] = daemon
        if failed:
            log.warning("MPS control daemons failed to start: %s", "; ".join(failed))
        if self.daemons:
            self.state = "running"
            self.reason = f"MPS control daemons for {len(self.daemons)} GPU(s)"
            if failed:
                self.reason += f" ({len(failed)} failed to start)"
        else:
            self.state = "failed"
            self.reason = "the MPS control daemons failed to start: " + ("; ".join(failed) or "no GPUs")

    def stop(self) -> None:
        """Tell each daemon to quit (blocking). Its MPS server ends once its clients have."""
        command, stdin = self.stop_command()
        stopped = list(self.daemons)
        for uuid, daemon in list(self.daemons.items()):
            try:
                done = subprocess.run(
                    command,
                    input=stdin,
                    env=daemon.environment(self.environ),
                    capture_output=True,
                    timeout=TIMEOUT,
                    check=False,
                )
                if done.returncode != 0:
                    log.warning("MPS control daemon for %s did not quit: exit %s", uuid, done.returncode)
            except (OSError, subprocess.SubprocessError) as err:
                log.warning("MPS control daemon for %s did not quit: %s", uuid, err)
            self.daemons.pop(uuid, None)
        if self.state == "running":
            self.state, self.reason = "stopped", "the MPS control daemons were stopped"
        if self.short_root is not None and not any(self.running(self.daemon_for(u)) for u in stopped):
            shutil.rmtree(self.short_root, ignore_errors=True)
            self.short_root = None

    def info(self) -> dict:
        """What kernels are told (``JUPYTER_GPUSCHED_MPS``; see ``kernel.limits.MpsInfo``)."""
        return {
            "state": self.state,
            "reason": self.reason,
            "daemons": {
                uuid: {"pipe": d.pipe_directory, "log": d.log_directory} for uuid, d in self.daemons.items()
            },
        }
