"""JupyterHub on a shared GPU server, with jupyter-gpusched's GPU broker.

Install jupyter-gpusched in the hub's environment (for the broker) and in the users' environment
(for the server extension and the kernel agent), then merge this file into
/etc/jupyterhub/jupyterhub_config.py. The broker reads its own settings (``c.GPUBroker.*``, at the
end) from this same file.

Kernels get GPUs through the gpusched-provisioner; install a kernelspec for it once, for everyone:

    jupyter gpusched kernelspec install --name gpu --gpus 1 --prefix /usr/local

The admin page is at /services/gpusched/ (also under Services in the hub's menu).
"""

import os
import sys
from urllib.parse import quote

c = get_config()  # noqa: F821 - provided by JupyterHub when it loads this file

# -- The GPU broker: a hub-managed service that owns the GPUs and the lease ledger -------------
# It listens in two places. The single-user servers of this host reach it through a Unix socket
# in a directory only the broker's user (root here) can create files in: every server sends its
# hub token to the broker, and no other local user can take that address, not even while the
# broker restarts (a TCP port on 127.0.0.1 that is free for a moment can be taken by anyone, who
# would then collect the servers' tokens). Each server checks the socket's path before it
# connects. The hub's proxy reaches the admin page over TCP (the hub tells the broker where,
# through JUPYTERHUB_SERVICE_URL); no server's token goes there.
GPUSCHED_URL = os.environ.get("GPUSCHED_BROKER_URL", "http://127.0.0.1:10101")
GPUSCHED_SOCKET = os.environ.get("GPUSCHED_BROKER_SOCKET", "/run/jupyterhub-gpusched/broker.sock")

c.JupyterHub.services = [
    {
        "name": "gpusched",
        "url": GPUSCHED_URL,
        # `jupyter gpusched broker --config <this file>`, run with the hub's Python. The hub
        # starts it, restarts it if it exits and stops it (SIGINT, then SIGTERM) on shutdown.
        "command": [sys.executable, "-m", "jupyter_gpusched.cli", "broker", f"--config={__file__}"],
        "display": True,
        "oauth_no_confirm": True,
        # The broker reads this file again in its own environment: give it the same socket.
        "environment": {"GPUSCHED_BROKER_SOCKET": GPUSCHED_SOCKET},
    },
]

# Who may call the broker: every user (so their browser can open the GPU page) and every
# single-user server's own token (the server calls it for its user). Both are needed: a server's
# token holds only scopes its user holds. Hub admins may use every service already.
c.JupyterHub.load_roles = [
    {"name": "user", "scopes": ["self", "access:services!service=gpusched"]},
]
c.Spawner.server_token_scopes = [
    "users:activity!user",
    "access:servers!server",
    "access:services!service=gpusched",
]

# Every single-user server schedules its kernels' GPUs through the broker, over its socket.
c.Spawner.environment = {
    "JUPYTER_GPUSCHED_BROKER_URL": "http+unix://" + quote(GPUSCHED_SOCKET, safe="") + "/services/gpusched/",
}

# Optional: make every kernel go through the scheduler, so that no kernel sees a GPU without a
# lease (otherwise only kernelspecs that name gpusched-provisioner do).
# c.Spawner.args = ["--KernelProvisionerFactory.default_provisioner_name=gpusched-provisioner"]

# -- The broker's policy (c.GPUBroker.<trait>; see `jupyter gpusched broker --help-all`) -------
c.GPUBroker.backend = "nvml"
c.GPUBroker.unix_socket = GPUSCHED_SOCKET
c.GPUBroker.ledger_path = "/var/lib/jupyterhub/gpusched.sqlite"
c.GPUBroker.policy = "hybrid"
# Guaranteed GPUs: by hub user, by hub group (the largest of a user's groups), and for everyone
# else. Users may borrow idle GPUs beyond their quota; borrowed GPUs are taken back first, after
# contended_idle_timeout, as soon as someone waits.
c.GPUBroker.quotas = {"group:staff": 2, "*": 1}
c.GPUBroker.idle_timeout = 300
c.GPUBroker.contended_idle_timeout = 60
c.GPUBroker.release_timeout = 3600
c.GPUBroker.grace_period = 60
c.GPUBroker.reclaim_fallback = "restart"
c.GPUBroker.max_pending_per_user = 4
# Users see their own leases in full and others' as "another user"; True shows everyone's names.
c.GPUBroker.show_holders = False
