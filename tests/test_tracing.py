"""In-trace helpers (`_tracing`): chunk lengths, leading axes, state that changes its
structure or shape within one call, `unroll`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from helpers import accumulate, tree_allclose
from helpers import ones as _ones

import autoflat


def test_remainder_chunk_and_length_errors():
    acc = autoflat.step(accumulate, num_steps=4)
    s = {"sum": jnp.zeros(3), "n": jnp.zeros((), jnp.int32)}
    s, out = acc(s, _ones(4))
    s, out = acc(s, _ones(2))
    assert out.shape == (2,)
    s, out = acc(s, _ones(2))  # the 2-step version is compiled once
    assert acc.stats.traces == 2
    assert int(s["n"]) == 8
    with pytest.raises(
        autoflat.AutoflatError, match="leading axis of 5, more than num_steps"
    ) as info:
        acc(s, _ones(5))
    assert "accumulate" in str(info.value) and "helpers.py" in str(info.value)
    # still usable after the error
    s, _ = acc(s, _ones(4))
    assert int(s["n"]) == 12


def test_inconsistent_leading_axes():
    def two(state, x, y):
        state = state + jnp.sum(x) + jnp.sum(y)
        return state

    declared = autoflat.step(two, num_steps=3, per_step=("x", "y"))
    with pytest.raises(
        autoflat.ShapeError,
        match=r"disagree on their leading axis: `y` has 2, `x` has 3",
    ):
        declared(jnp.float32(0), jnp.ones((3, 2)), jnp.ones((2, 2)))
    # A leaf inside a pytree input is named by its path.
    with pytest.raises(
        autoflat.ShapeError,
        match=r"disagree on their leading axis: `y\['label'\]` has 2, `x` has 3",
    ):
        declared(
            jnp.float32(0), jnp.ones((3, 2)), {"image": jnp.ones((3, 2)), "label": jnp.ones(2)}
        )
    # Undeclared, an array without the leading axis of num_steps is the same for every step.
    inferred = autoflat.step(two, num_steps=3)
    out = inferred(jnp.float32(0), jnp.ones((3, 2)), jnp.ones((2, 2)))
    assert float(out) == 3 * (2 + 4)
    assert "# y: broadcast (no leading axis of num_steps=3 at the first call)" in inferred.source


def test_structure_change_in_scan_is_a_clear_error_but_fine_with_one_step():
    def grow(state, x):
        state = {"w": state["w"] + x, "count": 1}  # `count` becomes a Python int
        return state

    scanned = autoflat.step(grow, num_steps=2)
    s = {"w": jnp.zeros(()), "count": jnp.zeros((), jnp.int32)}
    with pytest.raises(
        autoflat.AutoflatError, match=r"state\['count'\]: an array became non-array int 1"
    ) as info:
        scanned(s, jnp.ones(2))
    assert "A Python number in the state is part of its structure" in str(info.value)
    single = autoflat.step(grow)
    out = single(s, jnp.float32(1.0))
    assert out["count"] == 1 and float(out["w"]) == 1.0
    out2 = single(out, jnp.float32(1.0))  # the new structure is fine from call to call
    assert float(out2["w"]) == 2.0


def test_a_leaf_added_or_removed_in_scan_is_named_by_its_path():
    """A state that gains or loses a leaf from one step to the next (a new Variable set in
    `__call__`, as Flax's NNX VAE example does; a dict key) names those paths, not the
    whole tree structures."""

    def add(state, x):
        state["w"] = state["w"] + x
        state["extra"] = x
        return state

    def drop(state, x):
        state["w"] = state["w"] + x
        del state["gone"]

    s = {"w": jnp.zeros(()), "gone": jnp.zeros(())}
    with pytest.raises(autoflat.ShapeError) as info:
        autoflat.step(add, num_steps=2)({"w": jnp.zeros(())}, jnp.ones(2))
    assert "  state['extra']: new (a leaf it did not come in with)\n" in str(info.value)
    assert "PyTreeDef" not in str(info.value)
    line = add.__code__.co_firstlineno + 3  # (its `return`)
    assert any(f"at {__file__}:{line} (generated code" in n for n in info.value.__notes__)
    with pytest.raises(autoflat.ShapeError, match=r"  state\['gone'\]: gone\n"):
        autoflat.step(drop, num_steps=2)(s, jnp.ones(2))


def test_a_static_field_changed_in_scan_is_named_by_its_node():
    """A change of a node's static data (a Flax NNX module's Python int attribute counted up
    in the step) names the node and shows its static data before and after, not the whole
    tree structures."""
    nnx = pytest.importorskip("flax.nnx")

    class Counted(nnx.Module):
        def __init__(self):
            self.lin = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
            self.n = 3

    def count(model, x):
        model.n = model.n + 1
        return model.lin(x).sum()

    model = Counted()
    with pytest.raises(autoflat.ShapeError) as info:
        autoflat.step(count, num_steps=2)(model, jnp.ones((2, 2)))
    message = str(info.value)
    assert "  model: the static data of this " in message
    assert "3))\n  became:\n" in message and message.count("4))") == 1
    assert "PyTreeDef" not in message
    assert model.n == 3  # nothing was written back


def test_shape_change_in_scan():
    def widen(state, x):
        state = jnp.concatenate([state, x[None]])
        return state

    with pytest.raises(
        autoflat.AutoflatError, match=r"array float32\[1\] became array float32\[2\]"
    ) as info:
        autoflat.step(widen, num_steps=2)(jnp.zeros(1), jnp.ones(2))
    # no Python number and no broadcast input is involved: the message blames neither
    message = str(info.value)
    assert "Python number" not in message and "broadcast" not in message
    assert message.endswith(
        "from step to step. Keep them fixed, or use num_steps=1, where the structure may "
        "change between calls.\n"
    )


@pytest.mark.parametrize("axis", [4, 2])
def test_a_state_change_from_an_input_read_as_broadcast_by_its_shape_names_it(axis):
    # `ys` holds one batch per step, but `axis` of them where num_steps=3: read as broadcast
    # (rule no-leading-axis), it reaches the state whole, which then changes shape.
    def update(w, xs, ys):
        w = w - 0.1 * xs + ys
        return w, jnp.sum(w)

    step = autoflat.step(update, num_steps=3)
    w = jnp.zeros(2)
    with pytest.raises(autoflat.ShapeError) as info:
        step(w, jnp.ones((3, 2)), jnp.ones((axis, 2)))
    fix = (
        "If `ys` holds one entry per step, pass 3 per call (`ys[:3]`, the rest in later "
        "calls), or use num_steps=4."
        if axis == 4
        else 'If `ys` is a first chunk of 2 steps, say so with `per_step="ys"`, or pass a '
        "first chunk of 3 (shorter chunks are fine after it)."
    )
    assert str(info.value).endswith(
        f"  w: array float32[2] became array float32[{axis}, 2]\n\n"
        "With num_steps=3 the steps of one call run in a `lax.scan`, whose carried state must\n"
        "keep its tree structure, non-array fields, shapes and dtypes from step to step. "
        "Keep them fixed.\n\n"
        "`ys` was read as broadcast, the same value for every step, because its leading axis "
        f"is {axis}, not num_steps=3 [rule: no-leading-axis], and that axis is in the state's "
        f"new shape. {fix} If `ys` is one value for every step, keep the state's shapes fixed "
        "with it.\n"
    )
    assert "Python number" not in str(info.value)
    # the caller's state is usable, and the fix the message names works (on a new step: the
    # roles stay those of the first call)
    fixed = autoflat.step(update, num_steps=3, per_step=("xs", "ys") if axis == 2 else ())
    w, sums = fixed(w, jnp.ones((3, 2))[:axis], jnp.ones((axis, 2))[:3])
    assert w.shape == (2,) and sums.shape == (min(axis, 3),)


def _normalised(w, x):
    x = (x - x.mean()) / (x.std() + 1e-6)
    w = w + 0.1 * x.sum(0)
    return w, x


def _normalised_by(w, x):  # (normalised by the weights too: from more than itself)
    x = (x - x.mean()) / (x.std() + 1e-6) * jnp.abs(w).mean()
    w = w + 0.1 * x.sum(0)
    return w, x


def _halved_count(w, count, x):
    w = w - 0.1 * x.sum(0)
    count = count / 2
    return w, count


def test_a_state_change_from_a_per_step_input_returned_by_name_names_it():
    # `x` is returned by name after the body rebinds it from itself alone: asked at the first
    # call (`hazards.check_rebound_per_step`).
    xs = jnp.linspace(0, 1, 60).reshape(4, 5, 3)
    with pytest.raises(autoflat.ShapeError, match="binds it again from `x` alone"):
        autoflat.step(_normalised, num_steps=4)(jnp.ones(3), xs)
    # Bound again from the weights too: state by rule 2, carried whole, so `x.sum(0)` is
    # (5, 3) and `w` changes shape. The message names `x`, not only `w`.
    with pytest.raises(autoflat.ShapeError) as info:
        autoflat.step(_normalised_by, num_steps=4)(jnp.ones(3), xs)
    assert str(info.value).endswith(
        "`x` is carried as state because the step returns it by name [rule: returned-by-name], "
        "and every array in it has a leading axis of num_steps=4: each step saw the whole "
        "chunk. If `x` is a per-step input whose new value the step returns each step, say so "
        '(its returned values are then stacked):\n\n    @autoflat.step(..., per_step="x")\n'
    )
    # Only where a shape changed: a counter made float (`count / 2`) beside a (4, 3) weight
    # returned by name at num_steps=4 is not blamed on the weight.
    with pytest.raises(autoflat.ShapeError) as info:
        autoflat.step(_halved_count, num_steps=4)(jnp.ones((4, 3)), jnp.ones((), jnp.int32), xs)
    assert "count: array int32[] became array float32[]" in str(info.value)
    assert "per_step=" not in str(info.value)
    # The fix it names: equal to the jax.jit loop.
    w, outs = jnp.ones(3), []
    for x in xs:
        w, out = jax.jit(_normalised)(w, x)
        outs.append(out)
    got = autoflat.step(_normalised, num_steps=4, per_step="x")(jnp.ones(3), xs)
    tree_allclose(got, (w, jnp.stack(outs)), rtol=1e-5)


def test_unroll_is_passed_to_scan():
    def f(state, x):
        state = state * 0.5 + x
        return state, state * 2

    a = autoflat.step(f, num_steps=4, unroll=2)
    b = autoflat.step(f, num_steps=4)
    xs = jnp.arange(4.0, dtype=jnp.float32)
    (sa, oa), (sb, ob) = a(jnp.float32(1.0), xs), b(jnp.float32(1.0), xs)
    assert float(sa) == float(sb) and oa.tolist() == ob.tolist()
    assert "unroll=2" in str(a.trace(jnp.float32(1.0), xs).jaxpr)
    assert "unroll=2" not in str(b.trace(jnp.float32(1.0), xs).jaxpr)
