"""The JSON schemas of the REST API's objects (leases, devices, status, errors, request bodies,
the node summary), and the helpers that build responses from them, for :mod:`.openapi`.

The request schemas take their patterns and bounds from :mod:`.input`.
"""

from __future__ import annotations

from . import input as api_input
from .routes import KERNEL_HEADER, SERVER_HEADER, TOKEN_HEADER

_ERROR = {"$ref": "#/components/schemas/Error"}
_LEASE = {"$ref": "#/components/schemas/Lease"}
_DEVICE = {"$ref": "#/components/schemas/Device"}


def _resp(description: str, schema: dict | None = None, headers: dict | None = None) -> dict:
    out: dict = {"description": description}
    if headers:
        out["headers"] = headers
    if schema is not None:
        out["content"] = {"application/json": {"schema": schema}}
    return out


def _error(name: str) -> dict:
    return {"$ref": f"#/components/responses/{name}"}


#: The error answers, each ``{"message", "reason"}``; operations list those they can give.
RESPONSES = {
    "BadRequest": _resp(
        "Bad input; the message names the field. The broker also answers 400 to a malformed "
        f"{KERNEL_HEADER} or {SERVER_HEADER} header, on every operation.",
        _ERROR,
    ),
    "Forbidden": _resp(
        "No valid credentials, or not allowed: no token, an unknown kernel token "
        f"({TOKEN_HEADER}), a kernel token used for another kernel's lease, another user's lease, "
        "or an admin action by someone who is not an admin",
        _ERROR,
    ),
    "NotFound": _resp("No such lease, running kernel or GPU", _ERROR),
    "Conflict": _resp(
        "Conflicts with the lease's state: a different claim for a kernel that already holds one, a "
        "lease that was released meanwhile, a keep or an acknowledgement the lease is not in a state for, "
        "or the per-user pending cap (broker)",
        _ERROR,
    ),
    "Unavailable": _resp(
        "No GPU can be scheduled (no inventory, every GPU drained or lost, or more GPUs asked "
        "for than there are), the lease ledger cannot be written, or (hub mode) the GPU broker "
        "cannot be reached",
        _ERROR,
    ),
}

#: Every operation may be refused (403); the broker may refuse a malformed identity header (400);
#: in hub mode the server forwards to the broker, which may be unreachable (503).
_READ_ERRORS = {"400": _error("BadRequest"), "403": _error("Forbidden"), "503": _error("Unavailable")}
_FIND_ERRORS = {**_READ_ERRORS, "404": _error("NotFound")}
_WRITE_ERRORS = {**_FIND_ERRORS, "409": _error("Conflict")}

#: A whole number of bytes, or a size with a unit.
_MEMORY = {
    "anyOf": [
        {"type": "integer", "minimum": 1, "maximum": api_input.MAX_CLAIM_MEMORY},
        {"type": "string", "pattern": f"^{api_input.MEMORY_REGEX}$", "examples": ["16GiB", "512MiB"]},
        {"type": "null"},
    ],
    "description": (
        "memory per GPU: a number of bytes, or a string with its unit such as '16GiB' (units B, K, "
        "KB, KiB, M, MB, MiB, G, GB, GiB, T, TB, TiB, any case; a string without a unit such as "
        "'16' is refused, 400); null or '' for a whole GPU. More than the largest GPU has is "
        "refused (400)."
    ),
}


def _seconds(description: str, *, null: bool = False, boolean: bool = False) -> dict:
    """Seconds as a number or a duration string (``30m``, ``1h30m``)."""
    kinds: list[dict] = [
        {"type": "number", "minimum": 0, "maximum": api_input.MAX_SECONDS},
        {"type": "string", "pattern": f"^{api_input.DURATION_REGEX}$", "examples": ["30m", "1h30m"]},
    ]
    if boolean:
        kinds.append({"type": "boolean"})
    if null:
        kinds.append({"type": "null"})
    return {
        "anyOf": kinds,
        "description": f"{description}. A number is seconds; a string needs its unit ('30m', '90s'), '0' aside.",
    }


