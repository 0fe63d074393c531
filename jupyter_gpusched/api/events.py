"""Arbiter events as one viewer may see them, for the events websockets of the server and broker."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from .views import ANOTHER_USER, Principal, ViewContext, for_viewer, iso, sees_everyone


def shape(event: Any, who: Principal, arbiter: Any, ctx: Any = None, *, own_notices_only: bool = False) -> dict | None:
    """``event`` (an :class:`~jupyter_gpusched.arbiter.ArbiterEvent`) shaped for ``who``.

    Returns None where the event is not for them. An event that arrives already shaped (a
    single-user server in hub mode receives its events from the broker) passes through.
    ``own_notices_only``: notices name a kernel, so the broker sends each only to its user.
    Every event is shaped by :func:`~jupyter_gpusched.api.views.for_viewer`: another user's
    notice, where one is sent, names neither them nor their kernel.
    """
    if event.payload is not None:
        return dict(event.payload)
    if event.type == "lease" and event.lease is not None:
        return {"type": "lease", "lease": arbiter.render_lease(event.lease, who, ctx)}
    if event.type == "device" and event.device is not None:
        return {"type": "device", "device": arbiter.render_device(event.device, who, ctx)}
    if event.type == "notice" and event.notice is not None:
        notice = dict(event.notice)
        owner = notice.get("user")
        if own_notices_only and owner != who.user:
            return None
        if notice.get("reclaim_at") is not None:
            notice["reclaim_at"] = iso(notice["reclaim_at"])
        # Whether holders are shown is the host's setting (as for leases), not the caller's word.
        show = getattr(arbiter, "show_holders", who.show_holders)
        if show != who.show_holders:
            who = replace(who, show_holders=show)
        if owner != who.user and not sees_everyone(who):
            notice["user"], notice["kernel_id"] = ANOTHER_USER, None
        known = ctx if isinstance(ctx, ViewContext) else arbiter.view_context()
        return for_viewer({"type": "notice", **notice}, who, known, owner=owner)
    return None


def latest(events: list) -> list:
    """The events of a batch, with only the last state of each lease and each device."""
    last: dict[tuple, int] = {}
    for n, event in enumerate(events):
        if event.lease is not None:
            last[("lease", event.lease.id)] = n
        elif event.device is not None:
            last[("device", event.device.uuid)] = n
    return [
        event
        for n, event in enumerate(events)
        if (event.lease is None and event.device is None)
        or last[("lease", event.lease.id) if event.lease is not None else ("device", event.device.uuid)] == n
    ]
