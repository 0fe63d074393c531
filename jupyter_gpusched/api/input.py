"""Reading the REST API's request bodies: one set of rules for the server and the hub broker.

Every function raises :class:`InputError` with a message that names the field; the handlers turn
it into a 400 with :func:`bad_input`. A message quotes at most ~100 characters of a bad value, so a
huge one is neither echoed back nor written to the log in full.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from dataclasses import dataclass
from typing import Iterator

from ..core import SchedulingError, parse_duration, parse_memory
from ..core.units import MAX_MEMORY, QUOTE_LIMIT, quote

# The grammar of ids, sizes and durations, written once: this module checks bodies against it and
# the OpenAPI document (``openapi.py``) publishes it, so that a value the document calls invalid is
# refused here and the other way round. Only ASCII classes and plain spaces, so that Python's and
# ECMA 262's regular expressions read them alike; Python matches them whole (``fullmatch``).
ID_REGEX = r"[A-Za-z0-9_-]{1,128}"
_NUMBER = r"[0-9]+(?:\.[0-9]+)?"
#: ``16GiB``, ``512 MiB``, ``80G``, ``4096B``: the units ``core.parse_memory`` knows, any case. A
#: string needs its unit ('16' is refused: a JSON number is the way to say bytes).
MEMORY_REGEX = rf"(?: *{_NUMBER} *(?:[bB]|[kKmMgGtT](?:[iI]?[bB])?) *)?"
#: ``30m``, ``1h30m``, ``90 s``, ``0``: the units ``core.parse_duration`` knows, any case. A string
#: needs its unit but for zero ('30' is refused: a JSON number is the way to say seconds).
DURATION_REGEX = rf" *(?:0+(?:\.0+)? *|(?:{_NUMBER} *(?:[sS](?:[eE][cC])?|[mM](?:[iI][nN])?|[hH][rR]?|[dD]) *)+)"
_MEMORY = re.compile(MEMORY_REGEX)
_DURATION = re.compile(DURATION_REGEX)

#: Kernel ids, lease ids: what jupyter_server and we generate, and nothing that needs escaping.
ID_PATTERN = re.compile(rf"^{ID_REGEX}\Z")
CLAIM_FIELDS = frozenset({"kernel_id", "count", "memory", "mode", "wait", "priority"})
#: The longest claim wait one call may ask for (the server answers 202 after it).
MAX_WAIT = 30.0
#: The largest whole number a field takes (count, priority), either sign.
INT_LIMIT = 2**31
#: The most seconds a duration may say (about 31 years): anything longer is a typo.
MAX_SECONDS = 1e9
#: The longest reason an admin may give (drain, release).
MAX_REASON = 500
#: The largest memory a claim may ask for per GPU, in bytes.
MAX_CLAIM_MEMORY = MAX_MEMORY
#: The largest request body read: every body of this API is a few hundred bytes.
MAX_BODY = 64 * 1024
#: The deepest nesting of arrays and objects in a body: the API's bodies are flat.
MAX_DEPTH = 32
#: The longest message a 400 carries (its quoted values are already cut to QUOTE_LIMIT).
MAX_MESSAGE = 1000
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKETS = re.compile(r"[\[\]{}]")


class InputError(ValueError):
    """A request body the API cannot accept; the message is for the caller."""


def http_error(status: int, message: str, reason: str | None = None):
    """A tornado ``HTTPError`` whose message reaches the log and ``write_error`` as written.

    Tornado 6.6 escapes ``%`` in ``log_message`` itself (and logs ``get_message()``); before it,
    the message was a %-format for the log and had to be escaped here. Escaping on both would
    double every ``%`` ("`%%gpu release`").
    """
    from tornado import web

    if not isinstance(getattr(web.HTTPError, "log_message", None), property):
        message = message.replace("%", "%%")
    return web.HTTPError(status, message, reason=reason)


@contextlib.contextmanager
def bad_input() -> Iterator[None]:
    """In a tornado handler: an :class:`InputError` becomes a 400 with its message."""
    try:
        yield
    except InputError as exc:
        message = str(exc)
        if len(message) > MAX_MESSAGE:
            message = message[:MAX_MESSAGE] + "…"
        raise http_error(400, message) from None


def _show(value: object) -> str:
    """A value as JSON spells it (``true``, ``null``, ``"text"``), cut to ~100 characters."""
    if isinstance(value, str):
        if len(value) <= QUOTE_LIMIT:
            return json.dumps(value)
        return f"{json.dumps(value[:QUOTE_LIMIT])}… ({len(value)} characters)"
    try:
        text = json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        return quote(value)
    if len(text) <= QUOTE_LIMIT:
        return text
    return f"{text[:QUOTE_LIMIT]}… ({len(text)} characters)"


def _nesting(text: str) -> int:
    """How deeply arrays and objects nest in JSON ``text`` (brackets inside strings do not count)."""
    depth = deepest = 0
    for bracket in _BRACKETS.findall(_JSON_STRING.sub('""', text)):
        if bracket in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > MAX_DEPTH:
                    break
        else:
            depth -= 1
    return deepest


def json_object(raw: bytes | None) -> dict:
    """The body as a JSON object (empty body: ``{}``).

    Bodies over :data:`MAX_BODY` bytes and nesting deeper than :data:`MAX_DEPTH` are refused
    before they are parsed.
    """
    if not raw:
        return {}
    if len(raw) > MAX_BODY:
        raise InputError(
            f"the request body is {len(raw)} bytes; this API takes bodies of at most {MAX_BODY // 1024} KiB"
        )
    try:
        text = raw.decode("utf-8") if isinstance(raw, (bytes, bytearray)) else str(raw)
    except UnicodeDecodeError:
        raise InputError("the request body is not valid JSON (it is not UTF-8)") from None
    if _nesting(text) > MAX_DEPTH:
        raise InputError(
            f"the request body nests arrays or objects more than {MAX_DEPTH} deep; this API's bodies are flat"
        )
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        raise InputError("the request body is not valid JSON") from None
    if not isinstance(data, dict):
        raise InputError("the request body must be a JSON object")
    return data


def _whole(value: object) -> int | None:
    """``value`` as an int if JSON calls it an integer (``2`` or ``2.0``, never ``true``), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def int_field(data: dict, name: str, default: int | None, low: int | None = None) -> int | None:
    value = data.get(name, default)
    if value is None:
        return None
    number = _whole(value)
    if number is None:
        raise InputError(f"{name} must be a whole number, not {_show(value)}")
    if low is not None and number < low:
        raise InputError(f"{name} must be at least {low}, not {_show(value)}")
    if abs(number) > INT_LIMIT:
        raise InputError(f"{name} is out of range")
    return number


