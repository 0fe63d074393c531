"""The admin verbs of ``jupyter gpusched``: status, release, drain, kernelspec install.

They talk to a running Jupyter server with the extension through its REST API, found from the
server files in the Jupyter runtime directory (or ``--url`` and ``--token``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any

from .core import SchedulingError, format_bytes, format_duration, parse_memory
from .rest import RestClient, RestError
from .rest import running_servers as _running_servers

#: Seconds a command waits for the server's answer.
TIMEOUT = 30.0


class CommandError(Exception):
    """Something the person running the command should read; exit status 1."""


# -- finding the server ------------------------------------------------------------------------
def running_servers() -> list[dict]:
    """Server files of running Jupyter servers of this user, newest first."""
    from jupyter_core.paths import jupyter_runtime_dir

    return _running_servers(jupyter_runtime_dir())


class Server:
    """One server's GPU scheduler API."""

    def __init__(self, url: str, token: str = "") -> None:
        self.url = url if url.endswith("/") else url + "/"
        self.token = token
        self._rest = RestClient(
            self.url, token, headers={"Content-Type": "application/json"}, timeout=TIMEOUT
        )

    @classmethod
    def find(cls, url: str | None, token: str | None) -> Server:
        if url:
            return cls(url, token or os.environ.get("JUPYTER_TOKEN", ""))
        env_url = os.environ.get("JUPYTER_GPUSCHED_URL")
        if env_url:
            return cls(env_url, token or os.environ.get("JUPYTER_TOKEN", ""))
        for info in running_servers():
            server = cls(info["url"], info.get("token", ""))
            try:
                server.call("GET", "status")
            except CommandError:
                continue
            return server
        raise CommandError(
            "no running Jupyter server with the GPU scheduler was found; start one "
            "(jupyter lab) or pass --url and --token"
        )

    def call(self, method: str, path: str, body: Any = None) -> Any:
        try:
            return self._rest.request(method, "api/gpusched/" + path, body)[1]
        except RestError as exc:
            if exc.status is None:
                raise CommandError(f"cannot reach {self.url}: {exc.cause}") from None
            if exc.invalid_json:
                raise CommandError(f"{self.url} answered {exc.status} with something that is not JSON") from None
            raise CommandError(f"{exc.status}: {exc.message if exc.from_server else exc.http_reason}") from None


