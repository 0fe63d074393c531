"""Workload traces: sessions (one kernel each) and the cells they ran.

Two formats are read:

* the NotebookOS workload JSON (``sessions[]`` with ``start_tick``, ``stop_tick``,
  ``max_resource_request`` and ``trainings[]``; one tick is 60 seconds), see ``traces/README.md``;
* a small CSV of our own, one row per cell::

      session,user,start_s,duration_s,gpus,vram_gb[,session_gpus,session_start_s,session_stop_s]

  ``start_s`` and ``duration_s`` are seconds, ``gpus`` the GPUs the cell computes on (0 for a
  CPU-only cell), ``vram_gb`` the GPU memory in GB (10^9 bytes) the kernel holds while it runs.
  ``user`` may be empty (then it is the session id). The optional columns describe the session:
  ``session_gpus`` is the size of its lease (default: its largest cell), ``session_start_s`` and
  ``session_stop_s`` when its kernel starts and stops (default: its first cell's start and its
  last cell's end); empty means the default, and rows of one session must agree. A first row
  starting with ``session`` is a header; blank rows and rows starting with ``#`` are skipped.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Iterable

#: Seconds in one NotebookOS tick.
TICK_SECONDS = 60.0

CSV_COLUMNS = ("session", "user", "start_s", "duration_s", "gpus", "vram_gb")
CSV_SESSION_COLUMNS = ("session_gpus", "session_start_s", "session_stop_s")


class TraceError(ValueError):
    """A trace that cannot be read; the message says where and why."""


@dataclass(frozen=True)
class Cell:
    """One cell execution as the trace recorded it (before any scheduling delay)."""

    start: float
    duration: float
    gpus: int
    vram_gb: float = 0.0
    utilization: float | None = None

    @property
    def end(self) -> float:
        return self.start + self.duration


@dataclass(frozen=True)
class Session:
    """One kernel of one user: its lifetime, the GPUs its lease asks for, and its cells in order."""

    id: str
    user: str
    start: float
    stop: float
    gpus: int
    cells: tuple[Cell, ...]


@dataclass(frozen=True)
class Trace:
    sessions: tuple[Session, ...]
    source: str = ""

    @cached_property
    def gpu_sessions(self) -> tuple[Session, ...]:
        """Sessions that need a GPU at all (``gpus > 0``); only they are scheduled."""
        return tuple(s for s in self.sessions if s.gpus > 0)

    def busy_gpu_seconds(self) -> float:
        """GPU-seconds of cells that compute on GPUs, the same under every policy."""
        return sum(c.gpus * c.duration for s in self.gpu_sessions for c in s.cells if c.gpus > 0)

    def static_peak(self) -> int:
        """GPUs static allocation needs: the most held at once if each session holds its lease
        from start to stop (the smallest host on which nobody ever waits under ``static``)."""
        return self._static_peak

    # A trace never changes, and a capacity search asks these of it once per replay.
    @cached_property
    def _static_peak(self) -> int:
        return _peak((s.start, s.stop, s.gpus) for s in self.gpu_sessions)

    def busy_peak(self, session_level: bool = False) -> int:
        """Most GPUs busy at once at trace times: each GPU cell's own ``gpus``, or with
        ``session_level`` every cell of a GPU session counted at its session's ``gpus``."""
        return _peak(
            (c.start, c.end, s.gpus if session_level else c.gpus)
            for s in self.gpu_sessions
            for c in s.cells
            if session_level or c.gpus > 0
        )

    def largest_claim(self, per_cell: bool = False) -> int:
        """The largest lease any session (or, with ``per_cell``, any GPU cell) asks for."""
        if per_cell:
            return max((c.gpus for s in self.gpu_sessions for c in s.cells), default=0)
        return max((s.gpus for s in self.gpu_sessions), default=0)


def _peak(intervals: Iterable[tuple[float, float, int]]) -> int:
    points: list[tuple[float, int]] = []
    for start, stop, count in intervals:
        if stop > start and count > 0:
            points.append((start, count))
            points.append((stop, -count))
    points.sort(key=lambda p: (p[0], p[1]))  # ends before starts at the same instant
    level = peak = 0
    for _, delta in points:
        level += delta
        peak = max(peak, level)
    return peak


