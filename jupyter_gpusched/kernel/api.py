"""The Python API: ``from jupyter_gpusched import gpu``.

``gpu`` talks for the kernel it runs in. Using it loads the kernel agent into the running IPython
(so that a lease taken here is also restored after a checkpoint), and works without IPython too,
minus the notices in cells.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from .agent import Agent, get_agent
from .results import GPULease, status_result


class GPU:
    """This kernel's GPUs. Errors from the server raise ``GPUSchedError`` (its message says
    what to do); bad arguments raise ``ValueError``."""

    def __init__(self, agent: Agent | None = None):
        self._agent = agent

    @property
    def agent(self) -> Agent:
        return self._agent if self._agent is not None else get_agent()

    @property
    def has_scheduler(self) -> bool:
        """Whether a GPU scheduler serves this kernel. Without one, every call here raises
        ``NoServerError`` (a ``GPUSchedError``) saying why, and ``%gpu`` says so."""
        return self.agent.has_scheduler

    def acquire(
        self,
        count: int | None = None,
        memory: int | str | None = None,
        mode: str | None = None,
        wait: float | str | bool | None = None,
        priority: int | None = None,
    ) -> dict:
        """Ask for ``count`` GPUs and make them this kernel's CUDA devices.

        Args:
            count: how many GPUs (default: the kernelspec's, else 1).
            memory: memory per GPU, a size with its unit (``"16GiB"``, ``"512MiB"``) or a
                number of bytes from 1 MiB up (default: a whole GPU, or the kernelspec's). A
                string without a unit (``"16"``) or a number under 1 MiB (``16``) is refused.
            mode: ``"exclusive"`` or ``"shared"`` (default: the kernelspec's).
            wait: ``None`` waits without a limit (showing the queue position), ``0`` or
                ``False`` returns at once (a pending lease keeps its place in the queue),
                a duration with its unit (``"10m"``, ``"90s"``) or a number of seconds waits
                that long and then withdraws the request (``"10"``, without a unit, is refused).
            priority: a priority among this user's own claims.

        Returns:
            The lease: a dict (``state``, ``devices``, ``position``, ...) shown as one line.
        """
        return GPULease(self.agent.acquire(count, memory=memory, mode=mode, wait=wait, priority=priority))

    def release(self, free: bool = False) -> dict | None:
        """Give this kernel's GPUs back now; returns the released lease (``None``: none held).

        ``free=True`` empties the frameworks' memory caches (PyTorch, CuPy) first. Memory this
        kernel still holds on those GPUs stays counted as taken there until it is freed.
        """
        return self.agent.release(free=free)

    def keep(self, duration: float | str = "30m") -> dict:
        """No idle reclaim of this kernel's lease for ``duration``: a duration with its unit
        (``"30m"``, ``"2h"``) or a number of seconds; 0 stops keeping. ``"30"`` is refused."""
        return GPULease(self.agent.keep(duration))

    def status(self) -> dict:
        """The scheduler's status: ``devices``, ``leases``, ``queue``, ``policy``, ... plus
        ``kernel_id`` and this kernel's ``lease`` (``None`` when it holds none): a dict shown as
        ``%gpu`` shows it."""
        return status_result(self.agent.status())

    def panel(self, interval: float = 2.0) -> Any:
        """The live status panel (an ipywidgets box); display it or leave it as a cell's value."""
        return self.agent.panel(interval=interval)

    @contextlib.contextmanager
    def lease(self, *args: Any, **kwargs: Any) -> Iterator[dict]:
        """``with gpu.lease(1): ...``: acquire on entry (the arguments of :meth:`acquire`), release on exit.

        A lease the kernel already held before the block is left as it was.
        """
        before = self.agent.refresh()
        held = bool(before and before.get("state") in ("active", "idle", "reclaiming", "suspended"))
        lease = self.acquire(*args, **kwargs)
        if held and before.get("id") == lease.get("id"):
            yield lease
            return
        try:
            yield lease
        finally:
            # Whatever the block left on the GPU is freed as far as the frameworks can.
            self.agent.release(quiet=True, free=True)

    def __repr__(self) -> str:
        from .agent import existing_agent

        agent = self._agent or existing_agent()
        lease = agent.lease if agent is not None else None
        if lease is None:
            return "<gpu: run gpu.status() or %gpu for this kernel's GPUs>"
        from . import render

        return f"<gpu: {render.lease_line(lease, agent.clock())}>"


gpu = GPU()
