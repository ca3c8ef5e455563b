"""deploy/*.yaml are valid Kubernetes objects (kubernetes-validate's bundled, strict schemas: unknown
fields are errors, and no network is needed), and every privilege and host mount of the DaemonSet says
why it is there."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.conftest import REPO

DEPLOY = REPO / "deploy"
K8S_VERSION = "1.30.0"
"""The oldest Kubernetes these manifests promise to work on (a schema kubernetes-validate ships)."""


def _docs() -> list[tuple[Path, dict[str, Any]]]:
    return [(p, d) for p in sorted(DEPLOY.glob("*.yaml")) for d in yaml.safe_load_all(p.read_text()) if d]


def test_every_manifest_validates_strictly() -> None:
    kinds = set()
    for path, doc in _docs():
        assert kubernetes_validate.validate(doc, K8S_VERSION, strict=True), path
        kinds.add(doc["kind"])
    assert {"Namespace", "ServiceAccount", "ConfigMap", "DaemonSet"} <= kinds


def test_the_validator_refuses_a_wrong_field() -> None:
    (ds,) = [d for _, d in _docs() if d["kind"] == "DaemonSet"]
    ds["spec"]["template"]["spec"]["hostPid"] = True  # misspelt: would silently not share the PID namespace
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(ds, K8S_VERSION, strict=True)


def test_validation_needs_no_network() -> None:
    """CI may be offline: run the validation in a network namespace without interfaces."""
    code = (
        "import kubernetes_validate, yaml, glob\n"
        f"for p in sorted(glob.glob({str(DEPLOY / '*.yaml')!r})):\n"
        "    for d in yaml.safe_load_all(open(p)):\n"
        f"        kubernetes_validate.validate(d, {K8S_VERSION!r}, strict=True)\n"
    )
    res = subprocess.run(["unshare", "--net", sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    if res.returncode != 0 and "unshare failed" in res.stderr:
        pytest.skip(f"cannot make a network namespace here: {res.stderr.strip()}")
    assert res.returncode == 0, res.stderr


def test_every_privilege_and_host_mount_is_explained() -> None:
    lines = (DEPLOY / "daemonset.yaml").read_text().splitlines()
    keys = ("hostPID:", "hostNetwork:", "privileged:", "mountPath:", "runAsUser:")
    for i, line in enumerate(lines):
        if not line.strip().startswith(keys) or "/etc/gpusnap" in line:
            continue
        above = [lines[j].strip() for j in range(max(0, i - 3), i)]
        assert "#" in line or any(a.startswith("#") for a in above), (
            f"daemonset.yaml:{i + 1} needs a why: {line.strip()}"
        )
    (ds,) = [d for _, d in _docs() if d["kind"] == "DaemonSet"]
    pod = ds["spec"]["template"]["spec"]
    mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    assert mounts["run"] == "/run/gpusnap" and mounts["store"] == "/var/lib/gpusnap" and mounts["shm"] == "/dev/shm"
    assert pod["hostPID"] is True and pod["automountServiceAccountToken"] is False


def test_the_config_map_is_a_valid_daemon_config() -> None:
    import tomllib

    from gpusnap.daemon.config import DaemonConfig
    from gpusnap.daemon.server import check_config

    (cm,) = [d for _, d in _docs() if d["kind"] == "ConfigMap"]
    doc = tomllib.loads(cm["data"]["gpusnapd.toml"])
    cfg = DaemonConfig.load(overrides=doc["gpusnapd"], env={})
    check_config(cfg)
    assert cfg.remote.startswith("s3://") and str(cfg.socket) == "/run/gpusnap/gpusnapd.sock"
