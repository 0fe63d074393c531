"""One small client for the ``api/gpusched`` REST API, for the command line and the kernel side.

Only the standard library (urllib): a kernel must not import tornado or jupyter_server, and the
command line needs nothing more. A request returns ``(status, decoded JSON)``; any failure is a
:class:`RestError` that keeps what is needed to say what happened (the HTTP status, the server's
``{"message", "reason"}``, or the exception when no answer came), and each caller words it for
its own audience. :func:`running_servers` lists the live Jupyter servers of a runtime directory.
"""

from __future__ import annotations

import glob
import json
import os
import ssl
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from typing import Any

#: Seconds a request may take unless the client or the call says otherwise.
DEFAULT_TIMEOUT = 10.0


class RestError(Exception):
    """A request failed.

    Attributes:
        message: the server's ``message`` when it gave one (``from_server``), else a short
            description of what went wrong.
        status: the HTTP status; ``None`` when no answer came.
        reason: the server's short ``reason``, when it gave one.
        http_reason: the reason phrase of the HTTP status line (``Not Found``).
        from_server: whether ``message`` is the server's own.
        invalid_json: the server answered (``status``) with a body that is not JSON.
        cause: the exception raised when no answer came (a ``URLError``, ``TimeoutError``...).
        limit: the timeout the request had, in seconds.
    """

    def __init__(
        self,
        message: str,
        status: int | None = None,
        reason: str | None = None,
        *,
        http_reason: str | None = None,
        from_server: bool = False,
        invalid_json: bool = False,
        cause: BaseException | None = None,
        limit: float | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.status = status
        self.reason = reason
        self.http_reason = http_reason
        self.from_server = from_server
        self.invalid_json = invalid_json
        self.cause = cause
        self.limit = limit

    def __str__(self) -> str:
        return self.message

    @property
    def timed_out(self) -> bool:
        """No answer came within the timeout."""
        return isinstance(self.cause, TimeoutError)


def _is_loopback(host: str | None) -> bool:
    return host in ("localhost", "127.0.0.1", "::1", "[::1]") or bool(host and host.startswith("127."))


class RestClient:
    """Requests to ``<base_url><path>`` with a Jupyter token and JSON in and out.

    Args:
        base_url: the server's URL including its base_url path, e.g. ``http://127.0.0.1:8888/``.
        token: a Jupyter server token, sent as ``Authorization: token ...`` (none if empty).
        headers: more headers for every request (a per-kernel token, a User-Agent).
        timeout: seconds a request may take unless the call says otherwise.
        local: the server is this host's own: bypass proxy settings, and accept a self-signed
            certificate on a loopback address (the traffic never leaves the host).
    """

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        *,
        headers: Mapping[str, str] | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        local: bool = False,
    ):
        if not base_url.endswith("/"):
            base_url += "/"
        self.base_url = base_url
        self.token = token or None
        self.timeout = timeout
        self.headers = dict(headers or {})
        if self.token:
            self.headers.setdefault("Authorization", f"token {self.token}")
        handlers: list[urllib.request.BaseHandler] = []
        if local:
            handlers.append(urllib.request.ProxyHandler({}))
            parsed = urllib.parse.urlsplit(base_url)
            if parsed.scheme == "https" and _is_loopback(parsed.hostname):
                context = ssl.create_default_context()
                context.check_hostname = False
                context.verify_mode = ssl.CERT_NONE
                handlers.append(urllib.request.HTTPSHandler(context=context))
        self._opener = urllib.request.build_opener(*handlers)

    def __repr__(self) -> str:
        return f"RestClient({self.base_url!r})"

    def url(self, path: str, query: Mapping[str, Any] | None = None) -> str:
        """The URL of ``path`` (relative to ``base_url``) with ``query`` (``None`` values left out)."""
        url = self.base_url + path.lstrip("/")
        if query:
            url += "?" + urllib.parse.urlencode({k: v for k, v in query.items() if v is not None})
        return url

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        query: Mapping[str, Any] | None = None,
        *,
        timeout: float | None = None,
    ) -> tuple[int, Any]:
        """One request; returns ``(status, decoded JSON or None)`` or raises :class:`RestError`."""
        data = None
        headers = dict(self.headers)
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        req = urllib.request.Request(self.url(path, query), data=data, headers=headers, method=method)
        limit = self.timeout if timeout is None else timeout
        try:
            with self._opener.open(req, timeout=limit) as resp:
                status = resp.status
                raw = resp.read()
        except urllib.error.HTTPError as err:
            with err:
                raw = err.read()
            raise _http_error(err.code, str(err.reason), raw, limit) from None
        except (urllib.error.URLError, OSError) as err:  # TimeoutError is an OSError
            raise RestError(f"cannot reach {self.base_url}: {err}", cause=err, limit=limit) from None
        if not raw:
            return status, None
        try:
            return status, json.loads(raw)
        except ValueError:
            raise RestError(
                f"{self.base_url} answered {status} with something that is not JSON",
                status,
                invalid_json=True,
                limit=limit,
            ) from None


def _http_error(status: int, http_reason: str, raw: bytes, limit: float) -> RestError:
    message = reason = None
    try:
        payload = json.loads(raw) if raw else None
    except ValueError:
        payload = None
    if isinstance(payload, dict):
        message = payload.get("message") or None
        reason = payload.get("reason") or None
    if message:
        return RestError(str(message), status, reason, http_reason=http_reason, from_server=True, limit=limit)
    return RestError(f"{status} {http_reason}", status, reason, http_reason=http_reason, limit=limit)


# -- finding servers -----------------------------------------------------------------------------
def running_servers(runtime_dir: str) -> list[dict]:
    """The ``jpserver-*.json`` files of live servers in ``runtime_dir``, newest first.

    As jupyter_server's ``list_running_servers``, less the servers urllib cannot speak to (Unix
    sockets) and the files without a URL or that cannot be read.
    """
    found: list[tuple[float, dict]] = []
    for path in glob.glob(os.path.join(runtime_dir, "jpserver-*.json")):
        try:
            with open(path, encoding="utf-8") as fh:
                info = json.load(fh)
            mtime = os.path.getmtime(path)
        except (OSError, ValueError):
            continue
        if not isinstance(info, dict) or not info.get("url"):
            continue
        if info.get("sock"):
            continue  # a Unix socket server: urllib cannot speak to it
        if not _server_alive(info.get("pid")):
            continue
        found.append((mtime, info))
    found.sort(key=lambda pair: pair[0], reverse=True)
    return [info for _, info in found]


def _server_alive(pid: object) -> bool:
    try:
        number = int(pid)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return True  # no pid recorded: let the HTTP check decide
    if isinstance(pid, bool) or number <= 0:
        return True
    from .procs import alive  # imported here: a kernel imports psutil only when it looks

    return alive(number)
