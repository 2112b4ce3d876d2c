"""Property-based equivalence (issue 13): random pytrees, roles and options against a plain
`jax.jit` loop, and state passed into a call that fails stays intact.

Hypothesis draws the state's tree (nested dicts, lists, tuples, NamedTuples, `None`), its
leaves' dtypes (f32, bf16, i32, bool, PRNG keys) and shapes (0-size included), whether a
per-step input and a broadcast argument are passed, `num_steps`, a final chunk, `donate`,
`pack` and `lazy`. Each example compiles a few programs, so the default run draws 8
examples; the slow suite draws 40 more with another seed (`AUTOFLAT_HYPOTHESIS_EXAMPLES` sets
both counts).
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import tree_allclose

import autoflat

hypothesis = pytest.importorskip("hypothesis")
st = pytest.importorskip("hypothesis.strategies")

_EXAMPLES = int(os.environ.get("AUTOFLAT_HYPOTHESIS_EXAMPLES", "8"))
_SLOW_EXAMPLES = int(os.environ.get("AUTOFLAT_HYPOTHESIS_EXAMPLES", "40"))
_DTYPES = ("float32", "bfloat16", "int32", "bool", "key")


class Pair(NamedTuple):
    a: Any
    b: Any


@st.composite
def _leaf(draw: Any) -> Any:
    dtype = draw(st.sampled_from(_DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 3), max_size=2)))
    seed = draw(st.integers(0, 2**16))
    if dtype == "key":
        return jax.random.split(jax.random.key(seed), shape) if shape else jax.random.key(seed)
    values = np.random.default_rng(seed).normal(size=shape)
    if dtype == "bool":
        return jnp.asarray(values > 0)
    if dtype == "int32":
        return jnp.asarray((values * 10).astype(np.int32))
    return jnp.asarray(values, dtype=dtype)


def _trees(leaves: Any) -> Any:
    return st.recursive(
        leaves | st.none(),
        lambda children: st.one_of(
            st.dictionaries(st.sampled_from("abcd"), children, min_size=1, max_size=3),
            st.lists(children, min_size=1, max_size=3),
            st.tuples(children, children),
            st.builds(Pair, children, children),
        ),
        max_leaves=6,
    )


def _bump(leaf: Any, x: Any) -> Any:
    """One step's change of a state leaf, for every dtype drawn."""
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        return jax.random.wrap_key_data(jax.random.key_data(leaf) + jnp.uint32(1))
    if leaf.dtype == jnp.bool_:
        return jnp.logical_not(leaf)
    if jnp.issubdtype(leaf.dtype, jnp.integer):
        return leaf + jnp.round(x).astype(leaf.dtype)
    return (leaf * 0.5 + x).astype(leaf.dtype)


def update(state: Any, x: Any, scale: Any) -> Any:
    y = jnp.sum(x) * scale
    state = jax.tree.map(lambda leaf: _bump(leaf, y), state)
    return state, y


def failing_update(state: Any, x: Any, scale: Any) -> Any:
    def fail(v: Any) -> Any:
        raise ValueError("the host check failed")

    y = jax.pure_callback(fail, jax.ShapeDtypeStruct((), jnp.float32), jnp.sum(x) * scale)
    state = jax.tree.map(lambda leaf: _bump(leaf, y), state)
    return state, y


def _copy(tree: Any) -> Any:
    return jax.tree.map(lambda a: a.copy() if hasattr(a, "copy") else a, tree)


def _settings(examples: int) -> Any:
    return hypothesis.settings(
        max_examples=examples,
        deadline=None,
        suppress_health_check=list(hypothesis.HealthCheck),
        derandomize=True,
    )


_GIVEN = hypothesis.given(
    state=_trees(_leaf()),
    k=st.integers(1, 3),
    n=st.integers(1, 5),
    donate=st.booleans(),
    pack=st.sampled_from([False, True, "auto"]),
    lazy=st.booleans(),
)


@_settings(_EXAMPLES)
@_GIVEN
def test_random_pytrees_roles_and_options_equal_jax_jit(state, k, n, donate, pack, lazy):
    _equal_jax_jit(state, k, n, donate, pack, lazy)


@pytest.mark.slow
@_settings(_SLOW_EXAMPLES)
@_GIVEN
def test_more_random_pytrees_equal_jax_jit(state, k, n, donate, pack, lazy):
    _equal_jax_jit(state, k, n, donate, pack, lazy)


def _equal_jax_jit(state: Any, k: int, n: int, donate: bool, pack: Any, lazy: bool) -> None:
    hypothesis.assume(jax.tree.leaves(state))  # state with no arrays is returned as it is
    xs = jnp.arange(n * 2, dtype=jnp.float32).reshape(n, 2) / 7
    scale = jnp.float32(0.25)  # broadcast: no leading axis of num_steps

    ref_state, ref_outs = _copy(state), []
    ref = jax.jit(update)
    for i in range(n):
        ref_state, out = ref(ref_state, xs[i], scale)
        ref_outs.append(out)

    options = dict(donate=donate, pack=pack, lazy=lazy, broadcast="scale")
    if k > 1:
        options["per_step"] = "x"  # a first chunk shorter than k is declared (hazard 4)
    step = autoflat.step(update, num_steps=k, **options)
    got, outs = _copy(state), []
    for start in range(0, n, k):
        x = xs[start : start + k] if k > 1 else xs[start]
        got, out = step(got, x, scale)
        outs.append(np.reshape(out, (-1,)))
    tree_allclose(ref_state, got, rtol=1e-2 if "bfloat16" in str(state) else 1e-5)
    np.testing.assert_allclose(np.concatenate(outs), np.stack(ref_outs), rtol=1e-6)

    # A call that fails while running leaves the state passed in intact and usable.
    before = _copy(autoflat.unwrap(got))
    failing = autoflat.step(failing_update, num_steps=k, **options)
    x = xs[:k] if k > 1 else xs[0]
    with pytest.raises(Exception, match="the host check failed"):
        jax.block_until_ready(failing(got, x, scale))
    tree_allclose(before, got, exact=True)
    again, _ = step(got, x, scale)  # and a working step still takes it
    jax.block_until_ready(autoflat.unwrap(again))
