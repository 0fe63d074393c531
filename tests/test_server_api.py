"""The REST API against a real Jupyter server with the extension on two simulated GPUs."""

from __future__ import annotations

import json
import math

import pytest

from conftest import api


async def _kernel(jp_fetch) -> str:
    r = await jp_fetch("api", "kernels", method="POST", body=json.dumps({"name": "python3"}))
    return json.loads(r.body)["id"]


def _ledger_rows(arbiter):
    return [(le.id, le.state.value, le.devices, le.version) for le in arbiter.ledger.leases(live_only=False)]


async def test_status_lists_simulated_gpus(jp_fetch):
    code, status = await api(jp_fetch, "status")
    assert code == 200
    assert status["backend"] == "simulated"
    assert status["mode"] == "standalone"
    assert status["policy"] == "hybrid"
    assert [d["index"] for d in status["devices"]] == [0, 1]
    assert all(d["health"] == "ok" and d["memory_total"] == 80 * 1024**3 for d in status["devices"])
    assert status["checkpoint"]["available"] is True
    code, devices = await api(jp_fetch, "devices")
    assert code == 200 and len(devices) == 2


async def test_openapi_document_describes_the_api(jp_fetch):
    code, doc = await api(jp_fetch, "openapi.json")
    assert code == 200
    assert doc["openapi"].startswith("3.")
    for path in ("/api/gpusched/status", "/api/gpusched/leases", "/api/gpusched/leases/{lease_id}/keep"):
        assert path in doc["paths"]
    assert set(doc["components"]["schemas"]["Lease"]["properties"]) >= {
        "id", "kernel_id", "user", "devices", "device_indices", "memory", "mode", "state", "position",
        "granted_at", "last_active_at", "idle_seconds", "reclaim_at", "keep_until",
    }
    operations = [op for item in doc["paths"].values() for method, op in item.items() if method != "parameters"]
    assert all("403" in op["responses"] for op in operations)
    claim = doc["paths"]["/api/gpusched/leases"]["post"]["responses"]
    assert {"200", "201", "202", "400", "403", "404", "409", "503"} <= set(claim)
    assert "Location" in claim["201"]["headers"]
    assert "204" in doc["paths"]["/api/gpusched/leases/{lease_id}"]["delete"]["responses"]
    freed = doc["paths"]["/api/gpusched/leases/{lease_id}/freed"]["post"]["responses"]
    assert {"200", "400", "403", "404", "409"} <= set(freed)
    assert {"101", "400", "403"} <= set(doc["paths"]["/api/gpusched/events"]["get"]["responses"])


async def test_claim_grant_release_round_trip(jp_fetch, arbiter):
    k1, k2, k3 = [await _kernel(jp_fetch) for _ in range(3)]
    code, lease1 = await api(jp_fetch, "leases", method="POST", body={"kernel_id": k1})
    assert code == 201, lease1
    assert lease1["state"] == "active" and len(lease1["devices"]) == 1
    code, lease2 = await api(jp_fetch, "leases", method="POST", body={"kernel_id": k2, "count": 1})
    assert code == 201
    assert lease2["devices"] != lease1["devices"]
    code, lease3 = await api(jp_fetch, "leases", method="POST", body={"kernel_id": k3})
    assert code == 202
    assert lease3["state"] == "pending" and lease3["position"] == 1

    # Asking again for the same kernel returns the lease it has.
    code, again = await api(jp_fetch, "leases", method="POST", body={"kernel_id": k1})
    assert code == 200 and again["id"] == lease1["id"]
    # 1.0 is a whole number in JSON as in the OpenAPI document.
    code, again = await api(jp_fetch, "leases", method="POST", body={"kernel_id": k1, "count": 1.0})
    assert code == 200 and again["id"] == lease1["id"]

    code, listed = await api(jp_fetch, "leases", params={"kernel_id": k2})
    assert code == 200 and [le["id"] for le in listed] == [lease2["id"]]

    code, _ = await api(jp_fetch, "leases", lease1["id"], method="DELETE")
    assert code == 204
    await arbiter.tick()
    code, got = await api(jp_fetch, "leases", lease3["id"])
    assert code == 200 and got["state"] == "active"
    assert got["devices"] == lease1["devices"]
    assert arbiter.ledger.check() == []


