"""``gpusched-provisioner``: starts kernels with a GPU lease (docs/layers.md: a claim, from the handler to the ledger).

Selected by a kernelspec's metadata::

    "metadata": {"kernel_provisioner": {"provisioner_name": "gpusched-provisioner",
                 "config": {"gpus": 1, "memory": "16GiB", "mode": "exclusive", "bind": "lazy"}}}

``bind: lazy`` starts the kernel without GPUs (``CUDA_VISIBLE_DEVICES=""``) and the kernel agent
binds before the first cell runs; ``bind: launch`` asks before the kernel starts and hands it its
GPUs in ``CUDA_VISIBLE_DEVICES`` (UUIDs), and for a shared lease its memory share in the
frameworks' own variables (see ``kernel/limits.py``). A restart keeps the lease; a shutdown
releases it. Every kernel is told in ``JUPYTER_GPUSCHED_MPS`` whether the server runs MPS daemons
(``c.GPUSchedApp.mps``) and why not.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from jupyter_client.provisioning import LocalProvisioner
from traitlets import Int, Unicode, validate
from traitlets import TraitError

from .config import one_of
from .core import SchedulingError, parse_memory
from .kernel import limits

AGENT_ARG = "--InteractiveShellApp.extra_extensions=jupyter_gpusched.kernel"
#: How long ``bind: launch`` waits for GPUs before starting the kernel to bind at its first cell.
LAUNCH_WAIT = 20.0


class GPUSchedProvisioner(LocalProvisioner):  # type: ignore[misc]
    """A local kernel whose GPUs come from the GPU scheduler."""

    gpus = Int(1, help="GPUs for the kernel; 0 gives it none.").tag(config=True)
    memory = Unicode("", help="GPU memory per GPU, e.g. '16GiB'; empty: whole GPUs.").tag(config=True)
    mode = Unicode("exclusive", help="'exclusive' or 'shared'.").tag(config=True)
    bind = Unicode("lazy", help="'lazy' (at the first cell) or 'launch' (before the kernel starts).").tag(
        config=True
    )

    _valid_bind = one_of("bind", ("lazy", "launch"))

    _valid_mode = one_of("mode", ("exclusive", "shared"))

    @validate("gpus")
    def _valid_gpus(self, proposal):
        if proposal["value"] < 0:
            raise TraitError("gpus must be 0 or more")
        return proposal["value"]

    @validate("memory")
    def _valid_memory(self, proposal):
        try:
            parse_memory(proposal["value"] or None)
        except SchedulingError as exc:
            raise TraitError(str(exc)) from None
        return proposal["value"]

    def _is_ipython(self) -> bool:
        argv = " ".join(self.kernel_spec.argv)
        return "ipykernel" in argv

    async def pre_launch(self, **kwargs: Any) -> dict[str, Any]:
        from .server import registry

        env = dict(kwargs.pop("env", None) or os.environ)
        reg = registry.current()
        devices: tuple[str, ...] = ()
        if reg is None or reg.arbiter is None:
            self.log.warning(
                "kernel %s: the GPU scheduler extension is not running in this server; "
                "the kernel starts without GPUs",
                self.kernel_id,
            )
        else:
            reg.kernels.launching(self.kernel_id)
            token = reg.tokens.issue(self.kernel_id)
            env.update(
                {
                    "JUPYTER_GPUSCHED_URL": reg.url,
                    "JUPYTER_GPUSCHED_TOKEN": token,
                    "JUPYTER_GPUSCHED_KERNEL_ID": self.kernel_id,
                    "JUPYTER_GPUSCHED_GPUS": str(self.gpus),
                    "JUPYTER_GPUSCHED_MEMORY": self.memory,
                    "JUPYTER_GPUSCHED_MODE": self.mode,
                    "JUPYTER_GPUSCHED_BIND": self.bind,
                }
            )
            if reg.sim_state:
                env["JUPYTER_GPUSCHED_SIM_STATE"] = reg.sim_state
            mps = limits.MpsInfo(**reg.mps.info()) if reg.mps is not None else limits.MpsInfo()
            env[limits.ENV_MPS] = mps.to_json()
            lease = await self._lease_for_launch(reg)
            if lease is not None:
                devices = tuple(lease["devices"])
                env.update(await self._limits_env(reg, lease, mps))
        visible = ",".join(devices)
        env["CUDA_VISIBLE_DEVICES"] = visible
        env["NVIDIA_VISIBLE_DEVICES"] = visible or "void"
        if self._is_ipython():
            extra = list(kwargs.pop("extra_arguments", None) or [])
            if AGENT_ARG not in extra:
                extra.append(AGENT_ARG)
            kwargs["extra_arguments"] = extra
        kwargs["env"] = env
        return await super().pre_launch(**kwargs)

    async def _limits_env(self, reg, lease: dict, mps) -> dict[str, str]:
        """A shared lease's memory share in the frameworks' variables (empty for any other)."""
        from .api.views import Principal

        if lease.get("mode") != "shared" or not lease.get("memory"):
            return {}
        who = Principal(user=reg.user, kernel_id=self.kernel_id)
        try:
            totals = limits.totals_of(await reg.arbiter.devices(who))
        except Exception as exc:  # noqa: BLE001 - the limits are set without JAX's fraction
            self.log.warning("kernel %s: the GPUs' memory is unknown for its limits: %s", self.kernel_id, exc)
            totals = {}
        found = limits.limits_for(lease, totals, mps)
        if found is None:
            return {}
        env = found.environment()
        env[limits.ENV_LIMITS_SET] = ",".join(sorted(env))
        return env

    async def _lease_for_launch(self, reg) -> dict | None:
        """The lease to start the kernel with (its GPUs, mode and memory): its kept lease after
        a restart, or a fresh grant."""
        from .arbiter import ArbiterError
        from .api.input import Claim
        from .api.views import Principal

        lease = await reg.arbiter.lease_for_kernel(self.kernel_id)
        if lease is not None:
            if lease.holding:
                return {"devices": list(lease.devices), "mode": lease.mode, "memory": lease.memory}
            if lease.state.value == "suspended":
                # The checkpointed process is gone with the restart: nothing left to restore.
                await reg.arbiter.kernel_ended(self.kernel_id, "the kernel restarted while suspended")
        if self.bind != "launch" or self.gpus < 1:
            return None
        who = Principal(user=reg.user, kernel_id=self.kernel_id)
        try:
            ask = Claim(self.kernel_id, self.gpus, parse_memory(self.memory or None), self.mode, wait=LAUNCH_WAIT)
            result = await reg.arbiter.claim(who, ask)
        except ArbiterError as exc:
            self.log.warning("kernel %s: no GPU at launch: %s", self.kernel_id, exc.message)
            return None
        if result.status == 202:
            self.log.info(
                "kernel %s: still waiting for %s GPU(s) (position %s); it will bind at its first cell",
                self.kernel_id,
                self.gpus,
                result.lease.get("position"),
            )
            return None
        return result.lease

    async def post_launch(self, **kwargs: Any) -> None:
        await super().post_launch(**kwargs)
        from .server import registry

        reg = registry.current()
        if reg is not None and reg.arbiter is not None:
            reg.kernels.started(self.kernel_id)
            await reg.arbiter.kernel_started(self.kernel_id, reg.user, self.pid)

    async def shutdown_requested(self, restart: bool = False) -> None:
        await super().shutdown_requested(restart=restart)
        if restart:
            from .server import registry

            reg = registry.current()
            if reg is not None and reg.kernels is not None:
                reg.kernels.restart_requested(self.kernel_id)

    async def cleanup(self, restart: bool = False) -> None:
        await super().cleanup(restart=restart)
        if restart:
            return
        from .server import registry

        reg = registry.current()
        if reg is None or reg.arbiter is None:
            return
        reg.tokens.revoke(self.kernel_id)
        reg.kernels.ended(self.kernel_id)
        await reg.arbiter.kernel_ended(self.kernel_id, "the kernel was shut down")


def kernelspec_argv(python: str | None = None) -> list[str]:
    """The argv of an IPython kernelspec for ``python`` (default: this interpreter)."""
    return [python or sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
