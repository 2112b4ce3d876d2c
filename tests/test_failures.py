"""The failure catalogue: after any exception the caller's state still works, and bad options
fail at decoration with a clear error. Each test failed before the change it covers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autoflat


class _Flaky:
    """A host check that fails on one call."""

    def __init__(self, fail_on):
        self.calls = 0
        self.fail_on = fail_on

    def __call__(self, x):
        self.calls += 1
        if self.calls == self.fail_on:
            raise ValueError("the host check failed")
        return np.asarray(x)


def _callback_step(check):
    def update(state, x):
        new = {"w": state["w"] + x}
        w = jax.pure_callback(check, jax.ShapeDtypeStruct((3,), jnp.float32), new["w"])
        state = {"w": w}
        return state

    return update


def test_a_run_time_failure_does_not_destroy_the_donated_input():
    check = _Flaky(fail_on=3)
    step = autoflat.step(_callback_step(check))  # donate=True, the default
    s = step({"w": jnp.zeros(3)}, jnp.ones(3))
    s = step(s, jnp.ones(3))
    with pytest.raises(Exception, match="the host check failed"):
        out = step(s, jnp.ones(3))
        jax.block_until_ready(jax.tree.leaves(out))
    # The handle passed to the call that failed is intact and not consumed: retry with it.
    np.testing.assert_allclose(s["w"], [2.0] * 3)
    s = step(s, jnp.ones(3))
    np.testing.assert_allclose(s["w"], [3.0] * 3)
    assert "pure_callback" in str(step.trace(s, jnp.ones(3)).jaxpr)


def test_a_run_time_failure_leaves_mutation_style_state_intact():
    check = _Flaky(fail_on=3)

    def update(totals, x):
        w = jax.pure_callback(check, jax.ShapeDtypeStruct((3,), jnp.float32), totals["w"] + x)
        totals["w"] = w

    step = autoflat.step(update)
    totals = {"w": jnp.zeros(3)}
    step(totals, jnp.ones(3))
    step(totals, jnp.ones(3))  # now totals["w"] holds a buffer autoflat wrote
    with pytest.raises(Exception, match="the host check failed"):
        step(totals, jnp.ones(3))
        jax.block_until_ready(totals["w"])
    np.testing.assert_allclose(totals["w"], [2.0] * 3)


def test_donate_always_donates_a_program_that_calls_back():
    step = autoflat.step(_callback_step(_Flaky(fail_on=-1)), donate="always")
    s = step({"w": jnp.zeros(3)}, jnp.ones(3))
    step(s, jnp.ones(3))
    with pytest.raises(autoflat.ConsumedError):
        float(s["w"][0])
    plain = autoflat.step(_callback_step(_Flaky(fail_on=-1)))
    s = plain({"w": jnp.zeros(3)}, jnp.ones(3))
    plain(s, jnp.ones(3))
    assert float(s["w"][0]) == 1.0  # not donated: the program calls back to the host


def test_programs_without_callbacks_still_donate():
    def update(state, x):
        state = {"w": state["w"] + x}
        return state

    step = autoflat.step(update)
    s = step({"w": jnp.zeros(3)}, jnp.ones(3))
    step(s, jnp.ones(3))
    with pytest.raises(autoflat.ConsumedError):
        float(s["w"][0])
    assert autoflat.stats(step).traces == 1  # the check reuses the first trace


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("unroll", "x", "unroll must be an int >= 1"),
        ("unroll", None, "unroll must be an int >= 1"),
        ("unroll", 2.5, "unroll must be an int >= 1"),
        ("unroll", 0, "unroll must be an int >= 1"),
        ("donate", "False", "donate must be True, False or \"always\", got 'False'"),
        ("donate", "no", "donate must be"),
        ("lazy", "False", "lazy must be True or False, got 'False'"),
        (
            "static_argnames",
            b"x",
            "static_argnames= takes a parameter name or a sequence of names, got b'x'",
        ),
    ],
)
def test_bad_options_fail_at_decoration(option, value, message):
    def update(state, x):
        state = state + x
        return state

    with pytest.raises(autoflat.OptionError, match=message.replace("(", r"\(").replace(")", r"\)")):
        autoflat.step(update, **{option: value})


def test_step_above_staticmethod_is_refused():
    with pytest.raises(autoflat.SourceError, match="Put `@staticmethod` above `@autoflat.step`"):

        class Trainer:
            @autoflat.step
            @staticmethod
            def update(state, x):
                state = state + x
                return state


def test_show_and_stats_on_a_method_reached_through_an_instance():
    class Trainer:
        def __init__(self, lr):
            self.lr = lr

        @autoflat.step
        def train(self, model, x):
            model = model + self.lr * x
            return model

    t = Trainer(0.5)
    t.train(jnp.float32(0.0), jnp.ones(()))
    assert autoflat.stats(t.train).calls == 1
    assert "# self: broadcast (the method's instance)" in autoflat.show(t.train)


def test_eqx_error_if_is_a_run_time_failure_that_loses_nothing():
    eqx = pytest.importorskip("equinox")

    def update(state, x):
        w = eqx.error_if(state["w"] + x, state["w"][0] > 1.5, "too big")
        state = {"w": w}
        return state

    step = autoflat.step(update)
    s = step({"w": jnp.zeros(3)}, jnp.ones(3))
    s = step(s, jnp.ones(3))
    with pytest.raises(Exception, match="too big"):
        out = step(s, jnp.ones(3))
        jax.block_until_ready(jax.tree.leaves(out))
    np.testing.assert_allclose(s["w"], [2.0] * 3)  # the input of the failed call


def test_a_starred_return_is_refused_not_nested():
    def update(p, x):
        p = p + x
        extras = (x * 2, x * 3)
        return p, *extras

    with pytest.raises(autoflat.SourceError, match=r"a starred element in a `return`"):
        autoflat.step(update)


def test_bodies_that_always_return_through_try_match_or_while_true():
    def with_try(p, x):
        try:
            p = p + x
            return p
        except ValueError:
            return p

    def with_finally(p, x):
        try:
            p = p + x
        finally:
            return p  # noqa: B012

    def with_match(p, x, mode):
        match mode:
            case "add":
                return p + x
            case _:
                return p - x

    def with_while(p, x):
        while True:
            p = p + x
            return p

    for fn, extra in ((with_try, ()), (with_finally, ()), (with_match, ("add",)), (with_while, ())):
        step = autoflat.step(fn, state="p", static_argnames=("mode",) if extra else ())
        out = step(jnp.ones(2), jnp.ones(2), *extra)
        np.testing.assert_allclose(out, [2.0, 2.0])


def _helper(x):
    return x * 2


def recursive_name(p, x):
    p = p + x
    if p is None:  # never: only the name is read
        recursive_name(p, x)
    return p


def test_a_body_that_reads_its_own_name_or_a_method_named_like_a_global():
    step = autoflat.step(recursive_name)
    np.testing.assert_allclose(step(jnp.ones(2), jnp.ones(2)), [2.0, 2.0])

    class Trainer:
        def _helper(self, x):  # a method named like the module-level function the body calls
            return x

        @autoflat.step
        def train(self, p, x):
            p = p + _helper(x)
            return p

    np.testing.assert_allclose(Trainer().train(jnp.ones(2), jnp.ones(2)), [3.0, 3.0])


def test_zero_argument_super_in_a_method_step():
    class Base:
        def scale(self):
            return 2.0

    class Child(Base):
        def scale(self):
            return 10.0

        @autoflat.step(num_steps=2)
        def train(self, p, x):
            p = p + x * super().scale()
            return p

    np.testing.assert_allclose(Child().train(jnp.ones(2), jnp.ones((2, 2))), [5.0, 5.0])
    assert "super(__class__, self).scale()" in autoflat.show(Child.train)


def test_the_same_handle_as_state_and_as_another_argument():
    def update(state, reference, x):
        state = {"w": state["w"] + reference["w"] * x}
        return state

    step = autoflat.step(update, broadcast="reference")
    s = step({"w": jnp.ones(2)}, {"w": jnp.ones(2)}, jnp.ones(2))
    s2 = step(s, s, jnp.ones(2))  # one handle as the state and as the broadcast reference
    np.testing.assert_allclose(s2["w"], [4.0, 4.0])


class _Dict:
    """The same, with a `__dict__`: written back in place."""

    def __init__(self, w):
        self.w = w


jax.tree_util.register_pytree_node(
    _Dict, lambda s: ((s.w,), None), lambda _, children: _Dict(*children)
)


class _Slotted:
    """A mutable pytree class whose instances have no `__dict__`."""

    __slots__ = ("w",)

    def __init__(self, w):
        self.w = w


jax.tree_util.register_pytree_node(
    _Slotted, lambda s: ((s.w,), None), lambda _, children: _Slotted(*children)
)


def test_a_write_back_that_would_fail_is_refused_before_the_call():
    def update(params, box, x):
        box.w = box.w + x  # mutation style: written back into the caller's object
        params = {"p": params["p"] * 2}
        return params

    step = autoflat.step(update)
    written = _Dict(jnp.zeros(2))
    params = step({"p": jnp.ones(2)}, written, jnp.ones(2))
    np.testing.assert_allclose(written.w, [1.0, 1.0])
    box = _Slotted(jnp.zeros(2))
    with pytest.raises(autoflat.StateError, match="immutable") as info:
        step(params, box, jnp.ones(2))
    assert "test_failures.py" in str(info.value)
    np.testing.assert_allclose(params["p"], [2.0, 2.0])  # the other state: not consumed
    np.testing.assert_allclose(box.w, [0.0, 0.0])


def test_arrays_written_into_a_callers_object_are_donated_only_through_it():
    def add(totals, x):
        totals["sum"] = totals["sum"] + x  # mutation style: written back

    def other(acc, y):
        acc = acc + y
        return acc

    step, second = autoflat.step(add), autoflat.step(other)
    totals = {"sum": jnp.zeros(2)}
    step(totals, jnp.ones(2))
    step(totals, jnp.ones(2))
    assert autoflat.stats(step).copies == 1  # the second call donated what the first wrote
    # Passed to another step by another road: copied, so `totals` keeps its array.
    second(totals["sum"], jnp.ones(2))
    np.testing.assert_allclose(totals["sum"], [2.0, 2.0])
    # Kept elsewhere by the caller: copied before the next call, so the history survives.
    history = []
    for _ in range(3):
        history.append(totals["sum"])
        step(totals, jnp.ones(2))
    np.testing.assert_allclose(np.stack(history), [[2.0, 2.0], [3.0, 3.0], [4.0, 4.0]])
    np.testing.assert_allclose(totals["sum"], [5.0, 5.0])


def test_a_flax_nnx_variable_passed_to_another_step_keeps_the_model_intact():
    nnx = pytest.importorskip("flax.nnx")

    class Model(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.zeros(2))

    def train(model, x):
        model.w[...] = model.w[...] + x

    def other(acc, y):
        acc = acc + y
        return acc

    model, step, second = Model(), autoflat.step(train), autoflat.step(other)
    step(model, jnp.ones(2))
    step(model, jnp.ones(2))
    second(model.w[...], jnp.ones(2))
    np.testing.assert_allclose(model.w[...], [2.0, 2.0])
    step(model, jnp.ones(2))
    np.testing.assert_allclose(model.w[...], [3.0, 3.0])
