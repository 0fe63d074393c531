"""The live GPU panel: standard ipywidgets only, so it renders in JupyterLab, Notebook 7 and VS Code.

A background thread reads ``GET api/gpusched/status`` every ``interval`` seconds and sets only the
widget values that changed, so an unchanged host sends no comm messages. Comm messages from the
kernel never count as execution. Polling stops for good when the panel is closed
(``panel.close()`` or ``panel.widget.close()``), and pauses while no view of it is shown (its
output cleared, the notebook closed) where the frontend reports views.
"""

from __future__ import annotations

import html
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from . import render
from .client import GPUSchedError

log = logging.getLogger("jupyter_gpusched.kernel")

GiB = 1024**3
#: After failed reads the interval doubles up to this many seconds.
MAX_BACKOFF = 30.0
_MINE = "background-color: rgba(76, 175, 80, 0.25); font-weight: bold; padding: 0 4px;"


def _set(widget: Any, **values: Any) -> int:
    """Set the traits that differ, in one message; returns how many changed."""
    changed = {k: v for k, v in values.items() if getattr(widget, k) != v}
    if changed:
        with widget.hold_sync():
            for key, value in changed.items():
                setattr(widget, key, value)
    return len(changed)


class _DeviceRow:
    """One GPU: name, utilization bar, memory bar, holder."""

    def __init__(self, widgets: Any):
        w = widgets
        self.name = w.HTML(layout=w.Layout(width="22em"))
        self.util = w.IntProgress(min=0, max=100, value=0, layout=w.Layout(width="9em"))
        self.util_label = w.Label(layout=w.Layout(width="4em"))
        self.memory = w.FloatProgress(min=0.0, max=1.0, value=0.0, layout=w.Layout(width="9em"))
        self.memory_label = w.Label(layout=w.Layout(width="11em"))
        self.holder = w.HTML(layout=w.Layout(width="auto"))
        self.box = w.HBox(
            [self.name, self.util, self.util_label, self.memory, self.memory_label, self.holder]
        )

    def update(
        self, device: Mapping[str, Any], holder: str, mine: bool, lease: Mapping[str, Any] | None = None
    ) -> None:
        index = device.get("index", "?")
        health = device.get("health") or "ok"
        name = f"GPU {index} · {html.escape(str(device.get('name') or 'GPU'))}"
        if health != "ok":
            name += f" <span style='color: var(--jp-error-color1, red)'>({html.escape(str(health))})</span>"
        _set(self.name, value=name)

        util = device.get("utilization")
        _set(
            self.util,
            value=round(float(util)) if util is not None else 0,
            bar_style="success" if mine else "info",
        )
        _set(self.util_label, value=render.percent(util))

        total = device.get("memory_total") or 0
        used = device.get("memory_used")
        total_gib = round(total / GiB, 1) if total else 1.0
        used_gib = min(round((used or 0) / GiB, 1), total_gib)
        full = bool(total and used and used / total > 0.9)
        # max first when it grows, value first when it shrinks: a value above max is clipped.
        if total_gib >= self.memory.max:
            _set(self.memory, max=total_gib)
            _set(
                self.memory, value=used_gib, bar_style="warning" if full else ("success" if mine else "info")
            )
        else:
            _set(
                self.memory, value=used_gib, bar_style="warning" if full else ("success" if mine else "info")
            )
            _set(self.memory, max=total_gib)
        _set(self.memory_label, value=render.memory_label(device, lease))

        text = html.escape(holder)
        if mine:
            text = f"<span style='{_MINE}'>{text}</span>"
        _set(self.holder, value=text)

    def close(self) -> None:
        for widget in (
            self.name,
            self.util,
            self.util_label,
            self.memory,
            self.memory_label,
            self.holder,
            self.box,
        ):
            widget.close()


