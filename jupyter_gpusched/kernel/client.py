"""A small HTTP client for the server's ``api/gpusched`` REST API, used from inside a kernel.

Only the standard library: the kernel must not import tornado or jupyter_server. Every request
has a timeout, bypasses proxies (the server is the kernel's own Jupyter server) and turns any
failure into :class:`GPUSchedError`, whose message is meant for a person.
"""

from __future__ import annotations

import os
import urllib.parse
from collections.abc import Mapping
from typing import Any

from .._version import __version__
from ..rest import RestClient, RestError, running_servers

#: Seconds a plain request may take before the client gives up.
DEFAULT_TIMEOUT = 10.0
#: The server long-polls a claim for at most this many seconds.
MAX_LONG_POLL = 30.0

TOKEN_HEADER = "X-GPUSched-Token"

ENV_URL = "JUPYTER_GPUSCHED_URL"
ENV_TOKEN = "JUPYTER_GPUSCHED_TOKEN"
ENV_KERNEL_ID = "JUPYTER_GPUSCHED_KERNEL_ID"


NOT_RUN_BY_A_SERVER = (
    "No running Jupyter server runs this kernel (nbconvert, nbclient or a console started it, say), "
    "so no GPU scheduler serves it. Open the notebook in JupyterLab or Jupyter Server with "
    "jupyter_gpusched enabled to get a GPU."
)


