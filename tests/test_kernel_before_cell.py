"""What the kernel does before a cell, as a pure function of the lease, the flags, the settings
and the time.

No IPython and no server: :func:`decide` takes the lease as the pre-run hook found it and says
whether the hook binds, restores, waits for a checkpoint, claims, or does nothing.
"""

from __future__ import annotations

import pytest

from jupyter_gpusched.kernel.before import TAKEN_BACK, Action, Do, Flags, decide, params_of
from jupyter_gpusched.kernel.settings import Settings

NOW = 1_700_000_000.0
GiB = 1024**3

#: A kernel the provisioner started with ``bind = lazy``: it claims before its first cell.
LAZY = Settings(gpus=1, memory=None, mode="exclusive", bind="lazy", provisioned=True)
#: Bound at launch: it makes no first-cell claim, but follows its lease.
LAUNCH = Settings(gpus=1, bind="launch", provisioned=True)
#: ``%load_ext`` in a kernel the provisioner did not start: nothing by itself.
LOADED = Settings(gpus=1, provisioned=False)
#: A provisioned kernelspec that asks for no GPU.
NO_GPU = Settings(gpus=0, provisioned=True)

LAST = {"count": 2, "memory": 8 * GiB, "mode": "shared", "priority": 3}
DEFAULT_CLAIM = {"count": 1, "memory": None, "mode": "exclusive", "priority": None}


def lease(state: str, lease_id: str = "L1", **extra) -> dict:
    return {"id": lease_id, "state": state, "count": 1, "memory": None, "mode": "exclusive", **extra}


SHARED_PENDING = lease("pending", count=2, memory=4 * GiB, mode="shared")

