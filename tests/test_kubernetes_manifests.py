"""deploy/kubernetes/: what Kubernetes, the Zero to JupyterHub chart, JupyterHub and the broker accept.

- Every manifest validates against the Kubernetes API's schemas (kubernetes-validate ships them,
  so no cluster and no network are needed), strictly: an unknown field fails. Both GPU modes'
  objects (the device plugin's, and DRA's in dra/, ResourceClaims included) against the
  ``resource.k8s.io/v1`` era, 1.34 to 1.36; the device-plugin mode's also against 1.30.
- Device-plugin mode: the broker requests all of its node pool's ``nvidia.com/gpu``. DRA mode:
  the broker's own admin-access claim, the node claim the hub creates (the example is what the
  code makes), the hub's RBAC (get, list, create ResourceClaims: nothing that deletes).
- The values file, merged over the chart's default values as Helm merges (maps key by key,
  everything else replaced), validates against the chart's values schema (tests/data/z2jh/).
- The DaemonSet's command line and config file are ones ``jupyter gpusched broker`` takes, and
  its environment gives the broker the node's name, the hub's API and the service's identity.
- The GPU profile, applied by a real KubeSpawner, makes a pod that validates and joins its
  node's broker; the hub settings, loaded the way the chart's jupyterhub_config.py loads them,
  initialize a real JupyterHub with the spawn hook set.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from jupyter_gpusched import nodeclaims

from conftest import ROOT

DEPLOY = ROOT / "deploy" / "kubernetes"
CHART = ROOT / "tests" / "data" / "z2jh"
VALUES = DEPLOY / "z2jh-values.yaml"
DRA = DEPLOY / "dra"
DRA_VALUES = DRA / "z2jh-values-dra.yaml"
#: The device-plugin mode's manifests, and the DRA mode's (which replace its DaemonSet).
MANIFESTS = sorted(p for p in DEPLOY.glob("*.yaml") if p != VALUES)
DRA_MANIFESTS = sorted(p for p in DRA.glob("*.yaml") if p != DRA_VALUES)
#: Kubernetes releases with resource.k8s.io/v1 (Dynamic Resource Allocation, GA in 1.34) that we
#: check every manifest against; the oldest the chart's 4.x line supports, for the device plugin's.
DRA_VERSIONS = ("1.34.0", "1.35.0", "1.36.0")
K8S_VERSIONS = ("1.30.0", *DRA_VERSIONS)
TOKEN = "0123456789abcdef" * 4
NODE = "gpu-node-1"


def documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def resource(kind: str, name: str | None = None, manifests: list[Path] = MANIFESTS) -> dict:
    found = [
        doc for path in manifests for doc in documents(path)
        if doc["kind"] == kind and (name is None or doc["metadata"]["name"] == name)
    ]
    assert len(found) == 1, f"expected one {kind} {name or ''} in deploy/kubernetes/, found {len(found)}"
    return found[0]


def daemonset() -> dict:
    return resource("DaemonSet", "gpusched-broker")


def broker_container(ds: dict | None = None) -> dict:
    (container,) = (ds or daemonset())["spec"]["template"]["spec"]["containers"]
    return container


def dra_daemonset() -> dict:
    return resource("DaemonSet", "gpusched-broker", DRA_MANIFESTS)


def env_of(container: dict) -> dict[str, dict]:
    return {item["name"]: item for item in container["env"]}


def helm_merge(base: dict, override: dict) -> dict:
    """Helm's rule for values files: maps merge key by key, everything else is replaced."""
    merged = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = helm_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def chart_schema() -> dict:
    return yaml.safe_load((CHART / "values.schema.yaml").read_text())


def merged_values(dra: bool = False, **extra) -> dict:
    """The chart's values, ours over them (and DRA's over those, as the docs' helm command gives them)."""
    merged = helm_merge(yaml.safe_load((CHART / "values.yaml").read_text()), yaml.safe_load(VALUES.read_text()))
    if dra:
        merged = helm_merge(merged, yaml.safe_load(DRA_VALUES.read_text()))
    return helm_merge(merged, extra)


def schema_errors(values: dict) -> list[str]:
    validator = jsonschema.Draft7Validator(chart_schema())
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(values)]


def profile(slug: str, values: Path = VALUES) -> dict:
    (found,) = [p for p in yaml.safe_load(values.read_text())["singleuser"]["profileList"] if p["slug"] == slug]
    return found


