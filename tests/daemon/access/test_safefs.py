"""Root's writes into caller-named directories never follow symlinks or leave the directory."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from gpusnap.daemon.access import safefs
from gpusnap.daemon.api.errors import InvalidArgumentError, PermissionDeniedError
from gpusnap.daemon.workers import controldir


def test_create_replaces_a_planted_symlink_instead_of_following_it(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious")
    ctl = tmp_path / "ctl"
    ctl.mkdir()
    (ctl / ".restore-complete.tmp").symlink_to(victim)
    (ctl / "restore-context.json").symlink_to(victim)
    controldir.write_context(ctl, 0, {"X": "evil"}, [])
    controldir.signal_file(ctl, 0, controldir.RESTORE_COMPLETE)
    assert victim.read_text() == "precious"
    assert not (ctl / "restore-context.json").is_symlink()
    assert (ctl / controldir.RESTORE_COMPLETE).is_file()


def test_directory_must_be_real_and_owned(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(InvalidArgumentError):
        with safefs.open_dir(link, 0):
            pass
    with pytest.raises(InvalidArgumentError):
        with safefs.open_dir("relative/dir", 0):
            pass
    searchable = Path(tempfile.mkdtemp(prefix="gpusnap-safefs-"))  # tmp_path's parent is root's 0700
    try:
        os.chmod(searchable, 0o711)
        real = searchable / "real"
        real.mkdir()
        os.chown(real, 65534, 65534)
        with pytest.raises(PermissionDeniedError):
            with safefs.open_dir(real, 1000):
                pass
        with safefs.open_dir(real, 65534):
            pass
    finally:
        shutil.rmtree(searchable)
