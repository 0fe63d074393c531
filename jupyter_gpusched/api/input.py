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
from ..core.units import QUOTE_LIMIT, quote

#: Kernel ids, lease ids: what jupyter_server and we generate, and nothing that needs escaping.
ID_PATTERN = re.compile(r"^[A-Za-z0-9_\-]{1,128}$")
CLAIM_FIELDS = frozenset({"kernel_id", "count", "memory", "mode", "wait", "priority"})
#: The longest claim wait one call may ask for (the server answers 202 after it).
MAX_WAIT = 30.0
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


@contextlib.contextmanager
def bad_input() -> Iterator[None]:
    """In a tornado handler: an :class:`InputError` becomes a 400 with its message."""
    from tornado import web

    try:
        yield
    except InputError as exc:
        message = str(exc)
        if len(message) > MAX_MESSAGE:
            message = message[:MAX_MESSAGE] + "…"
        raise web.HTTPError(400, message.replace("%", "%%")) from None


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


def int_field(data: dict, name: str, default: int | None, low: int | None = None) -> int | None:
    value = data.get(name, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(f"{name} must be a whole number, not {_show(value)}")
    if low is not None and value < low:
        raise InputError(f"{name} must be at least {low}, not {_show(value)}")
    if abs(value) > 2**31:
        raise InputError(f"{name} is out of range")
    return value


def seconds_field(data: dict, name: str, default: float | None = None) -> float | None:
    """Seconds from a number or a duration such as ``'30m'``."""
    value = data.get(name, default)
    if value is None:
        return None
    if isinstance(value, bool):
        raise InputError(f"{name} must be a number of seconds or a duration such as '30m'")
    try:
        seconds = parse_duration(value, name)
    except SchedulingError as exc:
        raise InputError(str(exc)) from None
    if not math.isfinite(seconds):
        raise InputError(f"{name} must be finite")
    return seconds


@dataclass(frozen=True)
class Claim:
    kernel_id: str
    count: int | None
    memory: int | None
    mode: str | None
    priority: int
    wait: float


def claim(data: dict) -> Claim:
    """``POST /api/gpusched/leases``: ``{kernel_id, count?, memory?, mode?, wait?, priority?}``."""
    unknown = sorted(set(data) - CLAIM_FIELDS)
    if unknown:
        shown = ", ".join(_show(name) for name in unknown[:5]) + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
        raise InputError(f"unknown field(s): {shown}; the fields are {', '.join(sorted(CLAIM_FIELDS))}")
    kernel_id = data.get("kernel_id")
    if not isinstance(kernel_id, str) or not ID_PATTERN.match(kernel_id):
        raise InputError("kernel_id must be the id of a running kernel (letters, digits, '-' and '_')")
    count = int_field(data, "count", None, low=1)
    try:
        memory = parse_memory(data.get("memory"), "memory")
    except SchedulingError as exc:
        raise InputError(str(exc)) from None
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
    if "seconds" not in data:
        raise InputError("seconds is required: how long to keep the lease, e.g. 1800 or '30m'")
    return seconds_field(data, "seconds") or 0.0


def reason(data: dict) -> str:
    """An admin's optional reason (drain, release)."""
    value = data.get("reason", "")
    if not isinstance(value, str) or len(value) > 500:
        raise InputError("reason must be a string of at most 500 characters")
    return value


#: The most framework names an acknowledgement of a free-cache step may list.
MAX_FRAMEWORKS = 16


def frameworks(data: dict) -> tuple[str, ...]:
    """The frameworks whose caches a kernel dropped (``{"frameworks": ["torch"]}``), possibly none."""
    value = data.get("frameworks", [])
    if not isinstance(value, list) or len(value) > MAX_FRAMEWORKS:
        raise InputError(f"frameworks must be a list of at most {MAX_FRAMEWORKS} names, not {_show(value)}")
    for name in value:
        if not isinstance(name, str) or not 0 < len(name) <= 64:
            raise InputError(f"frameworks must hold names of 1 to 64 characters, not {_show(name)}")
    unknown = set(data) - {"frameworks"}
    if unknown:
        raise InputError(f"unknown field(s) {', '.join(sorted(map(_show, unknown)))}; only frameworks is accepted")
    return tuple(value)
