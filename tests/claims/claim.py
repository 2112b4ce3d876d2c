"""The doc-claims suite's one helper: a test names the sentence of a user page it backs.

`@claim("docs/faq.md", "d |= {...}")` checks, when the test runs, that the page still says
that text (whitespace and Markdown emphasis aside): a test whose sentence was reworded or
removed fails, so the claim and its test change together. `claims_of(page)` lists every
sentence claimed so far, for the coverage check of each page's test file.
"""

from __future__ import annotations

import functools
import pathlib
import re
from collections.abc import Callable
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[2]
_CLAIMED: dict[str, list[str]] = {}


def normalise(text: str) -> str:
    """Text as compared: Markdown emphasis and backslash escapes dropped, whitespace one
    space."""
    text = re.sub(r"\*\*|__", "", text)
    text = text.replace("\\|", "|")
    return re.sub(r"\s+", " ", text).strip()


@functools.cache
def page(path: str) -> str:
    return normalise((ROOT / path).read_text())


def claim(path: str, text: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Mark a test as the evidence for `text` on the page `path` (relative to the repository)."""
    _CLAIMED.setdefault(path, []).append(text)

    def mark(test: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(test)
        def run(*args: Any, **kwargs: Any) -> Any:
            assert normalise(text) in page(path), f"{path} no longer says: {text!r}"
            return test(*args, **kwargs)

        return run

    return mark


def claims_of(path: str) -> list[str]:
    return list(_CLAIMED.get(path, ()))