def seconds_field(data: dict, name: str, default: float | None = None) -> float | None:
    """Seconds from a number or a duration such as ``'30m'``, at most :data:`MAX_SECONDS`."""
    value = data.get(name, default)
    if value is None:
        return None
    if isinstance(value, bool):
        raise InputError(f"{name} must be a number of seconds or a duration such as '30m'")
    try:
        seconds = parse_duration(value, name)
    except SchedulingError as exc:
        raise InputError(str(exc)) from None
    if isinstance(value, str) and not _DURATION.fullmatch(value):
        raise InputError(f"{name} must be a duration such as '30m' or '1h30m', not {_show(value)}")
    if not math.isfinite(seconds) or seconds > MAX_SECONDS:
        raise InputError(f"{name} must be at most {MAX_SECONDS:.0f} seconds, not {_show(value)}")
    return seconds


def memory_field(data: dict, name: str) -> int | None:
    """Bytes per GPU from a whole number or a size such as ``'16GiB'`` (absent, null or empty: None)."""
    value = data.get(name)
    try:
        memory = parse_memory(value, name)
    except SchedulingError as exc:
        raise InputError(str(exc)) from None
    if isinstance(value, float) and not value.is_integer():
        raise InputError(f"{name} must be a whole number of bytes or a size such as '16GiB', not {_show(value)}")
    if isinstance(value, str) and not _MEMORY.fullmatch(value):
        raise InputError(f"{name} must be a size such as '16GiB' or '512MiB', not {_show(value)}")
    return memory