@pytest.mark.parametrize(
    "body, field",
    [
        ("{not json", "JSON"),
        ("[1, 2]", "object"),
        ({"count": 1}, "kernel_id"),
        ({"kernel_id": 7}, "kernel_id"),
        ({"kernel_id": "K", "count": 0}, "count"),
        ({"kernel_id": "K", "count": -3}, "count"),
        ({"kernel_id": "K", "count": "two"}, "count"),
        ({"kernel_id": "K", "count": 1.5}, "count"),
        ({"kernel_id": "K", "count": True}, "count"),
        ({"kernel_id": "K", "memory": "lots"}, "memory"),
        ({"kernel_id": "K", "memory": "9999PiB"}, "memory"),
        ({"kernel_id": "K", "memory": "-16GiB"}, "memory"),
        ({"kernel_id": "K", "memory": "0GiB"}, "memory"),
        ({"kernel_id": "K", "memory": "500GiB"}, "memory"),
        ({"kernel_id": "K", "mode": "greedy"}, "mode"),
        ({"kernel_id": "K", "wait": "forever"}, "wait"),
        ({"kernel_id": "K", "count": 3}, "GPU"),
        ({"kernel_id": "K", "colour": "red"}, "colour"),
    ],
)
async def test_bad_claims_are_refused_and_change_nothing(jp_fetch, arbiter, body, field):
    kernel_id = await _kernel(jp_fetch)
    if isinstance(body, dict) and body.get("kernel_id") == "K":
        body = {**body, "kernel_id": kernel_id}
    before = _ledger_rows(arbiter)
    code, err = await api(jp_fetch, "leases", method="POST", body=body)
    assert code == 400, err
    assert field.lower() in err["message"].lower()
    assert _ledger_rows(arbiter) == before


async def test_unknown_lease_and_kernel(jp_fetch, arbiter):
    before = _ledger_rows(arbiter)
    assert (await api(jp_fetch, "leases", "nosuchlease"))[0] == 404
    assert (await api(jp_fetch, "leases", "nosuchlease", method="DELETE"))[0] == 404
    assert (await api(jp_fetch, "leases", "nosuchlease", "keep", method="POST", body={"seconds": 60}))[0] == 404
    code, err = await api(jp_fetch, "leases", method="POST", body={"kernel_id": "not-a-kernel"})
    assert code == 404 and "kernel" in err["message"]
    assert _ledger_rows(arbiter) == before


async def test_keep_bounds_and_conflicts(jp_fetch, arbiter):
    kernel_id = await _kernel(jp_fetch)
    code, lease = await api(jp_fetch, "leases", method="POST", body={"kernel_id": kernel_id})
    assert code == 201
    before = _ledger_rows(arbiter)
    for bad in ({}, {"seconds": "soon"}, {"seconds": -5}, {"seconds": 10**9}, {"seconds": True}):
        code, err = await api(jp_fetch, "leases", lease["id"], "keep", method="POST", body=bad)
        assert code == 400, (bad, err)
        assert "seconds" in err["message"] or "keep" in err["message"]
    code, err = await api(jp_fetch, "leases", lease["id"], "keep", method="POST", body={"seconds": 60, "until": "x"})
    assert code == 400 and "until" in err["message"], err
    assert _ledger_rows(arbiter) == before
    code, kept = await api(jp_fetch, "leases", lease["id"], "keep", method="POST", body={"seconds": "30m"})
    assert code == 200 and kept["keep_until"] is not None
    # A different claim for a kernel that already holds a lease is a conflict.
    code, err = await api(jp_fetch, "leases", method="POST", body={"kernel_id": kernel_id, "count": 2})
    assert code == 409 and "release it" in err["message"]
    assert err["message"].startswith("this kernel already holds GPU "), err
    assert "(`%gpu release`)" in err["message"] and "%%" not in err["message"], err


