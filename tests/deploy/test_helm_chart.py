"""The Helm chart, rendered by Helm's own template engine and checked offline.

Helm comes from `helm-python-sdk` (Helm's Go SDK behind a C ABI, no helm binary). Every rendered
object validates against the Kubernetes API schemas that `kubernetes-validate` ships (strict: an
unknown field fails) and the RayCluster and ServiceMonitor against their CRDs' openAPIV3Schema,
copied into helm/schemas/. The cluster.yaml the gateway mounts must load in pdserve and fit the
worker groups, and the gateway's command line must parse with `pdserve serve`'s own parser. The
files under deploy/ are checked against what they describe: the dashboard against the metrics
cluster/observability/metrics.py exports, the Ray launcher config against Ray's schema.
"""

from __future__ import annotations

import copy
import functools
import importlib.resources
import json
import re
import shlex
from pathlib import Path
from typing import Any

import helm_python as helm  # Helm's Go SDK: the dev dependency helm-python-sdk
import jsonschema
import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "pdserve"
SCHEMAS = ROOT / "helm" / "schemas"
DEPLOY = ROOT / "deploy"
CRD_FILES = {"RayCluster": "ray.io_rayclusters.yaml", "ServiceMonitor": "monitoring.coreos.com_servicemonitors.yaml"}
# The oldest Kubernetes the chart supports (Chart.yaml kubeVersion) and the newest the schemas know.
KUBE_VERSIONS = ("1.27.0", kubernetes_validate.utils.latest_version())  # both have a -local-strict folder
RELEASE, NAMESPACE = "demo", "llm"

EVERYTHING_ON = {
    "ray": {"enableInTreeAutoscaling": True, "auth": {"existingSecret": "ray-token", "secretKey": "ray-token"},
            "decodeGroups": [{"groupName": "decode-a", "replicas": 2, "minReplicas": 0, "maxReplicas": 3,
                              "workersPerPod": 2, "idleTimeoutSeconds": 120, "shmSize": "1Gi",
                              "resources": {"limits": {"cpu": "4", "memory": "8Gi"}}},
                             {"groupName": "decode-b", "replicas": 1, "workersPerPod": 1, "shmSize": "1Gi",
                              "resources": {"limits": {"cpu": "2", "memory": "8Gi"}}}]},
    "gateway": {"ingress": {"enabled": True, "className": "nginx",
                            "tls": [{"secretName": "tls", "hosts": ["pdserve.example.com"]}]},
                "podDisruptionBudget": {"maxUnavailable": 1}, "attachedReplicas": 2,
                "tls": {"secretName": "pdserve-gateway-tls"}, "trustedProxies": "10.0.0.0/8,192.168.1.7",
                "prefixCacheIsolation": "shared",
                "connections": {"maxConnections": 1000, "requestReadTimeoutSeconds": 10,
                                "streamWriteTimeoutSeconds": 20.5},
                "tools": {"callParser": "llama3_json", "excludeWhenToolChoiceNone": True}},
    "cluster": {"decodePrefixReuse": False, "localPrefillThreshold": 64, "prefixFetch": True},
    "apiKey": {"value": "a-key-from-values"},
    "apiKeys": {"existingSecret": "pdserve-tenants"},
    "redis": {"auth": {"existingSecret": "redis-credentials", "secretKey": "redis-password"}},
    "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"},
                       "tlsConfig": {"ca": {"secret": {"name": "pdserve-ca", "key": "ca.crt"}},
                                     "serverName": "demo-pdserve-gateway"}},
}
COLOCATED_EXTERNAL = {
    "cluster": {"mode": "colocated"},
    "redis": {"externalUrl": "redis://redis.shared.svc:6379/3"},
    "apiKey": {"enabled": False},
    "networkPolicy": {"enabled": False},
    "grafanaDashboard": {"enabled": False},
}


# The live controller: decode pods 1..3 of 2 workers each, prefill pods 1..2 of one.
SCALING = {
    "cluster": {"scaling": {"enabled": True, "queueDepth": 2, "sustainSeconds": 5, "scaleDownSustainSeconds": 60},
                "decode": {"engine": {"max_num_seqs": 32, "kv_cache_memory_gb": 4}},  # per-pool limits
                "prefill": {"engine": {"max_num_batched_tokens": 4096}}},
    "ray": {"prefill": {"replicas": 1, "minReplicas": 1, "maxReplicas": 2},
            "decodeGroups": [{"groupName": "decode", "replicas": 1, "minReplicas": 1, "maxReplicas": 3,
                              "workersPerPod": 2, "idleTimeoutSeconds": 120, "shmSize": "1Gi",
                              "resources": {"limits": {"cpu": "4", "memory": "8Gi"}}}]},
}


# Ray's token and Redis's password are on by default; off, the pods run as they did before them.
AUTH_OFF = {"ray": {"auth": {"enabled": False}}, "redis": {"auth": {"enabled": False}}}


def examples() -> dict[str, dict[str, Any]]:
    return {path.stem: yaml.safe_load(path.read_text()) for path in sorted((CHART / "examples").glob("*.yaml"))}


CASES = {"defaults": {}, **examples(), "everything-on": EVERYTHING_ON, "colocated-external-redis": COLOCATED_EXTERNAL,
         "auth-off": AUTH_OFF, "scaling": SCALING}


