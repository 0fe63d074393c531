"""The daemon thread that follows the kernel's lease and shows what changes.

It only reads the server and publishes display messages (never executes code in the kernel, so
the kernel never looks busy because of it). What to say comes from :func:`.notices.notices`; this
module remembers what it shows (countdowns updated in place) and serves the server's free-cache
requests once per reclaim.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import notices as _notices
from .client import GPUSchedError
from .notices import COUNTDOWN_ENDS, Notice, NoticeKind

if TYPE_CHECKING:
    from .client import Client
    from .lease import LeaseCache
    from .output import SayFn
    from .settings import Settings

log = logging.getLogger("jupyter_gpusched.kernel")

#: The watcher warns once after this many failed polls in a row.
WATCH_FAILURES_BEFORE_NOTICE = 3


class Watcher:
    """Polls the kernel's lease every ``settings.poll`` seconds and reports each change.

    Args:
        leases: the lease cache (what this kernel released itself; whether a claim loop runs).
        settings: how often to poll (``poll``).
        read: reads the lease from the server; the reader reports changes to :meth:`report`.
        connected: whether talking to the server is expected (without discovering it now).
        unbind: hides the GPUs of a lease that ended.
        free_caches: empties the frameworks' GPU memory caches; returns which.
        client: the REST client, to acknowledge a free-cache step.
        say: shows a line in the last cell that ran.
        clock: wall-clock seconds.
    """

    def __init__(
        self,
        *,
        leases: LeaseCache,
        settings: Settings,
        read: Callable[[], dict | None],
        connected: Callable[[], bool],
        unbind: Callable[[], None],
        free_caches: Callable[[], list[str]],
        client: Callable[[], Client],
        say: SayFn,
        clock: Callable[[], float],
    ):
        self.leases = leases
        self.settings = settings
        self.read = read
        self.connected = connected
        self.unbind = unbind
        self.free_caches = free_caches
        self.client = client
        self.say = say
        self.clock = clock
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failures = 0
        #: display id -> the countdown text it shows now.
        self._countdowns: dict[str, str] = {}
        #: (lease id, reclaim_at) of free-cache requests served.
        self._freed: set[tuple[Any, Any]] = set()

    # -- the thread ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start the daemon thread that follows this kernel's lease (once)."""
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return
            if not self.connected():
                return
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="gpusched-watcher", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        self._thread = None

    @property
    def watching(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _loop(self) -> None:
        while not self._stop.wait(self.settings.poll):
            if self.leases.claiming:
                continue  # the claim loop reads the lease itself and says what it sees
            try:
                self.watch_once()
            except Exception:
                log.exception("gpusched watcher poll failed")

    def watch_once(self) -> None:
        """One poll: read the lease, act on ``free-cache``, show notices about changes."""
        if not self.connected():
            return
        try:
            self.read()
        except GPUSchedError as err:
            self._failures += 1
            if self._failures == WATCH_FAILURES_BEFORE_NOTICE:
                self.say(f"GPU scheduler: lost contact ({err}). Notices pause until it answers again.")
            return
        self._failures = 0

    # -- notices ------------------------------------------------------------------------------
    def report(self, previous: dict | None, current: dict | None) -> None:
        """Show what changed from ``previous`` to ``current`` (whoever read the lease calls this)."""
        view = self.leases.view()
        found = _notices.notices(
            previous,
            current,
            self.clock(),
            released_by_me=view.released_by_me,
            asks_again=not view.user_released,
        )
        for notice in found:
            self._show(notice, current)

    def _show(self, notice: Notice, current: dict | None) -> None:
        say = self.say
        if notice.kind == NoticeKind.FREE_CACHE:
            if notice.key not in self._freed:
                self._freed.add(notice.key)
                self._free_caches(notice, current or {})
        elif notice.kind == NoticeKind.RECLAIM_WARNING:
            display_id = notice.display_id or ""
            if self._countdowns.get(display_id) != notice.text:
                update = display_id in self._countdowns
                self._countdowns[display_id] = notice.text
                say(notice.text, notice.html, display_id, update)
        elif notice.kind in COUNTDOWN_ENDS:
            # Said only in place of a countdown on screen: no countdown shown, nothing to end.
            if notice.display_id in self._countdowns:
                del self._countdowns[notice.display_id]
                say(notice.text, notice.html, notice.display_id, True)
        else:
            if notice.unbind:
                with contextlib.suppress(Exception):
                    self.unbind()
            say(notice.text, notice.html, notice.display_id, notice.update)

    def _free_caches(self, notice: Notice, lease: dict) -> None:
        """Serve a free-cache request: drop the frameworks' caches, tell the server, say which."""
        freed = self.free_caches()
        self._acknowledge(notice.lease_id, freed)
        text = _notices.freed_text(lease, freed)
        if text:
            self.say(text)

    def _acknowledge(self, lease_id: str | None, frameworks: list[str]) -> None:
        """Tell the server the free-cache step is done, so it need not wait polls to assume so.

        Best effort: an older server without the endpoint (404) or one that does not answer
        leaves the server to its own timing; neither may reach the user's cell or the watcher.
        """
        if not lease_id:
            return
        try:
            self.client().freed(lease_id, list(frameworks))
        except GPUSchedError as err:
            log.debug("lease %s: the server took no free-cache acknowledgement (%s)", lease_id, err)
        except Exception:  # noqa: BLE001 - never into the user's cell, never stop the watcher
            log.exception("lease %s: acknowledging the free-cache step failed", lease_id)
