"""A one-line progress bar on stderr for long replays (only when stderr is a terminal)."""

from __future__ import annotations

import sys
import time
from typing import TextIO

#: A replay shorter than this shows nothing.
SHOW_AFTER_S = 2.0
#: Redraw at most this often.
REDRAW_S = 0.2
_WIDTH = 30


def wanted(stream: TextIO | None = None) -> bool:
    """Whether to draw progress: only on a terminal, never into a file or a pipe."""
    stream = stream if stream is not None else sys.stderr
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # closed or replaced by something without a terminal
        return False


class Progress:
    """``update(done, total)`` redraws ``label [#####.....] 42%`` in place, once the work has
    taken ``SHOW_AFTER_S``; ``close()`` clears the line. Does nothing when ``enabled`` is false."""

    def __init__(self, label: str, enabled: bool = True, stream: TextIO | None = None) -> None:
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.started = time.monotonic()
        self.drawn_at = 0.0
        self.shown = False

    def update(self, done: float, total: float, note: str = "") -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self.started < SHOW_AFTER_S or now - self.drawn_at < REDRAW_S:
            return
        self.drawn_at = now
        share = min(max(done / total, 0.0), 1.0) if total > 0 else 0.0
        filled = int(share * _WIDTH)
        bar = "#" * filled + "." * (_WIDTH - filled)
        line = f"{self.label} [{bar}] {share:4.0%} {now - self.started:5.0f}s{('  ' + note) if note else ''}"
        self.stream.write("\r" + line + "\x1b[K")
        self.stream.flush()
        self.shown = True

    def close(self) -> None:
        if self.shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self.shown = False
