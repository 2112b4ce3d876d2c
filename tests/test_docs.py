"""Every ```python block in docs/ runs.

Each page is one test: its blocks run in order in one shared namespace, so a block can use
the names an earlier block of the same page defined. A block is skipped only when the line
just before its opening fence is `<!-- skip-test -->` (for code that cannot run here, such as
code that needs a GPU).

Blocks are compiled under the Markdown file's own path with their real line numbers, so a
function defined in a block has readable source (`inspect.getsource`, which autoflat needs)
and a failure points at the page and line.

A ```text block that starts with `# autoflat: generated from` is pasted `autoflat.show`
output: it must equal what `autoflat.show` returns now for the step it names (or its first
lines, for an excerpt such as the header), up to file names and line numbers, so the docs
cannot drift from the generated code.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
import sys
import textwrap
import types

import pytest

import autoflat

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"
SKIP = "<!-- skip-test -->"
_OPEN = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<lang>[\w+-]*)")
_SHOW_HEADER = re.compile(r"^# autoflat: generated from `(?P<name>[^`]+)` at ")


@dataclasses.dataclass(frozen=True)
class Block:
    lang: str
    line: int  # 1-based line of the first line of code (the line after the opening fence)
    code: str
    skip: bool


def blocks(path: pathlib.Path) -> list[Block]:
    """The fenced code blocks of a Markdown page, in order (indented fences included)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    found = []
    i = 0
    while i < len(lines):
        m = _OPEN.match(lines[i])
        if m is None:
            i += 1
            continue
        indent, fence, lang = m["indent"], m["fence"], m["lang"]
        skip = i > 0 and lines[i - 1].strip() == SKIP
        body = []
        j = i + 1
        while j < len(lines):
            stripped = lines[j].strip()
            if stripped.startswith(fence) and stripped.strip(fence[0]) == "":
                break
            body.append(lines[j][len(indent) :] if lines[j].startswith(indent) else lines[j])
            j += 1
        else:
            raise AssertionError(f"{path}:{i + 1}: unclosed code fence")
        found.append(Block(lang, i + 2, "\n".join(body) + "\n", skip))
        i = j + 1
    return found


def _normalize_show(text: str) -> str:
    """Generated code with its file names and line numbers blanked out."""
    text = re.sub(r"(generated from `[^`]+` at )\S+:\d+", r"\1FILE:LINE", text)
    text = re.sub(r"(# body of \S+ \()\S+:\d+-\d+\)", r"\1FILE:LINES)", text)
    return text.strip()


def _check_show(block: Block, namespace: dict, path: pathlib.Path) -> None:
    name = _SHOW_HEADER.match(block.code)["name"]  # type: ignore[index]
    fn = namespace.get(name.split(".")[0])
    assert isinstance(fn, autoflat.Step), (
        f"{path}:{block.line}: pasted autoflat.show output for `{name}`, but no step of that "
        "name was defined by an earlier block of the page"
    )
    actual = autoflat.show(fn)
    pasted = _normalize_show(block.code).splitlines()
    assert pasted == _normalize_show(actual).splitlines()[: len(pasted)], (
        f"{path}:{block.line}: the pasted autoflat.show output is out of date; it is now:\n{actual}"
    )


PAGES = sorted(DOCS.rglob("*.md"))


def test_docs_have_pages():
    assert PAGES, f"no Markdown pages under {DOCS}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(DOCS)))
def test_page(page: pathlib.Path, monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path):
    monkeypatch.chdir(tmp_path)  # blocks that write files write them here
    name = "autoflat_docs_" + re.sub(r"\W", "_", str(page.relative_to(DOCS).with_suffix("")))
    module = types.ModuleType(name)
    module.__file__ = str(page)
    # A real module, so classes defined in a block can be pickled and dataclasses can find it.
    monkeypatch.setitem(sys.modules, name, module)
    namespace = module.__dict__
    for block in blocks(page):
        if block.skip:
            continue
        if block.lang == "text" and _SHOW_HEADER.match(block.code):
            _check_show(block, namespace, page)
        if block.lang != "python":
            continue
        # Pad with blank lines so line numbers in the compiled code are the page's own.
        source = "\n" * (block.line - 1) + textwrap.dedent(block.code)
        exec(compile(source, str(page), "exec"), namespace)
    autoflat.clear_caches()
