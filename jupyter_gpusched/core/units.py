"""Parsing and formatting of sizes and durations as people write them ("16GiB", "30m")."""

from __future__ import annotations

import math
import re

from .model import SchedulingError

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1024,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")
#: No GPU has a petabyte of memory; anything above is a typo, not a request.
MAX_MEMORY = 1024**5

_DURATION_UNITS = {"": 1, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "hr": 3600, "d": 86400}
_DURATION_RE = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)")
#: The most characters of a value a message quotes back: a 10 MB typo is not worth 10 MB of reply.
QUOTE_LIMIT = 100
#: The forms a message about a size or a duration shows.
SIZE_FORMS = "'16GiB', '512MiB' or '80GB'"
DURATION_FORMS = "'90s', '30m', '1h30m' or '2h'"


class MissingUnit(SchedulingError):
    """Text that is a number alone (``'16'``, ``'30'``): a size or a duration typed without its
    unit is refused, never read as bytes or seconds. ``number`` is the number as typed, so that
    a caller can show the fix in its own syntax (``--memory 16GiB``, ``%gpu keep 30m``)."""

    def __init__(self, message: str, number: str, kind: str) -> None:
        super().__init__(message)
        self.number = number
        #: ``"size"`` or ``"duration"``.
        self.kind = kind


def quote(value: object, limit: int = QUOTE_LIMIT) -> str:
    """``repr(value)`` for a message, cut after ``limit`` characters with its length said.

    ``'aaaa…' (10000000 characters)``; cheap on a huge string (only its start is rendered).
    """
    if isinstance(value, str):
        if len(value) <= limit:
            return repr(value)
        return f"{value[:limit]!r}… ({len(value)} characters)"
    try:
        text = repr(value)
    except ValueError:  # an int too long to print (sys.get_int_max_str_digits)
        return "a number too long to print"
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… ({len(text)} characters)"


def parse_memory(value: object, field: str = "memory") -> int | None:
    """Bytes from ``16GiB``, ``16 GB``, ``512MiB``, ``4096B`` or a number (int or float) of bytes.

    ``None`` and empty strings mean "no memory limit" (a whole GPU). Text must carry its unit:
    ``'16'`` raises :class:`MissingUnit` (it would be 16 bytes, where 16 GiB was surely meant).
    """
    if value is None or value == "":
        return None
    if isinstance(value, bool):
        raise SchedulingError(f"{field} must be a size such as '16GiB' or a number of bytes, not {quote(value)}")
    if isinstance(value, (int, float)):
        number, unit = _to_float(value, field, "bytes"), ""
    elif isinstance(value, str):
        match = _SIZE_RE.match(value)
        if not match:
            raise SchedulingError(f"{field} must be a size such as '16GiB' or '512MiB', not {quote(value)}")
        number, unit = float(match.group(1)), match.group(2).lower()
        if not unit and number != 0:  # zero is zero in any unit: refused below for what it is
            raise MissingUnit(missing_size(field, match.group(1)), match.group(1), "size")
        if unit not in _SIZE_UNITS:
            raise SchedulingError(f"{field} has an unknown unit {quote(match.group(2))}: use B, MiB, GiB or TiB")
    else:
        raise SchedulingError(f"{field} must be a size such as '16GiB' or a number of bytes")
    if math.isnan(number) or number <= 0:
        raise SchedulingError(f"{field} must be more than 0 bytes")
    if math.isinf(number) or number * _SIZE_UNITS[unit] > MAX_MEMORY:
        raise SchedulingError(f"{field} of {quote(value)} is more than any GPU has")
    size = int(number * _SIZE_UNITS[unit])
    if size < 1:
        # "0.5B" would otherwise become a claim for 0 bytes.
        raise SchedulingError(f"{field} must be at least 1 byte, not {quote(value)}")
    return size


def _to_float(value: int | float, field: str, what: str) -> float:
    try:
        return float(value)
    except OverflowError:
        raise SchedulingError(f"{field} of {quote(value)} {what} is too large") from None


