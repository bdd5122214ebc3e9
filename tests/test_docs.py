"""The docs can be navigated: every relative link of README.md and docs/*.md names a file that
exists and, after a ``#``, a heading of it (as GitHub makes its anchors)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```.*?^```", re.M | re.S)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """GitHub's anchors: each heading lowercased, punctuation dropped, spaces made hyphens."""
    headings = re.findall(r"^#+ (.*)$", FENCE.sub("", page.read_text()), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_link_reaches_a_page_and_its_heading(page: Path) -> None:
    broken = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):
            continue  # http:, https:, mailto:
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists() or (anchor and linked.suffix == ".md" and anchor not in anchors(linked)):
            broken.append(target)
    assert broken == [], f"{page.name}: links to no such page or heading"


def test_the_design_opens_with_its_contents() -> None:
    design = (ROOT / "docs" / "design.md").read_text()
    listed = re.findall(r"^\s*- \[.*?\]\(#(.*?)\)", design.split("\n## 1.", 1)[0], re.M)
    assert set(listed) == anchors(ROOT / "docs" / "design.md") - {"poolkeeper-design", "contents"}
