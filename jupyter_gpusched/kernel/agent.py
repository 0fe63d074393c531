"""The kernel agent: binds the kernel to its lease, resumes it, and tells the user what happens.

It runs inside the kernel process. A ``pre_run_cell`` hook acquires a GPU before the first cell
(lazy binding) and restores a checkpointed kernel before its next cell; a daemon thread watches
the kernel's lease and shows notices (reclaim countdowns, checkpoints, lost GPUs). Neither ever
executes code in the kernel: the watcher only reads the server and publishes display messages, so
the kernel never looks busy because of it.

:class:`Agent` builds the parts and installs them: :mod:`.settings` (the kernelspec's defaults),
:mod:`.lease` (the lease as last read, with its lock, and the reader that fills it), :mod:`.output`
(where lines go), :mod:`.binding` (``CUDA_VISIBLE_DEVICES``), :mod:`.limits` (a shared lease's
memory share), :mod:`.claims` (acquire, wait, release, keep), :mod:`.hooks` (before each cell),
:mod:`.watcher` (the polling thread) and :mod:`.notices` (what to say about a change). Each part
is handed only what it uses (the client, the cache, ``say``, a clock), never the agent.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from . import cuda as _cuda
from .binding import Binding
from .claims import Claims, WaitCancelled
from .client import Client, GPUSchedError, NoServerError
from .hooks import AUTO_RETRY_AFTER, CellNotRun, Hooks
from .lease import LeaseCache, LeaseReader
from .limits import Keeper
from .output import DisplayFn, Output
from .output import ipython_display as _ipython_display
from .settings import ENV_BIND, ENV_GPUS, ENV_MEMORY, ENV_MODE, ENV_POLL, MODES, Settings
from .states import DISRUPTIVE_STEPS, LIVE
from .watcher import WATCH_FAILURES_BEFORE_NOTICE, Watcher

# Names the magics, the Python API and the tests import from here, wherever they live now.
__all__ = ["Agent", "CellNotRun", "Settings", "WaitCancelled", "existing_agent", "get_agent"]
__all__ += ["load_ipython_extension", "unload_ipython_extension", "GPUSchedError", "MODES"]
__all__ += ["ENV_BIND", "ENV_GPUS", "ENV_MEMORY", "ENV_MODE", "ENV_POLL", "DISRUPTIVE_STEPS"]
__all__ += ["AUTO_RETRY_AFTER", "WATCH_FAILURES_BEFORE_NOTICE", "DisplayFn"]

log = logging.getLogger("jupyter_gpusched.kernel")

#: Set in kernels of a server that runs simulated GPUs (devices.simulated.STATE_ENV).
_SIM_STATE_ENV = "JUPYTER_GPUSCHED_SIM_STATE"


def _kernel_id_from_connection_file() -> str | None:
    try:
        from ipykernel.connect import get_connection_file

        name = os.path.basename(get_connection_file())
    except Exception:  # noqa: BLE001 - not an ipykernel (a terminal IPython, say)
        return None
    match = re.match(r"^kernel-(.+)\.json$", name)
    return match.group(1) if match else None


class Agent:
    """Everything the kernel side does for one IPython shell.

    Args:
        shell: the IPython shell (``None`` outside IPython: no hooks, no notices in cells).
        settings: the kernelspec's defaults; read from the environment when not given.
        client: the HTTP client; found from the environment or the server's runtime files on
            first use when not given.
        cuda_probe: tells whether CUDA is initialized in this process (see ``cuda.probe``).
        free_caches: drops framework caches for the ``free-cache`` reclaim step.
        display: ``display(text, html, display_id, update)`` for everything shown in cells.
        clock: wall-clock seconds (the server's times are wall-clock).
    """

    def __init__(
        self,
        shell: Any = None,
        *,
        settings: Settings | None = None,
        client: Client | None = None,
        environ: Mapping[str, str] | None = None,
        cuda_probe: Callable[[], _cuda.CudaState] = _cuda.probe,
        free_caches: Callable[[], list[str]] = _cuda.free_framework_caches,
        display: DisplayFn | None = None,
        clock: Callable[[], float] = time.time,
    ):
        self.shell = shell
        self.environ = os.environ if environ is None else environ
        self.settings = settings or Settings.from_environment(self.environ)
        self._client = client
        #: Replaceable (tests do); the parts call these through the agent.
        self.cuda_probe = cuda_probe
        self.free_caches = free_caches
        self.clock = clock
        #: Guards finding the server.
        self._lock = threading.RLock()
        self._no_scheduler: str | None = None
        self._said_no_scheduler = False
        self._installed = False
        self._magics: Any = None
        self.panel_obj: Any = None

        #: Where lines go: the display function and the cell they belong to.
        self.output = Output(shell, display or _ipython_display)
        #: The lease as last read, and what this kernel did to it (shared with the watcher thread).
        self.leases = LeaseCache(self._now)
        self.limits = Keeper(self.environ, self._devices)
        self.binding = Binding(self.environ, self.limits, self._probe_cuda, self.say, self.settings.provisioned)
        self.watcher = Watcher(
            leases=self.leases,
            settings=self.settings,
            read=self.refresh,
            connected=self._connected,
            unbind=self.binding.unbind,
            free_caches=self._free_caches,
            client=self._get_client,
            say=self.say,
            clock=self._now,
        )
        self.reader = LeaseReader(
            client=self._get_client,
            leases=self.leases,
            report=self.watcher.report,
            connected=self._connected,
            max_age=self._max_age,
            clock=self._now,
        )
        self.claims = Claims(
            client=self._get_client,
            leases=self.leases,
            settings=self.settings,
            binding=self.binding,
            refresh=self.refresh,
            status=self.status,
            start_watcher=self.start_watcher,
            say=self.say,
            display=self.output.show,
            cuda_probe=self._probe_cuda,
            free_caches=self._free_caches,
            clock=self._now,
        )
        self.hooks = Hooks(
            leases=self.leases,
            claims=self.claims,
            binding=self.binding,
            settings=self.settings,
            current=self.reader.current,
            refresh=self.refresh,
            start_watcher=self.start_watcher,
            note_cell=self.output.note_cell,
            say=self.say,
            clock=self._now,
        )

    # The parts are handed these, so that a replaced clock, probe or client reaches them all.
    def _now(self) -> float:
        return self.clock()

    def _probe_cuda(self) -> _cuda.CudaState:
        return self.cuda_probe()

    def _free_caches(self) -> list[str]:
        return self.free_caches()

    def _get_client(self) -> Client:
        return self.client

    def _devices(self) -> Any:
        return self.client.devices()

    # -- identity and transport --------------------------------------------------------------
    @property
    def client(self) -> Client:
        """The HTTP client (raises NoServerError if no server with the extension is found).

        The search happens once: a kernel without a scheduler stays without one, and every
        later call says so with the same message.
        """
        with self._lock:
            if self._client is None:
                if self._no_scheduler is not None:
                    raise NoServerError(self._no_scheduler)
                client = Client.from_environment(self.environ)
                if client is None:
                    try:
                        client = Client.discover(kernel_id=_kernel_id_from_connection_file())
                    except NoServerError as err:
                        self._no_scheduler = err.message
                        log.info("no GPU scheduler for this kernel: %s", err.message)
                        raise
                self._client = client
            return self._client

    @property
    def has_scheduler(self) -> bool:
        """Whether a GPU scheduler serves this kernel (found on first use; never raises)."""
        try:
            self.client
        except NoServerError:
            return False
        return True

    def say_no_scheduler(self, what: str = "it has no GPU") -> None:
        """Say that this kernel has no GPU scheduler: why, the first time; briefly after that."""
        if not self._said_no_scheduler and self._no_scheduler:
            self._said_no_scheduler = True
            self.say(f"No GPU scheduler for this kernel, so {what}. {self._no_scheduler}")
        else:
            self.say(f"No GPU scheduler for this kernel, so {what}.")

    @property
    def kernel_id(self) -> str | None:
        return self.client.kernel_id

    def _connected(self) -> bool:
        """Whether talking to the server is expected (without discovering it now)."""
        return self._client is not None or self.settings.provisioned

    # -- lease cache --------------------------------------------------------------------------
    @property
    def lease(self) -> dict | None:
        """The last known lease of this kernel (may be a few seconds old)."""
        return self.leases.lease

    def refresh(self) -> dict | None:
        """Read this kernel's lease from the server (``GET api/gpusched/leases?kernel_id=``)."""
        return self.reader.refresh()

    def _max_age(self) -> float:
        return max(2 * self.settings.poll, 5.0) if self.watching else self.settings.poll

    # -- output -------------------------------------------------------------------------------
    def say(
        self, text: str, html_text: str | None = None, display_id: str | None = None, update: bool = False
    ) -> None:
        """Show a line in the cell that is running (or, from the watcher, the last one that ran)."""
        self.output.say(text, html_text, display_id, update)

    # -- what the magics and the Python API call ----------------------------------------------
    def acquire(
        self,
        count: int | None = None,
        memory: int | str | None = None,
        mode: str | None = None,
        wait: float | str | bool | None = None,
        priority: int | None = None,
        *,
        show_wait: bool = True,
        quiet: bool = False,
    ) -> dict:
        """Ask for GPUs and bind them (a checkpointed kernel's claim restores its GPU state).

        Args:
            count: how many GPUs (default: the kernelspec's, else 1).
            memory: memory per GPU, a size with its unit (``"16GiB"``) or a number of bytes
                from 1 MiB up (default: a whole GPU, or the kernelspec's).
            mode: ``"exclusive"`` or ``"shared"`` (default: the kernelspec's).
            wait: ``None`` waits without a limit, ``0`` or ``False`` returns at once, a
                duration (``"10m"``) or a number of seconds waits that long and then withdraws
                the request.
            priority: a priority among this user's own claims.
            show_wait: show the live "Waiting for a GPU: position 2 in the queue" line.
            quiet: say nothing about the outcome.

        Returns:
            The lease (``state`` ``pending`` with a ``position`` when ``wait`` was 0 and no GPU
            was free).

        Raises:
            GPUSchedError: the server refused, or the wait ran out.
            ValueError: bad arguments.
        """
        return self.claims.acquire(count, memory, mode, wait, priority, show_wait=show_wait, quiet=quiet)

    def release(self, *, quiet: bool = False, free: bool = False) -> dict | None:
        """Give this kernel's GPUs back now (and withdraw a waiting claim).

        With ``free`` the frameworks' memory caches are emptied first. What this kernel's
        processes still hold on those GPUs stays counted as taken there; the message says so.
        """
        return self.claims.release(quiet=quiet, free=free)

    def keep(self, duration: float | str = "30m", *, quiet: bool = False) -> dict:
        """Pin this kernel's lease against idle reclaim for ``duration`` (0 unpins)."""
        return self.claims.keep(duration, quiet=quiet)

    def status(self) -> dict:
        """The server's status plus ``kernel_id`` and this kernel's ``lease``."""
        status = dict(self.client.status() or {})
        lease = self.refresh()
        status["kernel_id"] = self.client.kernel_id
        status["lease"] = lease if lease and lease.get("state") in LIVE else None
        status["first_cell"] = self._first_cell_claim() if status["lease"] is None else None
        status["limits"] = self.limits.describe(status["lease"], status.get("devices"))
        return status

    def _first_cell_claim(self) -> dict | None:
        return self.hooks.first_cell_claim()

    # -- the pre-run hook and the watcher -----------------------------------------------------
    def pre_run_cell(self, info: Any) -> None:
        self.hooks.pre_run_cell(info)

    def before_cell(self) -> None:
        """Make sure the kernel holds (and is bound to) its lease before a cell runs."""
        self.hooks.before_cell()

    def start_watcher(self) -> None:
        """Start the daemon thread that follows this kernel's lease (once)."""
        self.watcher.start()

    def stop_watcher(self, timeout: float = 5.0) -> None:
        self.watcher.stop(timeout)

    @property
    def watching(self) -> bool:
        return self.watcher.watching

    def watch_once(self) -> None:
        """One poll: read the lease, act on ``free-cache``, show notices about changes."""
        self.watcher.watch_once()

    # -- installation -------------------------------------------------------------------------
    def install(self) -> None:
        """Register the magics, the pre-run hook and the AST gate; start the watcher."""
        if self._installed or self.shell is None:
            return
        from .magics import GPUMagics

        self._magics = GPUMagics(self.shell, self)
        self.shell.register_magics(self._magics)
        self.shell.events.register("pre_run_cell", self.pre_run_cell)
        self.shell.ast_transformers.insert(0, self.hooks.gate)
        atexit.register(self.stop_watcher, 1.0)
        self._installed = True
        self._on_checkpointed(self.hooks.resume_running_cell)
        if self.limits.set_at_launch:
            # Before any startup code can import torch.
            self.limits.install_torch_hook()
        if self.settings.provisioned:
            self.start_watcher()

    def uninstall(self) -> None:
        """Undo :meth:`install`: no hook, no magics, no watcher, no panel polling."""
        self.stop_watcher()
        self.limits.uninstall_torch_hook()
        with contextlib.suppress(Exception):
            atexit.unregister(self.stop_watcher)
        if self.panel_obj is not None:
            with contextlib.suppress(Exception):
                self.panel_obj.close()
            self.panel_obj = None
        if not self._installed or self.shell is None:
            return
        self._on_checkpointed(None)
        with contextlib.suppress(ValueError):
            self.shell.events.unregister("pre_run_cell", self.pre_run_cell)
        if self.hooks.gate in self.shell.ast_transformers:
            self.shell.ast_transformers.remove(self.hooks.gate)
        magics = self.shell.magics_manager.magics
        for kind in ("line", "cell"):
            owner = getattr(magics[kind].get("gpu"), "__self__", None)
            if owner is self._magics:
                magics[kind].pop("gpu", None)
        self._installed = False

    def _on_checkpointed(self, resume: Callable[[], None] | None) -> None:
        """Tell the simulated GPUs' CUDA stand-in, where this kernel uses them, how a call that
        meets a checkpointed process asks for the lease back (a real driver's call blocks until
        the server restores the process, which it does for a kernel seen running)."""
        if not self.environ.get(_SIM_STATE_ENV):
            return
        try:
            from ..devices.simulated import cuda as simulated_cuda
        except Exception:  # noqa: BLE001 - the simulated GPUs are a convenience, never a failure here
            log.debug("simulated GPUs unavailable in this kernel", exc_info=True)
            return
        simulated_cuda.on_checkpointed(resume)

    # -- the panel ----------------------------------------------------------------------------
    def panel(self, interval: float = 2.0) -> Any:
        """The live ipywidgets panel (one per kernel; shown again if it is still open)."""
        from .panel import Panel

        if self.panel_obj is not None and not self.panel_obj.stopped:
            return self.panel_obj
        kid = self.client.kernel_id
        self.panel_obj = Panel(
            fetch=self.client.status,
            kernel_id=kid,
            interval=interval,
            actions={
                "acquire": lambda: self.acquire(wait=0, show_wait=False, quiet=True),
                "release": lambda: self.release(quiet=True),
                "keep": lambda: self.keep(1800, quiet=True),
            },
            clock=self.clock,
            first_cell=self._first_cell_claim,
        )
        self.panel_obj.start()
        return self.panel_obj


# -- one agent per shell ------------------------------------------------------------------------
_agents: dict[int, Agent] = {}
_agents_lock = threading.Lock()


def get_agent(shell: Any = None, *, install: bool = True) -> Agent:
    """The agent of ``shell`` (the running IPython by default), created on first use."""
    if shell is None:
        try:
            from IPython import get_ipython

            shell = get_ipython()
        except ImportError:  # pragma: no cover - IPython is a dependency
            shell = None
    with _agents_lock:
        agent = _agents.get(id(shell))
        if agent is None or agent.shell is not shell:
            agent = Agent(shell)
            _agents[id(shell)] = agent
    if install:
        agent.install()
    return agent


def existing_agent() -> Agent | None:
    """The running IPython's agent if one was made; never creates one."""
    try:
        from IPython import get_ipython

        shell = get_ipython()
    except ImportError:  # pragma: no cover - IPython is a dependency
        shell = None
    agent = _agents.get(id(shell))
    return agent if agent is not None and agent.shell is shell else None


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext jupyter_gpusched`` / ``extra_extensions=jupyter_gpusched.kernel``."""
    get_agent(ipython, install=True)


def unload_ipython_extension(ipython: Any) -> None:
    with _agents_lock:
        agent = _agents.pop(id(ipython), None)
    if agent is not None:
        agent.uninstall()
