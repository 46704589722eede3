"""The repository's cross-references hold, read from `git ls-files` (pure text, no imports of k3ray):

- every relative markdown link `[x](path)` / `[x](path#anchor)` of a tracked *.md names a tracked file
  or folder inside the repository, and an anchor into a markdown file names one of its headings
  (GitHub's slugs);
- every `<file>.md §N[.N]` citation in tracked code and docs names a tracked markdown file with a
  heading numbered N[.N] (also each `, §M` and `-M` after it);
- nothing names a path outside the repository (a sibling checkout, an absolute machine path)."""

from __future__ import annotations

import os
import re
import subprocess
from collections import Counter
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
ME = Path(__file__).resolve().relative_to(ROOT).as_posix()  # its planted cases are not the repository's
CITING = ("*.py", "*.md", "*.sh", "*.yaml", "*.yml", "*.toml")

FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1[^\n]*$", re.S | re.M)
CODE_SPAN = re.compile(r"(`+)(?!`).*?(?<!`)\1(?!`)", re.S)
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^()\s<>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.M)
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
ATX = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)(?:\s+#+)?\s*$")
SETEXT = re.compile(r"^ {0,3}(=+|-+)\s*$")
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"", re.I)
NUMBERED = re.compile(r"^(\d+(?:\.\d+)*)\.?(?:\s|$)")
SECTION = r"\d+(?:\.\d+)*"
CITATION = re.compile(rf"([\w./-]*[\w-]\.md)\s+§\s?({SECTION})((?:\s*,\s*§\s?{SECTION}|\s*[-–]\s*§?{SECTION})*)")
URL = re.compile(r"[a-zA-Z][a-zA-Z0-9+.-]*://\S+")
OUTSIDE = {  # a path this repository must not name -> the pattern that finds it
    "a sibling folder ../shared": re.compile(r"\.\./shared\b"),
    "a sibling folder ../.library": re.compile(r"\.\./\.library\b"),
    "a research/ folder outside the repository": re.compile(r"(?<![\w.-])research/"),
    "a citation of the research notes (cite docs/k3-architecture.md)": re.compile(r"\b[Rr]esearch\s+§"),
    "an absolute /work/ path": re.compile(r"(?<![\w.~/-])/work/"),
}


