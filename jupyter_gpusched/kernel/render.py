"""Text and HTML for what the kernel side shows: leases, the host's GPUs, the queue, notices.

Every function takes the server's JSON (the OpenAPI document, api/openapi.py) as plain dicts and returns strings, so
the magics, the Python API, the watcher's notices and the panel all say the same thing the same
way.
"""

from __future__ import annotations

import html
import os
import re
import time
from collections.abc import Iterable, Mapping
from datetime import datetime, timezone
from typing import Any

from .states import HOLDING, LIVE  # noqa: F401 - the panel and the agent read them from here too

_HIGHLIGHT = "background-color: rgba(76, 175, 80, 0.18); font-weight: bold;"


# -- units (the core's parsers, imported only when needed to keep the agent's import light) ----
def parse_memory(value: object) -> int | None:
    """Bytes from ``16GiB`` (``None``/empty: a whole GPU); ValueError with a message if bad."""
    from ..core.units import parse_memory as parse

    return parse(value, "memory")


def parse_duration(value: object, field: str = "duration") -> float:
    """Seconds from ``30m``, ``1h30m`` or a number; ValueError with a message if bad."""
    from ..core.units import parse_duration as parse

    return parse(value, field)


def format_bytes(size: float | None) -> str:
    from ..core.units import format_bytes as fmt

    return fmt(size)


def format_duration(seconds: float | None) -> str:
    """``65`` -> ``1m05s``."""
    from ..core.units import format_duration as fmt

    return fmt(seconds)