# -- the manifests against the Kubernetes API ---------------------------------------------------
def test_deploy_holds_both_modes_beside_each_other():
    names = {p.name for p in DEPLOY.iterdir()}
    assert {"broker-config.yaml", "broker-daemonset.yaml", "broker-rbac.yaml", "broker-secret.example.yaml",
            "z2jh-values.yaml", "README.md", "dra"} <= names
    kinds = sorted(doc["kind"] for path in MANIFESTS for doc in documents(path))
    assert kinds == sorted(["ConfigMap", "DaemonSet", "Role", "RoleBinding", "Secret", "Service", "ServiceAccount"])
    assert {p.name for p in DRA.iterdir()} == {
        "broker-daemonset.yaml", "broker-rbac.yaml", "hub-rbac.yaml", "node-claim.example.yaml", "z2jh-values-dra.yaml"
    }
    dra_kinds = sorted(doc["kind"] for path in DRA_MANIFESTS for doc in documents(path))
    assert dra_kinds == sorted(
        ["DaemonSet", "ResourceClaim", "ResourceClaimTemplate", "Role", "RoleBinding", "Role", "RoleBinding"]
    )


@pytest.mark.parametrize(
    "path, version",
    [(p, v) for p in MANIFESTS for v in K8S_VERSIONS] + [(p, v) for p in DRA_MANIFESTS for v in DRA_VERSIONS],
    ids=lambda x: str(x.relative_to(DEPLOY)) if isinstance(x, Path) else x,
)
def test_every_manifest_validates_against_the_kubernetes_api(path, version):
    docs = documents(path)
    assert docs, f"{path.name} holds no resource"
    for doc in docs:
        # Raises ValidationError (a bad field), or SchemaNotFoundError for an unknown kind.
        assert kubernetes_validate.validate(doc, version, strict=True) == version.rsplit(".", 1)[0]


@pytest.mark.parametrize(
    "break_it",
    [
        lambda ds: ds["spec"]["template"]["spec"].update(hostPid=True),  # hostPID, misspelt
        lambda ds: ds["spec"]["template"]["spec"]["containers"][0]["ports"][0].update(hostPort="8765"),
        lambda ds: ds["spec"].pop("selector"),
    ],
    ids=["unknown-field", "wrong-type", "required-field-missing"],
)
def test_a_broken_daemonset_fails_validation(break_it):
    broken = copy.deepcopy(daemonset())
    break_it(broken)
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSIONS[-1], strict=True)


def test_in_device_plugin_mode_the_broker_requests_all_of_its_node_pools_gpus():
    """The kubelet counts the node's GPUs as taken (by the broker, which lends them to the GPU
    pods), so no other pod gets them: one value per node pool, the request and the node label
    GPU feature discovery sets agreeing."""
    spec = daemonset()["spec"]["template"]["spec"]
    container = broker_container()
    env = env_of(container)
    assert spec["hostPID"] is True
    count = container["resources"]["limits"]["nvidia.com/gpu"]
    assert int(count) >= 1
    assert spec["nodeSelector"]["nvidia.com/gpu.count"] == count
    assert "nvidia.com/gpu" not in container["resources"].get("requests", {})  # an extended resource: limits only
    # The device plugin names the broker's GPUs; an env of its own would fight it.
    assert "NVIDIA_VISIBLE_DEVICES" not in env
    assert "utility" in env["NVIDIA_DRIVER_CAPABILITIES"]["value"].split(",")  # NVML
    # The GPU pods take none: they see the node's GPUs through the runtime's environment variable.
    gpu_env = profile("gpu")["kubespawner_override"]["environment"]
    assert gpu_env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert "extra_resource_limits" not in profile("gpu")["kubespawner_override"]
    assert spec["runtimeClassName"] == "nvidia"
    (port,) = container["ports"]
    assert port["containerPort"] == port["hostPort"] == 8765
    ledger = next(m for m in container["volumeMounts"] if m["name"] == "ledger")
    volume = next(v for v in spec["volumes"] if v["name"] == "ledger")
    assert volume["hostPath"]["path"] == "/var/lib/jupyter-gpusched" == ledger["mountPath"]
    assert "--GPUBroker.ledger_path=/var/lib/jupyter-gpusched/gpusched.sqlite" in container["args"]