class GPUSchedError(Exception):
    """A request to the GPU scheduler failed; ``message`` says what happened and what to do.

    ``status`` is the HTTP status (``None`` when the server could not be reached) and
    ``reason`` the server's short reason, when it gave one.
    """

    def __init__(self, message: str, status: int | None = None, reason: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.reason = reason

    def __str__(self) -> str:
        return self.message

    def _render_traceback_(self) -> list[str]:
        # IPython shows this instead of a traceback: a user needs the message, not our stack.
        text = self.message.replace("`", "")  # plain text: no markdown code marks
        return [f"\x1b[0;31m{type(self).__name__}\x1b[0m: {text}"]


class NoServerError(GPUSchedError):
    """No Jupyter server with the GPU scheduler extension could be found for this kernel."""


class Client:
    """Talks to ``<base_url>api/gpusched/...`` on behalf of one kernel.

    Args:
        base_url: the server's URL including its base_url path, e.g. ``http://127.0.0.1:8888/``.
        kernel_token: the per-kernel token (sent as ``X-GPUSched-Token``).
        server_token: a Jupyter server token (sent as ``Authorization: token ...``), used when
            the kernel was not started by the provisioner.
        kernel_id: the id of the kernel this client speaks for.
        timeout: seconds for a request without long-polling.
    """

    def __init__(
        self,
        base_url: str,
        *,
        kernel_token: str | None = None,
        server_token: str | None = None,
        kernel_id: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
    ):
        headers = {
            "Accept": "application/json",
            "User-Agent": f"jupyter-gpusched-kernel/{__version__}",
        }
        if kernel_token:
            headers[TOKEN_HEADER] = kernel_token
            server_token = None
        self._rest = RestClient(base_url, server_token, headers=headers, timeout=timeout, local=True)
        self.base_url = self._rest.base_url
        self.kernel_id = kernel_id

    @property
    def timeout(self) -> float:
        """Seconds for a request without long-polling."""
        return self._rest.timeout

    @timeout.setter
    def timeout(self, value: float) -> None:
        self._rest.timeout = value

    def __repr__(self) -> str:
        return f"Client({self.base_url!r}, kernel_id={self.kernel_id!r})"

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> Client | None:
        """The client the kernel provisioner configured, or ``None`` if it set nothing."""
        env = os.environ if environ is None else environ
        url = env.get(ENV_URL, "").strip()
        token = env.get(ENV_TOKEN, "").strip()
        kernel_id = env.get(ENV_KERNEL_ID, "").strip()
        if not (url and token and kernel_id):
            return None
        return cls(url, kernel_token=token, kernel_id=kernel_id)

    @classmethod
    def discover(
        cls,
        kernel_id: str | None = None,
        runtime_dir: str | None = None,
        timeout: float = 3.0,
    ) -> Client:
        """Find the running Jupyter server of this kernel from its ``jpserver-*.json`` files.

        Only a server that knows ``kernel_id`` (runs this kernel) and answers on
        ``api/gpusched/status`` serves it: another server's scheduler would list its GPUs but
        never grant this kernel one. Raises :class:`NoServerError` with a plain explanation
        when there is none.
        """
        if runtime_dir is None:
            from jupyter_core.paths import jupyter_runtime_dir

            runtime_dir = jupyter_runtime_dir()
        servers = running_servers(runtime_dir)
        if not servers:
            raise NoServerError(
                f"No running Jupyter server was found (no jpserver-*.json in {runtime_dir}), so no "
                "server with the GPU scheduler extension either. Start this kernel from "
                "JupyterLab or Jupyter Server with jupyter_gpusched enabled."
            )
        if not kernel_id:
            # Its connection file is not one a server writes (kernel-<id>.json): no server runs it.
            raise NoServerError(NOT_RUN_BY_A_SERVER)
        owner_without_extension: str | None = None
        for info in servers:
            client = cls(
                info["url"],
                server_token=info.get("token") or None,
                kernel_id=kernel_id,
                timeout=timeout,
            )
            try:
                owns = client.request("GET", f"api/kernels/{urllib.parse.quote(kernel_id)}")[0] == 200
            except GPUSchedError:
                owns = False
            if not owns:
                continue
            try:
                client.request("GET", "api/gpusched/status")
            except GPUSchedError as err:
                if err.status in (404, None):
                    owner_without_extension = client.base_url
                    continue
                # 403 or 503: the extension is there, the answer will say more later on.
            client.timeout = DEFAULT_TIMEOUT
            return client
        if owner_without_extension is not None:
            raise NoServerError(
                f"The Jupyter server that runs this kernel ({owner_without_extension}) does not run the "
                "GPU scheduler extension. Enable it with `jupyter server extension enable "
                "jupyter_gpusched` and restart the server."
            )
        raise NoServerError(NOT_RUN_BY_A_SERVER)

    # -- transport ---------------------------------------------------------------------------
    def url(self, path: str, query: Mapping[str, Any] | None = None) -> str:
        return self._rest.url(path, query)

    def request(
        self,
        method: str,
        path: str,
        body: Mapping[str, Any] | None = None,
        *,
        query: Mapping[str, Any] | None = None,
        timeout: float | None = None,
    ) -> tuple[int, Any]:
        """One request; returns ``(status, decoded JSON or None)`` or raises GPUSchedError."""
        try:
            return self._rest.request(method, path, body, query, timeout=timeout)
        except RestError as err:
            raise self._error(err, path) from None

    def _error(self, err: RestError, path: str) -> GPUSchedError:
        """The failure in words for the person at the notebook."""
        status, reason = err.status, err.reason
        if status is None:
            if err.timed_out:
                return GPUSchedError(
                    f"The GPU scheduler at {self.base_url} did not answer within {err.limit:.0f} s."
                )
            why = getattr(err.cause, "reason", err.cause)
            return GPUSchedError(
                f"Cannot reach the GPU scheduler at {self.base_url} ({why}). Is the Jupyter server "
                "still running?"
            )
        if err.invalid_json:
            return GPUSchedError(
                f"The GPU scheduler at {self.base_url} answered {status} with something that is not JSON."
            )
        if err.from_server:
            return GPUSchedError(err.message, status, reason)
        if status == 404 and path.startswith("api/gpusched"):
            return GPUSchedError(
                f"The Jupyter server at {self.base_url} does not run the GPU scheduler (no "
                f"{path.split('?')[0]}). Enable the jupyter_gpusched server extension.",
                status,
                reason,
            )
        if status in (401, 403):
            return GPUSchedError(
                f"The GPU scheduler at {self.base_url} refused this kernel's credentials "
                f"({status} {err.http_reason}).",
                status,
                reason,
            )
        return GPUSchedError(
            f"The GPU scheduler at {self.base_url} answered {status} {err.http_reason}.", status, reason
        )

    # -- the API ----------------------------------------------------------------------------
    def status(self) -> dict:
        """``GET api/gpusched/status``."""
        return self.request("GET", "api/gpusched/status")[1]

    def devices(self) -> list[dict]:
        """``GET api/gpusched/devices``."""
        return list(self.request("GET", "api/gpusched/devices")[1] or [])

    def leases(self, kernel_id: str | None = None) -> list[dict]:
        """``GET api/gpusched/leases[?kernel_id=]``."""
        result = self.request("GET", "api/gpusched/leases", query={"kernel_id": kernel_id})[1]
        return list(result or [])

    def lease(self, lease_id: str) -> dict:
        """``GET api/gpusched/leases/{id}``."""
        return self.request("GET", f"api/gpusched/leases/{urllib.parse.quote(lease_id)}")[1]

    def claim(
        self,
        count: int,
        *,
        memory: int | None = None,
        mode: str | None = None,
        wait: float | None = None,
        priority: int | None = None,
    ) -> tuple[int, dict]:
        """``POST api/gpusched/leases``: 201 granted (or resumed), 202 pending, 200 already held."""
        if not self.kernel_id:
            raise GPUSchedError("This kernel's id is unknown, so it cannot ask for a GPU.")
        body: dict[str, Any] = {"kernel_id": self.kernel_id, "count": count}
        if memory is not None:
            body["memory"] = memory
        if mode is not None:
            body["mode"] = mode
        if wait is not None:
            body["wait"] = max(0.0, float(wait))
        if priority is not None:
            body["priority"] = priority
        poll = min(float(wait or 0), MAX_LONG_POLL)
        return self.request("POST", "api/gpusched/leases", body, timeout=self.timeout + poll)

    def release(self, lease_id: str, memory_held: str = "release") -> dict | None:
        """``DELETE api/gpusched/leases/{id}``: ``None`` (204), or the server's word that the
        kernel's processes hold GPU memory (200: ``{released, lease, memory_held, processes,
        message}``; ``memory_held="keep"`` keeps the lease then)."""
        query = {"memory_held": memory_held} if memory_held != "release" else None
        status, data = self.request("DELETE", f"api/gpusched/leases/{urllib.parse.quote(lease_id)}", query=query)
        return data if status == 200 and isinstance(data, dict) else None

    def keep(self, lease_id: str, seconds: float) -> dict:
        """``POST api/gpusched/leases/{id}/keep`` with ``{"seconds": N}``."""
        return self.request(
            "POST", f"api/gpusched/leases/{urllib.parse.quote(lease_id)}/keep", {"seconds": seconds}
        )[1]

    def freed(self, lease_id: str, frameworks: list[str]) -> dict:
        """``POST api/gpusched/leases/{id}/freed`` with ``{"frameworks": [...]}``: the kernel
        freed its framework caches for the ``free-cache`` reclaim step (``frameworks`` names
        those it freed, possibly none)."""
        return self.request(
            "POST",
            f"api/gpusched/leases/{urllib.parse.quote(lease_id)}/freed",
            {"frameworks": list(frameworks)},
        )[1]