def format_idle(seconds: float | None) -> str:
    """A coarse idle time (``under a minute``, ``5 min``, ``2 h 05 min``) that changes rarely."""
    if seconds is None:
        return "-"
    minutes = int(seconds // 60)
    if minutes < 1:
        return "under a minute"
    if minutes < 60:
        return f"{minutes} min"
    return f"{minutes // 60} h {minutes % 60:02d} min"


def parse_time(value: object) -> float | None:
    """Epoch seconds from an ISO 8601 time (``...Z`` or with an offset); ``None`` if absent."""
    if not isinstance(value, str) or not value:
        return None
    text = value.strip()
    if text.endswith(("Z", "z")):
        text = text[:-1] + "+00:00"
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return moment.timestamp()


# -- text with code in it --------------------------------------------------------------------
_CODE = re.compile(r"`([^`]+)`")


def plain(text: str) -> str:
    """``run `%gpu keep 30m` to keep it`` as plain text: the backticks go."""
    return _CODE.sub(r"\1", text)


def code_html(escaped: str) -> str:
    """Already escaped HTML with ```code``` spans marked up as ``<code>``."""
    return _CODE.sub(r"<code>\1</code>", escaped)


# -- leases --------------------------------------------------------------------------------
def ordered_devices(lease: Mapping[str, Any]) -> list[tuple[int | None, str]]:
    """The lease's ``(index, uuid)`` pairs, lowest index first (the server's order if unknown)."""
    uuids = [str(u) for u in lease.get("devices") or []]
    indices = list(lease.get("device_indices") or [])
    if len(indices) != len(uuids) or any(not isinstance(i, int) for i in indices):
        return [(None, u) for u in uuids]
    return sorted(zip(indices, uuids))


def gpu_label(lease: Mapping[str, Any]) -> str:
    """``GPU 0`` or ``GPUs 0, 1`` in index order (UUIDs when the indices are unknown)."""
    pairs = ordered_devices(lease)
    names = [str(u if i is None else i) for i, u in pairs]
    if not names:
        indices = sorted(i for i in lease.get("device_indices") or [] if isinstance(i, int))
        names = [str(i) for i in indices]
    if not names:
        count = lease.get("count") or 1
        return f"{count} GPU{'s' if count != 1 else ''}"
    return ("GPUs " if len(names) > 1 else "GPU ") + ", ".join(names)


def device_uuids(lease: Mapping[str, Any]) -> list[str]:
    """The lease's GPU UUIDs in index order: the order CUDA numbers them in this kernel."""
    return [u for _, u in ordered_devices(lease)]


def uuid_list(uuids: Iterable[str]) -> str:
    return ", ".join(uuids) or "no GPU"


def claim_label(lease: Mapping[str, Any]) -> str:
    """``1 GPU, 16.0 GiB, shared``: what a lease asks for."""
    count = lease.get("count") or 1
    parts = [f"{count} GPU{'s' if count != 1 else ''}"]
    if lease.get("memory"):
        parts.append(f"{format_bytes(lease['memory'])} each")
    parts.append(str(lease.get("mode") or "exclusive"))
    return ", ".join(parts)


def seconds_until(value: object, now: float) -> float | None:
    at = parse_time(value)
    return None if at is None else max(0.0, at - now)


def lease_line(lease: Mapping[str, Any] | None, now: float) -> str:
    """One line on this kernel's lease, for status output and the panel."""
    if not lease or lease.get("state") == "released":
        return "This kernel holds no GPU."
    state = lease.get("state")
    if state == "pending":
        position = lease.get("position")
        where = f"position {position} in the queue" if position else "in the queue"
        return f"This kernel is waiting for {claim_label(lease)}: {where}."
    if state == "suspended":
        return "This kernel's GPU state is checkpointed to host memory; the next cell restores it."
    text = f"This kernel holds {gpu_label(lease)} ({claim_label(lease)}): {state}"
    if state == "idle" and lease.get("idle_seconds") is not None:
        text += f" for {format_idle(lease['idle_seconds'])}"
    share = share_label(lease)
    if share:
        text += f", {share}"
    if state == "reclaiming":
        left = seconds_until(lease.get("reclaim_at"), now)
        step = lease.get("reclaim_step")
        if left is not None and left > 0:
            text += f", taken back in {format_duration(left)}"
        if step:
            text += f" ({step})"
    keep_left = seconds_until(lease.get("keep_until"), now)
    if keep_left:
        text += f", kept for {format_duration(keep_left)} more"
    text += "."
    if lease.get("over_share_since") and lease.get("reason"):
        # What the scheduler does about it, in its own words.
        text += f" It is {lease['reason']}."
    return text


def share_label(lease: Mapping[str, Any]) -> str:
    """``uses 2.0 GiB of its 8.0 GiB share`` for a shared lease whose use is known, else ``""``."""
    share, held = lease.get("memory"), lease.get("memory_held")
    if lease.get("mode") != "shared" or not share or held is None:
        return ""
    text = f"uses {format_bytes(held)} of its {format_bytes(share)} share"
    if held > share:
        text += " (over it)"
    return text


_DONE = {
    "release": "released",
    "checkpoint": "checkpointed",
    "free-cache": "asked to free its cached GPU memory",
    "restart": "restarted",
    "shutdown": "shut down",
}


def clock_time(at: float, now: float) -> str:
    """``14:32`` in the kernel's local time (with the date when it is not within a day)."""
    moment = time.localtime(at)
    if abs(at - now) >= 86400:
        return time.strftime("%Y-%m-%d %H:%M", moment)
    return time.strftime("%H:%M", moment)


def span(seconds: float) -> str:
    """``60 s``, ``5 min``, ``1 h``, ``1 h 30 min``: a duration in plain words."""
    seconds = max(0, round(float(seconds)))
    if seconds < 120:
        return f"{seconds} s"
    minutes = round(seconds / 60)
    if minutes < 60:
        return f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h" + (f" {minutes} min" if minutes else "")


#: Who waits, where it can only be one of the user's own kernels.
OWN_WAITS = "another of your kernels waits"


def idle_line(lease: Mapping[str, Any] | None, now: float, single_user: bool = False) -> str:
    """What idle will do to this kernel's lease, in plain words (``""`` when nothing to say).

    From the lease's ``idle_forecast``: ``Idle: checkpointed at 14:32 (in 58 min) if still idle;
    after 60 s idle if someone waits.`` On a server of one user (``single_user``: standalone
    mode) whoever waits can only be another of that user's kernels, and it says so.
    """
    if not lease or lease.get("state") not in ("active", "idle"):
        return ""
    forecast = lease.get("idle_forecast")
    if not isinstance(forecast, Mapping):
        return ""
    step = forecast.get("step")
    at = parse_time(forecast.get("at"))
    contended = parse_time(forecast.get("contended_at"))
    if step is None:
        reason = str(forecast.get("reason") or "")
        if "static" in reason:
            return "Idle: never taken back; the GPU stays with this kernel until it ends (static policy)."
        return "Idle: never taken back while idle."
    done = _DONE.get(str(step), str(step))
    notice = " after a notice" if step in ("restart", "shutdown") else ""
    if at is not None:
        left = at - now
        when = "now" if left < 1 else f"at {clock_time(at, now)} (in {span(left) if left < 120 else format_idle(left)})"
        first = f"{done}{notice} {when} if still idle"
    else:
        first = "kept while nobody waits"
    parts = [first]
    who = {"anyone": "someone waits", "same_user": OWN_WAITS}.get(str(forecast.get("contended_by")))
    if who and single_user:
        who = OWN_WAITS
    if who and contended is not None:
        since = parse_time(lease.get("last_active_at"))
        busy_or_unknown = since is None or lease.get("idle_seconds") in (None, 0)
        base = now if busy_or_unknown else since
        if at is None:
            parts.append(f"{done}{notice} after {span(contended - base)} idle if {who}")
        else:
            parts.append(f"after {span(contended - base)} idle if {who}")
    return "Idle: " + "; ".join(parts) + "."


def first_cell_line(claim: Mapping[str, Any]) -> str:
    """The line for a lazily bound kernel that has no lease yet."""
    return f"GPU: at first cell. This kernel asks for its GPU ({claim_label(claim)}) before its first cell runs."


def holder_label(lease: Mapping[str, Any] | None, kernel_id: str | None) -> str:
    """Who holds a lease: ``this kernel``, ``alice (train.ipynb)``."""
    if lease is None:
        return "in use"
    if kernel_id and lease.get("kernel_id") == kernel_id:
        return "this kernel"
    who = str(lease.get("holder") or lease.get("user") or "someone")
    notebook = lease.get("notebook")
    if notebook:
        name = os.path.basename(str(notebook))
        if name and name not in who:
            who += f" ({name})"
    return who


def device_holders(
    device: Mapping[str, Any], leases_by_id: Mapping[str, Mapping[str, Any]], kernel_id: str | None
) -> tuple[str, bool]:
    """Who holds ``device`` and whether it is this kernel."""
    ids = device.get("lease_ids") or []
    if not ids:
        return ("free" if device.get("health", "ok") == "ok" else str(device.get("health"))), False
    mine = False
    names: list[str] = []
    for lease_id in ids:
        lease = leases_by_id.get(lease_id)
        if lease is not None and kernel_id and lease.get("kernel_id") == kernel_id:
            mine = True
        label = holder_label(lease, kernel_id)
        if label not in names:
            names.append(label)
    return ", ".join(names), mine


def my_lease(leases: Iterable[Mapping[str, Any]], kernel_id: str | None) -> dict | None:
    """This kernel's live lease among ``leases``, if any."""
    for lease in leases or []:
        if lease.get("kernel_id") == kernel_id and lease.get("state") in LIVE:
            return dict(lease)
    return None


def percent(value: object) -> str:
    return "-" if value is None else f"{float(value):.0f}%"


def memory_label(device: Mapping[str, Any], mine: Mapping[str, Any] | None = None) -> str:
    """``12.0 GiB / 80.0 GiB``; where the device's use is unknown, what this kernel's lease uses."""
    used, total = device.get("memory_used"), device.get("memory_total")
    if total is None:
        return "-"
    if used is None:
        held = (mine or {}).get("memory_held")
        if held is not None and device.get("uuid") in ((mine or {}).get("devices") or []):
            return f"{format_bytes(held)} (this kernel) / {format_bytes(total)}"
        return f"unknown / {format_bytes(total)}"
    return f"{format_bytes(used)} / {format_bytes(total)}"


def outside_lease(proc: Mapping[str, Any]) -> bool:
    """Whether a device's process counts toward no lease on that GPU (its memory is taken)."""
    if "lease_id" in proc:
        return not proc.get("lease_id")
    return not proc.get("kernel_id")


def unleased_lines(devices: Iterable[Mapping[str, Any]], kernel_id: str | None) -> list[str]:
    """``GPU 2: pid 1234, this kernel, 8.0 GiB``: each GPU process outside every lease."""
    out = []
    for dev in devices:
        for proc in dev.get("processes") or []:
            if not outside_lease(proc):
                continue
            if kernel_id and proc.get("kernel_id") == kernel_id:
                whose = "this kernel (no lease on this GPU)"
            else:
                whose = str(proc.get("user") or ("a kernel" if proc.get("kernel_id") else "no kernel"))
            out.append(f"GPU {dev.get('index')}: pid {proc.get('pid')}, {whose}, {format_bytes(proc.get('memory_used'))}")
    return out


# -- %gpu status ----------------------------------------------------------------------------
def status_report(
    status: Mapping[str, Any],
    kernel_id: str | None,
    lease: Mapping[str, Any] | None,
    now: float,
    show_all: bool = False,
    first_cell: Mapping[str, Any] | None = None,
) -> tuple[str, str]:
    """``(text, html)`` for ``%gpu status``: this kernel's lease, the GPUs, the queue.

    ``first_cell`` is the claim a lazily bound kernel makes before its first cell, when it has
    no lease yet.
    """
    leases = list(status.get("leases") or [])
    by_id = {le.get("id"): le for le in leases}
    if lease is None:
        lease = my_lease(leases, kernel_id)
    queue = list(status.get("queue") or [])
    live = lease is not None and lease.get("state") in LIVE
    first = first_cell_line(first_cell) if first_cell is not None and not live else lease_line(lease, now)
    text: list[str] = [first]
    html_parts: list[str] = [f"<p>{html.escape(text[0])}</p>"]
    idle = idle_line(lease, now, single_user=status.get("mode") == "standalone")
    if idle:
        text.append(idle)
        html_parts.append(f"<p>{html.escape(idle)}</p>")
    limits = status.get("limits") if live else None
    if limits:
        text.append(str(limits))
        html_parts.append(f"<p>{html.escape(str(limits))}</p>")
    mine_in_queue = next((q for q in queue if kernel_id and q.get("kernel_id") == kernel_id), None)
    if mine_in_queue is not None:
        line = f"Queue: position {mine_in_queue.get('position')} of {len(queue)}."
    elif queue:
        line = f"Queue: {len(queue)} waiting."
    else:
        line = "Queue: nobody is waiting."
    text.append(line)
    html_parts.append(f"<p>{html.escape(line)}</p>")

    devices = sorted(status.get("devices") or [], key=lambda d: (d.get("index") is None, d.get("index")))
    header = ("GPU", "Name", "Util", "Memory", "Health", "Held by")
    rows: list[tuple[tuple[str, ...], bool]] = []
    for dev in devices:
        holders, mine = device_holders(dev, by_id, kernel_id)
        rows.append(
            (
                (
                    str(dev.get("index", "?")),
                    str(dev.get("name") or "GPU"),
                    percent(dev.get("utilization")),
                    memory_label(dev, lease),
                    str(dev.get("health") or "ok"),
                    holders,
                ),
                mine,
            )
        )
    if rows:
        text.append("")
        text.extend(_text_table(header, [r for r, _ in rows]))
        html_parts.append(_html_table(header, rows))
    else:
        line = "This host has no GPUs to schedule."
        text.append(line)
        html_parts.append(f"<p>{html.escape(line)}</p>")

    strays = unleased_lines(devices, kernel_id)
    if strays:
        title = "GPU processes outside any lease (their memory counts as taken):"
        text.append("")
        text.append(title)
        text.extend(f"  {line}" for line in strays)
        items = "".join(f"<li>{html.escape(line)}</li>" for line in strays)
        html_parts.append(f"<p>{html.escape(title)}</p><ul>{items}</ul>")

    if show_all:
        lease_header = ("Lease", "Holder", "GPUs", "Asks for", "State", "Idle", "Reason")
        lease_rows = []
        for le in leases:
            if le.get("state") == "released":
                continue
            lease_rows.append(
                (
                    (
                        str(le.get("id")),
                        holder_label(le, kernel_id),
                        gpu_label(le) if le.get("devices") else "-",
                        claim_label(le),
                        str(le.get("state")),
                        format_idle(le.get("idle_seconds")) if le.get("state") == "idle" else "-",
                        str(le.get("reason") or ""),
                    ),
                    bool(kernel_id and le.get("kernel_id") == kernel_id),
                )
            )
        text.append("")
        html_parts.append("<h4>Leases</h4>")
        if lease_rows:
            text.extend(_text_table(lease_header, [r for r, _ in lease_rows]))
            html_parts.append(_html_table(lease_header, lease_rows))
        else:
            text.append("No leases.")
            html_parts.append("<p>No leases.</p>")
        if queue:
            q_header = ("Position", "User", "Kernel", "GPUs")
            q_rows = [
                (
                    (
                        str(q.get("position")),
                        str(q.get("user")),
                        str(q.get("kernel_id")),
                        str(q.get("count")),
                    ),
                    bool(kernel_id and q.get("kernel_id") == kernel_id),
                )
                for q in queue
            ]
            text.append("")
            text.extend(_text_table(q_header, [r for r, _ in q_rows]))
            html_parts.append("<h4>Queue</h4>" + _html_table(q_header, q_rows))
        usage_rows = usage_table(status, kernel_id)
        if usage_rows is not None:
            title, rows_u = usage_rows
            u_header = ("User", "GPU-hours", "Quota", "Holds now")
            text.append("")
            text.append(title)
            html_parts.append(f"<h4>{html.escape(title)}</h4>")
            if rows_u:
                text.extend(_text_table(u_header, [r for r, _ in rows_u]))
                html_parts.append(_html_table(u_header, rows_u))
            else:
                text.append("Nobody used a GPU recently.")
                html_parts.append("<p>Nobody used a GPU recently.</p>")
        meta = ", ".join(
            f"{key} {status.get(key)}" for key in ("mode", "backend", "policy") if status.get(key)
        )
        checkpoint = status.get("checkpoint") or {}
        if checkpoint:
            meta += "; checkpoint " + ("available" if checkpoint.get("available") else "unavailable")
            if checkpoint.get("reason"):
                meta += f" ({checkpoint['reason']})"
        if meta:
            text.append("")
            text.append(f"Scheduler: {meta}.")
            html_parts.append(f"<p><small>Scheduler: {html.escape(meta)}.</small></p>")
    return "\n".join(text), "\n".join(html_parts)


def half_life_label(seconds: float) -> str:
    """``86400`` -> ``1 day``; else a duration (``12h00m``)."""
    days = seconds / 86400.0
    if days >= 1 and days == int(days):
        return f"{int(days)} day{'s' if days > 1 else ''}"
    return format_duration(seconds)


def gpus_number(value: object) -> str:
    """``2.0`` -> ``2``, ``0.5`` -> ``0.5``."""
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return "-"
    return f"{number:g}"


def usage_table(
    status: Mapping[str, Any], kernel_id: str | None = None
) -> tuple[str, list[tuple[tuple[str, ...], bool]]] | None:
    """The status's recent usage per user as a title and table rows (the viewer's own row
    highlighted), or ``None`` when the server does not track usage (``usage_half_life`` 0)."""
    half_life = (status.get("config") or {}).get("usage_half_life")
    if not half_life or "usage" not in status:
        return None
    me = status.get("user")
    title = f"Recent GPU usage (half-life {half_life_label(float(half_life))}):"
    rows = [
        (
            (
                str(u.get("user")),
                f"{float(u.get('gpu_hours') or 0.0):.1f}",
                gpus_number(u.get("quota")),
                gpus_number(u.get("held")),
            ),
            bool(me and u.get("user") == me),
        )
        for u in status.get("usage") or []
    ]
    return title, rows


def _text_table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(header[i]), *(len(r[i]) for r in rows)) for i in range(len(header))]

    def line(cells: tuple[str, ...]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()

    return [line(header), *(line(r) for r in rows)]


def _html_table(header: tuple[str, ...], rows: list[tuple[tuple[str, ...], bool]]) -> str:
    head = "".join(f"<th style='text-align:left'>{html.escape(h)}</th>" for h in header)
    body = []
    for cells, mine in rows:
        style = f" style='{_HIGHLIGHT}'" if mine else ""
        tds = "".join(f"<td style='text-align:left'>{html.escape(c)}</td>" for c in cells)
        body.append(f"<tr{style}>{tds}</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"
