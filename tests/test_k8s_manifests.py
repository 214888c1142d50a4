"""deploy/k8s/: every manifest valid against the Kubernetes OpenAPI schema (kubernetes-validate,
strict: unknown fields are errors), and the pieces agree with each other and with tokenmill."""
from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tokenmill.cli import build_parser

K8S = Path(__file__).parent.parent / "deploy" / "k8s"
KUBERNETES_VERSION = "1.30"


def manifests() -> dict[str, dict]:
    docs = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            docs[doc["kind"]] = doc
    return docs


@pytest.mark.parametrize("path", sorted(K8S.glob("*.yaml")), ids=lambda p: p.name)
def test_manifest_is_valid_kubernetes(path):
    for doc in yaml.safe_load_all(path.read_text()):
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_a_broken_manifest_fails_the_validator():
    hpa = manifests()["HorizontalPodAutoscaler"]
    hpa["spec"]["metrics"][0]["pods"]["target"]["averageValeu"] = "2"      # typo: unknown field
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(hpa, KUBERNETES_VERSION, strict=True)


def test_pieces_agree():
    m = manifests()
    deployment, service, hpa, adapter = (m["Deployment"], m["Service"], m["HorizontalPodAutoscaler"], m["ConfigMap"])
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    # the container's command line is a valid `tokenmill` invocation listening where the probes look
    args = build_parser().parse_args(container["args"])
    assert args.host == "0.0.0.0" and args.port == container["ports"][0]["containerPort"]
    assert deployment["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == str(args.port)
    assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > args.shutdown_timeout
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert service["spec"]["ports"][0]["targetPort"] == container["ports"][0]["name"]
    assert hpa["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    # the HPA's metric is one the adapter serves, renamed from the gauge tokenmill exports
    rules = yaml.safe_load(adapter["data"]["config.yaml"])["rules"]
    served = {r["name"]["as"]: r["name"]["matches"] for r in rules}
    metric = hpa["spec"]["metrics"][0]["pods"]["metric"]["name"]
    assert served[metric] == "tokenmill:num_requests_waiting"


def test_exported_gauges_exist():
    from tokenmill.metrics import EngineMetrics
    text = EngineMetrics("m", log_interval=None).render().decode()
    for rule in yaml.safe_load(manifests()["ConfigMap"]["data"]["config.yaml"])["rules"]:
        assert f"\n{rule['name']['matches']}{{" in text