def load_trace(path: str | Path, tick_seconds: float = TICK_SECONDS) -> Trace:
    """Read a trace, NotebookOS JSON or our CSV, chosen by the file's extension or content."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TraceError(f"trace file {path} does not exist") from None
    except OSError as err:
        raise TraceError(f"cannot read trace file {path}: {err.strerror or err}") from None
    suffix = path.suffix.lower()
    if suffix == ".json" or (suffix != ".csv" and text.lstrip().startswith("{")):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise TraceError(f"{path} is not valid JSON: {err}") from None
        return parse_notebookos(data, tick_seconds=tick_seconds, source=str(path))
    return parse_csv(text, source=str(path))


def parse_notebookos(data: object, tick_seconds: float = TICK_SECONDS, source: str = "") -> Trace:
    """A :class:`Trace` from a NotebookOS workload document (already parsed JSON)."""
    where = source or "trace"
    if not isinstance(data, dict) or not isinstance(data.get("sessions"), list):
        raise TraceError(f"{where}: expected an object with a 'sessions' list (NotebookOS format)")
    sessions = []
    for i, raw in enumerate(data["sessions"]):
        try:
            sid = str(raw["id"])
            request = raw.get("max_resource_request") or {}
            gpus = _count(request.get("gpus", 0), "max_resource_request.gpus")
            cells = []
            for raw_cell in raw.get("trainings") or ():
                utils = [u.get("utilization") for u in raw_cell.get("gpu_utilizations") or ()]
                utils = [float(u) for u in utils if isinstance(u, (int, float))]
                cells.append(
                    Cell(
                        start=_number(raw_cell["start_tick"], "start_tick") * tick_seconds,
                        duration=_number(raw_cell["duration_in_ticks"], "duration_in_ticks") * tick_seconds,
                        gpus=_count(raw_cell.get("gpus", 0), "gpus"),
                        vram_gb=_number(raw_cell.get("vram", 0.0), "vram"),
                        utilization=sum(utils) / len(utils) if utils else None,
                    )
                )
            session = _session(
                sid,
                sid,
                _number(raw["start_tick"], "start_tick") * tick_seconds,
                _number(raw["stop_tick"], "stop_tick") * tick_seconds,
                gpus,
                cells,
            )
        except (KeyError, TypeError, AttributeError) as err:
            raise TraceError(f"{where}: session #{i} lacks or mangles a field ({err!r})") from None
        except TraceError as err:
            raise TraceError(f"{where}: session #{i}: {err}") from None
        sessions.append(session)
    return Trace(tuple(sessions), source)


def parse_csv(text: str, source: str = "") -> Trace:
    """A :class:`Trace` from our CSV format (see the module docstring)."""
    where = source or "trace"
    rows: dict[str, list[tuple[int, list[str]]]] = {}
    for lineno, row in enumerate(csv.reader(text.splitlines()), start=1):
        if not row or not "".join(row).strip() or row[0].lstrip().startswith("#"):
            continue
        row = [field.strip() for field in row]
        if row[0].lower() == "session":
            continue
        if len(row) not in (len(CSV_COLUMNS), len(CSV_COLUMNS) + len(CSV_SESSION_COLUMNS)):
            raise TraceError(
                f"{where}:{lineno}: expected {len(CSV_COLUMNS)} or "
                f"{len(CSV_COLUMNS) + len(CSV_SESSION_COLUMNS)} columns "
                f"({','.join(CSV_COLUMNS)}[,{','.join(CSV_SESSION_COLUMNS)}]), got {len(row)}"
            )
        if not row[0]:
            raise TraceError(f"{where}:{lineno}: the session column is empty")
        rows.setdefault(row[0], []).append((lineno, row))
    sessions = []
    for sid, session_rows in rows.items():
        user = None
        explicit: list[str | None] = [None, None, None]
        cells = []
        for lineno, row in session_rows:
            try:
                this_user = row[1] or sid
                if user is not None and this_user != user:
                    raise TraceError(f"session {sid} has two users ({user!r} and {this_user!r})")
                user = this_user
                cells.append(
                    Cell(
                        start=_number(row[2], "start_s"),
                        duration=_number(row[3], "duration_s"),
                        gpus=_count(row[4], "gpus"),
                        vram_gb=_number(row[5] or 0, "vram_gb"),
                    )
                )
                for j, value in enumerate(row[len(CSV_COLUMNS):]):
                    if not value:
                        continue
                    if explicit[j] is not None and explicit[j] != value:
                        raise TraceError(
                            f"session {sid} has two values of {CSV_SESSION_COLUMNS[j]} "
                            f"({explicit[j]} and {value})"
                        )
                    explicit[j] = value
            except TraceError as err:
                raise TraceError(f"{where}:{lineno}: {err}") from None
        cells.sort(key=lambda c: c.start)
        try:
            gpus = _count(explicit[0], "session_gpus") if explicit[0] else max(c.gpus for c in cells)
            start = _number(explicit[1], "session_start_s") if explicit[1] else cells[0].start
            stop = _number(explicit[2], "session_stop_s") if explicit[2] else max(c.end for c in cells)
            sessions.append(_session(sid, user or sid, start, stop, gpus, cells))
        except TraceError as err:
            raise TraceError(f"{where}: {err}") from None
    return Trace(tuple(sessions), source)


def _session(sid: str, user: str, start: float, stop: float, gpus: int, cells: list[Cell]) -> Session:
    if stop < start:
        raise TraceError(f"session {sid} stops ({stop:g}s) before it starts ({start:g}s)")
    cells = sorted(cells, key=lambda c: c.start)
    for cell in cells:
        if cell.gpus > gpus:
            raise TraceError(f"session {sid} has a cell on {cell.gpus} GPUs but asks for only {gpus}")
        if cell.start < start:
            raise TraceError(f"session {sid} has a cell at {cell.start:g}s, before it starts ({start:g}s)")
    return Session(sid, user, start, stop, gpus, tuple(cells))


def _number(value: object, name: str) -> float:
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise TraceError(f"{name} must be a number, not {value!r}") from None
    if not math.isfinite(number) or number < 0:
        raise TraceError(f"{name} must be 0 or more, not {value!r}")
    return number


def _count(value: object, name: str) -> int:
    number = _number(value, name)
    if number != int(number):
        raise TraceError(f"{name} must be a whole number of GPUs, not {value!r}")
    return int(number)
