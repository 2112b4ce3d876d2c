"""The generated code, exactly: header, labelled sections, the body unchanged, rewritten returns."""

from __future__ import annotations

import textwrap

import jax
import jax.numpy as jnp
import numpy as np

import autoflat


def update(model, opt_state, batch, lr=0.1, *, scale: float = 1.0):
    """Docstring: documents the step, not copied into the generated code."""
    # a comment stays
    loss = jnp.sum(batch * model["w"])  # trailing comment stays
    if loss > 1e9:  # early return, rewritten too
        return model, opt_state, loss

    def inner(m):
        return m  # a nested function's return is not rewritten

    model = inner({"w": model["w"] - lr * scale * batch})
    return model, opt_state, loss


LINE = update.__code__.co_firstlineno


def test_scan_code_exactly():
    step = autoflat.step(update, num_steps=4, static_argnames="scale", broadcast="lr")
    src = autoflat.show(step)
    expected = textwrap.dedent(
        f"""\
        # autoflat: generated from `update` at test_codegen.py:{LINE}
        # num_steps: 4
        # model: state (returned) [rule: returned-by-name]
        # opt_state: state (returned) [rule: returned-by-name]
        # batch: scanned (per-step input) [rule: as-passed]
        # lr: broadcast (broadcast=) [rule: option-or-self]
        # scale: static (static_argnames=) [rule: option-or-self]
        # returns: state model, state opt_state, output (stacked)
        def _autoflat_update(_af_unflatten, _af_flatten, _af_scan):
            def update(_af_spec, _af_state, _af_xs, _af_broadcast):
                def update_step(_af_carry, _af_x):
                    # unflatten state and bind this step's inputs
                    model = _af_unflatten(_af_carry[0])
                    opt_state = _af_unflatten(_af_carry[1])
                    batch = _af_x[0]
                    lr = _af_unflatten(_af_broadcast[0])
                    scale = _af_spec.static['scale']
                    # body of update (test_codegen.py:{LINE + 1}-{LINE + 11})
                    # a comment stays
                    loss = jnp.sum(batch * model["w"])  # trailing comment stays
                    if loss > 1e9:  # early return, rewritten too
                        return (_af_flatten(_af_spec, 0, model), _af_flatten(_af_spec, 1, opt_state)), (loss,)

                    def inner(m):
                        return m  # a nested function's return is not rewritten

                    model = inner({{"w": model["w"] - lr * scale * batch}})
                    return (_af_flatten(_af_spec, 0, model), _af_flatten(_af_spec, 1, opt_state)), (loss,)
                return _af_scan(update_step, _af_spec, _af_state, _af_xs)
            return update
        """
    )
    assert src == expected


def test_plain_code_for_one_step_and_fallthrough():
    def bump(counter, d):
        counter["n"] = counter["n"] + d

    step = autoflat.step(bump)
    src = autoflat.show(step)
    body = src.split("def bump(", 1)[1]
    assert body == textwrap.dedent(
        """\
        _af_spec, _af_state, _af_xs, _af_broadcast):
                # unflatten state and bind inputs
                counter = _af_unflatten(_af_state[0])
                d = _af_xs[0]
                # body of bump (test_codegen.py:{a}-{a})
                counter["n"] = counter["n"] + d
                return (_af_flatten(_af_spec, 0, counter),), ()
            return bump
        """
    ).format(a=bump.__code__.co_firstlineno + 1)
    assert f"# counter: state (assigned into at line {bump.__code__.co_firstlineno + 1})" in src


def _tally(counter, x):
    counter["n"] = counter["n"] + x.sum()
    return x * 2


def test_a_return_that_calls_runs_before_state_is_flattened():
    """`return f(counter, x), ...`: the call may change state in place, so the `return`'s
    calls are bound first, in the order written, and state is flattened after them (what
    the call wrote is read after it, as written)."""

    def count(counter, x):
        counter["seen"] = counter["seen"] + 1
        return _tally(counter, x), counter["n"] + 0

    step = autoflat.step(count)
    src = autoflat.show(step)
    line = count.__code__.co_firstlineno + 2
    assert src.split("# body of count ", 1)[1] == textwrap.dedent(
        """\
        (test_codegen.py:{a}-{b})
                counter["seen"] = counter["seen"] + 1
                _af_ret0 = _tally(counter, x)
                return (_af_flatten(_af_spec, 0, counter),), (_af_ret0, counter["n"] + 0)
            return count
        """
    ).format(a=line - 1, b=line)
    counter = {"n": jnp.float32(0.0), "seen": jnp.int32(0)}
    doubled, n = step(counter, jnp.ones(3))
    assert (float(counter["n"]), int(counter["seen"]), float(n)) == (3.0, 1, 3.0)
    assert doubled.tolist() == [2.0, 2.0, 2.0]


def _read_then_tally(counter, x):
    counter["seen"] = counter["seen"] + 1
    return counter["n"] + 0, _tally(counter, x)


def _rebound_by_a_nested_function(params, x):
    def shift():
        nonlocal params
        params = params + 1.0
        return x.sum()

    return params, shift()


def test_a_return_runs_in_the_order_written_up_to_its_last_call():
    """What a `return` writes before a call reads the value before the call, as `jax.jit`
    evaluates it; a bare name beside a call that a nested function rebinds (`nonlocal`)
    reads the value before the call too."""
    step = autoflat.step(_read_then_tally)
    assert '_af_ret0, _af_ret1 = counter["n"] + 0, _tally(counter, x)' in autoflat.show(step)
    counter = {"n": jnp.float32(0.0), "seen": jnp.int32(0)}
    before, _ = step(counter, jnp.ones(3))
    assert (float(before), float(counter["n"])) == (0.0, 3.0)  # (the state: after the call)
    fresh = {"n": jnp.float32(0.0), "seen": jnp.int32(0)}
    assert float(jax.jit(_read_then_tally)(fresh, jnp.ones(3))[0]) == 0.0
    for k in (1, 4):
        nested = autoflat.step(_rebound_by_a_nested_function, num_steps=k)
        xs = jnp.ones((k, 3)) if k > 1 else jnp.ones(3)
        p, _ = nested(jnp.zeros(2), xs)
        np.testing.assert_allclose(p, jnp.zeros(2))  # the value before `shift()` ran
    assert "_af_ret0, _af_ret1 = params, shift()" in autoflat.show(nested)


def test_names_avoid_collisions_with_user_names():
    _af_flatten = 1  # noqa: F841  (a local of this test, closed over below)

    def clash(_af_state, x):
        _af_spec = _af_flatten
        _af_state = _af_state + x + _af_spec
        return _af_state, x * 1

    step = autoflat.step(clash, num_steps=2)
    src = autoflat.show(step)
    assert "def _autoflat_clash(_af_unflatten, _af_flatten_1, _af_scan, _af_flatten):" in src
    assert "def clash(_af_spec_1, _af_state_1, _af_xs, _af_broadcast):" in src
    total, out = step(jnp.float32(1.0), jnp.array([1.0, 2.0], jnp.float32))
    assert float(total) == 1.0 + (1 + 1) + (2 + 1)
    assert out.tolist() == [1.0, 2.0]


def test_show_returns_the_compiled_text(capsys):
    step = autoflat.step(update)
    text = autoflat.show(step)
    assert capsys.readouterr().out == ""  # a value, shown as the code by a REPL
    assert repr(text) == text == step.programs[-1].generated.source


def test_generated_code_is_deterministic():
    a = autoflat.show(autoflat.step(update, num_steps=3))
    b = autoflat.show(autoflat.step(update, num_steps=3))
    assert a == b
