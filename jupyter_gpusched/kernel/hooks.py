"""Before each cell: claim the kernelspec's GPU, bind it, restore a checkpoint, or stop the cell.

A ``pre_run_cell`` hook prepares the cell; it cannot stop one (IPython catches its exceptions), so
an AST transformer that runs right after the hooks rejects a cell the hook could not prepare (an
interrupted wait, a failed restore).
"""

from __future__ import annotations

import ast
import logging
import re
import time
import weakref
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from IPython.core.error import InputRejected

from . import render
from .before import Do, Flags, checkpointing, decide, params_of
from .claims import WaitCancelled, split_wait
from .client import GPUSchedError
from .states import HOLDING, LeaseState

if TYPE_CHECKING:
    from .binding import Binding
    from .claims import Claims
    from .lease import LeaseCache
    from .output import SayFn
    from .settings import Settings

log = logging.getLogger("jupyter_gpusched.kernel")

#: After a failed automatic acquire, later cells try again only after this many seconds.
AUTO_RETRY_AFTER = 30.0


class CellNotRun(InputRejected):
    """Raised from the agent's AST gate so that a cell the hook could not prepare does not run."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def _render_traceback_(self) -> list[str]:
        return [f"\x1b[0;31mCell not run\x1b[0m: {self.message}"]


def manages_gpus_itself(cell: str) -> bool:
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


class Gate(ast.NodeTransformer):
    """Stops a cell that the pre-run hook could not prepare (interrupted wait, failed restore)."""

    def __init__(self, hooks: Hooks):
        self._hooks = weakref.ref(hooks)

    def visit(self, node: ast.AST) -> ast.AST:
        hooks = self._hooks()
        message = hooks.take_abort() if hooks is not None else None
        if message:
            raise CellNotRun(message)
        return node


class Hooks:
    """The pre-run hook and the gate of the agent's shell.

    Args:
        leases: the lease cache.
        claims: makes the claims (and shows the wait line).
        binding: points CUDA at the lease's GPUs.
        settings: the kernelspec's defaults.
        current: the lease as a cell needs it (read fresh while it holds a GPU).
        refresh: reads the lease from the server.
        start_watcher: starts the thread that follows the lease.
        note_cell: a cell starts (the watcher's lines go to it from now on).
        say: shows a line in the cell.
        clock: wall-clock seconds.
        sleep: waits between reads while a checkpoint finishes.
    """

    def __init__(
        self,
        *,
        leases: LeaseCache,
        claims: Claims,
        binding: Binding,
        settings: Settings,
        current: Callable[[], dict | None],
        refresh: Callable[[], dict | None],
        start_watcher: Callable[[], None],
        note_cell: Callable[[], None],
        say: SayFn,
        clock: Callable[[], float],
        sleep: Callable[[float], None] = time.sleep,
    ):
        self.leases = leases
        self.claims = claims
        self.binding = binding
        self.settings = settings
        self.current = current
        self.refresh = refresh
        self.start_watcher = start_watcher
        self.note_cell = note_cell
        self.say = say
        self.clock = clock
        self.sleep = sleep
        self.gate = Gate(self)
        #: Why the cell being prepared must not run (read once by the gate).
        self.abort: str | None = None
        #: After a failed automatic claim, no new one before this (the clock's seconds).
        self.auto_retry_at = 0.0

    def pre_run_cell(self, info: Any) -> None:
        self.abort = None
        self.note_cell()
        if not getattr(info, "store_history", True):
            return  # tool executions (variable inspectors and such) must not take or restore GPUs
        if manages_gpus_itself(getattr(info, "raw_cell", "") or ""):
            return
        try:
            self.before_cell()
        except WaitCancelled as err:
            self.abort = err.message
        except CellNotRun as err:
            self.abort = err.message
        except (GPUSchedError, ValueError) as err:
            text = str(err).rstrip()
            self.say(f"GPU scheduler: {text}{'' if text.endswith('.') else '.'} This cell runs without a GPU.")
        except Exception:
            log.exception("gpusched pre-run hook failed")
            self.say("GPU scheduler: an internal error occurred (see the kernel log); this cell runs as is.")

    def take_abort(self) -> str | None:
        message, self.abort = self.abort, None
        return message

    def past_checkpoint(self, lease: dict | None) -> tuple[dict | None, str | None]:
        """The lease and its state once a checkpoint under way (if any) has landed."""
        if checkpointing(lease):
            lease = self.await_checkpoint(lease)
        return lease, lease.get("state") if lease else None

    def flags(self) -> Flags:
        """What the kernel did with its leases, as :func:`.before.decide` reads it."""
        view = self.leases.view()
        return Flags(
            user_released=view.user_released,
            had_lease=view.had_lease,
            released_by_me=view.released_by_me,
            last_claim=view.last_claim,
            retry_at=self.auto_retry_at,
        )

    def before_cell(self) -> None:
        """Make sure the kernel holds (and is bound to) its lease before a cell runs."""
        lease = self.current()
        action = decide(lease, self.flags(), self.settings, self.clock())
        while action.do == Do.WAIT_CHECKPOINT:
            lease = self.await_checkpoint(lease)
            action = decide(lease, self.flags(), self.settings, self.clock())
        log.debug("before the cell: %s (%s)", action.do, action.reason)
        if action.do == Do.BIND:
            self.binding.ensure(lease)
        elif action.do == Do.RESUME:
            self.resume(lease)
        elif action.do == Do.CLAIM:
            if action.unbind:
                self.binding.unbind()
            self.acquire_for_cell(action.claim or {}, action.what)

    def acquire_for_cell(self, params: Mapping[str, Any], what: str) -> None:
        self.leases.last_claim = params
        try:
            lease, granted, _waited = self.claims.claim(
                params["count"], params["memory"], params["mode"], params.get("priority"), None, what=what
            )
        except GPUSchedError:
            self.auto_retry_at = self.clock() + AUTO_RETRY_AFTER
            raise
        self.start_watcher()
        if granted:
            message = self.binding.ensure(lease)
            if message is None:
                self.say(
                    f"This kernel uses {render.gpu_label(lease)} ({render.uuid_list(render.device_uuids(lease))})."
                )

    def await_checkpoint(self, lease: dict) -> dict | None:
        """A checkpoint is under way: it finishes first, then the restore follows."""
        progress = self.claims.wait_display("the GPU checkpoint to finish before restoring")
        start = self.clock()
        try:
            while checkpointing(lease):
                progress.show(
                    "This kernel's GPU state is being checkpointed; the restore follows "
                    f"(waited {render.format_duration(self.clock() - start)})..."
                )
                self.sleep(min(self.settings.poll, 1.0))
                lease = self.refresh()
        except KeyboardInterrupt:
            progress.finish("Stopped waiting for the checkpoint.")
            raise WaitCancelled(
                "Stopped waiting; the checkpoint finishes in the background and the next cell restores it."
            ) from None
        progress.finish("Checkpoint finished; restoring.")
        return lease

    def resume(self, lease: dict) -> None:
        """Restore a checkpointed kernel onto a GPU (waiting for one if need be)."""
        params = params_of(lease)
        self.leases.last_claim = params
        try:
            resumed, granted, waited = self.claims.claim(
                params["count"],
                params["memory"],
                params["mode"],
                None,
                None,
                what="a GPU to restore this kernel's GPU state",
                resuming=True,
            )
        except GPUSchedError as err:
            raise CellNotRun(
                f"This kernel's GPU state is checkpointed and could not be restored: {err} "
                "Run the cell again to retry."
            ) from None
        self.start_watcher()
        if granted:
            self.binding.ensure(resumed, resumed=True)
            # The wait line says how long the queue took; this says the restore's own time.
            now = self.clock()
            _queued, restoring = split_wait(resumed, now - waited, now)
            self.say(
                f"Restored this kernel's GPU state onto {render.gpu_label(resumed)} "
                f"(the restore took {render.format_duration(restoring)})."
            )

    def resume_running_cell(self) -> None:
        """Code of the running cell needs the GPU while this kernel's GPU state is checkpointed
        (a checkpoint landed mid-cell): ask for the lease back now and wait, showing the queue
        position, as the next cell's hook would; the cell goes on once the state is restored.

        Raises:
            GPUSchedError: the state could not be restored (the server says why).
        """
        lease, state = self.past_checkpoint(self.refresh())
        if state in HOLDING:
            return  # restored already (by the server, or another thread of the cell)
        if state not in (LeaseState.SUSPENDED, LeaseState.PENDING):
            why = (lease or {}).get("reason") or "it holds no lease"
            raise GPUSchedError(
                f"This kernel's GPU state is checkpointed, but its lease is gone ({why}); the server "
                "restores the state once its GPU is free. Run `%gpu status` to see where it stands."
            )
        try:
            self.resume(lease)
        except CellNotRun as err:
            raise GPUSchedError(err.message) from None

    def first_cell_claim(self) -> dict | None:
        """The claim the pre-run hook makes before the next cell, for a lazily bound kernel that
        has never held a lease (``None``: it makes none by itself)."""
        s = self.settings
        view = self.leases.view()
        if not s.lazy or view.user_released or view.had_lease:
            return None
        return {"count": s.gpus, "memory": s.memory, "mode": s.mode}
