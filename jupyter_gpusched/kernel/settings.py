"""What the kernelspec asked for, as the provisioner passes it in the kernel's environment."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

from . import render
from .client import Client

log = logging.getLogger("jupyter_gpusched.kernel")

ENV_GPUS = "JUPYTER_GPUSCHED_GPUS"
ENV_MEMORY = "JUPYTER_GPUSCHED_MEMORY"
ENV_MODE = "JUPYTER_GPUSCHED_MODE"
ENV_BIND = "JUPYTER_GPUSCHED_BIND"
ENV_POLL = "JUPYTER_GPUSCHED_POLL"

MODES = ("exclusive", "shared")
BINDS = ("lazy", "launch")


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

    @property
    def lazy(self) -> bool:
        """The pre-run hook claims the kernelspec's GPUs before the first cell by itself."""
        return self.auto_bind and self.bind == "lazy"

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
        if bind not in BINDS:
            log.warning("%s=%r ignored: use lazy or launch", ENV_BIND, bind)
            bind = "lazy"
        try:
            poll = float(env.get(ENV_POLL, "3") or "3")
        except ValueError:
            poll = 3.0
        poll = min(max(poll, 0.2), 60.0)
        return cls(gpus=max(gpus, 0), memory=memory, mode=mode, bind=bind, poll=poll, provisioned=provisioned)