def _body(schema: dict, required: bool = True) -> dict:
    return {"required": required, "content": {"application/json": {"schema": schema}}}


_TIME = {"type": ["string", "null"], "format": "date-time"}
_ID_PATTERN = f"^{api_input.ID_REGEX}$"
#: GPU and MIG UUIDs as the routes take them (``routes.DEVICE_UUID``).
_UUID_PATTERN = "^[A-Za-z0-9_/-]{1,128}$"

#: A GPU process outside every lease, as ``Status.unleased_processes`` lists it.
_UNLEASED = {
    "type": "object",
    "description": (
        "A GPU process no lease covers: not a kernel's, or a kernel's on a GPU its lease does not hold. "
        "The hub broker names the server it runs under where it can tell."
    ),
    "required": ["pid", "device", "memory_used"],
    "properties": {
        "pid": {"type": "integer", "description": "the host's process id, as the GPU driver reports it"},
        "device": {"type": "string", "description": "the GPU's UUID"},
        "memory_used": {"type": ["integer", "null"], "description": "bytes; null where the driver does not say"},
        "kernel_id": {"type": ["string", "null"], "description": "the kernel whose process it is, where it is one"},
        "unix_user": {"type": ["string", "null"], "description": "hub broker: the Unix user it runs as"},
        "server_id": {
            "type": ["string", "null"],
            "description": (
                "hub broker: the single-user server it runs under (in a kernel's process tree, below the "
                "server's process, or in the PID namespace of a server's container); null: none known"
            ),
        },
        "user": {"type": ["string", "null"], "description": "hub broker: that server's hub user"},
        "pod": {
            "type": ["string", "null"],
            "description": (
                "hub broker: the name of the pod the broker finds that server's process in (the host "
                "name of a UTS namespace the host made; a name the server reports is only checked "
                "against it, never believed); null where it finds none"
            ),
        },
    },
}

