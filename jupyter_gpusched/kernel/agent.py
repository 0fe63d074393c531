"""The kernel agent: binds the kernel to its lease, resumes it, and tells the user what happens.

It runs inside the kernel process. A ``pre_run_cell`` hook acquires a GPU before the first cell
(lazy binding) and restores a checkpointed kernel before its next cell; a daemon thread watches
the kernel's lease and shows notices (reclaim countdowns, checkpoints, lost GPUs). Neither ever
executes code in the kernel: the watcher only reads the server and publishes display messages, so
the kernel never looks busy because of it.
"""

from __future__ import annotations

import ast
import atexit
import contextlib
import html
import logging
import os
import re
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from IPython.core.error import InputRejected

from . import cuda as _cuda
from . import render
from .client import Client, GPUSchedError, NoServerError

log = logging.getLogger("jupyter_gpusched.kernel")

ENV_GPUS = "JUPYTER_GPUSCHED_GPUS"
ENV_MEMORY = "JUPYTER_GPUSCHED_MEMORY"
ENV_MODE = "JUPYTER_GPUSCHED_MODE"
ENV_BIND = "JUPYTER_GPUSCHED_BIND"
ENV_POLL = "JUPYTER_GPUSCHED_POLL"

MODES = ("exclusive", "shared")
DISRUPTIVE_STEPS = ("restart", "shutdown")
#: After a failed automatic acquire, later cells try again only after this many seconds.
AUTO_RETRY_AFTER = 30.0
#: The watcher warns once after this many failed polls in a row.
WATCH_FAILURES_BEFORE_NOTICE = 3

DisplayFn = Callable[[str, "str | None", "str | None", bool], None]


class WaitCancelled(KeyboardInterrupt):
    """The user interrupted a wait for a GPU; the claim was withdrawn (or left to restore)."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message

    def _render_traceback_(self) -> list[str]:
        return [f"\x1b[0;31mWaitCancelled\x1b[0m: {self.message}"]


class CellNotRun(InputRejected):
    """Raised from the agent's AST gate so that a cell the hook could not prepare does not run."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def _render_traceback_(self) -> list[str]:
        return [f"\x1b[0;31mCell not run\x1b[0m: {self.message}"]


@dataclass(frozen=True)
class Settings:
    """What the kernelspec asked for (through the provisioner's environment)."""

    gpus: int = 1
    memory: int | None = None
    mode: str = "exclusive"
    bind: str = "lazy"
    poll: float = 3.0
    provisioned: bool = False

    @property
    def auto_bind(self) -> bool:
        """Bind before cells without being asked: only for kernels the provisioner started."""
        return self.provisioned and self.gpus >= 1

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if environ is None else environ
        provisioned = Client.from_environment(env) is not None
        try:
            gpus = int(env.get(ENV_GPUS, "1").strip() or "1")
        except ValueError:
            log.warning("%s=%r is not a whole number; using 1", ENV_GPUS, env.get(ENV_GPUS))
            gpus = 1
        memory = None
        text = env.get(ENV_MEMORY, "").strip()
        if text:
            try:
                memory = render.parse_memory(text)
            except ValueError as err:
                log.warning("%s=%r ignored: %s", ENV_MEMORY, text, err)
        mode = env.get(ENV_MODE, "exclusive").strip() or "exclusive"
        if mode not in MODES:
            log.warning("%s=%r ignored: use exclusive or shared", ENV_MODE, mode)
            mode = "exclusive"
        bind = env.get(ENV_BIND, "lazy").strip() or "lazy"
        if bind not in ("lazy", "launch"):
            log.warning("%s=%r ignored: use lazy or launch", ENV_BIND, bind)
            bind = "lazy"
        try:
            poll = float(env.get(ENV_POLL, "3") or "3")
        except ValueError:
            poll = 3.0
        poll = min(max(poll, 0.2), 60.0)
        return cls(gpus=max(gpus, 0), memory=memory, mode=mode, bind=bind, poll=poll, provisioned=provisioned)


def _ipython_display(
    text: str, html_text: str | None = None, display_id: str | None = None, update: bool = False
) -> None:
    from IPython.display import display

    bundle = {"text/plain": text}
    if html_text:
        bundle["text/html"] = html_text
    if display_id:
        display(bundle, raw=True, display_id=display_id, update=update)
    else:
        display(bundle, raw=True)