def tracked(*patterns: str) -> list[str]:
    """Tracked paths (relative, '/'-separated) that exist in the working tree."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--", *patterns], cwd=ROOT, capture_output=True,
                             check=True).stdout.decode()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return sorted(p for p in out.split("\0") if p and (ROOT / p).is_file())


def prose(text: str) -> str:
    """Markdown without fenced code blocks and code spans (same line count)."""
    text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    return CODE_SPAN.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: its text lower-cased, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link counts by its text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def headings(text: str) -> list[str]:
    """ATX and setext heading texts, outside code blocks."""
    lines = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text).split("\n")
    found = []
    for i, line in enumerate(lines):
        if m := ATX.match(line):
            found.append(m.group(2))
        elif i and SETEXT.match(line) and _paragraph(lines[i - 1]):
            found.append(lines[i - 1].strip())
    return found


def _paragraph(line: str) -> bool:
    """A line a setext underline turns into a heading (not blank, not a table row, list item or quote)."""
    return bool(line.strip()) and not line.lstrip().startswith(("|", "-", "*", ">"))


def anchors(text: str) -> set[str]:
    seen: Counter[str] = Counter()
    out = set(HTML_ANCHOR.findall(text))
    for heading in headings(text):
        base = slug(heading)
        out.add(base if not seen[base] else f"{base}-{seen[base]}")
        seen[base] += 1
    return out


def line_of(text: str, index: int) -> int:
    return text.count("\n", 0, index) + 1


class Repo:
    def __init__(self) -> None:
        self.files = set(tracked())
        self.folders = {str(Path(p).parent.as_posix()) for p in self.files}
        self.folders |= {f for d in list(self.folders) for f in _parents(d)}
        self._anchors: dict[str, set[str]] = {}

    def relative(self, base: str, target: str) -> str | None:
        """`target` relative to the folder of tracked file `base`, as a repository path; None outside it."""
        joined = os.path.normpath(os.path.join(os.path.dirname(base), target)).replace(os.sep, "/")
        return None if joined == ".." or joined.startswith(("../", "/")) else joined

    def exists(self, path: str) -> bool:
        return path in self.files or path.rstrip("/") in self.folders or path in ("", ".")

    def anchors(self, path: str) -> set[str]:
        if path not in self._anchors:
            self._anchors[path] = anchors((ROOT / path).read_text(encoding="utf-8"))
        return self._anchors[path]


def _parents(folder: str) -> list[str]:
    parts = folder.split("/")
    return ["/".join(parts[:i]) for i in range(1, len(parts))]


@pytest.fixture(scope="module")
def repo() -> Repo:
    return Repo()


def broken_links(repo: Repo, md: str) -> list[str]:
    text = prose((ROOT / md).read_text(encoding="utf-8"))
    found = [(m.start(1), m.group(1)) for m in INLINE_LINK.finditer(text)]
    found += [(m.start(1), m.group(1)) for m in REFERENCE_DEF.finditer(text)]
    broken = []
    for index, target in found:
        if not target or SCHEME.match(target) or target.startswith("//"):
            continue
        path, _, anchor = unquote(target).partition("#")
        where = f"{md}:{line_of(text, index)}: ({target})"
        resolved = md if path == "" else repo.relative(md, path)
        if resolved is None:
            broken.append(f"{where} leaves the repository")
        elif not repo.exists(resolved):
            broken.append(f"{where} names no tracked file or folder ({resolved})")
        elif anchor and resolved.endswith(".md") and anchor not in repo.anchors(resolved):
            broken.append(f"{where} names no heading of {resolved}")
    return broken


def test_markdown_links_resolve(repo):
    broken = [b for md in tracked("*.md") for b in broken_links(repo, md)]
    assert not broken, "broken markdown links:\n" + "\n".join(broken)


def section_numbers(text: str) -> set[str]:
    return {m.group(1) for h in headings(text) if (m := NUMBERED.match(h.strip()))}


def cited_sections(first: str, rest: str) -> list[str]:
    return [first, *re.findall(SECTION, rest)]


def broken_citations(repo: Repo, path: str) -> list[str]:
    text = (ROOT / path).read_text(encoding="utf-8")
    broken = []
    for m in CITATION.finditer(text):
        name, where = m.group(1), f"{path}:{line_of(text, m.start())}: {m.group(0).strip()!r}"
        candidates = [repo.relative(path, name), os.path.normpath(name).replace(os.sep, "/")]
        target = next((c for c in candidates if c and c in repo.files), None)
        if target is None:
            broken.append(f"{where} names no tracked file (from the repository root or {path}'s folder)")
            continue
        numbers = section_numbers((ROOT / target).read_text(encoding="utf-8"))
        missing = [n for n in cited_sections(m.group(2), m.group(3)) if n not in numbers]
        if missing:
            broken.append(f"{where}: {target} has no heading numbered {', '.join(missing)}")
    return broken


def test_section_citations_name_existing_headings(repo):
    broken = [b for path in tracked(*CITING) if path != ME for b in broken_citations(repo, path)]
    assert not broken, "citations of missing sections:\n" + "\n".join(broken)


def outside_references(path: str) -> list[str]:
    data = (ROOT / path).read_bytes()
    if b"\0" in data:
        return []
    text = data.decode("utf-8", errors="replace")
    scrubbed = URL.sub(lambda m: " " * len(m.group(0)), text)
    return [f"{path}:{line_of(text, m.start())}: {what}: {text[m.start():m.start() + 60].splitlines()[0]!r}"
            for what, pattern in OUTSIDE.items() for m in pattern.finditer(scrubbed)]


def test_nothing_names_a_path_outside_the_repository():
    found = [f for path in tracked() if path != ME for f in outside_references(path)]
    assert not found, "references outside the repository:\n" + "\n".join(found)


def test_the_checks_catch_what_they_look_for(repo):
    """Each check's parts on planted cases: what must be found is found, what must pass passes."""
    doc = ("# T\n\n## 2. Two\n\n### 2.1 Sub part\n\n## 2. Two\n\nSee [two](#21-sub-part), [x](missing.md), "
           "[y](#nope), [z](../../outside.md), `[code](ignored.md)`.\n\n```\n[fenced](ignored.md)\n```\n")
    assert anchors(doc) == {"t", "2-two", "21-sub-part", "2-two-1"}
    assert slug("8. MXFP4 / MXFP8") == "8-mxfp4--mxfp8"
    assert slug("6. Stable LatentMoE (layers 1–92)") == "6-stable-latentmoe-layers-192"
    targets = [m.group(1) for m in INLINE_LINK.finditer(prose(doc))]
    assert targets == ["#21-sub-part", "missing.md", "#nope", "../../outside.md"]
    assert repo.relative("docs/a.md", "../../outside.md") is None
    assert repo.relative("docs/a.md", "b.md") == "docs/b.md" and repo.exists("docs") and not repo.exists("docs/nope.md")
    assert section_numbers(doc) == {"2", "2.1"}
    m = CITATION.search("as in other.md §7.2-7.3, §12 step 4")
    assert m and cited_sections(m.group(2), m.group(3)) == ["7.2", "7.3", "12"]
    bad = ["../shared/BENCHMARKS.md", "see research/k3-architecture.md", "research §7.3", "/work/notes/x.md"]
    assert all(any(p.search(s) for p in OUTSIDE.values()) for s in bad)
    good = ["https://example.org/work/research/x", "k3ray/bench/work/x", "docs/k3-architecture.md §7.3"]
    assert not any(p.search(URL.sub(" ", s)) for s in good for p in OUTSIDE.values())
