"""The OpenAPI document of the REST API, served at ``GET /api/gpusched/openapi.json``."""

from __future__ import annotations

from .._version import __version__

_ERROR = {"$ref": "#/components/schemas/Error"}
_LEASE = {"$ref": "#/components/schemas/Lease"}


def _resp(description: str, schema: dict | None = None) -> dict:
    out: dict = {"description": description}
    if schema is not None:
        out["content"] = {"application/json": {"schema": schema}}
    return out


_ERRORS = {
    "400": _resp("Bad input; the message names the field", _ERROR),
    "403": _resp("Not allowed (another user's or another kernel's lease)", _ERROR),
    "404": _resp("No such lease, kernel or device", _ERROR),
    "409": _resp("Conflicts with the current state", _ERROR),
    "503": _resp("No GPU inventory on this server", _ERROR),
}

_TIME = {"type": ["string", "null"], "format": "date-time"}

SCHEMAS = {
    "Error": {
        "type": "object",
        "required": ["message", "reason"],
        "properties": {"message": {"type": "string"}, "reason": {"type": ["string", "null"]}},
    },
    "Process": {
        "type": "object",
        "properties": {
            "pid": {"type": "integer"},
            "memory_used": {"type": ["integer", "null"]},
            "kernel_id": {"type": ["string", "null"]},
        },
    },
    "Device": {
        "type": "object",
        "required": ["uuid", "index", "name", "memory_total", "health", "lease_ids", "processes"],
        "properties": {
            "uuid": {"type": "string"},
            "index": {"type": "integer"},
            "name": {"type": "string"},
            "memory_total": {"type": "integer", "description": "bytes"},
            "memory_used": {"type": ["integer", "null"], "description": "bytes; null where unknown"},
            "utilization": {"type": ["number", "null"], "description": "percent; null where unknown"},
            "health": {"type": "string", "enum": ["ok", "lost", "drained"]},
            "drain_reason": {"type": ["string", "null"]},
            "parent_uuid": {"type": ["string", "null"], "description": "physical GPU of a MIG instance"},
            "mig_profile": {"type": ["string", "null"]},
            "lease_ids": {"type": "array", "items": {"type": "string"}},
            "processes": {"type": "array", "items": {"$ref": "#/components/schemas/Process"}},
        },
    },
    "Lease": {
        "type": "object",
        "required": ["id", "kernel_id", "user", "devices", "device_indices", "memory", "mode", "state"],
        "properties": {
            "id": {"type": "string"},
            "kernel_id": {"type": ["string", "null"], "description": "null when held by another user"},
            "user": {"type": "string"},
            "holder": {"type": "string"},
            "notebook": {"type": ["string", "null"]},
            "count": {"type": "integer"},
            "devices": {"type": "array", "items": {"type": "string"}, "description": "GPU UUIDs"},
            "device_indices": {"type": "array", "items": {"type": "integer"}},
            "memory": {"type": ["integer", "null"], "description": "bytes per GPU; null = whole GPU"},
            "mode": {"type": "string", "enum": ["exclusive", "shared"]},
            "priority": {"type": "integer"},
            "state": {
                "type": "string",
                "enum": ["pending", "active", "idle", "reclaiming", "suspended", "released"],
            },
            "position": {"type": ["integer", "null"], "description": "1-based queue place while pending"},
            "created_at": _TIME,
            "granted_at": _TIME,
            "last_active_at": _TIME,
            "idle_seconds": {"type": ["number", "null"]},
            "reclaim_at": _TIME,
            "reclaim_step": {
                "type": ["string", "null"],
                "enum": ["release", "checkpoint", "free-cache", "restart", "shutdown", None],
            },
            "keep_until": _TIME,
            "memory_held": {"type": ["integer", "null"]},
            "reason": {"type": "string"},
            "mine": {"type": "boolean"},
            "idle_forecast": {
                "oneOf": [{"$ref": "#/components/schemas/IdleForecast"}, {"type": "null"}],
                "description": "what idle reclaim will do to this lease; null for a lease that holds no GPU",
            },
        },
    },
    "IdleForecast": {
        "type": "object",
        "description": (
            "When this lease would be taken back, and how, if its kernel stays idle from now on "
            "(a running cell counts as idle from now). Computed from the same rules the scheduler "
            "applies: the adaptive idle timeouts, the reclaim ladder, the policy, quotas and keep_until."
        ),
        "required": ["step", "at", "contended_at", "contended_by", "reason"],
        "properties": {
            "step": {
                "type": ["string", "null"],
                "enum": ["release", "checkpoint", "free-cache", "restart", "shutdown", None],
                "description": "the first reclaim step (same values as reclaim_step); null: never taken back while idle",
            },
            "at": {
                **_TIME,
                "description": (
                    "when the step is carried out if nobody waits for a GPU (for restart and "
                    "shutdown: after the grace_period notice); null: never"
                ),
            },
            "contended_at": {
                **_TIME,
                "description": "when, if a kernel that may take it waits for a GPU; never later than at; null: never",
            },
            "contended_by": {
                "type": ["string", "null"],
                "enum": ["anyone", "same_user", None],
                "description": (
                    "who makes it come sooner than at: any waiting kernel (borrowed capacity, or "
                    "the dynamic policy), or only another kernel of the same user (a lease within "
                    "its user's guaranteed share); null: a waiting claim changes nothing"
                ),
            },
            "reason": {"type": "string", "description": "the forecast in plain words"},
        },
    },
    "QueueEntry": {
        "type": "object",
        "properties": {
            "lease_id": {"type": "string"},
            "kernel_id": {"type": ["string", "null"]},
            "user": {"type": "string"},
            "position": {"type": "integer"},
            "count": {"type": "integer"},
            "waiting_since": _TIME,
        },
    },
    "Status": {
        "type": "object",
        "required": ["mode", "backend", "policy", "devices", "leases", "queue"],
        "properties": {
            "mode": {"type": "string", "enum": ["standalone", "hub"]},
            "backend": {"type": "string", "enum": ["nvml", "simulated", "none"]},
            "policy": {"type": "string", "enum": ["static", "dynamic", "hybrid"]},
            "user": {"type": "string"},
            "is_admin": {"type": "boolean"},
            "checkpoint": {
                "type": "object",
                "properties": {"available": {"type": "boolean"}, "reason": {"type": "string"}},
            },
            "devices": {"type": "array", "items": {"$ref": "#/components/schemas/Device"}},
            "leases": {"type": "array", "items": _LEASE},
            "queue": {"type": "array", "items": {"$ref": "#/components/schemas/QueueEntry"}},
        },
    },
    "Claim": {
        "type": "object",
        "required": ["kernel_id"],
        "additionalProperties": False,
        "properties": {
            "kernel_id": {"type": "string", "minLength": 1},
            "count": {"type": "integer", "minimum": 1, "default": 1},
            "memory": {
                "oneOf": [{"type": "string", "example": "16GiB"}, {"type": "integer", "minimum": 1}],
                "description": "per GPU; absent = a whole GPU",
            },
            "mode": {"type": "string", "enum": ["exclusive", "shared"], "default": "exclusive"},
            "priority": {"type": "integer", "default": 0},
            "wait": {
                "oneOf": [{"type": "number", "minimum": 0}, {"type": "string"}],
                "description": "seconds to wait for a grant before answering 202 (at most 30)",
            },
        },
    },
}


