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


@pytest.mark.parametrize("donate", [True, False])
@pytest.mark.parametrize("style", ["dict", "nnx"])
def test_a_failure_seen_only_when_waited_for_leaves_mutation_style_state_intact(
    monkeypatch, donate, style
):
    """On an accelerator, a program that calls back can fail after the call returned: the
    error shows when its results are waited for. Mutation-style state then held the broken
    results in place of its values (the write-back came first). XLA:CPU runs such programs
    to the end before it returns, so the failure is simulated here: the wait raises once."""
    check = _Flaky(fail_on=-1)
    if style == "nnx":
        nnx = pytest.importorskip("flax.nnx")

        class Totals(nnx.Module):
            def __init__(self):
                self.w = nnx.Param(jnp.zeros(3))

        def update(totals, x):
            w = jax.pure_callback(check, jax.ShapeDtypeStruct((3,), jnp.float32), totals.w + x)
            totals.w[...] = w

        totals = Totals()
        value = lambda: np.asarray(totals.w[...])  # noqa: E731
    else:

        def update(totals, x):
            w = jax.pure_callback(check, jax.ShapeDtypeStruct((3,), jnp.float32), totals["w"] + x)
            totals["w"] = w

        totals = {"w": jnp.zeros(3)}
        value = lambda: np.asarray(totals["w"])  # noqa: E731
    step = autoflat.step(update, donate=donate)
    step(totals, jnp.ones(3))
    step(totals, jnp.ones(3))
    real_wait, waits = jax.block_until_ready, []

    def failing_wait(x):
        waits.append(x)
        raise RuntimeError("the program failed while it ran")

    monkeypatch.setattr(jax, "block_until_ready", failing_wait)
    with pytest.raises(RuntimeError, match="failed while it ran"):
        step(totals, jnp.ones(3))
    monkeypatch.setattr(jax, "block_until_ready", real_wait)
    assert waits  # the call waited for its results before writing them back
    np.testing.assert_allclose(value(), [2.0] * 3)
    with pytest.raises(autoflat.StateError, match="nothing to recover"):
        step.recover()
    step(totals, jnp.ones(3))
    np.testing.assert_allclose(value(), [3.0] * 3)


def test_a_program_that_calls_back_is_traced_once_and_its_inputs_not_copied():
    step = autoflat.step(_callback_step(_Flaky(fail_on=-1)))
    s = step({"w": jnp.zeros(3)}, jnp.ones(3))
    for _ in range(3):
        s = step(s, jnp.ones(3))
    stats = autoflat.stats(step)
    # one trace serves both the donation check and the run; the first call copies the
    # caller's arrays before the check, later calls know the program keeps its inputs
    assert (stats.traces, stats.copies) == (1, 1)
    np.testing.assert_allclose(s["w"], [4.0] * 3)


def test_state_rebound_to_another_shape_is_not_donated():
    # A parameter returned by name that the body rebinds to another shape (`x = f(x)`): its
    # buffers cannot hold the output. Donating them would make JAX warn "Some donated
    # buffers were not usable" (an error under this suite's filters).
    def step_fn(params, x):
        x = x[:, :2] * params["w"]
        params = {"w": params["w"] + 1.0}
        return params, x

    step = autoflat.step(step_fn)
    p = {"w": jnp.ones(2)}
    for _ in range(3):
        x = jnp.ones((4, 3))
        p, y = step(p, x)
        assert y.shape == (4, 2) and not x.is_deleted()
    np.testing.assert_allclose(p["w"], [4.0, 4.0])
    np.testing.assert_allclose(y, np.full((4, 2), 3.0))
    stats = autoflat.stats(step)
    assert (stats.traces, stats.copies) == (1, 2)  # only the first call copies


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
    assert "# self: broadcast (the method's instance; a new value of self.lr recompiles)" in (
        autoflat.show(t.train)
    )


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("donate", [True, "always"])
@pytest.mark.parametrize("flag", ["debug_nans", "debug_infs"])
def test_debug_nans_turned_on_between_calls_loses_nothing(k, donate, flag):
    """`jax_debug_nans` set after the program compiled (to look into a loss gone NaN): JAX runs
    the program again op by op on the same inputs, which the compiled program, donating,
    had consumed. That raised "Array has been deleted" and lost the state passed in."""

    def update(state, opt, x):
        w = state["w"] + jnp.log(x)  # log(-1) is NaN, log(0) is -inf
        return {"w": w, "b": [b + 1 for b in state["b"]]}, {"n": opt["n"] + 1}

    step = autoflat.step(update, num_steps=k, donate=donate)
    xs = jnp.ones((k, 3)) if k > 1 else jnp.ones(3)
    s, o = step({"w": jnp.zeros(3), "b": [jnp.zeros(())] * 40}, {"n": jnp.zeros(())}, xs)
    s, o = step(s, o, xs)  # compiled, donating
    with getattr(jax, flag)(True):
        with pytest.raises(FloatingPointError):
            step(s, o, -xs if flag == "debug_nans" else 0 * xs)
        np.testing.assert_allclose(s["w"], [0.0] * 3)  # the input of the failed call
        assert float(o["n"]) == 2 * k
        s, o = step(s, o, xs)  # and it trains on
    s, o = step(s, o, xs)
    assert float(o["n"]) == 4 * k
    assert float(s["b"][39]) == 4 * k


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
    # Its own buffers went in as a copy, so it stays valid, as under jax.jit (a target
    # network synced with `target = online`, then read: it raised the consumed error).
    np.testing.assert_allclose(s["w"], [2.0, 2.0])
    s3 = step(s2, s, jnp.ones(2))
    np.testing.assert_allclose(s3["w"], [6.0, 6.0])


