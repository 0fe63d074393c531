"""The live panel: what it shows for a status payload, what it sends, and that it stops polling.

The panel reads its status through an injected fetch function, so no server is needed; comm
messages are recorded through ``comm.create_comm``, the hook kernels use to provide comms.
"""

from __future__ import annotations

import copy
import threading
import time
from datetime import datetime, timedelta, timezone

import comm
import pytest
from comm.base_comm import BaseComm

from jupyter_gpusched.kernel.client import GPUSchedError
from jupyter_gpusched.kernel.panel import Panel

GiB = 1024**3
ME = "kernel-me"
U0, U1, U2 = "GPU-aaaa", "GPU-bbbb", "GPU-cccc"


class RecordingComm(BaseComm):
    sent: list[tuple[str, str, dict]] = []

    def publish_msg(self, msg_type, data=None, metadata=None, buffers=None, **keys):
        RecordingComm.sent.append((self.comm_id, msg_type, copy.deepcopy(data or {})))


@pytest.fixture(autouse=True)
def recording_comms(monkeypatch):
    RecordingComm.sent = []
    monkeypatch.setattr(comm, "create_comm", lambda *a, **kw: RecordingComm(*a, **kw))
    return RecordingComm.sent


def updates() -> list[dict]:
    """The state updates sent so far (comm_msg with method 'update')."""
    return [d["state"] for _, t, d in RecordingComm.sent if t == "comm_msg" and d.get("method") == "update"]


def iso(seconds_from_now: float) -> str:
    return (datetime.now(timezone.utc) + timedelta(seconds=seconds_from_now)).isoformat()


def lease(lid, kernel, user, devices, state="active", **extra):
    base = {
        "id": lid,
        "kernel_id": kernel,
        "user": user,
        "holder": user,
        "notebook": None,
        "count": len(devices) or 1,
        "devices": devices,
        "device_indices": [[U0, U1, U2].index(d) for d in devices],
        "memory": None,
        "mode": "exclusive",
        "state": state,
        "position": None,
        "idle_seconds": 0,
        "reclaim_at": None,
        "reclaim_step": None,
        "keep_until": None,
        "reason": "",
    }
    base.update(extra)
    return base


def payload() -> dict:
    return {
        "mode": "standalone",
        "backend": "simulated",
        "policy": "hybrid",
        "user": "me",
        "is_admin": False,
        "checkpoint": {"available": False, "reason": "simulated"},
        "devices": [
            {
                "uuid": U0,
                "index": 0,
                "name": "H100",
                "memory_total": 80 * GiB,
                "memory_used": 12 * GiB,
                "utilization": 37.0,
                "health": "ok",
                "lease_ids": ["L1"],
                "processes": [],
            },
            {
                "uuid": U1,
                "index": 1,
                "name": "H100",
                "memory_total": 80 * GiB,
                "memory_used": 75 * GiB,
                "utilization": 90.0,
                "health": "ok",
                "lease_ids": ["L2"],
                "processes": [],
            },
            {
                "uuid": U2,
                "index": 2,
                "name": "H100",
                "memory_total": 80 * GiB,
                "memory_used": 0,
                "utilization": None,
                "health": "drained",
                "lease_ids": [],
                "processes": [],
            },
        ],
        "leases": [
            lease("L1", ME, "me", [U0], notebook="me/analysis.ipynb", state="idle", idle_seconds=420),
            lease("L2", "kernel-bob", "bob", [U1], notebook="bob/train.ipynb"),
            lease("L3", "kernel-carol", "carol", [], state="pending", position=1),
        ],
        "queue": [
            {"lease_id": "L3", "kernel_id": "kernel-carol", "user": "carol", "position": 1, "count": 1}
        ],
    }


