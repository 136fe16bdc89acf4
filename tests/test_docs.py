"""The docs ship with the code: no file of the repository refers to a file outside it, every ``docs/NAME.md`` and
``docs/NAME.md §N`` citation names a page and a section heading that exist, docs/README.md indexes every page, and
docs/targets.md holds exactly the figures of each target file."""
from __future__ import annotations

import re
import subprocess
from collections.abc import Mapping
from pathlib import Path, PurePosixPath

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]

# Names of files that live outside the repository (the shared notes of the people who wrote it) and machine paths.
# Spelled in pieces so that this file does not match itself.
OUTSIDE = re.compile("|".join([r"\.\./shared", r"\bFAC" r"TS\b", r"\bDES" r"IGN\.md\b", r"\bPLAT" r"FORM\.md\b",
                               r"\bseed" r"s/", r"/wo" r"rk/"]))

_NUM = r"\d+(?:\.\d+)*"
# "§4.1", "§2–3", "§4, §6": the first section, then ranges and list items that follow it directly
_SECTIONS = rf"§({_NUM})((?:\s*[–-]\s*{_NUM}|,\s*§{_NUM})*)"
# docs/NAME.md anywhere, then an optional markdown link target and closing bracket, then optionally its section:
# "docs/x.md §2", "[docs/x.md §2](docs/x.md)". Not inside a longer path (a URL's .../blob/<sha>/docs/x.md), nor
# pinned to a commit ("owner/repo docs/x.md @0123abc": another repository's file).
DOC_CITATION = re.compile(rf"(?<![\w/.-])docs/([\w.-]+\.md)(?!\s*@[0-9a-f]{{7}})"
                          rf"(?:\]\([^)\s]*\))?\)?[\"',]?\s?(?:{_SECTIONS})?")
