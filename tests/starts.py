"""What a test starts, read from its code: the tests that start gpusnapd, CRIU, an engine or worker, a
workload, a pip install, a Ceph gateway or test users are ``slow``, and ``make test-fast`` (``-m 'not slow'``)
leaves them out.

A *starter* is a function, class or fixture of tests/ marked ``@starts("gpusnapd")`` (and so on). A test
starts what its own code, the fixtures it uses and the helpers of tests/ they call start: the names each
function's code uses are followed, through functions, classes (their methods) and modules of tests/, down to
the starters (:func:`started_by`; ``tests/conftest.py`` marks the tests at collection). So a new test needs
no marker: it is slow as soon as it calls ``start_daemon`` or takes the ``daemon`` fixture.

What the code cannot show (a command line a test builds itself) is checked while the test runs: a test that
is not slow may not start gpusnapd, CRIU, a script of tests/ (workers, engines, workloads, launchers) or a pip
install (:func:`refused`, applied to every ``subprocess.Popen`` by ``tests/conftest.py``); it fails naming what
it started and the fix, ``@starts`` on the helper or the test that starts it.
"""

from __future__ import annotations

import inspect
import os
import sys
import types
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
TESTS = Path(__file__).resolve().parent
_ATTR = "__gpusnap_starts__"


def starts(*what: str) -> Callable[[T], T]:
    """Mark a function, class or fixture function as starting ``what`` (e.g. ``"gpusnapd"``); put it under
    ``@pytest.fixture``."""

    def mark(obj: T) -> T:
        setattr(obj, _ATTR, frozenset(what))
        return obj

    return mark


def _ours(obj: object) -> bool:
    name = obj.__name__ if isinstance(obj, types.ModuleType) else getattr(obj, "__module__", None) or ""
    return name == "tests" or name.startswith("tests.")


def _names(code: types.CodeType) -> Iterator[str]:
    """The global, attribute and imported names ``code`` (and the functions, lambdas and comprehensions
    inside it) uses."""
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _names(const)


def started_by(obj: object, seen: set[int] | None = None) -> frozenset[str]:
    """What ``obj`` (a function, class or module of tests/) starts, by its starters and the names its code
    uses; nothing for objects outside tests/."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return frozenset()
    seen.add(id(obj))
    if isinstance(obj, (staticmethod, classmethod)):
        return started_by(obj.__func__, seen)
    if isinstance(obj, property):
        return frozenset().union(*(started_by(f, seen) for f in (obj.fget, obj.fset) if f is not None))
    if not (isinstance(obj, type) or inspect.isfunction(obj)) or not _ours(obj):
        return frozenset()  # data, or code outside tests/
    marked = obj.__dict__.get(_ATTR)
    if marked:
        return frozenset(marked)
    if isinstance(obj, type):
        return frozenset().union(*(started_by(member, seen) for member in vars(obj).values()))
    fn = inspect.unwrap(obj)
    names = set(_names(fn.__code__))
    scope: dict[str, Any] = fn.__globals__
    found: set[str] = set()
    modules = []
    for name in names:
        target = scope.get(name, sys.modules.get(name) if name.startswith("tests") else None)
        if isinstance(target, types.ModuleType):
            modules.append(target)
        elif target is not None:
            found |= started_by(target, seen)
    for module in modules:  # ``module.helper(...)`` and ``from tests.x import helper`` inside a function
        if _ours(module):
            for name in names:
                if hasattr(module, name):
                    found |= started_by(getattr(module, name), seen)
    return frozenset(found)


def refused(argv: Sequence[object]) -> str:
    """What ``argv`` would start that a test which is not slow may not: "gpusnapd", "CRIU", "a script of
    tests/ (…)", "a pip install"; "" for anything else."""
    args = [os.fspath(a) if isinstance(a, os.PathLike) else str(a) for a in argv]
    words = [os.path.basename(a) for a in args[:6]]
    if "gpusnap.daemon.main" in args or words[:1] == ["gpusnapd"]:
        return "gpusnapd"
    if "criu" in words or "gpusnap.daemon.drivers.criu_exec" in args:
        return "CRIU"
    if "pip" in args[:3] and "install" in args:
        return "a pip install"
    for a in args[:4]:
        if a.endswith(".py") and Path(a).resolve().is_relative_to(TESTS):
            return f"a script of tests/ ({Path(a).name}: a worker, engine, workload or launcher)"
    return ""
