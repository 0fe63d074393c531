"""What to tell the user when the kernel's lease changes: a pure function of two lease readings.

:func:`notices` compares the previous and the current reading of the kernel's lease (the
server's lease JSON, api/openapi.py) and returns the notices to show, in order. It keeps no
state and does nothing: the watcher remembers which countdowns it shows and which free-cache
requests it served, frees the caches, unbinds CUDA and displays the text.
"""

from __future__ import annotations

import html
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from . import render
from .states import HOLDING, LIVE, LeaseState, ReclaimStep


#: How the server's reason begins for a lease taken back while idle that held no GPU memory.
IDLE_RELEASE = "released while idle"


class NoticeKind(str, Enum):
    """What a notice is about (the names of the server's notice events where they match)."""

    #: The server asks the kernel to free framework caches; act once per ``key``.
    FREE_CACHE = "free_cache"
    #: A reclaim is coming: a countdown, shown in place under ``display_id``.
    RECLAIM_WARNING = "reclaim_warning"
    #: The countdown's lease holds its GPUs again: the countdown line says the reclaim is off.
    RECLAIM_CANCELLED = "reclaim_cancelled"
    #: The countdown's lease no longer holds its GPUs: the countdown line says it was taken back.
    RECLAIMED = "reclaimed"
    #: The GPU was taken back and the kernel's GPU state checkpointed.
    SUSPENDED = "suspended"
    #: A claim that waited in the queue was granted.
    GRANTED = "granted"
    #: The lease ended without this kernel asking.
    RELEASED = "released"
    #: The lease ended because its GPU was lost.
    LOST = "lost"
    #: A shared lease's processes hold more than its memory share (or are back within it).
    OVER_SHARE = "over_share"

    def __str__(self) -> str:
        return str(self.value)


_DISRUPTIVE = (ReclaimStep.RESTART, ReclaimStep.SHUTDOWN)

#: Kinds that end a countdown: shown only where the caller shows that countdown (``display_id``).
COUNTDOWN_ENDS = (NoticeKind.RECLAIM_CANCELLED, NoticeKind.RECLAIMED)


@dataclass(frozen=True)
class Notice:
    """One line to show in a cell.

    Attributes:
        kind: what it is about.
        text: the line as plain text (code in backticks).
        html: the line as HTML, when it differs from the escaped text.
        display_id: the display the line lives in, when it is updated in place.
        update: replace what ``display_id`` shows (a countdown already on screen) instead of
            adding a line; the caller, who knows what it shows, has the last word.
        lease_id: the lease it is about.
        key: for ``free_cache``, ``(lease id, reclaim_at)``: one request per reclaim.
        unbind: the lease's GPUs are gone: hide them from CUDA (where CUDA has not started).
    """

    kind: NoticeKind
    text: str
    html: str | None = None
    display_id: str | None = None
    update: bool = False
    lease_id: str | None = None
    key: tuple[Any, Any] | None = None
    unbind: bool = False


def countdown_id(lease: Mapping[str, Any]) -> str:
    """The display id of a lease's reclaim countdown."""
    return f"gpusched-reclaim-{lease.get('id')}"


def countdown_html(lease: Mapping[str, Any], text: str) -> str:
    """The countdown line in bold, marked for the lab extension: the lease, its GPUs, the step and
    when it is due, so that a countdown the kernel can no longer update (its kernel was restarted,
    or the notebook was saved and opened again) is replaced by what became of it."""
    marks = {
        "data-gpusched-countdown": lease.get("id") or "",
        "data-gpu": render.gpu_label(lease),
        "data-step": lease.get("reclaim_step") or "",
        "data-reclaim-at": lease.get("reclaim_at") or "",
    }
    attrs = "".join(f' {name}="{html.escape(str(value))}"' for name, value in marks.items())
    return f"<b{attrs}>{html.escape(text)}</b>"


def countdown_text(lease: Mapping[str, Any], seconds_left: float) -> str:
    """"GPU 0 will be taken back in 55 s because ...; run `%gpu keep 30m` to keep it. Then ..." """
    reason = lease.get("reason") or ""
    step = lease.get("reclaim_step")
    if step == ReclaimStep.RESTART:
        then = " Then the kernel restarts and its variables are lost."
    elif step == ReclaimStep.SHUTDOWN:
        then = " Then the kernel shuts down and its variables are lost."
    elif step == ReclaimStep.CHECKPOINT:
        then = " Its GPU state will be checkpointed; the next cell restores it."
    else:
        then = ""
    if lease.get("over_share_since"):
        # Over its memory share, a keep does not help: freeing GPU memory does. The reason names
        # the notice's length, which the countdown already says.
        share = lease.get("memory")
        claimed = f"the {render.format_bytes(share)} per GPU it claimed" if share else "the memory it claimed"
        return (
            f"{render.gpu_label(lease)} will be taken back in {seconds_left:.0f} s: this kernel's "
            f"processes hold more than {claimed}, and another kernel needs the room; free GPU "
            "memory (delete large arrays or tensors) to keep it." + then
        )
    return (
        f"{render.gpu_label(lease)} will be taken back in {seconds_left:.0f} s"
        + (f" because {reason}" if reason else "")
        + "; run `%gpu keep 30m` to keep it."
        + then
    )


def over_share_text(lease: Mapping[str, Any]) -> str:
    """What to say when a shared lease is seen over its memory share (or its response changes)."""
    reason = lease.get("reason") or "over its memory share"
    return (
        f"{render.gpu_label(lease)}: {reason}. Free GPU memory (delete large arrays or tensors) to "
        "stay within the share this kernel claimed."
    )


