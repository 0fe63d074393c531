"""Load on the hub's GPU broker: many users' servers claiming and releasing GPUs at once.

    python benchmarks/hub_load.py [--users 50] [--gpus 8] [--seconds 20] [--baseline-seconds 10] [--rounds 2]
                                  [--hold 0.2] [--watching 1.0] [--json] [--keep] [--profile-broker FILE]

Starts a real JupyterHub with configurable-http-proxy and the broker as a managed service,
configured by ``examples/jupyterhub_config.py`` (plus simulated GPUs, free ports and a scratch
directory), creates ``--users`` hub users with a token each, and starts one "server" per user: a
child process of this script with the user's token and name in its environment
(``JUPYTERHUB_API_TOKEN``, ``JUPYTERHUB_USER``), as JupyterHub starts a single-user server, so that
the broker's checks of a server's process pass. Each runs a ``BrokerClient``, the same class a
single-user server runs in hub mode, with its websocket and heartbeats, reporting one kernel
whose process is a sleeping child of that server.

The servers take ``--rounds`` turns of two phases, all at once: ``GET api/gpusched/status``
through the broker in a loop (the baseline: a request that takes no decision), then claims: claim
a GPU for its kernel (``wait`` 0: granted or queued), if queued wait for the grant with long
polls, hold it for a random time up to ``--hold`` seconds, release it. Taking turns lets a change
of the machine's load weigh on both alike.

Reports p50 and p99 of the status call and of the claim call (the answer, 201 or 202) and their
ratio, the time from claim to grant, the release call, grants per second, the broker's CPU per
grant and per status request, and whether any GPU was ever granted twice at once: from the
ledger's own history (``Ledger.check``) and from the servers' record of who held which GPU when.
Nothing here asserts on time; the exit status is 1 if a double grant or a ledger problem is found,
and if the run measured nothing (no grant, or no status answered).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
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
from jupyter_gpusched.api.input import Claim  # noqa: E402
from jupyter_gpusched.api.views import Principal  # noqa: E402


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


class OneKernel:
    """What a single-user server's kernel manager tells its BrokerClient: one kernel (a sleeping
    child process of the server), busy while it holds a GPU."""

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
    """What one server measured (it goes to the parent as JSON, and records merge there)."""

    def __init__(self) -> None:
        self.status: list[float] = []
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

    def to_json(self) -> dict:
        return {k: v for k, v in vars(self).items()}

    def merge(self, data: dict) -> None:
        for name in ("status", "claim", "grant_wait", "release", "errors"):
            getattr(self, name).extend(data[name])
        for name in ("grants", "queued", "events"):
            setattr(self, name, getattr(self, name) + data[name])
        for device, spans in data["holds"].items():
            self.holds[device].extend(tuple(span) for span in spans)


async def status_loop(client: BrokerClient, user: str, until: float, rec: Record) -> None:
    """The baseline: ``GET api/gpusched/status`` through the broker, again and again."""
    who = Principal(user=user)
    while time.monotonic() < until:
        try:
            t0 = time.monotonic()
            await client.status(who)
            rec.status.append(time.monotonic() - t0)
        except ArbiterError as exc:
            rec.errors.append(f"{user}: status: {exc.status} {exc.message}")
            await asyncio.sleep(0.5)


async def user_loop(client: BrokerClient, kernels: OneKernel, user: str, until: float, hold: float, rec: Record) -> None:
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


# -- a user's server: a child process, started as JupyterHub starts one ---------------------------
async def serve(url: str, user: str, heartbeat: float) -> None:
    """One user's server: connect to the broker, then run the phases the parent sends on stdin
    (one JSON object a line), answering each on stdout when done; ``report`` ends it."""
    loop = asyncio.get_running_loop()
    kernel = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    kernels = OneKernel(kernel.pid)
    client = BrokerClient(url, kernels=kernels, user=user, token=os.environ["JUPYTERHUB_API_TOKEN"], heartbeat_interval=heartbeat)
    rec = Record()

    def answer(data: dict) -> None:
        sys.stdout.write(json.dumps(data) + "\n")
        sys.stdout.flush()

    try:
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line:
                return  # the parent is gone
            order = json.loads(line)
            if order["phase"] == "connect":
                if order["watching"]:
                    client.subscribe(rec.event)  # as a JupyterLab's events websocket does
                await client.start()
                answer({"connected": client.connected})
            elif order["phase"] == "status":
                await status_loop(client, user, time.monotonic() + order["seconds"], rec)
                answer({"done": True})
            elif order["phase"] == "claims":
                await user_loop(client, kernels, user, time.monotonic() + order["seconds"], order["hold"], rec)
                answer({"done": True})
            elif order["phase"] == "report":
                answer(rec.to_json())
                return
    finally:
        await client.stop()
        kernel.kill()
        kernel.wait(10)


class Servers:
    """The users' server processes, driven phase by phase from here."""

    def __init__(self, url: str, tokens: dict[str, str], log_path: Path, heartbeat: float) -> None:
        self._log = open(log_path, "ab")
        self.procs: dict[str, subprocess.Popen] = {}
        for user, token in tokens.items():
            env = dict(os.environ)
            env.update({"JUPYTERHUB_API_TOKEN": token, "JUPYTERHUB_USER": user})
            self.procs[user] = subprocess.Popen(
                [sys.executable, __file__, "--serve", url, "--user", user, "--heartbeat", str(heartbeat)],
                env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
            )

    def all(self, order: dict | None = None, *, each: dict[str, dict] | None = None) -> dict[str, dict]:
        """Send every server ``order`` (or each its own, from ``each``) and wait for every answer."""
        for user, proc in self.procs.items():
            proc.stdin.write(json.dumps(each[user] if each is not None else order) + "\n")
            proc.stdin.flush()
        answers = {}
        for user, proc in self.procs.items():
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the server of {user} exited ({proc.wait()}): see its log")
            answers[user] = json.loads(line)
        return answers

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    proc.stdin.close()
                except OSError:
                    pass
        for proc in self.procs.values():
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        self._log.close()


