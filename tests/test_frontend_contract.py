"""The lab extension's TypeScript interfaces against the OpenAPI document the server serves.

The interfaces that mirror API objects live in ``labextension/src/types.ts``; a strict parser
below reads their fields (name, and whether TypeScript marks them optional) and the test
compares them, schema by schema, with ``GET /api/gpusched/openapi.json`` from a running server.
A field renamed on either side fails it.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass

import pytest

from conftest import ROOT, api

TYPES_TS = ROOT / "labextension" / "src" / "types.ts"

#: Each TypeScript interface that mirrors a schema, and that schema: a name under
#: ``components.schemas``, or ``Schema.property`` for an object the schema declares inline.
CONTRACT: dict[str, str] = {
    "IStatusPayload": "Status",
    "ICheckpointInfo": "Status.checkpoint",
    "IDevice": "Device",
    "IDeviceProcess": "Process",
    "ILease": "Lease",
    "IIdleForecast": "IdleForecast",
    "IQueueEntryPayload": "QueueEntry",
    "IErrorPayload": "Error",
    "IUserUsage": "UserUsage",
    "IGroupUsage": "GroupUsage",
    "IReleased": "Released",
}

#: Schemas no interface mirrors, and why.
NOT_MIRRORED: dict[str, str] = {
    "Claim": "the body of POST /api/gpusched/leases; the lab extension never claims a GPU",
}

#: Fields a schema describes that its interface does not mirror yet, and why. Once types.ts
#: declares one, the test says to drop it from here.
SCHEMA_ONLY: dict[str, dict[str, str]] = {}

#: Fields an interface has that its schema does not describe, and why. Keep this short: a field
#: that the server sends belongs in the schema.
TS_ONLY: dict[str, dict[str, str]] = {
    "IStatusPayload": {
        "backend_note": "sent by the server, missing from the Status schema",
        "config": "sent by the server, missing from the Status schema",
        "time": "sent by the server, missing from the Status schema",
    },
    "IQueueEntryPayload": {
        "id": "accepted in place of lease_id; the server sends lease_id",
        "holder": "accepted where sent; else taken from the queued lease",
        "notebook": "accepted where sent; else taken from the queued lease",
    },
}

#: Fields the interface declares always present while the schema does not list them in
#: ``required``: the server sends them on every object, the schema's ``required`` omits them.
SCHEMA_LEAVES_OPTIONAL: dict[str, set[str]] = {
    "IDevice": {"memory_used", "utilization"},
    "IDeviceProcess": {"pid", "memory_used", "kernel_id"},
    "ILease": {"position", "granted_at", "last_active_at", "idle_seconds", "reclaim_at", "keep_until"},
    "ICheckpointInfo": {"available", "reason"},
}


@dataclass(frozen=True)
class Field:
    name: str
    optional: bool


_INTERFACE = re.compile(
    r"^export interface (?P<name>[A-Z]\w*)(?: extends [^{\n]+)? \{\n(?P<body>.*?)^\}$",
    re.MULTILINE | re.DOTALL,
)
_BLOCK_COMMENT = re.compile(r"/\*.*?\*/", re.DOTALL)
_LINE_COMMENT = re.compile(r"^\s*//.*$", re.MULTILINE)
#: One property per line, as prettier writes it: `name: type;` or `name?: type;`.
_PROPERTY = re.compile(r"^  (?P<readonly>readonly )?(?P<name>[A-Za-z_]\w*)(?P<optional>\?)?: [^;]+;$")


def parse_interfaces(source: str) -> dict[str, list[Field]]:
    """The exported interfaces of a TypeScript file and their properties.

    Strict: a line of an interface body that is neither a comment nor a one-line property
    raises, so that nothing is skipped silently.
    """
    interfaces: dict[str, list[Field]] = {}
    for match in _INTERFACE.finditer(source):
        body = _LINE_COMMENT.sub("", _BLOCK_COMMENT.sub("", match["body"]))
        fields: list[Field] = []
        for line in body.splitlines():
            if not line.strip():
                continue
            prop = _PROPERTY.match(line)
            if prop is None:
                raise ValueError(f"interface {match['name']}: cannot read the line {line!r}")
            fields.append(Field(prop["name"], prop["optional"] is not None))
        names = [f.name for f in fields]
        assert len(names) == len(set(names)), f"{match['name']} declares a field twice: {names}"
        interfaces[match["name"]] = fields
    return interfaces


def test_parser_reads_fields_and_refuses_what_it_cannot_read():
    source = (
        "/** A thing. */\n"
        "export interface IThing {\n"
        "  id: string;\n"
        "  /** Maybe. */\n"
        "  note?: string | null;\n"
        "}\n"
    )
    assert parse_interfaces(source) == {"IThing": [Field("id", False), Field("note", True)]}
    with pytest.raises(ValueError, match="cannot read"):
        parse_interfaces("export interface IThing {\n  id: string;\n  nested: {\n    a: 1;\n  };\n}\n")


def _schema(doc: dict, ref: str) -> dict:
    name, _, prop = ref.partition(".")
    schemas = doc["components"]["schemas"]
    assert name in schemas, f"the OpenAPI document has no schema {name!r}; it has {sorted(schemas)}"
    schema = schemas[name]
    if prop:
        assert prop in schema.get("properties", {}), f"schema {name} has no property {prop!r}"
        schema = schema["properties"][prop]
    assert schema.get("type") == "object" and "properties" in schema, f"{ref} is not an object schema"
    return schema


async def _served_openapi(jp_fetch) -> dict:
    """The OpenAPI document as the running server serves it."""
    code, doc = await api(jp_fetch, "openapi.json")
    assert code == 200, doc
    return doc


@pytest.fixture(scope="module")
def interfaces() -> dict[str, list[Field]]:
    return parse_interfaces(TYPES_TS.read_text(encoding="utf-8"))


async def test_every_schema_is_mirrored_or_said_not_to_be(jp_fetch):
    openapi = await _served_openapi(jp_fetch)
    schemas = set(openapi["components"]["schemas"])
    mirrored = {ref.partition(".")[0] for ref in CONTRACT.values()}
    unaccounted = schemas - mirrored - set(NOT_MIRRORED)
    assert not unaccounted, (
        f"schemas {sorted(unaccounted)} have no TypeScript interface in labextension/src/types.ts: "
        "add one and map it in CONTRACT, or say why not in NOT_MIRRORED"
    )


def disagreements(interface: str, fields: list[Field], doc: dict) -> list[str]:
    """Where an interface and the schema CONTRACT maps it to disagree, in words (empty: none)."""
    ref = CONTRACT[interface]
    schema = _schema(doc, ref)
    props = set(schema["properties"])
    required = set(schema.get("required", []))
    by_name = {f.name: f for f in fields}
    allowed_extra = set(TS_ONLY.get(interface, {}))
    problems = []

    not_yet = set(SCHEMA_ONLY.get(interface, {}))
    only_ts = set(by_name) - props - allowed_extra
    only_schema = props - set(by_name) - not_yet
    if only_ts or only_schema:
        problems.append(
            f"{interface} (types.ts) and {ref} (openapi.json) disagree: "
            f"only in TypeScript {sorted(only_ts)}, only in the schema {sorted(only_schema)}"
        )
    stale = allowed_extra & props
    if stale:
        problems.append(f"{ref} now describes {sorted(stale)}: drop them from TS_ONLY[{interface!r}]")
    mirrored = not_yet & set(by_name)
    if mirrored:
        problems.append(f"{interface} now declares {sorted(mirrored)}: drop them from SCHEMA_ONLY[{interface!r}]")

    optional_but_required = sorted(n for n, f in by_name.items() if f.optional and n in required)
    if optional_but_required:
        problems.append(f"{interface} marks {optional_but_required} optional (`?`), but {ref} requires them")
    always_present = {n for n, f in by_name.items() if not f.optional and n in props}
    unexpected = always_present - required - SCHEMA_LEAVES_OPTIONAL.get(interface, set())
    if unexpected:
        problems.append(
            f"{interface} declares {sorted(unexpected)} always present, but {ref} does not require "
            "them: mark them optional (`?`) in types.ts, or require them in the schema"
        )
    return problems


@pytest.mark.parametrize("interface", sorted(CONTRACT))
async def test_interface_matches_its_schema(jp_fetch, interfaces, interface):
    openapi = await _served_openapi(jp_fetch)
    assert interface in interfaces, f"labextension/src/types.ts has no exported interface {interface}"
    problems = disagreements(interface, interfaces[interface], openapi)
    assert not problems, "\n".join(problems)


async def test_a_field_renamed_on_either_side_is_a_disagreement(jp_fetch, interfaces):
    openapi = await _served_openapi(jp_fetch)
    lease = interfaces["ILease"]
    assert disagreements("ILease", lease, openapi) == []

    renamed_ts = [Field("kept_until", f.optional) if f.name == "keep_until" else f for f in lease]
    (problem,) = disagreements("ILease", renamed_ts, openapi)
    assert "only in TypeScript ['kept_until'], only in the schema ['keep_until']" in problem

    doc = copy.deepcopy(openapi)
    props = doc["components"]["schemas"]["Lease"]["properties"]
    props["holder_name"] = props.pop("holder")
    (problem,) = disagreements("ILease", lease, doc)
    assert "only in TypeScript ['holder'], only in the schema ['holder_name']" in problem

    doc = copy.deepcopy(openapi)
    doc["components"]["schemas"]["Lease"]["required"].append("reason")
    (problem,) = disagreements("ILease", lease, doc)
    assert "marks ['reason'] optional" in problem