def test_panel_shows_the_numbers_holders_and_highlight():
    panel = Panel(fetch=payload, kernel_id=ME)
    assert panel.refresh()
    mine, bob, drained = panel.rows[U0], panel.rows[U1], panel.rows[U2]
    assert (mine.util.value, mine.util_label.value) == (37, "37%")
    assert (mine.memory.value, mine.memory.max) == (12.0, 80.0)
    assert mine.memory_label.value == "12.0 GiB / 80.0 GiB"
    assert "this kernel" in mine.holder.value and "background-color" in mine.holder.value
    assert mine.util.bar_style == "success"
    assert bob.holder.value == "bob (train.ipynb)" and bob.util.value == 90
    assert bob.memory.bar_style == "warning"  # over 90 % full
    assert "drained" in drained.name.value and drained.util_label.value == "-"
    assert drained.holder.value == "drained"
    assert panel.lease_html.value == "This kernel holds GPU 0 (1 GPU, exclusive): idle for 7 min."
    assert panel.queue_html.value == "Queue: 1. carol (1 GPU)"
    assert "hybrid policy" in panel.title.value
    assert (
        panel.acquire_button.disabled and not panel.release_button.disabled and not panel.keep_button.disabled
    )
    assert [c for c in panel.devices_box.children] == [mine.box, bob.box, drained.box]
    panel.close()


def test_panel_shows_this_kernels_queue_place_and_a_reclaim_countdown():
    status = payload()
    status["leases"][0] = lease("L1", ME, "me", [], state="pending", position=2)
    status["devices"][0]["lease_ids"] = []
    status["queue"].append({"lease_id": "L1", "kernel_id": ME, "user": "me", "position": 2, "count": 1})
    panel = Panel(fetch=lambda: status, kernel_id=ME)
    panel.refresh()
    assert "position 2 in the queue" in panel.lease_html.value
    assert "2. this kernel (1 GPU)" in panel.queue_html.value and "background-color" in panel.queue_html.value
    assert panel.acquire_button.disabled  # a pending claim: no second one
    assert panel.keep_button.disabled and not panel.release_button.disabled

    status["leases"][0] = lease(
        "L1", ME, "me", [U0], state="reclaiming", reclaim_at=iso(45.5), reclaim_step="restart"
    )
    panel.refresh()
    assert "taken back in 45s (restart)" in panel.lease_html.value
    panel.close()


def test_panel_says_what_idle_will_do_and_what_a_shared_lease_uses():
    status = payload()
    status["devices"][0]["memory_used"] = None  # the driver does not report this GPU's memory
    status["leases"][0].update(
        mode="shared",
        memory=8 * GiB,
        memory_held=2 * GiB,
        last_active_at=iso(-420),
        idle_forecast={
            "step": "restart",
            "at": iso(3 * 3600 + 30),
            "contended_at": iso(-420 + 90),
            "contended_by": "same_user",
            "reason": "restarted (its variables are lost) after 1h00m00s idle with nobody waiting",
        },
    )
    panel = Panel(fetch=lambda: status, kernel_id=ME)
    panel.refresh()
    text = panel.lease_html.value
    assert text.startswith("This kernel holds GPU 0 (1 GPU, 8.0 GiB each, shared): idle for 7 min, uses 2.0 GiB of its 8.0 GiB share.<br>")
    assert "Idle: restarted after a notice at " in text and "(in 3 h 00 min) if still idle" in text
    assert text.endswith("; after 90 s idle if another of your kernels waits.")
    assert panel.rows[U0].memory_label.value == "2.0 GiB (this kernel) / 80.0 GiB"
    panel.close()


def test_panel_of_a_lazy_kernel_says_it_gets_its_gpu_at_its_first_cell():
    status = payload()
    del status["leases"][0]
    status["devices"][0]["lease_ids"] = []
    panel = Panel(fetch=lambda: status, kernel_id=ME, first_cell=lambda: {"count": 1, "mode": "exclusive"})
    panel.refresh()
    assert panel.lease_html.value.startswith("GPU: at first cell.")
    panel.close()