def cpu_seconds(proc: psutil.Process | None) -> float | None:
    if proc is None:
        return None
    try:
        times = proc.cpu_times()
    except psutil.Error:
        return None
    return times.user + times.system


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--users", type=int, default=50, help="hub users, each with a server (default 50)")
    parser.add_argument("--gpus", type=int, default=8, help="simulated GPUs (default 8)")
    parser.add_argument("--seconds", type=float, default=20.0, help="seconds of claims, all rounds together (default 20)")
    parser.add_argument(
        "--baseline-seconds", type=float, default=10.0,
        help="seconds of GET status through the broker, all rounds together (default 10)",
    )
    parser.add_argument("--rounds", type=int, default=2, help="turns of baseline and claims (default 2)")
    parser.add_argument("--hold", type=float, default=0.2, help="longest hold of a GPU, seconds (default 0.2)")
    parser.add_argument(
        "--watching", type=float, default=1.0,
        help="share of servers with a browser watching (an events listener), 0-1 (default 1: all)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--keep", action="store_true", help="keep the hub's directory (log, ledger)")
    parser.add_argument("--profile-broker", metavar="FILE", help="run the broker under cProfile, stats to FILE")
    parser.add_argument("--serve", metavar="URL", help=argparse.SUPPRESS)  # a user's server (a child)
    parser.add_argument("--user", help=argparse.SUPPRESS)
    parser.add_argument("--heartbeat", type=float, default=2.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format=f"[{args.user}] %(message)s")
        asyncio.run(serve(args.serve, args.user, args.heartbeat))
        return 0

    from hub_util import Hub  # the parent only: the servers need no hub

    from jupyter_gpusched.ledger import Ledger

    workdir = Path(tempfile.mkdtemp(prefix="gpusched-hub-load-"))
    users = [f"user{i:03d}" for i in range(args.users)]
    heartbeat = 2.0
    broker = {
        "simulated_devices": args.gpus,
        "poll_interval": 1.0,
        "heartbeat_interval": heartbeat,
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
    servers = None
    load_before = os.getloadavg()
    wall = {"status": 0.0, "claims": 0.0}
    cpu = {"status": 0.0, "claims": 0.0}
    try:
        t0 = time.monotonic()
        hub.start()
        hub.create_users(users)
        tokens = {user: hub.token(user) for user in users}
        url = f"http://127.0.0.1:{hub.broker_port}/services/gpusched/"
        servers = Servers(url, tokens, workdir / "servers.log", heartbeat)
        watching = set(users[: round(args.watching * len(users))])
        answers = servers.all(each={user: {"phase": "connect", "watching": user in watching} for user in users})
        unconnected = sorted(user for user, a in answers.items() if not a["connected"])
        setup = time.monotonic() - t0
        broker_proc = hub.broker_process()
        rounds = max(1, args.rounds)
        for _ in range(rounds):
            for phase, seconds in (("status", args.baseline_seconds), ("claims", args.seconds)):
                c0, w0 = cpu_seconds(broker_proc), time.monotonic()
                servers.all({"phase": phase, "seconds": seconds / rounds, "hold": args.hold})
                c1, wall[phase] = cpu_seconds(broker_proc), wall[phase] + time.monotonic() - w0
                cpu[phase] = cpu[phase] + (c1 - c0) if c0 is not None and c1 is not None else math.nan
        for data in servers.all({"phase": "report"}).values():
            rec.merge(data)
        with Ledger(hub.ledger_path) as ledger:
            problems = ledger.check()
            live = [le for le in ledger.leases() if le.live]
    finally:
        if servers is not None:
            servers.stop()
        hub.stop()
    double = overlaps(rec.holds)
    status_ms, claim_ms = summary(rec.status), summary(rec.claim)
    nothing = []
    if not rec.grants:
        nothing.append("no claim was granted")
    if not rec.status:
        nothing.append("no GET status was answered")

    def per(seconds: float, count: int) -> float | None:
        return round(1000 * seconds / count, 2) if count and not math.isnan(seconds) else None

    report = {
        "users": args.users,
        "gpus": args.gpus,
        "rounds": rounds,
        "seconds": round(wall["claims"], 1),
        "baseline_seconds": round(wall["status"], 1),
        "setup_seconds": round(setup, 1),
        "servers_unconnected": unconnected[:10],
        "statuses": len(rec.status),
        "claims": len(rec.claim),
        "queued": rec.queued,
        "grants": rec.grants,
        "grants_per_second": round(rec.grants / wall["claims"], 1) if wall["claims"] else None,
        "status_ms": status_ms,
        "claim_ms": claim_ms,
        "claim_p50_over_status_p50": (
            round(claim_ms["p50"] / status_ms["p50"], 2) if claim_ms["p50"] and status_ms["p50"] else None
        ),
        "claim_to_grant_ms": summary(rec.grant_wait),
        "release_ms": summary(rec.release),
        "broker_cpu_percent": round(100 * cpu["claims"] / wall["claims"], 1) if wall["claims"] and not math.isnan(cpu["claims"]) else None,
        "broker_cpu_ms_per_grant": per(cpu["claims"], rec.grants),
        "broker_cpu_ms_per_status": per(cpu["status"], len(rec.status)),
        "watching_servers": len(watching),
        "events_received": rec.events,
        "errors": len(rec.errors),
        "error_examples": rec.errors[:5],
        "double_grants": double[:10],
        "ledger_problems": problems[:10],
        "live_leases_after": len(live),
        "measured_nothing": nothing,
        "load_average_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "cpus": psutil.cpu_count(),
    }
    if args.keep:
        report["workdir"] = str(workdir)
    if args.json:
        print(json.dumps(report))
    else:
        print(
            f"{args.users} users' servers, {args.gpus} simulated GPUs, {rounds} rounds: "
            f"{report['seconds']}s of claims, {report['baseline_seconds']}s of status (setup {report['setup_seconds']}s)"
        )
        if unconnected:
            print(f"servers that did not connect: {len(unconnected)} {unconnected[:3]}")
        print(f"claims {report['claims']} (queued {rec.queued}), grants {rec.grants}, {report['grants_per_second']} grants/s")
        for name in ("status_ms", "claim_ms", "claim_to_grant_ms", "release_ms"):
            s = report[name]
            print(f"  {name:18} p50 {s['p50']} ms  p99 {s['p99']} ms  max {s['max']} ms  (n={s['n']})")
        print(f"claim p50 / GET status p50: {report['claim_p50_over_status_p50']}")
        print(
            f"broker CPU {report['broker_cpu_percent']}% of one core during claims; "
            f"{report['broker_cpu_ms_per_grant']} ms per grant (claim + release), "
            f"{report['broker_cpu_ms_per_status']} ms per status; load {report['load_average_before_after']}"
        )
        print(f"events to {report['watching_servers']} watching servers: {rec.events}")
        print(f"errors {len(rec.errors)} {rec.errors[:3]}")
        print(f"double grants: {len(double)}; ledger problems: {len(problems)}; live leases after: {len(live)}")
    if nothing:
        print(f"measured nothing: {'; '.join(nothing)} (servers' log: {workdir / 'servers.log'})", file=sys.stderr)
    if not args.keep and not nothing:
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)
    return 1 if double or problems or nothing else 0


if __name__ == "__main__":
    sys.exit(main())
