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

c = get_config()  # noqa: F821 - provided by JupyterHub when it loads this file

# -- The GPU broker: a hub-managed service that owns the GPUs and the lease ledger -------------
# Where it listens (the hub tells it through JUPYTERHUB_SERVICE_URL) and where the single-user
# servers on this host reach it.
GPUSCHED_URL = os.environ.get("GPUSCHED_BROKER_URL", "http://127.0.0.1:10101")

c.JupyterHub.services = [
    {
        "name": "gpusched",
        "url": GPUSCHED_URL,
        # `jupyter gpusched broker --config <this file>`, run with the hub's Python. The hub
        # starts it, restarts it if it exits and stops it (SIGINT, then SIGTERM) on shutdown.
        "command": [sys.executable, "-m", "jupyter_gpusched.cli", "broker", f"--config={__file__}"],
        "display": True,
        "oauth_no_confirm": True,
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

# Every single-user server schedules its kernels' GPUs through the broker.
c.Spawner.environment = {
    "JUPYTER_GPUSCHED_BROKER_URL": GPUSCHED_URL + "/services/gpusched/",
}

# Optional: make every kernel go through the scheduler, so that no kernel sees a GPU without a
# lease (otherwise only kernelspecs that name gpusched-provisioner do).
# c.Spawner.args = ["--KernelProvisionerFactory.default_provisioner_name=gpusched-provisioner"]

# -- The broker's policy (c.GPUBroker.<trait>; see `jupyter gpusched broker --help-all`) -------
c.GPUBroker.backend = "nvml"
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
