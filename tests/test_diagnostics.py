"""Counters and the recompile warning (`_diagnostics`), and `autoflat.clear_caches`."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import pytest
from helpers import accumulate
from helpers import ones as _ones

import autoflat
from autoflat._runtime.diagnostics import RECOMPILE_WARN_AFTER


def test_recompile_warning_names_the_cause():
    def f(state, x, scale):
        state = state + x * scale
        return state

    step = autoflat.step(f, static_argnames="scale", donate=False)
    s = jnp.float32(0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i in range(RECOMPILE_WARN_AFTER):  # the last of these compiles for the 8th time
            step(s, jnp.float32(1.0), float(i))
    # Warned at the start of the next call, before it takes anything.
    with pytest.warns(autoflat.AutoflatRecompileWarning, match=r"static argument `scale`"):
        step(s, jnp.float32(1.0), 0.0)
    # warned once only
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(s, jnp.float32(1.0), 100.0)
        step(s, jnp.float32(1.0), 101.0)


def test_clear_caches_keeps_steps_usable():
    acc = autoflat.step(accumulate, num_steps=4)
    s = {"sum": jnp.zeros(3), "n": jnp.zeros((), jnp.int32)}
    s, _ = acc(s, _ones(4))
    autoflat.clear_caches()
    s, _ = acc(s, _ones(4))
    assert acc.stats.traces == 2 and int(s["n"]) == 8


def test_a_recompile_warning_raised_as_an_error_loses_no_caller_state():
    """The warning is issued at the start of the call after the one that compiled for the
    eighth time, before that call takes anything: the previous call's results are bound, and
    the arguments of the call that raised are untouched."""

    def add_x(state, x):
        state["total"] = state["total"] + jnp.sum(x)  # mutation style: written back

    def total(state, x):
        state = jax.tree.map(lambda t: t + jnp.sum(x), state)
        return state

    for start in ({"t": jnp.float32(0.0)}, jnp.float32(0.0)):  # a handle, one array
        step = autoflat.step(total)
        s = step(start, jnp.ones(1))
        with warnings.catch_warnings():
            warnings.simplefilter("error", autoflat.AutoflatRecompileWarning)
            with pytest.raises(autoflat.AutoflatRecompileWarning):
                for n in range(2, RECOMPILE_WARN_AFTER + 3):
                    s = step(s, jnp.ones(n))
        # `s` was passed to the call that raised, and is intact: every compiled call is in it.
        value = jax.tree.leaves(s)[0]
        assert float(value) == sum(range(1, RECOMPILE_WARN_AFTER + 1))
        s = step(s, jnp.ones(1))  # and usable
        assert float(jax.tree.leaves(s)[0]) == sum(range(1, RECOMPILE_WARN_AFTER + 1)) + 1

    writer = autoflat.step(add_x)
    state = {"total": jnp.zeros(())}
    writer(state, jnp.ones(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error", autoflat.AutoflatRecompileWarning)
        with pytest.raises(autoflat.AutoflatRecompileWarning):
            for n in range(2, RECOMPILE_WARN_AFTER + 3):
                writer(state, jnp.ones(n))
    # Every call that ran is written back; the one that raised ran nothing.
    assert float(state["total"]) == sum(range(1, RECOMPILE_WARN_AFTER + 1))