# (what, lease, flags, settings, now, do, claim, what is waited for, unbind)
TABLE = [
    # holding: bind
    ("active", lease("active"), Flags(), LAZY, NOW, Do.BIND, None, "", False),
    ("idle", lease("idle"), Flags(), LAZY, NOW, Do.BIND, None, "", False),
    ("reclaiming, releasing", lease("reclaiming", reclaim_step="release"), Flags(), LAZY, NOW, Do.BIND, None, "", False),
    ("active, user released before", lease("active"), Flags(user_released=True), LAZY, NOW, Do.BIND, None, "", False),
    ("active, not provisioned", lease("active"), Flags(), LOADED, NOW, Do.BIND, None, "", False),
    # a checkpoint under way: wait for it
    ("checkpointing", lease("reclaiming", reclaim_step="checkpoint"), Flags(), LAZY, NOW, Do.WAIT_CHECKPOINT, None, "", False),
    ("checkpointing, user released", lease("reclaiming", reclaim_step="checkpoint"), Flags(user_released=True), LOADED, NOW,
     Do.WAIT_CHECKPOINT, None, "", False),
    # checkpointed: restore
    ("suspended", lease("suspended"), Flags(), LAZY, NOW, Do.RESUME, None, "", False),
    ("suspended, user released", lease("suspended"), Flags(user_released=True), LOADED, NOW, Do.RESUME, None, "", False),
    # waiting in the queue: the hook waits on with it, where it binds by itself
    ("pending", SHARED_PENDING, Flags(), LAZY, NOW, Do.CLAIM, params_of(SHARED_PENDING), "a GPU", False),
    ("pending, bound at launch", lease("pending"), Flags(), LAUNCH, NOW, Do.CLAIM, DEFAULT_CLAIM, "a GPU", False),
    ("pending, user released", lease("pending"), Flags(user_released=True), LAZY, NOW, Do.NOTHING, None, "", False),
    ("pending, %gpu acquire --no-wait in a loaded kernel", lease("pending"), Flags(), LOADED, NOW, Do.NOTHING, None, "", False),
    ("pending, no GPU in the kernelspec", lease("pending"), Flags(), NO_GPU, NOW, Do.NOTHING, None, "", False),
    # released
    ("taken back", lease("released"), Flags(had_lease=True), LAZY, NOW, Do.CLAIM, DEFAULT_CLAIM, TAKEN_BACK, True),
    ("taken back, not provisioned", lease("released"), Flags(), LOADED, NOW, Do.CLAIM, DEFAULT_CLAIM, TAKEN_BACK, True),
    ("taken back, user released since", lease("released"), Flags(user_released=True), LAZY, NOW, Do.NOTHING, None, "", False),
    ("withdrawn by this kernel, lazy", lease("released"), Flags(released_by_me=frozenset({"L1"})), LAZY, NOW,
     Do.CLAIM, DEFAULT_CLAIM, "a GPU", False),
    ("withdrawn by this kernel, at launch", lease("released"), Flags(released_by_me=frozenset({"L1"})), LAUNCH, NOW,
     Do.NOTHING, None, "", False),
    ("withdrawn after holding one", lease("released"), Flags(had_lease=True, released_by_me=frozenset({"L1"}), last_claim=LAST),
     LAZY, NOW, Do.CLAIM, LAST, TAKEN_BACK, False),
    # no lease
    ("first cell, lazy", None, Flags(), LAZY, NOW, Do.CLAIM, DEFAULT_CLAIM, "a GPU", False),
    ("first cell, backing off", None, Flags(retry_at=NOW + 1), LAZY, NOW, Do.NOTHING, None, "", False),
    ("first cell, backoff over", None, Flags(retry_at=NOW), LAZY, NOW, Do.CLAIM, DEFAULT_CLAIM, "a GPU", False),
    ("first cell, at launch", None, Flags(), LAUNCH, NOW, Do.NOTHING, None, "", False),
    ("first cell, not provisioned", None, Flags(), LOADED, NOW, Do.NOTHING, None, "", False),
    ("first cell, no GPU in the kernelspec", None, Flags(), NO_GPU, NOW, Do.NOTHING, None, "", False),
    ("gone after holding one", None, Flags(had_lease=True, last_claim=LAST), LAUNCH, NOW, Do.CLAIM, LAST, TAKEN_BACK, False),
    ("gone after holding one, backing off", None, Flags(had_lease=True, last_claim=LAST, retry_at=NOW + 60), LAZY, NOW,
     Do.CLAIM, LAST, TAKEN_BACK, False),
    ("gone, user released", None, Flags(had_lease=True, last_claim=LAST, user_released=True), LAZY, NOW,
     Do.NOTHING, None, "", False),
    ("never held, a claim was made", None, Flags(last_claim=LAST), LAUNCH, NOW, Do.NOTHING, None, "", False),
    # a state this version does not know: leave it
    ("unknown state", lease("hibernating"), Flags(), LAZY, NOW, Do.NOTHING, None, "", False),
]


@pytest.mark.parametrize(
    ("lease_now", "flags", "settings", "now", "do", "claim", "what", "unbind"),
    [row[1:] for row in TABLE],
    ids=[row[0] for row in TABLE],
)
def test_what_the_hook_does_before_a_cell(lease_now, flags, settings, now, do, claim, what, unbind):
    action = decide(lease_now, flags, settings, now)
    assert isinstance(action, Action)
    assert action.do == do
    assert (dict(action.claim) if action.claim is not None else None) == claim
    assert action.what == what
    assert action.unbind is unbind
    assert action.reason


def test_decide_reads_the_lease_without_changing_it():
    before = lease("released")
    copy = dict(before)
    decide(before, Flags(released_by_me=frozenset({"L1"}), had_lease=True, last_claim=LAST), LAZY, NOW)
    assert before == copy


def test_a_claim_made_again_asks_for_what_the_lease_held():
    held = lease("released", count=2, memory=16 * GiB, mode="shared")
    assert params_of(held) == {"count": 2, "memory": 16 * GiB, "mode": "shared", "priority": None}
    assert params_of({"state": "released"}) == DEFAULT_CLAIM
