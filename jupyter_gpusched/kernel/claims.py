"""Asking for GPUs: the claim loop with its live queue position, withdrawing, releasing, keeping.

A claim is a ``POST api/gpusched/leases`` that the server long-polls; while it waits the user sees
one line, updated in place, and an interrupt withdraws the claim (or, for a checkpointed kernel,
leaves the restore queued).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from . import render
from .client import GPUSchedError
from .settings import MODES
from .states import HOLDING, LIVE, LeaseState

if TYPE_CHECKING:
    from .binding import Binding
    from .client import Client
    from .cuda import CudaState
    from .lease import LeaseCache
    from .output import DisplayFn, SayFn
    from .settings import Settings


#: The smallest number the Python API reads as bytes of memory: below it a number is a size
#: whose unit was left out (``memory=16``), refused rather than taken as 16 bytes.
MIN_BYTES = 1024**2


class WaitCancelled(KeyboardInterrupt):
    """The user interrupted a wait for a GPU; the claim was withdrawn (or left to restore)."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message

    def _render_traceback_(self) -> list[str]:
        return [f"\x1b[0;31mWaitCancelled\x1b[0m: {self.message}"]


class ClaimCancelled(GPUSchedError):
    """A claim this kernel waited on was ended from outside it (the GPU sidebar, ``jupyter
    gpusched release``, an admin): the wait line says so, and ``%gpu acquire`` says no more."""


def cancelled_text(lease: Mapping[str, Any]) -> str:
    """What to say when a claim this kernel waits on was released by someone else."""
    reason = str(lease.get("reason") or "")
    by = reason[len("released by ") :] if reason.startswith("released by ") else ""
    who = f" by {by}" if by and not by.startswith("kernel ") else ""
    return (
        f"Stopped waiting: this kernel's request for a GPU was cancelled{who} from outside this "
        "notebook (the GPU sidebar or the command line). Run `%gpu acquire` to ask again."
    )


class WaitDisplay:
    """The live "Waiting for a GPU: position 2 in the queue..." line, updated in place.

    Args:
        display: ``display(text, html, display_id, update)``.
        status: the server's status (the leases being taken back, for an estimate).
        clock: wall-clock seconds.
        what: what is waited for ("a GPU").
    """

    def __init__(
        self, display: DisplayFn, status: Callable[[], Mapping[str, Any] | None], clock: Callable[[], float], what: str
    ):
        self._display = display
        self._status = status
        self._clock = clock
        self.what = what
        self.display_id: str | None = None
        self.text = ""

    def show(self, text: str) -> None:
        if text == self.text:
            return
        self.text = text
        if self.display_id is None:
            self.display_id = f"gpusched-wait-{time.monotonic_ns()}"
            self._display(text, None, self.display_id, False)
        else:
            self._display(text, None, self.display_id, True)

    def update(self, lease: Mapping[str, Any], waited: float) -> None:
        position = lease.get("position")
        where = f"position {position} in the queue" if position else "in the queue"
        try:
            status = self._status() or {}
        except GPUSchedError:
            status = {}
        soon = reclaim_estimate(status.get("leases") or [], lease, self._clock())
        self.show(
            f"Waiting for {self.what}: {where} (waited {render.format_duration(waited)}). "
            + (f"{soon} " if soon else "")
            + "Interrupt the kernel to stop waiting."
        )

    def finish(self, text: str) -> None:
        if self.display_id is not None:
            self.show(text)


def reclaim_estimate(leases: list, claim: Mapping[str, Any], now: float) -> str:
    """When a GPU is expected for a waiting ``claim``, where a reclaim is already under way
    (``""`` where none is): the claim at position N gets the Nth GPU to be freed, soonest first.

    ``GPU 1 is being taken back from another kernel: free in about 45s (after its notice).``
    """
    position = claim.get("position") or 1
    freeing = [
        le
        for le in leases
        if le.get("state") == "reclaiming" and le.get("id") != claim.get("id") and le.get("devices")
    ]
    if len(freeing) < position:
        return ""
    freeing.sort(key=lambda le: render.parse_time(le.get("reclaim_at")) or now)
    victim = freeing[position - 1]
    label = render.gpu_label(victim)
    left = render.seconds_until(victim.get("reclaim_at"), now)
    step = victim.get("reclaim_step")
    if step in ("restart", "shutdown") and left:
        return (
            f"{label} is being taken back from another kernel: expected free in about "
            f"{render.format_duration(left)} (when its notice ends)."
        )
    doing = {
        "checkpoint": "its kernel's GPU state is being saved to host memory",
        "free-cache": "its kernel is freeing cached memory",
    }.get(str(step), "it is being released")
    return f"{label} is being taken back from another kernel now ({doing}): expected free shortly."


