"""Ahead-of-time stages (`Step.lower`, `trace`, `eval_shape`): the same program as a call,
compiled once, with JAX's cost and memory analysis; nothing consumed or written back."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autoflat


def _setup(num_steps):
    tx = optax.adam(1e-2)

    def update(params, opt_state, x):
        grads = jax.grad(lambda p: jnp.sum((p["w"] * x - 1.0) ** 2))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, jnp.sum(params["w"])

    params = {"w": jnp.arange(3.0, dtype=jnp.float32)}
    xs = jnp.ones((num_steps, 3), jnp.float32) if num_steps > 1 else jnp.ones(3, jnp.float32)
    return update, tx, params, tx.init(params), xs


@pytest.mark.parametrize("num_steps", [1, 4])
def test_lower_compile_runs_like_the_step(num_steps):
    update, _, params, opt_state, xs = _setup(num_steps)
    step = autoflat.step(update, num_steps=num_steps)
    lowered = step.lower(params, opt_state, xs)
    assert isinstance(lowered, autoflat.Lowered)
    assert "stablehlo" in lowered.as_text() or "func.func" in lowered.as_text()
    compiled = lowered.compile()
    assert isinstance(compiled, autoflat.Compiled)
    assert step.stats.traces == 1 and step.stats.calls == 0
    p, o, out = compiled(params, opt_state, xs)
    p, o, out = compiled(p, o, xs)  # handles back in: the fast path, the same executable
    ref = autoflat.step(update, num_steps=num_steps)
    rp, ro, rout = ref(params, opt_state, xs)
    rp, ro, rout = ref(rp, ro, xs)
    np.testing.assert_array_equal(p["w"], rp["w"])
    np.testing.assert_array_equal(out, rout)
    assert step.stats.traces == 1 and step.stats.calls == 2 and step.stats.fast_path == 2
    # The caller's own arrays were not donated by the compiled calls.
    assert float(jnp.sum(params["w"])) == 3.0


def test_cost_and_memory_analysis():
    update, _, params, opt_state, xs = _setup(1)
    compiled = autoflat.step(update).lower(params, opt_state, xs).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost  # a list on older JAX
    assert cost["flops"] > 0
    assert compiled.memory_analysis() is not None
    assert compiled.jax is not None and "HloModule" in compiled.as_text()


def test_bare_program_takes_the_lowered_args():
    update, _, params, opt_state, xs = _setup(4)
    step = autoflat.step(update, num_steps=4, donate=False)
    lowered = step.lower(params, opt_state, xs)
    # What it returns is built without Python (no pytree classes): the state's buffers per
    # state argument, then the outputs' leaves.
    state_out, outputs = lowered.compile().jax(*lowered.args)
    (p_arrays, _), (losses,) = state_out, outputs
    p, _, ref_losses = step(params, opt_state, xs)
    np.testing.assert_array_equal(p_arrays[0], p["w"])
    np.testing.assert_array_equal(losses, ref_losses)


def test_compiled_refuses_other_structures():
    update, _, params, opt_state, xs = _setup(1)
    step = autoflat.step(update)
    compiled = step.lower(params, opt_state, xs).compile()
    other = {"w": params["w"], "b": params["w"]}
    with pytest.raises(autoflat.CallError, match="lowered with") as info:
        compiled(other, opt_state, xs)
    assert isinstance(info.value, TypeError)


def test_lower_consumes_nothing():
    update, _, params, opt_state, xs = _setup(1)
    step = autoflat.step(update)
    p, o, _ = step(params, opt_state, xs)
    step.lower(p, o, xs)  # handles are prepared (fast path) but not donated
    step.trace(p, o, xs)
    step.eval_shape(p, o, xs)
    p2, o2, _ = step(p, o, xs)  # still usable: lower/trace/eval_shape consumed nothing
    rp, ro, _ = jax.jit(update)(params, opt_state, xs)
    rp, _, _ = jax.jit(update)(rp, ro, xs)
    np.testing.assert_allclose(p2["w"], rp["w"], rtol=1e-6)


def test_trace_gives_the_jaxpr():
    def f(total, x):
        total = total + jnp.sin(x)
        return total

    step = autoflat.step(f, num_steps=3)
    traced = step.trace(jnp.float32(0.0), jnp.ones(3))
    assert isinstance(traced, autoflat.Traced)
    assert "sin" in str(traced.jaxpr) and "scan" in str(traced.jaxpr)
    assert traced.lower().compile().cost_analysis() is not None


def test_eval_shape_returns_the_user_structure():
    update, _, params, opt_state, xs = _setup(4)
    step = autoflat.step(update, num_steps=4, pack=True)
    p, o, losses = step.eval_shape(params, opt_state, xs)
    assert type(p) is dict and p["w"] == jax.ShapeDtypeStruct((3,), jnp.float32)
    assert jax.tree.structure(o) == jax.tree.structure(opt_state)
    assert losses == jax.ShapeDtypeStruct((4,), jnp.float32)
    # Nothing run; at most the one trace the first call's roles may need (one step's
    # abstract value), which the call then compiles rather than tracing again.
    assert step.stats.traces <= 1 and step.stats.calls == 0
    step(params, opt_state, xs)
    assert step.stats.traces == 1 and step.stats.calls == 1


def test_a_compiled_step_under_debug_nans_marks_what_it_donated():
    """`Compiled` runs the executable lowered (donating) before the flag: its inputs are
    consumed and say so, not JAX's "Array has been deleted" from a handle said intact."""

    def update(state, x):
        state = {"w": state["w"] + x}
        return state

    step = autoflat.step(update)
    s = step({"w": jnp.zeros(3)}, jnp.ones(3))
    compiled = step.lower(s, jnp.ones(3)).compile()
    with jax.debug_nans(True):
        out = compiled(s, jnp.ones(3))
    np.testing.assert_allclose(out["w"], [2.0] * 3)
    with pytest.raises(autoflat.ConsumedError):
        s["w"]
