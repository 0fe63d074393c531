"""Checkpoint and restore of a real GPU process, read against the host's copy bandwidth.

    python benchmarks/gpu_checkpoint.py measure --out FILE [--sizes 1,4,16] [--seconds 300]
    python benchmarks/gpu_checkpoint.py report --out FILE [--steps F] [--tests F] [--measure F] [--meta F]

``scripts/gpu-check.sh`` runs both; they can be run by hand as well.

``measure`` (needs an NVIDIA GPU, PyTorch with CUDA, and this package with a CUDA checkpointer):

1. the pinned host-to-device and device-to-host copy bandwidth of the GPU under test, from a child
   process with PyTorch (``copy_`` between a pinned host tensor and a device tensor, median of
   five copies after two warm-ups);
2. for each size (1, 4 and 16 GiB): a child process that allocates that much on ``cuda:0`` (the
   GPU under test, by UUID in ``CUDA_VISIBLE_DEVICES``, as the scheduler binds kernels), fills it
   with a pattern and waits; this package's checkpointer (``reclaim.checkpoint.detect`` on the
   NVML backend: the driver API through ``cuda.bindings``, else the ``cuda-checkpoint`` utility)
   checkpoints it and restores it, each timed (checkpoint: lock and checkpoint; restore: restore
   and unlock; with the driver API each call is timed too); NVML must no longer list the process on the GPU
   while it is checkpointed; the child then checks its pattern. Before the child is ended its GPU
   state is checkpointed again (NVIDIA/cuda-checkpoint#53: on driver 595, ending a live restored
   process hung the host; a checkpointed one can be ended safely).

A size is skipped when the GPU's free memory or the host's available memory cannot hold it, or
when the time left (``--seconds``) is short, and the row says so. The results are written to
``--out`` after every step, so a run stopped by its time box keeps what it measured.

``report`` (standard library only) merges the setup steps, the per-test results of
``pytest -m gpu`` (collected by this module as a pytest plugin: ``-p gpu_checkpoint`` with
``GPU_CHECK_RESULTS=FILE``) and the measurement into one table (printed) and one JSON document.
GB/s are 10^9 bytes per second; a ratio is a figure divided by the pinned host-to-device copy
bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

GiB = 1 << 30
MiB = 1 << 20
#: The pattern is written and checked in pieces of this size.
CHUNK_BYTES = 256 * MiB
#: What a size needs on the GPU beyond itself: the CUDA context and one piece to check against.
GPU_HEADROOM = 1536 * MiB
#: What a size needs in host memory beyond itself (the checkpoint lives there).
HOST_HEADROOM = 2 * GiB
#: Environment variable naming the file the pytest plugin appends its results to.
RESULTS_ENV = "GPU_CHECK_RESULTS"
#: Before the first size is measured: seconds to start a child, and seconds per GiB for the rest.
DEFAULT_STARTUP_S = 25.0
DEFAULT_PER_GIB_S = 4.0

PASSED, FAILED, SKIPPED, NOT_RUN = "passed", "failed", "skipped", "not run"
STATUSES = (PASSED, FAILED, SKIPPED, NOT_RUN)

REPO = Path(__file__).resolve().parent.parent


# -- pure functions: figures, rows, the table, the document ---------------------------------------


def gbps(nbytes: float | None, seconds: float | None) -> float | None:
    """10^9 bytes per second, or ``None`` when either figure is missing or the time is not positive."""
    if nbytes is None or seconds is None or seconds <= 0:
        return None
    return nbytes / seconds / 1e9


def ratio(value: float | None, reference: float | None) -> float | None:
    """``value / reference``, or ``None`` when either is missing or the reference is not positive."""
    if value is None or reference is None or reference <= 0:
        return None
    return value / reference


def _reason_of_skip(longrepr: Any) -> str:
    # pytest gives a skip as (path, line, "Skipped: why").
    if isinstance(longrepr, (list, tuple)) and len(longrepr) == 3:
        text = str(longrepr[2])
    else:
        text = str(longrepr or "")
    return text.removeprefix("Skipped: ").strip()


def rows_of_tests(records: Iterable[Mapping[str, Any]], stopped: str | None = None) -> list[dict]:
    """One row per test from the plugin's records (one per test phase, plus the collected list).

    Args:
        records: dicts with ``nodeid``, ``when`` (``setup``, ``call``, ``teardown``, ``collect``),
            ``outcome`` (``passed``, ``failed``, ``skipped``), ``duration`` and ``reason``; and
            one ``{"collected": [nodeid, ...]}``.
        stopped: why pytest did not finish, if it did not: the collected tests that never
            reported are rows "not run" with this reason.
    """
    collected: list[str] = []
    order: list[str] = []
    rows: dict[str, dict] = {}
    for record in records:
        if "collected" in record:
            collected.extend(record["collected"])
            continue
        nodeid = str(record["nodeid"])
        if nodeid not in rows:
            order.append(nodeid)
            rows[nodeid] = {"check": f"test {nodeid}", "status": PASSED, "seconds": 0.0, "note": ""}
        row = rows[nodeid]
        row["seconds"] = round(row["seconds"] + float(record.get("duration") or 0.0), 3)
        outcome, when, reason = record.get("outcome"), record.get("when"), str(record.get("reason") or "")
        if outcome == FAILED:
            where = {"setup": "error in setup", "teardown": "error in teardown", "collect": "error in collection"}
            prefix = where.get(str(when), "")
            row["status"] = FAILED
            row["note"] = f"{prefix}: {reason}" if prefix and reason else (prefix or reason)
        elif outcome == SKIPPED and row["status"] != FAILED:
            row["status"] = SKIPPED
            row["note"] = reason
    for nodeid in collected:
        if nodeid not in rows:
            order.append(nodeid)
            rows[nodeid] = {
                "check": f"test {nodeid}",
                "status": NOT_RUN,
                "seconds": None,
                "note": stopped or "pytest ended before this test reported",
            }
    return [rows[nodeid] for nodeid in order]


def step_rows(text: str) -> list[dict]:
    """Rows from the script's step file: one ``check<TAB>status<TAB>seconds<TAB>note`` a line."""
    rows = []
    for line in text.splitlines():
        if not line.strip():
            continue
        parts = line.split("\t") + ["", "", ""]
        check, status, seconds, note = parts[0], parts[1] or NOT_RUN, parts[2], parts[3]
        try:
            secs: float | None = float(seconds)
        except ValueError:
            secs = None
        rows.append({"check": check, "status": status if status in STATUSES else FAILED, "seconds": secs, "note": note})
    return rows