class Panel:
    """The live status panel.

    Args:
        fetch: returns the server's status (``GET api/gpusched/status``); may raise
            GPUSchedError. Injected so that the panel can be driven without a server.
        kernel_id: this kernel, to highlight its GPUs and queue place.
        interval: seconds between reads.
        actions: callables for the buttons: ``acquire``, ``release``, ``keep``. Each may raise
            GPUSchedError or ValueError; the panel shows the message.
        clock: wall-clock seconds, for countdowns.
        first_cell: returns the claim a lazily bound kernel makes before its first cell while it
            has no lease (``None``: it makes none).
    """

    def __init__(
        self,
        fetch: Callable[[], Mapping[str, Any]],
        kernel_id: str | None = None,
        interval: float = 2.0,
        actions: Mapping[str, Callable[[], Any]] | None = None,
        clock: Callable[[], float] = time.time,
        first_cell: Callable[[], Mapping[str, Any] | None] | None = None,
    ):
        import ipywidgets as w

        self._w = w
        self.fetch = fetch
        self.kernel_id = kernel_id
        self.interval = max(0.05, float(interval))
        self.actions = dict(actions or {})
        self.clock = clock
        self.first_cell = first_cell
        #: How many times the panel read the status (tests watch it stop growing).
        self.fetch_count = 0
        self.last_status: Mapping[str, Any] | None = None
        self.stopped = False

        self.title = w.HTML()
        self.rows: dict[str, _DeviceRow] = {}
        self.devices_box = w.VBox()
        self.lease_html = w.HTML()
        self.queue_html = w.HTML()
        self.acquire_button = w.Button(
            description="Acquire", icon="play", tooltip="Ask for a GPU (no waiting)"
        )
        self.release_button = w.Button(
            description="Release", icon="stop", tooltip="Give this kernel's GPU back"
        )
        self.keep_button = w.Button(
            description="Keep 30 min", icon="lock", tooltip="No idle reclaim for 30 minutes"
        )
        self.message = w.HTML()
        self.acquire_button.on_click(lambda _b: self._act("acquire"))
        self.release_button.on_click(lambda _b: self._act("release"))
        self.keep_button.on_click(lambda _b: self._act("keep"))
        self.buttons = w.HBox([self.acquire_button, self.release_button, self.keep_button])
        self.widget = w.VBox(
            [self.title, self.devices_box, self.lease_html, self.queue_html, self.buttons, self.message],
            layout=w.Layout(border="1px solid var(--jp-border-color2, #ccc)", padding="6px"),
        )
        # Ask the frontend to count this panel's views: at 0 the output was cleared or closed.
        self.widget._view_count = 0
        self._views_seen = False
        self.widget.observe(self._on_views, names="_view_count")
        self.widget.observe(self._on_comm, names="comm")

        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._delay = self.interval
        self._busy = False
        self._fetch_failed = False

    # -- display ----------------------------------------------------------------------------
    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return self.widget._repr_mimebundle_(**kwargs)

    def __repr__(self) -> str:
        state = "stopped" if self.stopped else ("paused" if self.paused else "live")
        return f"<GPU panel ({state}), {len(self.rows)} GPUs>"

    # -- polling ----------------------------------------------------------------------------
    @property
    def paused(self) -> bool:
        """No view shows the panel (after one did): reads wait until a view is back."""
        return self._views_seen and not (self.widget._view_count or 0)

    @property
    def polling(self) -> bool:
        """Whether the panel is reading the status now."""
        return self._thread is not None and self._thread.is_alive() and not self.paused

    def start(self) -> Panel:
        """Read once now, then every ``interval`` seconds in a daemon thread."""
        if self.stopped or (self._thread is not None and self._thread.is_alive()):
            return self
        self.refresh()
        self._thread = threading.Thread(target=self._loop, name="gpusched-panel", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self._delay):
            if self.widget.comm is None:
                self.close()
                return
            if self.paused:
                continue
            self.refresh()

    def refresh(self) -> bool:
        """Read the status and show it; ``False`` (and a message in the panel) if that failed."""
        with self._lock:
            if self.stopped:
                return False
            self.fetch_count += 1
            try:
                status = self.fetch()
            except GPUSchedError as err:
                self._delay = min(max(self._delay * 2, self.interval), MAX_BACKOFF)
                self._fetch_failed = True
                _set(
                    self.message,
                    value=f"<span style='color: var(--jp-error-color1, red)'>{html.escape(str(err))}</span>",
                )
                return False
            except Exception as err:
                log.exception("gpusched panel: reading the status failed")
                self._delay = min(max(self._delay * 2, self.interval), MAX_BACKOFF)
                self._fetch_failed = True
                _set(self.message, value=html.escape(f"Could not read the GPU status: {err}"))
                return False
            self._delay = self.interval
            if self._fetch_failed:
                self._fetch_failed = False
                _set(self.message, value="")
            self.render(status)
            return True

    # -- rendering ---------------------------------------------------------------------------
    def render(self, status: Mapping[str, Any]) -> None:
        """Show ``status`` (the ``GET api/gpusched/status`` payload)."""
        with self._lock:
            self.last_status = status
            now = self.clock()
            leases = list(status.get("leases") or [])
            by_id = {le.get("id"): le for le in leases}
            mine = render.my_lease(leases, self.kernel_id)

            parts = ["<b>GPUs on this host</b>"]
            facts = [str(status[k]) for k in ("policy", "backend") if status.get(k)]
            if status.get("policy"):
                facts[0] += " policy"
            if facts:
                parts.append(f"<small>({html.escape(', '.join(facts))})</small>")
            _set(self.title, value=" ".join(parts))

            devices = sorted(
                status.get("devices") or [], key=lambda d: (d.get("index") is None, d.get("index"))
            )
            uuids = [str(d.get("uuid")) for d in devices]
            if list(self.rows) != uuids:
                old = self.rows
                self.rows = {u: old.pop(u) if u in old else _DeviceRow(self._w) for u in uuids}
                for row in old.values():
                    row.close()
                self.devices_box.children = tuple(r.box for r in self.rows.values())
            if not devices:
                _set(self.lease_html, value="This host has no GPUs to schedule.")
            for dev in devices:
                holder, is_mine = render.device_holders(dev, by_id, self.kernel_id)
                strays = render.unleased_lines([dev], self.kernel_id)
                if strays:
                    # "GPU 2: pid 1234, ann, 8.0 GiB" -> "pid 1234, ann, 8.0 GiB outside any lease"
                    holder += "; " + "; ".join(line.split(": ", 1)[1] for line in strays) + " outside any lease"
                self.rows[str(dev.get("uuid"))].update(dev, holder, is_mine, mine)

            if devices:
                claim = self.first_cell() if self.first_cell is not None and mine is None else None
                line = render.first_cell_line(claim) if claim else render.lease_line(mine, now)
                idle = render.idle_line(mine, now, single_user=status.get("mode") == "standalone")
                value = html.escape(line) + (f"<br>{html.escape(idle)}" if idle else "")
                _set(self.lease_html, value=value)
            self._render_queue(status.get("queue") or [])

            state = mine.get("state") if mine else None
            if not self._busy:
                _set(self.acquire_button, disabled=state in render.LIVE)
                _set(self.release_button, disabled=state not in render.LIVE)
                _set(self.keep_button, disabled=state not in render.HOLDING)

    def _render_queue(self, queue: list[Mapping[str, Any]]) -> None:
        if not queue:
            _set(self.queue_html, value="Queue: nobody is waiting.")
            return
        items = []
        for item in sorted(queue, key=lambda q: q.get("position") or 0):
            count = item.get("count") or 1
            is_mine = bool(self.kernel_id and item.get("kernel_id") == self.kernel_id)
            who = "this kernel" if is_mine else str(item.get("user") or "someone")
            text = html.escape(f"{item.get('position')}. {who} ({count} GPU{'s' if count != 1 else ''})")
            items.append(f"<span style='{_MINE}'>{text}</span>" if is_mine else text)
        _set(self.queue_html, value="Queue: " + " &nbsp; ".join(items))

    # -- buttons -----------------------------------------------------------------------------
    def _act(self, name: str) -> None:
        """Run a button's action off the comm handler, so the kernel stays responsive."""
        action = self.actions.get(name)
        if action is None or self._busy:
            return
        self._busy = True
        for button in (self.acquire_button, self.release_button, self.keep_button):
            _set(button, disabled=True)
        threading.Thread(
            target=self._run_action, args=(name, action), name="gpusched-panel-action", daemon=True
        ).start()

    def _run_action(self, name: str, action: Callable[[], Any]) -> None:
        try:
            result = action()
        except (GPUSchedError, ValueError) as err:
            text = f"<span style='color: var(--jp-error-color1, red)'>{html.escape(str(err))}</span>"
        except Exception as err:
            log.exception("gpusched panel action %s failed", name)
            text = html.escape(f"{name} failed: {err}")
        else:
            text = html.escape(self._describe(name, result))
        finally:
            self._busy = False
        _set(self.message, value=text)
        self.refresh()

    def _describe(self, name: str, result: Any) -> str:
        lease = result if isinstance(result, Mapping) else {}
        if name == "acquire":
            if lease.get("state") == "pending":
                return f"Queued at position {lease.get('position') or '?'}; the GPU is used from the next cell after the grant."
            return f"Granted {render.gpu_label(lease)}; the next cell uses it."
        if name == "release":
            return "Released." if lease else "This kernel held no GPU."
        if name == "keep":
            return "Kept for 30 minutes: no idle reclaim before then."
        return "Done."

    # -- closing -----------------------------------------------------------------------------
    def _on_views(self, change: Mapping[str, Any]) -> None:
        if change.get("new"):
            self._views_seen = True

    def _on_comm(self, change: Mapping[str, Any]) -> None:
        if change.get("new") is None:
            self.close()

    def close(self) -> None:
        """Stop polling for good and close the panel's widgets (its views disappear)."""
        with self._lock:
            if self.stopped:
                return
            self.stopped = True
            self._stop.set()
        for row in self.rows.values():
            row.close()
        for widget in (
            self.title,
            self.devices_box,
            self.lease_html,
            self.queue_html,
            self.acquire_button,
            self.release_button,
            self.keep_button,
            self.buttons,
            self.message,
            self.widget,
        ):
            widget.close()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)

    def wait_stopped(self, timeout: float = 5.0) -> bool:
        """Whether the polling thread has ended within ``timeout`` seconds."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
        return thread is None or not thread.is_alive()
