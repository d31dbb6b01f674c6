"""The Helm chart (deploy/helm/hybridmon) through a real `helm` (issue 32): `helm lint --strict`,
`helm template` validated by kubernetes-validate, and the rendered objects equal to the kustomize
manifests they are generated from, with the namespace, image and switches a chart user sets."""
from __future__ import annotations

import subprocess

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import SchemaNotFoundError

from deploy.helm import generate_chart
from hybridmon import __version__
from tests.integration.test_deploy import CRD_KINDS, KUBERNETES_VERSIONS, PLACEHOLDER_IMAGE, manifests
from tests.support.helm import HELM_VERSION, helm_binary

CHART = generate_chart.CHART_DIR


def helm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(helm_binary()), *args], capture_output=True, text=True, timeout=120)


def rendered(*settings: str, namespace: str = "gpu-monitoring") -> dict[str, dict]:
    """kind -> the one object of that kind `helm template` renders."""
    result = helm("template", "hybridmon", str(CHART), "--namespace", namespace,
                  *[part for setting in settings for part in ("--set", setting)])
    assert result.returncode == 0, result.stderr
    objects = {}
    for document in yaml.safe_load_all(result.stdout):
        if document:
            assert document["kind"] not in objects, f"two {document['kind']} objects"
            objects[document["kind"]] = document
    return objects


def test_the_helm_binary_is_the_checked_release():
    result = helm("version", "--template", "{{ .Version }}")
    assert (result.returncode, result.stdout) == (0, HELM_VERSION), result.stderr


def test_chart_templates_are_generated_from_the_current_manifests(capsys):
    assert generate_chart.main(["--check"]) == 0, capsys.readouterr().out[-3000:]


def test_chart_passes_helm_lint_strict_and_carries_the_agents_version():
    result = helm("lint", "--strict", str(CHART))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 chart(s) linted, 0 chart(s) failed" in result.stdout
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["version"] == chart["appVersion"] == __version__


def test_rendered_chart_passes_kubernetes_validate_strict():
    objects = rendered()
    assert set(objects) == {"DaemonSet", "Service", "ServiceMonitor", "PrometheusRule"}
    for version in KUBERNETES_VERSIONS:
        for kind, resource in objects.items():
            if kind in CRD_KINDS:  # the validator knows built-in kinds only
                with pytest.raises(SchemaNotFoundError):
                    kubernetes_validate.validate(resource, version, strict=True)
            else:
                kubernetes_validate.validate(resource, version, strict=True)


def test_rendered_chart_is_the_kustomize_manifests_with_the_users_namespace_image_and_labels():
    objects = rendered("image.repository=ghcr.io/acme/hybridmon", "image.tag=1.2.3",
                       "serviceMonitor.labels.release=kps", "prometheusRule.labels.release=kps")
    expected = manifests()
    for kind in ("DaemonSet", "Service", "ServiceMonitor", "PrometheusRule"):
        want = yaml.safe_load(yaml.safe_dump(expected[kind]))
        want["metadata"]["namespace"] = "gpu-monitoring"
        if kind in CRD_KINDS:
            want["metadata"]["labels"]["release"] = "kps"
        if kind == "DaemonSet":
            (container,) = want["spec"]["template"]["spec"]["containers"]
            container["image"] = "ghcr.io/acme/hybridmon:1.2.3"
        # PrometheusRule included: its annotations' {{ $labels... }} come out of Helm unchanged.
        assert objects[kind] == want, kind


def test_default_image_is_the_placeholder_at_the_charts_app_version():
    (container,) = rendered()["DaemonSet"]["spec"]["template"]["spec"]["containers"]
    assert container["image"] == f"{PLACEHOLDER_IMAGE}:{__version__}"


def test_prometheus_operator_objects_can_be_switched_off():
    objects = rendered("serviceMonitor.enabled=false", "prometheusRule.enabled=false")
    assert set(objects) == {"DaemonSet", "Service"}


def test_a_manifest_the_generator_does_not_understand_is_an_error(tmp_path):
    for name in generate_chart.MANIFESTS:
        (tmp_path / name).write_text((generate_chart.KUBERNETES_DIR / name).read_text())
    daemonset = tmp_path / "daemonset.yaml"
    daemonset.write_text(daemonset.read_text().replace("image: hybridmon:", "image: other:"))
    with pytest.raises(ValueError, match="daemonset.yaml: expected one match"):
        generate_chart.render(tmp_path)
