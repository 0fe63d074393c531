"""Is it a node summary: what a node broker answered, checked before any use.

The schema is the OpenAPI document's (``GET api/gpusched/node``), with bounds on every string and
list; then the counts must be counts and agree (:func:`jupyter_gpusched.core.nodes.count_problem`).
"""

from __future__ import annotations

import copy
import functools
from typing import Any

from .core.nodes import count_problem

#: Bounds the schema puts on a summary's strings and lists, where the OpenAPI document sets none.
MAX_STRING = 1024
MAX_ITEMS = 4096


def summary_problem(data: Any) -> str | None:
    """Why ``data`` is not a node summary (None: it is one).

    The schema is the OpenAPI document's (``GET api/gpusched/node``), with bounds on strings and
    lists; then the counts must be counts and agree (free and reclaimable GPUs among the
    schedulable ones, those among the devices listed). Fields a newer broker adds are allowed.
    """
    from jsonschema.exceptions import best_match

    error = best_match(_summary_validator().iter_errors(data))
    if error is not None:
        message, shown = error.message, repr(error.instance)
        if len(shown) > 60 and message.startswith(shown):  # the value itself may be huge
            message = _short(shown, 60) + message[len(shown):]
        where = "/".join(str(part) for part in error.absolute_path)
        return _short(f"{where}: {message}" if where else message)
    return count_problem(data)


@functools.lru_cache(maxsize=1)
def _summary_validator() -> Any:
    from jsonschema import Draft202012Validator

    from .api.openapi import NODE_SUMMARY

    schema = _bounded(copy.deepcopy(NODE_SUMMARY))
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema)


def _bounded(schema: dict) -> dict:
    """``schema`` with a length limit on every string and list that has none."""
    kinds = schema.get("type")
    kinds = kinds if isinstance(kinds, list) else [kinds]
    if "string" in kinds:
        schema.setdefault("maxLength", MAX_STRING)
    if "array" in kinds:
        schema.setdefault("maxItems", MAX_ITEMS)
    for sub in (schema.get("properties") or {}).values():
        _bounded(sub)
    if isinstance(schema.get("items"), dict):
        _bounded(schema["items"])
    return schema


def _short(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"
