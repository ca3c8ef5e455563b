"""gpusnapd's settings reach DaemonConfig from every source, and bad values stop it before it starts."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from gpusnap.daemon.config import DaemonConfig
from gpusnap.daemon.main import EXIT_CONFIG, main


def test_agent_wait_from_file_environment_and_flag(tmp_path: Path) -> None:
    conf = tmp_path / "gpusnapd.toml"
    conf.write_text("agent_wait = 30\n")
    assert DaemonConfig().agent_wait == 15.0
    assert DaemonConfig.load(conf, env={}).agent_wait == 30.0
    assert DaemonConfig.load(conf, env={"GPUSNAP_AGENT_WAIT": "2.5"}).agent_wait == 2.5
    assert DaemonConfig.load(conf, env={"GPUSNAP_AGENT_WAIT": "2.5"}, overrides={"agent_wait": 4.0}).agent_wait == 4.0


def test_a_negative_agent_wait_is_refused_at_start() -> None:
    res = CliRunner().invoke(main, ["--agent-wait", "-1"])
    assert res.exit_code == EXIT_CONFIG, res.output
    assert "agent_wait must not be negative" in res.output, res.output