def split_wait(lease: Mapping[str, Any], start: float, end: float) -> tuple[float, float]:
    """``(seconds queued, seconds restoring)`` of a claim made at ``start`` and answered at
    ``end`` (wall clock): the server grants a restore (``granted_at``) and answers once the GPU
    state is back, so what came after the grant was the restore, not the queue."""
    total = max(0.0, end - start)
    granted = render.parse_time(lease.get("granted_at"))
    if granted is None:
        return total, 0.0
    queued = min(max(0.0, granted - start), total)
    return queued, total - queued


def wait_seconds(wait: object) -> float | None:
    """``wait`` as seconds: ``None`` (or True) waits without a limit, False not at all."""
    if wait is None or wait is True:
        return None
    if wait is False:
        return 0.0
    return render.parse_duration(wait, "wait")


class Claims:
    """Claims, releases and keeps for the kernel.

    Args:
        client: the REST client (found on first use).
        leases: the lease cache.
        settings: the kernelspec's defaults.
        binding: points CUDA at a granted lease, and away from a released one.
        refresh: reads the lease from the server (and reports what changed).
        status: the server's status as ``%gpu status`` shows it.
        start_watcher: starts the thread that follows the lease.
        say: shows a line in the cell.
        display: ``display(text, html, display_id, update)``, for the wait line.
        cuda_probe: tells whether CUDA is initialized in this process.
        free_caches: empties the frameworks' GPU memory caches; returns which.
        clock: wall-clock seconds (the server's times are wall-clock).
        sleep: waits between claim requests.
    """

    def __init__(
        self,
        *,
        client: Callable[[], Client],
        leases: LeaseCache,
        settings: Settings,
        binding: Binding,
        refresh: Callable[[], dict | None],
        status: Callable[[], dict],
        start_watcher: Callable[[], None],
        say: SayFn,
        display: DisplayFn,
        cuda_probe: Callable[[], CudaState],
        free_caches: Callable[[], list[str]],
        clock: Callable[[], float],
        sleep: Callable[[float], None] = time.sleep,
    ):
        self.client = client
        self.leases = leases
        self.settings = settings
        self.binding = binding
        self.refresh = refresh
        self.status = status
        self.start_watcher = start_watcher
        self.say = say
        self.display = display
        self.cuda_probe = cuda_probe
        self.free_caches = free_caches
        self.clock = clock
        self.sleep = sleep
        #: Seconds between claim requests while waiting; the server long-polls each one.
        self.long_poll = min(max(settings.poll, 1.0), 30.0)
        #: Claim requests while waiting are at least this many seconds apart.
        self.min_poll_gap = 1.0

    def wait_display(self, what: str) -> WaitDisplay:
        """A live line for a wait for ``what``, updated in place."""
        return WaitDisplay(self.display, lambda: self.client().status(), self.clock, what)

    def claim(
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
        client = self.client()
        start = self.clock()
        deadline = None if wait is None else start + wait
        pending_id: str | None = None
        progress = self.wait_display(what) if show_wait else None
        self.leases.claiming = True
        first = True
        try:
            while True:
                remaining = None if deadline is None else max(0.0, deadline - self.clock())
                chunk = self.long_poll if remaining is None else min(self.long_poll, remaining)
                if first and show_wait:
                    chunk = 0.0  # learn the queue position at once, to show it while waiting
                first = False
                sent = time.monotonic()
                try:
                    _, lease = client.claim(count, memory=memory, mode=mode, wait=chunk, priority=priority)
                except GPUSchedError as err:
                    self.cancelled(err, pending_id, progress)
                    raise
                lease = dict(lease or {})
                self.leases.set(lease)
                state = lease.get("state")
                waited = self.clock() - start
                if state in HOLDING:
                    if progress is not None:
                        # Only a wait that was shown is finished; a claim served at once says nothing here.
                        # Queue time only: a restore's own time is said where the restore is.
                        queued, _restoring = split_wait(lease, start, self.clock())
                        after = f" after {render.format_duration(queued)} in the queue" if queued >= 1 else ""
                        progress.finish(f"Got {render.gpu_label(lease)}{after}.")
                    return lease, True, waited
                if state == LeaseState.RELEASED:
                    raise GPUSchedError(
                        f"The claim was turned down: {lease.get('reason') or 'the server released it'}."
                    )
                pending_id = lease.get("id") or pending_id
                if remaining is not None and remaining <= chunk:
                    if progress is not None and wait:
                        # The caller says what became of the claim; the live line only stops.
                        progress.finish(f"Stopped waiting for {what} after {render.format_duration(wait)}.")
                    return lease, False, waited
                if progress is not None:
                    progress.update(lease, waited)
                gap = self.min_poll_gap - (time.monotonic() - sent)
                if chunk > 0 and gap > 0:  # a server that answers early is not asked in a tight loop
                    self.sleep(gap)
        except KeyboardInterrupt:
            message = self.withdraw(pending_id, resuming)
            if progress is not None:
                progress.finish(message)
            raise WaitCancelled(message) from None
        finally:
            self.leases.claiming = False

    def cancelled(self, err: GPUSchedError, pending_id: str | None, progress: WaitDisplay | None) -> None:
        """Where the claim waited on was released from outside (the server answers 409 for it),
        raise :class:`ClaimCancelled` saying so in words; anything else is left to the caller."""
        if err.status != 409 or not pending_id:
            return
        try:
            lease = self.client().lease(pending_id)
        except GPUSchedError:
            return
        if lease.get("state") != LeaseState.RELEASED:
            return
        if not str(lease.get("reason") or "").startswith("released by "):
            # Ended by the server, not by a person (a restore that failed, a GPU lost, the
            # kernel's process gone): the caller raises the server's own reason.
            return
        # Said here once; the watcher does not tell it again, and the next cell does not ask again.
        self.leases.note_released(pending_id)
        self.leases.user_released = True
        self.leases.set(dict(lease))
        text = cancelled_text(lease)
        if progress is not None:
            progress.finish(text)
        raise ClaimCancelled(text, 409, "cancelled") from None

    def withdraw(self, pending_id: str | None, resuming: bool) -> str:
        """Take back a claim the user stopped waiting for; say what became of it."""
        if resuming:
            # Releasing would throw away the checkpointed GPU state; leave the restore queued.
            return (
                "Stopped waiting. This kernel's GPU state stays checkpointed and is restored when a "
                "GPU frees up; run `%gpu release` to drop it instead."
            )
        try:
            client = self.client()
            ids = (
                [pending_id]
                if pending_id
                else [le["id"] for le in client.leases(client.kernel_id) if le.get("state") == LeaseState.PENDING]
            )
            for lease_id in ids:
                client.release(lease_id)
                self.leases.note_released(lease_id)
            self.leases.mark_withdrawn(ids)
        except (GPUSchedError, KeyboardInterrupt) as err:
            return f"Stopped waiting, but the request could not be withdrawn ({err}); run `%gpu release`."
        return "Stopped waiting for a GPU; the request was withdrawn."

    def params(
        self, count: object, memory: object, mode: object, priority: object
    ) -> tuple[int, int | None, str, int | None]:
        """Check a claim's arguments, filling in the kernelspec's defaults (ValueError if bad)."""
        settings = self.settings
        if count is None:
            count = max(settings.gpus, 1)
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"count must be a whole number of GPUs, at least 1 (not {count!r})")
        if memory is None:
            memory_bytes = settings.memory
        elif isinstance(memory, (int, float)) and not isinstance(memory, bool) and 0 < memory < MIN_BYTES:
            # No claim is this small: a number alone here is a size whose unit was left out.
            raise ValueError(
                f"memory={memory!r} would be {memory:g} bytes: give the unit, as in memory='{memory:g}GiB' "
                "(sizes look like '16GiB', '512MiB' or '80GB'; a number is read as bytes)"
            )
        else:
            memory_bytes = render.parse_memory(memory)
        if mode is None:
            mode = settings.mode
        if mode not in MODES:
            raise ValueError(f"mode must be 'exclusive' or 'shared', not {mode!r}")
        if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)):
            raise ValueError(f"priority must be a whole number, not {priority!r}")
        return count, memory_bytes, str(mode), priority

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
        """See :meth:`Agent.acquire`."""
        count, memory_bytes, mode, priority = self.params(count, memory, mode, priority)
        seconds = wait_seconds(wait)
        previous = self.refresh()
        resuming = bool(previous and previous.get("state") == LeaseState.SUSPENDED)
        self.leases.user_released = False
        self.leases.last_claim = {"count": count, "memory": memory_bytes, "mode": mode, "priority": priority}
        try:
            lease, granted, _waited = self.claim(
                count, memory_bytes, mode, priority, seconds, resuming=resuming, show_wait=show_wait
            )
        except ClaimCancelled:
            raise
        except GPUSchedError as err:
            if err.status != 409:
                raise
            raise GPUSchedError(self.conflict(err), err.status, err.reason) from None
        self.start_watcher()
        if granted:
            self.binding.ensure(lease, resumed=resuming)
            if not quiet:
                verb = "Restored this kernel's GPU state onto" if resuming else "This kernel holds"
                self.say(
                    f"{verb} {render.gpu_label(lease)} ({render.uuid_list(render.device_uuids(lease))})."
                )
            return lease
        position = lease.get("position")
        if seconds == 0:
            if not quiet:
                self.say(
                    f"No GPU is free now: this kernel is at position {position or '?'} in the queue. "
                    "It gets the GPU when one frees up and uses it from the next cell on."
                )
            return lease
        message = self.withdraw(lease.get("id"), resuming)
        raise GPUSchedError(
            f"No GPU became free within {render.format_duration(seconds)} (this kernel was at position "
            f"{position or '?'} in the queue). {message.replace('Stopped waiting for a GPU; the', 'The')}"
        )

    def conflict(self, err: GPUSchedError) -> str:
        """The server's 409 in terms of this kernel's own lease, where it has one."""
        try:
            lease = self.refresh()
        except GPUSchedError:
            return err.message
        state = lease.get("state") if lease else None
        if state in HOLDING:
            return (
                f"This kernel holds {render.gpu_label(lease)} ({lease.get('mode') or 'exclusive'}); "
                "`%gpu release` first to ask for a different GPU."
            )
        if state == LeaseState.PENDING:
            return (
                f"This kernel is already waiting for {render.claim_label(lease)}; `%gpu release` first "
                "to ask for something else."
            )
        if state == LeaseState.SUSPENDED:
            return (
                f"This kernel's GPU state ({render.claim_label(lease)}) is checkpointed and is restored "
                "before its next cell; `%gpu release` first to ask for something else."
            )
        return err.message

    def release(self, *, quiet: bool = False, free: bool = False) -> dict | None:
        """See :meth:`Agent.release`."""
        lease = self.refresh()
        frameworks = self.free_caches() if free else []
        if not lease or lease.get("state") not in LIVE:
            if not quiet:
                self.say(self.no_lease_text(free, frameworks))
            return None
        # The server says what this kernel's processes still hold on the lease's GPUs: memory
        # that stays behind when the lease goes, and counts as taken there.
        left = self.client().release(lease["id"])
        self.leases.note_released(lease["id"])
        self.leases.user_released = True
        was = lease.get("state")
        released = {**lease, "state": LeaseState.RELEASED.value, "devices": [], "reason": "released by the user"}
        self.leases.set(released)
        initialized = was in HOLDING and self.cuda_probe().initialized
        if was in HOLDING:
            self.binding.unbind()
        if not quiet:
            if was == LeaseState.PENDING:
                text = "Withdrew this kernel's request for a GPU."
            elif was == LeaseState.SUSPENDED:
                text = "Released this kernel's checkpointed GPU state; CUDA in this kernel will not work until it restarts."
            else:
                text = f"Released {render.gpu_label(lease)}."
                if frameworks:
                    text += f" Emptied the GPU memory caches of {', '.join(frameworks)} first."
                if left is not None:
                    text += " " + memory_left_text(left, freed=free)
                elif initialized:
                    text += (
                        " CUDA is still initialized in this kernel and may hold memory on it: restart the "
                        "kernel (or free its GPU memory) so that the next holder has the whole GPU."
                    )
            if self.settings.auto_bind:
                text += " This kernel takes no GPU again until you run `%gpu acquire`."
            self.say(text)
        return released

    def no_lease_text(self, free: bool, frameworks: list[str]) -> str:
        """What ``%gpu release`` says with no lease to release (``--free``: what it emptied, and
        what this kernel's processes still hold on GPUs outside any lease, as last seen)."""
        if not free:
            return "This kernel holds no GPU."
        text = "This kernel holds no GPU lease; " + (
            f"emptied the GPU memory caches of {', '.join(frameworks)}." if frameworks
            else "no framework cache to empty (PyTorch and CuPy hold none in it)."
        )
        try:
            status = self.status()
        except GPUSchedError:
            return text
        mine = self.client().kernel_id
        held = [
            (dev.get("index"), proc.get("memory_used") or 0)
            for dev in status.get("devices") or []
            for proc in dev.get("processes") or []
            if mine and proc.get("kernel_id") == mine and render.outside_lease(proc) and proc.get("memory_used")
        ]
        if held:
            where = ", ".join(f"{render.format_bytes(size)} on GPU {index}" for index, size in held)
            text += (
                f" Its processes held {where} outside any lease when last seen, counted as taken there: `del` "
                "what you no longer need, or restart the kernel."
            )
        return text

    def keep(self, duration: float | str = "30m", *, quiet: bool = False) -> dict:
        """See :meth:`Agent.keep`."""
        seconds = render.parse_duration(duration, "keep")
        lease = self.refresh()
        if not lease or lease.get("state") not in LIVE:
            raise GPUSchedError("This kernel holds no GPU to keep; run `%gpu acquire` first.")
        kept = self.client().keep(lease["id"], seconds)
        self.leases.set(kept)
        if not quiet:
            if seconds:
                self.say(
                    f"{render.gpu_label(kept)} is kept for {render.format_duration(seconds)}: no idle "
                    "reclaim before then."
                )
            else:
                self.say(f"{render.gpu_label(kept)} is no longer kept; idle reclaim applies again.")
        return kept