@pytest.mark.parametrize("k", [1, 2])
def test_the_same_handle_as_state_and_as_the_per_step_input(k):
    """It raised the consumed error from JAX's flattening of the per-step input, which
    `launch` had claimed as the donated state."""

    def update(state, x):
        state = {"w": state["w"] + jnp.sum(x["w"])}
        return state

    def make(state, x):
        state = {"w": state["w"] * x}
        return state

    h = autoflat.step(make)({"w": jnp.ones((k, 2))}, 2.0)  # a handle
    out = autoflat.step(update, num_steps=k)(h, h)
    np.testing.assert_allclose(out["w"], np.full((k, 2), 2.0 + 4.0 * k))  # 4 per step
    maker = autoflat.step(make)
    h = maker({"w": jnp.ones((k, 2))}, 2.0)
    out = autoflat.step(lambda_free_nested, num_steps=k)(h, {"batch": h})  # or inside one
    np.testing.assert_allclose(out["w"], np.full((k, 2), 2.0 + 4.0 * k))
    assert autoflat.stats(maker).rebuilds == 0  # the handle is not rebuilt in place


def lambda_free_nested(state, x):
    state = {"w": state["w"] + jnp.sum(x["batch"]["w"])}
    return state


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


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize(
    "spelling", ["update", "ior", "setdefault_pop", "setattr", "append", "iadd_list"]
)
def test_in_place_spellings_are_written_back(spelling, k):
    """Item 9: `d.update(...)`, `d |= ...`, `d.pop(k)`, `setattr(o, ...)`, `xs.append(...)`
    change the caller's object as `d[k] = ...` does (they were silently dropped)."""

    class Box:
        pass

    def update(totals, x):
        if spelling == "update":
            totals.update({"sum": totals["sum"] + jnp.sum(x)})
        elif spelling == "ior":
            totals |= {"sum": totals["sum"] + jnp.sum(x)}
        elif spelling == "setdefault_pop":
            old = totals.pop("sum")
            totals.setdefault("sum", old + jnp.sum(x))
        elif spelling == "setattr":
            totals.sum = totals.sum + jnp.sum(x)
        elif spelling == "append":
            totals.append(totals.pop() + jnp.sum(x))
        else:
            totals += [totals.pop() + jnp.sum(x)]
        return jnp.sum(x)

    if spelling == "setattr":
        totals = Box()
        totals.sum = jnp.zeros(())
        jax.tree_util.register_pytree_node(
            Box, lambda b: ((b.sum,), None), lambda _, c: _box(Box, c[0])
        )
    elif spelling in ("append", "iadd_list"):
        totals = [jnp.zeros(())]
    else:
        totals = {"sum": jnp.zeros(())}
    step = autoflat.step(update, num_steps=k)
    x = jnp.ones((k, 3)) if k > 1 else jnp.ones(3)
    for _ in range(2):
        step(totals, x)
    got = (
        totals.sum
        if spelling == "setattr"
        else totals[0]
        if isinstance(totals, list)
        else totals["sum"]
    )
    np.testing.assert_allclose(got, 6.0 * k)
    assert "changed in place" in autoflat.show(step) or "assigned into" in autoflat.show(step)