SCHEMAS = {
    "Error": {
        "type": "object",
        "required": ["message", "reason"],
        "properties": {"message": {"type": "string"}, "reason": {"type": ["string", "null"]}},
    },
    "Process": {
        "type": "object",
        "required": ["pid", "memory_used", "kernel_id"],
        "properties": {
            "pid": {"type": "integer"},
            "memory_used": {"type": ["integer", "null"]},
            "kernel_id": {"type": ["string", "null"]},
            "lease_id": {
                "type": ["string", "null"],
                "description": (
                    "the lease on this GPU the process counts toward; null: outside every lease (not a "
                    "kernel's, or a kernel's that holds no lease on this GPU, such as one released while "
                    "its memory was kept): its memory counts as taken for new claims"
                ),
            },
            "user": {"type": ["string", "null"], "description": "the user of the kernel it belongs to, where known"},
        },
    },
    "Released": {
        "type": "object",
        "description": (
            "A release whose kernel's processes still hold GPU memory on the lease's GPUs (more than a CUDA "
            "context left behind)"
        ),
        "required": ["released", "lease", "memory_held", "processes", "message"],
        "properties": {
            "released": {
                "type": "boolean",
                "description": "whether the lease was released (false: kept, as memory_held=keep asked)",
            },
            "lease": _LEASE,
            "memory_held": {"type": "integer", "description": "bytes the kernel's processes hold on the lease's GPUs"},
            "processes": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["pid", "device", "device_index", "memory_used"],
                    "properties": {
                        "pid": {"type": "integer"},
                        "device": {"type": "string", "description": "the GPU's UUID"},
                        "device_index": {"type": "integer"},
                        "memory_used": {"type": "integer", "description": "bytes"},
                    },
                },
            },
            "message": {"type": "string", "description": "what happened and what to do, for a person"},
        },
    },
    "Device": {
        "type": "object",
        "required": [
            "uuid", "index", "name", "memory_total", "memory_used", "utilization", "health", "lease_ids", "processes",
        ],
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
            "processes": {
                "type": "array",
                "items": {"$ref": "#/components/schemas/Process"},
                "description": (
                    "the GPU's processes; a hub user who is not an admin, where show_holders is off, sees "
                    "only their own kernels' processes"
                ),
            },
        },
    },
    "Lease": {
        "type": "object",
        "required": [
            "id", "kernel_id", "user", "devices", "device_indices", "memory", "mode", "state", "position",
            "granted_at", "last_active_at", "idle_seconds", "reclaim_at", "keep_until",
        ],
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
            "over_share_since": {
                **_TIME,
                "description": (
                    "when a shared lease's processes were first seen holding more than its memory "
                    "share (what happens next is in reason); null: within it"
                ),
            },
            "reason": {
                "type": "string",
                "description": (
                    "why the lease is as it is; for a pending claim also why it stands where it does "
                    "in the fair queue (quota, its user's recent usage, priority, age)"
                ),
            },
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
            "reason": {
                "type": "string",
                "description": (
                    "why the claim waits and why it stands where it does in the fair queue (its "
                    "class against its user's quota, its user's recent GPU usage, what put the "
                    "claims ahead of it there); empty for another user's claim unless holders are shown"
                ),
            },
        },
    },
    "UserUsage": {
        "type": "object",
        "required": ["user", "gpu_hours", "quota", "held"],
        "properties": {
            "user": {"type": "string", "description": "the user, or 'another user' as for their leases"},
            "gpu_hours": {
                "type": "number",
                "minimum": 0,
                "description": "GPU-hours held recently, decayed with usage_half_life (a shared lease counts its share of the GPU)",
            },
            "quota": {"type": "number", "minimum": 0, "description": "GPUs guaranteed to the user"},
            "held": {"type": "number", "minimum": 0, "description": "GPUs' worth held now"},
        },
    },
    "GroupUsage": {
        "type": "object",
        "required": ["group", "gpu_hours", "held"],
        "properties": {
            "group": {"type": "string"},
            "gpu_hours": {"type": "number", "minimum": 0, "description": "GPU-hours its members held recently, decayed"},
            "held": {"type": "number", "minimum": 0, "description": "GPUs' worth its members hold now"},
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
                "required": ["available", "reason"],
                "properties": {
                    "available": {"type": "boolean"},
                    "reason": {"type": "string"},
                    "host_memory_budget": {
                        "type": ["integer", "null"],
                        "description": "bytes of host memory checkpoints may hold together (checkpoint_host_memory); null: no limit",
                    },
                    "host_memory_held": {
                        "type": "integer",
                        "description": "bytes that checkpoints hold now (suspended kernels and those being checkpointed)",
                    },
                },
            },
            "devices": {"type": "array", "items": {"$ref": "#/components/schemas/Device"}},
            "leases": {"type": "array", "items": _LEASE},
            "queue": {"type": "array", "items": {"$ref": "#/components/schemas/QueueEntry"}},
            "usage": {
                "type": "array",
                "items": {"$ref": "#/components/schemas/UserUsage"},
                "description": (
                    "recent GPU usage per user, most first: every user with recent usage or a live "
                    "lease; empty when usage_half_life is 0"
                ),
            },
            "group_usage": {
                "type": "array",
                "items": {"$ref": "#/components/schemas/GroupUsage"},
                "description": "recent GPU usage per group, most first (a group only to its members unless holders are shown)",
            },
            "unleased_processes": {
                "type": "array",
                "items": _UNLEASED,
                "description": "GPU processes outside every lease (admins only; empty for others)",
            },
            "node": {"type": "string", "description": "hub broker only: the node (host) whose GPUs it schedules"},
        },
    },
    "Claim": {
        "type": "object",
        "description": "POST /api/gpusched/leases: what a kernel asks for; null in a field means its default",
        "required": ["kernel_id"],
        "additionalProperties": False,
        "properties": {
            "kernel_id": {"type": "string", "pattern": _ID_PATTERN, "description": "a running kernel's id"},
            "count": {
                "type": ["integer", "null"],
                "minimum": 1,
                "maximum": api_input.INT_LIMIT,
                "default": 1,
                "description": "GPUs; more than this host has is refused (400)",
            },
            "memory": _MEMORY,
            "mode": {"enum": ["exclusive", "shared", None], "default": "exclusive"},
            "priority": {
                "type": ["integer", "null"],
                "minimum": -api_input.INT_LIMIT,
                "maximum": api_input.INT_LIMIT,
                "default": 0,
                "description": "ties in the queue; in hub mode only an admin raises it above 0 (403)",
            },
            "wait": _seconds(
                f"seconds to wait for a grant before answering 202 (at most {api_input.MAX_WAIT:.0f}; "
                f"true: {api_input.MAX_WAIT:.0f}, false or null: 0)",
                null=True,
                boolean=True,
            ),
        },
    },
}

