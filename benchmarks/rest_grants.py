"""Grant round trips through the REST API of a real server, with many clients at once.

    python benchmarks/rest_grants.py [--clients 50] [--gpus N] [--seconds 20]
                                     [--baseline-seconds 10] [--rounds 4] [--start-batch 10]
                                     [--json] [--keep]

Starts ``jupyter server`` with the extension on ``--gpus`` simulated GPUs (default: one per client,
so that a claim never queues) and one real kernel per client. Each client, on its own keep-alive
connection, then loops ``POST /api/gpusched/leases`` (expects 201) and ``DELETE`` of that lease
(expects 204) for ``--seconds``. The in-run baseline is ``GET /api/status``, jupyter_server's own
trivial endpoint, from the same clients at the same concurrency, in turns with the grants
(``--rounds``, default 4: a change of the machine's load weighs on both alike). The report gives
p50/p99 of each round trip, grants per second, claim/baseline ratios, the CPU the server and the
clients used, and whether the ledger shows any device granted twice. Nothing here asserts on time.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import re
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _server import Connection, JupyterServer, jsonable, percentile, print_log_findings

from jupyter_gpusched.ledger import ACQUIRE_KINDS, Ledger

REQUEST_TIMEOUT = 120.0
UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"


async def start_kernels(server: JupyterServer, count: int, batch: int, spec: str) -> tuple[list[str], list[float]]:
    """Start ``count`` kernels, at most ``batch`` at a time; returns their ids and POST times."""
    ids: list[str] = []
    times: list[float] = []
    todo = iter(range(count))

    async def worker() -> None:
        conn = Connection.to(server)
        try:
            for _ in todo:
                t0 = time.perf_counter()
                status, body = await asyncio.wait_for(
                    conn.request("POST", "/api/kernels", json.dumps({"name": spec}).encode()), REQUEST_TIMEOUT
                )
                if status != 201:
                    raise RuntimeError(f"starting a kernel answered {status}: {body[:300]!r}")
                times.append(time.perf_counter() - t0)
                ids.append(json.loads(body)["id"])
        finally:
            await conn.close()

    await asyncio.gather(*(worker() for _ in range(min(batch, count))))
    return ids, times


class Phase:
    """Latencies and outcomes of one timed phase."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.first: list[float] = []  # GET, or claim
        self.second: list[float] = []  # release
        self.first_at: list[float] = []  # when each first request started, seconds into the phase
        self.unexpected: Counter[str] = Counter()
        self.ok = 0
        self.wall = 0.0
        self.server_cpu = 0.0
        self.client_cpu = 0.0


def merge(phases: list[Phase]) -> Phase:
    """Rounds of one kind as one phase: latencies together, CPU as the share of all their time."""
    out = Phase(phases[0].name)
    for p in phases:
        out.first += p.first
        out.second += p.second
        out.first_at += p.first_at
        out.unexpected.update(p.unexpected)
        out.ok += p.ok
        out.wall += p.wall
        out.server_cpu += p.server_cpu * p.wall
        out.client_cpu += p.client_cpu * p.wall
    if out.wall:
        out.server_cpu /= out.wall
        out.client_cpu /= out.wall
    return out