def _only(data: dict, fields: frozenset[str]) -> None:
    """Refuses a body with a field outside ``fields``, naming it and the fields there are."""
    unknown = sorted(set(data) - fields)
    if unknown:
        more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
        shown = ", ".join(_show(name) for name in unknown[:5]) + more
        raise InputError(f"unknown field(s): {shown}; the fields are {', '.join(sorted(fields))}")


@dataclass(frozen=True)
class Claim:
    """What a claim asks for (``None``: the kernel's lease's, or the default)."""

    kernel_id: str
    count: int | None = None
    memory: int | None = None
    mode: str | None = None
    priority: int = 0
    wait: float = 0.0


def claim(data: dict) -> Claim:
    """``POST /api/gpusched/leases``: ``{kernel_id, count?, memory?, mode?, wait?, priority?}``."""
    _only(data, CLAIM_FIELDS)
    kernel_id = data.get("kernel_id")
    if not isinstance(kernel_id, str) or not ID_PATTERN.match(kernel_id):
        raise InputError("kernel_id must be the id of a running kernel (letters, digits, '-' and '_')")
    count = int_field(data, "count", None, low=1)
    memory = memory_field(data, "memory")
    mode = data.get("mode")
    if mode is not None and mode not in ("exclusive", "shared"):
        raise InputError(f"mode must be 'exclusive' or 'shared', not {_show(mode)}")
    priority = int_field(data, "priority", 0) or 0
    wait = data.get("wait", 0)
    wait = MAX_WAIT if wait is True else 0 if wait is False else wait
    wait_s = seconds_field({"wait": wait}, "wait") or 0.0
    return Claim(kernel_id, count, memory, mode, priority, wait_s)


def keep_seconds(data: dict) -> float:
    """``POST .../keep``: ``{seconds}``."""
    if data.get("seconds") is None:
        raise InputError("seconds is required: how long to keep the lease, e.g. 1800 or '30m'")
    _only(data, frozenset({"seconds"}))
    return seconds_field(data, "seconds") or 0.0


def reason(data: dict) -> str:
    """An admin's optional reason (drain, undrain; a kernel that ended): ``{reason?}``."""
    value = data.get("reason", "")
    if not isinstance(value, str) or len(value) > MAX_REASON:
        raise InputError(f"reason must be a string of at most {MAX_REASON} characters")
    _only(data, frozenset({"reason"}))
    return value


#: The most framework names an acknowledgement of a free-cache step may list.
MAX_FRAMEWORKS = 16
#: The longest framework name in such an acknowledgement.
MAX_FRAMEWORK_NAME = 64


def frameworks(data: dict) -> tuple[str, ...]:
    """The frameworks whose caches a kernel dropped (``{"frameworks": ["torch"]}``), possibly none."""
    value = data.get("frameworks", [])
    if not isinstance(value, list) or len(value) > MAX_FRAMEWORKS:
        raise InputError(f"frameworks must be a list of at most {MAX_FRAMEWORKS} names, not {_show(value)}")
    for name in value:
        if not isinstance(name, str) or not 0 < len(name) <= MAX_FRAMEWORK_NAME:
            raise InputError(f"frameworks must hold names of 1 to {MAX_FRAMEWORK_NAME} characters, not {_show(name)}")
    unknown = set(data) - {"frameworks"}
    if unknown:
        raise InputError(f"unknown field(s) {', '.join(sorted(map(_show, unknown)))}; only frameworks is accepted")
    return tuple(value)


#: What ``DELETE .../leases/{id}?memory_held=`` may ask for a lease whose kernel still holds GPU
#: memory: release it all the same (the default), or keep it.
MEMORY_HELD_CHOICES = ("release", "keep")


def memory_held_choice(value: str | None) -> str:
    """The ``memory_held`` query parameter of a release (default ``release``)."""
    if value is None or value == "":
        return "release"
    if value not in MEMORY_HELD_CHOICES:
        raise InputError(
            f"memory_held must be 'release' (release even if the kernel holds GPU memory) or 'keep' "
            f"(keep the lease then), not {value!r}"
        )
    return value
