"""deploy/: every file is checked by the tool that will read it, offline.

systemd-analyze (unit), kubernetes-validate (built-in Kubernetes kinds, strict), promtool (the
Prometheus config and the rules inside the PrometheusRule), amtool and a real Alertmanager (routing
and inhibition). kubernetes-validate has no schema for the Prometheus Operator's CRDs, so the
ServiceMonitor and PrometheusRule are checked by what they must agree with: the Service, the
DaemonSet's pods and the rule file.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import jsonpatch
import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import SchemaNotFoundError, ValidationError

from hybridmon import __version__
from hybridmon.agent.config import AgentConfig, load_config, parse_listen, tomllib
from deploy.kubernetes import generate_prometheusrule
from hybridmon.exporters.numa import parse_numa_maps
from tests.support.agent_helpers import REPO
from tests.support.alertmanager_helpers import Alertmanager, WebhookReceiver
from tests.support.live_stack import require_binary


def require_root() -> None:
    """Switching to another user needs root: CI runs as root, so there a non-root run fails."""
    if os.geteuid() != 0:
        if os.environ.get("CI") == "true":
            pytest.fail("CI runs as root; this check needs root to switch users")
        pytest.skip("needs root to run a process as another user")


DEPLOY = REPO / "deploy"
UNIT = DEPLOY / "systemd" / "hybridmon.service"
KUBERNETES = DEPLOY / "kubernetes"
NO_PTRACE = DEPLOY / "kubernetes-variants" / "no-ptrace"
WEB_CONFIG = DEPLOY / "kubernetes-variants" / "web-config"
ALERTMANAGER_CONFIG = DEPLOY / "alertmanager" / "alertmanager.yml"
PROMETHEUS_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
RULES_FILE = REPO / "rules" / "hybridmon.rules.yml"
# The oldest Kubernetes the manifests claim to work on, and the newest the validator knows.
KUBERNETES_VERSIONS = ("1.30", kubernetes_validate.utils.latest_version())
CRD_KINDS = {"ServiceMonitor", "PrometheusRule"}


def unit_settings(path: Path = UNIT) -> dict[str, list[str]]:
    """[Service] and friends as {key: [values in order]}; systemd allows a key more than once."""
    settings: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        if line and not line.startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            settings.setdefault(key.strip(), []).append(value.strip())
    return settings


def manifests() -> dict[str, dict]:
    """kind -> the one resource of that kind under deploy/kubernetes/."""
    resources = {}
    for path in sorted(KUBERNETES.glob("*.yaml")):
        for resource in yaml.safe_load_all(path.read_text()):
            assert resource["kind"] not in resources, f"two {resource['kind']} resources"
            resources[resource["kind"]] = resource
    return resources


def agent_container() -> dict:
    (container,) = manifests()["DaemonSet"]["spec"]["template"]["spec"]["containers"]
    return container


# --- systemd ----------------------------------------------------------------------------------

def test_unit_passes_systemd_analyze_verify_and_security(tmp_path):
    analyze = require_binary("systemd-analyze", "systemd")
    # verify insists that ExecStart's binary exists: point it at this checkout's entry point.
    installed = Path(sys.executable).with_name("hybridmon")
    assert installed.is_file(), "pip install -e . puts a hybridmon entry point beside the venv's python"
    unit = tmp_path / "hybridmon.service"
    unit.write_text(UNIT.read_text().replace("/opt/hybridmon/bin/hybridmon", str(installed)))
    assert unit.read_text() != UNIT.read_text()
    verify = subprocess.run([analyze, "verify", "--man=no", str(unit)], capture_output=True, text=True, timeout=30)
    # Unknown keys and unparsable values are only warnings (exit 0): any output is a failure.
    assert (verify.returncode, verify.stdout + verify.stderr) == (0, "")
    # Exposure 0 (locked down) to 10 (unprotected); 2.5 leaves room only for what NVML needs.
    security = subprocess.run([analyze, "security", "--offline=true", "--threshold=25", str(unit)],
                              capture_output=True, text=True, timeout=30)
    assert security.returncode == 0, security.stdout[-1500:] + security.stderr


def test_unit_with_https_turned_on_passes_systemd_analyze_verify(tmp_path):
    """The commented --web-config-file lines, uncommented as deploy/README.md says."""
    analyze = require_binary("systemd-analyze", "systemd")
    installed = Path(sys.executable).with_name("hybridmon")
    text, enabled = re.subn(r"^#((?:LoadCredential=(?:web-config\.yml|tls\.)|Environment=HYBRIDMON_WEB_CONFIG_FILE=).*)$",
                            r"\1", UNIT.read_text(), flags=re.M)
    assert enabled == 4
    unit = tmp_path / "hybridmon.service"
    unit.write_text(text.replace("/opt/hybridmon/bin/hybridmon", str(installed)))
    verify = subprocess.run([analyze, "verify", "--man=no", str(unit)], capture_output=True, text=True, timeout=30)
    assert (verify.returncode, verify.stdout + verify.stderr) == (0, "")
    settings = unit_settings(unit)
    credentials = {value.split(":")[0] for value in settings["LoadCredential"]}
    assert "HYBRIDMON_WEB_CONFIG_FILE=%d/web-config.yml" in settings["Environment"] and "web-config.yml" in credentials


def test_unit_keeps_what_the_agent_needs_and_nothing_more():
    settings = unit_settings()
    single = {key: values[-1] for key, values in settings.items()}
    assert single["CapabilityBoundingSet"] == single["AmbientCapabilities"] == "CAP_SYS_PTRACE"
    for key in ("DynamicUser", "NoNewPrivileges", "ProtectHome", "PrivateTmp", "ProtectKernelTunables",
                "ProtectControlGroups", "RestrictSUIDSGID", "LockPersonality"):
        assert single[key] == "yes", key
    assert single["ProtectSystem"] == "strict"
    assert single["StateDirectory"] == "hybridmon"  # -> $STATE_DIRECTORY, the agent's state_dir
    assert set(single["RestrictAddressFamilies"].split()) == {"AF_UNIX", "AF_INET", "AF_INET6", "AF_NETLINK"}
    assert single["DevicePolicy"] == "closed" and "char-nvidia* rw" in settings["DeviceAllow"]
    assert settings["SystemCallFilter"] == ["@system-service", "~@privileged"]  # keeps set_mempolicy
    assert {"MemoryMax", "LimitMEMLOCK", "TasksMax"} <= settings.keys()
    # Each would hide what the agent reads: /dev/nvidia*, other users' processes, host /proc files.
    assert single.get("PrivateDevices", "no") == "no" and single.get("PrivateUsers", "no") == "no"
    assert single["ProtectProc"] == "default" and single["ProcSubset"] == "all"


def test_unit_fd_limit_and_stop_timeout_cover_the_http_servers_bounds():
    from hybridmon.agent.api.httpserver import MAX_CONNECTIONS, SHUTDOWN_BACKSTOP_SECONDS, ServerLimits, connection_cap

    single = {key: values[-1] for key, values in unit_settings().items()}
    # The whole connection cap fits under the unit's fd limit, beside the agent's own files.
    assert connection_cap(int(single["LimitNOFILE"])) == MAX_CONNECTIONS
    # SIGTERM: the server's bounded shutdown, then collectors abandoned after a few seconds.
    stop_seconds = float(single["TimeoutStopSec"].removesuffix("s"))
    assert stop_seconds >= ServerLimits().graceful_shutdown_seconds + SHUTDOWN_BACKSTOP_SECONDS + 10


def test_every_service_setting_is_explained_by_a_comment():
    text = UNIT.read_text()
    lines = text[text.index("[Service]"):text.index("[Install]")].splitlines()
    unexplained = []
    for number, line in enumerate(lines):
        if not line or line.startswith(("#", "[")):
            continue
        above = number - 1
        while above >= 0 and lines[above] and not lines[above].startswith(("#", "[")):
            above -= 1  # a run of settings shares the comment above it
        if above < 0 or not lines[above].startswith("#"):
            unexplained.append(line)
    assert unexplained == []


def test_the_units_capability_is_what_reading_numa_maps_needs():
    """As an unprivileged user another user's numa_maps is unreadable; with the unit's capability
    set (and nothing else) it reads, and the agent's parser finds the process's pages in it."""
    require_root()
    setpriv = require_binary("setpriv", "util-linux")
    capabilities = ",".join("+" + c.lower().removeprefix("cap_")
                            for c in unit_settings()["AmbientCapabilities"][-1].split())
    as_nobody = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", "--no-new-privs"]
    with_capabilities = [f"--inh-caps={capabilities}", f"--ambient-caps={capabilities}",
                         f"--bounding-set=-all,{capabilities}"]
    target = subprocess.Popen(["sleep", "30"])  # owned by root, not by the reader
    try:
        read = ["cat", f"/proc/{target.pid}/numa_maps"]
        denied = subprocess.run([*as_nobody, *read], capture_output=True, text=True, timeout=30)
        allowed = subprocess.run([*as_nobody, *with_capabilities, *read], capture_output=True, text=True,
                                 timeout=30)
    finally:
        target.kill()
        target.wait()
    assert denied.returncode != 0 and "Permission denied" in denied.stderr
    assert allowed.returncode == 0, allowed.stderr
    assert sum(parse_numa_maps(allowed.stdout).values()) > 0  # resident bytes of sleep, all nodes


def test_example_config_is_valid_and_leaves_the_state_dir_to_systemd():
    settings = unit_settings()
    config_path = re.search(r"--config (\S+)", settings["ExecStart"][-1]).group(1)
    assert config_path == f"/etc/{settings['ConfigurationDirectory'][-1]}/hybridmon.toml"
    config = load_config(DEPLOY / "systemd" / "hybridmon.toml", environ={})
    assert config.resolved_state_dir({"STATE_DIRECTORY": "/var/lib/hybridmon"}) == Path("/var/lib/hybridmon")


# --- Kubernetes -------------------------------------------------------------------------------

@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_builtin_manifests_validate_strictly(version):
    resources = manifests()
    assert {"DaemonSet", "Service", "Kustomization"} | CRD_KINDS == resources.keys()
    for kind, resource in resources.items():
        if kind in CRD_KINDS or kind == "Kustomization":
            # The validator knows built-in kinds only; these are checked by the tests below.
            with pytest.raises(SchemaNotFoundError):
                kubernetes_validate.validate(resource, version, strict=True)
        else:
            kubernetes_validate.validate(resource, version, strict=True)
    misspelled = yaml.safe_load(yaml.safe_dump(resources["DaemonSet"]))
    misspelled["spec"]["template"]["spec"]["hostPid"] = True
    with pytest.raises(ValidationError, match="hostPid"):
        kubernetes_validate.validate(misspelled, version, strict=True)


def test_kustomization_lists_every_manifest_and_the_agents_version():
    kustomization = manifests()["Kustomization"]
    on_disk = {p.name for p in KUBERNETES.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(kustomization["resources"]) == sorted(on_disk)
    (image,) = kustomization["images"]
    assert agent_container()["image"] == f"{image['name']}:{__version__}" and image["newTag"] == __version__


# The image's placeholder registry in kustomization.yaml (RFC 2606 reserves example.com).
PLACEHOLDER_IMAGE = "registry.example.com/hybridmon"


def test_namespace_and_image_registry_are_explicit_in_the_kustomization():
    resources = manifests()
    kustomization = resources.pop("Kustomization")
    # Every manifest names the kustomization's namespace, so `kubectl apply -f` of one file lands
    # where `kubectl apply -k` puts it; a Namespace object is not among them (`delete -k` would
    # delete a namespace shared with other things).
    assert {r["metadata"]["namespace"] for r in resources.values()} == {kustomization["namespace"]} == {"monitoring"}
    assert "Namespace" not in resources
    (image,) = kustomization["images"]
    # A registry host, by the rule docker applies to the first path component (a dot, a colon or
    # "localhost"); "hybridmon" alone would be docker.io/library/hybridmon.
    registry = image["newName"].split("/")[0]
    assert "." in registry or ":" in registry, image["newName"]
    assert image["newName"] == PLACEHOLDER_IMAGE
    comment = (KUBERNETES / "kustomization.yaml").read_text().split("apiVersion:")[0]
    readme = (DEPLOY / "README.md").read_text()
    for text in (comment, readme):
        assert "kustomize edit set namespace" in text and "kustomize edit set image hybridmon=" in text
    assert "docker build -f deploy/container/Dockerfile" in readme and "docker push" in readme


def kubectl_kustomize(directory: Path) -> dict[str, dict]:
    """kind -> resource, as `kubectl kustomize` (kustomize inside kubectl) builds `directory`."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        # Not a Debian package, so scripts/test cannot install it; the CI image ships it
        # (/usr/bin/kubectl), so there a missing one is a lost install step, not a skip.
        message = "kubectl is not installed: the kustomize build itself cannot be checked"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    built = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=60)
    assert built.returncode == 0, built.stderr
    return {resource["kind"]: resource for resource in yaml.safe_load_all(built.stdout)}


