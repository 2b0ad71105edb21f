"""The documentation holds together: the docs site builds under `mkdocs build --strict` with
no warning (every link between pages, every anchor, every page in the nav), the README's
relative links and anchors resolve (it lies outside docs/, where mkdocs does not look), the
repository paths the README and the docs name exist, and the README stays a page or two.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.support.launch import REPO

README = REPO / "README.md"
DOCS = REPO / "docs"
README_MAX_LINES = 160

_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_CODE = re.compile(r"`([^`\s]+)`")
# A code span naming a file or folder of this repository: ckpt/schedule/interval.py, deploy/README.md.
_REPO_PATH = re.compile(r"(?:ckpt|tests|bench|examples|deploy|agents|docs)/[\w.\-/]*|[A-Z]+\.md")


def prose(path: Path) -> str:
    """The text of a markdown file without its fenced code blocks."""
    return _FENCE.sub("", path.read_text(encoding="utf-8"))


def github_anchors(path: Path) -> set[str]:
    """The anchors GitHub gives the headings of a markdown file."""
    anchors = set()
    for line in prose(path).splitlines():
        heading = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            text = re.sub(r"[^\w\- ]", "", heading[1].replace("`", "")).lower()
            anchors.add(text.replace(" ", "-"))
    return anchors


def own_pages() -> list[Path]:
    """docs/*.md written for the site (not the files linked in from elsewhere)."""
    return sorted(p for p in DOCS.glob("*.md") if not p.is_symlink())


def test_docs_site_builds_strict_without_a_warning(tmp_path):
    site = tmp_path / "site"
    build = ["build", "--strict", "-f", str(REPO / "mkdocs.yml"), "-d", str(site)]
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", *build],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    log = out.stdout + out.stderr
    assert out.returncode == 0 and "WARNING" not in log, log
    assert (site / "index.html").exists()


def test_readme_relative_links_and_anchors_resolve():
    broken = []
    for target in _LINK.findall(prose(README)):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: and the like
            continue
        path, _, anchor = target.partition("#")
        file = (REPO / path).resolve() if path else README
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in github_anchors(file):
            broken.append(f"{target}: no heading makes the anchor #{anchor}")
    assert not broken, broken


def test_readme_links_every_docs_page():
    linked = {(REPO / t.partition("#")[0]).resolve() for t in _LINK.findall(prose(README))}
    assert not [p.name for p in own_pages() if p.resolve() not in linked]


def test_repository_paths_named_in_readme_and_docs_exist():
    missing = [
        f"{page.relative_to(REPO)}: {name}"
        for page in [README, *own_pages()]
        for name in _CODE.findall(prose(page))
        if _REPO_PATH.fullmatch(name) and not (REPO / name).exists()
    ]
    assert not missing, missing


def test_readme_is_a_page_or_two():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines: move detail into docs/"


def test_the_readme_snippet_runs_as_it_is_and_resumes(tmp_path):
    """The first code block of the README, copied as a new user would: it trains, saves, and
    a second run finds the work done."""
    snippet = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    runs = [subprocess.run([sys.executable, "-c", snippet], cwd=tmp_path, capture_output=True, text=True, timeout=300) for _ in range(2)]
    assert runs[0].returncode == 0, runs[0].stderr
    assert "ckpt: no checkpoint in ./checkpoints: starting at step 0" in runs[0].stderr
    assert "ckpt: saved step 10: committed" in runs[0].stderr, runs[0].stderr
    assert runs[1].returncode == 0 and "ckpt: restored step 1000" in runs[1].stderr, runs[1].stderr
