"""The README and docs/: every relative link points at a file that exists, and every #anchor at a
heading of its page (as GitHub makes a heading's anchor). Links to the web are not followed."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def prose(text: str) -> str:
    """The text without fenced code blocks and inline code, where brackets are not links."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to hyphens;
    a repeated heading gets -1, -2, ..."""
    seen: dict = {}
    out = set()
    for line in re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).replace("`", "").replace("*", "").lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links(page: Path) -> list[str]:
    return [t for t in LINK.findall(prose(page.read_text())) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def test_the_anchors_are_githubs():
    page = ROOT / "docs" / "design.md"
    assert {"the-words", "imports-point-one-way", "tests-and-ci"} <= anchors(page)
    assert "expert-parallelism-trainexpert_parallel" in anchors(ROOT / "docs" / "distributed.md")


def test_the_link_finder_finds_links_but_not_code(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("[a](x.md) and [b](y.md#h) ![img](i.png) [web](https://e.org)\n`[c](no.md)`\n"
                    "```\n[d](no.md)\n```\n")
    assert links(page) == ["x.md", "y.md#h"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_the_readme_is_a_front_page():
    # Read in three minutes: at most 120 lines and 9,000 characters, prose lines at most 100
    # characters (code blocks and tables excepted); the rest lives in docs/.
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 120 and len(text) <= 9000, (len(text.splitlines()), len(text))
    long = [line for line in re.sub(r"^```.*?^```", "", text, flags=re.S | re.M).splitlines()
            if len(line) > 100 and not line.startswith("|")]
    assert not long, long
    for page in ("training", "distributed", "dispatch", "benchmarks", "quality", "reliability", "design"):
        assert f"docs/{page}.md" in text and (ROOT / "docs" / f"{page}.md").exists()
