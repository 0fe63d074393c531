"""The server's side of the REST API: who is asking (jupyter_server's auth, or a kernel's token).

The handlers themselves are in :mod:`jupyter_gpusched.api.handlers`. Every call is authenticated
and authorized on the ``gpusched`` resource through jupyter_server, except that a kernel may also
present its own token (``X-GPUSched-Token``), which is good for that kernel's own lease only.
Errors are ``{"message", "reason"}`` with 400, 403, 404, 409 or 503.
"""

from __future__ import annotations

import json
from typing import Any

from jupyter_core.utils import ensure_async
from jupyter_server.auth.decorator import ws_authenticated
from jupyter_server.base.handlers import APIHandler, JupyterHandler
from tornado import web, websocket

from ..api import routes
from ..api.events import shape
from ..api.handlers import api_handlers
from ..api.views import Principal
from ..arbiter import Arbiter, ArbiterEvent

AUTH_RESOURCE = "gpusched"
TOKEN_HEADER = routes.TOKEN_HEADER


class GPUSchedHandler(APIHandler):
    """The server's identity hook: jupyter_server's user (admin of this server) or a kernel."""

    auth_resource = AUTH_RESOURCE

    @property
    def scheduler(self) -> Arbiter:
        return self.settings["gpusched_arbiter"]

    @property
    def registry(self):
        return self.settings["gpusched_registry"]

    def _kernel_token(self) -> str | None:
        return self.request.headers.get(TOKEN_HEADER)

    def kernel_id_from_token(self) -> str | None:
        return self.registry.tokens.kernel_of(self._kernel_token())

    def check_xsrf_cookie(self) -> None:
        # A kernel authenticates with its header token and sends no cookie.
        if self.kernel_id_from_token() is not None:
            return None
        return super().check_xsrf_cookie()

    async def principal(self, action: str) -> Principal:
        """The caller; raises 403 if they may not ``action`` (``read`` or ``write``)."""
        token = self._kernel_token()
        if token is not None:
            kernel_id = self.registry.tokens.kernel_of(token)
            if kernel_id is None:
                raise web.HTTPError(403, "this kernel token is not valid (the kernel may have been restarted elsewhere)")
            return Principal(user=self.registry.user, kernel_id=kernel_id)
        user = self.current_user
        if not user:
            raise web.HTTPError(403, "authentication required")
        allowed = await ensure_async(self.authorizer.is_authorized(self, user, action, AUTH_RESOURCE))
        if not allowed:
            raise web.HTTPError(403, f"not allowed to {action} GPU leases")
        return Principal(user=self.registry.user, admin=True)

    def lease_url(self, lease_id: str) -> str:
        return self.base_url.rstrip("/") + "/" + routes.lease_path(lease_id)

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        """``{"message", "reason"}``, the message as written (jupyter_server's shows it %-escaped)."""
        exc = kwargs.get("exc_info", (None, None, None))[1]
        if isinstance(exc, web.HTTPError) and exc.log_message:
            message = exc.log_message % exc.args
            self.log.warning("wrote error: %r", message)
            self.set_header("Content-Type", "application/json")
            self.finish(json.dumps({"message": message, "reason": exc.reason}))
            return
        super().write_error(status_code, **kwargs)


class EventsHandler(JupyterHandler, websocket.WebSocketHandler):
    """``GET /api/gpusched/events``: a snapshot, then lease, device and notice events."""

    auth_resource = AUTH_RESOURCE

    @property
    def arbiter(self) -> Arbiter:
        return self.settings["gpusched_arbiter"]

    async def pre_get(self) -> None:
        user = self.current_user
        allowed = await ensure_async(self.authorizer.is_authorized(self, user, "read", AUTH_RESOURCE))
        if not allowed:
            raise web.HTTPError(403)
        registry = self.settings["gpusched_registry"]
        self.who = Principal(user=registry.user, admin=True)

    @ws_authenticated
    async def get(self, *args: Any, **kwargs: Any) -> None:
        await self.pre_get()
        res = super().get(*args, **kwargs)
        if res is not None:
            await res

    async def open(self) -> None:  # type: ignore[override]
        self.arbiter.subscribe(self.on_event)
        status = await self.arbiter.status(self.who)
        self._send({"type": "snapshot", **status})

    def _send(self, payload: dict) -> None:
        try:
            self.write_message(json.dumps(payload))
        except websocket.WebSocketClosedError:
            self.arbiter.unsubscribe(self.on_event)

    def on_event(self, event: ArbiterEvent) -> None:
        shaped = shape(event, self.who, self.arbiter)
        if shaped is not None:
            self._send(shaped)

    def on_message(self, message: Any) -> None:
        # The socket is one-way; actions go through the REST API.
        return None

    def on_close(self) -> None:
        self.arbiter.unsubscribe(self.on_event)


_API = "/" + routes.API_PATH
default_handlers = [
    *api_handlers(GPUSchedHandler, _API),
    (_API + routes.EVENTS, EventsHandler),
]