async def test_kernel_token_acts_on_its_own_lease_only(jp_fetch, arbiter):
    from jupyter_gpusched.server import registry

    k1, k2 = await _kernel(jp_fetch), await _kernel(jp_fetch)
    tokens = registry.current().tokens
    t1 = tokens.issue(k1)
    bare = {"Authorization": "", "X-GPUSched-Token": t1}
    code, lease1 = await api(jp_fetch, "leases", method="POST", body={"kernel_id": k1}, headers=bare)
    assert code == 201, lease1
    code, lease2 = await api(jp_fetch, "leases", method="POST", body={"kernel_id": k2})
    assert code == 201
    before = _ledger_rows(arbiter)
    # Kernel 1's token cannot touch kernel 2's lease, nor claim for kernel 2.
    assert (await api(jp_fetch, "leases", lease2["id"], method="DELETE", headers=bare))[0] == 403
    assert (await api(jp_fetch, "leases", lease2["id"], "keep", method="POST", body={"seconds": 5}, headers=bare))[0] == 403
    assert (await api(jp_fetch, "leases", lease2["id"], headers=bare))[0] == 403
    assert (await api(jp_fetch, "leases", method="POST", body={"kernel_id": k2}, headers=bare))[0] == 403
    assert (await api(jp_fetch, "leases", params={"kernel_id": k2}, headers=bare))[0] == 403
    # A forged token is refused outright; so is an admin action with a kernel token.
    forged = {"Authorization": "", "X-GPUSched-Token": "forged"}
    assert (await api(jp_fetch, "status", headers=forged))[0] == 403
    uuid = lease1["devices"][0]
    assert (await api(jp_fetch, "devices", uuid, "drain", method="POST", headers=bare))[0] == 403
    assert _ledger_rows(arbiter) == before
    # Its own lease it can read and release.
    assert (await api(jp_fetch, "leases", lease1["id"], headers=bare))[0] == 200
    assert (await api(jp_fetch, "leases", lease1["id"], method="DELETE", headers=bare))[0] == 204


async def test_unauthenticated_requests_are_refused(jp_fetch):
    code, _ = await api(jp_fetch, "status", headers={"Authorization": ""})
    assert code == 403


async def test_drained_device_gets_no_new_lease(jp_fetch, arbiter):
    code, status = await api(jp_fetch, "status")
    first, second = (d["uuid"] for d in status["devices"])
    code, dev = await api(jp_fetch, "devices", first, "drain", method="POST", body={"reason": "maintenance"})
    assert code == 200 and dev["health"] == "drained"
    k1, k2 = await _kernel(jp_fetch), await _kernel(jp_fetch)
    code, lease = await api(jp_fetch, "leases", method="POST", body={"kernel_id": k1})
    assert code == 201 and lease["devices"] == [second]
    code, pending = await api(jp_fetch, "leases", method="POST", body={"kernel_id": k2})
    assert code == 202 and pending["position"] == 1
    assert (await api(jp_fetch, "devices", "GPU-nope", "drain", method="POST"))[0] == 404
    code, _ = await api(jp_fetch, "devices", first, "undrain", method="POST")
    assert code == 200
    await arbiter.tick()
    code, got = await api(jp_fetch, "leases", pending["id"])
    assert got["state"] == "active" and got["devices"] == [first]


