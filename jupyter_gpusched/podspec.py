"""What the spawn hooks change in a KubeSpawner pod (a ``V1Pod``): pure edits of its spec.

:func:`is_gpu_pod` says whether a pod is a GPU user's; :func:`add_preferred_node` adds a preferred
node affinity (device-plugin mode); :func:`add_node_claim` makes the pod use a node's
ResourceClaim and require that node (DRA mode). Every affinity the pod had is kept.
"""

from __future__ import annotations

from typing import Any

#: A single-user server joins the broker at this URL (``GPUSchedApp.broker_url``'s default).
ENV_BROKER_URL = "JUPYTER_GPUSCHED_BROKER_URL"
#: The node label the preferred affinity matches, and the weight of the preference (1-100).
HOSTNAME_LABEL = "kubernetes.io/hostname"
AFFINITY_WEIGHT = 100


def _notebook_container(pod: Any) -> Any:
    containers = list(getattr(getattr(pod, "spec", None), "containers", None) or ())
    return next((c for c in containers if getattr(c, "name", None) == "notebook"), containers[0] if containers else None)


def _env_of(container: Any) -> dict[str, Any]:
    """The container's environment: name -> literal value (None for a value from elsewhere)."""
    return {e.name: e.value for e in (getattr(container, "env", None) or ()) if getattr(e, "name", None)}


def is_gpu_pod(pod: Any) -> bool:
    """Whether ``pod`` is a GPU user's: its notebook container's env sets JUPYTER_GPUSCHED_BROKER_URL.

    The notebook container is the one named ``notebook`` (KubeSpawner's), else the first. A
    profile that joins its node's broker is the one the broker's GPUs are for; every other pod
    is left alone.
    """
    container = _notebook_container(pod)
    return container is not None and ENV_BROKER_URL in _env_of(container)


def add_preferred_node(pod: Any, node: str, weight: int = AFFINITY_WEIGHT) -> Any:
    """Add a preferred node affinity for ``node`` to a KubeSpawner pod (a ``V1Pod``), keeping
    every affinity it has; returns the pod."""
    from kubernetes_asyncio.client.models import (
        V1Affinity,
        V1NodeAffinity,
        V1NodeSelectorRequirement,
        V1NodeSelectorTerm,
        V1PreferredSchedulingTerm,
    )

    spec = pod.spec
    if spec.affinity is None:
        spec.affinity = V1Affinity()
    if spec.affinity.node_affinity is None:
        spec.affinity.node_affinity = V1NodeAffinity()
    node_affinity = spec.affinity.node_affinity
    terms = list(node_affinity.preferred_during_scheduling_ignored_during_execution or ())
    terms.append(
        V1PreferredSchedulingTerm(
            weight=weight,
            preference=V1NodeSelectorTerm(
                match_expressions=[V1NodeSelectorRequirement(key=HOSTNAME_LABEL, operator="In", values=[node])]
            ),
        )
    )
    node_affinity.preferred_during_scheduling_ignored_during_execution = terms
    return pod


def add_node_claim(pod: Any, claim: str, node: str, request: str = "gpus") -> Any:
    """Make a KubeSpawner pod (a ``V1Pod``) use ``node``'s claim: returns the pod.

    The pod's ``resourceClaims`` names ``claim`` (as ``request``), the notebook container's
    ``resources.claims`` uses it, and the pod requires ``node`` (``matchFields`` on the node's
    name, added to every required term it has, so that its own requirements still hold): the node
    where the scheduler allocates the claim when it is not allocated. Once it is, its allocation
    keeps the pod on that node anyway.
    """
    from kubernetes_asyncio.client.models import (
        CoreV1ResourceClaim,
        V1Affinity,
        V1NodeAffinity,
        V1NodeSelector,
        V1NodeSelectorRequirement,
        V1NodeSelectorTerm,
        V1PodResourceClaim,
        V1ResourceRequirements,
    )

    spec = pod.spec
    claims = [c for c in (spec.resource_claims or ()) if getattr(c, "name", None) != request]
    spec.resource_claims = [*claims, V1PodResourceClaim(name=request, resource_claim_name=claim)]
    container = _notebook_container(pod)
    if container.resources is None:
        container.resources = V1ResourceRequirements()
    uses = [c for c in (container.resources.claims or ()) if getattr(c, "name", None) != request]
    container.resources.claims = [*uses, CoreV1ResourceClaim(name=request)]
    if spec.affinity is None:
        spec.affinity = V1Affinity()
    if spec.affinity.node_affinity is None:
        spec.affinity.node_affinity = V1NodeAffinity()
    affinity = spec.affinity.node_affinity
    required = affinity.required_during_scheduling_ignored_during_execution
    on_node = V1NodeSelectorRequirement(key="metadata.name", operator="In", values=[node])
    terms = list(getattr(required, "node_selector_terms", None) or ()) or [V1NodeSelectorTerm()]
    for term in terms:  # terms are ORed: the node goes into each
        term.match_fields = [*(term.match_fields or ()), on_node]
    affinity.required_during_scheduling_ignored_during_execution = V1NodeSelector(node_selector_terms=terms)
    return pod
