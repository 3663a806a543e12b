"""The documentation's links resolve, and every doc path the code cites exists.

- Every relative link in README.md and docs/*.md names an existing file (or folder), and a
  ``#anchor`` names a heading of the linked Markdown file (GitHub's slugs).
- Every ``docs/....md`` cited in mlxspec/, app/ and tests/ exists, and a section it cites
  (``docs/acceptance.md 2.4``) is a heading of that file; no bare ``heads.md`` / ``DESIGN.md``
  (files outside the repository) is cited.
- No tracked file outside tests/ names a path on the machine it was made on (``/work/...``,
  ``/root/...``, ``/home/...``, ``/tmp/...``, ``/Users/...``): docs, README, scripts and the JSON
  records and training records that ship.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: The manual: what each feature is, how to use it, what it costs (issue 51: readable in an evening). Every
#: page under docs/ except the archive of dated runs (docs/archive/), in whatever folder it sits.
MANUAL = sorted(p for p in (ROOT / "docs").rglob("*.md")
                if "archive" not in p.relative_to(ROOT / "docs").parts)
#: Every page whose links must resolve: the README, the manual and its archive of dated runs (docs/archive/).
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
CODE = [p for d in ("mlxspec", "app", "tests") for p in sorted((ROOT / d).rglob("*.py"))
        if p.resolve() != Path(__file__).resolve()]

LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)
MACHINE_PATH = re.compile(r"(?<![\w.~/-])/(?:work|root|home|tmp|Users)/[\w.-]+")
CITED_DOC = re.compile(
    r"(?<![\w./-])((?:[\w.-]+/)*[\w.-]+\.md)(?:\s+(?:rule\s+|section\s+|§)?(\d+(?:\.\d+)*))?"
)


def _prose(path: Path) -> str:
    """The file without fenced code blocks (commands there are not links)."""
    return FENCE.sub("", path.read_text(encoding="utf-8"))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: inline markup dropped, lower case, punctuation removed, spaces to
    '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # [text](url) -> text
    text = re.sub(r"[`*~]", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(_prose(path)):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def headings(path: Path) -> list[str]:
    return HEADING.findall(_prose(path))


def links(path: Path) -> list[str]:
    return [target for target in LINK.findall(_prose(path))
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target)]  # http:, https:, mailto: ...


def test_there_are_docs():
    assert (ROOT / "docs").is_dir() and len(DOCS) > 1


def test_slug_matches_github():
    assert slug("2.4 Tree, deterministic children (q one-hot)") == "24-tree-deterministic-children-q-one-hot"
    assert slug("`mlxspec generate`") == "mlxspec-generate"
    assert slug("Drafters on the held-out prompts") == "drafters-on-the-held-out-prompts"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc: Path):
    broken = []
    for target in links(doc):
        file_part, _, anchor = target.partition("#")
        linked = (doc.parent / file_part).resolve() if file_part else doc
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor.lower() not in anchors(linked):
            broken.append(f"{target}: no heading with anchor #{anchor}")
    assert not broken, f"{doc.relative_to(ROOT)}: " + "; ".join(broken)


def _citations():
    for path in CODE:
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            for m in CITED_DOC.finditer(line):
                yield path.relative_to(ROOT), n, m.group(1), m.group(2)


def test_cited_doc_paths_exist():
    broken = []
    for where, n, name, section in _citations():
        if name.lower() in ("readme.md",) or name.startswith("docs/") or name in ("heads.md", "DESIGN.md"):
            target = ROOT / name
            if not target.is_file():
                broken.append(f"{where}:{n}: {name} is not a file in the repository")
            elif section and not any(h.split()[0] == section for h in headings(target)):
                broken.append(f"{where}:{n}: {name} has no section {section}")
    assert not broken, "\n".join(broken)


def test_code_cites_docs():
    """The re-pointed citations are there to check (the scan above is not vacuous)."""
    cited = {name for _, _, name, _ in _citations()}
    assert {"docs/acceptance.md", "docs/heads.md"} <= cited


def test_ci_runs_the_readmes_test_command():
    """.ci/run runs the README's quick-start test command verbatim."""
    blocks = re.findall(r"^```bash\n(.*?)^```", (ROOT / "README.md").read_text(encoding="utf-8"), re.S | re.M)
    commands = [line for b in blocks for line in b.splitlines() if "pytest" in line and "pip install" in line]
    assert commands, "the README has no install-and-test command"
    assert commands[0] in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()