async def run_phase(
    server: JupyterServer, conns: list[Connection], kernels: list[str], seconds: float, kind: str,
    offset: float = 0.0,
) -> Phase:
    """``seconds`` of one kind of loop; ``first_at`` counts on from ``offset`` (earlier rounds)."""
    phase = Phase(kind)
    began = time.perf_counter()
    start = began - offset
    stop_at = began + seconds
    proc = psutil.Process(server.pid)
    cpu0, own0 = sum(proc.cpu_times()[:2]), time.process_time()

    async def status_client(conn: Connection) -> None:
        while time.perf_counter() < stop_at:
            t0 = time.perf_counter()
            status, _ = await asyncio.wait_for(conn.request("GET", "/api/status"), REQUEST_TIMEOUT)
            t1 = time.perf_counter()
            if status == 200:
                phase.first.append(t1 - t0)
                phase.first_at.append(t0 - start)
                phase.ok += 1
            else:
                phase.unexpected[f"GET /api/status -> {status}"] += 1

    async def grant_client(conn: Connection, kernel_id: str) -> None:
        claim = json.dumps({"kernel_id": kernel_id, "count": 1}).encode()
        while time.perf_counter() < stop_at:
            t0 = time.perf_counter()
            status, body = await asyncio.wait_for(conn.request("POST", "/api/gpusched/leases", claim), REQUEST_TIMEOUT)
            t1 = time.perf_counter()
            if status not in (200, 201, 202):
                message = re.sub(UUID, "<kernel id>", body[:200].decode(errors="replace"))
                phase.unexpected[f"claim -> {status}: {message}"] += 1
                if status == 404:
                    phase.unexpected["clients stopped early: their kernel is gone"] += 1
                    return
                await asyncio.sleep(0.1)
                continue
            if status == 201:
                phase.first.append(t1 - t0)
                phase.first_at.append(t0 - start)
            else:
                phase.unexpected[f"claim -> {status} (expected 201)"] += 1
            lease_id = json.loads(body)["id"]
            t2 = time.perf_counter()
            status, body = await asyncio.wait_for(
                conn.request("DELETE", f"/api/gpusched/leases/{lease_id}"), REQUEST_TIMEOUT
            )
            t3 = time.perf_counter()
            if status == 204:
                phase.second.append(t3 - t2)
                phase.ok += 1
            else:
                phase.unexpected[f"release -> {status}: {body[:200].decode(errors='replace')}"] += 1

    if kind == "status":
        await asyncio.gather(*(status_client(c) for c in conns))
    else:
        await asyncio.gather(*(grant_client(c, k) for c, k in zip(conns, kernels)))
    phase.wall = time.perf_counter() - began
    phase.server_cpu = (sum(proc.cpu_times()[:2]) - cpu0) / phase.wall
    phase.client_cpu = (time.process_time() - own0) / phase.wall
    return phase


def _drift(by_quarter: list[float]) -> float | None:
    """Claim p50 of the last quarter over the first's: above 1, claims cost more as history grows."""
    if len(by_quarter) < 2 or not by_quarter[0] or by_quarter[-1] != by_quarter[-1]:
        return None
    return round(by_quarter[-1] / by_quarter[0], 2)


def quarters(phase: Phase, seconds: float) -> list[float]:
    """Claim p50 (ms) by when the claim was sent, per quarter of the run: drift or a queue building up."""
    if not phase.first:
        return []
    edges = [seconds * i / 4 for i in range(5)]
    out = []
    for lo, hi in itertools.pairwise(edges):
        part = [lat for lat, at in zip(phase.first, phase.first_at, strict=True) if lo <= at < hi]
        out.append(round(statistics.median(part) * 1000, 2) if part else float("nan"))
    return out


def ms(values: list[float], q: float) -> float:
    return round(percentile(values, q) * 1000, 2)


