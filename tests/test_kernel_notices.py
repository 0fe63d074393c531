"""What the kernel tells the user about its lease, as a pure function of two lease readings.

No IPython and no server: :func:`notices` takes the previous and the current lease JSON and a
clock reading, and returns the lines to show.
"""

from __future__ import annotations

import subprocess
import sys
from datetime import datetime, timezone

import pytest

from jupyter_gpusched.kernel.notices import (
    COUNTDOWN_ENDS,
    Notice,
    NoticeKind,
    countdown_id,
    freed_text,
    notices,
)
from jupyter_gpusched.kernel.states import LeaseState, ReclaimStep

NOW = 1_700_000_000.0
UUID0 = "GPU-0a0a0a0a-0000-0000-0000-000000000000"
UUID1 = "GPU-1b1b1b1b-0000-0000-0000-000000000000"


def at(seconds_from_now: float) -> str:
    moment = datetime.fromtimestamp(NOW + seconds_from_now, timezone.utc)
    return moment.isoformat().replace("+00:00", "Z")


def lease(state: str = "active", lease_id: str = "L1", devices=(UUID0,), **extra) -> dict:
    out = {
        "id": lease_id,
        "kernel_id": "k-1",
        "count": max(len(devices), 1),
        "devices": list(devices),
        "device_indices": [[UUID0, UUID1].index(d) for d in devices],
        "mode": "exclusive",
        "state": state,
        "position": None,
        "reclaim_at": None,
        "reclaim_step": None,
        "reason": "",
    }
    out.update(extra)
    return out


def reclaiming(step: str, seconds: float = 55.4, reason: str = "borrowed, idle and bob's claim L9 is waiting") -> dict:
    return lease("reclaiming", reclaim_step=step, reclaim_at=at(seconds), reason=reason)


def kinds(found: list[Notice]) -> list[NoticeKind]:
    return [n.kind for n in found]