@pytest.fixture(scope="module")
def chart() -> Any:
    with helm.Chart.load(str(CHART)) as loaded:
        yield loaded


@functools.cache
def render_case(case: str) -> list[dict[str, Any]]:
    with helm.Chart.load(str(CHART)) as loaded:
        return render(loaded, CASES[case])


def render(chart: Any, values: dict[str, Any]) -> list[dict[str, Any]]:
    """Every object the chart renders with these values (as `helm template -f values.yaml`)."""
    manifests = chart.render(copy.deepcopy(values), name=RELEASE, namespace=NAMESPACE, is_install=True)
    objects = []
    for path, text in sorted(manifests.items()):
        if path.endswith(".yaml"):
            objects += [document for document in yaml.safe_load_all(text) if document]
    return objects


def one(objects: list[dict[str, Any]], kind: str, suffix: str = "") -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"].endswith(suffix)]
    assert len(found) == 1, f"expected one {kind} named *{suffix}, got {[o['metadata']['name'] for o in found]}"
    return found[0]


def pod_specs(objects: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    specs = [(o["metadata"]["name"], o["spec"]["template"]["spec"]) for o in objects
             if o["kind"] in ("Deployment", "StatefulSet")]
    for cluster in (o for o in objects if o["kind"] == "RayCluster"):
        specs.append(("ray-head", cluster["spec"]["headGroupSpec"]["template"]["spec"]))
        specs += [(group["groupName"], group["template"]["spec"]) for group in cluster["spec"]["workerGroupSpecs"]]
    return specs


# ---- schemas -------------------------------------------------------------------------------------


@functools.cache
def crd_validator(kind: str, version: str) -> Any:
    crd = yaml.load((SCHEMAS / CRD_FILES[kind]).read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    for served in crd["spec"]["versions"]:
        if served["name"] == version:
            schema = closed(served["schema"]["openAPIV3Schema"])
            return jsonschema.Draft7Validator(schema)
    raise AssertionError(f"{CRD_FILES[kind]} has no version {version}")


def closed(schema: Any) -> Any:
    """The schema with unknown fields refused, as the API server's strict field validation does: an
    object with `properties` allows no others unless it says it preserves unknown fields."""
    if isinstance(schema, list):
        return [closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    result = {key: closed(value) for key, value in schema.items()}
    if ("properties" in result and "additionalProperties" not in result
            and not result.get("x-kubernetes-preserve-unknown-fields")):
        result["additionalProperties"] = False
    return result


@functools.cache
def kubernetes_validator(kind: str, api_version: str, kube_version: str) -> Any:
    """kubernetes-validate's strict schema of a kind (as its `validate` picks it), loaded once."""
    from referencing import Registry, Resource

    schemas = importlib.resources.files("kubernetes_validate") / "kubernetes-json-schema"
    folder = schemas / f"v{kube_version}-local-strict"
    group_version = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)  # apps/v1 -> apps-v1
    schema = json.loads((folder / f"{kind.lower()}-{group_version}.json").read_text())
    definitions = json.loads((folder / "_definitions.json").read_text())
    registry = Registry().with_resources([(document["$id"], Resource.from_contents(document))
                                          for document in (schema, definitions)])
    return jsonschema.Draft202012Validator(schema, registry=registry)


def validate(resource: dict[str, Any], kube_version: str) -> None:
    kind = resource["kind"]
    if kind in CRD_FILES:
        validator = crd_validator(kind, resource["apiVersion"].split("/")[-1])
        where = kind
    else:
        validator = kubernetes_validator(kind, resource["apiVersion"], kube_version)
        where = f"{kind} (Kubernetes {kube_version})"
    errors = sorted(validator.iter_errors(resource), key=lambda e: list(e.path))
    assert not errors, f"{where} {resource['metadata']['name']}: " + "; ".join(
        f"{'.'.join(map(str, e.path))}: {e.message}" for e in errors[:5])


@pytest.mark.parametrize("case", sorted(CASES))
def test_renders_and_every_object_validates(case: str) -> None:
    objects = render_case(case)
    kinds = {o["kind"] for o in objects}
    assert {"RayCluster", "ConfigMap", "Deployment", "Service", "ServiceAccount"} <= kinds
    for resource in objects:
        assert resource["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE
        for kube_version in KUBE_VERSIONS:
            validate(resource, kube_version)


def test_the_validation_refuses_a_misspelt_field() -> None:
    objects = render_case("defaults")
    cluster = copy.deepcopy(one(objects, "RayCluster"))
    cluster["spec"]["workerGroupSpecs"][0]["replica"] = 2
    with pytest.raises(AssertionError, match="replica"):
        validate(cluster, KUBE_VERSIONS[-1])
    gateway = copy.deepcopy(one(objects, "Deployment", "-gateway"))
    gateway["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(AssertionError, match="readinesProbe"):
        validate(gateway, KUBE_VERSIONS[-1])


@pytest.mark.parametrize("case", sorted(CASES))
def test_helm_lint_is_clean(case: str) -> None:
    report = helm.lint(str(CHART), copy.deepcopy(CASES[case]), strict=True, namespace=NAMESPACE)
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not problems and not report["errors"], report


# ---- what the objects mean -----------------------------------------------------------------------


def pool_offers(group: dict[str, Any]) -> dict[str, float]:
    """The custom resources a group's pod offers, as `ray start --resources` receives them after
    KubeRay puts the value into a bash command line."""
    (value,) = shlex.split(group["rayStartParams"]["resources"])
    return json.loads(value)


def cluster_yaml(objects: list[dict[str, Any]]) -> dict[str, Any]:
    return yaml.safe_load(one(objects, "ConfigMap", "-cluster")["data"]["cluster.yaml"])


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_pools_fit_the_worker_groups_that_hold_them(case: str) -> None:
    from cluster.ray_cluster.config import cluster_config_from

    objects = render_case(case)
    config = cluster_config_from(cluster_yaml(objects))  # loads in pdserve, every value checked
    groups = one(objects, "RayCluster")["spec"]["workerGroupSpecs"]
    pools = [("decode", config.decode)] + ([] if config.mode == "colocated" else [("prefill", config.prefill)])
    assert {name for group in groups for name in pool_offers(group)} == {f"{name}_node" for name, _ in pools}
    for name, pool in pools:
        (resource,) = pool.resources  # one unit of its group's resource per worker
        assert resource == f"{name}_node" and pool.resources[resource] == 1
        offered = sum(group["replicas"] * pool_offers(group).get(resource, 0) for group in groups)
        assert offered == pool.replicas >= 1, f"{name}: groups offer {offered} workers, the pool has {pool.replicas}"
        for group in groups:
            assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    model = CASES[case].get("model", {})
    reuse = CASES[case].get("cluster", {})
    assert (config.decode_prefix_reuse, config.local_prefill_threshold, config.prefix_fetch) == \
        (reuse.get("decodePrefixReuse", True), reuse.get("localPrefillThreshold", 0), reuse.get("prefixFetch", False))
    assert config.engine.model.model == model.get("name", "default")
    assert config.engine.model.device == model.get("device", "auto")  # the device reaches every worker
    gpus_per_pod = {group["groupName"]: int(group["template"]["spec"]["containers"][0]["resources"]["limits"]
                                            .get("nvidia.com/gpu", 0)) for group in groups}
    if any(gpus_per_pod.values()):  # GPU pods: each worker asks Ray for the GPU its pod holds
        assert config.prefill.num_gpus == config.decode.num_gpus == 1


def gateway_command(objects: list[dict[str, Any]]) -> list[str]:
    container = one(objects, "Deployment", "-gateway")["spec"]["template"]["spec"]["containers"][0]
    (script,) = container["args"]
    (line,) = [line for line in script.splitlines() if line.strip().startswith("exec pdserve serve")]
    return shlex.split(line)[2:]


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_gateway_runs_serve_on_the_mounted_config_and_drains_within_its_grace(case: str) -> None:
    from cluster.cli import build_parser

    objects = render_case(case)
    deployment = one(objects, "Deployment", "-gateway")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = build_parser().parse_args(gateway_command(objects))  # every flag is one serve knows
    cluster = one(objects, "RayCluster")
    head_port = cluster["spec"]["headGroupSpec"]["rayStartParams"]["port"]
    assert args.ray_address == f"{cluster['metadata']['name']}-head-svc:{head_port}"  # KubeRay's head Service
    # Ray's dashboard can submit jobs (run code): on loopback unless the values open it.
    assert cluster["spec"]["headGroupSpec"]["rayStartParams"]["dashboard-host"] == "127.0.0.1"
    assert args.host == "0.0.0.0"
    # Named: its workers outlive a restarted gateway pod, which takes them over without reloading models.
    assert args.name == deployment["metadata"]["name"].removesuffix("-gateway")  # the release's full name
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {
        "http": args.port, "grpc": args.grpc_port, "metrics": args.metrics_port}
    assert args.metrics_port > 0 and args.metrics_port not in (args.port, args.grpc_port)
    mount = next(m for m in container["volumeMounts"] if m["name"] == "cluster-config")
    assert Path(args.config).parent == Path(mount["mountPath"])
    volume = next(v for v in pod["volumes"] if v["name"] == "cluster-config")
    assert volume["configMap"]["name"] == one(objects, "ConfigMap", "-cluster")["metadata"]["name"]
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"]["type"] == "Recreate"

    pre_stop = int(container["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert pre_stop + args.drain_s < pod["terminationGracePeriodSeconds"]
    # The kubelet probes the operator port: the API port's /ready says no more than ready or not.
    assert container["readinessProbe"]["httpGet"].items() >= {"path": "/ready", "port": "metrics"}.items()
    assert container["livenessProbe"]["httpGet"].items() >= {"path": "/health", "port": "metrics"}.items()
    assert container["startupProbe"]["httpGet"].items() >= {"path": "/health", "port": "metrics"}.items()

    service = one(objects, "Service", "-gateway")
    assert {p["name"]: p["targetPort"] for p in service["spec"]["ports"]} == {
        "http": "http", "grpc": "grpc", "metrics": "metrics"}
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    budget = one(objects, "PodDisruptionBudget", "-gateway")
    assert budget["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_attached_gateways_serve_the_owners_pools_behind_the_same_service() -> None:
    from cluster.cli import build_parser

    objects = render_case("everything-on")
    owner, attached = one(objects, "Deployment", "-gateway"), one(objects, "Deployment", "-gateway-attached")
    assert attached["spec"]["replicas"] == 2 and attached["spec"]["strategy"]["type"] == "RollingUpdate"
    (script,) = attached["spec"]["template"]["spec"]["containers"][0]["args"]
    (line,) = [line for line in script.splitlines() if line.strip().startswith("exec pdserve serve")]
    args = build_parser().parse_args(shlex.split(line)[2:])
    assert args.attach and args.ray_address == build_parser().parse_args(gateway_command(objects)).ray_address
    assert not args.name  # the owner's workers, found in the registry
    assert not build_parser().parse_args(gateway_command(objects)).attach
    env = {e["name"] for e in attached["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert {"PDSERVE_REDIS_URL", "PDSERVE_API_KEY"} <= env
    service = one(objects, "Service", "-gateway")
    for deployment, other in ((owner, attached), (attached, owner)):  # each selects its own pods only
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
        assert not other["spec"]["selector"]["matchLabels"].items() <= labels.items()
        assert service["spec"]["selector"].items() <= labels.items()


@pytest.mark.parametrize("case", sorted(CASES))
def test_api_key_and_redis_come_to_the_gateway_from_the_release(case: str) -> None:
    objects = render_case(case)
    values = CASES[case]
    container = one(objects, "Deployment", "-gateway")["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    api_key = values.get("apiKey", {})
    if api_key.get("enabled", True):
        reference = env["PDSERVE_API_KEY"]["valueFrom"]["secretKeyRef"]
        if api_key.get("existingSecret"):
            assert reference["name"] == api_key["existingSecret"]
            assert not [o for o in objects if o["kind"] == "Secret" and o["metadata"]["name"].endswith("-api-key")]
        else:
            secret = one(objects, "Secret", "-api-key")
            assert reference["name"] == secret["metadata"]["name"] and reference["key"] in secret["data"]
    else:
        assert "PDSERVE_API_KEY" not in env
    redis = values.get("redis", {})
    url = env["PDSERVE_REDIS_URL"]["value"]
    if redis.get("externalUrl"):
        assert url == redis["externalUrl"] and not [o for o in objects if o["kind"] == "StatefulSet"]
    else:
        service = one(objects, "Service", "-redis")
        password = ":$(REDIS_PASSWORD)@" if redis.get("auth", {}).get("enabled", True) else ""
        assert url == f"redis://{password}{service['metadata']['name']}:{service['spec']['ports'][0]['port']}/0"
        statefulset = one(objects, "StatefulSet", "-redis")
        assert service["spec"]["selector"].items() <= statefulset["spec"]["template"]["metadata"]["labels"].items()


# ---- the cluster closed by default: Ray's token, Redis's password, the gateway's security flags ------


def gateways(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The gateway Deployments: the owner and, if any, the attached gateways."""
    return [o for o in objects if o["kind"] == "Deployment" and "-gateway" in o["metadata"]["name"]]


def ray_containers(objects: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """Every container that runs Ray: the head, each worker group, each gateway (it joins with `ray
    start`) and the autoscaler beside the head when it runs (KubeRay adds its container from
    autoscalerOptions)."""
    cluster = one(objects, "RayCluster")
    found = [(name, spec["containers"][0]) for name, spec in pod_specs(objects) if not name.endswith("-redis")]
    assert len(found) == 1 + len(cluster["spec"]["workerGroupSpecs"]) + len(gateways(objects))
    if cluster["spec"]["enableInTreeAutoscaling"]:
        found.append(("autoscaler", cluster["spec"]["autoscalerOptions"]))
    return found


def secret_value(objects: list[dict[str, Any]], reference: dict[str, str]) -> str:
    """What a secretKeyRef gives: the chart's Secret's value, or a stand-in for a Secret of the operator's."""
    import base64

    found = [o for o in objects if o["kind"] == "Secret" and o["metadata"]["name"] == reference["name"]]
    if not found:
        return f"{reference['name']}.{reference['key']}"  # URL-safe, as the values ask of such a Secret
    return base64.b64decode(found[0]["data"][reference["key"]]).decode()


def expand(text: str, env: dict[str, str]) -> str:
    """$(NAME) in a container's args or env, as Kubernetes fills it in from `env` (undefined: left as is)."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), text)


def container_env(objects: list[dict[str, Any]], container: dict[str, Any]) -> dict[str, str]:
    """The container's environment as the kubelet builds it: in order, each value expanded with the
    entries defined before it only."""
    env: dict[str, str] = {}
    for entry in container.get("env", []):
        if "valueFrom" in entry:
            env[entry["name"]] = secret_value(objects, entry["valueFrom"]["secretKeyRef"])
        else:
            env[entry["name"]] = expand(entry["value"], env)
    return env


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_ray_container_authenticates_with_one_token(case: str) -> None:
    objects = render_case(case)
    auth = CASES[case].get("ray", {}).get("auth", {})
    chart_secrets = [o for o in objects if o["kind"] == "Secret" and o["metadata"]["name"].endswith("-ray-auth")]
    references = set()
    for name, container in ray_containers(objects):
        env = {e["name"]: e for e in container.get("env", [])}
        if auth.get("enabled", True):
            assert env["RAY_AUTH_MODE"]["value"] == "token", name
            reference = env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
            references.add((reference["name"], reference["key"]))
        else:
            assert env["RAY_AUTH_MODE"]["value"] == "disabled" and "RAY_AUTH_TOKEN" not in env, name
    if not auth.get("enabled", True):
        assert not references and not chart_secrets
        return
    ((secret_name, key),) = references  # one token for the whole cluster
    if auth.get("existingSecret"):
        assert (secret_name, key) == (auth["existingSecret"], auth.get("secretKey", "token")) and not chart_secrets
    else:
        (secret,) = chart_secrets
        assert secret["metadata"]["name"] == secret_name and key == "token"
        token = secret_value(objects, {"name": secret_name, "key": key})
        assert re.fullmatch(r"[A-Za-z0-9]{48}", token), "a random token: 48 letters and digits"


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_charts_redis_requires_the_password_the_gateways_send(case: str) -> None:
    import redis.connection

    objects = render_case(case)
    values = CASES[case].get("redis", {})
    chart_secrets = [o for o in objects if o["kind"] == "Secret" and o["metadata"]["name"].endswith("-redis-auth")]
    if values.get("externalUrl") or not values.get("enabled", True):
        assert not chart_secrets  # an external URL carries its own credentials
        return
    service = one(objects, "Service", "-redis")
    (server,) = one(objects, "StatefulSet", "-redis")["spec"]["template"]["spec"]["containers"]
    server_env = container_env(objects, server)
    args = [expand(arg, server_env) for arg in server["args"]]
    auth = values.get("auth", {})
    if not auth.get("enabled", True):
        assert "--requirepass" not in args and not server.get("env") and not chart_secrets
    else:
        password = args[args.index("--requirepass") + 1]
        assert password == server_env["REDIS_PASSWORD"] == server_env["REDISCLI_AUTH"]  # redis-cli in the probe
        assert server["readinessProbe"]["exec"]["command"][0] == "redis-cli"
        reference = next(e for e in server["env"] if e["name"] == "REDIS_PASSWORD")["valueFrom"]["secretKeyRef"]
        if auth.get("existingSecret"):
            assert reference == {"name": auth["existingSecret"], "key": auth.get("secretKey", "password")}
            assert not chart_secrets
        else:
            (secret,) = chart_secrets
            assert reference == {"name": secret["metadata"]["name"], "key": "password"}
            assert re.fullmatch(r"[A-Za-z0-9]{32}", password), "a random password, URL-safe"
    for gateway in gateways(objects):
        container = gateway["spec"]["template"]["spec"]["containers"][0]
        url = container_env(objects, container)["PDSERVE_REDIS_URL"]  # $(REDIS_PASSWORD) filled in, or not
        parsed = redis.connection.parse_url(url)  # as pdserve's RedisState reads it
        assert (parsed["host"], parsed["port"]) == (service["metadata"]["name"], service["spec"]["ports"][0]["port"])
        if auth.get("enabled", True):
            assert parsed["password"] == password, gateway["metadata"]["name"]
            assert "$(" not in url, "REDIS_PASSWORD must be defined before PDSERVE_REDIS_URL"
        else:
            assert "password" not in parsed and "REDIS_PASSWORD" not in {e["name"] for e in container["env"]}


def test_ray_token_and_redis_password_keep_what_values_give(chart: Any) -> None:
    objects = render(chart, {"ray": {"auth": {"value": "a-ray-token"}}, "redis": {"auth": {"value": "passw0rd"}}})
    ray_secret = one(objects, "Secret", "-ray-auth")
    assert secret_value(objects, {"name": ray_secret["metadata"]["name"], "key": "token"}) == "a-ray-token"
    (server,) = one(objects, "StatefulSet", "-redis")["spec"]["template"]["spec"]["containers"]
    assert container_env(objects, server)["REDIS_PASSWORD"] == "passw0rd"
    gateway = one(objects, "Deployment", "-gateway")["spec"]["template"]["spec"]["containers"][0]
    assert container_env(objects, gateway)["PDSERVE_REDIS_URL"].startswith("redis://:passw0rd@")
    # A second render without values makes new random ones (an upgrade keeps the cluster's: `lookup`).
    first, second = (secret_value(render(chart, {}), {"name": f"{RELEASE}-pdserve-ray-auth", "key": "token"})
                     for _ in range(2))
    assert first != second


def secret_mounted_at(pod: dict[str, Any], folder: Path) -> str:
    """The Secret mounted, read-only, at this folder of the pod's container, in no other volume's folder."""
    mounts = {Path(m["mountPath"]): m for m in pod["containers"][0]["volumeMounts"]}
    mount = mounts[folder]
    assert mount.get("readOnly") is True
    assert not any(other in folder.parents for other in mounts)  # e.g. not inside the ConfigMap's volume
    return next(v for v in pod["volumes"] if v["name"] == mount["name"])["secret"]["secretName"]


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_gateways_certificate_keys_and_limits_come_from_values(case: str) -> None:
    from cluster.cli import build_parser

    objects = render_case(case)
    values, api_keys = CASES[case].get("gateway", {}), CASES[case].get("apiKeys", {})
    connections = {"maxConnections": 4096, "requestReadTimeoutSeconds": 30, "streamWriteTimeoutSeconds": 30,
                   **values.get("connections", {})}
    tools = values.get("tools", {})
    for gateway in gateways(objects):
        pod = gateway["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        (script,) = container["args"]
        (line,) = [line for line in script.splitlines() if line.strip().startswith("exec pdserve serve")]
        command = shlex.split(line)[2:]
        args = build_parser().parse_args(command)
        probes = [container[probe]["httpGet"] for probe in ("startupProbe", "livenessProbe", "readinessProbe")]
        if values.get("tls", {}).get("secretName"):
            cert, key = Path(args.tls_cert), Path(args.tls_key)
            assert (cert.name, key.name) == ("tls.crt", "tls.key") and cert.parent == key.parent
            assert secret_mounted_at(pod, cert.parent) == values["tls"]["secretName"]
            assert all(probe["scheme"] == "HTTPS" for probe in probes)  # the gateway speaks TLS only
        else:
            assert not args.tls_cert and not args.tls_key and all("scheme" not in probe for probe in probes)
        if api_keys.get("existingSecret"):
            path = Path(args.api_keys_file)
            assert path.name == api_keys.get("secretKey", "keys.yaml")
            assert secret_mounted_at(pod, path.parent) == api_keys["existingSecret"]
        else:
            assert not args.api_keys_file
        assert args.trusted_proxies == values.get("trustedProxies", "")
        assert "--prefix-cache-isolation" in command  # stated: the chart's default is the chart's choice
        assert args.prefix_cache_isolation == values.get("prefixCacheIsolation", "per-key")
        # The limits are stated on the command line, not left to pdserve's defaults.
        assert {"--max-connections", "--request-read-timeout", "--stream-write-timeout"} <= set(command)
        assert (args.max_connections, args.request_read_timeout, args.stream_write_timeout) == (
            connections["maxConnections"], connections["requestReadTimeoutSeconds"],
            connections["streamWriteTimeoutSeconds"])
        assert "--tool-call-parser" in command  # stated, as the limits are
        assert (args.tool_call_parser, args.exclude_tools_when_tool_choice_none) == (
            tools.get("callParser", "auto"), tools.get("excludeWhenToolChoiceNone", False))
    monitors = [o for o in objects if o["kind"] == "ServiceMonitor"]
    for monitor in monitors:  # Prometheus scrapes /metrics as the gateway serves it
        (endpoint,) = monitor["spec"]["endpoints"]
        if values.get("tls", {}).get("secretName"):
            assert endpoint["scheme"] == "https"
            assert endpoint["tlsConfig"] == CASES[case]["serviceMonitor"].get("tlsConfig")
        else:
            assert "scheme" not in endpoint and "tlsConfig" not in endpoint


@pytest.mark.parametrize("case", sorted(CASES))
def test_pods_run_as_non_root_with_shared_memory_for_ray(case: str) -> None:
    objects = render_case(case)
    autoscaling = one(objects, "RayCluster")["spec"]["enableInTreeAutoscaling"]
    for name, spec in pod_specs(objects):
        assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] == 1000
        # Only the autoscaler, beside the head, talks to the API server (with the account KubeRay makes).
        assert spec.get("automountServiceAccountToken", True) is (autoscaling and name == "ray-head"), name
        for container in spec["containers"]:
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False, name
            assert context["readOnlyRootFilesystem"] is True, name
            assert context["capabilities"]["drop"] == ["ALL"], name
        if name.endswith("-redis"):
            continue
        volumes = {v["name"]: v for v in spec["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in spec["containers"][0]["volumeMounts"]}
        assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory", name
        assert "emptyDir" in volumes[mounts["/tmp"]], name  # Ray's session files; the root is read-only
        env = {e["name"]: e.get("value") for e in spec["containers"][0]["env"]}
        assert mounts[env["PDSERVE_CACHE_DIR"]] == "model-cache", name


def test_worker_groups_carry_their_scheduling_and_gpus() -> None:
    values = CASES["values-gpu-rdma"]
    cluster = one(render_case("values-gpu-rdma"), "RayCluster")
    assert cluster["spec"]["enableInTreeAutoscaling"] is True
    groups = {g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}
    wanted = {values["ray"]["prefill"].get("groupName", "prefill"): values["ray"]["prefill"],
              **{g["groupName"]: g for g in values["ray"]["decodeGroups"]}}
    assert groups.keys() == wanted.keys()
    for name, group in groups.items():
        spec = group["template"]["spec"]
        assert spec["nodeSelector"] == wanted[name]["nodeSelector"]
        assert spec["tolerations"] == wanted[name]["tolerations"]
        assert spec["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
        bounds = (wanted[name]["minReplicas"], wanted[name]["maxReplicas"])
        assert (group["minReplicas"], group["maxReplicas"]) == bounds
        assert group.get("idleTimeoutSeconds") == wanted[name].get("idleTimeoutSeconds")
        assert "IPC_LOCK" in spec["containers"][0]["securityContext"]["capabilities"]["add"]


def test_monitoring_objects_select_the_gateway() -> None:
    objects = render_case("everything-on")
    monitor = one(objects, "ServiceMonitor")
    service = one(objects, "Service", "-gateway")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"]["matchNames"] == [NAMESPACE]
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics" and endpoint["port"] == "metrics"  # the operator port, not the API's
    assert "metrics" in {p["name"] for p in service["spec"]["ports"]}
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    dashboard = one(objects, "ConfigMap", "-dashboard")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["pdserve.json"]) == json.loads((DEPLOY / "grafana-dashboard.json").read_text())
    assert "ServiceMonitor" not in {o["kind"] for o in render_case("defaults")}  # needs the operator's CRD


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_ingress_routes_the_api_only(case: str) -> None:
    """No `/` catch-all: /metrics, /docs, /openapi.json and /ready stay inside the cluster."""
    for ingress in (o for o in render_case(case) if o["kind"] == "Ingress"):
        for rule in ingress["spec"]["rules"]:
            paths = rule["http"]["paths"]
            assert {p["path"] for p in paths} == {"/v1", "/tokenize", "/detokenize"}, paths
            assert all(p["pathType"] in ("Prefix", "Exact") and p["backend"]["service"]["port"]["name"] == "http"
                       for p in paths)


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_network_policy_lets_the_scrapers_reach_the_operator_port(case: str) -> None:
    objects = render_case(case)
    if not CASES[case].get("networkPolicy", {}).get("enabled", True):
        return
    policy = one(objects, "NetworkPolicy", "-gateway")
    rules = [{p["port"] for p in rule.get("ports", [])} for rule in policy["spec"]["ingress"]]
    assert {"metrics"} in rules  # its own rule: the peers in networkPolicy.metricsFrom, not the API's clients


def test_the_charts_tool_call_parsers_are_pdserves() -> None:
    from cluster.serving.tools.parsers import PARSERS

    schema = json.loads((CHART / "values.schema.json").read_text())
    parsers = schema["properties"]["gateway"]["properties"]["tools"]["properties"]["callParser"]["enum"]
    assert sorted(parsers) == sorted(["auto", *PARSERS])


@pytest.mark.parametrize(("values", "message"), [
    ({"gateway": {"replicas": 2}}, "at '/gateway/replicas': value must be 1"),  # values.schema.json
    ({"ray": {"prefill": {"workerPerPod": 2}}}, "'workerPerPod' not allowed"),
    ({"gateway": {"drainSeconds": 60, "terminationGracePeriodSeconds": 60}}, "drainSeconds must be shorter"),
    ({"gateway": {"drainSeconds": 50, "preStopSleepSeconds": 10, "terminationGracePeriodSeconds": 60}},
     "preStopSleepSeconds"),
    ({"ray": {"decodeGroups": []}}, "at least one decode worker"),
    ({"gateway": {"attachedReplicas": 1}, "redis": {"enabled": False}}, "attachedReplicas needs Redis"),
    ({"ray": {"prefill": {"replicas": 0}}}, "ray.prefill.replicas must be >= 1"),
    ({"ray": {"enableInTreeAutoscaling": True, "autoscalerOptions": {"version": "v1"},
              "prefill": {"idleTimeoutSeconds": 60}}}, "idleTimeoutSeconds needs the v2 autoscaler"),
    ({"redis": {"auth": {"value": "p@ss/word"}}}, "at '/redis/auth/value'"),  # it goes into a URL as it is
    ({"gateway": {"trustedProxies": "10.0.0.0/8; curl evil"}}, "at '/gateway/trustedProxies'"),  # a shell line
    ({"gateway": {"tools": {"callParser": "xml"}}}, "at '/gateway/tools/callParser'"),  # pdserve's parsers only
    ({"gateway": {"prefixCacheIsolation": "per-salt"}}, "at '/gateway/prefixCacheIsolation'"),
    ({"cluster": {"decode": {"engine": {"block_size": 32}}}}, "'block_size' not allowed"),  # one KV layout
    ({"gateway": {"ingress": {"enabled": True, "paths": ["/"]}}}, "at '/gateway/ingress/paths/0'"),  # no catch-all
    ({"gateway": {"ingress": {"enabled": True, "hosts": [{"host": "a.example", "paths": [{"path": "/"}]}]}}},
     "hosts[].paths is gone"),
    ({"gateway": {"metricsPort": 8000}}, "metricsPort must differ"),
])
def test_values_that_cannot_work_fail_with_a_message(chart: Any, values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmError, match=re.escape(message)):
        render(chart, values)


def test_the_api_key_secret_keeps_a_key_given_in_values(chart: Any) -> None:
    import base64

    secret = one(render(chart, {"apiKey": {"value": "s3cret"}}), "Secret", "-api-key")
    assert base64.b64decode(secret["data"]["api-key"]).decode() == "s3cret"
    generated = one(render_case("defaults"), "Secret", "-api-key")
    assert len(base64.b64decode(generated["data"]["api-key"])) == 40


# ---- deploy/ -------------------------------------------------------------------------------------


def exported_metrics() -> set[str]:
    """The sample names /metrics can show, from the registry cluster/observability/metrics.py builds."""
    from cluster.observability.metrics import ClusterMetrics

    names: set[str] = set()
    for family in ClusterMetrics("model").registry.collect():
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}.get(family.type, ("",))
        names |= {family.name + suffix for suffix in suffixes}
    return names


def test_the_dashboard_charts_metrics_the_gateway_exports() -> None:
    dashboard = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
    assert (CHART / "dashboards" / "pdserve.json").read_text() == (DEPLOY / "grafana-dashboard.json").read_text()
    expressions = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    used = {name for expr in expressions for name in re.findall(r"\b(?:vllm|pdserve):[a-z0-9_]+", expr)}
    assert used <= exported_metrics(), f"not exported: {sorted(used - exported_metrics())}"
    wanted = {"vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
              "vllm:e2e_request_latency_seconds_bucket", "vllm:num_requests_running", "vllm:num_requests_waiting",
              "vllm:kv_cache_usage_perc", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
              "vllm:request_success_total", "vllm:num_preemptions_total", "vllm:prefix_cache_queries_total",
              "vllm:prefix_cache_hits_total", "pdserve:kv_transfer_bytes_total", "pdserve:kv_transfer_seconds_total",
              "pdserve:kv_transfer_failures_total", "pdserve:router_decisions_total", "pdserve:workers"}
    assert wanted <= used, f"not charted: {sorted(wanted - used)}"
    for metric in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        assert any(f"histogram_quantile(0.99, sum by (le) (rate(vllm:{metric}_bucket" in e for e in expressions)
    assert any('by (role, worker)' in e and "vllm:kv_cache_usage_perc" in e for e in expressions)


def test_prometheus_scrapes_the_gateway() -> None:
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    (job,) = [job for job in config["scrape_configs"] if job["job_name"] == "pdserve"]
    assert job["metrics_path"] == "/metrics"
    assert all(target.endswith(":8000") for group in job["static_configs"] for target in group["targets"])


def test_the_ray_launcher_config_is_valid_and_pins_the_pools() -> None:
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load((DEPLOY / "ray-cluster.yaml").read_text())
    validate_config(prepare_config(copy.deepcopy(config)))  # what `ray up` checks first
    assert config["provider"]["type"] == "local"
    workers = " ".join(config["worker_start_ray_commands"])
    assert '{"prefill_node": 1}' in workers and '{"decode_node": 1}' in workers
    assert "--num-cpus=0" in " ".join(config["head_start_ray_commands"])


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.gpu"])
def test_the_images_are_multi_stage_non_root_with_the_cache_as_a_volume(name: str) -> None:
    lines = [line.strip() for line in (DEPLOY / name).read_text().splitlines() if line.strip()]
    stages = [line for line in lines if line.startswith("FROM ")]
    assert len(stages) >= 2 and all(" AS " in line for line in stages)
    final = lines[lines.index(stages[-1]):]
    (user,) = [line.split()[1] for line in final if line.startswith("USER ")]
    assert user.split(":")[0].isdigit() and int(user.split(":")[0]) != 0
    env = " ".join(line for line in final if line.startswith("ENV") or line.endswith("\\") or "=" in line)
    cache_dir = re.search(r"PDSERVE_CACHE_DIR=(\S+)", env)
    assert cache_dir, "the image sets PDSERVE_CACHE_DIR"
    (volume,) = [line for line in final if line.startswith("VOLUME")]
    assert cache_dir.group(1) in volume
    assert any("--from=build" in line for line in final)
    for line in lines:  # what the build copies exists in the repository
        if line.startswith("COPY ") and "--from" not in line:
            for source in line.split()[1:-1]:
                assert (ROOT / source).exists(), f"{name}: {source} is missing"


def test_live_scaling_turns_rays_autoscaler_on_within_the_groups_bounds() -> None:
    """The controller's pools may grow to what the worker groups' maxReplicas hold, and Ray's
    autoscaler brings up the pods for the workers it adds; off, neither is there."""
    from cluster.ray_cluster.config import POOL_ENGINE_KEYS, PoolBounds, cluster_config_from

    objects = render_case("scaling")
    cluster = one(objects, "RayCluster")["spec"]
    assert cluster["enableInTreeAutoscaling"] is True and "autoscalerOptions" in cluster
    assert [group.get("idleTimeoutSeconds") for group in cluster["workerGroupSpecs"]] == [None, 120]
    config = cluster_config_from(cluster_yaml(objects))
    assert config.scaling.enabled and config.scaling.queue_depth == 2 and config.scaling.sustain_s == 5
    assert config.scaling.down_sustain_s == 60  # shrinking waits longer than growing
    assert config.scaling.prefill == PoolBounds(1, 2) and config.scaling.decode == PoolBounds(2, 6)
    assert (config.prefill.replicas, config.decode.replicas) == (1, 2)
    decode, prefill = config.engine_for("decode"), config.engine_for("prefill")  # each pool's own limits
    assert (decode.scheduler.max_num_seqs, decode.cache.kv_cache_memory_gb) == (32, 4)
    assert (prefill.scheduler.max_num_batched_tokens, prefill.scheduler.max_num_seqs) == (4096, 256)
    schema = json.loads((CHART / "values.schema.json").read_text())["properties"]["cluster"]["properties"]
    assert all(sorted(schema[pool]["properties"]["engine"]["properties"]) == sorted(POOL_ENGINE_KEYS)
               for pool in ("prefill", "decode"))
    off = render_case("defaults")
    assert "engine" not in cluster_yaml(off)["decode"] and "engine" not in cluster_yaml(off)["prefill"]
    assert one(off, "RayCluster")["spec"]["enableInTreeAutoscaling"] is False
    assert "scaling" not in cluster_yaml(off) and not cluster_config_from(cluster_yaml(off)).scaling.enabled
