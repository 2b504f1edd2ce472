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
