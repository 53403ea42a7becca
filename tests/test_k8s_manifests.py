"""docker/k8s/: schema-valid for a current Kubernetes, and consistent with the image and the server."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

kubernetes_validate = pytest.importorskip("kubernetes_validate")

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "docker" / "k8s"
MIN_VERSION = (
    1,
    33,
)  # "current": the oldest Kubernetes release the manifests must validate against


def manifests() -> dict[str, dict[str, Any]]:
    """{kind: resource} over every YAML document in docker/k8s (one resource per kind)."""
    docs = [d for f in sorted(K8S.glob("*.yaml")) for d in yaml.safe_load_all(f.read_text()) if d]
    by_kind = {d["kind"]: d for d in docs}
    assert len(by_kind) == len(docs), "one resource per kind is expected"
    return by_kind


def test_manifests_validate_strictly_against_current_kubernetes() -> None:
    version = kubernetes_validate.latest_version()
    assert tuple(int(x) for x in version.split(".")[:2]) >= MIN_VERSION
    res = manifests()
    assert {"Deployment", "Service", "HorizontalPodAutoscaler", "ConfigMap"} <= set(res)
    for doc in res.values():
        # strict: unknown fields (a typo'd probe or a misplaced key) are errors, not ignored.
        kubernetes_validate.validate(doc, version, strict=True)


def test_a_typo_fails_validation() -> None:
    """The validator really checks: a misspelt field in the Deployment is rejected."""
    dep = manifests()["Deployment"]
    dep["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, kubernetes_validate.latest_version(), strict=True)


def arg(args: list[str], name: str) -> str | None:
    for i, a in enumerate(args):
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
        if a == name:
            return args[i + 1]
    return None


def test_deployment_probes_drain_and_gpu() -> None:
    res = manifests()
    pod = res["Deployment"]["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    port = int(
        next(e["value"] for e in c["env"] if e["name"] == "PORT")
    )  # the entrypoint's listen port
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"http": port}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    # SIGTERM arrives after preStop; the server then drains for --drain-timeout; the kubelet kills after the
    # grace period, which must cover both.
    pre_stop = c["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    drain = float(arg(c["args"], "--drain-timeout") or 30)
    assert pod["terminationGracePeriodSeconds"] >= float(pre_stop[1]) + drain + 5
    # The image's non-root user (USER in the Dockerfiles), so runAsNonRoot holds.
    uid = pod["securityContext"]["runAsUser"]
    for dockerfile in ("Dockerfile.cpu", "Dockerfile.cuda"):
        user = re.search(r"^USER (\d+)", (REPO / "docker" / dockerfile).read_text(), re.M)
        assert user and int(user.group(1)) == uid, dockerfile
    assert pod["securityContext"]["runAsNonRoot"] is True
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert (
        "/cache" in mounts
    )  # HF_HOME in the image: writable although the root filesystem is read-only


def test_service_and_autoscaler_point_at_the_deployment_and_a_real_metric() -> None:
    from server.metrics import ServerMetrics

    res = manifests()
    dep, svc, hpa = res["Deployment"], res["Service"], res["HorizontalPodAutoscaler"]
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert svc["spec"]["ports"][0]["targetPort"] == "http"
    ref = hpa["spec"]["scaleTargetRef"]
    assert (ref["kind"], ref["name"]) == ("Deployment", dep["metadata"]["name"])
    (metric,) = hpa["spec"]["metrics"]
    name = metric["pods"]["metric"]["name"]
    assert name == "moe_offload_requests_waiting"
    exported = {m.name for m in ServerMetrics().registry.collect()}
    assert name in exported, "the autoscaling metric is not exported by the server"
    rules = yaml.safe_load(res["ConfigMap"]["data"]["config.yaml"])["rules"]
    assert any(r["seriesQuery"].startswith(name + "{") and r["name"]["as"] == name for r in rules)