def measurement_rows(measure: Mapping[str, Any] | None) -> list[dict]:
    """Rows for the copy bandwidth and each size, with GB/s and ratios to the copy bandwidth."""
    if not measure:
        return []
    rows: list[dict] = []
    copy = measure.get("copy") or {}
    h2d = copy.get("h2d_gbps")
    d2h = copy.get("d2h_gbps")
    if copy:
        note = copy.get("note") or ""
        if copy.get("bytes"):
            note = (note + "; " if note else "") + f"pinned, {copy['bytes'] / GiB:.2f} GiB per copy, median of {copy.get('repeats', '?')}"
        rows.append(
            {
                "check": "copy host to device (pinned, torch)",
                "status": copy.get("status", NOT_RUN),
                "seconds": copy.get("h2d_s"),
                "copy_gbps": h2d,
                "note": note,
            }
        )
        rows.append(
            {
                "check": "copy device to host (pinned, torch)",
                "status": copy.get("status", NOT_RUN),
                "seconds": copy.get("d2h_s"),
                "copy_gbps": d2h,
                "note": "" if copy.get("status") == PASSED else copy.get("note") or "",
            }
        )
    for size in measure.get("sizes") or []:
        moved = size.get("bytes")
        ck_s, rs_s = size.get("checkpoint_s"), size.get("restore_s")
        ck, rs = gbps(moved, ck_s), gbps(moved, rs_s)
        notes = []
        if moved:
            notes.append(f"{moved / GiB:.2f} GiB moved ({size.get('bytes_source', 'allocated')})")
        if size.get("pattern"):
            notes.append(f"pattern {size['pattern']}")
        if size.get("freed") is False:
            notes.append("NVML still listed the process while checkpointed")
        if size.get("reason"):
            notes.append(str(size["reason"]))
        rows.append(
            {
                "check": f"checkpoint and restore {size.get('gib')} GiB",
                "status": size.get("status", NOT_RUN),
                "seconds": None,
                "checkpoint_s": ck_s,
                "checkpoint_gbps": ck,
                "restore_s": rs_s,
                "restore_gbps": rs,
                "copy_gbps": h2d,
                "checkpoint_ratio": ratio(ck, h2d),
                "restore_ratio": ratio(rs, h2d),
                "checkpoint_vs_d2h": ratio(ck, d2h),
                "note": "; ".join(notes),
            }
        )
    return rows


