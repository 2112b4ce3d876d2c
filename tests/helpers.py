"""Shared assertions and small steps for the test suite."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import autoflat


def tree_allclose(
    a: Any, b: Any, *, rtol: float = 1e-5, atol: float = 1e-6, exact: bool = False
) -> None:
    """Assert two pytrees have the same structure, non-array leaves and (close) array leaves."""
    a = autoflat.unwrap(a)
    b = autoflat.unwrap(b)
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    assert ta == tb, f"tree structures differ:\n{ta}\n{tb}"
    for i, (x, y) in enumerate(zip(la, lb, strict=True)):
        if isinstance(x, (jax.Array, np.ndarray, np.generic)):
            if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
                x, y = jax.random.key_data(x), jax.random.key_data(y)
            x, y = np.asarray(x), np.asarray(y)
            assert x.shape == y.shape and x.dtype == y.dtype, (
                i,
                x.shape,
                y.shape,
                x.dtype,
                y.dtype,
            )
            if exact:
                np.testing.assert_array_equal(x, y, err_msg=f"leaf {i}")
            else:
                np.testing.assert_allclose(x, y, rtol=rtol, atol=atol, err_msg=f"leaf {i}")
        else:
            assert x == y, (i, x, y)


def noisy_allclose(a: Any, b: Any, *, bound: float, outliers: float) -> None:
    """`a` and `b` close where float noise drives some elements: every element within
    `bound`, and at most the fraction `outliers` of all of them past the usual tolerance.

    For steps with every leaf packed (`AUTOFLAT_PACK=on`): whole-buffer updates differ from
    per-leaf ones in the last bits, and Adam moves an element whose gradient is float noise
    (the bias of a layer before a BatchNorm) by up to its learning rate whatever the noise."""
    la = jax.tree.leaves(autoflat.unwrap(a))
    lb = jax.tree.leaves(autoflat.unwrap(b))
    assert len(la) == len(lb)
    far = total = 0
    for x, y in zip(la, lb, strict=True):
        if jax.dtypes.issubdtype(jnp.result_type(x), jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        assert x.shape == y.shape
        np.testing.assert_allclose(x, y, rtol=0, atol=bound)
        far += int((~np.isclose(x, y, rtol=1e-5, atol=1e-6)).sum())
        total += x.size
    assert far <= outliers * total, (far, total)


def chunk(tree: Any, start: int, stop: int) -> Any:
    """Steps [start, stop) of a tree whose leaves have a leading axis of steps."""
    return jax.tree.map(lambda x: x[start:stop], tree)


def step_i(tree: Any, i: int) -> Any:
    return jax.tree.map(lambda x: x[i], tree)


def ones(n: int) -> Any:
    """`n` steps of a per-step input of shape (3,)."""
    return jnp.ones((n, 3), jnp.float32)


def accumulate(state: Any, x: Any) -> Any:
    """A step with dict state and a per-step output."""
    state = {"sum": state["sum"] + x, "n": state["n"] + 1}
    return state, jnp.sum(x)