# -- DRA mode ---------------------------------------------------------------------------------------
def _without_gpu_parts(ds: dict) -> dict:
    ds = copy.deepcopy(ds)
    spec = ds["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    spec.pop("runtimeClassName", None)
    spec.pop("resourceClaims", None)
    spec["nodeSelector"].pop("nvidia.com/gpu.count", None)
    container["resources"]["limits"].pop("nvidia.com/gpu", None)
    container["resources"].pop("claims", None)
    container["env"] = [e for e in container["env"] if not e["name"].startswith(("NVIDIA_", "GPUSCHED_DRA_"))]
    return ds


def test_the_dra_broker_sees_its_nodes_gpus_through_an_admin_access_claim():
    dra = dra_daemonset()
    # The same broker as the device plugin's, but for how it gets the node's GPUs.
    assert _without_gpu_parts(dra) == _without_gpu_parts(daemonset())
    spec, container = dra["spec"]["template"]["spec"], broker_container(dra)
    assert "runtimeClassName" not in spec
    assert not any(e["name"].startswith("NVIDIA_") for e in container["env"])  # no environment-variable GPUs
    assert not any("nvidia.com/gpu" in container["resources"].get(k, {}) for k in ("limits", "requests"))
    (pod_claim,) = spec["resourceClaims"]
    assert container["resources"]["claims"] == [{"name": pod_claim["name"]}]
    template = resource("ResourceClaimTemplate", pod_claim["resourceClaimTemplateName"], DRA_MANIFESTS)
    (request,) = template["spec"]["spec"]["devices"]["requests"]
    # Every GPU of its node, for watching them: admin access takes nothing from the node's claim.
    assert request["exactly"] == {"deviceClassName": nodeclaims.DEFAULT_DEVICE_CLASS, "allocationMode": "All",
                                  "adminAccess": True}
    hub_env = yaml.safe_load(DRA_VALUES.read_text())["hub"]["extraEnv"]
    assert hub_env[nodeclaims.ENV_DEVICE_CLASS] == request["exactly"]["deviceClassName"]
    # The broker knows the class too: its admin page reads the nodes' claims of that class.
    broker_env = {e["name"]: e.get("value") for e in container["env"]}
    assert broker_env[nodeclaims.ENV_DEVICE_CLASS] == request["exactly"]["deviceClassName"]


def test_the_node_claim_example_is_the_one_the_hub_creates():
    example = resource("ResourceClaim", manifests=DRA_MANIFESTS)
    node = example["metadata"]["annotations"][nodeclaims.NODE_ANNOTATION]
    assert example == nodeclaims.node_claim(node, nodeclaims.DEFAULT_DEVICE_CLASS)
    (request,) = example["spec"]["devices"]["requests"]
    assert request["exactly"]["allocationMode"] == "All"


@pytest.mark.parametrize("version", DRA_VERSIONS)
@pytest.mark.parametrize("node", ["gpu-node-1", "ip-10-0-3-17.eu-west-1.compute.internal", "n" * 253, "GPU_Node"],
                         ids=["plain", "dotted", "longest", "not-a-dns-name"])
def test_every_node_claim_the_hub_makes_validates(node, version):
    claim = nodeclaims.node_claim(node, "gpu.example.com")
    assert kubernetes_validate.validate(claim, version, strict=True) == version.rsplit(".", 1)[0]
    assert claim["metadata"]["annotations"][nodeclaims.NODE_ANNOTATION] == node
    broken = copy.deepcopy(claim)
    broken["spec"]["devices"]["requests"][0]["exactly"]["allocationmode"] = "All"  # misspelt
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, version, strict=True)


