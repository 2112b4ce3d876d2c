"""Shared helpers for the corpus harnesses: batching and collecting per-step outputs."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import autoflat

N_STEPS = 8  # steps every case trains for


class Result(NamedTuple):
    """What a run leaves behind, compared leaf by leaf between upstream's jit and autoflat.

    `state`: the final parameters and other carried state (real objects, not handles);
    `per_step`: per-step outputs (losses, metrics) with a leading axis of steps, or None;
    `post`: what upstream's post-training code (eval, accuracy, sampling) computes from it;
    `loose`: values that float noise drives (a module says which and why), compared with a
    bound instead of equality; None in most cases.
    """

    state: Any
    per_step: Any
    post: Any
    loose: Any = None


def _stack(xs: Sequence[Any]) -> Any:
    if isinstance(xs[0], jax.Array):
        return jnp.stack(xs)
    return np.stack([np.asarray(x) for x in xs])


def calls(steps: Sequence[Any], chunk: int | None) -> Iterator[Any]:
    """The inputs of each call: each step's own (`chunk` None or 1: one step per call, as
    upstream feeds them), or `chunk` steps stacked along a new leading axis."""
    if chunk is None or chunk == 1:
        yield from steps
        return
    for start in range(0, len(steps), chunk):
        yield jax.tree.map(lambda *xs: _stack(xs), *steps[start : start + chunk])


def collect(outputs: Sequence[Any], chunk: int | None) -> Any:
    """Per-step outputs of all calls as one tree with a leading axis of steps."""
    outputs = [autoflat.unwrap(o) for o in outputs]
    if chunk is None or chunk == 1:
        return jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *outputs)
    return jax.tree.map(lambda *xs: np.concatenate([np.asarray(x) for x in xs]), *outputs)


def real(tree: Any) -> Any:
    """A tree with every lazy handle in it replaced by its object."""
    return autoflat.unwrap(tree)