_KEEP = {
    "type": "object",
    "required": ["seconds"],
    "additionalProperties": False,
    "properties": {
        "seconds": _seconds("how long to keep the lease, at most max_keep (else 400); 0 ends a keep"),
    },
}
_FREED = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "frameworks": {
            "type": "array",
            "maxItems": api_input.MAX_FRAMEWORKS,
            "items": {"type": "string", "minLength": 1, "maxLength": api_input.MAX_FRAMEWORK_NAME},
            "description": "the frameworks whose caches the kernel dropped (torch, tensorflow, jax, cupy); may be empty",
        }
    },
}
_REASON = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "reason": {"type": "string", "maxLength": api_input.MAX_REASON, "description": "shown as the GPU's drain_reason"}
    },
}


_COUNT = {"type": "integer", "minimum": 0}

#: ``GET api/gpusched/node`` (broker only): one node in brief, for the hub's spawn hook
#: (``jupyter_gpusched.kubernetes``) and the cluster view of the admin page.
NODE_SUMMARY = {
    "type": "object",
    "required": ["node", "time", "policy", "backend", "gpus", "free", "reclaimable", "pending", "leases", "devices", "queue"],
    "properties": {
        "node": {"type": "string", "description": "the node's name (the broker's node_name)"},
        "time": _TIME,
        "policy": {"type": "string", "enum": ["static", "dynamic", "hybrid"]},
        "backend": {"type": "string", "enum": ["nvml", "simulated", "none"]},
        "gpus": {**_COUNT, "description": "GPUs that can be scheduled (healthy, not drained; MIG instances, not their parents)"},
        "free": {**_COUNT, "description": "of those, GPUs no lease holds"},
        "reclaimable": {
            **_COUNT,
            "description": (
                "of those, GPUs held only by leases the reclaim ladder can take back for another user's claim: "
                "idle leases on borrowed capacity (or under the dynamic policy, or due to be taken back anyway), "
                "and leases being reclaimed"
            ),
        },
        "pending": {**_COUNT, "description": "claims waiting in the queue"},
        "pending_gpus": {**_COUNT, "description": "GPUs the claims waiting in the queue ask for"},
        "leases": {**_COUNT, "description": "leases that hold GPUs"},
        "servers": {**_COUNT, "description": "single-user servers connected to this broker"},
        "servers_without_lease": {
            **_COUNT,
            "description": "connected servers none of whose kernels holds or waits for a lease yet (they bind at their first cell)",
        },
        "devices": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["index", "uuid", "name", "memory_total", "health", "state", "users"],
                "properties": {
                    "index": {"type": "integer"},
                    "uuid": {"type": "string"},
                    "name": {"type": "string"},
                    "memory_total": {"type": "integer", "description": "bytes"},
                    "health": {"type": "string", "enum": ["ok", "lost", "drained"]},
                    "state": {
                        "type": "string",
                        "enum": ["free", "reclaimable", "held", "unavailable"],
                        "description": "unavailable: lost, drained, or split into MIG instances",
                    },
                    "users": {"type": "array", "items": {"type": "string"}, "description": "who holds it"},
                },
            },
        },
        "queue": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["position", "user", "count", "waiting_since"],
                "properties": {
                    "position": {"type": "integer"},
                    "user": {"type": "string"},
                    "count": {"type": "integer"},
                    "waiting_since": _TIME,
                },
            },
        },
    },
}
