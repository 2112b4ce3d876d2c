"""`functools.partial` steps, taken as `jax.jit` takes them: the function plus the arguments
the partials bind (nested ones too, positional and keyword, outside or inside a `jax.jit` or
`eqx.filter_jit`). The bound values take roles by the same table as passed ones, with rule 10
(`bound-argument`): a bound array is broadcast (never sliced per step), a bound Python number
a constant; a bound value is never state a return gives back (an error that says to pass it
at the call), but a bound object the body writes into is written back into. `show()` lists
them as bound, and the source is the wrapped function's.
"""

from __future__ import annotations

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import tree_allclose

import autoflat


def _role_line(step, param):
    return next(
        line for line in autoflat.show(step).splitlines() if line.startswith(f"# {param}: ")
    )


# --- a Flax-style step with a schedule and an optimizer bound ------------------------------


def train_step(params, opt_state, batch, learning_rate_fn, tx):
    def loss_fn(p):
        return jnp.mean((batch["x"] @ p["w"] - batch["y"]) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, opt_state, {"loss": loss, "lr": learning_rate_fn(opt_state[0].count)}


def _batches(n):
    key = jax.random.key(0)
    x = jax.random.normal(key, (n, 5, 3))
    return {"x": x, "y": jnp.tanh(x @ jnp.ones((3, 2)))}


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("wrap", ["partial", "jit(partial)", "filter_jit(partial)"])
def test_a_partial_runs_as_jax_jit_of_the_partial(k, wrap):
    schedule = optax.linear_schedule(1.0, 0.1, 8)
    tx = optax.adam(1e-2)
    bound = functools.partial(train_step, learning_rate_fn=schedule, tx=tx)
    wrapped = {
        "partial": bound,
        "jit(partial)": jax.jit(bound),
        "filter_jit(partial)": eqx.filter_jit(bound),
    }[wrap]
    step = autoflat.step(wrapped, num_steps=k)
    reference = jax.jit(bound)
    params = {"w": jnp.zeros((3, 2))}
    opt_state = tx.init(params)
    batches = _batches(8)
    p, s = params, opt_state
    ref_p, ref_s, ref_out = params, opt_state, []
    outs = []
    for c in range(8 // k):
        chunk = jax.tree.map(lambda a, c=c: a[c * k : (c + 1) * k], batches)
        p, s, out = step(p, s, chunk if k > 1 else jax.tree.map(lambda a: a[0], chunk))
        outs.append(out)
        for i in range(k):
            ref_p, ref_s, o = reference(ref_p, ref_s, jax.tree.map(lambda a, i=i: a[i], chunk))
            ref_out.append(o)
    tree_allclose(p, ref_p)
    tree_allclose(s, ref_s)
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *ref_out)
    got = outs if k == 1 else [jax.tree.map(lambda a: a, o) for o in outs]
    got = jax.tree.map(lambda *a: jnp.concatenate(a) if k > 1 else jnp.stack(a), *got)
    tree_allclose(got, stacked)
    assert autoflat.stats(step).traces == 1
    assert _role_line(step, "learning_rate_fn") == (
        "# learning_rate_fn: broadcast (bound by functools.partial; a function, holds values "
        "JAX cannot trace) [rule: untraceable]"
    )
    assert _role_line(step, "tx").startswith("# tx: broadcast (bound by functools.partial; ")
    # The source shown is the wrapped function's.
    assert autoflat.show(step).startswith(
        "# autoflat: generated from `train_step` at test_partial.py:"
        f"{train_step.__code__.co_firstlineno}\n"
    )
    assert step.__name__ == "train_step"


def test_nested_partials_bind_as_calling_them_would():
    def f(a, b, w, x, scale=1.0):
        return w - a * b * x * scale, jnp.sum(x)

    inner = functools.partial(f, 0.1, scale=3.0)
    outer = functools.partial(jax.jit(inner), jnp.full(3, 2.0), scale=0.5)  # outer wins
    step = autoflat.step(outer, num_steps=2)
    w, sums = step(jnp.ones(3), jnp.ones((2, 3)))
    expected = jnp.ones(3)
    for _ in range(2):
        expected = expected - 0.1 * 2.0 * 1.0 * 0.5
    np.testing.assert_allclose(w, expected, rtol=1e-6)
    np.testing.assert_allclose(sums, [3.0, 3.0])
    assert _role_line(step, "a").startswith("# a: static (bound by functools.partial; a Python")
    assert _role_line(step, "b") == (
        "# b: broadcast (bound by functools.partial; the same value every call) "
        "[rule: bound-argument]"
    )
    assert _role_line(step, "scale").startswith("# scale: static (bound by functools.partial")


def test_a_call_keyword_overrides_a_bound_one_as_with_the_partial():
    def layer(w, n):
        return w + jnp.zeros(n).sum() + n

    step = autoflat.step(functools.partial(layer, n=3))
    np.testing.assert_allclose(step(jnp.ones(2)), [4.0, 4.0])
    np.testing.assert_allclose(step(jnp.ones(2), n=5), [6.0, 6.0])  # a new static: a retrace
    assert autoflat.stats(step).traces == 2


def test_a_bound_python_number_is_a_constant_the_step_may_need_concrete():
    def layer(w, n):
        return w + jnp.zeros(n).sum()  # `n` must be concrete, as under jax.jit of the partial

    step = autoflat.step(functools.partial(layer, n=3))
    np.testing.assert_allclose(step(jnp.ones(2)), [1.0, 1.0])
    assert _role_line(step, "n") == (
        "# n: static (bound by functools.partial; a Python int, a constant as under jax.jit "
        "of the partial) [rule: bound-argument]"
    )


def test_a_bound_array_is_broadcast_even_with_a_leading_axis_of_num_steps():
    """Under `jax.jit` every call of the partial sees the whole bound array: it is never sliced
    per step, whatever its leading axis."""

    def add(w, table):
        return w + table.sum(0)

    table = jnp.arange(8.0).reshape(4, 2)
    step = autoflat.step(functools.partial(add, table=table), num_steps=4)
    got = step(jnp.zeros(2))
    reference = jax.jit(functools.partial(add, table=table))
    w = jnp.zeros(2)
    for _ in range(4):
        w = reference(w)
    np.testing.assert_allclose(got, w)
    assert _role_line(step, "table").endswith("[rule: bound-argument]")
    assert _role_line(step, "w").startswith("# w: state")


def test_before_the_first_call_show_lists_the_bound_arguments():
    step = autoflat.step(functools.partial(train_step, learning_rate_fn=None, tx=None))
    assert _role_line(step, "tx") == (
        "# tx: broadcast (bound by functools.partial; the same value every call) "
        "[rule: bound-argument]"
    )


def test_a_bound_value_returned_by_name_is_a_source_error_at_decoration():
    def f(w, x):
        w = w - x
        return w, jnp.sum(x)

    with pytest.raises(autoflat.SourceError) as info:
        autoflat.step(functools.partial(f, jnp.ones(3)))
    message = str(info.value)
    assert "returns `w`, which a functools.partial binds" in message
    assert "Pass `w` at the call instead" in message
    assert f"{__file__}:{f.__code__.co_firstlineno}" in message


def test_state_naming_a_bound_value_is_an_option_error():
    def f(w, x):
        new = w - x
        return new

    with pytest.raises(autoflat.OptionError, match="state= names `w`, which a functools.partial"):
        autoflat.step(functools.partial(f, w=jnp.ones(3)), state="w")


def test_a_bound_value_is_never_matched_as_state():
    """`new_w = w - x; return new_w` matches `w` by value when passed; bound, the same value
    comes back every call under jax.jit: it is broadcast, and the result a per-step output."""

    def f(w, x):
        new_w = w - 0.5 * x
        return new_w

    w0 = jnp.ones(3)
    step = autoflat.step(functools.partial(f, w0), num_steps=2)
    out = step(jnp.ones((2, 3)))
    reference = jax.jit(functools.partial(f, w0))
    np.testing.assert_allclose(out, jnp.stack([reference(jnp.ones(3))] * 2))
    assert _role_line(step, "w").endswith("[rule: bound-argument]")


def test_a_bound_dict_changed_in_place_is_written_back_into_the_bound_object():
    def accumulate(totals, x):
        totals.update({"s": totals["s"] + jnp.sum(x)})
        return jnp.sum(x)

    totals = {"s": jnp.zeros(())}
    step = autoflat.step(functools.partial(accumulate, totals), num_steps=2)
    step(jnp.ones((2, 3)))
    step(jnp.ones((2, 3)))
    assert float(totals["s"]) == 12.0
    assert _role_line(step, "totals").startswith(
        "# totals: state (bound by functools.partial; a dict changed in place"
    )


def test_a_partial_of_a_bound_method_binds_the_instance():
    class Agent:
        def __init__(self):
            self.lr = 0.5

        def update(self, w, g):
            return w - self.lr * g

    agent = Agent()
    step = autoflat.step(functools.partial(agent.update, g=jnp.ones(2)))
    np.testing.assert_allclose(step(jnp.ones(2)), [0.5, 0.5])
    agent.lr = 0.25  # an attribute the body reads: a new compiled version, as documented
    np.testing.assert_allclose(step(jnp.ones(2)), [0.75, 0.75])
    assert _role_line(step, "self").startswith(
        "# self: broadcast (bound by functools.partial; the method's instance"
    )


def test_a_jit_static_argname_under_a_partial_is_static():
    def f(w, x, n):
        return w + jnp.zeros(n).sum() + x

    step = autoflat.step(functools.partial(jax.jit(f, static_argnames="n"), x=jnp.ones(2)))
    np.testing.assert_allclose(step(jnp.ones(2), n=3), [2.0, 2.0])
    assert _role_line(step, "n").startswith("# n: static (static_argnames=)")


def test_a_bad_call_of_a_partial_names_the_function():
    def f(w, x):
        return w + x

    step = autoflat.step(functools.partial(f, x=jnp.ones(2)))
    with pytest.raises(autoflat.CallError, match="multiple values for argument 'x'"):
        step(jnp.ones(2), jnp.ones(2))


def test_the_aot_stages_and_profile_take_the_bound_arguments():
    def f(w, x, lr):
        return w - lr * x

    step = autoflat.step(functools.partial(f, lr=0.1))
    w, x = jnp.ones(2), jnp.ones(2)
    assert step.eval_shape(w, x) == jax.ShapeDtypeStruct((2,), jnp.float32)
    assert "lr" not in step.trace(w, x).jaxpr.jaxpr.invars.__repr__()
    np.testing.assert_allclose(step.lower(w, x).compile()(w, x), [0.9, 0.9])
    profile = autoflat.profile(step, w, x, calls=2)
    assert profile.num_steps == 1
    np.testing.assert_allclose(step(w, x), [0.9, 0.9])