def _manages_gpus_itself(cell: str) -> bool:
    """Whether the pre-run hook should leave a cell alone.

    A cell of ``%gpu`` magics only needs no GPU, and a cell that starts with ``%gpu acquire`` or
    ``%gpu release`` says itself what it wants (the hook would otherwise take the kernelspec's
    default first, and ``%gpu acquire 2`` would then conflict with it).
    """
    lines = [ln.strip() for ln in cell.splitlines()]
    lines = [ln for ln in lines if ln and not ln.startswith("#")]
    if not lines:
        return False
    if re.match(r"^%gpu\s+(acquire|release)\b", lines[0]):
        return True
    return all(re.match(r"^%{1,2}(gpu|load_ext|reload_ext|unload_ext)\b", ln) for ln in lines)


def _kernel_id_from_connection_file() -> str | None:
    try:
        from ipykernel.connect import get_connection_file

        name = os.path.basename(get_connection_file())
    except Exception:  # noqa: BLE001 - not an ipykernel (a terminal IPython, say)
        return None
    match = re.match(r"^kernel-(.+)\.json$", name)
    return match.group(1) if match else None


class _Gate(ast.NodeTransformer):
    """Stops a cell that the pre-run hook could not prepare (interrupted wait, failed restore).

    A ``pre_run_cell`` hook cannot stop a cell (IPython catches its exceptions), but an AST
    transformer runs right after the hooks and may reject the input.
    """

    def __init__(self, agent: Agent):
        self._agent = weakref.ref(agent)

    def visit(self, node: ast.AST) -> ast.AST:
        agent = self._agent()
        message = agent._take_abort() if agent is not None else None
        if message:
            raise CellNotRun(message)
        return node


