"""The broker's page at the service's URL: hub login through OAuth (``HubOAuth``).

A hub admin sees the whole host: every GPU with its telemetry, every lease with its user, the
queue (and why each claim stands where it does), each user's and group's recent GPU usage, GPU processes that belong to no lease (with their Unix user), GPU processes left behind
by servers that stopped sending heartbeats, the connected servers; and can drain, undrain and
release. Any other user with access to the service sees the host as the REST API shows it to
them: their own leases in full, others' as held by "another user".

Beyond one host (one broker per GPU node), a hub admin also sees the cluster view ("Nodes"):
this node and every other node broker (``GPUBroker.node_brokers``), each with its GPUs, leases
and queue as its node summary says; a node whose broker does not answer, is not asked (the token
may not go there) or is broken (a summary that fails the schema, a certificate not verified) is
listed as such, with the reason: another node never makes this page fail.

Every button that changes something (drain, undrain, release) leads to a confirmation page first
(no JavaScript needed): the change is made only by a POST that carries the page's XSRF token and
``confirm=yes``. No page may be framed by another site (``frame-ancestors 'none'``), so a click
cannot be stolen through an invisible frame.
"""

from __future__ import annotations

import html
import logging
from typing import Any

from jupyterhub.services.auth import HubOAuthCallbackHandler, HubOAuthenticated, UserNotAllowed
from tornado import web

from ..core import format_bytes
from ..core.fairness import half_life_text
from .. import kubernetes
from ..api.input import http_error
from ..api.views import Principal

log = logging.getLogger("jupyter_gpusched.hub.page")