# -- rendering ---------------------------------------------------------------------------------
def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)] if rows else [len(h) for h in header]
    lines = ["  ".join(str(h).ljust(w) for h, w in zip(header, widths)).rstrip()]
    for row in rows:
        lines.append("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())
    return "\n".join(lines)


def _pct(value: Any) -> str:
    return "-" if value is None else f"{value:.0f}%"


def render_status(status: dict) -> str:
    """The status as a person reads it: GPUs, leases, queue."""
    out = [
        f"GPU scheduler: {status['mode']} mode, {status['backend']} backend, {status['policy']} policy; "
        f"checkpoint {'available' if status.get('checkpoint', {}).get('available') else 'unavailable'}"
        f" ({status.get('checkpoint', {}).get('reason', '-')})"
    ]
    if status.get("backend_note"):
        out.append(f"note: {status['backend_note']}")
    checkpoint = status.get("checkpoint") or {}
    if checkpoint.get("available") and "host_memory_held" in checkpoint:
        budget = checkpoint.get("host_memory_budget")
        held = format_bytes(checkpoint["host_memory_held"])
        of = "no limit" if budget is None else f"{format_bytes(budget)} (checkpoint_host_memory)"
        out.append(f"checkpoints hold {held} of host memory, of {of}")
    leases = {le["id"]: le for le in status["leases"]}
    rows = []
    for d in status["devices"]:
        holders = ", ".join(
            f"{leases[lid]['user']}" + (f" ({leases[lid]['state']})" if lid in leases else "")
            for lid in d["lease_ids"]
            if lid in leases
        )
        used = "-" if d["memory_used"] is None else format_bytes(d["memory_used"])
        rows.append(
            [
                str(d["index"]),
                d["name"],
                d["health"],
                _pct(d["utilization"]),
                f"{used} / {format_bytes(d['memory_total'])}",
                holders or "free",
            ]
        )
    out.append("")
    out.append(_table(rows, ["GPU", "NAME", "HEALTH", "UTIL", "MEMORY", "HELD BY"]) if rows else "No GPUs.")
    rows = []
    for le in status["leases"]:
        if le["state"] == "pending":
            continue
        gpus = ",".join(str(i) for i in le["device_indices"]) or "-"
        when = ""
        if le.get("reclaim_at"):
            when = f"reclaim at {le['reclaim_at']}"
        elif le.get("keep_until"):
            when = f"kept until {le['keep_until']}"
        elif le.get("idle_seconds"):
            when = f"idle {format_duration(le['idle_seconds'])}"
        rows.append(
            [
                le["id"][:12],
                le["user"],
                (le.get("notebook") or le.get("kernel_id") or "-")[:40],
                gpus,
                le["state"],
                when,
            ]
        )
    out.append("")
    out.append(_table(rows, ["LEASE", "USER", "KERNEL", "GPUS", "STATE", ""]) if rows else "No leases.")
    if status["queue"]:
        rows = [
            [str(q["position"]), q["lease_id"][:12], q["user"], str(q["count"]), q.get("waiting_since") or "-"]
            for q in status["queue"]
        ]
        out.append("")
        out.append(_table(rows, ["#", "LEASE", "USER", "GPUS", "WAITING SINCE"]))
    else:
        out.append("")
        out.append("Queue: empty.")
    unleased = status.get("unleased_processes") or []
    if unleased:
        out.append("")
        out.append(f"{len(unleased)} GPU process(es) hold no lease: " + ", ".join(str(p["pid"]) for p in unleased))
    return "\n".join(out)


# -- verbs -------------------------------------------------------------------------------------
def cmd_status(args: argparse.Namespace) -> int:
    status = Server.find(args.url, args.token).call("GET", "status")
    print(json.dumps(status, indent=2) if args.json else render_status(status))
    return 0


def _resolve_lease(server: Server, prefix: str) -> str:
    leases = server.call("GET", "leases")
    matches = [le["id"] for le in leases if le["id"].startswith(prefix)]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise CommandError(f"no lease {prefix!r}; `jupyter gpusched status` lists them")
    raise CommandError(f"{prefix!r} matches {len(matches)} leases; give more of the id")


def cmd_release(args: argparse.Namespace) -> int:
    server = Server.find(args.url, args.token)
    lease_id = _resolve_lease(server, args.lease)
    server.call("DELETE", f"leases/{lease_id}")
    print(f"released lease {lease_id}")
    return 0


def cmd_drain(args: argparse.Namespace) -> int:
    server = Server.find(args.url, args.token)
    action = "undrain" if args.undo else "drain"
    device = server.call("POST", f"devices/{args.uuid}/{action}", {"reason": args.reason or ""})
    state = "drained: no new leases on it" if device["health"] == "drained" else f"{device['health']}"
    print(f"GPU {device['index']} ({device['uuid']}) {state}")
    return 0


def cmd_kernelspec_install(args: argparse.Namespace) -> int:
    from jupyter_client.kernelspec import KernelSpecManager

    if args.gpus < 0:
        raise CommandError("--gpus must be 0 or more")
    try:
        parse_memory(args.memory or None, "--memory")
    except SchedulingError as exc:
        raise CommandError(str(exc)) from None
    config: dict[str, Any] = {"gpus": args.gpus, "bind": args.bind, "mode": args.mode}
    if args.memory:
        config["memory"] = args.memory
    what = f"{args.gpus} GPU{'s' if args.gpus != 1 else ''}"
    if args.mode == "shared":
        what += f", shared {args.memory}" if args.memory else ", shared"
    elif args.memory:
        what += f", {args.memory}"
    display = args.display_name or f"Python 3 ({what}, {args.bind})"
    spec = {
        "argv": [args.python or sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": display,
        "language": "python",
        "metadata": {
            "kernel_provisioner": {"provisioner_name": "gpusched-provisioner", "config": config},
            "debugger": True,
        },
    }
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "kernel.json"), "w") as f:
            json.dump(spec, f, indent=1)
        dest = KernelSpecManager().install_kernel_spec(
            tmp, kernel_name=args.name, user=args.user, prefix=args.prefix or (sys.prefix if args.sys_prefix else None)
        )
    print(f"Installed kernelspec {args.name} in {dest}: {display}")
    return 0


def add_verbs(sub: argparse._SubParsersAction) -> None:
    """Add status, release, drain and kernelspec to the ``jupyter gpusched`` parser."""

    def server_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--url", help="server URL (default: the running Jupyter server with the extension)")
        p.add_argument("--token", help="server token (default: from the server file or JUPYTER_TOKEN)")

    p = sub.add_parser("status", help="GPUs, leases and the queue")
    server_args(p)
    p.add_argument("--json", action="store_true", help="print the status as JSON")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("release", help="release a lease now")
    server_args(p)
    p.add_argument("lease", help="lease id (a unique prefix will do)")
    p.set_defaults(func=cmd_release)

    p = sub.add_parser("drain", help="admin: no new leases on a GPU (--undo puts it back)")
    server_args(p)
    p.add_argument("uuid", help="GPU UUID, as `status --json` shows it")
    p.add_argument("--undo", action="store_true", help="put the GPU back into service")
    p.add_argument("--reason", help="why, shown to users")
    p.set_defaults(func=cmd_drain)

    p = sub.add_parser("kernelspec", help="kernelspecs that get their GPUs from the scheduler")
    ksub = p.add_subparsers(dest="kernelspec_cmd", required=True)
    k = ksub.add_parser("install", help="install a kernelspec that uses gpusched-provisioner")
    k.add_argument("--name", required=True, help="kernelspec name, e.g. python3-gpu")
    k.add_argument("--gpus", type=int, default=1, help="GPUs per kernel (default 1)")
    k.add_argument("--memory", default="", help="GPU memory per GPU, e.g. 16GiB (default: whole GPUs)")
    k.add_argument("--mode", choices=("exclusive", "shared"), default="exclusive")
    k.add_argument("--bind", choices=("lazy", "launch"), default="lazy", help="when the kernel gets its GPUs")
    k.add_argument("--display-name", help="name shown in the launcher")
    k.add_argument("--python", help="Python executable for the kernel (default: this one)")
    k.add_argument("--user", action="store_true", help="install for this user only")
    k.add_argument("--sys-prefix", action="store_true", help="install into this environment")
    k.add_argument("--prefix", help="install under this prefix")
    k.set_defaults(func=cmd_kernelspec_install)