def _box(cls, value):
    b = object.__new__(cls)
    b.sum = value
    return b


def test_an_optax_transformation_update_is_not_a_mutation():
    """`optimizer.update(grads, opt_state)` on an optax GradientTransformation argument is a
    call, not an in-place change: only dicts and lists count."""
    import optax

    def update(params, opt_state, optimizer, x):
        grads = jax.grad(lambda p: jnp.sum((p - x) ** 2))(params)
        updates, opt_state = optimizer.update(grads, opt_state)
        params = optax.apply_updates(params, updates)
        return params, opt_state

    opt = optax.sgd(0.1)
    step = autoflat.step(update, num_steps=2)
    params = jnp.zeros(3)
    params, state = step(params, opt.init(params), opt, jnp.ones((2, 3)))
    np.testing.assert_allclose(params, [0.36, 0.36, 0.36], rtol=1e-6)
    assert "# optimizer: broadcast" in autoflat.show(step)


def test_a_changed_attribute_of_a_method_steps_instance_is_seen():
    """Item 10: `t.lr = 0.1` after the first call was ignored (the instance was a static leaf
    hashed by identity). The attributes the body reads are part of the call's key: a new value
    recompiles, with the recompile warning naming it."""

    class Trainer:
        def __init__(self):
            self.lr = 0.5
            self.target = jnp.zeros(2)

        @autoflat.step
        def train(self, p):
            p = p - self.lr * (p - self.target)
            return p

    t = Trainer()
    p = t.train(jnp.ones(2))
    np.testing.assert_allclose(p, [0.5, 0.5])
    p = t.train(p)
    np.testing.assert_allclose(p, [0.25, 0.25])
    t.lr = 1.0
    p = t.train(p)
    np.testing.assert_allclose(p, [0.0, 0.0])
    t.target = jnp.ones(2)
    np.testing.assert_allclose(t.train(jnp.zeros(2)), [1.0, 1.0])
    assert autoflat.stats(Trainer.train).traces == 3
    assert "a new value of self.lr, self.target recompiles" in autoflat.show(Trainer.train)
    # The recompile warning names the attribute that changed.
    with pytest.warns(
        autoflat.AutoflatRecompileWarning, match=r"`self\.lr` \(0\.0625 -> 0\.03125\)"
    ):
        for i in range(8):
            t.lr = 1.0 / 2 ** (i + 1)
            t.train(p)


def test_a_non_array_per_step_input_names_the_argument():
    """Item 15: a string declared per-step got JAX's message naming `Step._entry` and
    `xs[1]`; now the argument and leaf path, and the fix."""

    def update(p, tags, x):
        p = p + x
        return p

    step = autoflat.step(update, num_steps=2, per_step=("tags", "x"))
    p = step(jnp.zeros(2), jnp.zeros(2), jnp.ones((2, 2)))
    with pytest.raises(
        autoflat.CallError, match=r"`tags\[1\]` is a str, not an array, and `tags` is a per-step"
    ) as info:
        step(p, [jnp.zeros(()), "b"], jnp.ones((2, 2)))
    assert 'static_argnames="tags"' in str(info.value)
    np.testing.assert_allclose(step(p, jnp.zeros(2), jnp.ones((2, 2))), [4.0, 4.0])  # p intact


def _zeros_state():
    return {"sum": jnp.zeros(3), "n": jnp.zeros(())}


def test_a_keyboard_interrupt_after_the_program_ran_is_recoverable(monkeypatch):
    """An interrupt after the compiled program ran (it consumed the donated state): the new
    state is reachable from the step, `step.recover()` returns what the call would have."""
    from helpers import accumulate, ones

    import autoflat._step as step_module

    step = autoflat.step(accumulate, num_steps=2)
    s, _ = step(_zeros_state(), ones(2))
    finish = step_module.finish

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(step_module, "finish", interrupted)
    with pytest.raises(KeyboardInterrupt):
        step(s, ones(2))
    monkeypatch.setattr(step_module, "finish", finish)
    with pytest.raises(autoflat.ConsumedError):
        s["sum"]  # donated to the interrupted call, and marked so
    s, outs = step.recover()
    np.testing.assert_allclose(s["sum"], [4.0, 4.0, 4.0])
    np.testing.assert_allclose(outs, [3.0, 3.0])
    with pytest.raises(autoflat.StateError, match="nothing to recover"):
        step.recover()
    s, _ = step(s, ones(2))
    np.testing.assert_allclose(s["n"], 6.0)


