"""The README and the docs read as written: well-formed tables, whole headings, the README's commands
the user guide's, and config comments that describe their config.

Independent of the generators: the markdown is parsed as a reader's renderer would see it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from megatron_dsa.train import JobConfig

REPO_ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
GUIDE = (REPO_ROOT / "docs" / "user_guide.md").read_text()
README = (REPO_ROOT / "README.md").read_text()
# Words a title does not end on: a sentence cut into pieces ends on them.
DANGLING = {"a", "an", "the", "or", "and", "of", "to", "for", "with", "in", "on", "by", "per"}


def outside_code_blocks(text: str) -> list[tuple[int, str]]:
    """(line number, line) of `text` outside ``` fences."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append((number, line))
    return lines


def cells(row: str) -> list[str]:
    """The cells of a table row `| a | b |`; `\\|` is a pipe inside a cell."""
    return [cell.strip() for cell in re.split(r"(?<!\\)\|", row.strip())[1:-1]]


def tables(text: str) -> list[tuple[int, list[str], list[list[str]]]]:
    """(line number, header cells, body rows) of every pipe table."""
    found, lines = [], outside_code_blocks(text)
    for index, (number, line) in enumerate(lines[:-1]):
        following = lines[index + 1][1]
        if line.startswith("|") and re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", following.strip()):
            body = []
            for _, row in lines[index + 2:]:
                if not row.startswith("|"):
                    break
                body.append(cells(row))
            found.append((number, cells(line), body))
    return found


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda p: p.name)
def test_every_table_has_rows_of_its_headers_width(path: Path) -> None:
    for number, header, body in tables(path.read_text()):
        assert body, f"{path.name}:{number}: the table {header} has no rows"
        for offset, row in enumerate(body, 2):
            assert len(row) == len(header), (f"{path.name}:{number + offset}: {len(row)} cells under "
                                             f"{len(header)} headers: {row}")
            assert any(row), f"{path.name}:{number + offset}: an empty row"


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda p: p.name)
def test_bold_titles_are_whole(path: Path) -> None:
    """A paragraph that is only bold text is a title: it starts a phrase and does not stop mid-sentence
    (a section comment cut into lines rendered as several such titles)."""
    for number, line in outside_code_blocks(path.read_text()):
        title = re.fullmatch(r"\*\*(.+)\*\*", line.strip())
        if title is None:
            continue
        text = title.group(1)
        last = re.sub(r"\W+$", "", text).rsplit(None, 1)[-1].lower()
        assert not text[0].islower(), f"{path.name}:{number}: the title {text!r} starts mid-sentence"
        assert last not in DANGLING and not text.endswith((",", ":", ";")), \
            f"{path.name}:{number}: the title {text!r} stops mid-sentence"


def test_the_check_catches_a_title_split_into_pieces() -> None:
    broken = ("**Kernels: \"auto\" or a**\n\n| field | type |\n|---|---|\n\n"
              "**backend name for every op**\n\n| field | type |\n|---|---|\n| `x` | `int` |\n")
    empty = [header for _, header, body in tables(broken) if not body]
    assert empty == [["field", "type"]]
    titles = [re.fullmatch(r"\*\*(.+)\*\*", line).group(1) for _, line in outside_code_blocks(broken)
              if line.startswith("**")]
    assert titles[0].endswith(" a") and titles[1][0].islower()


def readme_commands() -> list[str]:
    """The README's indented command lines that launch the package's commands."""
    return [line.strip() for line in README.splitlines()
            if re.match(r"^    (torchrun|megatron-dsa|pip install torch)", line)]


def test_readme_commands_are_the_guides() -> None:
    commands = readme_commands()
    assert any(c.startswith("torchrun") for c in commands) and any("--index-url" in c for c in commands)
    for command in commands:
        assert f"`{command}`" in GUIDE, f"README's `{command}` is not in docs/user_guide.md"


def test_readme_main_job_command_is_in_the_guide() -> None:
    main_job = re.search(r"^    pip install -e \. && (megatron-dsa train .*)$", README, re.M).group(1)
    assert f"`{main_job}`" in GUIDE


@pytest.mark.parametrize("path", sorted((REPO_ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_config_comments_count_the_rows_they_have(path: Path) -> None:
    """'N of M rows' / '(X LM rows, Y retrieval row)' comments match the batch the job builds."""
    text = path.read_text()
    train = JobConfig.from_yaml(path).train
    retrieval, rows = train.retrieval_rows, train.batch_size
    for count, total in re.findall(r"(\d+) of (\d+) rows", text):
        assert (int(count), int(total)) == (retrieval, rows), f"{path.name}: '{count} of {total} rows'"
    for count in re.findall(r"(\d+) retrieval rows?\b", text):
        assert int(count) == retrieval, f"{path.name}: '{count} retrieval row(s)'"
    for count in re.findall(r"(\d+) LM rows?\b", text):
        assert int(count) == rows - retrieval, f"{path.name}: '{count} LM row(s)'"
    for count, length in re.findall(r"(\d+) rows of (\d+) tokens", text):
        assert (int(count), int(length)) == (rows, train.seq_len), f"{path.name}: '{count} rows of {length}'"
    assert yaml.safe_load(text)  # the comments did not break the YAML


# ------------------------------------------------------------------------------ section references
# A reference is `docs/<name>.md §N`, optionally a range `§N–M` and more numbers after ", ", " and "
# or "/": e.g. `docs/math.md §7.3`, `docs/math.md §6.1–6.2`, `docs/math.md §4.4, §14`. In prose it may
# read `docs/<name>.md section N` (the name may be in backticks).
SECTION = r"§\d+(?:\.\d+)*(?:–§?\d+(?:\.\d+)*)?"
REFERENCE = re.compile(rf"docs/(\w+)\.md ({SECTION}(?:(?:, | and |/){SECTION})*)")
PROSE_REFERENCE = re.compile(r"docs/(\w+)\.md`? (sections? \d+(?:\.\d+)*(?:(?:, | and |–)\d+(?:\.\d+)*)*)")
# Every file of the repository that may cite a section: code, docs, configs (hidden folders left out).
REFERRING_FILES = sorted(path for pattern in ("*.py", "*.md", "*.yaml", "*.toml", "*.txt")
                         for path in REPO_ROOT.rglob(pattern)
                         if not any(part.startswith(".") for part in path.relative_to(REPO_ROOT).parts)
                         and path != Path(__file__).resolve())


