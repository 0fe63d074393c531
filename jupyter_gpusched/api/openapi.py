"""The OpenAPI document of the REST API, served at ``GET /api/gpusched/openapi.json``.

Both the server and the hub broker serve it, and ``tests/test_openapi_conformance.py`` holds both
to it with Schemathesis: every status code an operation can answer is listed, responses match
their schemas, and a request body the schemas call invalid is refused (400). The request schemas
take their patterns and bounds from :mod:`.input`, which checks bodies against the same grammar.
The objects (leases, devices, status, errors, the node summary) are in :mod:`.schemas`; this
module puts the operations together.
"""

from __future__ import annotations

import copy

from .._version import __version__
from .routes import KERNEL_HEADER, SERVER_HEADER, TOKEN_HEADER
from .schemas import (  # the schemas and the helpers that build operations from them
    _body,
    _DEVICE,
    _error,
    _FIND_ERRORS,
    _FREED,
    _ID_PATTERN,
    _KEEP,
    _LEASE,
    NODE_SUMMARY,
    _READ_ERRORS,
    _REASON,
    _resp,
    RESPONSES,
    SCHEMAS,
    _UUID_PATTERN,
    _WRITE_ERRORS,
)

def _broker_paths() -> dict:
    """The operations only the hub broker serves."""
    return {
        "/api/gpusched/node": {
            "get": {
                "summary": "Broker only: this node's GPUs, leases and queue in brief",
                "description": (
                    "For hub admins and for the gpusched service's own token (the hub's spawn hook and "
                    "the other node brokers); anyone else is refused (403)."
                ),
                "security": [{"jupyter": []}],
                "responses": {
                    "200": _resp("The node summary", copy.deepcopy(NODE_SUMMARY)),
                    "400": _error("BadRequest"),
                    "403": _error("Forbidden"),
                },
            }
        },
    }