async def test_all_gpus_drained_is_503(jp_fetch, arbiter):
    code, status = await api(jp_fetch, "status")
    for device in status["devices"]:
        await api(jp_fetch, "devices", device["uuid"], "drain", method="POST")
    kernel_id = await _kernel(jp_fetch)
    before = _ledger_rows(arbiter)
    code, err = await api(jp_fetch, "leases", method="POST", body={"kernel_id": kernel_id})
    assert code == 503 and "drained" in err["message"]
    assert _ledger_rows(arbiter) == before


@pytest.mark.parametrize("sched_config", [{"backend": "auto"}], indirect=False)
async def test_no_inventory_is_503(jp_fetch, sched_config):
    code, status = await api(jp_fetch, "status")
    assert code == 200 and status["backend"] == "none" and status["devices"] == []
    kernel_id = await _kernel(jp_fetch)
    code, err = await api(jp_fetch, "leases", method="POST", body={"kernel_id": kernel_id})
    assert code == 503 and "simulated" in err["message"]


async def test_prometheus_metrics(jp_fetch, arbiter):
    k1, k2, k3 = [await _kernel(jp_fetch) for _ in range(3)]
    for kernel_id in (k1, k2, k3):
        await api(jp_fetch, "leases", method="POST", body={"kernel_id": kernel_id})
    r = await jp_fetch("metrics", method="GET")
    text = r.body.decode()

    def value(name: str) -> float:
        for line in text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"{name} not in /metrics")

    assert value("gpusched_gpus_held") == 2
    assert value("gpusched_gpus_free") == 0
    assert value("gpusched_queue_length") == 1
    assert value('gpusched_leases{state="active"}') == 2
    assert value('gpusched_leases{state="pending"}') == 1
    assert "gpusched_wait_seconds_bucket" in text


async def test_events_websocket_sends_snapshot_then_changes(jp_fetch, jp_ws_fetch, arbiter):
    import asyncio

    ws = await jp_ws_fetch("api", "gpusched", "events")
    first = json.loads(await asyncio.wait_for(ws.read_message(), 10))
    assert first["type"] == "snapshot"
    assert len(first["devices"]) == 2 and first["leases"] == []

    kernel_id = await _kernel(jp_fetch)
    code, lease = await api(jp_fetch, "leases", method="POST", body={"kernel_id": kernel_id})
    assert code == 201
    seen = []
    def done():
        active = any(e["type"] == "lease" and e["lease"]["state"] == "active" for e in seen)
        return active and any(e["type"] == "notice" for e in seen)

    while not done():
        seen.append(json.loads(await asyncio.wait_for(ws.read_message(), 10)))
    event = next(e for e in seen if e["type"] == "lease" and e["lease"]["state"] == "active")
    assert event["lease"]["id"] == lease["id"] and event["lease"]["devices"] == lease["devices"]
    assert any(e["type"] == "notice" and e["kind"] == "granted" for e in seen)
    ws.close()


async def test_events_websocket_needs_authentication(jp_ws_fetch):
    from tornado.httpclient import HTTPClientError

    with pytest.raises(HTTPClientError) as info:
        await jp_ws_fetch("api", "gpusched", "events", headers={"Authorization": ""})
    assert info.value.code == 403


# -- hostile input -----------------------------------------------------------------------------
HUGE = 50_000  # under the body limit, far over what a message quotes


@pytest.mark.parametrize(
    "field, value",
    [
        ("memory", "x" * HUGE),
        ("memory", "1" + "q" * HUGE),
        ("memory", "9" * HUGE),
        ("wait", "y" * HUGE),
        ("wait", "1" + "z" * HUGE),
        ("mode", "m" * HUGE),
        ("count", "c" * HUGE),
        ("k" * HUGE, 1),
    ],
)
async def test_a_huge_bad_value_is_quoted_short_in_the_reply_and_the_log(jp_fetch, arbiter, caplog, field, value):
    kernel_id = await _kernel(jp_fetch)
    caplog.clear()
    code, err = await api(jp_fetch, "leases", method="POST", body={"kernel_id": kernel_id, field: value})
    assert code == 400, err
    message = err["message"]
    assert len(message) < 400, message[:500]
    assert f"({HUGE}" in message and "characters)" in message  # says how long the value was
    logged = sum(len(record.getMessage()) for record in caplog.records)
    assert logged < 4000, [record.getMessage()[:200] for record in caplog.records]


