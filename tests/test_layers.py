"""The layers and rules of docs/architecture.md, held by import-linter's contracts in pyproject.toml, which
``make lint`` checks: a deliberate violation fails it; the contracts' lists of adapters/ are whole; and at run
time gpusnapd (and ``gpusnap.adapters.contract``) imports no module of adapters/ but the contract and the
engines' settings, which the ``gpusnap.engines`` entry points name."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.conftest import REPO

LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"
CONTRACTS = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


def _lint_imports(pythonpath: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``make lint``'s import check (lint-imports over pyproject.toml's contracts) of the package found first
    on ``pythonpath``."""
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--config", str(REPO / "pyproject.toml"), "--no-cache", "--no-logo"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _copy(tmp: Path) -> Path:
    """A copy of the package (``tmp/pkg/gpusnap/{daemon,adapters}``) to break; returns ``tmp/pkg``."""
    root = tmp / "pkg"
    for portion in ("daemon", "adapters"):
        shutil.copytree(REPO / portion, root / "gpusnap" / portion, ignore=shutil.ignore_patterns("__pycache__"))
    return root


@pytest.mark.parametrize(
    ("module", "line", "contract"),
    [
        ("gpusnap.daemon.drivers", "from gpusnap.daemon.operations import base", "layers"),
        ("gpusnap.daemon.store", "from gpusnap.daemon.park import ladder", "layers"),
        ("gpusnap.daemon.drivers", "import grpc", "drivers never import gRPC or operations"),
        ("gpusnap.daemon.preflight", "from gpusnap.adapters import vmm", "imports only adapters.contract"),
        ("gpusnap.daemon.config", "from gpusnap.daemon.store import journal", "config imports only api"),
    ],
)
def test_a_violation_fails_make_lint(tmp_path: Path, module: str, line: str, contract: str) -> None:
    """One import that breaks a rule, added to a copy of the package: lint-imports fails and names the rule."""
    root = _copy(tmp_path)
    path = root.joinpath(*module.split("."))
    source = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    source.write_text(source.read_text() + f"\n{line}  # noqa\n")
    res = _lint_imports(root, tmp_path)
    assert res.returncode != 0, res.stdout
    assert "BROKEN" in res.stdout and contract in res.stdout.split("Broken contracts")[1], res.stdout


def test_the_tree_keeps_every_contract(tmp_path: Path) -> None:
    res = _lint_imports(_copy(tmp_path), tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"Contracts: {len(CONTRACTS)} kept, 0 broken." in res.stdout, res.stdout


@pytest.mark.parametrize("contract", ["contract", "contract-alone"])
def test_the_contracts_name_every_module_of_adapters_but_the_contract(contract: str) -> None:
    (rule,) = [c for c in CONTRACTS if c["id"] == contract]
    modules = {p.stem for p in (REPO / "adapters").glob("*.py") if p.stem != "__init__"}
    modules |= {p.parent.name for p in (REPO / "adapters").glob("*/__init__.py")} - {"contract"}
    listed = {
        m.removeprefix("gpusnap.adapters.") for m in rule["forbidden_modules"] if m.startswith("gpusnap.adapters")
    }
    assert listed == modules


def _adapters_loaded(*modules: str) -> list[str]:
    """The modules of gpusnap.adapters a fresh interpreter holds once it has imported ``modules``."""
    code = f"import sys, json\nimport {', '.join(modules)}\n"
    code += "print(json.dumps(sorted(m for m in sys.modules if m.startswith('gpusnap.adapters'))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    loaded: list[str] = json.loads(out.stdout)
    return loaded


ALLOWED = ("gpusnap.adapters", "gpusnap.adapters.contract", "gpusnap.adapters.engines")
"""What importing the contract may bring: the package inits (nothing but docstrings and lazy names), the
contract, and each engine's ``settings`` through its entry point (with its package's init)."""


def _outside_the_contract(loaded: list[str]) -> list[str]:
    engines = {f"gpusnap.adapters.engines.{e}" for e in ("sglang", "trtllm", "vllm")}
    settings = {f"{e}.settings" for e in engines}
    return [m for m in loaded if m not in (*ALLOWED, *engines, *settings) and not m.startswith(ALLOWED[1] + ".")]


def test_the_contract_imports_without_the_worker_runtime() -> None:
    loaded = _adapters_loaded(
        "gpusnap.adapters.contract.capture_settings",
        "gpusnap.adapters.contract.wire",
        "gpusnap.adapters.contract._proto",
    )
    assert "gpusnap.adapters.contract.registry" in loaded
    assert _outside_the_contract(loaded) == [], "no agent, buffers, vmm, ... in a process that imports the contract"


def test_gpusnapd_imports_only_the_contract_of_adapters() -> None:
    assert _outside_the_contract(_adapters_loaded("gpusnap.daemon.main", "gpusnap.daemon.server")) == []