@jax.tree_util.register_pytree_node_class
class _Metrics:
    """A user's pytree class among a step's outputs: JAX rebuilds it with Python code, after
    the program ran. `interrupt` makes that code raise as a Ctrl-C landing there would."""

    interrupt = False

    def __init__(self, loss):
        self.loss = loss

    def tree_flatten(self):
        return (self.loss,), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        if cls.interrupt:
            cls.interrupt = False
            raise KeyboardInterrupt
        return cls(*children)


@pytest.mark.parametrize("k", [1, 2])
def test_an_interrupt_while_the_outputs_are_rebuilt_is_recoverable(k):
    """It came while JAX rebuilt the outputs from the program's buffers, in Python, before
    they reached the step: the donated state and the new one were both lost."""

    def update(state, x):
        state = {"sum": state["sum"] + x, "n": state["n"] + 1}
        return state, _Metrics(jnp.sum(x))

    step = autoflat.step(update, num_steps=k)
    xs = jnp.ones((k, 3)) if k > 1 else jnp.ones(3)
    s, _ = step(_zeros_state(), xs)
    _Metrics.interrupt = True
    with pytest.raises(KeyboardInterrupt):
        step(s, xs)
    s, m = step.recover()
    np.testing.assert_allclose(s["sum"], [2.0 * k] * 3)
    np.testing.assert_allclose(m.loss, [3.0] * k if k > 1 else 3.0)


def _interrupted_after_running(runner):
    """`_launch.runner` whose program runs to the end, then a KeyboardInterrupt comes before
    its results reach autoflat (as in JAX's own Python dispatch on a first call)."""

    def interrupted(*args, **kwargs):
        jit = runner(*args, **kwargs)

        def run(*a):
            jax.block_until_ready(jit(*a))
            raise KeyboardInterrupt

        return run

    return interrupted


def test_an_interrupt_after_the_program_ran_that_lost_its_results_says_so(monkeypatch):
    """Where autoflat cannot keep the results (JAX's own Python dispatch, on a first call for
    some input shapes, stopped after the program ran), the interrupt and later uses of the
    consumed state say what happened, instead of JAX's "Array has been deleted"."""
    from helpers import accumulate, ones

    import autoflat._runtime.launch as launch_module

    step = autoflat.step(accumulate, num_steps=2)
    s, _ = step(_zeros_state(), ones(2))
    runner = launch_module.runner
    interrupted_after_running = _interrupted_after_running(runner)

    monkeypatch.setattr(launch_module, "runner", interrupted_after_running)
    with pytest.raises(KeyboardInterrupt) as info:
        step(s, ones(2))
    assert "its results are lost" in "".join(getattr(info.value, "__notes__", []))
    monkeypatch.setattr(launch_module, "runner", runner)
    with pytest.raises(autoflat.ConsumedError, match="which an interrupt stopped"):
        s["sum"]
    with pytest.raises(autoflat.StateError, match="nothing to recover"):
        step.recover()


def test_a_keyboard_interrupt_before_the_program_ran_leaves_the_inputs(monkeypatch):
    from helpers import accumulate, ones

    import autoflat._runtime.launch as call_module

    step = autoflat.step(accumulate, num_steps=2)
    s, _ = step(_zeros_state(), ones(2))
    runner = call_module.runner

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(call_module, "runner", interrupted)
    with pytest.raises(KeyboardInterrupt):
        step(s, ones(2))
    monkeypatch.setattr(call_module, "runner", runner)
    with pytest.raises(autoflat.StateError, match="nothing to recover"):
        step.recover()
    s, _ = step(s, ones(2))  # the handle passed to the interrupted call is intact
    np.testing.assert_allclose(s["sum"], [4.0, 4.0, 4.0])


