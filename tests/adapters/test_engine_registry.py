"""The engine registry (gpusnap.adapters.contract.registry): every engine folder's settings, found by folder,
and what the daemon's preflight reads from it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from gpusnap.adapters import engines
from gpusnap.adapters.contract import capture_settings, registry
from gpusnap.adapters.contract.settings import CaptureSetting, EngineSettings
from gpusnap.daemon.preflight import gpu as preflight


def test_engines_come_from_their_folders() -> None:
    assert [e.name for e in registry.ENGINES] == ["sglang", "trtllm", "vllm"]  # torch/ declares nothing
    for engine in registry.ENGINES:
        assert all(r in capture_settings.CAPTURE_SETTINGS for r in engine.rows)
    assert preflight.engine_from_argv(["/venv/bin/vllm", "serve", "m"]) == "vllm"
    assert preflight.engine_from_argv(["python", "-m", "sglang.launch_server"]) == "sglang"
    assert preflight.engine_from_argv(["trtllm-serve", "m"]) == "trtllm"
    assert preflight.engine_from_argv(["python", "serve.py", "--model", "vllm"]) is None
    assert preflight.tensor_parallel_from_argv(["trtllm-serve", "--tp_size", "4"]) == 4


def test_a_new_folder_is_an_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Adding an engine is one folder (docs/engines.md): its settings reach the registry with no other edit."""
    folder = tmp_path / "newengine"
    folder.mkdir()
    (folder / "__init__.py").write_text("")
    (folder / "settings.py").write_text(
        "from gpusnap.adapters.contract.settings import CaptureSetting, EngineSettings\n"
        "SETTINGS = EngineSettings('newengine', ('newengine',), ('--shards',),\n"
        "    (CaptureSetting('NEWENGINE_IPC', '0', 'its IPC maps peer memory', engine='newengine'),))\n"
    )
    (tmp_path / "nosettings").mkdir()
    (tmp_path / "nosettings" / "__init__.py").write_text("")
    monkeypatch.setattr(engines, "__path__", [*engines.__path__, str(tmp_path)])
    try:
        found = {e.name: e for e in registry._collect()}
    finally:
        for name in [m for m in sys.modules if m.startswith(f"{engines.__name__}.newengine")]:
            del sys.modules[name]
    assert set(found) == {"sglang", "trtllm", "vllm", "newengine"}
    assert found["newengine"].tensor_parallel_flags == ("--shards",)
    assert found["newengine"].rows[0].name == "NEWENGINE_IPC"


def test_rows_name_their_engine() -> None:
    with pytest.raises(ValueError, match="name another engine"):
        EngineSettings("a", rows=(CaptureSetting("X", "1", "why", engine="b"),))
