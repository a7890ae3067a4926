"""The README stays an entry point and the documentation stays connected.

README.md is at most 250 lines; every relative link in README.md, CHANGELOG.md and docs/*.md names a file that
exists and, for `file.md#anchor` (or `#anchor` alone), a heading of that file, by GitHub's anchor rule; every
docs/*.md file is linked from README.md. Text only: nothing is imported or run.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_README_LINES = 250

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, ...


def docs() -> list[Path]:
    return sorted((ROOT / "docs").glob("*.md"))


def checked_files() -> list[Path]:
    files = [README, *docs()]
    changelog = ROOT / "CHANGELOG.md"
    return files + [changelog] if changelog.is_file() else files


def prose_lines(text: str):
    """(line number, line) outside fenced and indented code blocks."""
    fenced = False
    previous_blank = True
    in_indented = False
    for number, line in enumerate(text.split("\n"), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if fenced:
            continue
        blank = not line.strip()
        if line.startswith(("    ", "\t")) and (previous_blank or in_indented) and not blank:
            in_indented = True  # an indented code block starts after a blank line and runs to the next text
            continue
        if not blank:
            in_indented = False
        previous_blank = blank
        yield number, line


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: links reduced to their text, lowercase, punctuation other than '-'
    and '_' dropped, each space a '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # [text](url) -> text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a markdown file, repeated headings numbered -1, -2, ... as GitHub does."""
    seen: dict[str, int] = {}
    found = set()
    for _, line in prose_lines(path.read_text(encoding="utf-8")):
        if m := HEADING.match(line):
            base = anchor(m.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(path: Path):
    """(line number, target) of every markdown link and image in the file's prose (code spans left out)."""
    for number, line in prose_lines(path.read_text(encoding="utf-8")):
        for m in LINK.finditer(INLINE_CODE.sub("", line)):
            yield number, m.group(1)


def test_anchor_rule():
    assert anchor("eval --decode: acceptance in real speculative decoding") == \
        "eval---decode-acceptance-in-real-speculative-decoding"
    assert anchor("Containers: `docker compose up`") == "containers-docker-compose-up"
    assert anchor("holdout: held out means held out") == "holdout-held-out-means-held-out"
    assert anchor("Store reads (against 875a7c5)") == "store-reads-against-875a7c5"


def test_readme_is_an_entry_point():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, (
        f"README.md has {len(lines)} lines, over {MAX_README_LINES}: move the detail into docs/ and link it")


@pytest.mark.parametrize("path", checked_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path: Path):
    broken = []
    for number, target in links(path):
        if EXTERNAL.match(target):
            continue
        file_part, _, fragment = target.partition("#")
        dest = (path.parent / unquote(file_part)).resolve() if file_part else path
        where = f"{path.relative_to(ROOT)}:{number}: {target}"
        if not dest.exists():
            broken.append(f"{where}: no such file")
        elif fragment and dest.suffix == ".md" and unquote(fragment).lower() not in anchors(dest):
            broken.append(f"{where}: no heading with that anchor in {dest.relative_to(ROOT)}")
    assert not broken, "\n".join(broken)


def test_every_doc_is_linked_from_the_readme():
    linked = set()
    for _, target in links(README):
        file_part = target.partition("#")[0]
        if file_part and not EXTERNAL.match(target):
            linked.add((ROOT / unquote(file_part)).resolve())
    assert docs(), "docs/ holds no markdown file"
    missing = [str(p.relative_to(ROOT)) for p in docs() if p.resolve() not in linked]
    assert not missing, f"docs not linked from README.md: {missing}"
