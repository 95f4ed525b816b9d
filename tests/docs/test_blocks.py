"""Every fenced block of README.md and docs/*.md says what it holds, and every runnable one is
run by a named test (or by .ci/run) or says why it is not: a doc command that stops working
fails CI."""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import REPO
from tests.docs.blocks import (
    NOT_RUN,
    RUN_BY,
    RUNNABLE,
    Block,
    all_blocks,
    blocks,
    doc_files,
    indented_commands,
)


def problems(found: list[Block]) -> list[str]:
    """What is wrong with each block, as ``file:line: what``."""
    wrong: list[str] = []
    for block in found:
        if not block.language:
            wrong.append(f"{block.where}: a fence without a language (say bash, python, text, ...)")
            continue
        if block.language not in RUNNABLE:
            continue
        run_by = RUN_BY.match(block.marker)
        if NOT_RUN.match(block.marker):
            continue
        if run_by is None:
            wrong.append(
                f"{block.where}: a {block.language} block neither run by a test nor marked: put "
                "'<!-- run by tests/docs/FILE.py::TEST -->' or '<!-- not run in CI: REASON -->' "
                "on the line before it (docs/architecture.md, 'Docs are tested')"
            )
            continue
        by = run_by["by"]
        if by == ".ci/run":
            if not _in_a_ci_section(block):
                wrong.append(
                    f"{block.where}: only README's 'Two commands' and 'Testing' are run by .ci/run"
                )
            continue
        file, _, test = by.partition("::")
        source = REPO / file
        if not file.startswith("tests/docs/") or not source.is_file():
            wrong.append(f"{block.where}: {by}: no test file {file} under tests/docs/")
        elif not re.search(rf"^def {re.escape(test)}\(", source.read_text(), re.MULTILINE):
            wrong.append(f"{block.where}: {by}: {file} has no test named {test!r}")
    return wrong


def _in_a_ci_section(block: Block) -> bool:
    if block.path != REPO / "README.md":
        return False
    before = block.path.read_text().splitlines()[: block.line]
    headings = [line for line in before if line.startswith("## ")]
    ci = (REPO / ".ci" / "run").read_text()
    return bool(headings) and headings[-1] in CI_SECTIONS and headings[-1] in ci


CI_SECTIONS = ("## Two commands", "## Testing")
"""README's sections whose blocks .ci/run reads and runs (it names each heading)."""


def test_every_doc_block_is_run_or_says_why_not() -> None:
    found = all_blocks()
    assert len(found) > 20, "the doc pages lost their blocks, or the parser did"
    wrong = problems(found)
    assert not wrong, "\n".join(wrong)


def test_no_command_hides_in_an_indented_block() -> None:
    wrong = [
        f"{path.relative_to(REPO)}:{line}: a command in an indented code block: fence it "
        "(```bash) and mark it (docs/architecture.md, 'Docs are tested')"
        for path in doc_files()
        for line in indented_commands(path)
    ]
    assert not wrong, "\n".join(wrong)


def test_an_indented_command_is_found(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "Run:\n\n    $ dlrover status x\n\n- a list\n\n    continued, not code\n\n"
        "```bash\n\n    dlrover-run --standalone x.py\n```\n\n    PYTHONPATH=. python b.py\n"
    )
    assert indented_commands(page) == [3, 14]


def test_the_checker_names_each_unmarked_block(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "# A page\n\n```\nplain\n```\n\n```bash\necho unmarked\n```\n\n"
        "<!-- not run in CI: needs a GPU -->\n```python\nimport torch\n```\n\n"
        "<!-- run by tests/docs/test_python_api.py::no_such_test -->\n```sh\ntrue\n```\n\n"
        "````text\n```bash\nnot a block of its own\n```\n````\n"
    )
    found = [
        Block(REPO / "docs" / "page.md", b.line, b.language, b.text, b.marker) for b in blocks(page)
    ]
    assert [(b.line, b.language) for b in found] == [(3, ""), (7, "bash"), (12, "python"),
                                                     (17, "sh"), (21, "text")]  # fmt: skip
    assert problems(found) == [
        "docs/page.md:3: a fence without a language (say bash, python, text, ...)",
        "docs/page.md:7: a bash block neither run by a test nor marked: put "
        "'<!-- run by tests/docs/FILE.py::TEST -->' or '<!-- not run in CI: REASON -->' "
        "on the line before it (docs/architecture.md, 'Docs are tested')",
        "docs/page.md:17: tests/docs/test_python_api.py::no_such_test: tests/docs/test_python_api.py "
        "has no test named 'no_such_test'",
    ]