COLUMNS = (
    ("check", "check"),
    ("status", "status"),
    ("seconds", "s"),
    ("checkpoint_s", "checkpoint s"),
    ("checkpoint_gbps", "checkpoint GB/s"),
    ("restore_s", "restore s"),
    ("restore_gbps", "restore GB/s"),
    ("copy_gbps", "copy H2D GB/s"),
    ("checkpoint_ratio", "checkpoint / copy"),
    ("restore_ratio", "restore / copy"),
    ("note", "note"),
)


def _cell(key: str, value: Any) -> str:
    if value is None or value == "":
        return ""
    if isinstance(value, float):
        if key.endswith("_ratio"):
            return f"{value:.2f}"
        if key.endswith("_gbps"):
            return f"{value:.1f}"
        return f"{value:.2f}"
    return str(value).replace("|", "/").replace("\n", " ")


def format_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """One Markdown table of every row; columns no row fills are left out."""
    used = [(key, title) for key, title in COLUMNS if key in ("check", "status") or any(_cell(key, r.get(key)) for r in rows)]
    lines = [
        "| " + " | ".join(title for _, title in used) + " |",
        "| " + " | ".join("---" for _ in used) + " |",
    ]
    for row in rows:
        lines.append("| " + " | ".join(_cell(key, row.get(key)) for key, _ in used) + " |")
    return "\n".join(lines)


def summarize(rows: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    counts = {status: 0 for status in STATUSES}
    for row in rows:
        counts[row.get("status", FAILED)] = counts.get(row.get("status", FAILED), 0) + 1
    return counts


def build_report(
    steps: Sequence[Mapping[str, Any]],
    tests: Sequence[Mapping[str, Any]],
    measure: Mapping[str, Any] | None,
    meta: Mapping[str, Any] | None = None,
) -> dict:
    """The JSON document: what ran where, every row, the counts and the raw measurement."""
    rows = [*steps, *tests, *measurement_rows(measure)]
    return {
        "gpu": True,
        "meta": dict(meta or {}),
        "rows": [dict(row) for row in rows],
        "summary": summarize(rows),
        "measurement": dict(measure) if measure else None,
    }


def summary_line(report: Mapping[str, Any]) -> str:
    counts = report["summary"]
    return "gpu-check: " + ", ".join(f"{counts.get(s, 0)} {s}" for s in STATUSES)


# -- the pytest plugin (-p gpu_checkpoint, GPU_CHECK_RESULTS=FILE) ---------------------------------


def _append(record: Mapping[str, Any]) -> None:
    path = os.environ.get(RESULTS_ENV)
    if not path:
        return
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(record) + "\n")


def _failure_reason(report: Any) -> str:
    crash = getattr(getattr(report, "longrepr", None), "reprcrash", None)
    text = str(getattr(crash, "message", "") or "")
    if not text:
        lines = str(getattr(report, "longreprtext", "") or "").strip().splitlines()
        text = lines[-1] if lines else ""
    return " ".join(text.split())[:400]


