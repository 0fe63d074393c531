"""Load on the hub's GPU broker: many users' servers claiming and releasing GPUs at once.

    python benchmarks/hub_load.py [--users 50] [--gpus 8] [--seconds 30] [--hold 0.2] [--watching 1.0] [--json] [--keep]
                                  [--profile-broker FILE]

Starts a real JupyterHub with configurable-http-proxy and the broker as a managed service,
configured by ``examples/jupyterhub_config.py`` (plus simulated GPUs, free ports and a scratch
directory), creates ``--users`` hub users with a token each, and stands up one "server" per
user in this process: a ``BrokerClient``, the same class a single-user server runs in hub mode,
authenticated with that user's token, with its websocket and heartbeats, reporting one kernel
(whose process is a sleeping child of this script, so that the broker sees a live owner). Every
server then loops: claim a GPU for its kernel (``wait`` 0: granted or queued), if queued wait
for the grant with long polls, hold it for a random time up to ``--hold`` seconds, release it.

Reports p50 and p99 of the claim call (the answer, 201 or 202), the time from claim to grant,
the release call, grants per second, and whether any GPU was ever granted twice at once: from
the ledger's own history (``Ledger.check``) and from the clients' record of who held which GPU
when. Nothing here asserts on time; the exit status is 1 if a double grant or a ledger problem
is found.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # hub_util: the real JupyterHub the hub tests start

from jupyter_gpusched.arbiter import ArbiterError  # noqa: E402
from jupyter_gpusched.arbiter.remote import BrokerClient  # noqa: E402
from jupyter_gpusched.ledger import Ledger  # noqa: E402
from jupyter_gpusched.api.input import Claim  # noqa: E402
from jupyter_gpusched.api.views import Principal  # noqa: E402

from hub_util import Hub  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank ``q`` percentile (0-100); NaN without samples."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered), max(1, math.ceil(q / 100 * len(ordered)))) - 1]


def summary(values: list[float]) -> dict:
    ms = [v * 1000 for v in values]
    out = {"n": len(ms), "p50": percentile(ms, 50), "p99": percentile(ms, 99), "max": max(ms) if ms else math.nan}
    return {k: (None if isinstance(v, float) and math.isnan(v) else round(v, 1) if isinstance(v, float) else v) for k, v in out.items()}


class FakeKernels:
    """What a single-user server's kernel manager tells its BrokerClient: one kernel, busy while it holds."""

    def __init__(self, pid: int) -> None:
        self.server_id = uuid.uuid4().hex
        self.kernel_id = str(uuid.uuid4())
        self.pid = pid
        self.busy = False
        self.last = time.time()

    def activity(self):
        return {self.kernel_id: (self.busy, self.last, self.last)}

    def alive(self, kernel_id):
        return True if kernel_id == self.kernel_id else None

    def restarting(self, kernel_id):
        return False

    def kernel_pid(self, kernel_id):
        return self.pid

    def process_tree(self, kernel_id):
        return {self.pid}

    def process_trees(self):
        return {self.kernel_id: {self.pid}}

    def notebook(self, kernel_id):
        return "load.ipynb"

    async def refresh_notebooks(self):
        return None

    def adopted(self, kernel_id):
        return None

    def user_of(self, kernel_id):
        return None

    async def restart(self, kernel_id):
        return None

    async def shutdown(self, kernel_id):
        return None


class Record:
    def __init__(self) -> None:
        self.claim: list[float] = []
        self.grant_wait: list[float] = []
        self.release: list[float] = []
        self.holds: dict[str, list[tuple[float, float, str]]] = defaultdict(list)
        self.grants = 0
        self.queued = 0
        self.errors: list[str] = []
        self.events = 0

    def event(self, event) -> None:
        self.events += 1


async def user_loop(client: BrokerClient, kernels: FakeKernels, user: str, until: float, hold: float, rec: Record) -> None:
    who = Principal(user=user)
    while time.monotonic() < until:
        try:
            t0 = time.monotonic()
            result = await client.claim(who, Claim(kernels.kernel_id, count=1))
            rec.claim.append(time.monotonic() - t0)
            lease = result.lease
            if result.status == 202:
                rec.queued += 1
                while lease["state"] == "pending":
                    left = until + 30 - time.monotonic()
                    if left <= 0:
                        break
                    result = await client.claim(who, Claim(kernels.kernel_id, wait=min(10.0, left)))
                    lease = result.lease
            if lease["state"] not in ("active", "idle"):
                if lease["state"] == "pending":
                    await client.release(who, lease["id"])
                continue
            granted = time.monotonic()
            rec.grant_wait.append(granted - t0)
            rec.grants += 1
            kernels.busy, kernels.last = True, time.time()
            await asyncio.sleep(random.uniform(0, hold))
            kernels.busy, kernels.last = False, time.time()
            released = time.monotonic()
            await client.release(who, lease["id"])
            rec.release.append(time.monotonic() - released)
            for device in lease["devices"]:
                rec.holds[device].append((granted, released, lease["id"]))
        except ArbiterError as exc:
            rec.errors.append(f"{user}: {exc.status} {exc.message}")
            await asyncio.sleep(0.5)


def overlaps(holds: dict[str, list[tuple[float, float, str]]]) -> list[str]:
    """Two leases that both held one GPU at once, by the clients' own clocks."""
    out = []
    for device, spans in holds.items():
        spans = sorted(spans)
        for (_, e1, l1), (s2, _, l2) in zip(spans, spans[1:], strict=False):
            if s2 < e1:
                out.append(f"{device}: lease {l2} granted at {s2:.3f} while {l1} held it until {e1:.3f}")
    return out


