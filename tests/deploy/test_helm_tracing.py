"""The chart's tracing: the endpoint and sample ratio reach pdserve through its cluster.yaml, and the
optional OpenTelemetry Collector (Deployment, Service, ConfigMap, NetworkPolicy) renders, validates
against the Kubernetes schemas, and is what the endpoint points at."""

from __future__ import annotations

import re
from typing import Any

import helm_python as helm
import pytest
import yaml

from cluster.ray_cluster.config import cluster_config_from
from tests.deploy.test_helm_chart import KUBE_VERSIONS, NAMESPACE, RELEASE, cluster_yaml, one, render, validate

COLLECTOR = {"tracing": {"sampleRatio": 0.25, "collector": {
    "enabled": True, "exporters": {"otlp": {"endpoint": "tempo.monitoring:4317", "tls": {"insecure": True}},
                                   "debug": {}}}}}


@pytest.fixture(scope="module")
def chart() -> Any:
    from tests.deploy.test_helm_chart import CHART

    with helm.Chart.load(str(CHART)) as loaded:
        yield loaded


def collector_objects(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objects if o["metadata"]["name"].endswith("-otel-collector")]


def test_the_collector_renders_validates_and_receives_what_pdserve_sends(chart: Any) -> None:
    objects = render(chart, COLLECTOR)
    collector = collector_objects(objects)
    assert sorted(o["kind"] for o in collector) == ["ConfigMap", "Deployment", "NetworkPolicy", "Service"]
    for resource in collector:
        for kube_version in KUBE_VERSIONS:
            validate(resource, kube_version)
    service = one(objects, "Service", "-otel-collector")
    [port] = service["spec"]["ports"]
    config = cluster_config_from(cluster_yaml(objects))  # the gateway loads it so; routers and workers get it
    assert config.tracing.endpoint == f"http://{service['metadata']['name']}.{NAMESPACE}.svc:{port['port']}"
    assert config.tracing.sample_ratio == 0.25
    template = one(objects, "Deployment", "-otel-collector")["spec"]["template"]
    pod = template["spec"]
    assert service["spec"]["selector"].items() <= template["metadata"]["labels"].items()
    collector_config = yaml.safe_load(one(objects, "ConfigMap", "-otel-collector")["data"]["config.yaml"])
    assert collector_config["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"] == f"0.0.0.0:{port['port']}"
    assert collector_config["service"]["pipelines"]["traces"] == {
        "receivers": ["otlp"], "processors": ["batch"], "exporters": ["debug", "otlp"]}
    assert collector_config["exporters"]["otlp"]["endpoint"] == "tempo.monitoring:4317"
    [container] = pod["containers"]
    assert container["args"] == ["--config=/etc/otelcol/config.yaml"]
    assert pod["volumes"][0]["configMap"]["name"] == f"{RELEASE}-pdserve-otel-collector"
    assert pod["securityContext"]["runAsNonRoot"] and container["securityContext"]["readOnlyRootFilesystem"]
    policy = one(objects, "NetworkPolicy", "-otel-collector")
    assert policy["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/instance"] == \
        RELEASE


def test_an_endpoint_of_your_own_needs_no_collector_and_by_default_nothing_traces(chart: Any) -> None:
    objects = render(chart, {"tracing": {"endpoint": "http://tempo.monitoring:4317", "sampleRatio": 0.1}})
    assert not collector_objects(objects)
    assert cluster_config_from(cluster_yaml(objects)).tracing.endpoint == "http://tempo.monitoring:4317"
    defaults = render(chart, {})
    assert not collector_objects(defaults)
    assert not cluster_config_from(cluster_yaml(defaults)).tracing.enabled


@pytest.mark.parametrize(("values", "message"), [
    ({"tracing": {"sampleRatio": 1.5}}, "at '/tracing/sampleRatio'"),
    ({"tracing": {"sampleRate": 0.5}}, "'sampleRate' not allowed"),
    ({"tracing": {"endpoint": "http://x:4317", "collector": {"enabled": True}}},
     "tracing.endpoint and tracing.collector.enabled exclude each other"),
])
def test_tracing_values_that_cannot_work_fail_with_a_message(chart: Any, values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmError, match=re.escape(message)):
        render(chart, values)


def test_helm_lint_is_clean_with_the_collector() -> None:
    from tests.deploy.test_helm_chart import CHART

    report = helm.lint(str(CHART), COLLECTOR, strict=True, namespace=NAMESPACE)
    assert not [m for m in report["messages"] if m["severity"] >= 2] and not report["errors"], report
