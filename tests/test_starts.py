"""Tests are slow by what they start (tests/starts.py): read from their code, and checked while they run."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.adapters import test_buffer_tiers_cpu, test_prefill_cpu
from tests.daemon import test_fault_matrix, test_faults
from tests.daemon.store import test_store
from tests.starts import refused, started_by


def test_a_daemon_started_through_helpers_and_local_imports_is_seen() -> None:
    """Tests that start gpusnapd without the ``daemon`` fixture: through a helper of their module, directly,
    by a name imported inside the function, and in a module-scoped fixture's code (these ran in
    ``make test-fast`` when only fixture names and a list of modules marked tests slow)."""
    assert "gpusnapd" in started_by(test_prefill_cpu.test_too_little_device_memory_falls_back)
    assert "gpusnapd" in started_by(test_buffer_tiers_cpu.test_a_capture_bigger_than_every_budget_is_refused)
    assert "gpusnapd" in started_by(test_faults.test_old_criu_is_refused_at_start)
    assert "gpusnapd" in started_by(test_fault_matrix.template.__wrapped__)  # type: ignore[attr-defined]


def test_a_test_that_starts_nothing_is_fast() -> None:
    assert started_by(test_store) == frozenset()
    assert all(not started_by(f) for n, f in vars(test_store).items() if n.startswith("test_"))


@pytest.mark.parametrize(
    ("argv", "what"),
    [
        ([sys.executable, "-m", "gpusnap.daemon.main", "--socket", "s"], "gpusnapd"),
        (["/opt/gpusnap/venv/bin/gpusnapd"], "gpusnapd"),
        ([".criu/lib64/ld-linux-x86-64.so.2", "--library-path", "lib", ".criu/usr/sbin/criu", "--version"], "CRIU"),
        ([sys.executable, "-m", "gpusnap.daemon.drivers.criu_exec", "criu"], "CRIU"),
        ([sys.executable, "tests/daemon/workloads/tree.py", "/tmp/w"], "a script of tests/"),
        ([sys.executable, "-m", "pip", "install", "x"], "a pip install"),
        ([sys.executable, "-c", "print(1)"], ""),
        (["setpriv", "--reuid=65534", "true"], ""),
    ],
)
def test_what_a_command_line_starts(argv: list[str], what: str) -> None:
    assert refused(argv).startswith(what) and bool(refused(argv)) == bool(what), refused(argv)


def test_a_test_not_marked_slow_cannot_start_gpusnapd() -> None:
    """The check while tests run: this test is not slow (its code starts nothing through a starter), so the
    command line it builds itself is refused before anything starts."""
    with pytest.raises(AssertionError, match="starts gpusnapd .* but is not marked slow"):
        subprocess.Popen([sys.executable, "-m", "gpusnap.daemon.main", "--version"])
