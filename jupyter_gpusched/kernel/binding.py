"""Pointing CUDA at a lease's GPUs (``CUDA_VISIBLE_DEVICES``), and hiding them again after.

CUDA reads the variable once, when it initializes: a kernel is bound by setting it before that,
and one that initialized CUDA already is told plainly that only a restart moves it (see
:mod:`.cuda` for how that is found out). A shared lease's memory share is set at the same moment,
in the variables the frameworks read when they start (see :mod:`.limits`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from . import render

if TYPE_CHECKING:
    from .cuda import CudaState
    from .limits import Keeper
    from .output import SayFn

log = logging.getLogger("jupyter_gpusched.kernel")


class Binding:
    """The kernel's ``CUDA_VISIBLE_DEVICES``, kept in step with its lease.

    Args:
        environ: the kernel's environment as it started (its own ``CUDA_VISIBLE_DEVICES``).
        limits: the shared lease's memory share, set and cleared with the binding.
        cuda_probe: tells whether CUDA is initialized in this process.
        say: shows a line in the cell.
        provisioned: the provisioner started the kernel (an unbound one sees no GPU).
    """

    def __init__(
        self,
        environ: Mapping[str, str],
        limits: Keeper,
        cuda_probe: Callable[[], CudaState],
        say: SayFn,
        provisioned: bool,
    ):
        self.limits = limits
        self.cuda_probe = cuda_probe
        self.say = say
        self.provisioned = provisioned
        cvd = environ.get("CUDA_VISIBLE_DEVICES")
        self.original = cvd
        #: What this process's CUDA_VISIBLE_DEVICES was last set to (or found as).
        self.bound: str | None = cvd
        #: The binding the user was told is too late for (said once, not at every cell).
        self.warned: str | None = None

    def ensure(self, lease: Mapping[str, Any], *, resumed: bool = False) -> str | None:
        """Point CUDA at the lease's devices if CUDA is not initialized yet; else say why not.

        Returns the message shown, if any.
        """
        uuids = render.device_uuids(lease)
        if not uuids:
            return None
        want = ",".join(uuids)
        current = os.environ.get("CUDA_VISIBLE_DEVICES")
        if current == want:
            self.bound = want
            self.limits.apply(lease)
            return None
        if self.warned == want:
            return None
        state = self.cuda_probe()
        if not state.initialized:
            os.environ["CUDA_VISIBLE_DEVICES"] = want
            os.environ["NVIDIA_VISIBLE_DEVICES"] = want
            self.bound = want
            self.limits.apply(lease)
            log.info("bound kernel to %s (lease %s)", want, lease.get("id"))
            if state.loaded:
                message = (
                    f"This kernel now sees {render.gpu_label(lease)} ({want}). The CUDA library was "
                    "already loaded, though not initialized; if CUDA code still cannot see the GPU, "
                    "restart the kernel."
                )
                self.say(message)
                return message
            return None
        if resumed:
            # The restore moved this process's CUDA context; nothing to change or to explain.
            self.bound = want
            self.limits.apply(lease)
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
        self.warned = want
        self.say(message)
        return message

    def unbind(self) -> None:
        """After the lease ended: no limits, and the GPUs hidden again if CUDA has not started on them."""
        self.limits.clear()
        if not self.bound:
            return
        if self.cuda_probe().initialized:
            return
        value = "" if self.provisioned else self.original
        if value is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            os.environ.pop("NVIDIA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = value
            os.environ["NVIDIA_VISIBLE_DEVICES"] = value or "none"
        self.bound = value
        self.warned = None