def test_the_module_imports_no_ipython():
    code = (
        "import sys\n"
        "import jupyter_gpusched.kernel.notices\n"
        "bad = [m for m in ('IPython', 'ipykernel', 'ipywidgets') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_notices_are_frozen():
    notice = Notice(NoticeKind.GRANTED, "Granted GPU 0.")
    with pytest.raises(AttributeError):
        notice.text = "changed"  # type: ignore[misc]


def test_nothing_to_say_without_a_lease():
    assert notices(None, None, NOW) == []
    assert notices(None, lease("active"), NOW) == []


@pytest.mark.parametrize(
    "step, then",
    [
        (ReclaimStep.RESTART, " Then the kernel restarts and its variables are lost."),
        (ReclaimStep.SHUTDOWN, " Then the kernel shuts down and its variables are lost."),
        (ReclaimStep.CHECKPOINT, " Its GPU state will be checkpointed; the next cell restores it."),
        (ReclaimStep.RELEASE, ""),
    ],
)
def test_a_reclaim_counts_down_and_says_what_follows(step, then):
    found = notices(lease("idle"), reclaiming(step.value), NOW)
    assert kinds(found) == [NoticeKind.RECLAIM_WARNING]
    warning = found[0]
    assert warning.text == (
        "GPU 0 will be taken back in 55 s because borrowed, idle and bob's claim L9 is waiting; "
        "run `%gpu keep 30m` to keep it." + then
    )
    # Bold, and marked for the lab extension (which replaces a countdown its kernel can no longer
    # update): the lease, its GPUs, the step and when it is due.
    due = reclaiming(step.value)["reclaim_at"]
    marks = f'data-gpusched-countdown="L1" data-gpu="GPU 0" data-step="{step.value}" data-reclaim-at="{due}"'
    assert warning.html == f"<b {marks}>{warning.text.replace(chr(39), '&#x27;')}</b>"
    assert warning.display_id == countdown_id({"id": "L1"}) == "gpusched-reclaim-L1"
    assert warning.update is False and warning.lease_id == "L1"


def test_a_countdown_without_a_reason_still_says_how_to_keep_the_gpu():
    found = notices(None, reclaiming("restart", reason=""), NOW)
    assert found[0].text.startswith("GPU 0 will be taken back in 55 s; run `%gpu keep 30m` to keep it.")


def test_the_countdown_is_updated_in_place():
    first = notices(lease("idle"), reclaiming("restart", 55.4), NOW)[0]
    later = notices(reclaiming("restart", 55.4), reclaiming("restart", 52.4), NOW)
    assert kinds(later) == [NoticeKind.RECLAIM_WARNING]
    assert later[0].display_id == first.display_id and later[0].update is True
    assert later[0].text.startswith("GPU 0 will be taken back in 52 s")


def test_a_reclaim_that_is_due_shows_no_countdown():
    assert notices(reclaiming("restart", 5), reclaiming("restart", -1), NOW) == []
    assert notices(None, lease("reclaiming", reclaim_step="restart"), NOW) == []


def test_a_cancelled_reclaim_ends_the_countdown_with_the_reason():
    found = notices(
        reclaiming("restart"), lease("active", reason="reclaim cancelled: kept by the user"), NOW
    )
    assert kinds(found) == [NoticeKind.RECLAIM_CANCELLED]
    end = found[0]
    assert end.text == "GPU 0: the reclaim is off (reclaim cancelled: kept by the user)."
    assert end.display_id == "gpusched-reclaim-L1" and end.update is True
    assert NoticeKind.RECLAIM_CANCELLED in COUNTDOWN_ENDS
    assert notices(reclaiming("restart"), lease("active"), NOW)[0].text == (
        "GPU 0: the reclaim is off (the kernel is active again)."
    )


def test_a_completed_reclaim_ends_the_countdown_and_the_lease():
    found = notices(
        reclaiming("release"), lease("released", devices=(), reason="idle with bob waiting"), NOW
    )
    assert kinds(found) == [NoticeKind.RECLAIMED, NoticeKind.RELEASED]
    assert found[0].text == "GPU 0 was taken back." and found[0].display_id == "gpusched-reclaim-L1"
    assert found[0].update is True and NoticeKind.RECLAIMED in COUNTDOWN_ENDS
    assert found[1].text == (
        "GPU lease ended: GPU 0: idle with bob waiting. This kernel asks for a GPU again before its next "
        "cell runs."
    )


def test_countdown_ends_are_only_candidates_for_the_caller_to_drop():
    # Without a countdown on screen there is nothing to end: the caller drops these.
    found = notices(lease("active"), lease("active"), NOW)
    assert all(n.kind in COUNTDOWN_ENDS and n.update for n in found)


def test_a_new_lease_counts_down_before_the_old_countdown_ends():
    found = notices(reclaiming("restart"), {**reclaiming("restart"), "id": "L2"}, NOW)
    assert kinds(found) == [NoticeKind.RECLAIM_WARNING, NoticeKind.RECLAIM_CANCELLED]
    assert [n.display_id for n in found] == ["gpusched-reclaim-L2", "gpusched-reclaim-L1"]
    assert found[0].update is False


def test_free_cache_asks_once_per_reclaim_and_says_what_was_freed():
    current = reclaiming("free-cache", 0, reason="over its memory")
    found = notices(lease("active"), current, NOW)
    assert kinds(found) == [NoticeKind.FREE_CACHE]
    assert found[0].key == ("L1", current["reclaim_at"]) and found[0].lease_id == "L1"
    # The request stands at every reading; the caller serves it once per key.
    assert notices(current, current, NOW)[0].key == found[0].key
    assert freed_text(current, ["torch"]) == "Freed cached GPU memory (torch) on GPU 0 because over its memory."
    assert freed_text({**current, "reason": ""}, ["torch", "cupy"]) == "Freed cached GPU memory (torch, cupy) on GPU 0."
    assert freed_text(current, []) is None


def test_a_free_cache_step_with_time_left_also_counts_down():
    found = notices(lease("active"), reclaiming("free-cache", 30), NOW)
    assert kinds(found) == [NoticeKind.FREE_CACHE, NoticeKind.RECLAIM_WARNING]


def test_suspended_says_the_checkpoint_restores_at_the_next_cell():
    current = lease("suspended", devices=(), reason="suspended: GPU state checkpointed")
    found = notices(lease("active"), current, NOW)
    assert kinds(found) == [NoticeKind.RECLAIMED, NoticeKind.SUSPENDED]
    assert found[1].text == (
        "GPU 0 was taken back while this kernel was idle. GPU state checkpointed; the next cell restores it."
    )
    # Not again at the next reading, and "The GPU" when the GPU it held is unknown.
    assert NoticeKind.SUSPENDED not in kinds(notices(current, current, NOW))
    assert notices(None, current, NOW)[0].text.startswith("The GPU was taken back while this kernel was idle.")


def test_a_suspended_lease_that_ends_leaves_the_binding_alone():
    found = notices(lease("suspended", devices=()), lease("released", devices=(), reason="dropped"), NOW)
    ended = [n for n in found if n.kind == NoticeKind.RELEASED]
    assert len(ended) == 1 and ended[0].unbind is False


def test_a_claim_granted_after_waiting_is_announced():
    found = notices(lease("pending", devices=(), position=2), lease("active", devices=(UUID0, UUID1)), NOW)
    assert kinds(found) == [NoticeKind.RECLAIM_CANCELLED, NoticeKind.GRANTED]
    assert found[1].text == f"Granted GPUs 0, 1 ({UUID0}, {UUID1}); cells run from now on use it."
    # A different lease (not the one that waited) is no grant.
    other = lease("active", lease_id="L2")
    assert NoticeKind.GRANTED not in kinds(notices(lease("pending", devices=()), other, NOW))


def test_a_lease_that_ends_says_why_and_unbinds():
    found = notices(lease("active"), lease("released", devices=(), reason="idle for 400s (past 300s)"), NOW)
    ended = found[-1]
    assert ended.kind == NoticeKind.RELEASED and ended.unbind is True
    assert ended.text == (
        "GPU lease ended: GPU 0: idle for 400s (past 300s). This kernel asks for a GPU again before its "
        "next cell runs."
    )
    assert ended.html == (
        "<b>GPU lease ended</b>: GPU 0: idle for 400s (past 300s). This kernel asks for a GPU again "
        "before its next cell runs."
    )
    quiet = notices(lease("active"), lease("released", devices=(), reason="idle"), NOW, asks_again=False)
    assert quiet[-1].text == "GPU lease ended: GPU 0: idle."


def test_a_lost_gpu_is_called_lost():
    reason = f"GPU 0 ({UUID0}) was lost; the kernel's GPU state on it is gone"
    found = notices(lease("active"), lease("released", devices=(), reason=reason), NOW)
    assert found[-1].kind == NoticeKind.LOST
    assert found[-1].text.startswith(f"GPU lost: GPU 0: GPU 0 ({UUID0}) was lost")


def test_a_lease_the_server_no_longer_lists_has_ended():
    found = notices(lease("active"), None, NOW)
    assert kinds(found) == [NoticeKind.RECLAIMED, NoticeKind.RELEASED]
    assert found[-1].text.startswith("GPU lease ended: GPU 0: the server no longer lists it.")


def test_a_lease_this_kernel_released_ends_quietly():
    current = lease("released", devices=(), reason="released by the kernel")
    found = notices(lease("active"), current, NOW, released_by_me={"L1"})
    assert NoticeKind.RELEASED not in kinds(found)
    # An ended lease is news once: not again at the next reading.
    assert NoticeKind.RELEASED not in kinds(notices(current, current, NOW))


def test_states_are_the_strings_the_server_sends():
    assert LeaseState.ACTIVE == "active" and LeaseState("suspended") is LeaseState.SUSPENDED
    assert ReclaimStep.FREE_CACHE == "free-cache" and f"{ReclaimStep.FREE_CACHE}" == "free-cache"
    assert str(LeaseState.RELEASED) == "released"


# -- a shared lease over its memory share -------------------------------------------------------
OVER = "over its memory share: its processes hold more than the 16.0 GiB it claimed on GPU 0"


def shared_lease(state="active", over=True, reason=f"{OVER}; its framework caches are dropped if it stays over", **extra):
    return lease(
        state, mode="shared", memory=16 << 30, over_share_since=at(-5) if over else None, reason=reason, **extra
    )


def said(found):
    """The kinds shown where no countdown is on screen (a countdown's end is shown only in its place)."""
    return [k for k in kinds(found) if k not in COUNTDOWN_ENDS]


def test_over_the_share_is_said_once_with_what_happens_next():
    within = shared_lease(over=False, reason="granted GPU 0")
    over = shared_lease()
    found = notices(within, over, NOW)
    assert said(found) == [NoticeKind.OVER_SHARE]
    assert found[0].text == (
        f"GPU 0: {OVER}; its framework caches are dropped if it stays over. Free GPU memory (delete large "
        "arrays or tensors) to stay within the share this kernel claimed."
    )
    assert said(notices(over, over, NOW)) == [], "said once"
    # The free-cache step, then what comes after it: said again, as the reason changed.
    cache = shared_lease("reclaiming", reason=f"{OVER}; dropping its framework caches", reclaim_step="free-cache", reclaim_at=at(0))
    assert said(notices(over, cache, NOW)) == [NoticeKind.FREE_CACHE]
    keeps = shared_lease(reason=f"{OVER}; ... nobody else uses GPU 0 or waits for it, so the kernel keeps running")
    found = notices(cache, keeps, NOW)
    assert NoticeKind.OVER_SHARE in kinds(found) and "so the kernel keeps running" in found[-1].text
    back = shared_lease(over=False, reason="back within its memory share")
    found = notices(keeps, back, NOW)
    assert said(found) == [NoticeKind.OVER_SHARE] and found[0].text == "GPU 0: back within its memory share."


def test_the_over_share_countdown_says_to_free_memory_not_to_keep():
    restart = shared_lease(
        "reclaiming", reason=f"{OVER} ... so the kernel will be restarted", reclaim_step="restart", reclaim_at=at(55)
    )
    found = notices(shared_lease(), restart, NOW)
    assert kinds(found) == [NoticeKind.RECLAIM_WARNING]
    assert "free GPU memory (delete large arrays or tensors) to keep it." in found[0].text
    assert "%gpu keep" not in found[0].text and "Then the kernel restarts" in found[0].text
    # Said once, in words that fit a countdown (the reason's own notice length would contradict it).
    assert found[0].text.startswith("GPU 0 will be taken back in 55 s: this kernel's processes hold more than the ")
    assert "another kernel needs the room" in found[0].text and "so the kernel will be restarted" not in found[0].text
    # Called off, back within the share: the countdown's end says why, nothing more.
    back = shared_lease(over=False, reason="back within its memory share: the restart is off")
    found = notices(restart, back, NOW)
    assert kinds(found) == [NoticeKind.RECLAIM_CANCELLED]
    assert "back within its memory share: the restart is off" in found[0].text