async def bench(args, server: JupyterServer) -> dict:
    t0 = time.perf_counter()
    kernels, post_times = await start_kernels(server, args.clients, args.start_batch, args.kernelspec)
    kernel_start = {
        "kernels": len(kernels),
        "batch": args.start_batch,
        "seconds": round(time.perf_counter() - t0, 2),
        "post_p50_s": round(percentile(post_times, 50), 2),
        "post_max_s": round(max(post_times), 2),
    }
    if not args.json:
        print(
            f"started {len(kernels)} {args.kernelspec} kernels, {args.start_batch} at a time, in "
            f"{kernel_start['seconds']:.1f}s (POST /api/kernels p50 {kernel_start['post_p50_s']:.2f}s, "
            f"max {kernel_start['post_max_s']:.2f}s)",
            flush=True,
        )

    conns = [Connection.to(server) for _ in kernels]
    try:
        warm = await run_phase(server, conns, kernels, args.warmup, "grants") if args.warmup > 0 else None
        # Baseline and grants take turns, so that a change in the machine's load in the middle
        # of the run weighs on both alike; the ledger's history still grows from round to round.
        bases, grant_rounds = [], []
        rounds = max(1, args.rounds)
        for i in range(rounds):
            bases.append(await run_phase(server, conns, kernels, args.baseline_seconds / rounds, "status"))
            grant_rounds.append(
                await run_phase(server, conns, kernels, args.seconds / rounds, "grants", offset=i * args.seconds / rounds)
            )
        base, grants = merge(bases), merge(grant_rounds)
    finally:
        for conn in conns:
            await conn.close()

    _, status = server.call("GET", "/api/gpusched/status")
    live = [le for le in status.get("leases", []) if le.get("state") != "released"]

    ledger = Ledger(server.ledger_path)
    try:
        problems = ledger.check()
        grant_events = sum(1 for e in ledger.events() if e.kind in ACQUIRE_KINDS)
    finally:
        ledger.close()
    client_grants = len(grants.first) + (len(warm.first) if warm else 0)

    def ratio(a: float, b: float) -> float:
        return round(a / b, 2) if b else float("nan")

    claim50, claim99 = ms(grants.first, 50), ms(grants.first, 99)
    rel50, rel99 = ms(grants.second, 50), ms(grants.second, 99)
    base50, base99 = ms(base.first, 50), ms(base.first, 99)
    return {
        "clients": args.clients,
        "gpus": server.gpus,
        "kernelspec": args.kernelspec,
        "kernel_start": kernel_start,
        "baseline": {
            "endpoint": "GET /api/status",
            "seconds": round(base.wall, 2),
            "requests": len(base.first),
            "per_second": round(len(base.first) / base.wall, 1),
            "p50_ms": base50,
            "p99_ms": base99,
            "server_cpu": round(base.server_cpu, 2),
            "client_cpu": round(base.client_cpu, 2),
            "unexpected": dict(base.unexpected),
        },
        "grants": {
            "seconds": round(grants.wall, 2),
            "granted": len(grants.first),
            "released": len(grants.second),
            "per_second": round(len(grants.first) / grants.wall, 1),
            "claim_p50_ms": claim50,
            "claim_p99_ms": claim99,
            "release_p50_ms": rel50,
            "release_p99_ms": rel99,
            "claim_p50_by_quarter_ms": quarters(grants, args.seconds),
            "server_cpu": round(grants.server_cpu, 2),
            # Server CPU per grant (its claim and its release), and per baseline request.
            "server_cpu_ms_per_grant": round(1000 * grants.server_cpu * grants.wall / max(1, len(grants.first)), 2),
            "server_cpu_ms_per_baseline_request": round(1000 * base.server_cpu * base.wall / max(1, len(base.first)), 2),
            "client_cpu": round(grants.client_cpu, 2),
            "unexpected": dict(grants.unexpected),
        },
        "ratios": {
            "claim_p50_vs_baseline": ratio(claim50, base50),
            "claim_p99_vs_baseline": ratio(claim99, base99),
            "release_p50_vs_baseline": ratio(rel50, base50),
            "release_p99_vs_baseline": ratio(rel99, base99),
            "claim_p50_last_vs_first_quarter": _drift(quarters(grants, args.seconds)),
        },
        "ledger": {
            "problems": problems,
            "grant_events": grant_events,
            "grants_seen_by_clients": client_grants,
            "live_leases_after": len(live),
        },
    }


