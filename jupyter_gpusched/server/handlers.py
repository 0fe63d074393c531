"""REST API and events websocket (DESIGN section 8).

Every handler is authenticated and authorized on the ``gpusched`` resource through jupyter_server,
except that a kernel may also present its own token (``X-GPUSched-Token``), which is good for that
kernel's own lease only. Errors are ``{"message", "reason"}`` with 400, 403, 404, 409 or 503.
"""

from __future__ import annotations

import json
from typing import Any, Awaitable, Callable

from jupyter_core.utils import ensure_async
from jupyter_server.auth.decorator import ws_authenticated
from jupyter_server.base.handlers import APIHandler, JupyterHandler
from tornado import web, websocket

from ..arbiter import Arbiter, ArbiterError, ArbiterEvent
from .. import api_input
from ..api_input import bad_input
from ..views import Principal
from .openapi import openapi_document

AUTH_RESOURCE = "gpusched"
TOKEN_HEADER = "X-GPUSched-Token"
_ID = r"(?P<lease_id>[A-Za-z0-9_\-]{1,128})"
_UUID = r"(?P<uuid>[A-Za-z0-9_\-/]{1,128})"


class GPUSchedHandler(APIHandler):
    """Base: the arbiter, the caller as a :class:`Principal`, and errors as JSON."""

    auth_resource = AUTH_RESOURCE

    @property
    def arbiter(self) -> Arbiter:
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

    async def run(self, action: str, fn: Callable[[Principal], Awaitable[Any]]) -> Any:
        who = await self.principal(action)
        try:
            return await fn(who)
        except ArbiterError as exc:
            raise web.HTTPError(exc.status, exc.message.replace("%", "%%"), reason=exc.reason) from None

    def body(self) -> dict:
        """The JSON body as an object; 400 with a clear message otherwise."""
        with bad_input():
            return api_input.json_object(self.request.body)

    def reply(self, data: Any, status: int = 200) -> None:
        self.set_status(status)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(data))


class StatusHandler(GPUSchedHandler):
    async def get(self) -> None:
        self.reply(await self.run("read", self.arbiter.status))


class DevicesHandler(GPUSchedHandler):
    async def get(self) -> None:
        self.reply(await self.run("read", self.arbiter.devices))


class LeasesHandler(GPUSchedHandler):
    async def get(self) -> None:
        kernel_id = self.get_argument("kernel_id", None)

        async def fn(who: Principal):
            if who.kernel_id is not None and kernel_id not in (None, who.kernel_id):
                from ..arbiter import Forbidden

                raise Forbidden("a kernel's token can only list that kernel's own lease")
            return await self.arbiter.leases(who, kernel_id or who.kernel_id)

        self.reply(await self.run("read", fn))

    async def post(self) -> None:
        with bad_input():
            req = api_input.claim(self.body())

        async def fn(who: Principal):
            return await self.arbiter.claim(who, req.kernel_id, req.count, req.memory, req.mode, req.priority, req.wait)

        result = await self.run("write", fn)
        if result.status == 201:
            self.set_header("Location", self.base_url.rstrip("/") + f"/api/gpusched/leases/{result.lease['id']}")
        self.reply(result.lease, result.status)


class LeaseHandler(GPUSchedHandler):
    async def get(self, lease_id: str) -> None:
        self.reply(await self.run("read", lambda who: self.arbiter.lease(who, lease_id)))

    async def delete(self, lease_id: str) -> None:
        await self.run("write", lambda who: self.arbiter.release(who, lease_id))
        self.set_status(204)
        self.finish()


class KeepHandler(GPUSchedHandler):
    async def post(self, lease_id: str) -> None:
        with bad_input():
            seconds = api_input.keep_seconds(self.body())
        self.reply(await self.run("write", lambda who: self.arbiter.keep(who, lease_id, seconds)))


class DrainHandler(GPUSchedHandler):
    async def post(self, uuid: str, action: str) -> None:
        with bad_input():
            reason = api_input.reason(self.body())
        drained = action == "drain"
        self.reply(await self.run("write", lambda who: self.arbiter.drain(who, uuid, drained, reason)))


class OpenAPIHandler(GPUSchedHandler):
    async def get(self) -> None:
        await self.principal("read")
        self.reply(openapi_document())


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
        if event.payload is not None:
            self._send(dict(event.payload))
            return
        render = getattr(self.arbiter, "render_lease", None)
        if event.type == "lease" and event.lease is not None and render is not None:
            self._send({"type": "lease", "lease": render(event.lease, self.who)})
        elif event.type == "device" and event.device is not None:
            self._send({"type": "device", "device": self.arbiter.render_device(event.device, self.who)})
        elif event.type == "notice" and event.notice is not None:
            notice = dict(event.notice)
            if notice.get("reclaim_at") is not None:
                from ..views import iso

                notice["reclaim_at"] = iso(notice["reclaim_at"])
            self._send({"type": "notice", **notice})

    def on_message(self, message: Any) -> None:
        # The socket is one-way; actions go through the REST API.
        return None

    def on_close(self) -> None:
        self.arbiter.unsubscribe(self.on_event)


default_handlers = [
    (r"/api/gpusched/status", StatusHandler),
    (r"/api/gpusched/devices", DevicesHandler),
    (rf"/api/gpusched/devices/{_UUID}/(?P<action>drain|undrain)", DrainHandler),
    (r"/api/gpusched/leases", LeasesHandler),
    (rf"/api/gpusched/leases/{_ID}", LeaseHandler),
    (rf"/api/gpusched/leases/{_ID}/keep", KeepHandler),
    (r"/api/gpusched/events", EventsHandler),
    (r"/api/gpusched/openapi.json", OpenAPIHandler),
]