def unit_fixes(number: str, kind: str) -> tuple[str, str]:
    """The two ways to write ``number`` with a unit, the likelier first: ``16`` -> ``16GiB``,
    ``16MiB``; a byte count (``17179869184``) -> ``17179869184B`` first; ``30`` -> ``30m``, ``30s``."""
    try:
        value = float(number)
    except ValueError:
        value = 0.0
    if kind == "size":
        return (f"{number}B", f"{number}GiB") if value >= 1024**2 else (f"{number}GiB", f"{number}MiB")
    return (f"{number}s", f"{number}m") if value >= 300 else (f"{number}m", f"{number}s")


#: The longest number a message about a missing unit repeats (with its fixes); a longer one is
#: quoted cut short and no fix is spelt out.
_FIX_LIMIT = 24


def _missing(field: str, number: str, kind: str, unit: str, forms: str) -> str:
    if len(number) > _FIX_LIMIT:
        return f"{field} needs a unit: {quote(number)} is a number alone. Write it with its unit ({kind}s look like {forms})"
    first, second = unit_fixes(number, kind)
    return (
        f"{field} needs a unit: {number!r} alone would be {number} {unit}. Write '{first}' or "
        f"'{second}' ({kind}s look like {forms})"
    )


def missing_size(field: str, number: str) -> str:
    """What to say about a size typed without its unit."""
    return _missing(field, number, "size", "bytes", SIZE_FORMS)


def missing_duration(field: str, number: str) -> str:
    """What to say about a duration typed without its unit."""
    return _missing(field, number, "duration", "seconds", DURATION_FORMS)


def parse_duration(value: object, field: str = "duration", *, bare_seconds: bool = False) -> float:
    """Seconds from ``30m``, ``1h30m``, ``90s``, ``2h`` or a number (int or float) of seconds.

    Text must carry its unit, except ``'0'`` (no time at all): ``'30'`` raises
    :class:`MissingUnit`, unless ``bare_seconds`` says the text is documented as seconds (a
    command-line option whose help says so).
    """
    if isinstance(value, bool):
        raise SchedulingError(f"{field} must be a duration such as '30m' or a number of seconds")
    if isinstance(value, (int, float)):
        seconds = _to_float(value, field, "seconds")
    elif isinstance(value, str) and value.strip():
        text = value.strip()
        pos, seconds, parts = 0, 0.0, []
        for match in _DURATION_RE.finditer(text):
            if text[pos : match.start()].strip():
                break
            unit = match.group(2).lower()
            if unit not in _DURATION_UNITS:
                raise SchedulingError(f"{field} has an unknown unit {quote(match.group(2))}: use s, m, h or d")
            parts.append(unit)
            seconds += float(match.group(1)) * _DURATION_UNITS[unit]
            pos = match.end()
        # A bare number is seconds only on its own: "1h30" or "5 5" are more likely typos
        # than 1 hour 30 seconds or 10 seconds.
        if text[pos:].strip() or not parts or (len(parts) > 1 and "" in parts):
            raise SchedulingError(f"{field} must be a duration such as '30m' or '1h30m', not {quote(value)}")
        if parts == [""] and seconds != 0 and not bare_seconds:
            number = text
            raise MissingUnit(missing_duration(field, number), number, "duration")
    else:
        raise SchedulingError(f"{field} must be a duration such as '30m' or a number of seconds")
    if math.isnan(seconds) or seconds < 0:
        raise SchedulingError(f"{field} must be 0 or more seconds")
    if math.isinf(seconds):
        raise SchedulingError(f"{field} of {quote(value)} is too long")
    return seconds


def format_bytes(size: int | float | None) -> str:
    """``17179869184`` -> ``16.0 GiB``."""
    if size is None:
        return "-"
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"  # pragma: no cover - unreachable


def format_duration(seconds: float | None) -> str:
    """``3725`` -> ``1h02m``; ``42`` -> ``42s``."""
    if seconds is None:
        return "-"
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds}s"
    minutes, secs = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def format_gpu_time(gpu_seconds: float) -> str:
    """Recent GPU use for people: ``41.2 GPU-hours``, ``5 GPU-minutes`` under a tenth of an hour
    (where hours would read 0.0), ``no GPU time`` under half a minute."""
    minutes = gpu_seconds / 60.0
    if minutes < 0.5:
        return "no GPU time"
    if minutes < 6.0:
        whole = round(minutes)
        return f"{whole} GPU-minute" + ("" if whole == 1 else "s")
    return f"{gpu_seconds / 3600.0:.1f} GPU-hours"
