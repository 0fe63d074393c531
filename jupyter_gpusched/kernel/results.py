"""What ``gpu.acquire()``, ``gpu.keep()`` and ``gpu.status()`` return: the server's JSON as a
dict (every field as before: ``lease["state"]``, ``status["devices"]``), shown as the few lines
``%gpu`` would print instead of some 200 lines of raw JSON."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from . import render


class _Shown(dict):
    """A dict that a notebook shows as text (``repr``) and, where it can, HTML."""

    def text(self) -> str:  # pragma: no cover - each subclass says it
        raise NotImplementedError

    def __repr__(self) -> str:
        return self.text()

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text("..." if cycle else self.text())


class GPULease(_Shown):
    """This kernel's lease: the server's lease JSON, shown as one line.

    ``lease["devices"]`` and every other field are there as the server sent them; ``dict(lease)``
    is the plain dict.
    """

    def text(self) -> str:
        return f"<GPU lease: {render.lease_line(self, time.time())}>"

    @property
    def state(self) -> str | None:
        return self.get("state")

    @property
    def devices(self) -> list[str]:
        """The GPUs' UUIDs, in the order CUDA numbers them in this kernel."""
        return render.device_uuids(self)


class GPUStatus(_Shown):
    """The scheduler's status as ``%gpu`` shows it: this kernel's lease, the GPUs, the queue.

    ``status["leases"]``, ``status["devices"]`` and every other field are there as the server
    sent them; ``status["lease"]`` is this kernel's (``None`` when it holds none).
    """

    def _report(self) -> tuple[str, str]:
        return render.status_report(
            self, self.get("kernel_id"), self.get("lease"), time.time(), first_cell=self.get("first_cell")
        )

    def text(self) -> str:
        return self._report()[0]

    def _repr_html_(self) -> str:
        return self._report()[1]


def lease_result(lease: Mapping[str, Any] | None) -> GPULease | None:
    return None if lease is None else GPULease(lease)


def status_result(status: Mapping[str, Any]) -> GPUStatus:
    out = GPUStatus(status)
    if out.get("lease") is not None:
        out["lease"] = GPULease(out["lease"])
    return out
