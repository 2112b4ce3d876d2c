"""Counters and the recompile warning (`_diagnostics`), and `autoflat.clear_caches`."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import pytest

import autoflat
from autoflat._diagnostics import RECOMPILE_WARN_AFTER


def _ones(n):
    return jnp.ones((n, 3), jnp.float32)


def accumulate(state, x):
    state = {"sum": state["sum"] + x, "n": state["n"] + 1}
    return state, jnp.sum(x)


def test_recompile_warning_names_the_cause():
    def f(state, x, scale):
        state = state + x * scale
        return state

    step = autoflat.step(f, static_argnames="scale", donate=False)
    s = jnp.float32(0.0)
    with pytest.warns(autoflat.AutoflatRecompileWarning, match=r"static argument `scale`"):
        for i in range(RECOMPILE_WARN_AFTER):
            step(s, jnp.float32(1.0), float(i))
    # warned once only
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(s, jnp.float32(1.0), 100.0)


def test_clear_caches_keeps_steps_usable():
    acc = autoflat.step(accumulate, num_steps=4)
    s = {"sum": jnp.zeros(3), "n": jnp.zeros((), jnp.int32)}
    s, _ = acc(s, _ones(4))
    autoflat.clear_caches()
    s, _ = acc(s, _ones(4))
    assert acc.stats.traces == 2 and int(s["n"]) == 8


def test_a_recompile_warning_raised_as_an_error_loses_no_caller_state():
    def add_x(state, x):
        state["total"] = state["total"] + jnp.sum(x)  # mutation style: written back

    def total(state, x):
        state = jax.tree.map(lambda t: t + jnp.sum(x), state)
        return state

    step = autoflat.step(total)
    s = step({"t": jnp.float32(0.0)}, jnp.ones(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error", autoflat.AutoflatRecompileWarning)
        with pytest.raises(autoflat.AutoflatRecompileWarning):
            for n in range(2, RECOMPILE_WARN_AFTER + 2):
                old = s
                s = step(s, jnp.ones(n))
    # The call that warned donated `old`: it says so, rather than failing inside JAX.
    with pytest.raises(autoflat.AutoflatError, match="consumed"):
        float(old["t"])

    # State that is one array comes back as the array; passed back, it is copied before the
    # donation, so the input of the call that warned is intact.
    step = autoflat.step(total)
    s = step(jnp.float32(0.0), jnp.ones(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error", autoflat.AutoflatRecompileWarning)
        with pytest.raises(autoflat.AutoflatRecompileWarning):
            for n in range(2, RECOMPILE_WARN_AFTER + 2):
                old = s
                s = step(s, jnp.ones(n))
    assert float(old) == sum(range(1, RECOMPILE_WARN_AFTER))  # the input of the warned call

    writer = autoflat.step(add_x)
    state = {"total": jnp.zeros(())}
    writer(state, jnp.ones(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error", autoflat.AutoflatRecompileWarning)
        with pytest.raises(autoflat.AutoflatRecompileWarning):
            for n in range(2, RECOMPILE_WARN_AFTER + 2):
                writer(state, jnp.ones(n))
    # Written back before the warning: every call, the failing one too, is in the total.
    assert float(state["total"]) == sum(range(1, RECOMPILE_WARN_AFTER + 1))
