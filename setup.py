"""Package list for setuptools, derived from the tree (the rest of the metadata is in pyproject.toml).

gpusnap is a namespace package made of two portions that live at the top of the repository
(``daemon/`` is ``gpusnap.daemon``, ``adapters/`` is ``gpusnap.adapters``), so every package below them
is found here and renamed, instead of being listed by hand (a hand-kept list once missed
``gpusnap.daemon.workers``; tests/test_packaging.py installs the built wheel and runs it).
"""

from setuptools import find_packages, setup

PORTIONS = ("daemon", "adapters")

setup(
    packages=[f"gpusnap.{p}" for p in find_packages(include=[f"{top}{sub}" for top in PORTIONS for sub in ("", ".*")])],
    package_dir={f"gpusnap.{top}": top for top in PORTIONS},
)