class _WaitDisplay:
    """The live "Waiting for a GPU: position 2 in the queue..." line, updated in place."""

    def __init__(self, agent: Agent, what: str):
        self.agent = agent
        self.what = what
        self.display_id: str | None = None
        self.text = ""

    def _show(self, text: str) -> None:
        if text == self.text:
            return
        self.text = text
        if self.display_id is None:
            self.display_id = f"gpusched-wait-{time.monotonic_ns()}"
            self.agent._display(text, None, self.display_id, False)
        else:
            self.agent._display(text, None, self.display_id, True)

    def update(self, lease: Mapping[str, Any], waited: float) -> None:
        position = lease.get("position")
        where = f"position {position} in the queue" if position else "in the queue"
        self._show(
            f"Waiting for {self.what}: {where} (waited {render.format_duration(waited)})... "
            "Interrupt the kernel to stop waiting."
        )

    def finish(self, text: str) -> None:
        if self.display_id is not None:
            self._show(text)


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
        self.cuda_probe = cuda_probe
        self.free_caches = free_caches
        self._display = display or _ipython_display
        self.clock = clock
        #: Seconds between claim requests while waiting; the server long-polls each one.
        self.long_poll = min(max(self.settings.poll, 1.0), 30.0)
        #: Claim requests while waiting are at least this many seconds apart.
        self.min_poll_gap = 1.0

        self._lock = threading.RLock()
        self._lease: dict | None = None
        self._lease_at = float("-inf")
        self._had_lease = False
        self._released_by_me: set[str] = set()
        self._user_released = False
        self._claiming = False
        self._last_claim: dict[str, Any] | None = None
        self._auto_retry_at = 0.0
        self._abort: str | None = None
        self._parent: Any = None
        cvd = self.environ.get("CUDA_VISIBLE_DEVICES")
        self._original_visible = cvd
        self._bound: str | None = cvd
        self._warned_bind: str | None = None

        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self._no_scheduler: str | None = None
        self._said_no_scheduler = False
        self._watch_failures = 0
        self._countdowns: dict[str, str] = {}
        self._freed: set[tuple[str, Any]] = set()
        self._installed = False
        self._gate: _Gate | None = None
        self._magics: Any = None
        self.panel_obj: Any = None

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
            self._say(f"No GPU scheduler for this kernel, so {what}. {self._no_scheduler}")
        else:
            self._say(f"No GPU scheduler for this kernel, so {what}.")

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
        with self._lock:
            return dict(self._lease) if self._lease else None

    def _set_lease(self, lease: dict | None) -> None:
        with self._lock:
            self._lease = dict(lease) if lease else None
            self._lease_at = self.clock()
            if lease and lease.get("state") in render.HOLDING:
                self._had_lease = True

    def _pick(self, leases: list[dict], previous: dict | None) -> dict | None:
        """This kernel's lease in a list from the server; a vanished known lease is released."""
        kid = self.client.kernel_id
        mine = render.my_lease(leases, kid)
        if mine is not None:
            return mine
        if previous is not None:
            for lease in leases:
                if lease.get("id") == previous.get("id"):
                    return dict(lease)
            if previous.get("state") in render.LIVE:
                return {
                    **previous,
                    "state": "released",
                    "devices": [],
                    "reason": "the server no longer lists this lease",
                }
            return previous
        return None

    def refresh(self) -> dict | None:
        """Read this kernel's lease from the server (``GET api/gpusched/leases?kernel_id=``)."""
        leases = self.client.leases(self.client.kernel_id)
        with self._lock:
            previous = self._lease
            lease = self._pick(leases, previous)
            self._set_lease(lease)
        # Whoever reads the lease first (the watcher, the hook, a magic) reports what changed.
        self._notice(previous, lease)
        return self.lease

    def _max_age(self) -> float:
        watching = self._watcher is not None and self._watcher.is_alive()
        return max(2 * self.settings.poll, 5.0) if watching else self.settings.poll

    def _current(self) -> dict | None:
        """The lease as the pre-run hook needs it: cached while active, else read fresh."""
        with self._lock:
            lease, age = self._lease, self.clock() - self._lease_at
        if not self._connected():
            return lease
        state = lease.get("state") if lease else None
        fresh = age <= self._max_age()
        if lease is None and fresh:
            return None
        if state == "active" and fresh:
            return dict(lease)
        if state == "suspended" or (state == "released" and age <= self._max_age()):
            return dict(lease)
        return self.refresh()

    # -- binding ------------------------------------------------------------------------------
    def _ensure_bound(self, lease: Mapping[str, Any], *, resumed: bool = False) -> str | None:
        """Point CUDA at the lease's devices if CUDA is not initialized yet; else say why not.

        Returns the message shown, if any.
        """
        uuids = render.device_uuids(lease)
        if not uuids:
            return None
        want = ",".join(uuids)
        current = os.environ.get("CUDA_VISIBLE_DEVICES")
        if current == want:
            self._bound = want
            return None
        if self._warned_bind == want:
            return None
        state = self.cuda_probe()
        if not state.initialized:
            os.environ["CUDA_VISIBLE_DEVICES"] = want
            os.environ["NVIDIA_VISIBLE_DEVICES"] = want
            self._bound = want
            log.info("bound kernel to %s (lease %s)", want, lease.get("id"))
            if state.loaded:
                message = (
                    f"This kernel now sees {render.gpu_label(lease)} ({want}). The CUDA library was "
                    "already loaded, though not initialized; if CUDA code still cannot see the GPU, "
                    "restart the kernel."
                )
                self._say(message)
                return message
            return None
        if resumed:
            # The restore moved this process's CUDA context; nothing to change or to explain.
            self._bound = want
            return None
        if current is None:
            where = "with every GPU visible"
        elif current.strip() == "":
            where = "with no GPU visible"
        else:
            where = f"on {current}"
        message = (
            f"CUDA is already initialized in this kernel {where}; the new lease is on "
            f"{render.gpu_label(lease)} ({want}). CUDA cannot switch GPUs in a running process: "
            "restart the kernel to use it."
        )
        self._warned_bind = want
        self._say(message)
        return message

    def _unbind(self) -> None:
        """After the lease ended: hide the GPUs again, if CUDA has not started on them."""
        if not self._bound:
            return
        if self.cuda_probe().initialized:
            return
        value = "" if self.settings.provisioned else self._original_visible
        if value is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            os.environ.pop("NVIDIA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = value
            os.environ["NVIDIA_VISIBLE_DEVICES"] = value or "none"
        self._bound = value
        self._warned_bind = None

    # -- output -------------------------------------------------------------------------------
    def _say(
        self, text: str, html_text: str | None = None, display_id: str | None = None, update: bool = False
    ) -> None:
        """Show a line in the cell that is running (or, from the watcher, the last one that ran).

        Code in backticks is marked up as code in HTML and shown without the backticks as text.
        """
        if html_text:
            html_text = render.code_html(html_text)
        elif "`" in text:
            html_text = render.code_html(html.escape(text))
        text = render.plain(text)
        with self._cell_context():
            try:
                self._display(text, html_text, display_id, update)
            except Exception:
                log.exception("could not show a notice: %s", text)

    @contextlib.contextmanager
    def _cell_context(self) -> Iterator[None]:
        """From a background thread, attach output to the last executed cell.

        Without this, ipykernel would attach it to whatever message it handled last (a completion
        or a widget message), and the frontend would drop it.
        """
        parent = self._parent
        pub = getattr(self.shell, "display_pub", None)
        token = None
        if (
            parent
            and threading.current_thread() is not threading.main_thread()
            and hasattr(pub, "set_thread_parent")
        ):
            try:
                token = pub.set_thread_parent(parent)
            except Exception:  # noqa: BLE001 - an older ipykernel: the default parent will do
                token = None
        try:
            yield
        finally:
            if token is not None:
                with contextlib.suppress(Exception):
                    pub.reset_thread_parent(token)

    # -- claims -------------------------------------------------------------------------------
    def _claim(
        self,
        count: int,
        memory: int | None,
        mode: str,
        priority: int | None,
        wait: float | None,
        *,
        what: str = "a GPU",
        resuming: bool = False,
        show_wait: bool = True,
    ) -> tuple[dict, bool, float]:
        """POST claims until granted, the wait runs out, or the user interrupts.

        Returns ``(lease, granted, seconds waited)``. ``wait`` ``None`` waits without a limit.
        """
        client = self.client
        start = self.clock()
        deadline = None if wait is None else start + wait
        pending_id: str | None = None
        progress = _WaitDisplay(self, what) if show_wait else None
        self._claiming = True
        first = True
        try:
            while True:
                remaining = None if deadline is None else max(0.0, deadline - self.clock())
                chunk = self.long_poll if remaining is None else min(self.long_poll, remaining)
                if first and show_wait:
                    chunk = 0.0  # learn the queue position at once, to show it while waiting
                first = False
                sent = time.monotonic()
                _, lease = client.claim(count, memory=memory, mode=mode, wait=chunk, priority=priority)
                lease = dict(lease or {})
                self._set_lease(lease)
                state = lease.get("state")
                waited = self.clock() - start
                if state in render.HOLDING:
                    if progress is not None:
                        # Only a wait that was shown is finished; a claim served at once says nothing here.
                        queued = f" after {render.format_duration(waited)} in the queue" if waited >= 1 else ""
                        progress.finish(f"Got {render.gpu_label(lease)}{queued}.")
                    return lease, True, waited
                if state == "released":
                    raise GPUSchedError(
                        f"The claim was turned down: {lease.get('reason') or 'the server released it'}."
                    )
                pending_id = lease.get("id") or pending_id
                if remaining is not None and remaining <= chunk:
                    if progress is not None and wait:
                        progress.finish(f"No GPU became free within {render.format_duration(wait)}.")
                    return lease, False, waited
                if progress is not None:
                    progress.update(lease, waited)
                gap = self.min_poll_gap - (time.monotonic() - sent)
                if chunk > 0 and gap > 0:  # a server that answers early is not asked in a tight loop
                    time.sleep(gap)
        except KeyboardInterrupt:
            message = self._withdraw(pending_id, resuming)
            if progress is not None:
                progress.finish(message)
            raise WaitCancelled(message) from None
        finally:
            self._claiming = False

    def _withdraw(self, pending_id: str | None, resuming: bool) -> str:
        """Take back a claim the user stopped waiting for; say what became of it."""
        if resuming:
            # Releasing would throw away the checkpointed GPU state; leave the restore queued.
            return (
                "Stopped waiting. This kernel's GPU state stays checkpointed and is restored when a "
                "GPU frees up; run `%gpu release` to drop it instead."
            )
        try:
            ids = (
                [pending_id]
                if pending_id
                else [
                    le["id"]
                    for le in self.client.leases(self.client.kernel_id)
                    if le.get("state") == "pending"
                ]
            )
            for lease_id in ids:
                self.client.release(lease_id)
                self._released_by_me.add(lease_id)
            with self._lock:
                if self._lease and self._lease.get("id") in ids:
                    self._lease = {**self._lease, "state": "released", "reason": "withdrawn by the user"}
        except (GPUSchedError, KeyboardInterrupt) as err:
            return f"Stopped waiting, but the request could not be withdrawn ({err}); run `%gpu release`."
        return "Stopped waiting for a GPU; the request was withdrawn."

    def _claim_params(
        self, count: object, memory: object, mode: object, priority: object
    ) -> tuple[int, int | None, str, int | None]:
        if count is None:
            count = max(self.settings.gpus, 1)
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"count must be a whole number of GPUs, at least 1 (not {count!r})")
        if memory is None:
            memory_bytes = self.settings.memory
        else:
            memory_bytes = render.parse_memory(memory)
        if mode is None:
            mode = self.settings.mode
        if mode not in MODES:
            raise ValueError(f"mode must be 'exclusive' or 'shared', not {mode!r}")
        if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)):
            raise ValueError(f"priority must be a whole number, not {priority!r}")
        return count, memory_bytes, str(mode), priority

    @staticmethod
    def _wait_seconds(wait: object) -> float | None:
        if wait is None or wait is True:
            return None
        if wait is False:
            return 0.0
        return render.parse_duration(wait, "wait")

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
        """Ask for GPUs and bind them; see :meth:`GPU.acquire` for the arguments.

        Returns the lease (``state`` ``pending`` with a ``position`` when ``wait`` was 0 and no
        GPU was free). Raises GPUSchedError (server refusals, a wait that ran out) or
        ValueError (bad arguments).
        """
        count, memory_bytes, mode, priority = self._claim_params(count, memory, mode, priority)
        seconds = self._wait_seconds(wait)
        previous = self.refresh()
        resuming = bool(previous and previous.get("state") == "suspended")
        self._user_released = False
        self._last_claim = {"count": count, "memory": memory_bytes, "mode": mode, "priority": priority}
        try:
            lease, granted, _waited = self._claim(
                count, memory_bytes, mode, priority, seconds, resuming=resuming, show_wait=show_wait
            )
        except GPUSchedError as err:
            if err.status != 409:
                raise
            raise GPUSchedError(self._conflict(err), err.status, err.reason) from None
        self.start_watcher()
        if granted:
            self._ensure_bound(lease, resumed=resuming)
            if not quiet:
                verb = "Restored this kernel's GPU state onto" if resuming else "This kernel holds"
                self._say(
                    f"{verb} {render.gpu_label(lease)} ({render.uuid_list(render.device_uuids(lease))})."
                )
            return lease
        position = lease.get("position")
        if seconds == 0:
            if not quiet:
                self._say(
                    f"No GPU is free now: this kernel is at position {position or '?'} in the queue. "
                    "It gets the GPU when one frees up and uses it from the next cell on."
                )
            return lease
        message = self._withdraw(lease.get("id"), resuming)
        raise GPUSchedError(
            f"No GPU became free within {render.format_duration(seconds)} (this kernel was at position "
            f"{position or '?'} in the queue). {message.replace('Stopped waiting for a GPU; the', 'The')}"
        )

    def _conflict(self, err: GPUSchedError) -> str:
        """The server's 409 in terms of this kernel's own lease, where it has one."""
        try:
            lease = self.refresh()
        except GPUSchedError:
            return err.message
        state = lease.get("state") if lease else None
        if state in render.HOLDING:
            return (
                f"This kernel holds {render.gpu_label(lease)} ({lease.get('mode') or 'exclusive'}); "
                "`%gpu release` first to ask for a different GPU."
            )
        if state == "pending":
            return (
                f"This kernel is already waiting for {render.claim_label(lease)}; `%gpu release` first "
                "to ask for something else."
            )
        if state == "suspended":
            return (
                f"This kernel's GPU state ({render.claim_label(lease)}) is checkpointed and is restored "
                "before its next cell; `%gpu release` first to ask for something else."
            )
        return err.message

    def release(self, *, quiet: bool = False) -> dict | None:
        """Give this kernel's GPUs back now (and withdraw a waiting claim)."""
        lease = self.refresh()
        if not lease or lease.get("state") not in render.LIVE:
            if not quiet:
                self._say("This kernel holds no GPU.")
            return None
        self.client.release(lease["id"])
        self._released_by_me.add(lease["id"])
        self._user_released = True
        was = lease.get("state")
        released = {**lease, "state": "released", "devices": [], "reason": "released by the user"}
        self._set_lease(released)
        initialized = was in render.HOLDING and self.cuda_probe().initialized
        if was in render.HOLDING:
            self._unbind()
        if not quiet:
            if was == "pending":
                text = "Withdrew this kernel's request for a GPU."
            elif was == "suspended":
                text = "Released this kernel's checkpointed GPU state; CUDA in this kernel will not work until it restarts."
            else:
                text = f"Released {render.gpu_label(lease)}."
                if initialized:
                    text += (
                        " CUDA is still initialized in this kernel and may hold memory on it: restart the "
                        "kernel (or free its GPU memory) so that the next holder has the whole GPU."
                    )
            if self.settings.auto_bind:
                text += " This kernel takes no GPU again until you run `%gpu acquire`."
            self._say(text)
        return released

    def keep(self, duration: float | str = "30m", *, quiet: bool = False) -> dict:
        """Pin this kernel's lease against idle reclaim for ``duration`` (0 unpins)."""
        seconds = render.parse_duration(duration, "keep")
        lease = self.refresh()
        if not lease or lease.get("state") not in render.LIVE:
            raise GPUSchedError("This kernel holds no GPU to keep; run `%gpu acquire` first.")
        kept = self.client.keep(lease["id"], seconds)
        self._set_lease(kept)
        if not quiet:
            if seconds:
                self._say(
                    f"{render.gpu_label(kept)} is kept for {render.format_duration(seconds)}: no idle "
                    "reclaim before then."
                )
            else:
                self._say(f"{render.gpu_label(kept)} is no longer kept; idle reclaim applies again.")
        return kept

    def status(self) -> dict:
        """The server's status plus ``kernel_id`` and this kernel's ``lease``."""
        status = dict(self.client.status() or {})
        lease = self.refresh()
        status["kernel_id"] = self.client.kernel_id
        status["lease"] = lease if lease and lease.get("state") in render.LIVE else None
        status["first_cell"] = self._first_cell_claim() if status["lease"] is None else None
        return status

    def _first_cell_claim(self) -> dict | None:
        """The claim the pre-run hook makes before the next cell, for a lazily bound kernel that
        has never held a lease (``None``: it makes none by itself)."""
        s = self.settings
        if not (s.auto_bind and s.bind == "lazy") or self._user_released or self._had_lease:
            return None
        return {"count": s.gpus, "memory": s.memory, "mode": s.mode}

    # -- the pre-run hook ---------------------------------------------------------------------
    def pre_run_cell(self, info: Any) -> None:
        self._abort = None
        self._parent = getattr(self.shell, "parent_header", None) or self._parent
        if not getattr(info, "store_history", True):
            return  # tool executions (variable inspectors and such) must not take or restore GPUs
        if _manages_gpus_itself(getattr(info, "raw_cell", "") or ""):
            return
        try:
            self.before_cell()
        except WaitCancelled as err:
            self._abort = err.message
        except CellNotRun as err:
            self._abort = err.message
        except (GPUSchedError, ValueError) as err:
            text = str(err).rstrip()
            self._say(
                f"GPU scheduler: {text}{'' if text.endswith('.') else '.'} This cell runs without a GPU."
            )
        except Exception:
            log.exception("gpusched pre-run hook failed")
            self._say("GPU scheduler: an internal error occurred (see the kernel log); this cell runs as is.")

    def _take_abort(self) -> str | None:
        message, self._abort = self._abort, None
        return message

    def before_cell(self) -> None:
        """Make sure the kernel holds (and is bound to) its lease before a cell runs."""
        lease = self._current()
        state = lease.get("state") if lease else None
        if state == "reclaiming" and lease.get("reclaim_step") == "checkpoint":
            lease = self._await_checkpoint(lease)
            state = lease.get("state") if lease else None
        if state in render.HOLDING:
            self._ensure_bound(lease)
            return
        if state == "suspended":
            self._resume(lease)
            return
        if state == "pending":
            if self.settings.auto_bind and not self._user_released:
                params = self._params_of(lease)
                self._acquire_for_cell(params, "a GPU")
            return
        if self._user_released:
            return
        if state == "released" and lease.get("id") not in self._released_by_me:
            self._unbind()
            params = self._params_of(lease)
            self._acquire_for_cell(params, "a GPU (the last one was taken back)")
            return
        if state == "released":
            lease = None  # withdrawn by this kernel: as if it never asked
        if lease is None and self._had_lease and self._last_claim:
            self._acquire_for_cell(self._last_claim, "a GPU (the last one was taken back)")
            return
        if lease is None and self.settings.auto_bind and self.settings.bind == "lazy":
            if self.clock() < self._auto_retry_at:
                return
            params = {
                "count": self.settings.gpus,
                "memory": self.settings.memory,
                "mode": self.settings.mode,
                "priority": None,
            }
            self._acquire_for_cell(params, "a GPU")

    @staticmethod
    def _params_of(lease: Mapping[str, Any]) -> dict[str, Any]:
        return {
            "count": int(lease.get("count") or 1),
            "memory": lease.get("memory"),
            "mode": lease.get("mode") or "exclusive",
            "priority": None,
        }

    def _acquire_for_cell(self, params: Mapping[str, Any], what: str) -> None:
        self._last_claim = dict(params)
        try:
            lease, granted, _waited = self._claim(
                params["count"], params["memory"], params["mode"], params.get("priority"), None, what=what
            )
        except GPUSchedError:
            self._auto_retry_at = self.clock() + AUTO_RETRY_AFTER
            raise
        self.start_watcher()
        if granted:
            message = self._ensure_bound(lease)
            if message is None:
                self._say(
                    f"This kernel uses {render.gpu_label(lease)} ({render.uuid_list(render.device_uuids(lease))})."
                )

    def _await_checkpoint(self, lease: dict) -> dict | None:
        """A checkpoint is under way: it finishes first, then the restore follows."""
        progress = _WaitDisplay(self, "the GPU checkpoint to finish before restoring")
        start = self.clock()
        try:
            while lease and lease.get("state") == "reclaiming" and lease.get("reclaim_step") == "checkpoint":
                progress._show(
                    "This kernel's GPU state is being checkpointed; the restore follows "
                    f"(waited {render.format_duration(self.clock() - start)})..."
                )
                time.sleep(min(self.settings.poll, 1.0))
                lease = self.refresh()
        except KeyboardInterrupt:
            progress.finish("Stopped waiting for the checkpoint.")
            raise WaitCancelled(
                "Stopped waiting; the checkpoint finishes in the background and the next cell restores it."
            ) from None
        progress.finish("Checkpoint finished; restoring.")
        return lease

    def _resume(self, lease: dict) -> None:
        params = self._params_of(lease)
        self._last_claim = params
        try:
            resumed, granted, waited = self._claim(
                params["count"],
                params["memory"],
                params["mode"],
                None,
                None,
                what="a GPU to restore this kernel's GPU state onto",
                resuming=True,
            )
        except GPUSchedError as err:
            raise CellNotRun(
                f"This kernel's GPU state is checkpointed and could not be restored: {err} "
                "Run the cell again to retry."
            ) from None
        self.start_watcher()
        if granted:
            self._ensure_bound(resumed, resumed=True)
            self._say(
                f"Restored this kernel's GPU state onto {render.gpu_label(resumed)} "
                f"(in {render.format_duration(waited)})."
            )

    # -- the watcher --------------------------------------------------------------------------
    def start_watcher(self) -> None:
        """Start the daemon thread that follows this kernel's lease (once)."""
        with self._lock:
            if self._watcher is not None and self._watcher.is_alive():
                return
            if not self._connected():
                return
            self._stop.clear()
            self._watcher = threading.Thread(target=self._watch_loop, name="gpusched-watcher", daemon=True)
            self._watcher.start()

    def stop_watcher(self, timeout: float = 5.0) -> None:
        self._stop.set()
        thread = self._watcher
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        self._watcher = None

    @property
    def watching(self) -> bool:
        return self._watcher is not None and self._watcher.is_alive()

    def _watch_loop(self) -> None:
        while not self._stop.wait(self.settings.poll):
            if self._claiming:
                continue  # the claim loop reads the lease itself and says what it sees
            try:
                self.watch_once()
            except Exception:
                log.exception("gpusched watcher poll failed")

    def watch_once(self) -> None:
        """One poll: read the lease, act on ``free-cache``, show notices about changes."""
        if not self._connected():
            return
        try:
            self.refresh()
        except GPUSchedError as err:
            self._watch_failures += 1
            if self._watch_failures == WATCH_FAILURES_BEFORE_NOTICE:
                self._say(f"GPU scheduler: lost contact ({err}). Notices pause until it answers again.")
            return
        self._watch_failures = 0

    def _notice(self, prev: dict | None, new: dict | None) -> None:
        now = self.clock()
        pstate = prev.get("state") if prev else None
        nstate = new.get("state") if new else None
        same = bool(prev and new and prev.get("id") == new.get("id"))
        reason = (new or {}).get("reason") or ""

        if new and nstate == "reclaiming" and new.get("reclaim_step") == "free-cache":
            key = (new.get("id"), new.get("reclaim_at"))
            if key not in self._freed:
                self._freed.add(key)
                freed = self.free_caches()
                if freed:
                    self._say(
                        f"Freed cached GPU memory ({', '.join(freed)}) on {render.gpu_label(new)}"
                        + (f" because {reason}." if reason else ".")
                    )

        if new and nstate == "reclaiming":
            left = render.seconds_until(new.get("reclaim_at"), now)
            if left is not None and left > 0:
                step = new.get("reclaim_step")
                if step == "restart":
                    then = " Then the kernel restarts and its variables are lost."
                elif step == "shutdown":
                    then = " Then the kernel shuts down and its variables are lost."
                elif step == "checkpoint":
                    then = " Its GPU state will be checkpointed; the next cell restores it."
                else:
                    then = ""
                text = (
                    f"{render.gpu_label(new)} will be taken back in {left:.0f} s"
                    + (f" because {reason}" if reason else "")
                    + "; run `%gpu keep 30m` to keep it."
                    + then
                )
                display_id = f"gpusched-reclaim-{new.get('id')}"
                update = display_id in self._countdowns
                if self._countdowns.get(display_id) != text:
                    self._countdowns[display_id] = text
                    self._say(text, f"<b>{html.escape(text)}</b>", display_id, update)
        if prev is not None:
            display_id = f"gpusched-reclaim-{prev.get('id')}"
            if display_id in self._countdowns and not (same and nstate == "reclaiming"):
                del self._countdowns[display_id]
                if nstate in render.HOLDING:
                    text = f"{render.gpu_label(prev)}: the reclaim is off ({reason or 'the kernel is active again'})."
                else:
                    text = f"{render.gpu_label(prev)} was taken back."
                self._say(text, None, display_id, True)

        if nstate == "suspended" and not (same and pstate == "suspended"):
            label = render.gpu_label(prev) if same and prev and prev.get("devices") else "The GPU"
            self._say(
                f"{label} was taken back while this kernel was idle. GPU state checkpointed; the next "
                "cell restores it."
            )

        if same and pstate == "pending" and nstate in render.HOLDING:
            self._say(
                f"Granted {render.gpu_label(new)} ({render.uuid_list(render.device_uuids(new))}); cells "
                "run from now on use it."
            )

        ended = nstate == "released" or (new is None and prev is not None)
        if ended and pstate in render.LIVE and prev.get("id") not in self._released_by_me:
            why = reason if new else "the server no longer lists it"
            if pstate != "suspended":
                with contextlib.suppress(Exception):
                    self._unbind()
            lost = "lost" in why
            head = "GPU lost" if lost else "GPU lease ended"
            again = (
                "" if self._user_released else " This kernel asks for a GPU again before its next cell runs."
            )
            rest = f"{render.gpu_label(prev)}: {why}.{again}"
            self._say(f"{head}: {rest}", f"<b>{html.escape(head)}</b>: {html.escape(rest)}")

    # -- installation -------------------------------------------------------------------------
    def install(self) -> None:
        """Register the magics, the pre-run hook and the AST gate; start the watcher."""
        if self._installed or self.shell is None:
            return
        from .magics import GPUMagics

        self._magics = GPUMagics(self.shell, self)
        self.shell.register_magics(self._magics)
        self.shell.events.register("pre_run_cell", self.pre_run_cell)
        self._gate = _Gate(self)
        self.shell.ast_transformers.insert(0, self._gate)
        atexit.register(self.stop_watcher, 1.0)
        self._installed = True
        if self.settings.provisioned:
            self.start_watcher()

    def uninstall(self) -> None:
        """Undo :meth:`install`: no hook, no magics, no watcher, no panel polling."""
        self.stop_watcher()
        with contextlib.suppress(Exception):
            atexit.unregister(self.stop_watcher)
        if self.panel_obj is not None:
            with contextlib.suppress(Exception):
                self.panel_obj.close()
            self.panel_obj = None
        if not self._installed or self.shell is None:
            return
        with contextlib.suppress(ValueError):
            self.shell.events.unregister("pre_run_cell", self.pre_run_cell)
        if self._gate in self.shell.ast_transformers:
            self.shell.ast_transformers.remove(self._gate)
        magics = self.shell.magics_manager.magics
        for kind in ("line", "cell"):
            owner = getattr(magics[kind].get("gpu"), "__self__", None)
            if owner is self._magics:
                magics[kind].pop("gpu", None)
        self._installed = False

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