@pytest.mark.parametrize("style", ["returned", "written_back_with_callback"])
def test_threads_with_their_own_state_never_get_each_others_results(style):
    """The program's results landed in one queue per step, read back later: under threads, a
    call could read another thread's results (wrong values, silently) or find the queue
    emptied (an IndexError, its handles left claimed)."""
    import sys
    import threading

    if style == "returned":

        def update(state, x):
            state = {"w": state["w"] + x}
            return state

    else:

        def update(state, x):
            jax.debug.callback(lambda v: None, x)  # waited for before the write-back
            state["w"] = state["w"] + x

    step = autoflat.step(update)
    step({"w": jnp.zeros(4)}, jnp.ones(4))
    wrong, errors = [], []

    def worker(t):
        s, expect = {"w": jnp.full((4,), t * 1000.0)}, t * 1000.0
        for _ in range(150):
            try:
                r = step(s, jnp.ones(4))
            except Exception as e:  # noqa: BLE001
                errors.append(e)
                return
            s = r if style == "returned" else s
            expect += 1
            if float(np.asarray(s["w"])[0]) != expect:
                wrong.append((t, expect))
                return

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors and not wrong, (errors[:1], wrong[:1])


def test_an_interrupted_call_whose_state_is_retried_points_at_recover(monkeypatch):
    """Mutation style: the objects held the buffers the interrupted call consumed. Calling
    the step again with them raised XLA's "Buffer has been deleted" and forgot the results
    `recover()` would have returned."""
    nnx = pytest.importorskip("flax.nnx")

    import autoflat._step as step_module

    class Model(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.zeros(2))

    def train(model, x):
        model.w[...] = model.w[...] + x

    model, step = Model(), autoflat.step(train)
    step(model, jnp.ones(2))
    step(model, jnp.ones(2))  # the model now holds buffers autoflat wrote: donated as they are
    finish = step_module.finish

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(step_module, "finish", interrupted)
    with pytest.raises(KeyboardInterrupt):
        step(model, jnp.ones(2))
    monkeypatch.setattr(step_module, "finish", finish)
    with pytest.raises(autoflat.StateError, match=r"train.recover\(\)` returns them"):
        step(model, jnp.ones(2))
    step.recover()  # still there
    np.testing.assert_allclose(model.w[...], [3.0, 3.0])
    step(model, jnp.ones(2))
    np.testing.assert_allclose(model.w[...], [4.0, 4.0])


def test_an_interrupt_after_the_first_run_that_consumed_only_copies_is_not_a_loss(monkeypatch):
    """The first call donates copies of the caller's arrays: an interrupt after it ran (and
    before its results landed) leaves the caller's state whole, and says nothing is lost."""
    from helpers import accumulate, ones

    import autoflat._runtime.launch as launch_module

    step = autoflat.step(accumulate, num_steps=2)
    runner = launch_module.runner
    interrupted_after_running = _interrupted_after_running(runner)

    state = _zeros_state()
    monkeypatch.setattr(launch_module, "runner", interrupted_after_running)
    with pytest.raises(KeyboardInterrupt) as info:
        step(state, ones(2))
    assert not getattr(info.value, "__notes__", None)
    monkeypatch.setattr(launch_module, "runner", runner)
    s, _ = step(state, ones(2))
    np.testing.assert_allclose(s["sum"], [2.0] * 3)