def test_node_claim_names_are_object_names_and_distinct():
    names = {node: nodeclaims.claim_name(node) for node in ("gpu-1", "gpu-2", "n" * 253, "m" * 253, "GPU_Node")}
    assert names["gpu-1"] == "gpusched-gpus-gpu-1"
    assert len(set(names.values())) == len(names)
    assert all(len(n) <= 253 and re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", n) for n in names.values())


def test_the_hub_may_get_list_and_create_claims_and_nothing_else():
    binding = resource("RoleBinding", "gpusched-hub-claims", DRA_MANIFESTS)
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "hub"}]  # the chart's hub
    role = resource("Role", binding["roleRef"]["name"], DRA_MANIFESTS)
    assert role["rules"] == [
        {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims"], "verbs": ["get", "list", "create"]}
    ]
    # The keeper calls exactly those: read, list, create. Nothing deletes, replaces or patches a claim.
    source = (ROOT / "jupyter_gpusched" / "nodeclaims.py").read_text()
    assert set(re.findall(r"\.(\w+)_namespaced_resource_claim\(", source)) == {"read", "list", "create"}
    # The brokers' Role is unchanged by DRA: read pods only.
    assert resource("Role", "gpusched-broker")["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
    ]
    # In DRA mode the brokers may also read the claims (for the admin page), and nothing more.
    binding = resource("RoleBinding", "gpusched-broker-claims", DRA_MANIFESTS)
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "gpusched-broker"}]
    assert resource("Role", binding["roleRef"]["name"], DRA_MANIFESTS)["rules"] == [
        {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims"], "verbs": ["get", "list"]}
    ]


def test_the_dra_values_merged_over_the_charts_validate_and_name_kubespawner_settings():
    from kubespawner import KubeSpawner

    assert schema_errors(merged_values(dra=True)) == []
    traits = set(KubeSpawner.class_trait_names(config=True))
    gpu = profile("gpu", DRA_VALUES)["kubespawner_override"]
    assert set(gpu) <= traits
    # Its GPUs come from the claim: no environment variable, no runtime class, no nvidia.com/gpu.
    assert "NVIDIA_VISIBLE_DEVICES" not in gpu["environment"]
    assert not {"extra_pod_config", "extra_resource_limits", "extra_resource_guarantees"} & set(gpu)
    # Everything else of the GPU profile is the device-plugin mode's.
    plain = copy.deepcopy(profile("gpu")["kubespawner_override"])
    for key in ("NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES"):
        plain["environment"].pop(key)
    plain.pop("extra_pod_config")
    assert gpu == plain
    assert profile("cpu", DRA_VALUES) == profile("cpu")


def test_the_pieces_name_each_other():
    from jupyter_gpusched import kubernetes

    ds = daemonset()
    pod = ds["spec"]["template"]
    env = env_of(broker_container())
    labels = pod["metadata"]["labels"]
    # The selector the brokers and the hub's hook discover peers with picks these pods.
    selector = env["GPUSCHED_BROKER_SELECTOR"]["value"]
    assert selector == kubernetes.DEFAULT_SELECTOR
    key, value = selector.split("=")
    assert labels[key] == value
    assert ds["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert resource("Service")["spec"]["selector"].items() <= labels.items()
    assert int(env["GPUSCHED_BROKER_PORT"]["value"]) == kubernetes.DEFAULT_PORT
    assert env["JUPYTERHUB_SERVICE_PREFIX"]["value"] == kubernetes.DEFAULT_PREFIX
    # The chart's NetworkPolicy lets only labelled pods reach the hub.
    assert labels["hub.jupyter.org/network-access-hub"] == "true"
    # Downward API: the node's name and the namespace to list the peers in.
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    # RBAC: the DaemonSet's ServiceAccount may list and watch pods, and nothing else.
    account = pod["spec"]["serviceAccountName"]
    assert resource("ServiceAccount", account)
    binding = resource("RoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account}]
    role = resource("Role", binding["roleRef"]["name"])
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    # One token: the Secret the broker reads is the one the hub's hook reads.
    secret = resource("Secret")
    ref = env["JUPYTERHUB_API_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": secret["metadata"]["name"], "key": "api-token"}
    assert set(secret["stringData"]) == {"api-token"}
    hub_env = yaml.safe_load(VALUES.read_text())["hub"]["extraEnv"]
    assert hub_env["GPUSCHED_API_TOKEN"]["valueFrom"]["secretKeyRef"] == ref
    # The config file comes from the ConfigMap.
    config_volume = next(v for v in pod["spec"]["volumes"] if v["name"] == "config")
    assert resource("ConfigMap", config_volume["configMap"]["name"])


# -- the broker takes the DaemonSet's command line ------------------------------------------------
def broker_argv(tmp_path: Path) -> list[str]:
    """The DaemonSet's args, with the ConfigMap's file written where --config points in tmp_path."""
    container = broker_container()
    assert container["command"] == ["jupyter", "gpusched", "broker"]
    mount = next(m for m in container["volumeMounts"] if m["name"] == "config")
    files = resource("ConfigMap")["data"]
    argv = []
    for arg in container["args"]:
        if arg.startswith("--config="):
            path = Path(arg.split("=", 1)[1])
            assert path.parent == Path(mount["mountPath"]) and path.name in files
            local = tmp_path / path.name
            local.write_text(files[path.name])
            arg = f"--config={local}"
        argv.append(arg)
    return argv


def test_the_daemonset_uses_only_settings_the_broker_has():
    from jupyter_gpusched.hub.broker import GPUBroker

    traits = set(GPUBroker.class_trait_names(config=True))
    for arg in broker_container()["args"]:
        name = arg[2:].split("=", 1)[0]
        if "." in name:
            cls, trait = name.split(".")
            assert cls == "GPUBroker" and trait in traits, f"{arg}: GPUBroker has no setting {trait!r}"
        else:
            assert name in GPUBroker.aliases, f"{arg}: not an option of jupyter gpusched broker"
    config = {}
    exec(compile(resource("ConfigMap")["data"]["broker_config.py"], "broker_config.py", "exec"),
         {"get_config": lambda: _Recorder(config)})
    unknown = set(config) - traits
    assert config and not unknown, f"broker_config.py sets what GPUBroker does not have: {sorted(unknown)}"
    # What the DaemonSet's comments and the docs lean on.
    assert {"node_name", "node_brokers", "broker_id", "ledger_path", "url", "prefix"} <= traits


class _Recorder:
    """A stand-in for traitlets' config object that records c.GPUBroker.<name> assignments."""

    def __init__(self, into: dict) -> None:
        self._into = into

    def __getattr__(self, section: str):
        into = self._into

        class Section:
            def __setattr__(self, name, value):
                assert section == "GPUBroker", f"broker_config.py configures {section}, not GPUBroker"
                into[name] = value

        return Section()


def test_the_broker_starts_from_the_daemonsets_command_line_and_environment(tmp_path, monkeypatch):
    from jupyterhub.services.auth import HubOAuth

    from jupyter_gpusched.hub.broker import GPUBroker

    downward = {"spec.nodeName": NODE, "metadata.namespace": "jhub"}
    for name, item in env_of(broker_container()).items():
        if "value" in item:
            monkeypatch.setenv(name, item["value"])
        elif "fieldRef" in item["valueFrom"]:
            monkeypatch.setenv(name, downward[item["valueFrom"]["fieldRef"]["fieldPath"]])
        else:
            assert item["valueFrom"]["secretKeyRef"]["key"] == "api-token"
            monkeypatch.setenv(name, TOKEN)
    for name in ("JUPYTERHUB_SERVICE_URL", "GPUSCHED_NODE_BROKERS"):
        monkeypatch.delenv(name, raising=False)

    app = GPUBroker()
    app.initialize(broker_argv(tmp_path))
    assert app.listen_address() == ("0.0.0.0", 8765)
    assert app.prefix == "/services/gpusched/"
    assert app.backend == "nvml"
    assert app.ledger_path == "/var/lib/jupyter-gpusched/gpusched.sqlite"
    # Named by the node, so that a recreated pod keeps its leases; peers found in the cluster.
    assert app.node_name == NODE
    assert app.broker_id == f"gpusched-broker@{NODE}"
    assert app.node_brokers == ""
    assert app.quotas == {"*": 1} and app.policy == "hybrid"  # from the ConfigMap's file

    auth = HubOAuth(parent=app)
    assert auth.api_url == "http://hub:8081/hub/api"
    assert auth.api_token == TOKEN
    assert auth.access_scopes == {"access:services!service=gpusched"}
    assert auth.oauth_client_id == "service-gpusched"
    assert auth.oauth_redirect_uri == "/services/gpusched/oauth_callback"


# -- the Zero to JupyterHub values --------------------------------------------------------------
def test_the_values_merged_over_the_charts_validate_against_its_schema():
    jsonschema.Draft7Validator.check_schema(chart_schema())
    assert schema_errors(merged_values()) == []
    # As installed: the token given with --set-string.
    assert schema_errors(merged_values(hub={"services": {"gpusched": {"apiToken": TOKEN}}})) == []


@pytest.mark.parametrize(
    "broken, where",
    [
        ({"hub": {"extraEnvv": {"A": "b"}}}, ""),  # a typo'd key
        ({"singleuser": {"profilelist": []}}, "singleuser"),
        ({"singleuser": {"networkPolicy": {"egress": {"to": []}}}}, "singleuser.networkPolicy.egress"),
        ({"hub": {"extraConfig": "from x import y"}}, "hub.extraConfig"),  # must be a map
        ({"singleuser": {"extraFiles": {"k": {"data": {}}}}}, "singleuser.extraFiles.k"),  # no mountPath
    ],
    ids=["hub-typo", "singleuser-typo", "egress-not-a-list", "extraConfig-not-a-map", "file-without-path"],
)
def test_a_broken_value_fails_the_charts_schema(broken, where):
    errors = schema_errors(merged_values(**broken))
    assert errors, f"the chart's schema accepted {broken}"
    assert any(e.startswith(where) for e in errors), errors


def test_profile_overrides_and_hub_config_name_real_kubespawner_settings():
    from kubespawner import KubeSpawner

    traits = set(KubeSpawner.class_trait_names(config=True))
    values = yaml.safe_load(VALUES.read_text())
    for item in values["singleuser"]["profileList"]:
        unknown = set(item.get("kubespawner_override", {})) - traits
        assert not unknown, f"profile {item['slug']}: KubeSpawner has no {sorted(unknown)}"
    for cls, settings in values["hub"]["config"].items():
        assert cls == "KubeSpawner" and set(settings) <= traits


def test_the_gpu_kernelspec_is_the_one_the_cli_writes(tmp_path):
    files = yaml.safe_load(VALUES.read_text())["singleuser"]["extraFiles"]
    mounted = files["gpusched-kernelspec"]
    path = Path(mounted["mountPath"])
    jupyter_path = profile("gpu")["kubespawner_override"]["environment"]["JUPYTER_PATH"]
    # Found only where JUPYTER_PATH points (the GPU profile): <path>/kernels/<name>/kernel.json.
    assert path.name == "kernel.json" and path.parent.parent == Path(jupyter_path) / "kernels"
    assert "JUPYTER_PATH" not in profile("cpu").get("kubespawner_override", {}).get("environment", {})
    subprocess.run(
        [sys.executable, "-m", "jupyter_gpusched.cli", "kernelspec", "install", "--name", path.parent.name,
         "--gpus", "1", "--prefix", str(tmp_path)],
        check=True, capture_output=True, timeout=60,
    )
    written = json.loads((tmp_path / "share" / "jupyter" / "kernels" / path.parent.name / "kernel.json").read_text())
    ours = mounted["data"]
    assert ours["metadata"] == written["metadata"]
    assert ours["argv"][1:] == written["argv"][1:] and ours["argv"][0] == "python"  # the image's Python
    assert ours["language"] == written["language"]


# -- KubeSpawner and JupyterHub, for real --------------------------------------------------------
KUBECONFIG = """\
apiVersion: v1
kind: Config
clusters: [{name: none, cluster: {server: "https://127.0.0.1:9"}}]
users: [{name: none, user: {token: none}}]
contexts: [{name: none, context: {cluster: none, user: none, namespace: jhub}}]
current-context: none
"""

# What the chart's jupyterhub_config.py does with the settings we use (hub.config, hub.services,
# hub.loadRoles, singleuser.profileList and .cmd, hub.extraConfig), on the merged values.
Z2JH_CONFIG = """\
import os
import yaml

_values = yaml.safe_load(open(os.environ["Z2JH_VALUES"]))


def get_config(key, default=None):
    value = _values
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return default
        value = value[part]
    return value


c.JupyterHub.spawner_class = "kubespawner.KubeSpawner"
c.JupyterHub.authenticator_class = "dummy"
c.JupyterHub.cleanup_servers = False
c.JupyterHub.services = []
c.JupyterHub.load_roles = []
for app, cfg in get_config("hub.config", {}).items():
    c[app].update(cfg)
for key, service in get_config("hub.services", {}).items():
    service.setdefault("name", key)
    service.pop("apiToken", None)
    service["api_token"] = os.environ["SERVICE_TOKEN"]  # the chart reads it from the hub's Secret
    c.JupyterHub.services.append(service)
for key, role in get_config("hub.loadRoles", {}).items():
    role.setdefault("name", key)
    c.JupyterHub.load_roles.append(role)
c.KubeSpawner.profile_list = get_config("singleuser.profileList")
if get_config("singleuser.cmd") is not None:
    c.Spawner.cmd = get_config("singleuser.cmd")
for key, config_py in sorted(get_config("hub.extraConfig", {}).items()):
    exec(config_py)
"""

PROBE = """\
import asyncio, json, sys
from jupyterhub import orm
from jupyterhub.app import JupyterHub
from kubernetes_asyncio.client import ApiClient
from kubespawner import KubeSpawner
from jupyter_gpusched import kubernetes

async def main(config, db):
    hub = JupyterHub()
    await hub.initialize([f"--config={config}", f"--JupyterHub.db_url=sqlite:///{db}",
                          f"--JupyterHub.cookie_secret_file={db}.cookie"])
    token = orm.APIToken.find(hub.db, __import__("os").environ["SERVICE_TOKEN"])
    service = hub._service_map["gpusched"]
    user_role = hub.db.query(orm.Role).filter_by(name="user").one()
    hook = hub.config.KubeSpawner.modify_pod_hook
    pods = {}
    for slug in ("cpu", "gpu"):
        spawner = KubeSpawner(_mock=True, config=hub.config)
        spawner.user_options = {"profile": slug}
        await spawner.load_user_options()
        pod = await spawner.get_pod_manifest()
        pods[slug] = {"pod": ApiClient().sanitize_for_serialization(pod), "is_gpu_pod": kubernetes.is_gpu_pod(pod),
                      "hook": spawner.modify_pod_hook is hook,
                      "server_token_scopes": list(spawner.server_token_scopes)}
    print(json.dumps({
        "spawner_class": f"{hub.spawner_class.__module__}.{hub.spawner_class.__name__}",
        "hook": f"{hook.__module__}.{hook.__name__}",
        "token_owner": token.service.name if token and token.service else None,
        "service": {"prefix": service.prefix, "url": service.url, "client_id": service.oauth_client_id,
                    "redirect_uri": service.oauth_redirect_uri},
        "user_role": sorted(user_role.scopes),
        "pods": pods,
    }))

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


@pytest.fixture(scope="module")
def hub_probe(tmp_path_factory):
    """A real JupyterHub initialized with the chart's way of loading our values; what it made."""
    return _probe(tmp_path_factory.mktemp("z2jh"), merged_values())


@pytest.fixture(scope="module")
def dra_probe(tmp_path_factory):
    """The same, with the DRA mode's values over ours."""
    return _probe(tmp_path_factory.mktemp("z2jh-dra"), merged_values(dra=True))


def _probe(tmp: Path, values: dict) -> dict:
    (tmp / "values.yaml").write_text(yaml.safe_dump(values))
    (tmp / "jupyterhub_config.py").write_text(Z2JH_CONFIG)
    (tmp / "probe.py").write_text(PROBE)
    (tmp / "kubeconfig").write_text(KUBECONFIG)
    env = {
        **os.environ,
        "Z2JH_VALUES": str(tmp / "values.yaml"),
        "KUBECONFIG": str(tmp / "kubeconfig"),
        "SERVICE_TOKEN": TOKEN,
        "GPUSCHED_API_TOKEN": TOKEN,  # hub.extraEnv, from the Secret
        "PYTHONWARNINGS": "ignore",
    }
    env.pop("KUBERNETES_SERVICE_HOST", None)
    done = subprocess.run(
        [sys.executable, str(tmp / "probe.py"), str(tmp / "jupyterhub_config.py"), str(tmp / "hub.sqlite")],
        cwd=tmp, env=env, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.hub
def test_the_hub_settings_load_in_a_real_jupyterhub(hub_probe):
    assert hub_probe["spawner_class"] == "kubespawner.spawner.KubeSpawner"
    assert hub_probe["hook"] == "jupyter_gpusched.kubernetes.prefer_gpu_node"
    # The brokers' token is the gpusched service's, and its OAuth client is the one they name.
    assert hub_probe["token_owner"] == "gpusched"
    env = {name: item.get("value") for name, item in env_of(broker_container()).items()}
    service = hub_probe["service"]
    assert service["prefix"] == env["JUPYTERHUB_SERVICE_PREFIX"]
    assert service["client_id"] == env["JUPYTERHUB_CLIENT_ID"]
    assert service["redirect_uri"] == env["JUPYTERHUB_OAUTH_CALLBACK_URL"]
    assert service["url"] == "http://gpusched-broker:8765"
    port = resource("Service")["spec"]["ports"][0]["port"]
    assert service["url"].endswith(f"//{resource('Service')['metadata']['name']}:{port}")
    assert "access:services!service=gpusched" in hub_probe["user_role"] and "self" in hub_probe["user_role"]
    for slug in ("cpu", "gpu"):
        assert hub_probe["pods"][slug]["hook"]
        assert "access:services!service=gpusched" in hub_probe["pods"][slug]["server_token_scopes"]


@pytest.mark.hub
@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_the_profiles_make_pods_kubernetes_accepts(hub_probe, version):
    for slug in ("cpu", "gpu"):
        pod = hub_probe["pods"][slug]["pod"]
        assert kubernetes_validate.validate(pod, version, strict=True) == version.rsplit(".", 1)[0]


@pytest.mark.hub
def test_the_gpu_profile_pod_joins_its_nodes_broker(hub_probe):
    gpu, cpu = hub_probe["pods"]["gpu"], hub_probe["pods"]["cpu"]
    assert gpu["is_gpu_pod"] and not cpu["is_gpu_pod"]  # what the spawn hook acts on
    spec = gpu["pod"]["spec"]
    (notebook,) = [c for c in spec["containers"] if c["name"] == "notebook"]
    env = [item["name"] for item in notebook["env"]]
    by_name = {item["name"]: item for item in notebook["env"]}
    assert by_name["GPUSCHED_NODE_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"
    url = by_name["JUPYTER_GPUSCHED_BROKER_URL"]["value"]
    assert url == "http://$(GPUSCHED_NODE_IP):8765/services/gpusched/"
    # Kubernetes expands $(VAR) only from variables defined before it.
    assert env.index("GPUSCHED_NODE_IP") < env.index("JUPYTER_GPUSCHED_BROKER_URL")
    assert by_name["NVIDIA_VISIBLE_DEVICES"]["value"] == "all"
    resources = notebook.get("resources") or {}
    assert not any("nvidia.com/gpu" in (resources.get(k) or {}) for k in ("limits", "requests"))
    assert spec["runtimeClassName"] == "nvidia"
    assert spec["nodeSelector"]["nvidia.com/gpu.present"] == "true"
    assert any(t.get("key") == "nvidia.com/gpu" for t in spec["tolerations"])
    assert "--KernelProvisionerFactory.default_provisioner_name=gpusched-provisioner" in notebook["args"]
    # The broker's port and prefix are the DaemonSet's.
    broker_env = env_of(broker_container())
    assert url.endswith(f":{broker_env['GPUSCHED_BROKER_PORT']['value']}{broker_env['JUPYTERHUB_SERVICE_PREFIX']['value']}")
    # The CPU profile's pod has none of it.
    cpu_spec = cpu["pod"]["spec"]
    cpu_env = {item["name"] for c in cpu_spec["containers"] for item in c.get("env") or ()}
    assert not cpu_env & {"NVIDIA_VISIBLE_DEVICES", "JUPYTER_GPUSCHED_BROKER_URL", "JUPYTER_PATH"}
    assert "runtimeClassName" not in cpu_spec


@pytest.mark.hub
def test_the_dra_values_load_in_a_real_jupyterhub_and_make_pods_kubernetes_accepts(dra_probe):
    """The hook itself (naming the chosen node's claim) is tested with brokers in test_kubernetes_hook.py."""
    assert dra_probe["hook"] == "jupyter_gpusched.kubernetes.claim_gpu_node"
    assert dra_probe["token_owner"] == "gpusched"
    gpu = dra_probe["pods"]["gpu"]
    assert gpu["is_gpu_pod"] and gpu["hook"] and not dra_probe["pods"]["cpu"]["is_gpu_pod"]
    spec = gpu["pod"]["spec"]
    (notebook,) = [c for c in spec["containers"] if c["name"] == "notebook"]
    env = {item["name"] for item in notebook["env"]}
    assert "JUPYTER_GPUSCHED_BROKER_URL" in env and "NVIDIA_VISIBLE_DEVICES" not in env
    assert "runtimeClassName" not in spec
    resources = notebook.get("resources") or {}
    assert not any("nvidia.com/gpu" in (resources.get(k) or {}) for k in ("limits", "requests"))
    for version in DRA_VERSIONS:
        for slug in ("cpu", "gpu"):
            kubernetes_validate.validate(dra_probe["pods"][slug]["pod"], version, strict=True)


# -- the docs point at what exists ---------------------------------------------------------------
def test_the_docs_name_files_that_exist():
    text = (ROOT / "docs" / "kubernetes.md").read_text() + (DEPLOY / "README.md").read_text()
    named = set(re.findall(r"deploy/kubernetes/(?:dra/)?[\w.-]+\.(?:yaml|md)", text))
    every = [*MANIFESTS, *DRA_MANIFESTS, VALUES, DRA_VALUES]
    assert {f"deploy/kubernetes/{p.relative_to(DEPLOY)}" for p in every} <= named
    for path in named:
        assert (ROOT / path).exists(), path
    readme = (ROOT / "README.md").read_text()
    assert "docs/kubernetes.md" in readme and "deploy/kubernetes/" in readme
