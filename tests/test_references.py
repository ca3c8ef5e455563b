"""Every reference in the code and the documents resolves inside the repo: each document cited exists (and
the section or anchor named in it), each failure case cited is in docs/failure-cases.md, each repository path
(``daemon/drivers/criu.py``, ``drivers/criu.py``) and each ``gpusnap.daemon.*`` / ``gpusnap.adapters.*`` name
is there, the generated messages carry their module's name, nothing points at documents that are not in the
repo, and the README's layout line names every package."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
from functools import cache
from pathlib import Path

import pytest

from tests.conftest import REPO

TEXT_SUFFIXES = (".py", ".md", ".sh", ".toml", ".proto", ".yaml", ".yml", ".pyi", ".service", ".conf")
DOC_RE = re.compile(r"(?<![\w/.-])((?:docs/)?[A-Za-z0-9_-]+\.md)(#[a-z0-9-]+)?")
SECTION_RE = re.compile(r"(?<![\w/.-])((?:docs/)?[A-Za-z0-9_-]+\.md)`*\)?, \"([^\"]+)\"")
OUTSIDE_RE = re.compile(r"\.\./shared|(?<![\w/.-])(?:engine-apis|prior-art)\b|(?<![\w/.-])style\.md")


@cache
def _files() -> tuple[Path, ...]:
    names = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    return tuple(
        REPO / n
        for n in names
        if (n.endswith(TEXT_SUFFIXES) or n.endswith("Makefile"))
        and not n.startswith(("docs/schemas/", "bench/results/"))
        and "/_proto/" not in n
        and (REPO / n).is_file()
        and REPO / n != Path(__file__)  # its patterns name what they look for
    )


def _text(path: Path) -> str:
    return " ".join(path.read_text(errors="replace").split())  # line breaks inside a citation are spaces


def _resolve(name: str, cited_in: Path) -> Path | None:
    for candidate in (REPO / name, REPO / "docs" / name, cited_in.parent / name):
        if candidate.is_file():
            return candidate
    return None


def _headings(doc: Path) -> list[str]:
    """The document's headings and the bold leads of its paragraphs (``**Disk tier.** …``)."""
    text = doc.read_text()
    return [ln.lstrip("#").strip() for ln in text.splitlines() if ln.startswith("#")] + re.findall(
        r"^\*\*(.+?)\.?\*\*", text, re.M
    )


def _slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def test_cited_documents_sections_and_anchors_exist() -> None:
    missing = []
    for path in _files():
        text = _text(path)
        where = path.relative_to(REPO)
        for m in DOC_RE.finditer(text):
            doc = _resolve(m.group(1), path)
            if doc is None:
                missing.append(f"{where}: {m.group(1)}")
            elif m.group(2) and m.group(2)[1:] not in {_slug(h) for h in _headings(doc)}:
                missing.append(f"{where}: {m.group(1)}{m.group(2)} (no such heading)")
        for m in SECTION_RE.finditer(text):
            doc = _resolve(m.group(1), path)
            if doc is not None and not any(h.startswith(m.group(2)) for h in _headings(doc)):
                missing.append(f'{where}: {m.group(1)}, "{m.group(2)}" (no such section)')
    assert not missing, "references that do not resolve in the repo:\n" + "\n".join(missing)


def test_nothing_cites_documents_outside_the_repo() -> None:
    found = [f"{p.relative_to(REPO)}: {m.group(0)}" for p in _files() for m in OUTSIDE_RE.finditer(p.read_text())]
    assert not found, "bring the facts into docs/ in the project's own words, and cite that:\n" + "\n".join(found)


def test_every_failure_case_cited_is_described() -> None:
    described = set(re.findall(r"^\*\*(FC-\d\d)\*\*", (REPO / "docs" / "failure-cases.md").read_text(), re.M))
    cited = {(m, p.relative_to(REPO)) for p in _files() for m in re.findall(r"\bFC-\d+\b", p.read_text())}
    undescribed = sorted(f"{where}: {fc}" for fc, where in cited if fc not in described)
    assert not undescribed, "add these to docs/failure-cases.md:\n" + "\n".join(undescribed)
    assert described >= {"FC-02", "FC-08", "FC-16", "FC-18"}


@pytest.mark.parametrize("top", ["daemon", "adapters"])
def test_the_readme_layout_names_every_package(top: str) -> None:
    readme = (REPO / "README.md").read_text()
    layout = _text(REPO / "README.md")[_text(REPO / "README.md").index("Layout (") :]
    layout = layout[: layout.index("## ")]
    packages = sorted(p.parent.name for p in (REPO / top).glob("*/__init__.py"))
    assert packages and readme
    unnamed = [name for name in packages if f"`{name}/`" not in layout and f"`{name}/<name>/`" not in layout]
    assert not unnamed, f"README's layout line leaves out {top}/ packages {unnamed}"