def test_two_threads_passing_one_handle():
    """Item 11: one wins; the other gets the consumed error (was JAX's "buffer deleted"), and
    nothing of the winner's result is lost."""
    import threading

    from helpers import accumulate, ones

    step = autoflat.step(accumulate, num_steps=2)
    s, _ = step(_zeros_state(), ones(2))
    results, errors = [], []
    barrier = threading.Barrier(2)

    def worker():
        barrier.wait()
        try:
            results.append(step(s, ones(2))[0])
        except Exception as e:
            errors.append(e)

    for _ in range(20):
        s, _ = step(s, ones(2))
        results.clear(), errors.clear()
        threads = [threading.Thread(target=worker) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(results) == 1 and len(errors) == 1, (results, errors)
        assert isinstance(errors[0], autoflat.ConsumedError), errors[0]
        s = results[0]
    assert float(s["n"]) == 2 * (1 + 2 * 20)


def test_a_qualname_with_a_line_break():
    """Item 15: a `__qualname__` holding a newline raised a libcst validation error."""

    def update(p, x):
        p = p + x
        return p

    update.__qualname__ = "weird\nname"
    step = autoflat.step(update)
    np.testing.assert_allclose(step(jnp.ones(2), jnp.ones(2)), [2.0, 2.0])
    assert "# autoflat: generated from `weird\\nname`" in autoflat.show(step)


def test_a_per_step_batch_written_into_is_not_carried_silently():
    """`batch["x"] = ...` made `batch` state: with num_steps=4 each step saw all four steps'
    values, carried and doubled (losses far from jax.jit's, and the caller's batch changed).
    Now an error names the two readings; per_step= gives jax.jit's result."""

    def update(p, batch):
        batch["x"] = batch["x"] * 2
        p = p + jnp.sum(batch["x"])
        return p

    xs = jnp.arange(8.0).reshape(4, 2)
    ref = jnp.zeros(())
    for i in range(4):
        ref = jax.jit(update)(ref, {"x": xs[i]})
    batch = {"x": xs}
    with pytest.raises(autoflat.ShapeError, match=r"writes into `batch` \(line \d+\)") as info:
        autoflat.step(update, num_steps=4)(jnp.zeros(()), batch)
    assert 'per_step="batch"' in str(info.value) and 'state="batch"' in str(info.value)
    assert batch["x"] is xs  # nothing written back
    step = autoflat.step(update, num_steps=4, per_step="batch")
    np.testing.assert_allclose(step(jnp.zeros(()), batch), ref)
    assert batch["x"] is xs  # changed locally, as under jax.jit


def test_the_consumed_error_names_the_step_that_consumed_the_handle():
    """Item 15: the message named the step that made the handle, not the one that took it."""

    def make(p, x):
        p = {"w": p["w"] + x}
        return p

    def train(p, x):
        p = {"w": p["w"] * x}
        return p

    maker, trainer = autoflat.step(make), autoflat.step(train)
    h = maker({"w": jnp.ones(2)}, jnp.ones(2))
    trainer(h, jnp.ones(2))
    with pytest.raises(autoflat.ConsumedError, match=r"consumed by call 1 of `[\w.<>]*train`"):
        h["w"]


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("donate", [True, False])
def test_numpy_float64_arguments_are_silent_as_under_jax_jit(k, donate):
    """Item 16: NumPy float64 state, per-step and broadcast inputs (the suite turns warnings
    into errors) give jax.jit's float32 results without a warning."""

    def update(params, totals, x, scale):
        params = {"w": params["w"] - scale * x}
        totals["sum"] = totals["sum"] + np.float32(1.0) * jnp.sum(x)
        return params, jnp.sum(params["w"])

    params = {"w": np.linspace(0.0, 1.0, 3)}  # float64
    xs = np.arange(9.0).reshape(3, 3) / 10  # float64
    scale = np.float64(0.5)
    ref_p, ref_t = params, {"sum": np.zeros(())}
    for i in range(3):
        ref_p, _ = jax.jit(update)(ref_p, ref_t, xs[i], scale)
    totals = {"sum": np.zeros(())}
    step = autoflat.step(update, num_steps=k, donate=donate, broadcast="scale")
    p = params
    for start in range(0, 3, k):
        x = xs[start : start + k] if k > 1 else xs[start]
        p, _ = step(p, totals, x, scale)
    np.testing.assert_allclose(p["w"], ref_p["w"], rtol=1e-6)
    np.testing.assert_allclose(totals["sum"], np.sum(xs), rtol=1e-6)
    assert params["w"].dtype == np.float64  # the caller's arrays are untouched


def _uses_a_table(w, table, x):
    return w + table.sum(axis=1).mean() * x, (w * x).sum()


@pytest.mark.parametrize("options", [{}, {"state": "w"}])
def test_a_step_failing_on_an_argument_sliced_by_its_leading_axis_says_so(options):
    """A full table whose length is num_steps is read as per-step (rule `leading-axis`) and
    the step then fails on a slice with JAX's bare error (numpyro's SVI docstring model, a
    full batch of 4 at num_steps=4): a note names the arguments read so and the
    `broadcast=` that settles it, which then runs as `jax.jit` does."""
    w, table, xs = jnp.ones(2), jnp.arange(8.0).reshape(4, 2), jnp.ones((4, 2))
    with pytest.raises(ValueError, match="out of bounds") as info:
        autoflat.step(_uses_a_table, num_steps=4, **options)(w, table, xs)
    note = info.value.__notes__[-1]
    assert (
        "autoflat read `table`, `x` as per-step by the leading axis alone (4 = num_steps)" in note
    )
    assert note.endswith("@autoflat.step(num_steps=4, broadcast=<its name>)")
    step = autoflat.step(_uses_a_table, num_steps=4, broadcast="table", **options)
    got, outs = step(w, table, xs)
    want = w
    for x in xs:
        want, _ = jax.jit(_uses_a_table)(want, table, x)
    np.testing.assert_allclose(autoflat.unwrap(got), want, rtol=1e-6)
