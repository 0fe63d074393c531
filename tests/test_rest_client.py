"""The one REST client of the command line and the kernel side, against a small local server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from jupyter_gpusched.rest import RestClient, RestError, running_servers


@pytest.fixture
def server():
    seen: list[tuple[str, str, dict, bytes]] = []
    answers: dict[str, tuple[int, str, bytes]] = {}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _serve(self):
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            seen.append((self.command, self.path, {k.lower(): v for k, v in self.headers.items()}, body))
            path = self.path.split("?")[0]
            if path == "/slow":
                time.sleep(1.5)
            status, ctype, raw = answers.get(path, (200, "application/json", b'{"ok": true}'))
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        do_GET = do_POST = do_DELETE = _serve

    class Server(ThreadingHTTPServer):
        def handle_error(self, request, client_address):
            pass  # a client that gave up (the timeout test) is expected here

    httpd = Server(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    httpd.seen, httpd.answers = seen, answers
    httpd.url = f"http://127.0.0.1:{httpd.server_address[1]}"  # no trailing slash: the client adds it
    yield httpd
    httpd.shutdown()
    httpd.server_close()
    thread.join(5)


def test_requests_send_json_the_token_and_extra_headers(server):
    client = RestClient(server.url, "secret", headers={"X-GPUSched-Token": "k"}, local=True)
    assert client.base_url == server.url + "/"
    status, payload = client.request("POST", "api/gpusched/leases", {"count": 1}, {"kernel_id": "k1", "x": None})
    assert (status, payload) == (200, {"ok": True})
    method, path, headers, body = server.seen[-1]
    assert (method, path) == ("POST", "/api/gpusched/leases?kernel_id=k1")
    assert headers["authorization"] == "token secret" and headers["x-gpusched-token"] == "k"
    assert headers["content-type"] == "application/json" and json.loads(body) == {"count": 1}
    client.request("GET", "api/gpusched/status")
    assert "content-type" not in server.seen[-1][2]  # no body, no content type
    assert "authorization" not in RestClient(server.url).headers


def test_an_empty_answer_is_none(server):
    server.answers["/gone"] = (204, "application/json", b"")
    assert RestClient(server.url).request("DELETE", "gone") == (204, None)


def test_an_error_carries_the_servers_message_and_reason(server):
    server.answers["/bad"] = (409, "application/json", b'{"message": "already held", "reason": "conflict"}')
    with pytest.raises(RestError) as err:
        RestClient(server.url).request("POST", "bad", {})
    assert err.value.status == 409 and err.value.message == "already held" and err.value.reason == "conflict"
    assert err.value.from_server and err.value.http_reason == "Conflict" and str(err.value) == "already held"


def test_an_error_without_a_message_says_the_status(server):
    server.answers["/missing"] = (404, "text/html", b"<html>404: Not Found</html>")
    with pytest.raises(RestError) as err:
        RestClient(server.url).request("GET", "missing")
    assert err.value.status == 404 and not err.value.from_server and err.value.reason is None
    assert err.value.message == "404 Not Found" and err.value.http_reason == "Not Found"


def test_an_answer_that_is_not_json_is_an_error(server):
    server.answers["/html"] = (200, "text/html", b"<html></html>")
    with pytest.raises(RestError) as err:
        RestClient(server.url).request("GET", "html")
    assert err.value.status == 200 and err.value.invalid_json


def test_no_answer_keeps_the_cause(server):
    with pytest.raises(RestError) as err:
        RestClient("http://127.0.0.1:9/", timeout=2).request("GET", "x")
    assert err.value.status is None and err.value.cause is not None and not err.value.timed_out
    assert err.value.message.startswith("cannot reach http://127.0.0.1:9/")
    with pytest.raises(RestError) as err:
        RestClient(server.url, timeout=0.3).request("GET", "slow")
    assert err.value.status is None and err.value.timed_out and err.value.limit == 0.3


def test_running_servers_lists_live_servers_newest_first(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()

    def write(name: str, info: object, age: float) -> None:
        path = tmp_path / name
        path.write_text(json.dumps(info) if not isinstance(info, str) else info)
        moment = time.time() - age
        os.utime(path, (moment, moment))

    write("jpserver-1.json", {"url": "http://127.0.0.1:1/", "pid": os.getpid()}, 30)
    write("jpserver-2.json", {"url": "http://127.0.0.1:2/", "pid": os.getpid()}, 10)
    write("jpserver-3.json", {"url": "http://127.0.0.1:3/", "pid": dead.pid}, 5)
    write("jpserver-4.json", {"url": "http://127.0.0.1:4/", "pid": os.getpid(), "sock": "/tmp/s"}, 5)
    write("jpserver-5.json", {"pid": os.getpid()}, 5)
    write("jpserver-6.json", "{not json", 5)
    write("jpserver-7.json", {"url": "http://127.0.0.1:7/"}, 20)  # no pid: the HTTP check decides
    write("nbserver-8.json", {"url": "http://127.0.0.1:8/", "pid": os.getpid()}, 1)
    urls = [info["url"] for info in running_servers(str(tmp_path))]
    assert urls == ["http://127.0.0.1:2/", "http://127.0.0.1:7/", "http://127.0.0.1:1/"]
    assert running_servers(str(tmp_path / "nowhere")) == []
