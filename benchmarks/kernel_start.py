"""Kernel start time with ``gpusched-provisioner`` against jupyter_client's ``local-provisioner``.

    python benchmarks/kernel_start.py [--rounds 8] [--warmup 1] [--gpus 4] [--json] [--keep]

One real ``jupyter server`` with the extension on simulated GPUs and three kernelspecs:
``python3`` (stock, local-provisioner), ``gpusched-lazy`` (1 GPU bound at the first cell) and
``gpusched-launch`` (1 GPU claimed before the kernel starts). A start is timed from
``POST /api/kernels`` until the kernel answers a ``kernel_info_request`` sent over the websocket
``/api/kernels/{id}/channels``; the kernel is then shut down (``DELETE /api/kernels/{id}``, timed
separately). Kinds are interleaved (A B C A B C ...) so that machine noise spreads over all of
them. The report gives median and p90 per kind and the ratio against local-provisioner.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import statistics
import sys
import time
import uuid
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

from tornado.httpclient import HTTPRequest
from tornado.websocket import websocket_connect

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _server import Connection, JupyterServer, jsonable, percentile, print_log_findings

UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
KINDS = (
    ("local-provisioner", "python3"),
    ("gpusched lazy", "gpusched-lazy"),
    ("gpusched launch", "gpusched-launch"),
)


def kernel_info_request(session: str) -> tuple[str, str]:
    msg_id = uuid.uuid4().hex
    msg = {
        "header": {
            "msg_id": msg_id,
            "msg_type": "kernel_info_request",
            "session": session,
            "username": "bench",
            "date": datetime.now(timezone.utc).isoformat(),
            "version": "5.3",
        },
        "parent_header": {},
        "metadata": {},
        "content": {},
        "channel": "shell",
        "buffers": [],
    }
    return msg_id, json.dumps(msg)


async def one_start(server: JupyterServer, conn: Connection, spec: str, timeout: float) -> dict:
    """Start a kernel of ``spec``, wait for its kernel_info_reply, shut it down; times in seconds."""
    t0 = time.perf_counter()
    status, body = await asyncio.wait_for(
        conn.request("POST", "/api/kernels", json.dumps({"name": spec}).encode()), timeout
    )
    if status != 201:
        # Reported in the table rather than raised, so that the other kinds are still measured.
        try:
            message = json.loads(body).get("message", "")
        except ValueError:
            message = body[:200].decode(errors="replace")
        return {"error": f"POST /api/kernels -> {status}: {re.sub(UUID, '<kernel id>', message)}"}
    t_post = time.perf_counter()
    kernel_id = json.loads(body)["id"]
    session = uuid.uuid4().hex
    request = HTTPRequest(
        f"ws://127.0.0.1:{server.port}/api/kernels/{kernel_id}/channels?session_id={session}",
        headers={"Authorization": f"token {server.token}"},
        connect_timeout=timeout,
        request_timeout=timeout,
    )
    ws = await websocket_connect(request)
    try:
        msg_id, msg = kernel_info_request(session)
        await ws.write_message(msg)
        deadline = time.monotonic() + timeout
        while True:
            raw = await asyncio.wait_for(ws.read_message(), max(0.1, deadline - time.monotonic()))
            if raw is None:
                raise RuntimeError(f"kernel {kernel_id} ({spec}): the websocket closed before kernel_info_reply")
            if isinstance(raw, bytes):
                continue
            reply = json.loads(raw)
            if (
                reply.get("msg_type") == "kernel_info_reply"
                and reply.get("parent_header", {}).get("msg_id") == msg_id
            ):
                break
        t_ready = time.perf_counter()
    finally:
        ws.close()

    # Not timed: what the scheduler holds for the kernel once it is up.
    _, lease_body = await conn.request("GET", f"/api/gpusched/leases?kernel_id={kernel_id}")
    leases = json.loads(lease_body) if lease_body else []
    holding = any(le.get("state") in ("active", "idle") and le.get("devices") for le in leases)

    t1 = time.perf_counter()
    status, body = await asyncio.wait_for(conn.request("DELETE", f"/api/kernels/{kernel_id}"), timeout)
    if status != 204:
        raise RuntimeError(f"shutting down kernel {kernel_id} answered {status}: {body[:300]!r}")
    t_down = time.perf_counter()
    return {"post": t_post - t0, "ready": t_ready - t0, "shutdown": t_down - t1, "gpu_at_ready": holding}


async def bench(args, server: JupyterServer) -> dict:
    conn = Connection.to(server)
    samples: dict[str, list[dict]] = {label: [] for label, _ in KINDS}
    try:
        for rnd in range(args.warmup + args.rounds):
            warm = rnd < args.warmup
            for label, spec in KINDS:
                sample = await one_start(server, conn, spec, args.timeout)
                if not warm:
                    samples[label].append(sample)
            if not args.json:
                what = "warm-up" if warm else f"round {rnd - args.warmup + 1}/{args.rounds}"
                print(f"  {what} done", flush=True)
    finally:
        await conn.close()

    _, status = server.call("GET", "/api/gpusched/status")
    live = [le for le in status.get("leases", []) if le.get("state") != "released"]

    def median(values: list[float]) -> float:
        return statistics.median(values) if values else math.nan

    def ratio(a: float, b: float) -> float:
        return round(a / b, 2) if b and not math.isnan(a) and not math.isnan(b) else math.nan

    local = [s["ready"] for s in samples[KINDS[0][0]] if "error" not in s]
    kinds = {}
    for label, spec in KINDS:
        got = [s for s in samples[label] if "error" not in s]
        errors = Counter(s["error"] for s in samples[label] if "error" in s)
        ready = [s["ready"] for s in got]
        kinds[label] = {
            "kernelspec": spec,
            "starts": len(got),
            "failed": sum(errors.values()),
            "errors": dict(errors),
            "ready_median_s": round(median(ready), 3),
            "ready_p90_s": round(percentile(ready, 90), 3),
            "ratio_vs_local": ratio(median(ready), median(local)),
            "ratio_p90_vs_local": ratio(percentile(ready, 90), percentile(local, 90)),
            "post_median_s": round(median([s["post"] for s in got]), 3),
            "shutdown_median_s": round(median([s["shutdown"] for s in got]), 3),
            "gpu_at_ready": sum(1 for s in got if s["gpu_at_ready"]),
        }
    return {"rounds": args.rounds, "gpus": server.gpus, "kinds": kinds, "live_leases_after": len(live)}


def print_report(r: dict) -> None:
    print()
    print(f"kernel start, POST /api/kernels -> kernel_info_reply over the websocket; {r['rounds']} interleaved "
          f"rounds, {r['gpus']} simulated GPUs")
    head = (f"{'kind':<18} {'starts':>6} {'failed':>6} {'median s':>9} {'p90 s':>7} {'x local':>8} {'p90 x':>6} "
            f"{'POST s':>7} {'shutdown s':>10} {'GPU at ready':>12}")
    print(head)
    print("-" * len(head))
    for label, k in r["kinds"].items():
        print(f"{label:<18} {k['starts']:>6} {k['failed']:>6} {k['ready_median_s']:>9.3f} {k['ready_p90_s']:>7.3f} "
              f"{k['ratio_vs_local']:>8.2f} {k['ratio_p90_vs_local']:>6.2f} {k['post_median_s']:>7.3f} "
              f"{k['shutdown_median_s']:>10.3f} {k['gpu_at_ready']:>6}/{k['starts']}")
    print("(x local: median against local-provisioner's median; p90 x: the same for p90. POST s: until "
          "POST /api/kernels answered; GPU at ready: starts whose kernel held a lease when it first answered)")
    for label, k in r["kinds"].items():
        for what, n in k["errors"].items():
            print(f"{label}: {n} start(s) failed: {what}")
    print(f"live leases after all kernels were shut down: {r['live_leases_after']}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8, help="measured rounds, one start of each kind (default 8)")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured rounds first (default 1)")
    parser.add_argument("--gpus", type=int, default=4, help="simulated GPUs (default 4)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds before one start counts as hung")
    parser.add_argument("--server-arg", action="append", default=[],
                        help="extra jupyter server option, e.g. --server-arg=--GPUSchedApp.poll_interval=1")
    parser.add_argument("--profile-server", metavar="FILE",
                        help="run the server under cProfile and write its stats to FILE (event loop thread only)")
    parser.add_argument("--keep", action="store_true", help="keep the server's temporary dir (log, ledger)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = parser.parse_args()

    server = JupyterServer(args.gpus, args.server_arg, keep=args.keep, profile=args.profile_server)
    load0 = os.getloadavg()[0]
    try:
        up = server.start()
        if not args.json:
            print(f"server up in {up:.1f}s on port {server.port} ({server.home}); load average {load0:.2f}",
                  flush=True)
        report = asyncio.run(bench(args, server))
    finally:
        down = server.stop()
    report["server_start_s"] = round(up, 2)
    report["server_stop_s"] = round(down, 2)
    report["load_average"] = [round(load0, 2), round(os.getloadavg()[0], 2)]
    report["server_log"] = [{"count": n, "line": text} for text, n in server.log_findings()]
    if args.json:
        print(json.dumps(jsonable(report), indent=2))
    else:
        print_report(report)
        print(f"load average (1 min) before/after: {report['load_average'][0]:.2f} / {report['load_average'][1]:.2f}")
        print_log_findings(server)
    server.cleanup()
    nothing = [label for label, k in report["kinds"].items() if not k["starts"]]
    if nothing:
        print(f"measured nothing: no kernel of {', '.join(nothing)} started", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
