"""Mutation-style state (`_writeback`): new values written into the caller's objects, and
objects that cannot be updated in place refused before the call."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import autoflat


def test_mutation_style_writes_back_into_callers_objects():
    def update(stats, x):
        stats["total"] = stats["total"] + jnp.sum(x)
        stats["history"][0] = stats["history"][0] + 1

    ref_stats = {"total": jnp.zeros(()), "history": [jnp.zeros((), jnp.int32)]}
    ref = jax.jit(lambda s, x: (update(s, x), s)[1])
    for i in range(6):
        ref_stats = ref(ref_stats, jnp.full((3,), float(i)))

    step = autoflat.step(update, num_steps=3)
    stats = {"total": jnp.zeros(()), "history": [jnp.zeros((), jnp.int32)]}
    history = stats["history"]
    xs = jnp.stack([jnp.full((3,), float(i)) for i in range(6)])
    assert step(stats, xs[:3]) is None
    assert step(stats, xs[3:]) is None
    assert stats["history"] is history  # updated in place, not replaced
    assert float(stats["total"]) == float(ref_stats["total"]) == 45.0
    assert int(history[0]) == 6
    assert "# stats: state (assigned into at line" in autoflat.show(step)


def test_mutation_into_immutable_parts_is_a_clear_error():
    def update(state, x):
        state[0]["w"] = state[0]["w"] + x

    step = autoflat.step(update)
    state = ({"w": jnp.zeros(())}, jnp.zeros(()))
    with pytest.raises(autoflat.AutoflatError, match=r"`state\[1\]` is immutable \(tuple\)"):
        step(state, jnp.float32(1.0))
    assert float(state[0]["w"]) == 0.0  # checked before running: nothing half-written