def pytest_collection_finish(session: Any) -> None:
    _append({"collected": [item.nodeid for item in session.items]})


def pytest_collectreport(report: Any) -> None:
    if report.failed:
        _append({"nodeid": report.nodeid or "collection", "when": "collect", "outcome": FAILED, "duration": 0.0, "reason": _failure_reason(report)})


def pytest_runtest_logreport(report: Any) -> None:
    if report.skipped:
        reason = getattr(report, "wasxfail", None)
        reason = f"expected to fail: {reason}" if reason is not None else _reason_of_skip(report.longrepr)
    elif report.failed:
        reason = _failure_reason(report)
    else:
        reason = ""
    _append({"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome, "duration": report.duration, "reason": reason})


# -- the measurement (needs a GPU) ----------------------------------------------------------------


def _pattern(index: int, elements: int, device: Any) -> Any:
    import torch

    return torch.arange(elements, dtype=torch.int64, device=device).mul_(2654435761).add_(index * 1_000_003)


def child(gib: int) -> int:
    """The process that is checkpointed: ``gib`` GiB of pattern on cuda:0, then commands on stdin."""
    started = time.perf_counter()
    # The measuring process ends this one (after checkpointing it again): a time box's SIGTERM to
    # the whole process group must not end a live restored process first.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    import torch

    device = torch.device("cuda:0")
    elements = CHUNK_BYTES // 8
    pieces = max(1, gib * GiB // CHUNK_BYTES)
    torch.cuda.init()
    ready = time.perf_counter()
    chunks = [_pattern(i, elements, device) for i in range(pieces)]
    torch.cuda.synchronize()
    print(
        json.dumps(
            {
                "ready": True,
                "allocated": pieces * CHUNK_BYTES,
                "startup_s": ready - started,
                "fill_s": time.perf_counter() - ready,
                "device": torch.cuda.get_device_name(0),
            }
        ),
        flush=True,
    )
    for line in sys.stdin:
        command = line.strip()
        if command == "verify":
            began = time.perf_counter()
            bad = [i for i, chunk in enumerate(chunks) if not torch.equal(chunk, _pattern(i, elements, device))]
            checked = time.perf_counter() - began
            # Free everything, so that the checkpoint before the end moves little.
            chunks.clear()
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            print(json.dumps({"intact": not bad, "bad_pieces": len(bad), "verify_s": checked}), flush=True)
        elif command == "exit":
            break
    return 0


def copy_child(nbytes: int, repeats: int) -> int:
    """Pinned host <-> device copy bandwidth with PyTorch on cuda:0; prints one JSON line."""
    import torch

    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host.fill_(7)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")

    def timed(dst: Any, src: Any) -> float:
        torch.cuda.synchronize()
        began = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        return time.perf_counter() - began

    for _ in range(2):
        timed(dev, host)
        timed(host, dev)
    h2d = sorted(timed(dev, host) for _ in range(repeats))
    d2h = sorted(timed(host, dev) for _ in range(repeats))
    print(json.dumps({"bytes": nbytes, "repeats": repeats, "h2d_s": h2d[len(h2d) // 2], "d2h_s": d2h[len(d2h) // 2],
                      "h2d_best_s": h2d[0], "d2h_best_s": d2h[0]}), flush=True)
    return 0


def _host_available() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


_PHASES = ("cuCheckpointProcessLock", "cuCheckpointProcessCheckpoint", "cuCheckpointProcessRestore", "cuCheckpointProcessUnlock")


class _TimedDriver:
    """The checkpointer's ``cuda.bindings.driver`` with each ``cuCheckpointProcess*`` call timed."""

    def __init__(self, driver: Any, phases: dict[str, float]) -> None:
        self._driver = driver
        self._phases = phases

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._driver, name)
        if name not in _PHASES or not callable(attr):
            return attr

        def timed(*args: Any) -> Any:
            began = time.perf_counter()
            try:
                return attr(*args)
            finally:
                phase = name.removeprefix("cuCheckpointProcess").lower()
                self._phases[phase] = self._phases.get(phase, 0.0) + time.perf_counter() - began

        return timed


class _Child:
    """A child process answering with one JSON line each time; its other output is ignored."""

    def __init__(self, args: list[str], env: Mapping[str, str], log_path: Path) -> None:
        self.log = open(log_path, "w", encoding="utf-8")  # noqa: SIM115 - closed in kill()
        self.proc = subprocess.Popen(
            args, env=dict(env), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def answer(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                line = self.lines.get(timeout=max(0.0, left))
            except queue.Empty:
                raise TimeoutError(f"no answer from the child process within {timeout:.0f} s") from None
            if line is None:
                raise RuntimeError(f"the child process ended (exit {self.proc.wait()}): {self.tail()}")
            line = line.strip()
            if line.startswith("{"):
                return json.loads(line)

    def send(self, command: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def tail(self) -> str:
        self.log.flush()
        try:
            text = Path(self.log.name).read_text(encoding="utf-8", errors="replace").strip()
        except OSError:
            return ""
        return " ".join(text.splitlines()[-3:])[-400:]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        self.log.close()


class Measurement:
    """Runs the copy and checkpoint measurements, saving the results after every step."""

    def __init__(self, out: Path, sizes: Sequence[int], seconds: float, workdir: Path) -> None:
        self.out = out
        self.sizes = list(sizes)
        self.deadline = time.monotonic() + seconds
        self.workdir = workdir
        self.data: dict[str, Any] = {"sizes": [], "copy": {}, "device": None, "checkpointer": None, "errors": []}
        self.startup_s = DEFAULT_STARTUP_S
        self.per_gib_s = DEFAULT_PER_GIB_S

    def save(self) -> None:
        tmp = self.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1), encoding="utf-8")
        tmp.replace(self.out)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def run(self) -> int:
        self.save()
        try:
            from jupyter_gpusched.devices.nvml import NvmlBackend
            from jupyter_gpusched.reclaim import checkpoint as ck
        except Exception as exc:  # noqa: BLE001 - reported, not raised
            return self._give_up(f"this package could not be imported: {exc}")
        try:
            backend = NvmlBackend()
            snapshot = backend.snapshot()
        except Exception as exc:  # noqa: BLE001 - InventoryUnavailable and the like
            return self._give_up(f"NVML: {exc}")
        mig_parents = {d.parent_uuid for d in snapshot if d.parent_uuid}
        physical = [d for d in snapshot if d.parent_uuid is None and not d.lost]
        whole = [d for d in physical if d.uuid not in mig_parents]
        if not whole:
            why = "every GPU is in MIG mode, and the driver cannot checkpoint MIG instances (NVIDIA/cuda-checkpoint#42)"
            backend.close()
            return self._give_up(why if physical else "NVML lists no usable GPU")
        target = max(whole, key=lambda d: d.memory_total - (d.memory_used or 0))
        self.data["device"] = {
            "index": target.index,
            "uuid": target.uuid,
            "name": target.name,
            "memory_total": target.memory_total,
            "memory_used": target.memory_used,
        }
        checkpointer = ck.detect(backend)
        self.data["checkpointer"] = {
            "kind": type(checkpointer).__name__,
            "available": bool(checkpointer.available),
            "reason": checkpointer.reason,
            "remap": bool(getattr(checkpointer, "remap", False)),
        }
        self.save()
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": target.uuid, "PYTHONUNBUFFERED": "1"}
        self._copy(env)
        for gib in self.sizes:
            row = {"gib": gib, "status": NOT_RUN, "reason": "the measurement was stopped during this size"}
            self.data["sizes"].append(row)
            try:
                self._size(gib, row, backend, target, checkpointer, env)
            except Exception as exc:  # noqa: BLE001 - one size's failure is a row, not the end
                row["status"] = FAILED
                row["reason"] = f"{type(exc).__name__}: {exc}"
            if row["status"] == PASSED:
                row.pop("reason", None)
            self.save()
        backend.close()
        return self.verdict()

    def _give_up(self, why: str) -> int:
        self.data["errors"].append(why)
        self.data["copy"] = {"status": NOT_RUN, "note": why}
        self.data["sizes"] = [{"gib": gib, "status": NOT_RUN, "reason": why} for gib in self.sizes]
        self.save()
        return self.verdict()

    def verdict(self) -> int:
        """0 if anything was measured (the copy bandwidth, or one size), else 1 and why on stderr:
        a measurement that measures nothing must not pass for one."""
        measured = self.data["copy"].get("status") == PASSED or any(
            row.get("status") == PASSED for row in self.data["sizes"]
        )
        if measured:
            return 0
        why = "; ".join(self.data["errors"]) or self.data["copy"].get("note") or "no size and no copy passed"
        print(f"measured nothing: {why}", file=sys.stderr)
        return 1

    def _copy(self, env: Mapping[str, str]) -> None:
        copy: dict[str, Any] = {"status": NOT_RUN}
        self.data["copy"] = copy
        nbytes = GiB
        available = _host_available()
        if available is not None and available < 4 * nbytes:
            nbytes = 256 * MiB
        if self.left() < 60:
            copy["note"] = f"only {self.left():.0f} s were left"
            return
        proc = _Child([sys.executable, __file__, "copy", "--bytes", str(nbytes), "--repeats", "5"], env,
                      self.workdir / "copy.log")
        try:
            result = proc.answer(timeout=min(120.0, self.left() - 30))
        except Exception as exc:  # noqa: BLE001
            copy.update(status=FAILED, note=f"{exc} {proc.tail()}".strip())
            return
        finally:
            proc.kill()
        copy.update(result)
        copy["status"] = PASSED
        copy["h2d_gbps"] = gbps(result["bytes"], result["h2d_s"])
        copy["d2h_gbps"] = gbps(result["bytes"], result["d2h_s"])
        self.save()

    def _size(self, gib: int, row: dict, backend: Any, target: Any, checkpointer: Any, env: Mapping[str, str]) -> None:
        if not checkpointer.available:
            row.update(status=SKIPPED, reason=f"no checkpointer: {checkpointer.reason}")
            return
        now = {d.uuid: d for d in backend.snapshot()}.get(target.uuid, target)
        free = now.memory_total - (now.memory_used or 0)
        if free < gib * GiB + GPU_HEADROOM:
            row.update(status=SKIPPED, reason=f"the GPU has {free / GiB:.1f} GiB free, {(gib * GiB + GPU_HEADROOM) / GiB:.1f} GiB needed")
            return
        host = _host_available()
        if host is not None and host < gib * GiB + HOST_HEADROOM:
            row.update(status=SKIPPED, reason=f"the host has {host / GiB:.1f} GiB available, {(gib * GiB + HOST_HEADROOM) / GiB:.1f} GiB needed for the checkpoint")
            return
        needed = (self.startup_s + gib * self.per_gib_s) * 1.5
        if self.left() < needed:
            row.update(status=NOT_RUN, reason=f"time short: {self.left():.0f} s left, about {needed:.0f} s needed")
            return
        began = time.monotonic()
        proc = _Child([sys.executable, __file__, "child", "--gib", str(gib)], env, self.workdir / f"child-{gib}.log")
        # Saved, so that the script can end it should this process be killed.
        self.data["child_pid"] = proc.pid
        self.save()
        try:
            self._cycle(gib, row, backend, target, checkpointer, proc)
        finally:
            proc.kill()
            self.data["child_pid"] = None
            self.save()
        if row.get("status") == PASSED and row.get("ready_s") is not None:
            # Learn the costs, for the next size's time estimate.
            self.startup_s = max(5.0, row["ready_s"] - row.get("fill_s", 0.0))
            self.per_gib_s = max(0.5, (time.monotonic() - began - self.startup_s) / gib)

    def _cycle(self, gib: int, row: dict, backend: Any, target: Any, checkpointer: Any, proc: _Child) -> None:
        from jupyter_gpusched.reclaim.checkpoint import CheckpointError

        began = time.monotonic()
        ready = proc.answer(timeout=min(180.0, max(10.0, self.left() - 10)))
        row["ready_s"] = time.monotonic() - began
        row["fill_s"] = ready.get("fill_s")
        row["allocated"] = ready.get("allocated")
        mine = self._process_memory(backend, target.uuid, proc.pid)
        if mine:
            row["bytes"], row["bytes_source"] = mine, "NVML, the process"
        else:
            row["bytes"], row["bytes_source"] = ready.get("allocated"), "allocated; NVML did not list the process"
        used_before = self._device_used(backend, target.uuid)
        phases: dict[str, float] = {}
        timed = "driver" in vars(checkpointer)
        if timed:
            checkpointer.driver = _TimedDriver(checkpointer.driver, phases)
        step, live = "checkpoint", True
        try:
            t0 = time.perf_counter()
            checkpointer.checkpoint(proc.pid)
            row["checkpoint_s"] = time.perf_counter() - t0
            live = False
            row["state_checkpointed"] = self._driver_state(checkpointer, proc.pid)
            used_after = self._device_used(backend, target.uuid)
            if used_before is not None and used_after is not None:
                row["gpu_memory_drop"] = used_before - used_after
            if mine is not None:
                row["freed"] = self._process_memory(backend, target.uuid, proc.pid) is None
            elif "gpu_memory_drop" in row and row.get("allocated"):
                row["freed"] = row["gpu_memory_drop"] >= 0.9 * row["allocated"]
            step = "restore"
            t0 = time.perf_counter()
            checkpointer.restore(proc.pid)
            row["restore_s"] = time.perf_counter() - t0
            live = True
            row["state_restored"] = self._driver_state(checkpointer, proc.pid)
            step = "verify"
            proc.send("verify")
            verdict = proc.answer(timeout=min(180.0, max(10.0, self.left())))
            row["verify_s"] = verdict.get("verify_s")
            row["pattern"] = "intact" if verdict.get("intact") else f"corrupted in {verdict.get('bad_pieces')} of 256 MiB pieces"
            if not verdict.get("intact"):
                row.update(status=FAILED, reason="the memory read back after the restore is not what was written")
            elif row.get("freed") is False:
                row.update(status=FAILED, reason="the GPU memory was not freed while the process was checkpointed")
            else:
                row["status"] = PASSED
        except CheckpointError as exc:
            row.update(status=FAILED, reason=f"{step}: {exc}")
        except Exception as exc:  # noqa: BLE001 - one size's failure is a row
            row.update(status=FAILED, reason=f"{step}: {type(exc).__name__}: {exc}")
        finally:
            row["phases"] = {name: round(seconds, 4) for name, seconds in phases.items()}
            if live and proc.proc.poll() is None:
                # NVIDIA/cuda-checkpoint#53: a restored process is ended only once checkpointed again.
                try:
                    checkpointer.checkpoint(proc.pid)
                    row["ended"] = "checkpointed again, then ended"
                except Exception as exc:  # noqa: BLE001 - it is ended either way
                    row["ended"] = f"ended without a second checkpoint ({exc})"
            if timed and isinstance(checkpointer.driver, _TimedDriver):
                checkpointer.driver = checkpointer.driver._driver
            if row.get("status") != PASSED:
                row["child_log"] = proc.tail()

    @staticmethod
    def _device_used(backend: Any, uuid: str) -> int | None:
        for device in backend.snapshot():
            if device.uuid == uuid:
                return device.memory_used
        return None

    @staticmethod
    def _process_memory(backend: Any, uuid: str, pid: int) -> int | None:
        for device in backend.snapshot():
            if device.uuid == uuid:
                for process in device.processes:
                    if process.pid == pid:
                        return process.memory_used or 0
        return None

    @staticmethod
    def _driver_state(checkpointer: Any, pid: int) -> str | None:
        driver = getattr(checkpointer, "driver", None)
        if driver is None or not hasattr(driver, "cuCheckpointProcessGetState"):
            return None
        try:
            err, state = driver.cuCheckpointProcessGetState(pid)
        except Exception as exc:  # noqa: BLE001 - a state is a detail of the row
            return f"unknown ({exc})"
        if int(err) != 0:
            return f"unknown ({err!r})"
        return str(getattr(state, "name", state))


# -- command line ---------------------------------------------------------------------------------


def _read_json(path: str | None) -> Any:
    if not path or not os.path.exists(path):
        return None
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _read_records(path: str | None) -> list[dict]:
    if not path or not os.path.exists(path):
        return []
    records = []
    for line in Path(path).read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


def complete_measure(measure: Mapping[str, Any] | None, sizes: Sequence[int], missing: str = "") -> dict:
    """The measurement with a "not run" row for each size it never reached, and why."""
    why = missing or "the measurement ended before this size (see measure.log)"
    data = dict(measure or {})
    if not data.get("copy"):
        data["copy"] = {"status": NOT_RUN, "note": why}
    done = {size.get("gib") for size in data.get("sizes") or []}
    data["sizes"] = list(data.get("sizes") or []) + [{"gib": gib, "status": NOT_RUN, "reason": why} for gib in sizes if gib not in done]
    return data


def report_main(args: argparse.Namespace) -> int:
    steps = step_rows(Path(args.steps).read_text(encoding="utf-8")) if args.steps and os.path.exists(args.steps) else []
    tests = rows_of_tests(_read_records(args.tests), stopped=args.tests_stopped or None)
    measure = complete_measure(_read_json(args.measure), _sizes(args.sizes), args.measure_missing)
    report = build_report(steps, tests, measure, _read_json(args.meta))
    Path(args.out).write_text(json.dumps(report, indent=1), encoding="utf-8")
    print(format_table(report["rows"]))
    print(summary_line(report))
    return 1 if report["summary"][FAILED] else 0


def _sizes(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("measure", help="checkpoint and restore times and the copy bandwidth (needs a GPU)")
    m.add_argument("--out", required=True, help="JSON file for the results (written after every step)")
    m.add_argument("--sizes", default="1,4,16", help="GiB held by the checkpointed process, comma separated")
    m.add_argument("--seconds", type=float, default=300.0, help="time for the whole measurement; sizes that do not fit are not run")
    r = sub.add_parser("report", help="one table and one JSON document from a run's parts")
    r.add_argument("--out", required=True, help="the JSON document")
    r.add_argument("--steps", help="the setup steps: check<TAB>status<TAB>seconds<TAB>note per line")
    r.add_argument("--tests", help="the pytest plugin's records (JSON lines)")
    r.add_argument("--tests-stopped", default="", help="why pytest did not finish, if it did not")
    r.add_argument("--measure", help="the measurement's JSON file")
    r.add_argument("--measure-missing", default="", help="why there is no measurement, if there is none")
    r.add_argument("--sizes", default="1,4,16", help="the sizes that were to be measured")
    r.add_argument("--meta", help="a JSON object about the machine and the run")
    c = sub.add_parser("child", help=argparse.SUPPRESS)
    c.add_argument("--gib", type=int, required=True)
    p = sub.add_parser("copy", help=argparse.SUPPRESS)
    p.add_argument("--bytes", type=int, default=GiB)
    p.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    if args.command == "report":
        return report_main(args)
    if args.command == "child":
        return child(args.gib)
    if args.command == "copy":
        return copy_child(args.bytes, args.repeats)
    out = Path(args.out).resolve()
    workdir = out.parent
    # The script's time box ends this process with SIGTERM: end the children and keep the file.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
    return Measurement(out, _sizes(args.sizes), args.seconds, workdir).run()


if __name__ == "__main__":
    sys.exit(main())
