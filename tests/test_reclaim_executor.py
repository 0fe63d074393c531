"""The reclaim executor's free-cache step: asked of the kernel once, done when the kernel says so."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

from conftest import api
from jupyter_gpusched.core import LeaseState, Step
from jupyter_gpusched.reclaim.executor import FREE_CACHE_WAIT
from jupyter_gpusched.server import registry


async def _kernel(jp_fetch) -> str:
    r = await jp_fetch("api", "kernels", method="POST", body=json.dumps({"name": "python3"}))
    return json.loads(r.body)["id"]


async def _shared_lease(jp_fetch, arbiter):
    kernel_id = await _kernel(jp_fetch)
    token = registry.current().tokens.issue(kernel_id)
    headers = {"Authorization": "", "X-GPUSched-Token": token}
    code, lease = await api(
        jp_fetch, "leases", method="POST", body={"kernel_id": kernel_id, "mode": "shared", "memory": "1GiB"}, headers=headers
    )
    assert code == 201, lease
    return kernel_id, headers, lease


async def _ask_to_free_cache(arbiter, lease_id: str, notices: list) -> None:
    """Put the lease at the free-cache step, as the core does for a shared lease over its memory."""
    lease = arbiter.live_lease(lease_id)

    def over_its_share(cur, now):
        return replace(
            cur, state=LeaseState.RECLAIMING, reclaim_step=Step.FREE_CACHE, reclaim_at=now,
            reason="the kernel holds more than its share: dropping framework caches",
        )

    reclaiming = await arbiter.update(lease, over_its_share)
    before = len(notices)
    arbiter.reclaims.carry_out_due([reclaiming])
    for _ in range(100):
        if len(notices) > before:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the kernel was not asked to free its caches")


async def test_free_cache_is_done_when_the_kernel_says_what_it_freed(jp_fetch, arbiter):
    notices: list[dict] = []
    arbiter.subscribe(lambda e: notices.append(dict(e.notice)) if e.type == "notice" and e.notice else None)
    kernel_id, headers, lease = await _shared_lease(jp_fetch, arbiter)
    other_id, other_headers, other = await _shared_lease(jp_fetch, arbiter)

    # Not asked yet: the acknowledgement is refused and changes nothing.
    code, body = await api(jp_fetch, "leases", lease["id"], "freed", method="POST", body={"frameworks": ["torch"]}, headers=headers)
    assert code == 409 and "not asked to free its caches" in body["message"]
    assert arbiter.live_lease(lease["id"]).state == LeaseState.ACTIVE

    await _ask_to_free_cache(arbiter, lease["id"], notices)
    asked = [n for n in notices if n["kind"] == "free_cache"]
    assert [n["kernel_id"] for n in asked] == [kernel_id]

    # Asking again while the kernel has not answered does not ask twice.
    arbiter.reclaims.carry_out_due([arbiter.live_lease(lease["id"])])
    await asyncio.sleep(0.05)
    assert len([n for n in notices if n["kind"] == "free_cache"]) == 1

    # Bad input and another kernel's token are refused; the step stays where it was.
    code, body = await api(jp_fetch, "leases", lease["id"], "freed", method="POST", body={"frameworks": "torch"}, headers=headers)
    assert code == 400 and "frameworks" in body["message"]
    code, _ = await api(jp_fetch, "leases", lease["id"], "freed", method="POST", body={"frameworks": []}, headers=other_headers)
    assert code == 403
    assert arbiter.live_lease(lease["id"]).reclaim_step == Step.FREE_CACHE

    code, done = await api(jp_fetch, "leases", lease["id"], "freed", method="POST", body={"frameworks": ["torch"]}, headers=headers)
    assert code == 200, done
    assert done["state"] == "idle" and done["reclaim_step"] is None
    assert "framework caches dropped (torch)" in done["reason"]
    stored = arbiter.ledger.lease(lease["id"])
    assert Step.FREE_CACHE in stored.tried_steps
    assert lease["id"] not in arbiter.reclaims.cache_asked
    # The other kernel's lease was never touched.
    assert arbiter.live_lease(other["id"]).state == LeaseState.ACTIVE


async def test_free_cache_goes_on_without_a_kernel_that_never_answers(jp_fetch, arbiter, use_clock):
    notices: list[dict] = []
    arbiter.subscribe(lambda e: notices.append(dict(e.notice)) if e.type == "notice" and e.notice else None)
    _, _, lease = await _shared_lease(jp_fetch, arbiter)
    await _ask_to_free_cache(arbiter, lease["id"], notices)

    use_clock.advance(FREE_CACHE_WAIT - 1)
    await arbiter.reclaims.expire_cache_requests()
    assert arbiter.live_lease(lease["id"]).reclaim_step == Step.FREE_CACHE, "it waits for the kernel a while"

    use_clock.advance(2)
    await arbiter.reclaims.expire_cache_requests()
    stored = arbiter.ledger.lease(lease["id"])
    assert stored.state == LeaseState.IDLE and Step.FREE_CACHE in stored.tried_steps
    assert "did not say" in stored.reason