def numbered_sections(document: str) -> set[str]:
    """Section numbers of headings like `## 7. Sparse attention` or `### 7.3 Backward`."""
    return set(re.findall(r"^#{2,4} (\d+(?:\.\d+)*)\.? ", document, re.M))


def section_reference_problems(text: str, sections: dict[str, set[str]]) -> list[str]:
    """Each `§` of `text` that is not part of a reference, or names a document or section that does not
    exist. `sections` maps a document name (`math`) to its section numbers."""
    problems, covered = [], set()
    for match in (*REFERENCE.finditer(text), *PROSE_REFERENCE.finditer(text)):
        covered.update(range(*match.span()))
        name = match.group(1)
        for number in re.findall(r"\d+(?:\.\d+)*", match.group(2)):
            if number not in sections.get(name, set()):
                problems.append(f"docs/{name}.md has no section {number} (cited as {match.group(0)!r})")
    for index in (i for i, char in enumerate(text) if char == "§" and i not in covered):
        line = text.count("\n", 0, index) + 1
        problems.append(f"line {line}: '§' outside a docs/<name>.md reference: "
                        f"{text.splitlines()[line - 1].strip()!r}")
    return problems


DOCUMENT_SECTIONS = {path.stem: numbered_sections(path.read_text())
                     for path in (REPO_ROOT / "docs").glob("*.md")}


@pytest.mark.parametrize("path", REFERRING_FILES, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_section_references_name_sections_that_exist(path: Path) -> None:
    """No `spec §N` of a document outside the repo; every `docs/x.md §N` names a heading of docs/x.md."""
    text = path.read_text()
    assert "spec §" not in text.lower(), f"{path.name} cites the spec, which is not in the repo"
    assert not section_reference_problems(text, DOCUMENT_SECTIONS), \
        f"{path.name}: " + "; ".join(section_reference_problems(text, DOCUMENT_SECTIONS))


def test_the_section_check_catches_stray_and_missing_sections() -> None:
    sections = {"math": {"7", "7.3", "8", "8.2", "14"}}
    good = "see docs/math.md §7.3 and docs/math.md §8–8.2, §14 / docs/math.md §7/§8"
    assert section_reference_problems(good, sections) == []
    assert section_reference_problems("(spec §5)", sections) == [
        "line 1: '§' outside a docs/<name>.md reference: '(spec §5)'"]
    assert section_reference_problems("docs/math.md §7.4", sections) == [
        "docs/math.md has no section 7.4 (cited as 'docs/math.md §7.4')"]
    assert section_reference_problems("docs/math.md §8–9", sections) == [
        "docs/math.md has no section 9 (cited as 'docs/math.md §8–9')"]
    assert section_reference_problems("docs/kernels.md §1", sections) == [
        "docs/kernels.md has no section 1 (cited as 'docs/kernels.md §1')"]
    assert section_reference_problems("see `docs/math.md` section 7 and docs/math.md sections 8–8.2", sections) == []
    assert section_reference_problems("docs/math.md section 9", sections) == [
        "docs/math.md has no section 9 (cited as 'docs/math.md section 9')"]
    assert numbered_sections("## 7. Sparse attention\n### 7.3 Backward\n#### 7.3.1 Sink\n## Notes\n") \
        == {"7", "7.3", "7.3.1"}