def built_namespaces_and_image(resources: dict[str, dict]) -> tuple[set[str], str]:
    (container,) = resources["DaemonSet"]["spec"]["template"]["spec"]["containers"]
    return {r["metadata"]["namespace"] for r in resources.values()}, container["image"]


@pytest.mark.parametrize("how", ["edit", "overlay"])
def test_namespace_and_image_are_overridable(tmp_path, how):
    """The two ways deploy/README.md gives: `kustomize edit set ...` in a copy of the directory
    (which rewrites kustomization.yaml's `namespace:` and the `hybridmon` images entry, as done
    here by hand: kubectl has no `edit`), or an overlay of one's own."""
    assert built_namespaces_and_image(kubectl_kustomize(KUBERNETES)) == (
        {"monitoring"}, f"{PLACEHOLDER_IMAGE}:{__version__}")
    if how == "edit":
        copy = tmp_path / "kubernetes"
        shutil.copytree(KUBERNETES, copy, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
        kustomization = yaml.safe_load((copy / "kustomization.yaml").read_text())
        kustomization["namespace"] = "gpu-observability"
        kustomization["images"] = [{"name": "hybridmon", "newName": "ghcr.io/acme/hybridmon", "newTag": "9.9.9"}]
        (copy / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
        directory = copy
    else:
        # An overlay matches the image as the base left it: the placeholder's name.
        directory = tmp_path / "overlay"
        directory.mkdir()
        (directory / "kustomization.yaml").write_text(yaml.safe_dump({
            "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
            "resources": [os.path.relpath(KUBERNETES, directory)],  # kustomize refuses absolute paths
            "namespace": "gpu-observability",
            "images": [{"name": PLACEHOLDER_IMAGE, "newName": "ghcr.io/acme/hybridmon", "newTag": "9.9.9"}],
        }))
    built = kubectl_kustomize(directory)
    assert built.keys() == {"DaemonSet", "Service"} | CRD_KINDS
    assert built_namespaces_and_image(built) == ({"gpu-observability"}, "ghcr.io/acme/hybridmon:9.9.9")
    for kind in ("DaemonSet", "Service"):
        kubernetes_validate.validate(built[kind], KUBERNETES_VERSIONS[-1], strict=True)


def test_daemonset_reads_the_host_read_only_with_one_capability():
    pod = manifests()["DaemonSet"]["spec"]["template"]["spec"]
    container = agent_container()
    environment = {e["name"]: e["value"] for e in container["env"]}
    config = load_config(environ=environment)  # the env vars are valid configuration keys
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    host_paths = {v["name"]: v.get("hostPath", {}).get("path") for v in pod["volumes"]}
    for root, host_root in ((config.paths.procfs, "/proc"), (config.paths.sysfs, "/sys")):
        assert mounts[root]["readOnly"] is True and host_paths[mounts[root]["name"]] == host_root
    assert pod["hostPID"] is True and environment["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert "nvidia.com/gpu" not in container["resources"].get("limits", {})  # must not take a GPU
    host, port = parse_listen(config.listen)
    (metrics_port,) = container["ports"]
    assert (host, port) == ("0.0.0.0", metrics_port["containerPort"])
    # liveness restarts a stalled agent (/healthz answers 503); readiness keeps it a scrape target
    # meanwhile, so the Prometheus side still sees it lag
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": metrics_port["name"]}
    assert container["readinessProbe"]["httpGet"] == {"path": "/metrics", "port": metrics_port["name"]}
    security = container["securityContext"]
    assert security["capabilities"]["drop"] == ["ALL"]
    unit_capabilities = unit_settings()["CapabilityBoundingSet"][-1].split()
    assert ["CAP_" + c for c in security["capabilities"]["add"]] == unit_capabilities
    assert security["allowPrivilegeEscalation"] is False and security["readOnlyRootFilesystem"] is True
    assert security["privileged"] is False
    writable = {m["mountPath"] for m in container["volumeMounts"] if not m.get("readOnly")}
    assert str(config.resolved_state_dir({})) in writable


# --- Kubernetes without ptrace -------------------------------------------------------------------

def kustomize_build(directory: Path) -> dict[str, dict]:
    """kind -> resource of a variant, as `kubectl kustomize` builds it (no kubectl here: the suite
    needs none). Only what the variants use is supported, and anything else fails: the base
    directory as the one resource, RFC 6902 patches aimed by kind and name."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    assert kustomization.keys() <= {"apiVersion", "kind", "resources", "patches"}, kustomization.keys()
    assert [(directory / r).resolve() for r in kustomization["resources"]] == [KUBERNETES.resolve()]
    resources = {kind: r for kind, r in manifests().items() if kind != "Kustomization"}
    for patch in kustomization["patches"]:
        target = patch["target"]
        assert target.keys() == {"kind", "name"} and resources[target["kind"]]["metadata"]["name"] == target["name"]
        resources[target["kind"]] = jsonpatch.apply_patch(resources[target["kind"]], yaml.safe_load(patch["patch"]))
    return resources


@pytest.mark.parametrize("variant", [NO_PTRACE, WEB_CONFIG], ids=lambda path: path.name)
@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_variants_validate_strictly(variant, version):
    resources = kustomize_build(variant)
    assert resources.keys() == {"DaemonSet", "Service"} | CRD_KINDS
    for kind in ("DaemonSet", "Service"):
        kubernetes_validate.validate(resources[kind], version, strict=True)


def test_no_ptrace_variant_is_the_daemonset_without_root_or_any_capability():
    base, variant = manifests()["DaemonSet"], kustomize_build(NO_PTRACE)["DaemonSet"]
    (container,) = variant["spec"]["template"]["spec"]["containers"]
    security = container["securityContext"]
    assert security["runAsNonRoot"] is True and security["runAsUser"] == security["runAsGroup"] > 0
    assert security["capabilities"] == {"drop": ["ALL"]}  # nothing added back: no SYS_PTRACE
    assert security["allowPrivilegeEscalation"] is False and security["privileged"] is False
    assert security["readOnlyRootFilesystem"] is True
    # Everything else is the default DaemonSet's: host PIDs (NVML reports them), /proc, /sys, probes.
    variant["spec"]["template"]["spec"]["containers"][0]["securityContext"] = agent_container()["securityContext"]
    assert variant == base


def test_web_config_variant_mounts_what_it_names_and_is_scraped_over_https_with_basic_auth():
    """The Secret's files reach the path the agent is told, rotated Secrets reach the files (no
    subPath), the liveness probe reads the same mount, and the ServiceMonitor verifies against the
    CA the agent's certificate comes with. The probe itself runs against a real agent in
    tests/integration/test_web_config_live.py."""
    built = kustomize_build(WEB_CONFIG)
    (container,) = built["DaemonSet"]["spec"]["template"]["spec"]["containers"]
    web_config = Path({e["name"]: e.get("value") for e in container["env"]}["HYBRIDMON_WEB_CONFIG_FILE"])
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "web-config"]
    assert Path(mount["mountPath"]) == web_config.parent and mount["readOnly"] and "subPath" not in mount
    (volume,) = [v for v in built["DaemonSet"]["spec"]["template"]["spec"]["volumes"] if v["name"] == "web-config"]
    files = {item["path"]: source["secret"]["name"] for source in volume["projected"]["sources"]
             for item in source["secret"]["items"]}
    assert files == {"web-config.yml": "hybridmon-web-config", "probe-password": "hybridmon-web-config",
                     "tls.crt": "hybridmon-tls", "tls.key": "hybridmon-tls", "ca.crt": "hybridmon-tls"}
    assert web_config.name in files
    probe = container["livenessProbe"]["exec"]["command"][-1]
    assert f'"{mount["mountPath"]}/"' in probe and "/healthz" in probe
    assert container["readinessProbe"] == {"tcpSocket": {"port": "metrics"}, "periodSeconds": 10, "timeoutSeconds": 5}
    (endpoint,) = built["ServiceMonitor"]["spec"]["endpoints"]
    assert endpoint["scheme"] == "https" and endpoint["tlsConfig"]["ca"]["secret"] == {"name": "hybridmon-tls", "key": "ca.crt"}
    assert endpoint["basicAuth"]["password"] == {"name": "hybridmon-scrape-auth", "key": "password"}
    # Everything else is the default DaemonSet's.
    base = manifests()["DaemonSet"]
    assert built["DaemonSet"]["spec"]["template"]["spec"]["hostPID"] == base["spec"]["template"]["spec"]["hostPID"]
    assert container["securityContext"] == agent_container()["securityContext"]


# The agent's process collectors on this host's /proc, watching the pids given, as the user the
# calling test chose: which series they export, what they log, and which ptrace-gated files of
# the processes the user could open.
_COLLECT_AS_USER = """
import json, logging, os, sys
from hybridmon.exporters.sources import LiveSource
from hybridmon.exporters.numa import ProcessNumaCollector
from hybridmon.exporters.process import ProcessCollector

log = []
handler = logging.Handler()
handler.emit = lambda record: log.append(record.getMessage())
logging.getLogger().addHandler(handler)
pids = [int(pid) for pid in sys.argv[1:]]
processes = ProcessCollector(LiveSource(), pids=pids)
# the fixture's two NUMA nodes: on a one-node host the collector reads no process file at all;
# each process as if on the fixture's GPU 0 (its PCI device on node 0)
placement = ProcessNumaCollector(LiveSource(), sysfs="tests/fixtures/host-2node/sys", watched=processes.watched,
                                 gpu_buses=lambda: {pid: ("0000:17:00.0",) for pid in pids})
series = set()
for _ in range(2):
    for collector in (processes, placement):
        series |= {(s.spec.name, s.label_values[0]) for s in collector.collect()}
opened = []
for pid in pids:
    for path in (f"/proc/{pid}/environ", f"/proc/{pid}/numa_maps", f"/proc/{pid}/root/etc"):
        try:
            open(path).close() if "root" not in path else os.listdir(path)
            opened.append(path)
        except PermissionError:
            pass
print(json.dumps({"uid": os.getuid(), "series": sorted(series), "log": log, "opened": opened}))
"""


def collect_as(prefix: list[str], pids: list[int]) -> dict:
    import json

    environment = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(REPO), "PYTHONDONTWRITEBYTECODE": "1"}
    done = subprocess.run([*prefix, sys.executable, "-c", _COLLECT_AS_USER, *map(str, pids)], cwd=REPO,
                          env=environment, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def test_without_ptrace_the_agent_sees_every_process_but_no_numa_placement_and_says_so_once():
    """The no-ptrace variant's uid with no capability, on the real kernel, against two root
    processes: the process series stay (stat, status, cmdline, limits are world-readable), NUMA
    placement is absent (not zero), one log line says why for both, and environ, numa_maps and
    root are closed to it. As root with every capability (the default DaemonSet's reach) the
    same run reads them all."""
    require_root()
    setpriv = require_binary("setpriv", "util-linux")
    security = kustomize_build(NO_PTRACE)["DaemonSet"]["spec"]["template"]["spec"]["containers"][0]["securityContext"]
    as_variant = [setpriv, f"--reuid={security['runAsUser']}", f"--regid={security['runAsGroup']}",
                  "--clear-groups", "--no-new-privs", "--inh-caps=-all", "--bounding-set=-all"]
    targets = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]  # owned by root
    try:
        pids = [target.pid for target in targets]
        unprivileged = collect_as(as_variant, pids)
        privileged = collect_as([], pids)
    finally:
        for target in targets:
            target.kill()
            target.wait()
    assert unprivileged["uid"] == security["runAsUser"] and privileged["uid"] == 0
    for pid in map(str, pids):
        for metric in ("hybridmon_process_resident_bytes", "hybridmon_process_major_faults_total",
                       "hybridmon_process_info", "hybridmon_process_cpu_seconds_off_gpu_node_total"):
            assert [metric, pid] in unprivileged["series"], metric
        assert ["hybridmon_process_resident_off_gpu_node_bytes", pid] in privileged["series"]
    assert not [s for s in unprivileged["series"] if s[0] == "hybridmon_process_resident_off_gpu_node_bytes"]
    about_numa_maps = [line for line in unprivileged["log"] if "numa_maps" in line]
    assert len(about_numa_maps) == 1 and "CAP_SYS_PTRACE" in about_numa_maps[0], unprivileged["log"]
    assert unprivileged["opened"] == [] and len(privileged["opened"]) == 3 * len(pids)


def dockerfile_stages() -> list[dict]:
    """The Dockerfile's stages, in order: {"from", "digest", "name", "instructions": [(keyword, text)]}
    ("from" without its "@sha256:..." digest), continuation lines joined and comments dropped (the
    subset of the syntax the file uses)."""
    text = re.sub(r"\\\n\s*", " ", (DEPLOY / "container" / "Dockerfile").read_text())
    stages, arguments = [], {}
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        keyword, _, rest = line.strip().partition(" ")
        if keyword == "ARG" and not stages:
            name, _, default = rest.partition("=")
            arguments[name] = default
        elif keyword == "FROM":
            image, _, name = rest.partition(" AS ")
            image = re.sub(r"\$\{(\w+)\}", lambda m: arguments[m.group(1)], image)
            image, _, digest = image.partition("@")
            stages.append({"from": image, "digest": digest or None, "name": name or None, "instructions": []})
        else:
            stages[-1]["instructions"].append((keyword, rest))
    return stages


def test_container_image_copies_what_the_package_is_built_from():
    *_builders, final = dockerfile_stages()
    copied = {source for keyword, rest in final["instructions"] if keyword == "COPY"
              and not rest.startswith("--from=") for source in rest.split()[:-1]}
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    packages = set(project["tool"]["setuptools"]["package-dir"].values())  # hybridmon, agent, rules...
    assert copied == {"pyproject.toml", project["project"]["readme"]} | packages
    assert all((REPO / source).exists() for source in copied)


def test_container_image_ships_the_prebuilt_benchmark_and_the_daemonset_runs_it():
    """Issue 13: the image had no way to run `hybridmon bench` (no nvcc in it). Stage 1 compiles
    offload_bench.cu with the CUDA toolkit's image through agent/bench/build.py; the final image
    copies the binary and names it in bench.binary, as the DaemonSet does."""
    builder, final = dockerfile_stages()
    assert builder["name"] == "bench" and re.fullmatch(r"nvidia/cuda:12\.\d+\.\d+-devel-ubuntu\d+\.04", builder["from"])
    steps = dict(builder["instructions"])
    assert steps["COPY"].split() == ["agent/bench/build.py", "agent/bench/offload_bench.cu", "/src/"]
    assert all((REPO / source).is_file() for source in steps["COPY"].split()[:-1])
    assert any(rest.startswith("python3 /src/build.py --cache-dir /cache")
               for keyword, rest in builder["instructions"] if keyword == "RUN")
    (binary_copy,) = [rest.split() for keyword, rest in final["instructions"] if rest.startswith("--from=")]
    assert binary_copy[0] == "--from=bench" and binary_copy[1] == binary_copy[2]
    image_env = dict(rest.split("=", 1) for keyword, rest in final["instructions"] if keyword == "ENV")
    pod_env = {e["name"]: e["value"] for e in agent_container()["env"]}
    assert image_env["HYBRIDMON_BENCH__BINARY"] == pod_env["HYBRIDMON_BENCH__BINARY"] == binary_copy[2]
    # A configuration key, so `hybridmon bench` in the pod uses it rather than looking for nvcc.
    assert load_config(environ=pod_env).bench.binary == binary_copy[2]
    compute = set(pod_env["NVIDIA_DRIVER_CAPABILITIES"].split(","))
    assert "compute" in compute  # libcuda.so.1 for the benchmark, mounted by the NVIDIA runtime


def test_container_image_bases_are_pinned_by_digest_and_it_exposes_the_default_port():
    """Issue 32: unpinned bases rebuilt the same commit on whatever the tags pointed to that day,
    and the image declared no port. Every FROM names a tag and its sha256 digest; EXPOSE is the
    agent's default port, the one the image's CMD listens on and the DaemonSet's containerPort."""
    stages = dockerfile_stages()
    for stage in stages:
        assert re.fullmatch(r"[\w./-]+:[\w.-]+", stage["from"]), stage  # a tag, kept for readers and Renovate
        assert re.fullmatch(r"sha256:[0-9a-f]{64}", stage["digest"] or ""), stage
    final = stages[-1]
    exposed = [rest for keyword, rest in final["instructions"] if keyword == "EXPOSE"]
    _host, default_port = parse_listen(AgentConfig().listen)
    assert exposed == [str(default_port)]
    (command,) = [json.loads(rest) for keyword, rest in final["instructions"] if keyword == "CMD"]
    assert parse_listen(command[command.index("--listen") + 1])[1] == default_port
    assert default_port in {port["containerPort"] for port in agent_container()["ports"]}


def test_service_and_servicemonitor_reach_the_agent_pods():
    resources = manifests()
    pod_labels = resources["DaemonSet"]["spec"]["template"]["metadata"]["labels"]
    service, monitor = resources["Service"], resources["ServiceMonitor"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    port_names = {p["name"] for p in service["spec"]["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= {p["name"] for p in agent_container()["ports"]}
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["metadata"]["namespace"] == service["metadata"]["namespace"]  # no namespaceSelector
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in port_names and endpoint["path"] == "/metrics"
    (job,) = yaml.safe_load(PROMETHEUS_CONFIG.read_text())["scrape_configs"]
    assert endpoint["interval"] == job["scrape_interval"] == "15s"


def test_prometheusrule_is_generated_from_the_current_rules(tmp_path, capsys):
    assert generate_prometheusrule.main(["--check"]) == 0, capsys.readouterr().out[-3000:]
    rule = manifests()["PrometheusRule"]
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["spec"]["groups"] == yaml.safe_load(RULES_FILE.read_text())["groups"]
    extracted = tmp_path / "extracted.rules.yml"
    extracted.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    promtool = require_binary("promtool", "prometheus")
    checked = subprocess.run([promtool, "check", "rules", str(extracted)], capture_output=True, text=True,
                             timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    # and a changed rule file makes the committed one stale
    changed = tmp_path / "changed.rules.yml"
    changed.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"][:-1]}))
    assert generate_prometheusrule.main(["--check", "--rules-file", str(changed)]) == 1


# --- Alertmanager and Prometheus --------------------------------------------------------------

RECEIVER_BY_SEVERITY = {"critical": "pager", "warning": "chat", "info": "none"}
DEFAULT_RECEIVER = "chat"


def rule_alerts() -> set[tuple[str, str]]:
    """(alertname, severity) of every alerting rule."""
    groups = yaml.safe_load(RULES_FILE.read_text())["groups"]
    return {(r["alert"], r["labels"]["severity"]) for g in groups for r in g["rules"] if "alert" in r}


def test_alertmanager_config_passes_amtool_and_routes_each_alert_by_severity():
    amtool = require_binary("amtool", "prometheus-alertmanager")
    checked = subprocess.run([amtool, "check-config", str(ALERTMANAGER_CONFIG)], capture_output=True, text=True,
                             timeout=30)
    assert checked.returncode == 0 and "SUCCESS" in checked.stdout, checked.stdout + checked.stderr
    alerts = sorted(rule_alerts()) + [("NotOneOfOurs", "page-me-maybe")]
    assert {severity for _, severity in alerts} >= RECEIVER_BY_SEVERITY.keys()
    for alertname, severity in alerts:
        routed = subprocess.run([amtool, "config", "routes", "test", f"--config.file={ALERTMANAGER_CONFIG}",
                                 f"alertname={alertname}", f"severity={severity}", "instance=gpu-host-1:9787",
                                 "gpu=0"], capture_output=True, text=True, timeout=30)
        assert routed.stdout.strip() == RECEIVER_BY_SEVERITY.get(severity, DEFAULT_RECEIVER), (alertname, severity)


def _alert(alertname: str, severity: str, **labels: str) -> dict:
    return {"labels": {"alertname": alertname, "severity": severity, **labels}}


# Alerts from Prometheus carry instance; those the agent pushes itself carry host.
INHIBITION_CASES = [  # (alert, muted?)
    (_alert("GpuLost", "critical", instance="a:9787", gpu="0"), False),
    (_alert("GpuPcieReplayErrors", "warning", instance="a:9787", gpu="0"), True),   # the lost GPU
    (_alert("GpuPcieReplayErrors", "warning", instance="a:9787", gpu="1"), False),  # another GPU
    (_alert("GpuPcieReplayErrors", "warning", instance="b:9787", gpu="0"), False),  # another host
    (_alert("HostSwapThrash", "warning", instance="a:9787"), False),                # the host itself
    (_alert("GpuLost", "critical", host="c", pci_bus_id="0000:17:00.0"), False),     # left the bus
    (_alert("PcieAerErrors", "warning", host="c", pci_bus_id="0000:17:00.0", aer_severity="correctable"), True),
    (_alert("HostSwapThrash", "warning", host="c"), False),  # no gpu label on either side: not muted
    (_alert("PcieAerErrors", "critical", instance="d:9787", pci_bus_id="0000:3b:00.0", aer_severity="fatal"),
     False),
    (_alert("PcieAerErrors", "warning", instance="d:9787", pci_bus_id="0000:3b:00.0", aer_severity="correctable"),
     True),  # its critical variant mutes it
    (_alert("HostSwappinessHigh", "info", instance="a:9787"), False),
]


def _receivers(webhook: WebhookReceiver) -> dict[frozenset, str]:
    """The receiver each delivered alert (by its label set) was routed to."""
    return {frozenset(alert["labels"].items()): body["receiver"]
            for body in list(webhook.notifications) for alert in body["alerts"]}


@contextlib.contextmanager
def example_alertmanager(tmp_path):
    """Debian's Alertmanager on the example configuration, every receiver pointed at one webhook and
    the group timers cut to a second: (alertmanager, webhook)."""
    config = yaml.safe_load(ALERTMANAGER_CONFIG.read_text())
    for receiver in config["receivers"]:
        for integration in [key for key in receiver if key.endswith("_configs")]:
            del receiver[integration]
        receiver["webhook_configs"] = [{"url": "WEBHOOK", "send_resolved": False}]
    for route in (config["route"], *config["route"]["routes"]):
        route.update(group_wait="1s", group_interval="1s")
    webhook = WebhookReceiver()
    alertmanager = None
    try:
        alertmanager = Alertmanager(tmp_path, webhook.url)
        (tmp_path / "alertmanager.yml").write_text(yaml.safe_dump(config).replace("WEBHOOK", webhook.url))
        assert httpx.post(f"{alertmanager.url}/-/reload", timeout=5).status_code == 200
        yield alertmanager, webhook
    finally:
        if alertmanager is not None:
            alertmanager.close()
        webhook.close()


def test_a_real_alertmanager_routes_and_inhibits_as_configured(tmp_path):
    """The example's routes and inhibit rules, loaded into Debian's Alertmanager with every receiver
    pointed at the test's webhook and the group timers cut to a second."""
    with example_alertmanager(tmp_path) as (alertmanager, webhook):
        posted = httpx.post(f"{alertmanager.url}/api/v2/alerts", json=[a for a, _ in INHIBITION_CASES], timeout=5)
        assert posted.status_code == 200, posted.text
        expected = {frozenset(a["labels"].items()): RECEIVER_BY_SEVERITY[a["labels"]["severity"]]
                    for a, muted in INHIBITION_CASES if not muted}
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and not expected.items() <= _receivers(webhook).items():
            time.sleep(0.2)
        time.sleep(2)  # two more group intervals: a muted alert would have been sent by now
        assert _receivers(webhook) == expected
        state = {frozenset(a["labels"].items()): (a["status"]["state"], bool(a["status"]["inhibitedBy"]))
                 for a in alertmanager.alerts()}
        assert state == {frozenset(a["labels"].items()): ("suppressed", True) if muted else ("active", False)
                         for a, muted in INHIBITION_CASES}


# One GPU that fell off the bus, seen by both views. Host a: its identity is known, so the rule and
# the detector give ONE alert with gpu, uuid and pci_bus_id. Host c: the agent started after the loss
# (no gpu_info to join), so NVML's view and the bus's view are two alerts with no GPU label in
# common; the default group_by (alertname, instance, host, gpu) put them in two groups, two pages.
LOST_GPU_CASES = [
    _alert("GpuLost", "critical", instance="a:9787", gpu="1", uuid="GPU-1", pci_bus_id="0000:ca:00.0"),
    _alert("GpuLost", "critical", host="c", gpu="1", uuid="GPU-1"),
    _alert("GpuLost", "critical", host="c", pci_bus_id="0000:ca:00.0"),
    _alert("GpuLost", "critical", host="d", gpu="0", uuid="GPU-0"),  # another machine: its own page
]


def test_a_real_alertmanager_sends_one_page_per_lost_gpu(tmp_path):
    """Both views of one lost GPU reach the pager as one notification (one group), on the example
    configuration loaded into Debian's Alertmanager, receivers pointed at a webhook."""
    with example_alertmanager(tmp_path) as (alertmanager, webhook):
        assert httpx.post(f"{alertmanager.url}/api/v2/alerts", json=LOST_GPU_CASES, timeout=5).status_code == 200
        wanted = {frozenset(a["labels"].items()) for a in LOST_GPU_CASES}
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and not wanted <= set(_receivers(webhook)):
            time.sleep(0.2)
        time.sleep(2)  # two more group intervals: a split group would have been sent by now
        groups: dict[str, set[frozenset]] = {}
        for body in list(webhook.notifications):
            assert body["receiver"] == "pager"
            groups.setdefault(body["groupKey"], set()).update(frozenset(a["labels"].items()) for a in body["alerts"])
        by_machine = sorted(sorted(dict(labels).get("instance") or dict(labels)["host"] for labels in alerts)
                            for alerts in groups.values())
        assert by_machine == [["a:9787"], ["c", "c"], ["d"]], groups


def test_prometheus_config_passes_promtool_with_the_rules_it_names():
    promtool = require_binary("promtool", "prometheus")
    checked = subprocess.run([promtool, "check", "config", str(PROMETHEUS_CONFIG)], capture_output=True, text=True,
                             timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    rules = sum(len(group["rules"]) for group in yaml.safe_load(RULES_FILE.read_text())["groups"])
    assert f"SUCCESS: {rules} rules found" in checked.stdout  # promtool read rules/hybridmon.rules.yml
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    assert [(PROMETHEUS_CONFIG.parent / p).resolve() for p in config["rule_files"]] == [RULES_FILE]
    (job,) = config["scrape_configs"]
    assert (job["job_name"], job["scrape_interval"], job["metrics_path"]) == ("hybridmon", "15s", "/metrics")
    assert config["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] == ["127.0.0.1:9093"]


def test_https_scrape_example_passes_promtool_and_matches_the_plain_job():
    """deploy/prometheus/scrape-https.yml, for agents run with --web-config-file; a real Prometheus
    scrapes an agent with it in tests/integration/test_web_config_live.py."""
    promtool = require_binary("promtool", "prometheus")
    example = DEPLOY / "prometheus" / "scrape-https.yml"
    checked = subprocess.run([promtool, "check", "config", str(example)], capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    (https_job,) = yaml.safe_load(example.read_text())["scrape_configs"]
    (plain_job,) = yaml.safe_load(PROMETHEUS_CONFIG.read_text())["scrape_configs"]
    assert https_job["scheme"] == "https" and https_job["basic_auth"].keys() == {"username", "password_file"}
    assert https_job["tls_config"].keys() == {"ca_file"}  # client certificates: commented, optional
    for same in ("job_name", "scrape_interval", "scrape_timeout", "metrics_path"):
        assert https_job[same] == plain_job[same], same


# --- The documents that describe these files --------------------------------------------------

@pytest.mark.parametrize("document", ["docs/quickstart.md", "deploy/README.md"])
def test_docs_name_real_files_metrics_and_settings(document):
    path = REPO / document
    text = path.read_text()
    links = [target for target in re.findall(r"\]\(([^)#]+)\)", text) if "://" not in target]
    assert links and [t for t in links if not (path.parent / t).exists()] == []
    metrics_doc = (REPO / "docs" / "metrics.md").read_text()
    documented_metrics = set(re.findall(r"^\| `(hybridmon_\w+)`", metrics_doc, re.M))
    named = set(re.findall(r"\b(hybridmon_\w*[a-z])\b(?![*\w])", text))
    assert named - documented_metrics == set()
    for variable in set(re.findall(r"\bHYBRIDMON_([A-Z_]+)=", text)):
        *sections, key = variable.lower().split("__")
        model = AgentConfig
        for section in sections:
            model = model.model_fields[section].annotation
        assert key in model.model_fields, variable
