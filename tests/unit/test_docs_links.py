"""Every relative link in README.md and docs/*.md leads somewhere: the file exists in the repository
and, with a #fragment, the target page has a heading of that anchor (GitHub's slugs)."""

from __future__ import annotations

import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _pages() -> list[str]:
    docs = os.path.join(REPO, "docs")
    return [os.path.join(REPO, "README.md")] + sorted(
        os.path.join(docs, name) for name in os.listdir(docs) if name.endswith(".md"))


def _without_code(text: str) -> str:
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    text = re.sub(r"[^\w\- ]", "", text.replace("`", ""))
    return text.replace(" ", "-")


def _anchors(path: str) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for line in re.sub(r"```.*?```", "", open(path).read(), flags=re.S).splitlines():
        m = re.match(r"#{1,6}\s+(.*)", line)
        if not m:
            continue
        slug = _slug(m.group(1))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def _local_links(path: str) -> list[str]:
    return [t for t in LINK.findall(_without_code(open(path).read()))
            if not re.match(r"[a-z][a-z0-9+.-]*:", t)]  # http:, https:, mailto: are not checked here


def test_docs_exist():
    names = {os.path.basename(p) for p in _pages()}
    assert {"README.md", "architecture.md", "benchmarks.md", "environment.md"} <= names, names


def test_every_local_link_resolves():
    broken = []
    for page in _pages():
        for target in _local_links(page):
            file_part, _, fragment = target.partition("#")
            dest = os.path.normpath(os.path.join(os.path.dirname(page), file_part)) if file_part else page
            where = f"{os.path.relpath(page, REPO)} -> {target}"
            if not os.path.exists(dest):
                broken.append(f"{where}: no such file")
            elif fragment and dest.endswith(".md") and fragment not in _anchors(dest):
                broken.append(f"{where}: no heading with that anchor")
    assert not broken, "\n".join(broken)


def test_the_checker_sees_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n[ok](#title) [gone](missing.md) [bad](#nowhere) `[code](x.md)`\n")
    assert _local_links(str(page)) == ["#title", "missing.md", "#nowhere"]
    assert _anchors(str(page)) == {"title"}
    assert _slug("DeepSeek-V3 / R1 graph") == "deepseek-v3--r1-graph"
    assert _slug("Parallelism (multi-process, torch.distributed)") == "parallelism-multi-process-torchdistributed"