# inside docs/: a sibling page cited with a section, "step-model.md §4", "[step-model.md §2, §4](step-model.md)"
SIBLING_CITATION = re.compile(rf"(?<![\w/.-])([\w-]+\.md)(?:\]\([^)\s]*\))?\)?\s?{_SECTIONS}")
# a relative markdown link to a .md file, "[text](path.md)" or "(path.md#anchor)"
MD_LINK = re.compile(r"\]\((?!\w+://)([^)\s#]+\.md)(?:#[^)\s]*)?\)")
HEADING_NUMBER = re.compile(rf"^#{{1,6}}\s+§?({_NUM})(?=[.\s])", re.M)
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def repo_files() -> dict[str, str]:
    """Text of every file git tracks or would track (untracked but not ignored), by POSIX path from the root."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, check=True).stdout.decode()
    files = {}
    for name in filter(None, out.split("\0")):
        path = ROOT / name
        if not path.is_file():
            continue  # deleted in the working tree
        try:
            files[name] = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # binary
    return files


def _line(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def outside_references(files: Mapping[str, str]) -> list[str]:
    """``path:line: text`` for every mention of a file outside the repository."""
    return [f"{name}:{_line(text, m.start())}: refers outside the repository: {m.group(0)!r}"
            for name, text in files.items() for m in OUTSIDE.finditer(text)]


def doc_sections(files: Mapping[str, str]) -> dict[str, set[str]]:
    """Section numbers per docs page: the leading number of each heading outside code blocks (``## §4.1 ...``,
    ``## 3. ...``)."""
    return {PurePosixPath(name).name: set(HEADING_NUMBER.findall(FENCE.sub("", text)))
            for name, text in files.items() if name.startswith("docs/") and name.endswith(".md")}


def _numbers(first: str, rest: str) -> list[str]:
    return [first, *re.findall(_NUM, rest)]


def citation_problems(files: Mapping[str, str]) -> list[str]:
    """``path:line: problem`` for every citation of a docs page or section that does not exist, and every relative
    markdown link to a .md file that does not resolve to a file of the repository."""
    sections = doc_sections(files)
    problems = []

    def check(name: str, text: str, pos: int, page: str, first: str | None, rest: str) -> None:
        where = f"{name}:{_line(text, pos)}"
        if page not in sections:
            problems.append(f"{where}: docs/{page} does not exist")
            return
        for number in _numbers(first, rest) if first else []:
            if number not in sections[page]:
                problems.append(f"{where}: docs/{page} has no section §{number}")

    for name, text in files.items():
        for m in DOC_CITATION.finditer(text):
            check(name, text, m.start(), m.group(1), m.group(2), m.group(3) or "")
        if not name.endswith(".md"):
            continue
        if name.startswith("docs/"):
            for m in SIBLING_CITATION.finditer(text):
                check(name, text, m.start(), m.group(1), m.group(2), m.group(3))
        for m in MD_LINK.finditer(text):
            target = (ROOT / PurePosixPath(name).parent / m.group(1)).resolve()
            rel = target.relative_to(ROOT).as_posix() if target.is_relative_to(ROOT) else None
            if rel not in files:
                problems.append(f"{name}:{_line(text, m.start())}: link to {m.group(1)} does not resolve")
    return problems


def test_nothing_refers_to_a_file_outside_the_repository() -> None:
    assert outside_references(repo_files()) == []


def test_every_docs_citation_names_a_page_and_section_that_exist() -> None:
    files = repo_files()
    del files["tests/test_docs.py"]  # it plants bad citations on purpose
    assert citation_problems(files) == []


def test_the_checks_catch_planted_errors_and_pass_legitimate_text() -> None:
    docs = {name: text for name, text in repo_files().items() if name.startswith("docs/")}
    outside = "../" "shared"  # in pieces, as OUTSIDE
    bad = {
        "moeplan/planted.py": '"""Bubble (docs/references.md §4.9), MFU (docs/refs.md §4.1), see docs/gone.md;\n'
                              f'memory (docs/references.md §4.2–9), {outside}/x."""',
        "docs/planted.md": "As [step-model.md §12](step-model.md) says; [page](missing.md).\n",
    }
    found = [p for p in citation_problems(docs | bad) + outside_references(bad) if p.startswith(tuple(bad))]
    assert sorted(p.split(": ", 1)[1] for p in found) == sorted([
        "docs/references.md has no section §4.9", "docs/refs.md does not exist", "docs/gone.md does not exist",
        "docs/references.md has no section §9", "docs/step-model.md has no section §12",
        "link to missing.md does not resolve", f"refers outside the repository: {outside!r}"])
    good = {
        "benchmarks/ok.yaml": "ref: https://github.com/o/r/blob/0123abc/docs/performance-summary.md, nccl-tests "
                              "doc/PERFORMANCE.md, arXiv 2412.19437 §3.2, MindSpeed megatron-moe-fb-overlap.md "
                              "@028de58; docs/references.md §4.1, §4.2; docs/references.md §2–3; "
                              "docs/references.md §3.2's sketch; facts of the simulator; NVIDIA-NeMo/Automodel "
                              "docs/performance-summary.md @89e3a9fdd6\n",
        "docs/ok.md": "[docs/step-model.md §4](step-model.md) and [step-model.md §2, §4](step-model.md#x); "
                      "docs/memory.md §3\n",
    }
    assert [p for p in citation_problems(docs | good) if p.startswith(tuple(good))] + outside_references(good) == []


def test_docs_index_links_every_page() -> None:
    files = repo_files()
    index = files["docs/README.md"]
    linked = set(MD_LINK.findall(index))
    pages = {PurePosixPath(n).name for n in files if n.startswith("docs/") and n.endswith(".md")} - {"README.md"}
    assert pages - linked == set()


def _flatten(value: object, prefix: str = "") -> dict[str, object]:
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in _flatten(item, f"{prefix}{key}.").items()}
    return {prefix[:-1]: value}


def _tables(page: str) -> dict[str, dict[str, object]]:
    """docs/targets.md's tables: per ``## `name``` section, field → value (each cell read as YAML)."""
    tables: dict[str, dict[str, object]] = {}
    for section in re.split(r"^## ", page, flags=re.M)[1:]:
        title, body = section.split("\n", 1)
        if m := re.fullmatch(r"`([\w.-]+)`", title.strip()):
            rows = re.findall(r"^\| `([\w.]+)` \| `([^`]*)` \|", body, re.M)
            tables[m.group(1)] = {field: yaml.safe_load(cell) for field, cell in rows}
    return tables


def test_targets_page_holds_exactly_each_target_files_figures() -> None:
    tables = _tables((ROOT / "docs" / "targets.md").read_text(encoding="utf-8"))
    targets = {p.stem: p for p in (ROOT / "targets").glob("*.yaml")}
    assert set(tables) == set(targets)
    for name, path in targets.items():
        assert tables[name] == _flatten(yaml.safe_load(path.read_text(encoding="utf-8"))), name