TOPS = ("adapters", "bench", "daemon", "deploy", "docs", "proto", "scripts", "systemd", "tests")
"""The repository's folders: a path that starts with one of them names a file or folder of this repository."""
SUBPACKAGES = {p.parent.name: p.parent for top in ("daemon", "adapters") for p in (REPO / top).glob("*/__init__.py")}
"""The package's folders by name (``drivers``, ``contract``, ...): ``drivers/criu.py`` names ``daemon/drivers/criu.py``."""
PATH_RE = re.compile(r"(?<![\w/.~$-])((?:[A-Za-z0-9_.-]+/)+[A-Za-z0-9_.-]*[A-Za-z0-9_])(\*|-\*|-?\[?<|\{)?")
UPSTREAM_RE = re.compile(r"\b[\w-]+/[\w.-]+,? *`*$")
"""``owner/name`` just before a path: the path is in that upstream repository (``ai-dynamo/dynamo,
`docs/x.md```)."""
NAME_RE = re.compile(r"(?<![\w.])gpusnap\.(?:daemon|adapters)(?:\.\w+)*")


@cache
def _tracked() -> tuple[frozenset[str], frozenset[str]]:
    """The tracked files, and every folder that holds one."""
    names = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    return frozenset(names), frozenset(str(d) for n in names for d in Path(n).parents)


def _path_resolves(path: str, pattern: str) -> bool:
    """Whether ``path`` (``a/b.py``, ``drivers/criu.py``) is a tracked file or folder (or a module's name:
    ``store/durable.fsync_tree``); one that a wildcard or a
    placeholder follows (``bench/results/gpu-*.json``, ``...-<stamp>.json``) names what a run writes: its folder
    must be there."""
    files, folders = _tracked()
    first = path.split("/")[0]
    base = "" if first in TOPS else str(SUBPACKAGES[first].relative_to(REPO)).removesuffix(first)
    full = base + path.rstrip("/")
    if pattern:
        return str(Path(full).parent) in folders or full in folders
    module, dot, _ = full.rpartition(".")
    return full in files or full in folders or (dot != "" and f"{module}.py" in files)  # store/durable.fsync_tree


def test_repository_paths_resolve() -> None:
    """Every path into the repository that the code and the documents give (``daemon/drivers/criu.py``,
    ``drivers/criu.py`` for the package's folders, ``bench/results/x-*.json``) is there."""
    missing = []
    for path in _files():
        text = _text(path)
        for m in PATH_RE.finditer(text):
            name, first = m.group(1), m.group(1).split("/")[0]
            if first not in TOPS and first not in SUBPACKAGES:
                continue  # another program's path (vllm/v1/..., /proc/...)
            if UPSTREAM_RE.search(text[max(0, m.start() - 60) : m.start()]):
                continue
            if not _path_resolves(name, m.group(2) or ""):
                missing.append(f"{path.relative_to(REPO)}: {name}")
    assert not missing, "paths that are not in the repository:\n" + "\n".join(sorted(set(missing)))


def _defined(body: list[ast.stmt]) -> dict[str, ast.AST]:
    """The names a module or class body defines: functions, classes, assignments, imports, and the
    ``self.x`` its methods assign."""
    out: dict[str, ast.AST] = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out[node.name] = node
            if not isinstance(node, ast.ClassDef):
                for sub in ast.walk(node):
                    for target in getattr(sub, "targets", [getattr(sub, "target", None)]):
                        if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name):
                            out.setdefault(target.attr, sub)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        out[name.id] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out.update({(a.asname or a.name).split(".")[0]: node for a in node.names})
        elif isinstance(node, (ast.If, ast.Try)):
            out.update(_defined(node.body))
    return out


def _resolves(name: str) -> bool:
    """Whether ``gpusnap.daemon.x.y`` is a module, or a name a module defines, or an attribute of a class a
    module defines (read from the source: engine modules import their engines)."""
    parts = name.split(".")
    path = REPO / parts[1]
    i = 2
    while i < len(parts) and ((path / parts[i]).is_dir() or (path / f"{parts[i]}.py").is_file()):
        path = path / parts[i] if (path / parts[i]).is_dir() else path / f"{parts[i]}.py"
        i += 1
    source = path / "__init__.py" if path.is_dir() else path
    if i == len(parts):
        return True
    if not source.is_file():
        return False
    body = ast.parse(source.read_text()).body
    for attr in parts[i:]:
        node = _defined(body).get(attr)
        if node is None:
            return False
        if not isinstance(node, ast.ClassDef):
            return True  # a function's or a value's attributes are not followed
        body = node.body
    return True


def test_gpusnap_names_resolve() -> None:
    """Every ``gpusnap.daemon.*`` / ``gpusnap.adapters.*`` name the code and the documents give is a module or
    what a module defines."""
    missing = sorted(
        {f"{p.relative_to(REPO)}: {m}" for p in _files() for m in NAME_RE.findall(p.read_text()) if not _resolves(m)}
    )
    assert not missing, "names that are not in the package:\n" + "\n".join(missing)


@pytest.mark.parametrize("top", ["daemon", "adapters"])
def test_generated_messages_are_registered_under_their_module(top: str) -> None:
    """protoc's modules, moved into ``gpusnap.daemon._proto`` and ``gpusnap.adapters.contract._proto``
    (scripts/gen_protos.py), give their messages the module they live in."""
    wrong = []
    for path in sorted((REPO / top).rglob("_proto/*_pb2.py")):
        module = importlib.import_module("gpusnap." + ".".join(path.relative_to(REPO).with_suffix("").parts))
        for message in module.DESCRIPTOR.message_types_by_name:
            if getattr(module, message).__module__ != module.__name__:
                wrong.append(f"{module.__name__}.{message}: {getattr(module, message).__module__}")
    assert not wrong, "regenerate with `make proto`:\n" + "\n".join(wrong)