def held_gpus(answer: Mapping[str, Any]) -> str:
    """``GPU 2`` or ``GPUs 0, 1``: where a release's answer says the kernel holds memory."""
    indices = list(dict.fromkeys(str(p.get("device_index", "?")) for p in answer.get("processes") or []))
    return ("GPU " if len(indices) == 1 else "GPUs ") + ", ".join(indices) if indices else "its GPU"


def memory_left_text(answer: Mapping[str, Any], freed: bool) -> str:
    """What a release left behind (the server's answer), and the user's choice about it."""
    gpus = held_gpus(answer)
    pids = ", ".join(dict.fromkeys(str(p.get("pid")) for p in answer.get("processes") or []))
    text = (
        f"This kernel's processes still hold {render.format_bytes(answer.get('memory_held'))} of GPU memory "
        f"on {gpus} (pid {pids}). It stays counted as taken there: no claim is given {gpus} unless it fits "
        "beside that memory. "
    )
    if freed:
        return text + "It is what this kernel still uses: `del` what you no longer need, or restart the kernel."
    return text + (
        "Free it: `del` the tensors and arrays you no longer need, then run `%gpu release --free`, which "
        "also empties PyTorch's and CuPy's memory caches (next time, run it instead of `%gpu release`). "
        "Or keep it, if this kernel still needs that data: it stays this kernel's until freed or the kernel ends."
    )