REFRESH_SECONDS = 5
#: The pages have no script and load nothing; only their inline style is allowed.
CONTENT_SECURITY_POLICY = "default-src 'none'; style-src 'unsafe-inline'; base-uri 'none'; frame-ancestors 'none'"

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.1em; margin-top: 1.6em; } h3 { font-size: 1em; margin-top: 1.2em; }
table { border-collapse: collapse; margin-top: .4em; }
th, td { border-bottom: 1px solid #ddd; padding: .3em .7em; text-align: left; font-size: .9em; vertical-align: top; }
th { background: #f4f4f4; }
.muted { color: #777; } .warn { color: #a40; } .ok { color: #060; }
form { display: inline; } button { font-size: .85em; }
code { font-size: .85em; }
.confirm { max-width: 40em; } .confirm button { font-size: 1em; margin-right: 1em; }
"""


def _e(value: Any) -> str:
    return html.escape("" if value is None else str(value))


def _bytes(value: Any) -> str:
    return format_bytes(value) if isinstance(value, int) else "?"


class OAuthCallbackHandler(HubOAuthCallbackHandler):
    """The end of the hub login, with the broker's own HubOAuth (it remembers the login's state)."""

    def initialize(self, app: Any) -> None:
        self.hub_auth = app.hub_auth


class PageBase(HubOAuthenticated, web.RequestHandler):
    """Hub OAuth login; the user model is fetched without blocking the event loop."""

    def initialize(self, app: Any) -> None:
        self.app = app
        self.broker = app.broker
        self.hub_auth = app.hub_auth
        self._model: dict | None = None

    def set_default_headers(self) -> None:
        # Also on error pages: tornado calls this again when it clears the headers for one.
        self.set_header("Content-Security-Policy", CONTENT_SECURITY_POLICY)
        self.set_header("X-Frame-Options", "DENY")
        self.set_header("X-Content-Type-Options", "nosniff")
        self.set_header("Referrer-Policy", "same-origin")
        self.set_header("Cache-Control", "no-store")

    async def prepare(self) -> None:
        model = await self.hub_auth.get_user(self, sync=False)
        if model:
            try:
                model = self.check_hub_user(model)
            except UserNotAllowed:
                raise web.HTTPError(403, "you may not use the GPU broker (ask the hub admin for access)") from None
        self._model = model or None

    def get_current_user(self) -> dict | None:
        return self._model

    def principal(self) -> Principal:
        model = self._model or {}
        return Principal(
            user=model.get("name", ""),
            groups=tuple(model.get("groups") or ()),
            admin=bool(model.get("admin")),
            show_holders=self.app.show_holders,
        )

    def form(self, action: str, label: str) -> str:
        """A button that opens the confirmation page of ``action`` (it changes nothing itself)."""
        return (
            f'<form method="get" action="{_e(self.app.prefix + action)}">'
            f'<button type="submit">{_e(label)}…</button></form>'
        )

    def html_page(self, title: str, body: str, refresh: bool = False) -> str:
        return (
            "<!DOCTYPE html><html><head><meta charset='utf-8'>"
            + (f"<meta http-equiv='refresh' content='{REFRESH_SECONDS}'>" if refresh else "")
            + f"<title>{_e(title)}</title><style>{_STYLE}</style></head><body>{body}</body></html>"
        )

    def _xsrf(self) -> str:
        token = self.xsrf_token
        return token.decode() if isinstance(token, bytes) else str(token)


class PageHandler(PageBase):
    @web.authenticated
    async def get(self) -> None:
        who = self.principal()
        status = await self.broker.status(who)
        # The cluster view is the application's (GPUBroker.cluster); an app without one has none.
        cluster = getattr(self.app, "cluster", None)
        nodes = await cluster() if who.admin and cluster is not None else None
        self.set_header("Content-Type", "text/html; charset=utf-8")
        self.finish(self.render_page(status, who, nodes))

    def render_page(self, status: dict, who: Principal, nodes: dict | None = None) -> str:
        node = f"Node <b>{_e(status['node'])}</b>. " if status.get("node") else ""
        parts = [
            "<h1>GPUs of this host</h1>",
            f"<p class='muted'>{node}Signed in as <b>{_e(who.user)}</b>{' (hub admin)' if who.admin else ''}. "
            f"Policy <code>{_e(status.get('policy'))}</code>, {_e(status.get('backend'))} backend"
            f"{(' (' + _e(status.get('backend_note')) + ')') if status.get('backend_note') else ''}. "
            f"Updated {_e(status.get('time'))}, every {REFRESH_SECONDS}s.</p>",
        ]
        parts += self._devices(status, who)
        parts += self._leases(status, who)
        parts += self._queue(status)
        parts += self._usage(status)
        if who.admin:
            parts += self._processes(status)
            parts += self._servers(status)
        if nodes is not None and (len(nodes.get("nodes", ())) > 1 or nodes.get("error")):
            parts += self._nodes(nodes)
        return self.html_page("GPUs of this host", "".join(parts), refresh=True)

    def _nodes(self, cluster: dict) -> list[str]:
        """The cluster view: one row per node (in DRA mode, each node's GPU claim), then each
        node's GPUs and queue."""
        rows, details, claims = [], [], []
        for node in cluster.get("nodes", []):
            if not isinstance(node, dict):
                continue
            name = _e(node.get("name")) + (" <span class='muted'>(this node)</span>" if node.get("this") else "")
            where = f"<br><code class='muted'>{_e(node.get('url'))}</code>" if node.get("url") else ""
            claim = node.get("claim")
            if isinstance(claim, dict):  # DRA mode: the node's GPUs as one ResourceClaim
                cls = "warn" if claim.get("problem") else ""
                claims.append(f"<tr><td>{_e(node.get('name'))}</td><td class='{cls}'>{_e(claim.get('text'))}</td></tr>")
            state, why = self._node_state(node)
            if state != kubernetes.OK:
                because = f": {_e(why)}" if why else ""
                rows.append(f"<tr><td>{name}{where}</td><td colspan='5' class='warn'>{_e(state)}{because}</td></tr>")
                continue
            summary = node["summary"]
            try:
                detail = self._node_detail(node.get("name"), summary)
            except Exception:  # noqa: BLE001 - one node that cannot be shown must not fail the page
                log.exception("cannot show the summary of node %s", node.get("name"))
                rows.append(f"<tr><td>{name}{where}</td><td colspan='5' class='warn'>broken: its summary cannot be shown</td></tr>")
                continue
            rows.append(
                f"<tr><td>{name}{where}</td><td>{_e(summary.get('gpus'))}</td><td>{_e(summary.get('free'))}</td>"
                f"<td>{_e(summary.get('reclaimable'))}</td><td>{_e(summary.get('leases'))}</td>"
                f"<td>{_e(summary.get('pending'))}</td></tr>"
            )
            details += detail
        if not rows:
            rows.append("<tr><td colspan='6' class='muted'>no nodes</td></tr>")
        error = cluster.get("error")
        note = f"<p class='warn'>The other nodes could not be listed: {_e(error)}</p>" if error else ""
        if cluster.get("claims_error"):
            note += f"<p class='warn'>The nodes' GPU claims could not be read: {_e(cluster['claims_error'])}</p>"
        return [
            "<h2>Nodes</h2>", note,
            "<table><tr><th>node</th><th>GPUs</th><th>free</th><th>reclaimable</th><th>leases</th>"
            "<th>waiting</th></tr>",
            *rows,
            "</table>",
            *(["<h3>GPU claims</h3><table><tr><th>node</th><th>claim</th></tr>", *claims, "</table>"] if claims else []),
            *details,
        ]

    @staticmethod
    def _node_state(node: dict) -> tuple[str, str]:
        """A node's state for the cluster view (``ok``, ``not answering``, ``not asked``, ``broken``) and why.

        A summary is shown only when it is a node summary (checked here again, whoever asked for
        it); without one, the reason is the node's own (``state``, ``problem``) or the last report
        of its broker in this process.
        """
        summary = node.get("summary")
        if summary is not None:
            problem = kubernetes.summary_problem(summary)
            return (kubernetes.BROKEN, f"not a node summary: {problem}") if problem else (kubernetes.OK, "")
        if node.get("state"):
            return str(node["state"]), str(node.get("problem") or "")
        report = kubernetes.last_report(node["url"]) if isinstance(node.get("url"), str) else None
        if report is not None and report.state != kubernetes.OK:
            return report.state, report.problem
        return kubernetes.NOT_ANSWERING, ""

    def _node_detail(self, name: Any, summary: dict) -> list[str]:
        gpus = [
            f"<tr><td>{_e(d.get('index'))}</td><td>{_e(d.get('name'))}</td><td>{_bytes(d.get('memory_total'))}</td>"
            f"<td class='{'ok' if d.get('health') == 'ok' else 'warn'}'>{_e(d.get('health'))}</td>"
            f"<td>{_e(d.get('state'))}</td><td>{_e(', '.join(d.get('users') or ())) or '-'}</td></tr>"
            for d in summary.get("devices", [])
        ] or ["<tr><td colspan='6' class='muted'>no GPUs</td></tr>"]
        queue = ", ".join(
            f"{_e(q.get('user'))} ({_e(q.get('count'))} GPU{'s' if q.get('count') != 1 else ''})"
            for q in summary.get("queue", [])
        ) or "<span class='muted'>nobody waits</span>"
        return [
            f"<h3>{_e(name)}</h3><table><tr><th>#</th><th>GPU</th><th>memory</th><th>health</th>"
            "<th>state</th><th>held by</th></tr>",
            *gpus,
            f"</table><p>Queue: {queue}</p>",
        ]

    def _devices(self, status: dict, who: Principal) -> list[str]:
        rows = []
        holders = {le["id"]: le for le in status.get("leases", [])}
        for d in status.get("devices", []):
            held = ", ".join(_e(holders[i]["user"]) for i in d.get("lease_ids", []) if i in holders) or "<span class='muted'>free</span>"
            health = d.get("health")
            cls = "ok" if health == "ok" else "warn"
            health_text = _e(health) + (f": {_e(d.get('drain_reason'))}" if d.get("drain_reason") else "")
            action = ""
            if who.admin and health == "drained":
                action = self.form(f"admin/devices/{d['uuid']}/undrain", "Undrain")
            elif who.admin and health == "ok":
                action = self.form(f"admin/devices/{d['uuid']}/drain", "Drain")
            util = d.get("utilization")
            rows.append(
                f"<tr><td>{_e(d['index'])}</td><td>{_e(d['name'])}<br><code class='muted'>{_e(d['uuid'])}</code></td>"
                f"<td>{_bytes(d.get('memory_used'))} / {_bytes(d.get('memory_total'))}</td>"
                f"<td>{'?' if util is None else _e(round(util))}%</td>"
                f"<td class='{cls}'>{health_text}</td><td>{held}</td>"
                f"<td>{len(d.get('processes', []))}</td><td>{action}</td></tr>"
            )
        return [
            "<h2>Devices</h2><table><tr><th>#</th><th>GPU</th><th>memory</th><th>util.</th>"
            "<th>health</th><th>held by</th><th>processes</th><th></th></tr>",
            *rows,
            "</table>",
        ]

    def _leases(self, status: dict, who: Principal) -> list[str]:
        rows = []
        for le in status.get("leases", []):
            gpus = ", ".join(f"GPU {i}" for i in le.get("device_indices", [])) or "-"
            action = ""
            if (le.get("mine") or who.admin) and le.get("state") != "released":
                action = self.form(f"admin/leases/{le['id']}/release", "Release")
            rows.append(
                f"<tr><td><code>{_e(le['id'][:12])}</code></td><td>{_e(le['user'])}</td>"
                f"<td><code>{_e((le.get('kernel_id') or '-')[:12])}</code></td><td>{_e(le.get('notebook') or '')}</td>"
                f"<td>{_e(le['state'])}</td><td>{_e(gpus)}</td><td>{_e(le.get('count'))}</td>"
                f"<td>{_e(le.get('idle_seconds') if le.get('idle_seconds') is not None else '')}</td>"
                f"<td>{_e(le.get('reason'))}</td><td>{action}</td></tr>"
            )
        if not rows:
            rows.append("<tr><td colspan='10' class='muted'>no leases</td></tr>")
        return [
            "<h2>Leases</h2><table><tr><th>lease</th><th>user</th><th>kernel</th><th>notebook</th>"
            "<th>state</th><th>GPUs</th><th>count</th><th>idle s</th><th>why</th><th></th></tr>",
            *rows,
            "</table>",
        ]

    def _queue(self, status: dict) -> list[str]:
        rows = [
            f"<tr><td>{_e(q['position'])}</td><td>{_e(q['user'])}</td><td>{_e(q['count'])}</td>"
            f"<td>{_e(q['waiting_since'])}</td><td><code>{_e(q['lease_id'][:12])}</code></td>"
            f"<td>{_e(q.get('reason'))}</td></tr>"
            for q in status.get("queue", [])
        ] or ["<tr><td colspan='6' class='muted'>nobody waits</td></tr>"]
        return [
            "<h2>Queue</h2><table><tr><th>position</th><th>user</th><th>GPUs</th><th>waiting since</th><th>lease</th>"
            "<th>why here</th></tr>",
            *rows,
            "</table>",
        ]

    def _usage(self, status: dict) -> list[str]:
        """Recent usage per user and group (fair share with memory), when the broker tracks it."""
        half_life = (status.get("config") or {}).get("usage_half_life")
        if not half_life:
            return []
        rows = [
            f"<tr><td>{_e(u['user'])}</td><td>{float(u['gpu_hours']):.1f}</td><td>{float(u['quota']):g}</td>"
            f"<td>{float(u['held']):g}</td></tr>"
            for u in status.get("usage", [])
        ] or ["<tr><td colspan='4' class='muted'>nobody used a GPU recently</td></tr>"]
        parts = [
            f"<h2>Recent usage</h2><p class='muted'>GPU-hours held, halving every {_e(half_life_text(float(half_life)))}; "
            "it orders the queue after quota and picks whose borrowed GPU is taken back first.</p>"
            "<table><tr><th>user</th><th>GPU-hours</th><th>quota (GPUs)</th><th>holds now</th></tr>",
            *rows,
            "</table>",
        ]
        groups = [
            f"<tr><td>{_e(g['group'])}</td><td>{float(g['gpu_hours']):.1f}</td><td>{float(g['held']):g}</td></tr>"
            for g in status.get("group_usage", [])
        ]
        if groups:
            parts += ["<table><tr><th>group</th><th>GPU-hours</th><th>holds now</th></tr>", *groups, "</table>"]
        return parts

    def _processes(self, status: dict) -> list[str]:
        index = {d["uuid"]: d["index"] for d in status.get("devices", [])}
        rows = [
            f"<tr><td>{_e(p['pid'])}</td><td>{_e(p.get('unix_user') or '?')}</td>"
            f"<td>GPU {_e(index.get(p.get('device'), '?'))}</td><td>{_bytes(p.get('memory_used'))}</td>"
            f"<td>{_e(p.get('user') or '')}</td><td><code>{_e((p.get('server_id') or '')[:12])}</code></td>"
            f"<td>{_e(p.get('pod') or '')}</td></tr>"
            for p in status.get("unleased_processes", [])
        ] or ["<tr><td colspan='7' class='muted'>none</td></tr>"]
        stranded = [
            f"<tr><td>{_e(p['pid'])}</td><td>{_e(p.get('unix_user') or '?')}</td><td>{_e(p['user'])}</td>"
            f"<td><code>{_e(p['kernel_id'][:12])}</code></td><td><code>{_e(p['server_id'][:12])}</code></td></tr>"
            for p in status.get("stranded_processes", [])
        ] or ["<tr><td colspan='5' class='muted'>none</td></tr>"]
        return [
            "<h2>GPU processes without a lease</h2><table><tr><th>pid</th><th>Unix user</th><th>GPU</th><th>memory</th>"
            "<th>hub user</th><th>server</th><th>pod</th></tr>",
            *rows,
            "</table>",
            "<h2>GPU processes left behind by silent servers</h2><table><tr><th>pid</th><th>Unix user</th>"
            "<th>hub user</th><th>kernel</th><th>server</th></tr>",
            *stranded,
            "</table>",
        ]

    def _servers(self, status: dict) -> list[str]:
        rows = [
            f"<tr><td>{_e(s['user'])}</td><td><code>{_e(s['server_id'][:12])}</code></td><td>{_e(s.get('pod') or '')}</td>"
            f"<td>{_e(s.get('pid'))}</td>"
            f"<td class='{'ok' if s['connected'] else 'warn'}'>{'connected' if s['connected'] else 'silent'}</td>"
            f"<td>{_e(s['silent_seconds'])}</td><td>{len(s['kernels'])}</td></tr>"
            for s in status.get("servers", [])
        ] or ["<tr><td colspan='7' class='muted'>none</td></tr>"]
        return [
            "<h2>Single-user servers</h2><table><tr><th>user</th><th>server</th><th>pod</th><th>pid</th><th>state</th>"
            "<th>last heard s ago</th><th>kernels</th></tr>",
            *rows,
            "</table>",
        ]


class _Action(PageBase):
    """GET: the confirmation page. POST with ``confirm=yes`` (and the XSRF token): the change."""

    def back(self) -> None:
        self.redirect(self.app.prefix)

    async def act(self, fn) -> None:
        from ..arbiter import ArbiterError

        try:
            await fn()
        except ArbiterError as exc:
            raise http_error(exc.status, exc.message) from None
        self.back()

    def confirmed(self) -> bool:
        return self.get_body_argument("confirm", "") == "yes"

    def confirm_page(self, question: str, detail: str, label: str) -> None:
        """Ask before changing anything; the answer is a POST of this same URL."""
        body = (
            f"<div class='confirm'><h1>{_e(question)}</h1><p>{detail}</p>"
            f'<form method="post" action="{_e(self.request.path)}">'
            f'<input type="hidden" name="_xsrf" value="{_e(self._xsrf())}">'
            '<input type="hidden" name="confirm" value="yes">'
            f'<button type="submit">{_e(label)}</button></form>'
            f'<a href="{_e(self.app.prefix)}">Cancel</a></div>'
        )
        self.set_header("Content-Type", "text/html; charset=utf-8")
        self.finish(self.html_page(question, body))


class DrainFormHandler(_Action):
    @web.authenticated
    async def get(self, uuid: str, action: str) -> None:
        await self.ask(uuid, action)

    async def ask(self, uuid: str, action: str) -> None:
        who = self.principal()
        if not who.admin:
            raise web.HTTPError(403, "only a hub admin can drain or undrain a GPU")
        status = await self.broker.status(who)
        device = next((d for d in status.get("devices", []) if d.get("uuid") == uuid), None)
        if device is None:
            raise web.HTTPError(404, "no such GPU on this host")
        gpu = f"GPU {device.get('index')}"
        if action == "drain":
            held = len(device.get("lease_ids") or ())
            self.confirm_page(
                f"Drain {gpu}?",
                f"{_e(device.get('name'))} <code>{_e(uuid)}</code>: no new lease will be granted on it until "
                f"it is undrained. {held} lease(s) on it now keep it until they end.",
                f"Drain {gpu}",
            )
        else:
            self.confirm_page(
                f"Undrain {gpu}?",
                f"{_e(device.get('name'))} <code>{_e(uuid)}</code>: new leases may be granted on it again "
                "(check that its maintenance is over).",
                f"Undrain {gpu}",
            )

    @web.authenticated
    async def post(self, uuid: str, action: str) -> None:
        if not self.confirmed():
            await self.ask(uuid, action)
            return
        who = self.principal()
        await self.act(lambda: self.broker.drain(who, uuid, action == "drain", f"drained by {who.user} on the admin page"))


class ReleaseFormHandler(_Action):
    @web.authenticated
    async def get(self, lease_id: str) -> None:
        await self.ask(lease_id)

    async def ask(self, lease_id: str) -> None:
        who = self.principal()
        status = await self.broker.status(who)
        lease = next((le for le in status.get("leases", []) if le.get("id") == lease_id), None)
        if lease is None or not (who.admin or lease.get("mine")):
            raise web.HTTPError(404, "no such lease of yours")
        gpus = ", ".join(f"GPU {i}" for i in lease.get("device_indices") or ()) or "no GPU yet"
        notebook = f" ({_e(lease['notebook'])})" if lease.get("notebook") else ""
        self.confirm_page(
            "Release this lease?",
            f"Lease <code>{_e(lease_id[:12])}</code> of {_e(lease.get('user'))}{notebook}, {_e(lease.get('state'))}, "
            f"on {_e(gpus)}: it ends now, and its GPUs go to whoever waits.",
            "Release the lease",
        )

    @web.authenticated
    async def post(self, lease_id: str) -> None:
        if not self.confirmed():
            await self.ask(lease_id)
            return
        who = self.principal()
        await self.act(lambda: self.broker.release(who, lease_id))
