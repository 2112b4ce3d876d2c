"""The one registry of autoflat's caches, so that `autoflat.clear_caches()` empties them all.

A module that keeps a cache registers the function that clears it (as Equinox's
`cache_clears` does); `clear_all` calls every one. The caches are listed, with what they
store and what invalidates them, in docs/how-it-works.md.
"""

from __future__ import annotations

from collections.abc import Callable

_clears: list[Callable[[], None]] = []


def register(clear: Callable[[], None]) -> Callable[[], None]:
    """Add a cache's clear function to the registry (usable as a decorator)."""
    _clears.append(clear)
    return clear


def clear_all() -> None:
    for clear in list(_clears):
        clear()
