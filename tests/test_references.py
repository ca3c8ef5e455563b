"""Every reference in the code and the documents resolves inside the repo: each document cited exists (and
the section or anchor named in it), each failure case cited is in docs/failure-cases.md, nothing points at
documents that are not in the repo, and the README's layout line names every package."""

from __future__ import annotations

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
