"""What a node does with a GPU pod in DRA mode, for tests/test_multinode.py: the scheduler's and the
kubelet's part, on one machine.

Run as the pod's command, already inside the pod's PID namespace (``unshare``):
``python multinode_pod.py KUBECONFIG NODES_JSON server-command...``. The pod names its node's
claim (``GPUSCHED_POD_CLAIM``) and requires a node (``GPUSCHED_POD_NODE``), as the hub's DRA hook
wrote them into the pod KubeSpawner built. As the scheduler does, this reserves the claim for the
pod, allocating it on the required node where it is not allocated (through the stand-in API server,
tests/kube_api.py, with the official client), and refuses a pod whose claim is allocated on
another node. Then, as the kubelet, it runs the server on THE NODE THE CLAIM IS ALLOCATED ON: that
node's GPUs (its simulated GPU state file) and broker (the URL the pod builds from its node's IP),
in the pod's host name.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kube_api import allocate  # noqa: E402

from jupyter_gpusched.nodeclaims import allocated_node  # noqa: E402


def main(kubeconfig: str, nodes_json: str, command: list[str]) -> None:
    from kubernetes import client, config

    nodes = json.loads(nodes_json)  # node -> {"url": broker URL, "gpus": n, "state": GPU state file}
    claim, required = os.environ["GPUSCHED_POD_CLAIM"], os.environ["GPUSCHED_POD_NODE"]
    user = os.environ["JUPYTERHUB_USER"]
    pod = f"jupyter-{user}"
    configuration = client.Configuration()
    config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
    with client.ApiClient(configuration) as api:
        try:
            reserved = allocate(api, "jhub", claim, required, nodes[required]["gpus"], pod)
        except RuntimeError as exc:
            sys.exit(f"pod {pod} is unschedulable: {exc}")
    node = allocated_node(reserved)
    os.environ.update(
        GPUSCHED_NODE=node,
        JUPYTER_GPUSCHED_BROKER_URL=nodes[node]["url"],
        JUPYTER_GPUSCHED_SIM_STATE=nodes[node]["state"],
    )
    socket.sethostname(pod)
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