def freed_text(lease: Mapping[str, Any], frameworks: Collection[str]) -> str | None:
    """What to say after serving a ``free_cache`` request (``None`` when nothing was freed)."""
    if not frameworks:
        return None
    reason = lease.get("reason") or ""
    return f"Freed cached GPU memory ({', '.join(frameworks)}) on {render.gpu_label(lease)}" + (
        f" because {reason}." if reason else "."
    )


def notices(
    previous: Mapping[str, Any] | None,
    current: Mapping[str, Any] | None,
    now: float,
    *,
    released_by_me: Collection[str] = (),
    asks_again: bool = True,
) -> list[Notice]:
    """The notices for the kernel's lease going from ``previous`` to ``current``, in order.

    Args:
        previous: the lease as last read (``None``: none known).
        current: the lease as read now (``None``: the kernel has none).
        now: wall-clock seconds (the server's times are wall-clock).
        released_by_me: ids of leases this kernel released itself: their end is no news.
        asks_again: whether the kernel claims a GPU again before its next cell once a lease ends
            (not after the user released one).
    """
    prev, new = previous, current
    pstate = prev.get("state") if prev else None
    nstate = new.get("state") if new else None
    same = bool(prev and new and prev.get("id") == new.get("id"))
    reason = (new or {}).get("reason") or ""
    out: list[Notice] = []

    if new and nstate == LeaseState.RECLAIMING and new.get("reclaim_step") == ReclaimStep.FREE_CACHE:
        out.append(
            Notice(NoticeKind.FREE_CACHE, "", lease_id=new.get("id"), key=(new.get("id"), new.get("reclaim_at")))
        )

    # Over its memory share: said when first seen over and whenever what happens next changes
    # (the reason says it), and when back within it. A countdown says it itself, and its end
    # says why (the reclaim is off).
    counted_down = bool(prev) and pstate == LeaseState.RECLAIMING and prev.get("reclaim_step") in _DISRUPTIVE
    if same and new and nstate in HOLDING and nstate != LeaseState.RECLAIMING and not counted_down:
        if new.get("over_share_since") and (not prev.get("over_share_since") or prev.get("reason") != reason):
            text = over_share_text(new)
            out.append(Notice(NoticeKind.OVER_SHARE, text, f"<b>{html.escape(text)}</b>", lease_id=new.get("id")))
        elif prev.get("over_share_since") and not new.get("over_share_since"):
            text = f"{render.gpu_label(new)}: back within its memory share."
            out.append(Notice(NoticeKind.OVER_SHARE, text, lease_id=new.get("id")))

    if new and nstate == LeaseState.RECLAIMING:
        left = render.seconds_until(new.get("reclaim_at"), now)
        if left is not None and left > 0:
            text = countdown_text(new, left)
            out.append(
                Notice(
                    NoticeKind.RECLAIM_WARNING,
                    text,
                    countdown_html(new, text),
                    countdown_id(new),
                    update=same and pstate == LeaseState.RECLAIMING,
                    lease_id=new.get("id"),
                )
            )
    if prev is not None and not (same and nstate == LeaseState.RECLAIMING):
        if nstate in HOLDING:
            kind = NoticeKind.RECLAIM_CANCELLED
            text = f"{render.gpu_label(prev)}: the reclaim is off ({reason or 'the kernel is active again'})."
        else:
            kind = NoticeKind.RECLAIMED
            text = f"{render.gpu_label(prev)} was taken back."
        out.append(Notice(kind, text, None, countdown_id(prev), update=True, lease_id=prev.get("id")))

    if nstate == LeaseState.SUSPENDED and not (same and pstate == LeaseState.SUSPENDED):
        label = render.gpu_label(prev) if same and prev and prev.get("devices") else "The GPU"
        out.append(
            Notice(
                NoticeKind.SUSPENDED,
                f"{label} was taken back while this kernel was idle. GPU state checkpointed; the next "
                "cell restores it.",
                lease_id=new.get("id") if new else None,
            )
        )

    if same and pstate == LeaseState.PENDING and nstate in HOLDING:
        out.append(
            Notice(
                NoticeKind.GRANTED,
                f"Granted {render.gpu_label(new)} ({render.uuid_list(render.device_uuids(new))}); cells "
                "run from now on use it.",
                lease_id=new.get("id"),
            )
        )

    ended = nstate == LeaseState.RELEASED or (new is None and prev is not None)
    if ended and pstate in LIVE and prev.get("id") not in released_by_me:
        why = reason if new else "the server no longer lists it"
        lost = "lost" in why
        head = "GPU lost" if lost else "GPU lease ended"
        again = " This kernel asks for a GPU again before its next cell runs." if asks_again else ""
        rest = f"{render.gpu_label(prev)}: {why}.{again}"
        if why.startswith(IDLE_RELEASE):
            # The server's reason ends on what the kernel does next, which `again` says.
            head = "GPU taken back while this kernel was idle"
            rest = f"{render.gpu_label(prev)}: it held no GPU memory, so nothing was lost.{again}"
        elif pstate == LeaseState.PENDING and why.startswith("released by "):
            head = "GPU request cancelled"
            rest = f"this kernel's request for {render.claim_label(prev)} was {why}, from outside this notebook."
        out.append(
            Notice(
                NoticeKind.LOST if lost else NoticeKind.RELEASED,
                f"{head}: {rest}",
                f"<b>{html.escape(head)}</b>: {html.escape(rest)}",
                lease_id=prev.get("id"),
                unbind=pstate != LeaseState.SUSPENDED,
            )
        )
    return out