def openapi_document() -> dict:
    lease_id = {"name": "lease_id", "in": "path", "required": True, "schema": {"type": "string"}}
    uuid = {"name": "uuid", "in": "path", "required": True, "schema": {"type": "string"}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "jupyter-gpusched", "version": __version__},
        "components": {
            "schemas": SCHEMAS,
            "securitySchemes": {
                "jupyter": {"type": "apiKey", "in": "header", "name": "Authorization"},
                "kernel": {"type": "apiKey", "in": "header", "name": "X-GPUSched-Token"},
            },
        },
        "security": [{"jupyter": []}, {"kernel": []}],
        "paths": {
            "/api/gpusched/status": {
                "get": {
                    "summary": "The host's GPUs, leases and queue",
                    "responses": {"200": _resp("Status", {"$ref": "#/components/schemas/Status"})},
                }
            },
            "/api/gpusched/devices": {
                "get": {
                    "summary": "GPUs with telemetry",
                    "responses": {
                        "200": _resp("Devices", {"type": "array", "items": {"$ref": "#/components/schemas/Device"}})
                    },
                }
            },
            "/api/gpusched/leases": {
                "get": {
                    "summary": "Leases, optionally of one kernel",
                    "parameters": [{"name": "kernel_id", "in": "query", "schema": {"type": "string"}}],
                    "responses": {"200": _resp("Leases", {"type": "array", "items": _LEASE}), **_ERRORS},
                },
                "post": {
                    "summary": "Ask for GPUs for a kernel (resumes a suspended lease)",
                    "requestBody": {
                        "required": True,
                        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Claim"}}},
                    },
                    "responses": {
                        "200": _resp("The kernel already holds a matching lease", _LEASE),
                        "201": _resp("Granted", _LEASE),
                        "202": _resp("Waiting in the queue; see position", _LEASE),
                        **_ERRORS,
                    },
                },
            },
            "/api/gpusched/leases/{lease_id}": {
                "parameters": [lease_id],
                "get": {"summary": "One lease", "responses": {"200": _resp("Lease", _LEASE), **_ERRORS}},
                "delete": {"summary": "Release now", "responses": {"204": _resp("Released"), **_ERRORS}},
            },
            "/api/gpusched/leases/{lease_id}/keep": {
                "parameters": [lease_id],
                "post": {
                    "summary": "No idle reclaim for a while (at most max_keep; 0 ends a keep)",
                    "requestBody": {
                        "required": True,
                        "content": {
                            "application/json": {
                                "schema": {
                                    "type": "object",
                                    "required": ["seconds"],
                                    "properties": {"seconds": {"oneOf": [{"type": "number"}, {"type": "string"}]}},
                                }
                            }
                        },
                    },
                    "responses": {"200": _resp("Lease", _LEASE), **_ERRORS},
                },
            },
            "/api/gpusched/leases/{lease_id}/freed": {
                "parameters": [lease_id],
                "post": {
                    "summary": "The kernel dropped its framework caches, as a free-cache reclaim step asked",
                    "requestBody": {
                        "required": True,
                        "content": {
                            "application/json": {
                                "schema": {
                                    "type": "object",
                                    "properties": {
                                        "frameworks": {"type": "array", "maxItems": 16, "items": {"type": "string"}}
                                    },
                                    "additionalProperties": False,
                                }
                            }
                        },
                    },
                    "responses": {"200": _resp("Lease", _LEASE), **_ERRORS},
                },
            },
            "/api/gpusched/devices/{uuid}/drain": {
                "parameters": [uuid],
                "post": {
                    "summary": "Admin: no new grants on this GPU",
                    "responses": {"200": _resp("Device", {"$ref": "#/components/schemas/Device"}), **_ERRORS},
                },
            },
            "/api/gpusched/devices/{uuid}/undrain": {
                "parameters": [uuid],
                "post": {
                    "summary": "Admin: back in service",
                    "responses": {"200": _resp("Device", {"$ref": "#/components/schemas/Device"}), **_ERRORS},
                },
            },
            "/api/gpusched/events": {
                "get": {
                    "summary": "Websocket of {type: snapshot | lease | device | notice, ...}",
                    "responses": {"101": _resp("Switching protocols")},
                }
            },
        },
    }