def test_panel_updates_changed_values_only():
    status = payload()
    panel = Panel(fetch=lambda: status, kernel_id=ME)
    panel.refresh()
    sent = len(updates())
    panel.refresh()
    panel.refresh()
    assert len(updates()) == sent, "an unchanged status must not send anything"

    status["devices"][1]["utilization"] = 55.0
    panel.refresh()
    new = updates()[sent:]
    assert new == [{"value": 55}, {"value": "55%"}]
    assert panel.rows[U1].util.value == 55

    status["devices"][0]["memory_used"] = 40 * GiB
    status["queue"] = []
    panel.refresh()
    assert panel.rows[U0].memory.value == 40.0
    assert panel.queue_html.value == "Queue: nobody is waiting."
    panel.close()


def test_panel_follows_a_changing_set_of_gpus():
    status = payload()
    panel = Panel(fetch=lambda: status, kernel_id=ME)
    panel.refresh()
    old_row = panel.rows[U1]
    del status["devices"][2]
    panel.refresh()
    assert list(panel.rows) == [U0, U1] and panel.rows[U1] is old_row
    assert len(panel.devices_box.children) == 2
    panel.close()


def _wait_for(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return predicate()


def test_polling_stops_when_the_panel_is_closed():
    panel = Panel(fetch=payload, kernel_id=ME, interval=0.02).start()
    assert panel.polling
    assert _wait_for(lambda: panel.fetch_count >= 4)
    panel.close()
    assert panel.stopped and panel.wait_stopped() and not panel.polling
    seen = panel.fetch_count
    time.sleep(0.15)
    assert panel.fetch_count == seen


def test_polling_stops_when_the_widget_is_closed():
    panel = Panel(fetch=payload, kernel_id=ME, interval=0.02).start()
    assert _wait_for(lambda: panel.fetch_count >= 2)
    panel.widget.close()  # what closing the widget from anywhere does
    assert panel.stopped and panel.wait_stopped()
    seen = panel.fetch_count
    time.sleep(0.15)
    assert panel.fetch_count == seen


def test_polling_pauses_while_no_view_shows_the_panel():
    panel = Panel(fetch=payload, kernel_id=ME, interval=0.02).start()
    panel.widget._view_count = 1  # as the frontend reports once it renders the panel
    assert _wait_for(lambda: panel.fetch_count >= 2)
    panel.widget._view_count = 0  # the output was cleared
    assert panel.paused and not panel.polling
    time.sleep(0.05)
    seen = panel.fetch_count
    time.sleep(0.15)
    assert panel.fetch_count == seen
    panel.widget._view_count = 1  # shown again (say, the notebook reopened)
    assert _wait_for(lambda: panel.fetch_count > seen)
    panel.close()


def test_a_failed_read_is_shown_and_polling_backs_off():
    calls = []

    def fetch():
        calls.append(1)
        raise GPUSchedError("Cannot reach the GPU scheduler at http://127.0.0.1:1/ (refused).")

    panel = Panel(fetch=fetch, kernel_id=ME, interval=0.05)
    assert not panel.refresh()
    assert "Cannot reach the GPU scheduler" in panel.message.value
    assert not panel.refresh()
    assert panel._delay == pytest.approx(0.2)
    panel.fetch = payload
    assert panel.refresh() and panel.message.value == "" and panel._delay == 0.05
    panel.close()


def test_buttons_run_their_actions_off_the_comm_thread():
    done = threading.Event()
    calls = []

    def acquire():
        calls.append(threading.current_thread().name)
        done.set()
        return {"state": "pending", "position": 3}

    def keep():
        raise GPUSchedError("keep is limited to 7200 seconds on this server (asked for 9000)")

    status = payload()
    status["leases"] = status["leases"][1:]
    status["devices"][0]["lease_ids"] = []
    panel = Panel(fetch=lambda: status, kernel_id=ME, actions={"acquire": acquire, "keep": keep})
    panel.refresh()
    assert not panel.acquire_button.disabled
    panel.acquire_button.click()
    assert done.wait(5) and calls == ["gpusched-panel-action"]
    assert _wait_for(lambda: "Queued at position 3" in panel.message.value)
    panel._act("keep")
    assert _wait_for(lambda: "keep is limited to 7200 seconds" in panel.message.value)
    panel.close()
