"""URL patterns and header names of the REST API, for the server, the broker and their clients."""

from __future__ import annotations

#: Where the API lives, under the server's base URL or the broker's service prefix.
API_PATH = "api/gpusched"

#: A kernel's own token (server): good for that kernel's lease only.
TOKEN_HEADER = "X-GPUSched-Token"
#: Broker: the kernel a server's call is for (narrows the call to that kernel's lease).
KERNEL_HEADER = "X-GPUSched-Kernel"
#: Broker: the single-user server a call comes from.
SERVER_HEADER = "X-GPUSched-Server"
#: Broker: the process id of the single-user server that connects, in its own PID namespace.
PID_HEADER = "X-GPUSched-Pid"
#: Broker: that PID namespace (the inode of the server's ``/proc/self/ns/pid``); the pid above and
#: the kernels' pids in its heartbeats are read in it. Absent: the broker's own namespace.
PIDNS_HEADER = "X-GPUSched-PidNS"
#: Broker: the single-user server's host name (in a Kubernetes pod, the pod's name).
HOST_HEADER = "X-GPUSched-Host"

LEASE_ID = r"(?P<lease_id>[A-Za-z0-9_\-]{1,128})"
KERNEL_ID = r"(?P<kernel_id>[A-Za-z0-9_\-]{1,128})"
DEVICE_UUID = r"(?P<uuid>[A-Za-z0-9_\-/]{1,128})"

#: The routes both the server and the broker serve, by name: (pattern below ``API_PATH``).
STATUS = "/status"
DEVICES = "/devices"
DRAIN = rf"/devices/{DEVICE_UUID}/(?P<action>drain|undrain)"
LEASES = "/leases"
LEASE = rf"/leases/{LEASE_ID}"
KEEP = rf"/leases/{LEASE_ID}/keep"
FREED = rf"/leases/{LEASE_ID}/freed"
EVENTS = "/events"
OPENAPI = "/openapi.json"
#: Broker only.
KERNEL_ENDED = rf"/kernels/{KERNEL_ID}/ended"
SERVERS_CONNECT = "/servers/connect"
#: Broker only: this node's GPUs, leases and queue in brief (hub admins and the gpusched service).
NODE = "/node"


def lease_path(lease_id: str) -> str:
    """The path of one lease below the base URL (for a ``Location`` header)."""
    return f"{API_PATH}/leases/{lease_id}"