def print_report(r: dict) -> None:
    b, g, q = r["baseline"], r["grants"], r["ratios"]
    print()
    print(f"REST grant round trips: {r['clients']} clients, {r['gpus']} simulated GPUs, one {r['kernelspec']} "
          f"kernel per client")
    head = f"{'request':<34} {'count':>7} {'per s':>8} {'p50 ms':>8} {'p99 ms':>8} {'p50 x':>6} {'p99 x':>6}"
    print(head)
    print("-" * len(head))
    print(f"{'GET /api/status (baseline)':<34} {b['requests']:>7} {b['per_second']:>8.1f} {b['p50_ms']:>8.2f} "
          f"{b['p99_ms']:>8.2f} {1.0:>6.2f} {1.0:>6.2f}")
    print(f"{'POST /api/gpusched/leases (201)':<34} {g['granted']:>7} {g['per_second']:>8.1f} "
          f"{g['claim_p50_ms']:>8.2f} {g['claim_p99_ms']:>8.2f} {q['claim_p50_vs_baseline']:>6.2f} "
          f"{q['claim_p99_vs_baseline']:>6.2f}")
    print(f"{'DELETE /api/gpusched/leases/{id}':<34} {g['released']:>7} {g['released'] / g['seconds']:>8.1f} "
          f"{g['release_p50_ms']:>8.2f} {g['release_p99_ms']:>8.2f} {q['release_p50_vs_baseline']:>6.2f} "
          f"{q['release_p99_vs_baseline']:>6.2f}")
    print(f"(p50 x / p99 x: against the baseline's p50 / p99; {b['seconds']:.0f}s baseline, {g['seconds']:.0f}s "
          f"of grants)")
    print(f"grants per second: {g['per_second']:.1f}   claim p50 by quarter of the run (ms): "
          f"{', '.join(f'{v:.2f}' for v in g['claim_p50_by_quarter_ms'])}")
    print(f"CPU (1.0 = one core): server {b['server_cpu']:.2f} baseline / {g['server_cpu']:.2f} grants; "
          f"clients {b['client_cpu']:.2f} / {g['client_cpu']:.2f}")
    print(f"server CPU ms per grant (claim + release): {g['server_cpu_ms_per_grant']:.2f}, per baseline request: "
          f"{g['server_cpu_ms_per_baseline_request']:.2f}   claim p50 last/first quarter: "
          f"{q['claim_p50_last_vs_first_quarter']}")
    for label, bad in (("baseline", b["unexpected"]), ("grants", g["unexpected"])):
        for what, n in bad.items():
            print(f"unexpected in {label}: {n} x {what}")
    led = r["ledger"]
    if led["problems"]:
        print(f"LEDGER CHECK FAILED: {len(led['problems'])} problem(s):")
        for p in led["problems"][:20]:
            print(f"  {p}")
    else:
        print(f"ledger check: sound, no device ever double-granted ({led['grant_events']} grant events replayed; "
              f"clients got {led['grants_seen_by_clients']} 201s incl. warm-up; "
              f"{led['live_leases_after']} live leases left)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=50, help="concurrent clients, one kernel each (default 50)")
    parser.add_argument("--gpus", type=int, default=0, help="simulated GPUs (default 0: one per client)")
    parser.add_argument("--seconds", type=float, default=20.0, help="seconds of claim/release loops (default 20)")
    parser.add_argument("--baseline-seconds", type=float, default=10.0,
                        help="seconds of GET /api/status loops (default 10)")
    parser.add_argument("--rounds", type=int, default=4,
                        help="baseline and grant phases take turns this many times (default 4)")
    parser.add_argument("--warmup", type=float, default=2.0, help="unmeasured seconds of grants first (default 2)")
    parser.add_argument("--start-batch", type=int, default=10, help="kernels started at once (default 10)")
    parser.add_argument("--kernelspec", default="python3",
                        help="kernelspec of the clients' kernels (default python3; gpusched-lazy also works)")
    parser.add_argument("--server-arg", action="append", default=[],
                        help="extra jupyter server option, e.g. --server-arg=--GPUSchedApp.poll_interval=1")
    parser.add_argument("--profile-server", metavar="FILE",
                        help="run the server under cProfile and write its stats to FILE (event loop thread only)")
    parser.add_argument("--keep", action="store_true", help="keep the server's temporary dir (log, ledger)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = parser.parse_args()

    server = JupyterServer(args.gpus or args.clients, args.server_arg, keep=args.keep, profile=args.profile_server)
    load0 = os.getloadavg()[0]
    try:
        up = server.start()
        if not args.json:
            print(f"server up in {up:.1f}s on port {server.port} ({server.home})", flush=True)
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
        print(f"server stopped in {down:.1f}s (shutting down {report['kernel_start']['kernels']} kernels); "
              f"load average (1 min) before/after: {report['load_average'][0]:.2f} / {report['load_average'][1]:.2f}")
        print_log_findings(server)
    server.cleanup()
    nothing = [what for what, n in (("no claim was granted", report["grants"]["granted"]),
                                    ("no GET /api/status was answered", report["baseline"]["requests"])) if not n]
    if nothing:
        print(f"measured nothing: {'; '.join(nothing)}", file=sys.stderr)
    return 1 if report["ledger"]["problems"] or nothing else 0


if __name__ == "__main__":
    sys.exit(main())