async def run(hub: Hub, users: list[str], seconds: float, hold: float, watching: float, rec: Record) -> float:
    url = f"http://127.0.0.1:{hub.broker_port}/services/gpusched/"
    sleepers = []
    clients = []
    try:
        for _ in users:
            sleepers.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"]))
        pairs = []
        for user, proc in zip(users, sleepers, strict=True):
            kernels = FakeKernels(proc.pid)
            client = BrokerClient(url, kernels=kernels, user=user, token=hub.token(user), heartbeat_interval=2.0)
            if len(clients) < round(watching * len(users)):
                client.subscribe(rec.event)  # as a JupyterLab's events websocket does
            clients.append(client)
            pairs.append((client, kernels, user))
        await asyncio.gather(*(c.start() for c in clients))
        start = time.monotonic()
        until = start + seconds
        await asyncio.gather(*(user_loop(c, k, u, until, hold, rec) for c, k, u in pairs))
        return time.monotonic() - start
    finally:
        await asyncio.gather(*(c.stop() for c in clients), return_exceptions=True)
        for proc in sleepers:
            proc.kill()
        for proc in sleepers:
            proc.wait(10)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--users", type=int, default=50, help="hub users, each with a server (default 50)")
    parser.add_argument("--gpus", type=int, default=8, help="simulated GPUs (default 8)")
    parser.add_argument("--seconds", type=float, default=30.0, help="length of the run (default 30)")
    parser.add_argument("--hold", type=float, default=0.2, help="longest hold of a GPU, seconds (default 0.2)")
    parser.add_argument(
        "--watching", type=float, default=1.0,
        help="share of servers with a browser watching (an events listener), 0-1 (default 1: all)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--keep", action="store_true", help="keep the hub's directory (log, ledger)")
    parser.add_argument("--profile-broker", metavar="FILE", help="run the broker under cProfile, stats to FILE")
    args = parser.parse_args(argv)

    workdir = Path(tempfile.mkdtemp(prefix="gpusched-hub-load-"))
    users = [f"user{i:03d}" for i in range(args.users)]
    broker = {
        "simulated_devices": args.gpus,
        "poll_interval": 1.0,
        "heartbeat_interval": 2.0,
        "heartbeat_timeout": 30.0,
        "max_pending_per_user": 4,
        "quotas": {},
    }
    rec = Record()
    extra = ""
    if args.profile_broker:
        extra = (
            "for service in c.JupyterHub.services:\n"
            "    if service.get('name') == 'gpusched':\n"
            "        cmd = service['command']\n"
            f"        service['command'] = cmd[:1] + ['-m', 'cProfile', '-o', {os.path.abspath(args.profile_broker)!r}] + cmd[1:]\n"
        )
    hub = Hub(workdir, broker=broker, log_level="WARN", extra_config=extra)
    load_before = os.getloadavg()
    try:
        t0 = time.monotonic()
        hub.start()
        hub.create_users(users)
        for user in users:
            hub.token(user)
        setup = time.monotonic() - t0
        broker_proc = hub.broker_process()
        cpu0 = broker_proc.cpu_times() if broker_proc else None
        wall = asyncio.run(run(hub, users, args.seconds, args.hold, args.watching, rec))
        cpu1 = broker_proc.cpu_times() if broker_proc else None
        with Ledger(hub.ledger_path) as ledger:
            problems = ledger.check()
            live = [le for le in ledger.leases() if le.live]
    finally:
        hub.stop()
    double = overlaps(rec.holds)
    broker_cpu = (cpu1.user + cpu1.system - cpu0.user - cpu0.system) if cpu0 and cpu1 else None
    report = {
        "users": args.users,
        "gpus": args.gpus,
        "seconds": round(wall, 1),
        "setup_seconds": round(setup, 1),
        "claims": len(rec.claim),
        "queued": rec.queued,
        "grants": rec.grants,
        "grants_per_second": round(rec.grants / wall, 1) if wall else None,
        "claim_ms": summary(rec.claim),
        "claim_to_grant_ms": summary(rec.grant_wait),
        "release_ms": summary(rec.release),
        "broker_cpu_percent": round(100 * broker_cpu / wall, 1) if broker_cpu is not None else None,
        "watching_servers": round(args.watching * args.users),
        "events_received": rec.events,
        "errors": len(rec.errors),
        "error_examples": rec.errors[:5],
        "double_grants": double[:10],
        "ledger_problems": problems[:10],
        "live_leases_after": len(live),
        "load_average_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "cpus": psutil.cpu_count(),
    }
    if args.keep:
        report["workdir"] = str(workdir)
    if args.json:
        print(json.dumps(report))
    else:
        print(f"{args.users} users' servers, {args.gpus} simulated GPUs, {report['seconds']}s (setup {report['setup_seconds']}s)")
        print(f"claims {report['claims']} (queued {rec.queued}), grants {rec.grants}, {report['grants_per_second']} grants/s")
        for name in ("claim_ms", "claim_to_grant_ms", "release_ms"):
            s = report[name]
            print(f"  {name:18} p50 {s['p50']} ms  p99 {s['p99']} ms  max {s['max']} ms  (n={s['n']})")
        print(f"events to {report['watching_servers']} watching servers: {rec.events}")
        print(f"broker CPU {report['broker_cpu_percent']}% of one core; load {report['load_average_before_after']}")
        print(f"errors {len(rec.errors)} {rec.errors[:3]}")
        print(f"double grants: {len(double)}; ledger problems: {len(problems)}; live leases after: {len(live)}")
    if not args.keep:
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)
    return 1 if double or problems else 0


if __name__ == "__main__":
    sys.exit(main())
