"""``GPUSchedApp``: the Jupyter server extension (configuration: ``c.GPUSchedApp.<trait>``)."""

from __future__ import annotations

import asyncio
import getpass
import logging
import os

from jupyter_server.extension.application import ExtensionApp
from traitlets import Bool, TraitError, Unicode, default, validate

from ..core import SchedulingError
from ..config import SCHEDULING_TRAITS, SchedulingConfig, one_of, open_inventory

__all__ = ["GPUSchedApp", "SCHEDULING_TRAITS", "SchedulingConfig", "open_inventory"]

#: The logger of the whole package (arbiter, ledger, devices, reclaim and their children).
PACKAGE_LOGGER = "jupyter_gpusched"


class GPUSchedApp(SchedulingConfig, ExtensionApp):
    """Fair, dynamic GPU sharing for the kernels of this server."""

    name = "jupyter_gpusched"
    description = "Fair, dynamic GPU sharing for Jupyter kernels"
    load_other_extensions = True

    broker_url = Unicode(
        help="""URL of the hub's GPU broker service. When set (or JUPYTER_GPUSCHED_BROKER_URL is),
        this server asks the broker for GPUs instead of scheduling them itself. On the broker's
        own host use its Unix socket, http+unix://<socket path, %-encoded>/services/gpusched/
        (the server checks before each connection that only the broker's user can have made the
        socket); elsewhere https://... (the broker's certificate verified with broker_ca). A plain
        http:// URL works but sends the server's token to whoever holds that address.""",
    ).tag(config=True)

    broker_ca = Unicode(
        help="""CA certificate file (PEM) that the broker's certificate must be signed by, for an
        https:// broker_url. Default: the environment variable JUPYTER_GPUSCHED_BROKER_CA, else
        JupyterHub's internal_ssl CA of this server (JUPYTERHUB_SSL_CLIENT_CA); empty: the
        system's trusted authorities.""",
    ).tag(config=True)

    simulated_state_path = Unicode(
        "",
        help="""File where simulated GPUs record which processes use them; empty: next to the
        ledger. Kernels find it through JUPYTER_GPUSCHED_SIM_STATE.""",
    ).tag(config=True)

    unleased_processes = Unicode(
        "report",
        help="""GPU processes that hold memory without a lease: 'report' them (status, CLI, log) or
        'kill' them (SIGTERM; only this server's Unix user's processes, never one under a live
        lease's kernel).""",
    ).tag(config=True)

    _valid_unleased = one_of("unleased_processes", ("report", "kill"))

    mps = Unicode(
        "auto",
        help="""NVIDIA MPS for shared leases: 'auto' starts one MPS control daemon per GPU when
        nvidia-cuda-mps-control is on PATH (pipes and logs under the runtime directory), and a
        kernel whose shared lease is on one GPU becomes its client, held to its memory share by
        the driver (CUDA_MPS_PINNED_DEVICE_MEM_LIMIT), with the same part of the GPU's compute
        (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, rounded up to a whole percent); 'off' starts none. Without MPS (off, absent,
        hub mode) shared leases get the frameworks' own memory limits only.""",
    ).tag(config=True)

    _valid_mps = one_of("mps", ("auto", "off"))

    show_holders = Bool(True, help="Show who holds each GPU (always true for a single user's server).").tag(
        config=True
    )

    #: Set while the extension runs (None before and after).
    registry = None
    _stopped = False
    _log_parent = None
    _log_level_set = False

    @default("broker_url")
    def _broker_url_default(self) -> str:
        return os.environ.get("JUPYTER_GPUSCHED_BROKER_URL", "")

    @validate("broker_url")
    def _valid_broker_url(self, proposal):
        value = proposal["value"].strip()
        if value:
            from ..transport import parse_broker_url

            try:
                parse_broker_url(value)
            except ValueError as exc:
                raise TraitError(str(exc)) from None
        return value

    @default("broker_ca")
    def _broker_ca_default(self) -> str:
        return os.environ.get("JUPYTER_GPUSCHED_BROKER_CA") or os.environ.get("JUPYTERHUB_SSL_CLIENT_CA", "")

    def _wire_logging(self) -> None:
        """Send the package's log records (grants, queueing, reclaims, ...) to the server's log.

        The package logs to ``logging.getLogger("jupyter_gpusched")``, which jupyter_server's
        logging setup never hears of: its records would fall through to the root logger, which
        has no handler, and info lines would be lost. jupyter_server hooks tornado's loggers up
        to its own the same way: by making the app's logger their parent, so that they take its
        handlers, format and level (``--log-level``).
        """
        package_log = logging.getLogger(PACKAGE_LOGGER)
        if package_log.parent is not self.log:
            self._log_parent = package_log.parent
            package_log.parent = self.log
            if package_log.level == logging.NOTSET:
                # The app's logger passes every level and leaves the choice to its handlers: the
                # package's debug lines (one per ledger write) would each become a record only to
                # be dropped. Below ``--log-level`` they are not made at all.
                package_log.setLevel(self._server_log_level())
                self._log_level_set = True

    def _unwire_logging(self) -> None:
        parent = self._log_parent
        package_log = logging.getLogger(PACKAGE_LOGGER)
        if parent is not None and package_log.parent is self.log:
            package_log.parent = parent
            if self._log_level_set:
                package_log.setLevel(logging.NOTSET)
        self._log_parent = None
        self._log_level_set = False

    def _server_log_level(self) -> int:
        level = getattr(self.serverapp, "log_level", logging.NOTSET) if self.serverapp is not None else logging.NOTSET
        if isinstance(level, str):
            level = logging.getLevelName(level.upper())
        return level if isinstance(level, int) else logging.NOTSET

    def _link_jupyter_server_extension(self, serverapp) -> None:
        """Read this extension's config; a setting it refuses stops the server.

        jupyter_server logs an extension's failure to link and goes on with the extension's
        defaults: a scheduler on other GPUs, another ledger or no broker. That must not happen.
        """
        try:
            super()._link_jupyter_server_extension(serverapp)
        except (TraitError, SchedulingError) as exc:
            message = f"GPU scheduler: bad configuration: {exc}. The server does not start."
            (serverapp.log if serverapp is not None else self.log).critical(message)
            raise SystemExit(message) from None

    def initialize_settings(self) -> None:
        self._wire_logging()
        from . import registry
        from .kernels import ServerKernels

        serverapp = self.serverapp
        kernels = ServerKernels(serverapp.kernel_manager, serverapp.session_manager)
        user = os.environ.get("JUPYTERHUB_USER") or getpass.getuser()
        reg = registry.Registry(kernels=kernels, user=user, log=self.log)

        if self.broker_url:
            from ..arbiter.remote import BrokerClient

            arbiter = BrokerClient(
                self.broker_url, kernels=kernels, user=user, log=self.log, ca_file=self.broker_ca or None
            )
        else:
            from ..arbiter.build import build_local_arbiter

            arbiter, state_path = build_local_arbiter(
                self,
                kernels=kernels,
                log=self.log,
                simulated_state_path=self.simulated_state_path,
                show_holders=True,
                unleased_processes=self.unleased_processes,
            )
            if arbiter.backend_name == "simulated":
                reg.sim_state = state_path
            self.log.info("GPU scheduler: ledger %s, policy %s", arbiter.ledger.path, self.policy)
        reg.arbiter = arbiter
        reg.mps = self._make_mps(arbiter)
        registry.install(reg)
        self.registry = reg
        self.settings.update({"gpusched_arbiter": arbiter, "gpusched_registry": reg})

    def _make_mps(self, arbiter):
        from .mps import MPS

        root = os.path.join(self.serverapp.runtime_dir, "gpusched-mps")
        return MPS(self.mps, root, hub=bool(self.broker_url), backend=getattr(arbiter, "backend_name", "none"))

    async def _start_mps(self) -> None:
        mps = self.registry.mps
        if not mps.wanted:
            mps.start(())  # says why not, once
            return

        def gpus() -> list[str]:
            snap = self.registry.arbiter.backend.snapshot()
            parents = {d.parent_uuid for d in snap if d.parent_uuid}
            return [d.uuid for d in snap if d.uuid not in parents]

        try:
            uuids = await asyncio.to_thread(gpus)
        except Exception as err:  # noqa: BLE001 - no GPUs to list: no daemons, and kernels are told
            mps.state, mps.reason = "failed", f"the GPUs could not be listed for MPS: {err}"
            self.log.warning("GPU scheduler: %s", mps.reason)
            return
        await asyncio.to_thread(mps.start, uuids)

    def initialize_handlers(self) -> None:
        from .handlers import default_handlers

        self.handlers.extend(default_handlers)

    async def _start_jupyter_server_extension(self, serverapp) -> None:
        self.registry.url = serverapp.connection_url
        listener = self._on_kernel_action
        serverapp.event_logger.add_listener(
            schema_id="https://events.jupyter.org/jupyter_server/kernel_actions/v1", listener=listener
        )
        await self._start_mps()
        await self.registry.arbiter.start()

    async def _on_kernel_action(self, logger, schema_id: str, data: dict) -> None:
        action, kernel_id = data.get("action"), data.get("kernel_id")
        if not kernel_id or data.get("status") == "error" or self._stopped:
            return
        if action == "shutdown":
            self.registry.kernels.ended(kernel_id)
            self.registry.tokens.revoke(kernel_id)
            await self.registry.arbiter.kernel_ended(kernel_id, "the kernel was shut down")

    async def stop_extension(self) -> None:
        from . import registry

        reg = self.registry
        if reg is None:
            self._unwire_logging()
            return
        self._stopped = True
        try:
            self.serverapp.event_logger.remove_listener(listener=self._on_kernel_action)
        except Exception:  # noqa: BLE001 - older jupyter_events may not know the listener
            pass
        await reg.arbiter.stop()
        reg.arbiter.close()
        if reg.mps is not None:
            await asyncio.to_thread(reg.mps.stop)
        registry.install(None)
        self._unwire_logging()
