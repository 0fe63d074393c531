"""The REST API's handlers, written once (the OpenAPI document, api/openapi.py).

Each handler here is a mixin. :func:`api_handlers` joins every one with a base class that says
who is asking and what answers them:

- ``scheduler``: the object with the :class:`~jupyter_gpusched.arbiter.Arbiter` calls (status,
  claim, release, ...): the server's arbiter, or the broker's service.
- ``async principal(action)``: the caller as a :class:`~jupyter_gpusched.api.views.Principal`, or
  an ``HTTPError(403)``; ``action`` is ``read`` or ``write``.
- ``lease_url(lease_id)``: the URL of a lease, for the ``Location`` of a 201.
- ``write_error``: errors as ``{"message", "reason"}``.

The server's base (``server/handlers.py``) authenticates through jupyter_server and the kernels'
tokens; the broker's (``hub/handlers.py``) through the hub. Nothing else differs.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any, Awaitable, Callable, Iterator

from tornado import web

from . import input as api_input
from . import routes
from .input import bad_input, http_error
from .openapi import openapi_document
from .views import Principal


class APIMixin:
    """JSON in and out; arbiter errors become HTTP errors with the arbiter's message."""

    scheduler: Any
    request: Any
    # The base class provides ``principal(action)`` and ``lease_url(lease_id)`` (see above).
    principal: Callable[[str], Awaitable[Principal]]
    lease_url: Callable[[str], str]

    def body(self) -> dict:
        """The JSON body as an object; 400 with a clear message otherwise."""
        with bad_input():
            return api_input.json_object(self.request.body)

    def reply(self, data: Any, status: int = 200) -> None:
        self.set_status(status)  # type: ignore[attr-defined]
        self.set_header("Content-Type", "application/json")  # type: ignore[attr-defined]
        self.finish(json.dumps(data))  # type: ignore[attr-defined]


@contextlib.contextmanager
def arbiter_errors() -> Iterator[None]:
    """An :class:`~jupyter_gpusched.arbiter.base.ArbiterError` becomes its HTTP error."""
    from ..arbiter.base import ArbiterError

    try:
        yield
    except ArbiterError as exc:
        raise http_error(exc.status, exc.message, exc.reason) from None


class StatusAPI(APIMixin):
    async def get(self) -> None:
        who = await self.principal("read")
        with arbiter_errors():
            self.reply(await self.scheduler.status(who))


class DevicesAPI(APIMixin):
    async def get(self) -> None:
        who = await self.principal("read")
        with arbiter_errors():
            self.reply(await self.scheduler.devices(who))


class LeasesAPI(APIMixin):
    async def get(self) -> None:
        kernel_id = self.get_argument("kernel_id", None)  # type: ignore[attr-defined]
        who = await self.principal("read")
        if who.kernel_id is not None and kernel_id not in (None, who.kernel_id):
            raise web.HTTPError(403, "a kernel's token can only list that kernel's own lease")
        with arbiter_errors():
            self.reply(await self.scheduler.leases(who, kernel_id or who.kernel_id))

    async def post(self) -> None:
        """A claim: parsed here, decided by the arbiter (``arbiter/local.py`` ``claim``)."""
        with bad_input():
            ask = api_input.claim(self.body())
        who = await self.principal("write")
        with arbiter_errors():
            result = await self.scheduler.claim(who, ask)
        if result.status == 201:
            self.set_header("Location", self.lease_url(result.lease["id"]))  # type: ignore[attr-defined]
        self.reply(result.lease, result.status)


class LeaseAPI(APIMixin):
    async def get(self, lease_id: str) -> None:
        who = await self.principal("read")
        with arbiter_errors():
            self.reply(await self.scheduler.lease(who, lease_id))

    async def delete(self, lease_id: str) -> None:
        """204 when released with nothing left behind; 200 with ``{released, lease, memory_held,
        processes, message}`` when the kernel's processes hold GPU memory (``?memory_held=keep``
        keeps the lease then, the default releases it all the same)."""
        with bad_input():
            choice = api_input.memory_held_choice(self.get_argument("memory_held", None))  # type: ignore[attr-defined]
        who = await self.principal("write")
        with arbiter_errors():
            answer = await self.scheduler.release(who, lease_id, memory_held=choice)
        if answer is not None:
            self.reply(answer, 200)
            return
        self.set_status(204)  # type: ignore[attr-defined]
        self.finish()  # type: ignore[attr-defined]


class KeepAPI(APIMixin):
    async def post(self, lease_id: str) -> None:
        with bad_input():
            seconds = api_input.keep_seconds(self.body())
        who = await self.principal("write")
        with arbiter_errors():
            self.reply(await self.scheduler.keep(who, lease_id, seconds))


class FreedAPI(APIMixin):
    """``POST .../leases/{id}/freed``: the kernel dropped its framework caches, as it was asked."""

    async def post(self, lease_id: str) -> None:
        with bad_input():
            frameworks = api_input.frameworks(self.body())
        who = await self.principal("write")
        with arbiter_errors():
            self.reply(await self.scheduler.cache_freed(who, lease_id, frameworks))


class DrainAPI(APIMixin):
    async def post(self, uuid: str, action: str) -> None:
        with bad_input():
            reason = api_input.reason(self.body())
        who = await self.principal("write")
        with arbiter_errors():
            self.reply(await self.scheduler.drain(who, uuid, action == "drain", reason))


class OpenAPIDocument(APIMixin):
    async def get(self) -> None:
        await self.principal("read")
        self.reply(openapi_document())


#: Every REST route both the server and the broker serve, with its handler mixin.
API_ROUTES: tuple[tuple[str, type], ...] = (
    (routes.STATUS, StatusAPI),
    (routes.DEVICES, DevicesAPI),
    (routes.DRAIN, DrainAPI),
    (routes.LEASES, LeasesAPI),
    (routes.LEASE, LeaseAPI),
    (routes.KEEP, KeepAPI),
    (routes.FREED, FreedAPI),
    (routes.OPENAPI, OpenAPIDocument),
)


def api_handlers(base: type, prefix: str, **kwargs: Any) -> list[tuple]:
    """The REST routes under ``prefix`` (ending in ``api/gpusched``), each handler on ``base``."""
    out: list[tuple] = []
    for pattern, mixin in API_ROUTES:
        cls = type(mixin.__name__ + "Handler", (mixin, base), {"__module__": base.__module__})
        out.append((prefix + pattern, cls, kwargs) if kwargs else (prefix + pattern, cls))
    return out
