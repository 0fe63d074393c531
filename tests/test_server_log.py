"""What an admin tailing the server's log sees: the scheduler's decisions, in the server's format."""

from __future__ import annotations

import re
import time

import pytest

from conftest import ServerProcess, free_port

pytestmark = pytest.mark.slow


def _log_lines(server: ServerProcess, pattern: str, timeout: float = 20.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while True:
        server.log.flush()
        with open(server.log.name) as f:
            found = [line for line in f if re.search(pattern, line)]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def test_grants_and_releases_reach_the_server_log(tmp_path):
    server = ServerProcess(tmp_path, str(tmp_path / "ledger.sqlite"), free_port())
    try:
        _, kernel = server.call("POST", "api/kernels", {"name": "python3"})
        code, lease = server.call("POST", "api/gpusched/leases", {"kernel_id": kernel["id"]})
        assert code == 201
        granted = _log_lines(server, rf"lease {lease['id']} of kernel {kernel['id']} .*granted")
        # One line, as the server writes its own: level, time, logger name, then the message.
        assert len(granted) == 1, granted
        assert re.match(r"\[I \d{4}-\d\d-\d\d [\d:.]+ jupyter_gpusched\] ", granted[0]), granted[0]
        server.call("DELETE", f"api/gpusched/leases/{lease['id']}")
        released = _log_lines(server, rf"lease {lease['id']} of kernel {kernel['id']} released")
        assert len(released) == 1, released
    finally:
        server.stop()
