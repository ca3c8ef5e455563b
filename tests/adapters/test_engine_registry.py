"""The engine registry (gpusnap.adapters.contract.registry): every engine's settings, found through the
gpusnap.engines entry points, and what the daemon's preflight reads from it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from gpusnap.adapters.contract import capture_settings, registry
from gpusnap.adapters.contract.settings import CaptureSetting, EngineSettings
from gpusnap.daemon.preflight import gpu as preflight


def test_engines_come_from_their_entry_points() -> None:
    assert [e.name for e in registry.ENGINES] == ["sglang", "trtllm", "vllm"]  # torch/ declares nothing
    for engine in registry.ENGINES:
        assert all(r in capture_settings.CAPTURE_SETTINGS for r in engine.rows)
    assert preflight.engine_from_argv(["/venv/bin/vllm", "serve", "m"]) == "vllm"
    assert preflight.engine_from_argv(["python", "-m", "sglang.launch_server"]) == "sglang"
    assert preflight.engine_from_argv(["trtllm-serve", "m"]) == "trtllm"
    assert preflight.engine_from_argv(["python", "serve.py", "--model", "vllm"]) is None
    assert preflight.tensor_parallel_from_argv(["trtllm-serve", "--tp_size", "4"]) == 4


def _distribution(root: Path, name: str, engines: str) -> None:
    """An installed distribution ``name`` under ``root`` whose ``gpusnap.engines`` entry points are ``engines``."""
    info = root / f"{name}-0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0\n")
    (info / "entry_points.txt").write_text(f"[gpusnap.engines]\n{engines}\n")


def test_a_new_entry_point_is_an_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Adding an engine is one folder and one entry point (docs/engines.md): its settings reach the registry
    with no other edit."""
    package = tmp_path / "newengine_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "settings.py").write_text(
        "from gpusnap.adapters.contract.settings import CaptureSetting, EngineSettings\n"
        "SETTINGS = EngineSettings('newengine', ('newengine',), ('--shards',),\n"
        "    (CaptureSetting('NEWENGINE_IPC', '0', 'its IPC maps peer memory', engine='newengine'),))\n"
    )
    _distribution(tmp_path, "newengine", "newengine = newengine_pkg.settings:SETTINGS")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        found = {e.name: e for e in registry._collect()}
    finally:
        sys.modules.pop("newengine_pkg.settings", None)
        sys.modules.pop("newengine_pkg", None)
    assert set(found) == {"sglang", "trtllm", "vllm", "newengine"}
    assert found["newengine"].tensor_parallel_flags == ("--shards",)
    assert found["newengine"].rows[0].name == "NEWENGINE_IPC"


def test_an_entry_point_that_is_not_its_engine_s_settings_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _distribution(tmp_path, "misnamed", "other = gpusnap.adapters.engines.vllm.settings:SETTINGS")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ImportError, match=r"gpusnap.engines:other .* is not that engine's EngineSettings"):
        registry._collect()


def test_without_gpusnap_s_metadata_the_registry_says_how_to_get_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry.metadata, "entry_points", lambda group: [])
    with pytest.raises(ImportError, match="scripts/link_tree.py"):
        registry._collect()


def test_rows_name_their_engine() -> None:
    with pytest.raises(ValueError, match="name another engine"):
        EngineSettings("a", rows=(CaptureSetting("X", "1", "why", engine="b"),))