#: The README is a product page (issue 44): manuals, methods and results live in docs/.
README_MAX_WORDS = 1500
README_MAX_LINE = 200
RUN_LETTER = re.compile(r"\b[Rr]uns? [A-Z]\d?\b(?:(?:, | and )[A-Z]\d?\b)*")


def readme_prose(text: str) -> list[str]:
    """The README's lines outside fenced code and tables."""
    return [line for line in FENCE.sub("", text).splitlines() if not line.lstrip().startswith("|")]


def test_readme_is_a_product_page():
    """At most 1,500 words, no prose line over 200 characters, no benchmark runs named by letter (those
    live in docs/archive/results-archive.md)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.split()) <= README_MAX_WORDS
    assert [line for line in readme_prose(text) if len(line) > README_MAX_LINE] == []
    assert RUN_LETTER.findall(text) == []


#: Issue 51: a manual a newcomer can read in an evening. Never raise it; a new page makes room by cutting
#: repetition, history or dated numbers (those go to docs/archive/).
MANUAL_MAX_WORDS = 20_000


def test_the_manual_stays_readable_and_holds_no_run_logs():
    """Every page under docs/ but docs/archive/ is the manual: bounded in words, and no section of it is a
    dated benchmark run (``### Run K: ...``); those live in docs/archive/, linked from the pages they
    support."""
    words = sum(len(p.read_text(encoding="utf-8").split()) for p in MANUAL)
    assert words <= MANUAL_MAX_WORDS, f"the manual has {words} words; move dated runs to docs/archive/"
    runs = [f"{p.name}: {h}" for p in MANUAL for h in headings(p) if RUN_LETTER.match(h)]
    assert runs == [], runs


def test_the_readme_checks_catch_what_they_forbid():
    assert RUN_LETTER.findall("as run E showed; runs S, T and V; Run K2") == [
        "run E",
        "runs S, T and V",
        "Run K2",
    ]
    assert RUN_LETTER.findall("a run of 4 prompts; runs a chain; run `mlxspec bench`") == []
    prose = readme_prose("para\n| " + "x" * 300 + " |\n```bash\n" + "y" * 300 + "\n```\n")
    assert [line for line in prose if line] == ["para"]


def test_no_merge_conflict_markers():
    """No README, doc, module or test keeps a merge's conflict markers (one did: docs/drafters.md)."""
    # the opening and closing markers only: a line of "=" alone is also a Markdown heading underline
    marker = re.compile("^(" + "<" * 7 + "|" + ">" * 7 + ") ", re.M)
    files = [*DOCS, *CODE, ROOT / "pyproject.toml", Path(__file__)]
    found = [f"{p.relative_to(ROOT)}:{p.read_text(encoding='utf-8')[:m.start()].count(chr(10)) + 1}"
             for p in files for m in marker.finditer(p.read_text(encoding="utf-8"))]
    assert not found, "conflict markers left by a merge: " + ", ".join(found)


def test_the_machine_path_check_finds_one():
    assert MACHINE_PATH.findall(
        '"checkpoint": "/work/qwen05/mtp/epoch-1", /root/x /Users/me/a /tmp/b /home/c'
    ) == ["/work/qwen05", "/root/x", "/Users/me", "/tmp/b", "/home/c"]
    assert MACHINE_PATH.findall("https://github.com/work/x ~/home/x models/tmp/x docs/work/x") == []


def test_no_machine_paths_in_tracked_files():
    """Records say where things are relative to the repository or as placeholders (CORPUS, OUTPUT), never
    where they were on the machine that made them."""
    names = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    found = []
    for name in filter(None, names.split("\0")):
        path = ROOT / name
        if name.startswith("tests/") or not path.is_file() or path.suffix not in (
                ".md", ".json", ".jsonl", ".sh", ".py", ".toml", ".txt", ".tcss", ".cfg", ".yml", ".yaml",
                ""):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        found += [f"{name}: {m}" for m in sorted(set(MACHINE_PATH.findall(text)))]
    assert not found, found[:20]