def openapi_document(broker: bool = False) -> dict:
    """The document, new each call (callers may change their copy).

    ``broker``: with the operations only the hub broker serves (it serves that document).
    """
    lease_id = {"$ref": "#/components/parameters/LeaseId"}
    uuid = {"$ref": "#/components/parameters/DeviceUuid"}
    doc = {
        "openapi": "3.1.0",
        "info": {
            "title": "jupyter-gpusched",
            "version": __version__,
            "description": (
                "GPU leases for Jupyter kernels. The server serves this API under its base URL; in hub "
                "mode the GPU broker serves the same API under its service prefix (e.g. "
                "/services/gpusched/), authenticated with a JupyterHub token only, where a server "
                f"names the kernel a call is for in {KERNEL_HEADER} and itself in {SERVER_HEADER}. "
                "Errors are {message, reason}."
            ),
        },
        "components": {
            "schemas": copy.deepcopy(SCHEMAS),
            "responses": copy.deepcopy(RESPONSES),
            "parameters": {
                "LeaseId": {
                    "name": "lease_id",
                    "in": "path",
                    "required": True,
                    "schema": {"type": "string", "pattern": _ID_PATTERN},
                },
                "DeviceUuid": {
                    "name": "uuid",
                    "in": "path",
                    "required": True,
                    "schema": {"type": "string", "pattern": _UUID_PATTERN},
                },
            },
            "securitySchemes": {
                "jupyter": {
                    "type": "apiKey",
                    "in": "header",
                    "name": "Authorization",
                    "description": "'token ...': the server's token (standalone) or a JupyterHub token (broker)",
                },
                "kernel": {
                    "type": "apiKey",
                    "in": "header",
                    "name": TOKEN_HEADER,
                    "description": "a kernel's own token (server only): good for that kernel's lease only",
                },
            },
        },
        "security": [{"jupyter": []}, {"kernel": []}],
        "paths": {
            "/api/gpusched/status": {
                "get": {
                    "summary": "The host's GPUs, leases and queue",
                    "responses": {"200": _resp("Status", {"$ref": "#/components/schemas/Status"}), **_READ_ERRORS},
                }
            },
            "/api/gpusched/devices": {
                "get": {
                    "summary": "GPUs with telemetry",
                    "responses": {"200": _resp("Devices", {"type": "array", "items": _DEVICE}), **_READ_ERRORS},
                }
            },
            "/api/gpusched/leases": {
                "get": {
                    "summary": "Leases, optionally of one kernel",
                    "parameters": [
                        {
                            "name": "kernel_id",
                            "in": "query",
                            "schema": {"type": "string"},
                            "description": "only this kernel's leases (none: all the caller sees)",
                        }
                    ],
                    "responses": {"200": _resp("Leases", {"type": "array", "items": _LEASE}), **_READ_ERRORS},
                },
                "post": {
                    "summary": "Ask for GPUs for a kernel (resumes a suspended lease)",
                    "requestBody": _body({"$ref": "#/components/schemas/Claim"}),
                    "responses": {
                        "200": _resp("The kernel already holds a matching lease", _LEASE),
                        "201": _resp(
                            "Granted (or resumed)",
                            _LEASE,
                            headers={
                                "Location": {"description": "the lease's URL", "required": True, "schema": {"type": "string"}}
                            },
                        ),
                        "202": _resp("Waiting in the queue; see position", _LEASE),
                        **_WRITE_ERRORS,
                    },
                },
            },
            "/api/gpusched/leases/{lease_id}": {
                "parameters": [lease_id],
                "get": {"summary": "One lease", "responses": {"200": _resp("Lease", _LEASE), **_FIND_ERRORS}},
                "delete": {
                    "summary": "Release now (a lease already released: nothing to do)",
                    "parameters": [
                        {
                            "name": "memory_held",
                            "in": "query",
                            "schema": {"type": "string", "enum": ["release", "keep"]},
                            "description": (
                                "when the kernel's processes still hold GPU memory on the lease's GPUs: "
                                "release all the same (release, the default; that memory then counts as "
                                "taken there) or keep the lease (keep)"
                            ),
                        }
                    ],
                    "responses": {
                        "200": _resp(
                            "The kernel's processes hold GPU memory: released all the same, or kept (memory_held=keep)",
                            {"$ref": "#/components/schemas/Released"},
                        ),
                        "204": _resp("Released; the kernel's processes hold no GPU memory on its GPUs"),
                        **_FIND_ERRORS,
                    },
                },
            },
            "/api/gpusched/leases/{lease_id}/keep": {
                "parameters": [lease_id],
                "post": {
                    "summary": "No idle reclaim for a while (at most max_keep; 0 ends a keep)",
                    "requestBody": _body(_KEEP),
                    "responses": {"200": _resp("Lease", _LEASE), **_WRITE_ERRORS},
                },
            },
            "/api/gpusched/leases/{lease_id}/freed": {
                "parameters": [lease_id],
                "post": {
                    "summary": "The kernel dropped its framework caches, as a free-cache reclaim step asked (else 409)",
                    "requestBody": _body(_FREED, required=False),
                    "responses": {"200": _resp("Lease", _LEASE), **_WRITE_ERRORS},
                },
            },
            "/api/gpusched/devices/{uuid}/drain": {
                "parameters": [uuid],
                "post": {
                    "summary": "Admin: no new grants on this GPU",
                    "requestBody": _body(_REASON, required=False),
                    "responses": {"200": _resp("Device", _DEVICE), **_FIND_ERRORS},
                },
            },
            "/api/gpusched/devices/{uuid}/undrain": {
                "parameters": [uuid],
                "post": {
                    "summary": "Admin: back in service",
                    "requestBody": _body(_REASON, required=False),
                    "responses": {"200": _resp("Device", _DEVICE), **_FIND_ERRORS},
                },
            },
            "/api/gpusched/events": {
                "get": {
                    "summary": "Websocket of {type: snapshot | lease | device | notice, ...}",
                    "description": "The broker takes its token as ?token= too.",
                    "security": [{"jupyter": []}],
                    "responses": {
                        "101": _resp("Switching protocols"),
                        "400": _resp("Not a websocket request (Can \"Upgrade\" only to \"WebSocket\".)"),
                        "403": _resp("No valid credentials"),
                    },
                }
            },
            "/api/gpusched/openapi.json": {
                "get": {
                    "summary": "This document",
                    "responses": {
                        "200": _resp("The OpenAPI document", {"type": "object"}),
                        "400": _error("BadRequest"),
                        "403": _error("Forbidden"),
                    },
                }
            },
        },
    }
    if broker:
        doc["paths"].update(_broker_paths())
    return doc
