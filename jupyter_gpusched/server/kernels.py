"""The kernels of this Jupyter server, as the arbiter sees them.

Idleness comes from execution, not from messages: ipywidgets comm traffic makes a kernel report
``busy`` too, so this watches each kernel's IOPub stream for status messages whose parent is an
``execute_request`` and ignores the rest.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any, Mapping

from jupyter_client.session import Session

from ..procs import process_trees

log = logging.getLogger("jupyter_gpusched")


class _Watch:
    def __init__(self) -> None:
        self.executing = False
        self.last_execute: float | None = None
        self.started: float | None = None
        self.stream: Any = None
        #: Counted as running from jupyter_server's word, not from a busy this watch saw: until
        #: the kernel's next "idle" (whatever its parent) or jupyter_server's state says idle.
        self.unsure = False


class ServerKernels:
    """:class:`~jupyter_gpusched.arbiter.KernelHost` over a jupyter_server kernel manager."""

    def __init__(self, kernel_manager: Any, session_manager: Any = None, clock=time.time) -> None:
        self.km = kernel_manager
        self.sessions = session_manager
        self.clock = clock
        self.server_id = uuid.uuid4().hex
        self._watches: dict[str, _Watch] = {}
        self._launching: set[str] = set()
        self._ended: set[str] = set()
        self._restarting: set[str] = set()
        self._notebooks: dict[str, str] = {}

    # -- registration ---------------------------------------------------------------------
    def launching(self, kernel_id: str) -> None:
        """The provisioner is about to start this kernel."""
        self._launching.add(kernel_id)
        self._ended.discard(kernel_id)

    def restart_requested(self, kernel_id: str) -> None:
        """A deliberate restart is under way: the lease stays with the kernel."""
        self._restarting.add(kernel_id)

    def started(self, kernel_id: str) -> None:
        # A restarted kernel stays "restarting" until its new process owns its lease (adopted).
        self._launching.discard(kernel_id)
        watch = self._watches.pop(kernel_id, None)
        if watch is not None and watch.stream is not None:
            try:
                watch.stream.close()
            except Exception:  # noqa: BLE001 - the old process's stream is gone already
                pass

    def executing(self, kernel_id: str) -> bool:
        """The kernel has published "busy" for a cell (IOPub) and not "idle" since."""
        watch = self._watches.get(kernel_id)
        if watch is not None and watch.unsure:
            self._settle(kernel_id, watch)
        return bool(watch is not None and watch.executing)

    def asking(self, kernel_id: str) -> None:
        """The kernel asks for a GPU from its own code, so it runs a cell now (a lazily bound
        kernel's first cell claims its GPU while it runs) or a comm's handler.

        A watch that began after that cell did never saw its "busy": where jupyter_server (which
        watches every kernel from its start) says the kernel is busy and the watch does not, the
        kernel counts as running until it is idle again.
        """
        watch = self._watch(kernel_id)
        if watch.executing or watch.stream is None or self._server_state(kernel_id) != "busy":
            return
        now = self.clock()
        watch.executing, watch.unsure = True, True
        watch.started = watch.last_execute = now

    def _server_state(self, kernel_id: str) -> str | None:
        try:
            return getattr(self.km.get_kernel(kernel_id), "execution_state", None)
        except Exception:  # noqa: BLE001 - jupyter_server raises HTTPError(404) for unknown ids
            return None

    def _settle(self, kernel_id: str, watch: _Watch) -> None:
        """An unsure watch follows jupyter_server's state: its IOPub stream, connected mid-cell,
        may have missed the cell's end."""
        if self._server_state(kernel_id) != "busy":
            watch.executing = watch.unsure = False
            watch.last_execute = self.clock()

    def restarting(self, kernel_id: str) -> bool:
        return kernel_id in self._restarting

    def adopted(self, kernel_id: str) -> None:
        """The kernel's new process owns its lease now."""
        self._restarting.discard(kernel_id)

    def ended(self, kernel_id: str) -> None:
        self._launching.discard(kernel_id)
        self._restarting.discard(kernel_id)
        self._ended.add(kernel_id)
        watch = self._watches.pop(kernel_id, None)
        if watch is not None and watch.stream is not None:
            try:
                watch.stream.close()
            except Exception:  # noqa: BLE001 - already closed with the kernel
                pass

    def _watch(self, kernel_id: str) -> _Watch:
        watch = self._watches.get(kernel_id)
        if watch is not None:
            return watch
        watch = self._watches[kernel_id] = _Watch()
        try:
            kernel = self.km.get_kernel(kernel_id)
            stream = kernel.connect_iopub()
        except Exception:  # noqa: BLE001 - kernel not ready yet: try again next tick
            del self._watches[kernel_id]
            return _Watch()
        session = Session(config=kernel.session.config, key=kernel.session.key)

        def on_message(msg_list: list) -> None:
            try:
                _, fed = session.feed_identities(msg_list)
                msg = session.deserialize(fed, content=False)
                if msg["header"]["msg_type"] != "status":
                    return
                parent = (msg.get("parent_header") or {}).get("msg_type")
                if parent != "execute_request" and not watch.unsure:
                    return
                msg = session.deserialize(fed)
                state = msg["content"].get("execution_state")
                now = self.clock()
                if watch.unsure:
                    if state != "idle":
                        return
                    watch.unsure = False
                if state == "busy" and not watch.executing:
                    watch.started = now
                watch.executing = state == "busy"
                watch.last_execute = now
            except Exception:  # noqa: BLE001 - a malformed message must not kill the watch
                log.debug("kernel %s: unreadable IOPub message", kernel_id, exc_info=True)

        stream.on_recv(on_message)
        watch.stream = stream
        return watch

    # -- KernelHost -----------------------------------------------------------------------
    def activity(self) -> Mapping[str, tuple[bool, float | None, float | None]]:
        out = {}
        for kernel_id in list(self.km.list_kernel_ids()):
            watch = self._watch(kernel_id)
            if watch.unsure:
                self._settle(kernel_id, watch)
            out[kernel_id] = (watch.executing, watch.last_execute, watch.started)
        return out

    def alive(self, kernel_id: str) -> bool | None:
        if kernel_id in self.km:
            return True
        if kernel_id in self._launching:
            return True
        if kernel_id in self._ended:
            return False
        return None

    def kernel_pid(self, kernel_id: str) -> int | None:
        if kernel_id not in self.km:
            return None  # not registered yet (being launched) or gone
        try:
            kernel = self.km.get_kernel(kernel_id)
        except Exception:  # noqa: BLE001 - jupyter_server raises HTTPError(404) for unknown ids
            return None
        provisioner = getattr(kernel, "provisioner", None)
        pid = getattr(provisioner, "pid", None)
        if pid is None:
            process = getattr(provisioner, "process", None)
            pid = getattr(process, "pid", None)
        return int(pid) if pid else None

    def process_tree(self, kernel_id: str) -> set[int]:
        pid = self.kernel_pid(kernel_id)
        if pid is None:
            return set()
        return process_trees({kernel_id: pid}).get(kernel_id, {pid})

    def process_trees(self) -> dict[str, set[int]]:
        """Every kernel's process tree, from one scan of the process table."""
        pids = {}
        for kernel_id in list(self.km.list_kernel_ids()):
            pid = self.kernel_pid(kernel_id)
            if pid is not None:
                pids[kernel_id] = pid
        return process_trees(pids)

    def notebook(self, kernel_id: str) -> str | None:
        return self._notebooks.get(kernel_id)

    def user_of(self, kernel_id: str) -> str | None:
        # Every kernel of this server is its user's; views of this server show them all.
        return None

    async def refresh_notebooks(self) -> None:
        """Notebook paths by kernel, from the session manager."""
        if self.sessions is None:
            return
        try:
            sessions = await self.sessions.list_sessions()
        except Exception:  # noqa: BLE001 - sessions are a nicety for display only
            return
        self._notebooks = {
            s["kernel"]["id"]: s.get("path") or s.get("name") for s in sessions if s.get("kernel")
        }

    async def restart(self, kernel_id: str) -> None:
        log.info("kernel %s: restarting to free its GPU", kernel_id)
        await self.km.restart_kernel(kernel_id)

    async def shutdown(self, kernel_id: str) -> None:
        log.info("kernel %s: shutting down to free its GPU", kernel_id)
        await self.km.shutdown_kernel(kernel_id)
        self.ended(kernel_id)
