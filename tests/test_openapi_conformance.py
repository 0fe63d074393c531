"""The OpenAPI document against the API that serves it, checked by Schemathesis.

Schemathesis reads the document from a running server (and from a running hub broker), then
calls every operation with examples, boundary values, fuzzed input and chains of calls (its
examples, coverage, fuzzing and stateful phases). Each answer must be no server error, carry a
status code the document lists for that operation, match the response schema the document gives
for it, and, for a request the document calls invalid, be a refusal. Claims name a real kernel
(the server's or, for the broker, one its connected server reports), so that grants, releases and
keeps are exercised too and not only refusals.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time

import pytest
import schemathesis
from schemathesis.config import SchemathesisConfig
from schemathesis.engine import Status, events, from_schema

from conftest import ServerProcess, free_port
from test_hub_broker import Setup, until

CHECKS = ("not_a_server_error", "status_code_conformance", "response_schema_conformance", "negative_data_rejection")
#: Examples per operation and phase: enough to reach every status code, small enough for about
#: half a minute per API.
MAX_EXAMPLES = 25
SEED = 20261203


def _config(base_url: str, token: str, kernels: list[str]) -> SchemathesisConfig:
    return SchemathesisConfig.from_dict(
        {
            "seed": SEED,
            "base-url": base_url,
            "headers": {"Authorization": f"token {token}"},
            "checks": {
                "enabled": False,
                **{name: {"enabled": True} for name in CHECKS},
                # 503 is no failure of the server but its documented answer when no GPU can be
                # scheduled (and the calls here drain both GPUs now and then).
                "not_a_server_error": {"enabled": True, "expected-statuses": ["2xx", "3xx", "4xx", "503"]},
            },
            "phases": {name: {"enabled": True} for name in ("examples", "coverage", "fuzzing", "stateful")},
            "generation": {"max-examples": MAX_EXAMPLES, "database": "none"},
            # Claims for a kernel that runs, half of the time (the other half: unknown kernels).
            "dictionaries": {"kernels": {"values": kernels}},
            "parameters": {"body.kernel_id": {"dictionary": "kernels", "probability": 0.5}},
            "continue-on-failure": True,
            "max-failures": 100,
            "cache": {"enabled": False},
        }
    )


class Report:
    """What one Schemathesis run found: failures, errors and the status codes each operation gave."""

    def __init__(self) -> None:
        self.failures: dict[tuple[str, str, str], str] = {}
        self.errors: list[str] = []
        self.statuses: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.phases: dict[str, str] = {}
        self.seconds = 0.0

    def problems(self) -> str:
        lines = [f"{op}: {title}: {message}\n    {sample}" for (op, title, message), sample in self.failures.items()]
        return "\n".join(lines + self.errors)


def run_schemathesis(doc_url: str, base_url: str, token: str, kernels: list[str]) -> Report:
    config = _config(base_url, token, kernels)
    auth = {"Authorization": f"token {token}"}
    schema = schemathesis.openapi.from_url(doc_url, config=config, headers=auth, timeout=30)
    report = Report()
    started = time.monotonic()
    for event in from_schema(schema).execute():
        if isinstance(event, events.ScenarioFinished):
            for case_id, node in event.recorder.cases.items():
                interaction = event.recorder.interactions.get(case_id)
                if interaction is not None and interaction.response is not None:
                    report.statuses[node.value.operation.label][interaction.response.status_code] += 1
            for checks in event.recorder.checks.values():
                for check in checks:
                    if check.status == Status.FAILURE and check.failure_info is not None:
                        failure = check.failure_info.failure
                        key = (failure.operation or "", failure.title, failure.message.strip())
                        report.failures.setdefault(key, check.failure_info.code_sample)
        elif isinstance(event, events.NonFatalError):
            report.errors.append(f"{event.label}: {event.info.format()}")
        elif isinstance(event, events.FatalError):
            report.errors.append(f"Schemathesis failed: {event.exception!r}")
        elif isinstance(event, events.PhaseFinished):
            report.phases[event.phase.name.value] = event.status.value if event.status is not None else "skipped"
    report.seconds = time.monotonic() - started
    return report


def assert_conforms(report: Report) -> None:
    assert not report.failures and not report.errors, "Schemathesis found:\n" + report.problems()
    ran = {phase for phase, status in report.phases.items() if status == "success"}
    assert {"examples", "coverage", "fuzzing", "stateful"} <= ran, report.phases
    # Every operation was reached (but the document's own, which Schemathesis leaves out), and
    # the claims for the real kernel were granted at least once.
    calls = {op: dict(codes) for op, codes in report.statuses.items()}
    for op in (
        "GET /api/gpusched/status", "GET /api/gpusched/devices", "GET /api/gpusched/leases",
        "GET /api/gpusched/leases/{lease_id}", "DELETE /api/gpusched/leases/{lease_id}",
        "POST /api/gpusched/leases/{lease_id}/keep", "POST /api/gpusched/leases/{lease_id}/freed",
        "POST /api/gpusched/devices/{uuid}/drain", "POST /api/gpusched/devices/{uuid}/undrain",
        "GET /api/gpusched/events",
    ):
        assert calls.get(op), (op, calls)
    claims = calls.get("POST /api/gpusched/leases", {})
    assert 201 in claims and 400 in claims and 404 in claims, claims
    assert 204 in calls["DELETE /api/gpusched/leases/{lease_id}"], calls
    assert 200 in calls["POST /api/gpusched/devices/{uuid}/drain"], calls


@pytest.mark.slow
def test_the_server_answers_as_its_openapi_document_says(tmp_path):
    server = ServerProcess(tmp_path, str(tmp_path / "ledger.sqlite"), free_port())
    try:
        code, kernel = server.call("POST", "api/kernels", {"name": "python3"})
        assert code == 201, kernel
        base = f"http://127.0.0.1:{server.port}"
        report = run_schemathesis(f"{base}/api/gpusched/openapi.json", base, server.token, [kernel["id"]])
    finally:
        server.stop()
    assert_conforms(report)


class BrokerThread:
    """A hub broker (``test_hub_broker.Setup``: the hub's token check stubbed) on a loop of its own.

    Schemathesis calls it from this thread, synchronously; one server of the admin ``root`` is
    connected, with one kernel, so that claims for that kernel reach the scheduler.
    """

    def __init__(self, tmp_path) -> None:
        self.setup = Setup(
            tmp_path, simulated_devices=2, idle_timeout=300.0, contended_idle_timeout=60.0, grace_period=60.0
        )
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="broker", daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self) -> str:
        """Starts the broker and root's server; the id of that server's kernel."""
        app = self.run(self.setup.start_broker())
        _, kernels = self.run(self.setup.server("root"))
        kernel_id = kernels.ids[0]

        async def known():
            await until(lambda: app.kernels.known(kernel_id), 20, "the server's heartbeat with its kernel")

        self.run(known())
        return kernel_id

    def stop(self) -> None:
        try:
            self.run(self.setup.close())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()


@pytest.mark.slow
def test_the_broker_answers_as_its_openapi_document_says(tmp_path):
    broker = BrokerThread(tmp_path)
    try:
        kernel_id = broker.start()
        base = broker.setup.url.rstrip("/")
        report = run_schemathesis(f"{base}/api/gpusched/openapi.json", base, "tok-root", [kernel_id])
    finally:
        broker.stop()
    assert_conforms(report)
