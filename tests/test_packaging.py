"""The built wheel, not the checkout: ``pip install .`` must give a daemon and CLI that round-trip a process.

The wheel is built from a copy of the sources (no build files in the checkout) and installed without
its dependencies into a fresh virtual environment; the dependencies come from this test's environment
through a path entry, which carries no ``.pth`` hooks, so this checkout's editable gpusnap stays out.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.conftest import REPO, Workloads, start_daemon, stop_daemon, wait_for
from tests.starts import starts

SOURCES = ("pyproject.toml", "setup.py", "README.md", "daemon", "adapters")


def _package_dirs(top: str) -> set[str]:
    return {
        "gpusnap/" + str(p.parent.relative_to(REPO))
        for p in (REPO / top).rglob("__init__.py")
        if "__pycache__" not in p.parts
    }


@pytest.fixture(scope="module")
@starts("a wheel build and a pip install")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with the wheel installed; returns its ``bin`` directory."""
    tmp = tmp_path_factory.mktemp("pkg")
    src = tmp / "src"
    src.mkdir()
    for name in (n for n in SOURCES if (REPO / n).exists()):
        (shutil.copytree if (REPO / name).is_dir() else shutil.copy2)(
            REPO / name,
            src / name,
            **({"ignore": shutil.ignore_patterns("__pycache__")} if (REPO / name).is_dir() else {}),
        )
    wheels = tmp / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(src)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = wheels.glob("gpusnap-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    in_wheel = {n.rsplit("/", 1)[0] for n in names if n.endswith("/__init__.py")}
    assert _package_dirs("daemon") | _package_dirs("adapters") <= in_wheel, "every package directory is in the wheel"
    assert "gpusnap/daemon/access/safefs.py" in names and "gpusnap/daemon/py.typed" in names

    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", "--no-index", str(wheel)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    site = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    (Path(site) / "deps-from-test-env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return venv / "bin"


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}


def test_installed_wheel_imports_from_the_venv_only(installed: Path) -> None:
    out = subprocess.run(
        [
            str(installed / "python"),
            "-c",
            "import gpusnap.daemon.access.safefs as m, gpusnap.daemon.main, gpusnap.adapters.agent; print(m.__file__)",
        ],
        check=True,
        capture_output=True,
        text=True,
        env=_clean_env(),
        cwd="/",
    ).stdout.strip()
    assert out.startswith(str(installed.parent)), f"gpusnap imported from {out}, not from the installed wheel"


def test_installed_daemon_and_cli_round_trip_a_process(installed: Path, tmp_path: Path, workloads: Workloads) -> None:
    d = start_daemon(tmp_path, bin_dir=installed, base_env=_clean_env())
    try:
        assert d.alive(), d.log.read_text()
        w = workloads.start("--mem-mb", "4", "--no-listener")
        dumped = json.loads(d.cli("-o", "json", "dump", str(w.pid), "--name", "pkg", check=True).stdout)
        assert w.proc is not None and w.proc.wait(timeout=10) == -signal.SIGKILL
        frozen_at = w.last("parent.log")
        restored = json.loads(d.cli("-o", "json", "restore", "pkg", check=True).stdout)
        workloads.adopt(restored["pid"])
        assert restored["snapshot_id"] == dumped["id"] and len(restored["pids"]) == 2
        wait_for(lambda: w.last("parent.log") > frozen_at, 10, "the restored tree did not continue its counter")
    finally:
        stop_daemon(d)
    assert "Traceback" not in d.log.read_text(), d.log.read_text()[-3000:]


def test_gpusnap_install_criu_gives_the_criu_gpusnapd_runs_with(
    installed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The wheel's way to CRIU (no Makefile): `gpusnap-install-criu PREFIX` prints the flags that the README's
    install block passes; a gpusnapd started with them serves with that CRIU."""
    from gpusnap.daemon.defaults import DEFAULT_CRIU_PREFIX
    from gpusnap.daemon.install_criu import flags

    block = (REPO / "README.md").read_text().split("## Install from the wheel", 1)[1].split("```sh\n", 1)[1]
    lines = block.split("```", 1)[0].splitlines()
    assert any(line.startswith("/opt/gpusnap/bin/gpusnap-install-criu ") for line in lines), lines
    assert lines[-1] == f"/opt/gpusnap/bin/gpusnapd {flags(str(DEFAULT_CRIU_PREFIX))}", lines
    service = (REPO / "scripts" / "install-service.sh").read_text()  # the same layout as make install-service
    assert "PREFIX=${PREFIX:-/opt/gpusnap}" in service and '"$DESTDIR$PREFIX/criu"' in service, service
    assert '"$PREFIX/bin/$cmd"' in service, "its gpusnapd and gpusnap are the venv's, in PREFIX/bin"
    prefix = tmp_path / "criu"
    out = subprocess.run(
        [str(installed / "gpusnap-install-criu"), str(prefix)],
        capture_output=True,
        text=True,
        timeout=600,
        env=_clean_env(),
        cwd="/",
    )
    assert out.returncode == 0, out.stderr
    assert flags(str(prefix)) in out.stdout, out.stdout
    monkeypatch.setenv("GPUSNAP_CRIU_PREFIX", str(prefix))  # start_daemon passes --criu and --pycriu-path from it
    d = start_daemon(tmp_path / "d", bin_dir=installed, base_env=_clean_env())
    try:
        assert d.alive(), d.log.read_text()
        node = json.loads(d.cli("-o", "json", "node", check=True).stdout)
        assert node["criu_path"] == f"{prefix}/bin/criu", node
        assert node["host"]["criu_version"] == (prefix / "VERSION").read_text().strip(), node["host"]
    finally:
        stop_daemon(d)


def test_python_m_build_in_a_checkout_runs_pypas_build(tmp_path: Path) -> None:
    """`make run` keeps its socket and store in the checkout's build/ directory; `python -m build` there still runs
    pypa's build (the dev environment has it), not that directory."""
    (tmp_path / "build" / "run").mkdir(parents=True)
    res = subprocess.run(
        [sys.executable, "-m", "build", "--version"], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert res.returncode == 0 and res.stdout.startswith("build "), res
    assert "site-packages" in res.stdout, res.stdout