async def test_an_oversized_body_is_refused_without_echo(jp_fetch, arbiter, caplog):
    kernel_id = await _kernel(jp_fetch)
    caplog.clear()
    body = json.dumps({"kernel_id": kernel_id, "memory": "x" * 10_000_000})
    code, err = await api(jp_fetch, "leases", method="POST", body=body)
    assert code == 400
    assert "at most 64 KiB" in err["message"] and len(err["message"]) < 200
    assert sum(len(record.getMessage()) for record in caplog.records) < 4000


@pytest.mark.parametrize(
    "body",
    [
        "[" * 60_000,
        "{" + '"a":{' * 10_000,
        '{"kernel_id": "K", "memory": ' + "[" * 40 + "]" * 40 + "}",
    ],
)
async def test_deeply_nested_json_is_a_400(jp_fetch, arbiter, body):
    kernel_id = await _kernel(jp_fetch)
    before = _ledger_rows(arbiter)
    code, err = await api(jp_fetch, "leases", method="POST", body=body.replace('"K"', json.dumps(kernel_id)))
    assert code == 400, err
    assert "nests" in err["message"] and "32 deep" in err["message"]
    assert _ledger_rows(arbiter) == before


async def test_brackets_inside_strings_are_not_nesting(jp_fetch, arbiter):
    kernel_id = await _kernel(jp_fetch)
    code, err = await api(jp_fetch, "leases", method="POST", body={"kernel_id": kernel_id, "memory": "[" * 100})
    assert code == 400
    assert "memory must be a size" in err["message"] and "nests" not in err["message"]


async def test_a_queued_claim_says_why_and_status_shows_recent_usage(jp_fetch, arbiter, use_clock):
    k1, k2 = await _kernel(jp_fetch), await _kernel(jp_fetch)
    code, held = await api(jp_fetch, "leases", method="POST", body={"kernel_id": k1, "count": 2})
    assert code == 201
    # Kept, so that idling for an hour takes nothing back.
    assert (await api(jp_fetch, "leases", held["id"], "keep", method="POST", body={"seconds": 7200}))[0] == 200
    use_clock.advance(3600)
    await arbiter.tick()
    code, waiting = await api(jp_fetch, "leases", method="POST", body={"kernel_id": k2})
    assert code == 202
    user = waiting["user"]
    # Two GPUs for an hour, decayed with the default half-life of a day: about 1.97 GPU-hours.
    hours = 2 * 86400 / math.log(2) * (1 - 2 ** (-3600 / 86400)) / 3600
    assert waiting["reason"].startswith("waiting for a GPU; 1st in line: ")
    assert f"{user} used {hours:.1f} GPU-hours recently (half-life 1 day)" in waiting["reason"]
    code, status = await api(jp_fetch, "status")
    assert status["queue"][0]["reason"] == waiting["reason"]
    assert status["config"]["usage_half_life"] == 86400
    [mine] = status["usage"]
    assert mine["user"] == user and mine["held"] == 2 and mine["quota"] == 2
    assert mine["gpu_hours"] == pytest.approx(hours, abs=0.01)
    assert status["group_usage"] == []


def test_a_negative_usage_half_life_is_refused():
    from traitlets import TraitError

    from jupyter_gpusched.hub.broker import GPUBroker
    from jupyter_gpusched.server.app import GPUSchedApp

    for app in (GPUSchedApp, GPUBroker):
        with pytest.raises(TraitError, match="usage_half_life must be 0 .usage not tracked. or a finite number"):
            app(usage_half_life=-60)
        assert app(usage_half_life=0).sched_config().usage_half_life == 0
