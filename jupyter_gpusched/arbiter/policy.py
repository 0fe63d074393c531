"""Who may do what with a lease: the rules a :class:`~.local.LocalArbiter` is handed.

:class:`AccessPolicy` is a single server's: its own user is admin of it, and a kernel's token is
good for that kernel's lease only. :class:`HubPolicy` adds the hub's: a kernel belongs to the user
the ledger records for it (its lease's user, across broker restarts), else to the user whose
server reported it first, a claim for a kernel the broker has not seen yet needs a connected,
checked server of that user, only hub admins raise a claim's priority, and an admin sees the
servers and the processes they left behind.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import psutil

from ..api.routes import SERVER_HEADER
from ..api.views import Principal
from ..core import Lease
from .base import BadRequest, Forbidden, NotFound


class AccessPolicy:
    """A single server's rules."""

    def caller(self, who: Principal) -> None:
        """Raises unless ``who`` may act at all (checked before anything is looked up)."""

    def admit_claim(self, who: Principal, kernel_id: str, priority: int) -> Callable[[], None] | None:
        """Raises unless ``who`` may claim for ``kernel_id``; returns what undoes a refused claim."""
        if who.kernel_id is not None and who.kernel_id != kernel_id:
            raise Forbidden("a kernel's token can only ask for that kernel's own lease")
        return None

    def act_on(self, who: Principal, lease: Lease) -> None:
        """Raises unless ``who`` may release or keep ``lease``."""
        if not who.owns(lease):
            if who.kernel_id is not None:
                raise Forbidden("a kernel's token can only act on that kernel's own lease")
            raise Forbidden(f"lease {lease.id} belongs to another user")

    def end_kernel(self, who: Principal, kernel_id: str, leases: Iterable[Lease]) -> None:
        """Raises unless ``who`` may say that ``kernel_id`` ended."""

    def status_extras(self, who: Principal, status: dict) -> dict:
        """What this host adds to ``who``'s status."""
        return status


class HubPolicy(AccessPolicy):
    """The hub broker's rules over the kernels its users' servers report (``hub/remote.py``)."""

    def __init__(self, kernels: Any) -> None:
        self.kernels = kernels

    def caller(self, who: Principal) -> None:
        if who.kernel_id is None:
            return
        owner = self.kernels.user_of(who.kernel_id)
        if owner is not None and owner != who.user:
            raise Forbidden("a kernel's token can only act for that kernel")

    def admit_claim(self, who: Principal, kernel_id: str, priority: int) -> Callable[[], None] | None:
        self.caller(who)
        if priority > 0 and not who.admin:
            # The fair queue orders users by their share first; priority breaks ties. Users may
            # lower theirs, but raising it would let anyone jump ahead of everyone else.
            raise Forbidden("only a hub admin can raise a claim's priority above 0")
        owner = self.kernels.user_of(kernel_id)
        if owner is not None and owner != who.user:
            raise NotFound(f"no running kernel {kernel_id!r} on your servers")
        super().admit_claim(who, kernel_id, priority)
        if self.kernels.known(kernel_id):
            return None
        if not who.server_id:
            raise NotFound(
                f"no running kernel {kernel_id!r} on your servers (a server that asks for a kernel "
                f"it has not reported yet names itself in {SERVER_HEADER})"
            )
        if not self.kernels.verified_server(who.server_id, who.user):
            raise NotFound(
                f"no running kernel {kernel_id!r} on your servers: server {who.server_id} is not "
                "connected to the GPU broker (a server connects when it starts)"
            )
        try:
            self.kernels.register(kernel_id, who.user, who.server_id)
        except PermissionError as exc:
            raise Forbidden(str(exc)) from None
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        return lambda: self.kernels.unregister(kernel_id)  # a refused claim leaves nothing behind

    def act_on(self, who: Principal, lease: Lease) -> None:
        if who.kernel_id is not None and (lease.kernel_id != who.kernel_id or lease.user != who.user):
            raise Forbidden("a kernel's token can only act on that kernel's own lease")
        if lease.user != who.user and not who.admin:
            raise Forbidden(f"lease {lease.id} belongs to another user")

    def end_kernel(self, who: Principal, kernel_id: str, leases: Iterable[Lease]) -> None:
        if who.kernel_id is not None:
            raise Forbidden("a kernel's token cannot end kernels")
        owner = self.kernels.user_of(kernel_id)
        if (owner is not None and owner != who.user) or any(le.user != who.user for le in leases):
            raise NotFound(f"no kernel {kernel_id!r} on your servers")

    def status_extras(self, who: Principal, status: dict) -> dict:
        if who.admin:
            status["unleased_processes"] = [
                {**_with_unix_user(p), **self.kernels.owner_of(p["pid"])} for p in status.get("unleased_processes", [])
            ]
            status["stranded_processes"] = [_with_unix_user(p) for p in self.kernels.stranded()]
            status["servers"] = self.kernels.servers()
        return status


def _with_unix_user(item: dict) -> dict:
    out = dict(item)
    try:
        out["unix_user"] = psutil.Process(int(item["pid"])).username()
    except (psutil.Error, KeyError, ValueError, TypeError):
        out["unix_user"] = None
    return out
