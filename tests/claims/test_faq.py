"""Doc-claims for docs/faq.md: every behavioural sentence of the FAQ, backed by a test.

Each test names the sentence it backs with `@claim("docs/faq.md", ...)` (tests/claims/claim.py):
it fails if the page no longer says that text, or if autoflat no longer does what it says.
Results are compared with a plain `jax.jit` loop of the same function (for `num_steps=k`, k
calls on the per-step slices); errors by type and the key words of their message; compiles,
fast-path hits, flattens, copies and rebuilds by `autoflat.stats`; roles and their evidence
by `autoflat.show`. Timing figures (the profile report's numbers, the benchmark ratios, the
convolution-in-a-scan slowdown) are not asserted. The claims about `functools.partial` steps
are backed here in brief; tests/test_partial.py has the cases in full.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import pickle
import re
import sys
import threading
import typing
import warnings
import weakref

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import tree_allclose

import autoflat
from claims.claim import claim

FAQ = "docs/faq.md"


@pytest.fixture(autouse=True)
def _default_transport(monkeypatch):
    # The sentences describe autoflat's defaults; `nox -s tests_pack` sets AUTOFLAT_PACK.
    monkeypatch.delenv("AUTOFLAT_PACK", raising=False)


def header(step):
    """The roles header of `autoflat.show(step)`."""
    return "\n".join(line for line in autoflat.show(step).splitlines() if line.startswith("# "))


def add(state, x):
    state = {"w": state["w"] + x}
    return state


# ==========================================================================================
# What cannot be transformed?
# ==========================================================================================


_LAMBDA = lambda params, x: params  # noqa: E731  (at module level: its name is `<lambda>`)


def _source_error(fn):
    with pytest.raises(autoflat.AutoflatError) as info:
        autoflat.step(fn)
    return str(info.value)


@claim(
    FAQ,
    "These raise an `AutoflatError` when the function is decorated, with a message that says what to write instead",
)
@claim(FAQ, "| a `lambda` | no statement body to rewrite | a `def` |")
def test_a_lambda_is_refused_at_decoration():
    message = _source_error(_LAMBDA)
    assert message.splitlines()[0].startswith("autoflat cannot read the source of `<lambda>`")
    assert message.splitlines()[0].endswith("it is a lambda.")
    assert "def update(" in message  # what to write instead


@claim(
    FAQ,
    "| code typed at the Python REPL, or run by `exec` | `inspect` cannot find its source | put the step in a file (a module or script) |",
)
def test_exec_code_is_refused_at_decoration():
    namespace = {}
    exec("def update(params, x):\n    return params\n", namespace)
    message = _source_error(namespace["update"])
    assert message.splitlines()[0] == (
        "autoflat cannot read the source of `update` (defined at <string>:1): "
        "could not get source code."
    )
    assert "in a file" in message


@claim(
    FAQ, "autoflat cannot read the source of `<lambda>` (defined at train.py:4): it is a lambda."
)
@claim(
    FAQ,
    "autoflat cannot read the source of `update` (defined at <string>:1): could not get source code.",
)
def test_the_printed_first_lines():
    first = _source_error(_LAMBDA).splitlines()[0]
    assert re.fullmatch(
        r"autoflat cannot read the source of `<lambda>` \(defined at .+test_faq\.py:\d+\): "
        r"it is a lambda\.",
        first,
    )


def _gen(params, x):
    yield params


async def _async(params, x):
    return params


async def _await(params, x):
    await x
    return params


_G = 0


def _global(params, x):
    global _G
    _G = x
    return params


def _nonlocal():
    n = 0

    def update(params, x):
        nonlocal n
        n = x
        return params

    return update


def _shapes(params, x):
    if x is None:
        return params
    return params, x


@claim(
    FAQ,
    "| `yield` | a step runs once per step and returns | `return` the values; per-step outputs are stacked for you |",
)
def test_yield_is_refused():
    message = _source_error(_gen)
    assert "`yield`" in message and "return" in message and "stacks them" in message


@claim(
    FAQ,
    "| `async def`, `await` | not an ordinary function | a plain `def` (JAX dispatch is already asynchronous) |",
)
def test_async_and_await_are_refused():
    for fn in (_async, _await):
        message = _source_error(fn)
        assert "async" in message and "ordinary `def`" in message
        assert "JAX dispatch is already asynchronous" in message


@claim(
    FAQ,
    "| `global x` / `nonlocal x` | the write would happen once, while tracing | return the value from the step |",
)
def test_global_and_nonlocal_are_refused():
    for fn, word in ((_global, "global"), (_nonlocal(), "nonlocal")):
        message = _source_error(fn)
        assert f"`{word}`" in message and "only while tracing" in message
        assert "Return the value instead" in message


@claim(
    FAQ,
    "| `return` statements of different shapes | every call must return the same layout | return the same tuple from every branch |",
)
def test_returns_of_different_shapes_are_refused():
    message = _source_error(_shapes)
    assert "disagree" in message and "the same shape" in message


@claim(
    FAQ,
    "| a `jax.jit` with `in_shardings`/`out_shardings` under `autoflat.step` (an `nnx.jit` with any option) | autoflat compiles the step itself and would drop them | remove the inner jit; shardings come from the arguments you pass |",
)
def test_a_jit_with_shardings_or_an_nnx_jit_with_options_is_refused():
    from flax import nnx
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    sharding = NamedSharding(Mesh(jax.devices()[:1], ("d",)), PartitionSpec())
    for kind, wrapped, options in (
        ("jax.jit", jax.jit(add, in_shardings=sharding), "in_shardings"),
        ("jax.jit", jax.jit(add, out_shardings=sharding), "out_shardings"),
        ("nnx.jit", nnx.jit(add, in_shardings=sharding), "in_shardings"),
        ("nnx.jit", nnx.jit(add, donate_argnums=0), "donate_argnums=(0,)"),
        ("nnx.jit", nnx.jit(add, static_argnames="x"), "static_argnums=(1,), static_argnames"),
    ):
        message = _source_error(wrapped)
        assert f"is wrapped by `{kind}` with {options}" in message
        assert "would drop" in message and f"Remove the inner `{kind}`" in message
        assert "shardings come from the arguments you pass" in message


def _with_schedule(params, x, learning_rate_fn, table):
    params = {"w": params["w"] - learning_rate_fn(0) * (x + table.sum(0))}
    return params


@claim(
    FAQ,
    "A `functools.partial` is taken as `jax.jit` takes it: its function, with the arguments the partial binds passed on every call",
)
@claim(FAQ, "a keyword you pass at the call overrides a bound one, as with the partial")
@claim(FAQ, "The source is the wrapped function's.")
@claim(
    FAQ,
    'a bound schedule or optimizer is broadcast, a bound array is broadcast (never sliced per step), a bound Python number is a constant, and `show()` says "bound by functools.partial" for each',
)
@claim(FAQ, "a `return` that names it is an error that asks you to pass it at the call instead")
def test_a_functools_partial_is_taken_as_jax_jit_takes_it():
    import functools

    schedule = optax.constant_schedule(0.5)
    table = jnp.ones((2, 3))  # leading axis 2 = num_steps, and still not sliced
    bound = functools.partial(_with_schedule, learning_rate_fn=schedule, table=table)
    step = autoflat.step(jax.jit(bound), num_steps=2)
    params = step({"w": jnp.zeros(3)}, jnp.ones((2, 3)))
    reference, ref = jax.jit(bound), {"w": jnp.zeros(3)}
    for _ in range(2):
        ref = reference(ref, jnp.ones(3))
    tree_allclose(params, ref)
    shown = header(step)
    assert shown.startswith("# autoflat: generated from `_with_schedule` at test_faq.py:")
    assert "# learning_rate_fn: broadcast (bound by functools.partial; " in shown
    assert "# table: broadcast (bound by functools.partial; the same value every call)" in shown
    other = jnp.full((2, 3), 2.0)
    params = step(params, jnp.ones((2, 3)), table=other)  # the call's keyword wins
    for _ in range(2):
        ref = reference(ref, jnp.ones(3), table=other)
    tree_allclose(params, ref)

    def returns_bound(w, x):
        w = w - x
        return w

    with pytest.raises(autoflat.SourceError, match="Pass `w` at the call instead"):
        autoflat.step(functools.partial(returns_bound, jnp.zeros(3)))


def _nested(params, x, n):
    def scale(v):
        return v * 2

    sq = lambda v: v * v  # noqa: E731
    total = sum([scale(v) for v in jax.tree.leaves(params)])
    for _ in range(n):
        total = total + sq(x)
    if n > 1:
        total = total - 1
    params = {"w": params["w"] + total}
    return params, total


@claim(
    FAQ,
    "Nested functions, lambdas, loops, comprehensions and `if` statements *inside* the step are fine: they are copied into the generated code unchanged, and JAX traces them as usual.",
)
def test_nested_functions_loops_and_ifs_inside_the_step_are_fine():
    step = autoflat.step(_nested, static_argnames="n")
    p, out = step({"w": jnp.ones(2)}, jnp.ones(2), 3)
    ref_p, ref_out = jax.jit(_nested, static_argnames="n")({"w": jnp.ones(2)}, jnp.ones(2), 3)
    tree_allclose((p, out), (ref_p, ref_out))
    source = autoflat.show(step)
    for line in (
        "def scale(v):",
        "sq = lambda v: v * v",
        "total = sum([scale(v) for v in jax.tree.leaves(params)])",
        "for _ in range(n):",
        "if n > 1:",
    ):
        assert line in source


class _Stepper(eqx.Module):
    lr: float = 0.5

    def __call__(self, w, x):
        w = w - self.lr * x
        return w


@claim(
    FAQ,
    "An object whose class defines `__call__` (an Equinox module used as the step) is taken as its bound `__call__`, as `jax.jit(stepper)` takes it: a method step whose instance is broadcast (a Flax NNX module's is state, its changes written back, as under `nnx.jit`).",
)
def test_a_callable_object_is_taken_as_its_bound_call():
    from flax import nnx

    stepper = _Stepper()
    step = autoflat.step(stepper)
    w = step(jnp.ones(2), jnp.ones(2))
    np.testing.assert_allclose(w, jax.jit(stepper)(jnp.ones(2), jnp.ones(2)))
    assert "generated from `_Stepper.__call__`" in autoflat.show(step)
    assert "# self: broadcast (the method's instance" in header(step)

    class Counting(nnx.Module):
        def __init__(self):
            self.n = nnx.BatchStat(jnp.zeros(()))

        def __call__(self, x):
            self.n[...] = self.n[...] + x.sum()
            return x * 2

    ref, got = Counting(), Counting()
    nnx.jit(lambda m, x: m(x))(ref, jnp.ones(2))
    autoflat.step(got)(jnp.ones(2))
    assert float(got.n[...]) == float(ref.n[...]) == 2.0


def _counted(w, x, n):
    w = w + x * n
    return w


@claim(
    FAQ,
    "A step already wrapped by `jax.jit`, `eqx.filter_jit` or `nnx.jit` is taken as its function (autoflat compiles it itself)",
)
@claim(
    FAQ,
    "a `jax.jit` of a bound method (jaxopt's solvers hold `self.update = jax.jit(self.update)`) as the method step.",
)
def test_a_step_wrapped_by_a_jit_is_taken_as_its_function():
    from flax import nnx

    for wrapped in (jax.jit(add), eqx.filter_jit(add), nnx.jit(add)):
        step = autoflat.step(wrapped)
        s = step({"w": jnp.zeros(2)}, jnp.ones(2))
        s = step(s, jnp.ones(2))
        np.testing.assert_allclose(s["w"], [2.0, 2.0])
        assert "generated from `add`" in autoflat.show(step)
        assert "# state: state (returned)" in header(step)

    class Solver:
        def __init__(self):
            self.update = jax.jit(self.update)

        def update(self, state, x):
            return add(state, x)

    step = autoflat.step(Solver().update)
    s = step(step({"w": jnp.zeros(2)}, jnp.ones(2)), jnp.ones(2))
    np.testing.assert_allclose(s["w"], [2.0, 2.0])
    assert "# self: broadcast (the method's instance" in header(step)


@claim(
    FAQ,
    "A `jax.jit`'s `static_argnums`/`static_argnames` become autoflat's `static_argnames`, by name; its `donate_argnums` are dropped: autoflat donates the state it carries from its second call on (`donate=`), and the arrays you pass at the first call stay valid.",
)
def test_a_jits_static_and_donate_arguments():
    import functools

    for wrapped in (
        functools.partial(jax.jit, static_argnums=2, donate_argnums=0)(_counted),
        jax.jit(_counted, static_argnames="n", donate_argnums=0),
    ):
        step = autoflat.step(wrapped)
        w = step(jnp.ones(2), jnp.ones(2), 3)
        np.testing.assert_allclose(w, [4.0, 4.0])
        w = step(w, jnp.ones(2), 2)
        np.testing.assert_allclose(w, [6.0, 6.0])
        assert "# n: static (static_argnames=)" in header(step)
        assert autoflat.stats(step).traces == 2  # one version per value of n
    # donation: the first call's arrays stay valid, the state it returned is donated next
    step = autoflat.step(jax.jit(add, donate_argnums=0))
    mine = {"w": jnp.ones(2)}
    s1 = step(mine, jnp.ones(2))
    assert not mine["w"].is_deleted()
    step(s1, jnp.ones(2))
    with pytest.raises(autoflat.ConsumedError):
        s1["w"]
    np.testing.assert_allclose(mine["w"], [1.0, 1.0])


# ==========================================================================================
# Why is my model a per-step input instead of state?
# ==========================================================================================

tx_sgd = optax.sgd(0.1)


def _by_value(params, opt_state, x):
    grads = jax.grad(lambda p: jnp.sum((p["w"] - x) ** 2))(params)
    updates, opt_state = tx_sgd.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state  # matched by value


@claim(
    FAQ,
    "State is a parameter the step gives back: by name (`return params, opt_state, loss`), or under another name or as an expression (`return new_params, ...`, `return optax.apply_updates(params, updates), ...`), which autoflat matches by abstract value at the first call.",
)
@claim(
    FAQ, 'assert "# params: state (matched by value to return position 0)" in autoflat.show(update)'
)
def test_state_given_back_as_an_expression_is_matched_by_value():
    step = autoflat.step(_by_value, num_steps=2)
    params = {"w": jnp.zeros(3)}
    xs = jax.random.normal(jax.random.key(0), (2, 3))
    p, o = step(params, tx_sgd.init(params), xs)
    assert "# params: state (matched by value to return position 0)" in autoflat.show(step)
    assert "# opt_state: state (returned)" in autoflat.show(step)
    ref = (params, tx_sgd.init(params))
    for i in range(2):
        ref = jax.jit(_by_value)(*ref, xs[i])
    tree_allclose((p, o), ref)


def _halved(w, x):
    w2 = w * 0.5 + x
    return w2, jnp.sum(x)


@claim(
    FAQ,
    'If a parameter is still not state, the header of `autoflat.show(update)` says why; name it with `state="params"`, or say at which return position it comes back: `state={"params": 0}`.',
)
def test_a_parameter_not_taken_as_state_says_why_and_state_names_it():
    step = autoflat.step(_halved)
    w, _ = step(jnp.zeros(3), jnp.ones(3))
    assert "# w: scanned (per-step input) [rule: as-passed]" in header(step)
    for option, evidence in (
        ("w", "# w: state (matched by value to return position 0)"),
        ({"w": 0}, "# w: state (state= at return position 0)"),
    ):
        step = autoflat.step(_halved, state=option)
        w = jnp.zeros(3)
        for _ in range(3):
            w, _ = step(w, jnp.ones(3))
        assert evidence in header(step)
        ref = jnp.zeros(3)
        for _ in range(3):
            ref, _ = jax.jit(_halved)(ref, jnp.ones(3))
        tree_allclose(w, ref)


# ==========================================================================================
# Why does autoflat ask whether my learning rate is state?
# ==========================================================================================


def train_step(params, opt_state, batch, lr):
    loss, grads = jax.value_and_grad(lambda p: jnp.sum((p["w"] * batch) ** 2))(params)
    updates, opt_state = tx_sgd.update(grads, opt_state, params)
    params = optax.apply_updates(params, jax.tree.map(lambda u: u * lr, updates))
    return params, opt_state, loss


def _lr_args(lr=None):
    params = {"w": jnp.ones(3)}
    lr = jnp.asarray(0.5) if lr is None else lr
    return params, tx_sgd.init(params), jnp.linspace(0.0, 1.0, 6).reshape(2, 3), lr


@claim(
    FAQ,
    'With `num_steps > 1`, a step such as `train_step(params, opt_state, batch, lr)` returning `params, opt_state, loss`, with `lr` an array, raises an `autoflat.OptionError`: "return position 2 (`loss`, not computed from `lr`) could be the new value of `lr`".',
)
@claim(
    FAQ,
    "Nothing in the step tells a learning rate beside a loss from a previous loss overwritten every step (`(w, prev_loss, x)` returning `w, loss`), so autoflat asks rather than guess.",
)
@claim(
    FAQ,
    'Say `broadcast="lr"` (the same every step), or pass a Python float (static: a new value recompiles); the message offers these, and `state={"lr": 2}` only for a value the step overwrites every step.',
)
def test_a_bare_array_at_the_place_of_a_loss_asks():
    args = _lr_args()
    with pytest.raises(autoflat.OptionError) as info:
        autoflat.step(train_step, num_steps=2)(*args)
    message = str(info.value)
    assert (
        "return position 2 (`loss`, not computed from `lr`) could be the new value of `lr`"
        in message
    )
    assert 'broadcast="lr"' in message and "Python float" in message
    assert 'state={"lr": 2}' in message
    assert message.index('broadcast="lr"') < message.index('state={"lr": 2}')
    assert "Only if each step's `lr` is what return position 2 gave back" in message
    # each fix runs: broadcast= and a Python float give the jax.jit loop's results
    ref = args[:2]
    for i in range(2):
        ref = jax.jit(train_step)(*ref, args[2][i], 0.5)[:2]
    for step, lr in (
        (autoflat.step(train_step, num_steps=2, broadcast="lr"), args[3]),
        (autoflat.step(train_step, num_steps=2), 0.5),
    ):
        p, o, _ = step(*args[:3], lr)
        tree_allclose((p, o), ref)
    step = autoflat.step(train_step, num_steps=2, state={"lr": 2})
    step(*args)
    assert "# lr: state (state= at return position 2)" in header(step)


def _prev_loss(w, prev_loss, x):
    loss = jnp.sum(w * x)
    w = w - 0.1 * x
    return w, loss


def _momentum(w, v, x):
    g = x * w
    return w - 0.1 * g, 0.9 * v + g


def _decayed(w, lr, g):
    w = w - 0.1 * g
    return w, jnp.abs(lr - 0.01 * jnp.sum(g))


def _best_expr(w, best, g):
    w = w - 0.1 * g
    return w, jnp.minimum(best, jnp.sum(w))


def _best_named(w, best, g):
    w = w - 0.1 * g
    best = jnp.minimum(best, jnp.sum(w))
    return w, best


@claim(
    FAQ,
    "The parameter's own name, its new one or it without a word for previous (`new_v`, `loss` for `prev_loss`; a name only sharing a word, `kl` beside `kl_weight`, does not), an expression computed from it, or a last operation that takes its array (`w - lr * g`) settles it without asking.",
)
def test_names_expressions_and_data_flow_settle_it():
    xs = jnp.linspace(0.0, 1.0, 6).reshape(2, 3)
    cases = (
        (_prev_loss, jnp.zeros(()), "# prev_loss: state (matched by value to return position 1)"),
        (_momentum, jnp.zeros(3), "# v: state (matched by value to return position 1)"),
        (_decayed, jnp.asarray(0.5), "# lr: state (matched by value to return position 1)"),
    )
    for fn, second, evidence in cases:
        step = autoflat.step(fn, num_steps=2)
        got = step(jnp.ones(3), second, xs)
        assert evidence in header(step), header(step)
        ref = (jnp.ones(3), second)
        for i in range(2):
            ref = jax.jit(fn)(*ref, xs[i])
        tree_allclose(got, ref)

    def weighted(w, kl_weight, x):  # (`kl` only shares a word with `kl_weight`: it asks)
        (_, kl), g = jax.value_and_grad(
            lambda w: (jnp.sum((w - x) ** 2) + kl_weight * jnp.sum(w**2), jnp.sum(w**2)),
            has_aux=True,
        )(w)
        return w - 0.1 * g, kl

    with pytest.raises(autoflat.OptionError, match='broadcast="kl_weight"'):
        autoflat.step(weighted, num_steps=2)(jnp.ones(3), jnp.asarray(0.5), xs)


@claim(
    FAQ,
    "A maximum or a minimum taking it is the exception: `jnp.minimum(best, loss)` keeps a running best and `jnp.maximum(floor, loss)` clamps by a fixed floor, so only the name settles it (`best = jnp.minimum(best, loss)`, `new_best`, or a word for an extreme it shares, `running_max` for `max_gnorm`), or the step computing with it (AMSGrad's `v_hat_t` in the update); returned as an expression and used for nothing else, it asks.",
)
def test_a_maximum_or_minimum_taking_it_is_settled_by_its_name_only():
    xs = jnp.linspace(0.0, 1.0, 6).reshape(2, 3)
    with pytest.raises(autoflat.OptionError, match='state=\\{"best": 1\\}'):
        autoflat.step(_best_expr, num_steps=2)(jnp.ones(3), jnp.asarray(9.0), xs)
    step = autoflat.step(_best_named, num_steps=2)
    got = step(jnp.ones(3), jnp.asarray(9.0), xs)
    ref = (jnp.ones(3), jnp.asarray(9.0))
    for i in range(2):
        ref = jax.jit(_best_named)(*ref, xs[i])
    tree_allclose(got, ref)
    assert "# best: state (returned)" in header(step)


# ==========================================================================================
# Why does my step recompile every call?
# ==========================================================================================


def _with_meta(state, cfg, x):
    state = {"w": cfg["act"](state["w"] * cfg["scale"] + x), "tag": state["tag"]}
    return state


def _identity(v):
    return v


@claim(
    FAQ,
    "Non-array leaves of state and broadcast arguments (Python numbers, strings, functions) are static: part of the cached structure, as in `eqx.filter_jit`",
)
def test_non_array_leaves_of_state_and_broadcast_arguments_are_static():
    step = autoflat.step(_with_meta, broadcast="cfg")
    cfg = {"scale": 2.0, "act": _identity}
    s = step({"w": jnp.ones(2), "tag": "a"}, cfg, jnp.ones(2))
    s = step(s, cfg, jnp.ones(2))
    assert autoflat.stats(step).traces == 1
    np.testing.assert_allclose(s["w"], [7.0, 7.0])
    assert s["tag"] == "a"
    s = step(s, {"scale": 3.0, "act": _identity}, jnp.ones(2))  # a new Python number
    assert autoflat.stats(step).traces == 2
    np.testing.assert_allclose(s["w"], [22.0, 22.0])
    s = step(s, {"scale": 3.0, "act": jnp.negative}, jnp.ones(2))  # a new function
    assert autoflat.stats(step).traces == 3
    np.testing.assert_allclose(s["w"], [-67.0, -67.0])
    step({"w": jnp.ones(2), "tag": "b"}, {"scale": 3.0, "act": jnp.negative}, jnp.ones(2))
    assert autoflat.stats(step).traces == 4  # a new string in the state


def _sgd_lr(w, x, lr):
    w = w - lr * x
    return w


@claim(
    FAQ,
    "so are Python numbers passed as arguments when `num_steps > 1`. A Python float learning rate passed that way compiles a new version for every value;",
)
@claim(
    FAQ,
    "Store values that change as arrays (`jnp.asarray(0.1)`), and keep shapes and dtypes fixed.",
)
def test_a_python_float_learning_rate_compiles_per_value_an_array_once():
    step = autoflat.step(_sgd_lr, num_steps=2)
    w = jnp.ones(2)
    for lr in (0.1, 0.2, 0.3):
        w = step(w, jnp.ones((2, 2)), lr)
    assert "# lr: static (a Python float" in header(step)
    assert autoflat.stats(step).traces == 3
    np.testing.assert_allclose(w, [1 - 2 * 0.6] * 2, rtol=1e-6)
    step = autoflat.step(_sgd_lr, num_steps=2)
    w = jnp.ones(2)
    for lr in (0.1, 0.2, 0.3):
        w = step(w, jnp.ones((2, 2)), jnp.asarray(lr))
    assert autoflat.stats(step).traces == 1
    np.testing.assert_allclose(w, [1 - 2 * 0.6] * 2, rtol=1e-6)


@claim(
    FAQ,
    "A Python `int` counter in state that the step counts up (`TrainState.step`) is made an array at the first call, so it compiles once.",
)
def test_a_python_int_counter_in_state_compiles_once():
    from flax.training import train_state

    def fit(state, x):
        grads = jax.grad(lambda p: jnp.sum((p["w"] * x) ** 2))(state.params)
        state = state.apply_gradients(grads=grads)
        return state

    state = train_state.TrainState.create(
        apply_fn=None, params={"w": jnp.ones(2)}, tx=optax.sgd(0.1)
    )
    assert type(state.step) is int
    for k in (1, 2):
        step = autoflat.step(fit, num_steps=k)
        s = state
        for _ in range(3):
            s = step(s, jnp.ones((k, 2)) if k > 1 else jnp.ones(2))
        assert autoflat.stats(step).traces == 1
        assert int(s.step) == 3 * k


def _lr_step(state, x, lr):
    state = {"w": state["w"] - lr * x}
    return state


@claim(
    FAQ,
    "After 8 compiles of one step autoflat warns with an `AutoflatRecompileWarning` that says what changed last.",
)
@claim(
    FAQ,
    "The recompile warning is issued at the start of the call after the one that compiled for the eighth time, before that call takes anything; raised as an error under your warning filters, it leaves every state usable.",
)
def test_the_recompile_warning_comes_before_the_ninth_call_takes_anything():
    step = autoflat.step(_lr_step, num_steps=2)
    s = {"w": jnp.zeros(2)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i in range(8):
            s = step(s, jnp.ones((2, 2)), 0.5 + i)  # eight compiles, no warning yet
        assert autoflat.stats(step).traces == 8
        with pytest.raises(autoflat.AutoflatRecompileWarning) as info:
            step(s, jnp.ones((2, 2)), 100.0)
    message = str(info.value)
    assert "compiled 8 times" in message
    assert "the value of static argument `lr` (6.5 -> 7.5)" in message
    assert autoflat.stats(step).calls == 8  # the ninth call took nothing
    expected = -2 * sum(0.5 + i for i in range(8))
    np.testing.assert_allclose(s["w"], [expected] * 2)  # the handle it was given: usable
    s = step(s, jnp.ones((2, 2)), 1.0)  # the warning is issued once
    np.testing.assert_allclose(s["w"], [expected - 2] * 2)


@claim(
    FAQ, "A final chunk shorter than `num_steps` compiles once for its length, and is then reused."
)
def test_a_final_chunk_compiles_once_for_its_length():
    step = autoflat.step(add, num_steps=4)
    s = {"w": jnp.zeros(2)}
    for _ in range(3):
        s = step(s, jnp.ones((4, 2)))
        s = step(s, jnp.ones((2, 2)))  # a final chunk of two steps
    assert autoflat.stats(step).traces == 2
    np.testing.assert_allclose(s["w"], [18.0, 18.0])


def _bf16_out(state, x):
    out = state["c"] + x  # weakly typed float32 + bfloat16 is bfloat16
    state = {"c": state["c"], "w": state["w"] + 1.0}
    return state, out


@claim(
    FAQ,
    "A state leaf made from a Python number (`jnp.asarray(0)`, `jnp.full((3,), 1.0)`, a `jax.jit` output of `0`",
)
@claim(
    FAQ, "is weakly typed, and the step sees it weakly typed, as under `jax.jit`, packed or not."
)
def test_weakly_typed_state_is_seen_weakly_typed_packed_or_not():
    assert jnp.asarray(0).weak_type and jax.jit(lambda: 0)().weak_type
    state = {"c": jnp.full((3,), 1.0), "w": jnp.zeros(3)}
    assert state["c"].weak_type
    x = jnp.ones(3, jnp.bfloat16)
    _, ref = jax.jit(_bf16_out)(state, x)
    assert ref.dtype == jnp.bfloat16
    for pack in (False, True):
        s, out = autoflat.step(_bf16_out, pack=pack)(dict(state), x)
        assert out.dtype == jnp.bfloat16, pack
        s, out = autoflat.step(_bf16_out, pack=pack)(s, x)
        assert out.dtype == jnp.bfloat16, pack


def _count_rewards(state, reward):
    state = {"n": state["n"] + reward}
    return state


@claim(
    FAQ,
    "Where the step gives it back strongly typed or of another dtype (a float32 reward added to a weakly typed int32 counter), the next call compiles once more, as `jax.jit`'s does",
)
def test_a_weak_leaf_given_back_strong_compiles_once_more_as_jax_jit():
    jitted = jax.jit(_count_rewards)
    step = autoflat.step(_count_rewards)
    r, s = {"n": jnp.asarray(0)}, {"n": jnp.asarray(0)}
    for _ in range(3):
        r = jitted(r, jnp.float32(1.0))
        s = step(s, jnp.float32(1.0))
    assert autoflat.stats(step).traces == 2 == jitted._cache_size()
    tree_allclose(s, r)
    assert autoflat.unwrap(s)["n"].dtype == jnp.float32


@claim(
    FAQ,
    "within a call of `num_steps` steps, the `lax.scan` carries it promoted to the type the step gives back from the first step, as `lax.scan` does, whether the step returns that state by name or as an expression (`return (w, total + loss), loss`).",
)
def test_within_a_call_the_scan_carries_it_promoted():
    rewards = jnp.array([0.5, 1.0, 1.5], jnp.float32)
    step = autoflat.step(_count_rewards, num_steps=3)
    s = step({"n": jnp.asarray(0)}, rewards)
    ref, _ = jax.lax.scan(lambda c, r: (_count_rewards(c, r), None), {"n": jnp.asarray(0)}, rewards)
    tree_allclose(s, ref)
    assert autoflat.unwrap(s)["n"].dtype == jnp.float32
    np.testing.assert_allclose(s["n"], 3.0)

    def body(carry, r):  # the carry given back as an expression
        w, total = carry
        return (w * 0.5, total + r * w), w

    step = autoflat.step(body, num_steps=3)
    start = (jnp.float32(1.0), jnp.asarray(0))
    got, ws = step(start, rewards)
    want, want_ws = jax.lax.scan(body, start, rewards)
    tree_allclose((autoflat.unwrap(got), ws), (want, want_ws))
    assert autoflat.unwrap(got)[1].dtype == jnp.float32


@claim(FAQ, "Give such leaves a dtype (`jnp.zeros((), jnp.float32)`) to compile once.")
def test_a_leaf_with_a_dtype_compiles_once():
    step = autoflat.step(_count_rewards)
    s = {"n": jnp.zeros((), jnp.float32)}
    for _ in range(3):
        s = step(s, jnp.float32(1.0))
    assert autoflat.stats(step).traces == 1
    np.testing.assert_allclose(s["n"], 3.0)


# ==========================================================================================
# My returned state has type `LazyHandle`. Is that a problem?
# ==========================================================================================


def _seq():
    return eqx.nn.Sequential(
        [
            eqx.nn.Linear(3, 4, key=jax.random.key(0)),
            eqx.nn.Dropout(0.5),
            eqx.nn.Linear(4, 2, key=jax.random.key(1)),
        ]
    )


def _halve(model, x):
    model = jax.tree.map(lambda a: a * 0.5 if eqx.is_array(a) else a, model)
    return model, jnp.sum(x)


def _halved_seq():
    return jax.tree.map(lambda a: a * 0.5 if eqx.is_array(a) else a, _seq())


def _seq_handle():
    model, _ = autoflat.step(_halve)(_seq(), jnp.ones(3))
    return model


@claim(
    FAQ,
    "No: a handle behaves as the object it stands for (`isinstance`, attributes, indexing, calling, `repr`, `pickle`, `copy`, `jax.tree.map`, `jax.jit`, `eqx.filter_jit`)",
)
def test_a_handle_behaves_as_its_object():
    h, real = _seq_handle(), _halved_seq()
    assert isinstance(h, eqx.nn.Sequential)
    np.testing.assert_array_equal(h.layers[0].weight, real.layers[0].weight)  # attributes
    assert isinstance(h[0], eqx.nn.Linear)  # indexing
    np.testing.assert_array_equal(h[2].bias, real[2].bias)
    x, key = jnp.ones(3), jax.random.key(2)
    np.testing.assert_array_equal(h(x, key=key), real(x, key=key))  # calling
    assert repr(h) == repr(real)
    for other in (pickle.loads(pickle.dumps(h)), copy.copy(h), copy.deepcopy(h)):
        assert type(other) is eqx.nn.Sequential
        tree_allclose(other, real, exact=True)
    doubled = jax.tree.map(lambda a: a * 2 if eqx.is_array(a) else a, h)
    assert type(doubled) is eqx.nn.Sequential
    tree_allclose(doubled, jax.tree.map(lambda a: a * 2 if eqx.is_array(a) else a, real))
    # (a Sequential's Dropout holds a Python float: static to jax.jit, hence filter_jit here
    # and a dict of arrays for jax.jit)
    np.testing.assert_allclose(
        eqx.filter_jit(lambda m, x: m(x, key=key))(h, x), real(x, key=key), rtol=1e-6
    )
    p = autoflat.step(add)({"w": jnp.ones(2)}, jnp.ones(2))
    assert autoflat.is_handle(p)
    np.testing.assert_array_equal(jax.jit(lambda s: s["w"] * 3)(p), [6.0, 6.0])


@claim(FAQ, "pickling it pickles the real object, so unpickling needs no autoflat.")
@claim(FAQ, "(a handle pickles as its real object by itself)")
def test_pickling_a_handle_pickles_the_real_object():
    h = _seq_handle()
    data = pickle.dumps(h)
    assert b"autoflat" not in data  # nothing of autoflat to import when unpickling
    assert data == pickle.dumps(autoflat.unwrap(h))
    assert type(pickle.loads(data)) is eqx.nn.Sequential


@claim(
    FAQ,
    "`type(x)` shows `LazyHandle`; `autoflat.is_handle(x)` tells you, and `autoflat.unwrap(x)` returns the real object.",
)
def test_type_is_handle_and_unwrap():
    h = _seq_handle()
    assert type(h) is autoflat.LazyHandle
    assert autoflat.is_handle(h) and not autoflat.is_handle(_seq())
    real = autoflat.unwrap(h)
    assert type(real) is eqx.nn.Sequential and not autoflat.is_handle(real)
    tree_allclose(real, _halved_seq(), exact=True)


@claim(
    FAQ,
    "To JAX a handle is a tree of the object's nodes: `jax.tree.map(f, handle)`, `jax.tree.leaves(handle, is_leaf=...)` (the `is_leaf` sees every node below the root, as for the object), `eqx.nn.inference_mode(handle)`, `eqx.tree_at(..., handle, ...)` and optax's `tx.init(handle)` and `tx.update(grads, opt_state)` give what they give for the object.",
)
def test_single_tree_operations_on_a_handle_give_what_they_give_for_the_object():
    h, real = _seq_handle(), _halved_seq()
    f = lambda a: a + 1 if eqx.is_array(a) else a  # noqa: E731
    tree_allclose(jax.tree.map(f, h), jax.tree.map(f, real), exact=True)
    seen_h, seen_r = [], []
    leaves_h = jax.tree.leaves(h, is_leaf=lambda n: seen_h.append(type(n)) or False)
    leaves_r = jax.tree.leaves(real, is_leaf=lambda n: seen_r.append(type(n)) or False)
    assert seen_h[1:] == seen_r[1:] and len(seen_h) == len(seen_r)  # every node below the root
    assert len(leaves_h) == len(leaves_r)
    tree_allclose(eqx.nn.inference_mode(h), eqx.nn.inference_mode(real), exact=True)
    assert eqx.nn.inference_mode(h).layers[1].inference is True
    at = lambda m: m.layers[0].bias  # noqa: E731
    tree_allclose(eqx.tree_at(at, h, jnp.zeros(4)), eqx.tree_at(at, real, jnp.zeros(4)))
    tx = optax.adam(1e-2)
    params = autoflat.step(add)({"w": jnp.ones(2)}, jnp.ones(2))
    state_h, state_r = tx.init(params), tx.init({"w": jnp.full(2, 2.0)})
    tree_allclose(state_h, state_r, exact=True)
    _, opt_h = autoflat.step(_adam_step)(params, state_r)
    grads = {"w": jnp.ones(2)}
    tree_allclose(tx.update(grads, opt_h), tx.update(grads, autoflat.unwrap(opt_h)), exact=True)


_tx_adam = optax.adam(1e-2)


def _adam_step(params, opt_state):
    updates, opt_state = _tx_adam.update({"w": jnp.ones(2)}, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, opt_state


@claim(
    FAQ,
    "a pytree operation over several trees that pairs a handle with a real tree fails with JAX's \"pytree structure error\", which prints the handle's type as `<class 'autoflat.LazyHandle'> (a lazy handle that an autoflat step returned: ... pass autoflat.unwrap(x) there, or decorate the step with lazy=False ...)`.",
)
@claim(
    FAQ,
    "Examples are `jax.tree.map(f, handle, real_tree)` (an EMA of the parameters kept outside the step), `optax.apply_updates(handle, updates)`, `eqx.partition(handle, ...)`, `eqx.combine` and `eqx.filter(handle, ...)`, so also `optim.init(eqx.filter(model, eqx.is_inexact_array))` on a returned model",
)
def test_multi_tree_operations_with_a_handle_fail_with_a_message_that_says_what_to_do():
    h, real = _seq_handle(), _halved_seq()
    params, static = eqx.partition(real, eqx.is_array)
    for operation in (
        lambda: jax.tree.map(lambda a, b: a, h, real),
        lambda: optax.apply_updates(h, real),
        lambda: eqx.partition(h, eqx.is_array),
        lambda: eqx.combine(h, static),
        lambda: eqx.combine(params, h),
        lambda: eqx.filter(h, eqx.is_array),
        lambda: optax.adam(1e-3).init(eqx.filter(h, eqx.is_inexact_array)),
    ):
        with pytest.raises(ValueError) as info:
            operation()
        message = str(info.value)
        assert "pytree structure error" in message
        assert (
            "<class 'autoflat.LazyHandle'> (a lazy handle that an autoflat step returned:"
            in message
        )
        assert "pass autoflat.unwrap(x) there, or decorate the step with lazy=False" in message


def _boxed(box, x):
    return box.replace(w=box.w + x), jnp.sum(box.b)


def _bump(state, x):
    return {"w": state["w"] + x, "b": state["b"] * 2.0}


@claim(
    FAQ,
    'Pass `autoflat.unwrap(handle)` also where code checks the object\'s exact type or pairs it with a prefix tree: `dataclasses.replace(handle, ...)`, `dataclasses.asdict` and `dataclasses.is_dataclass` (they check `type(x)`; an object\'s own `.replace`, as on a `flax.struct` dataclass or a `TrainState`, works on the handle); an `is_leaf` that tests `type(x) is dict` sees the handle at the root, and a `match` statement\'s mapping pattern does not match it; `jax.device_put(handle, {"w": sharding, ...})` fails in JAX (an `AssertionError`), and on JAX 0.10 so does `jax.vmap(f, in_axes=({"w": 0, "b": None},))(handle)` (an error about the prefix; JAX 0.12 takes it); and Equinox\'s transforms that partition their arguments refuse it with the pytree structure error above (`eqx.filter_grad`, `eqx.filter_value_and_grad`, `eqx.filter_vmap` with `in_axes`, `eqx.filter_eval_shape`; `eqx.filter_jit` and a plain `eqx.filter_vmap` take it).',
)
def test_exact_type_checks_and_prefix_trees_need_the_object():
    import dataclasses

    from flax import struct

    @struct.dataclass
    class Box:
        w: jax.Array
        b: jax.Array

    box, _ = autoflat.step(_boxed)(Box(jnp.ones(2), jnp.ones(2)), jnp.float32(1.0))
    with pytest.raises(TypeError, match="dataclass"):
        dataclasses.replace(box, w=jnp.zeros(2))
    assert not dataclasses.is_dataclass(box)
    assert dataclasses.is_dataclass(autoflat.unwrap(box))
    np.testing.assert_array_equal(box.replace(w=jnp.zeros(2)).w, jnp.zeros(2))  # its own
    h = autoflat.step(_bump)({"w": jnp.ones((2, 3)), "b": jnp.ones(2)}, jnp.float32(1.0))
    assert len(jax.tree.leaves(h, is_leaf=lambda x: type(x) is dict)) == 2  # not the root
    assert len(jax.tree.leaves(autoflat.unwrap(h), is_leaf=lambda x: type(x) is dict)) == 1
    match h:
        case {"w": _}:
            matched = True
        case _:
            matched = False
    assert not matched
    prefix = ({"w": 0, "b": None},)
    if jax.__version_info__ < (0, 11):
        with pytest.raises(ValueError, match="prefix"):
            jax.vmap(lambda s: s["w"].sum(), in_axes=prefix)(h)
    else:
        got = jax.vmap(lambda s: s["w"].sum(), in_axes=prefix)(h)
        np.testing.assert_allclose(got, [6.0, 6.0])
    got = jax.vmap(lambda s: s["w"].sum(), in_axes=prefix)(autoflat.unwrap(h))
    np.testing.assert_allclose(got, [6.0, 6.0])
    one = jax.devices()[0]
    with pytest.raises(AssertionError):
        jax.device_put(h, {"w": one, "b": one})
    placed = jax.device_put(autoflat.unwrap(h), {"w": one, "b": one})
    np.testing.assert_allclose(placed["w"], 2.0)
    model = _seq_handle()
    for transform in (
        eqx.filter_grad(lambda m: jnp.sum(m.layers[0](jnp.ones(3)))),
        lambda m: eqx.filter_eval_shape(lambda m: m, m),
    ):
        with pytest.raises(ValueError, match="pass autoflat.unwrap"):
            transform(model)
    assert eqx.filter_jit(lambda m: jnp.sum(m.layers[0](jnp.ones(3))))(model).shape == ()


def _adam_add(params, opt_state, x):
    updates, opt_state = _tx_adam.update({"w": params["w"] * x}, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def _dict_state(ts, x):
    params, opt_state = _adam_add(ts["params"], ts["opt"], x)
    return {"params": params, "opt": opt_state}


@claim(
    FAQ,
    'Arrays such a walk gives out stay valid: `kept = jax.tree.leaves(params)` is copied before the next call donates the buffers, if you still hold it. Flax NNX\'s own functions write into a returned model\'s handle as into the model (`nnx.update(model, state)`, an `nnx.jit` function that changes it), and the next call takes what they wrote. A state argument may hold handles that other steps returned (`step({"params": p, "opt": s}, ...)`): the call takes their objects, and they stay valid.',
)
def test_what_a_walk_gives_out_or_writes_and_handles_inside_state():
    from flax import nnx

    step = autoflat.step(_adam_add)
    params = {"w": jnp.ones(2)}
    p, s = step(params, _tx_adam.init(params), jnp.float32(2.0))
    kept = jax.tree.leaves(p)
    want = [np.array(a) for a in kept]
    p, s = step(p, s, jnp.float32(2.0))
    np.testing.assert_array_equal(np.asarray(kept[0]), want[0])
    # NNX: nnx.update through the handle, taken by the next call
    forward = autoflat.step(_nnx_forward)
    model, _ = forward(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), jnp.ones(2))
    nnx.update(model, jax.tree.map(jnp.zeros_like, nnx.state(model, nnx.Param)))
    model, out = forward(model, jnp.ones(2))
    assert float(out) == 0.0 and float(jnp.abs(model.kernel[...]).sum()) == 0.0
    # a dict of another step's handles as state, at four steps a call
    dict_step = autoflat.step(_dict_state, num_steps=4)
    xs = jnp.arange(1.0, 5.0)
    got = dict_step({"params": p, "opt": s}, xs)
    ref = {"params": autoflat.unwrap(p), "opt": autoflat.unwrap(s)}
    for x in xs:
        ref = jax.jit(_dict_state)(ref, x)
    tree_allclose(autoflat.unwrap(got), ref, rtol=1e-6)
    np.asarray(p["w"])  # still valid


def _nnx_forward(model, x):
    from flax import nnx

    model = nnx.clone(model)  # a new model: it comes back as a handle
    return model, model(x).sum()


def _shifted(params, x):
    params = {"w": params["w"] + x, "b": params["b"] - x}
    return params


@claim(
    FAQ,
    "and `tx.init` of an optimizer that pairs the parameters with a mask or labels (`optax.masked`, `optax.multi_transform`, `optax.adamw(..., mask=...)`)",
)
def test_tx_init_of_a_masked_optimizer_on_a_handle_says_what_to_do():
    p = autoflat.step(_shifted)({"w": jnp.ones(2), "b": jnp.ones(2)}, jnp.ones(2))
    for tx in (
        optax.masked(optax.sgd(0.1), {"w": True, "b": False}),
        optax.multi_transform({"a": optax.sgd(0.1), "b": optax.adam(0.1)}, {"w": "a", "b": "b"}),
        optax.adamw(0.1, mask=lambda t: jax.tree.map(lambda a: a.ndim > 0, t)),
    ):
        with pytest.raises(ValueError, match="pass autoflat.unwrap"):
            tx.init(p)
        tx.init(autoflat.unwrap(p))


@claim(
    FAQ,
    "A comparison of tree structures does not raise but answers that they differ: `eqx.tree_equal(handle, real_tree)` is `False` and `jax.tree.structure(handle) == jax.tree.structure(real_tree)` too, whatever the values.",
)
def test_comparing_a_handles_structure_with_a_real_trees_says_they_differ():
    @autoflat.step
    def shift(params, x):
        params = jax.tree.map(lambda a: a + x, params)
        return params, x

    params, _ = shift({"w": jnp.zeros(3)}, 1.0)
    real = {"w": jnp.ones(3)}
    assert eqx.tree_equal(params, real) is False
    assert jax.tree.structure(params) != jax.tree.structure(real)
    assert eqx.tree_equal(autoflat.unwrap(params), real)


@claim(FAQ, "Unwrap first, or decorate with `lazy=False`:")
@claim(
    FAQ,
    "params = optax.apply_updates(autoflat.unwrap(params), updates)   # not apply_updates(params, ...)",
)
def test_unwrap_first_or_lazy_false():
    params = {"w": jnp.zeros(3)}
    for lazy in (True, False):
        step = autoflat.step(_by_value, num_steps=2, lazy=lazy)
        p, opt_state = step(params, tx_sgd.init(params), jnp.ones((2, 3)))
        updates = {"w": jnp.ones(3)}
        new = optax.apply_updates(autoflat.unwrap(p), updates)
        expected = autoflat.unwrap(p)["w"] + 1
        np.testing.assert_array_equal(new["w"], expected)
        if not lazy:
            np.testing.assert_array_equal(optax.apply_updates(p, updates)["w"], expected)
            h, real = step(params, tx_sgd.init(params), jnp.ones((2, 3)))[0], params
            jax.tree.map(lambda a, b: a, h, real)
            eqx.partition(h, eqx.is_array)


def _paths(tree):
    return [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


@claim(
    FAQ,
    "Key paths of a handle (`jax.tree_util.tree_flatten_with_path`) are the object's own (`['w1']`, `[0].mu['w1']`).",
)
@claim(
    FAQ,
    "Two handles of one structure pair, with key paths or without (`jax.tree.map(f, h1, h2)`, `tree_map_with_path(f, h1, h2)`).",
)
def test_key_paths_and_pairing_handles():
    tx = optax.adam(1e-2)

    def fit(params, opt_state, x):
        grads = jax.grad(lambda p: jnp.sum(p["w1"] * x))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    step = autoflat.step(fit)
    params = {"w1": jnp.ones(2)}
    p, o = step(params, tx.init(params), jnp.ones(2))
    assert _paths(p) == ["['w1']"]
    assert _paths(o) == _paths(autoflat.unwrap(o))
    assert "[0].mu['w1']" in _paths(o)
    h1, h2 = _seq_handle(), _seq_handle()
    summed = jax.tree.map(lambda a, b: a + b if eqx.is_array(a) else a, h1, h2)
    tree_allclose(summed, jax.tree.map(lambda a: a * 2 if eqx.is_array(a) else a, _halved_seq()))
    paths = jax.tree_util.tree_map_with_path(lambda path, a, b: jax.tree_util.keystr(path), h1, h2)
    assert paths.layers[0].weight == ".layers[0].weight"


class NT(typing.NamedTuple):
    w: jax.Array
    b: jax.Array


def _fit_nt(p, x):
    p = NT(p.w + x, p.b * 2)
    return p


def _fit_dict(p, x):
    p = {"w": p["w"] + x, "b": p["b"] * 2}
    return p


def _main_args(text):
    m = re.search(r"func\.func public @main\((.*?)\) ->", text, re.S)
    assert m is not None
    return m.group(1).count("%arg")


def _small_leaves(n=40, size=4):
    return [jnp.full((size,), 0.1 * i) for i in range(n)]


def _scale_all(params, x):
    params = jax.tree.map(lambda a: a * x, params)
    return params


@claim(
    FAQ,
    "`lazy=False` costs a rebuild of the returned objects after every call, and its state travels one buffer per leaf (a real object holds one array per leaf)",
)
def test_lazy_false_rebuilds_every_call_and_travels_one_buffer_per_leaf():
    params = _small_leaves()
    lazy, eager = autoflat.step(_scale_all), autoflat.step(_scale_all, lazy=False)
    assert _main_args(lazy.lower(params, jnp.ones(())).as_text()) == 2  # packed, and x
    assert _main_args(eager.lower(params, jnp.ones(())).as_text()) == 41  # one per leaf
    p = params
    for i in range(3):
        p = eager(p, jnp.ones(()))
        assert type(p) is list and autoflat.stats(eager).rebuilds == i + 1


@claim(
    FAQ,
    "The objects it returned, passed back unchanged, are not flattened again (immutable structure: tuples, NamedTuples, frozen dataclasses, Equinox modules) or not copied again (a dict whose tree and arrays are still the returned ones, its arrays held nowhere else).",
)
def test_lazy_false_objects_passed_back_are_not_flattened_or_copied_again():
    @dataclasses.dataclass(frozen=True)
    class Frozen:
        w: jax.Array

    jax.tree_util.register_dataclass(Frozen, data_fields=["w"], meta_fields=[])

    def fit_frozen(p, x):
        p = Frozen(p.w + x)
        return p

    def fit_module(p, x):
        p = jax.tree.map(lambda a: a + x if eqx.is_array(a) else a, p)
        return p

    cases = (
        (_fit_nt, NT(jnp.zeros(2), jnp.ones(2))),
        (_fit_tuple, (jnp.zeros(2), jnp.ones(2))),
        (fit_frozen, Frozen(jnp.zeros(2))),
        (fit_module, eqx.nn.Linear(2, 2, key=jax.random.key(0))),
    )
    for fn, init in cases:
        step = autoflat.step(fn, lazy=False)
        p = step(init, jnp.ones(2))
        first = autoflat.stats(step)
        for _ in range(3):
            p = step(p, jnp.ones(2))
        assert type(p) is type(init)
        after = autoflat.stats(step)
        assert after.flattens == first.flattens, fn
        assert after.copies == first.copies, fn
    step = autoflat.step(_fit_dict, lazy=False)
    p = step({"w": jnp.zeros(2), "b": jnp.ones(2)}, jnp.ones(2))
    first = autoflat.stats(step)
    for _ in range(3):
        p = step(p, jnp.ones(2))
    assert autoflat.stats(step).copies == first.copies  # a dict: read again, not copied
    kept = p["w"]  # held elsewhere now: copied before donation
    p = step(p, jnp.ones(2))
    assert autoflat.stats(step).copies == first.copies + 1
    np.testing.assert_array_equal(kept, [4.0, 4.0])
    np.testing.assert_array_equal(p["w"], [5.0, 5.0])


def _fit_tuple(p, x):
    p = (p[0] + x, p[1] * 2)
    return p


_tx_hyper = optax.inject_hyperparams(optax.adam)(learning_rate=0.1)


def _fit_hyper(params, opt_state, x):
    grads = jax.grad(lambda p: jnp.sum(p["w"] * x))(params)
    updates, opt_state = _tx_hyper.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, opt_state


@claim(
    FAQ,
    '`float(opt_state.hyperparams["learning_rate"])` for a log line, or `params["head"]["bias"]`, rebuilds the object. The handle then holds a real object whose arrays you may keep, so the next call copies its arrays before donating them (and flattens it again if it is mutable, a dict: you may have changed it).',
)
@claim(
    FAQ, "(`autoflat.stats(step)` counts the `rebuilds` and `copies`). This is safe, only slower."
)
def test_reading_inside_a_handle_rebuilds_it_and_the_next_call_copies():
    step = autoflat.step(_fit_hyper)
    p = {"head": {"bias": jnp.ones(2)}, "w": jnp.ones(2)}
    p, o = step(p, _tx_hyper.init(p), jnp.ones(2))
    p, o = step(p, o, jnp.ones(2))
    before = autoflat.stats(step)
    assert before.rebuilds == 0
    lr = float(o.hyperparams["learning_rate"])
    bias = p["head"]["bias"]
    assert lr == pytest.approx(0.1)
    mid = autoflat.stats(step)
    assert mid.rebuilds == 2
    expected = np.asarray(bias)
    p, o = step(p, o, jnp.ones(2))
    after = autoflat.stats(step)
    assert after.flattens == before.flattens + 2 and after.copies == before.copies + 2
    assert not bias.is_deleted()  # safe: the kept array was copied, not donated
    np.testing.assert_array_equal(bias, expected)
    # immutable structure (a tuple): copied, not flattened
    step = autoflat.step(_advance_pair)
    pair = step((jnp.zeros(2), jnp.ones(2)), jnp.ones(2))
    pair = step(pair, jnp.ones(2))
    before = autoflat.stats(step)
    first = pair[0]
    expected = np.asarray(first)
    pair = step(pair, jnp.ones(2))
    after = autoflat.stats(step)
    assert after.rebuilds == before.rebuilds + 1 and after.flattens == before.flattens
    assert after.copies == before.copies + 1
    np.testing.assert_array_equal(first, expected)


def _advance_pair(pair, x):
    pair = (pair[0] + x, pair[1] * 2)
    return pair


@claim(
    FAQ,
    "An object you pass back is used up by the call, as a handle is: its arrays are donated, except those you also hold elsewhere (`w = model.layers[0].weight`, an argument of the same call), which are copied first. To keep the object itself (`best = model`), `copy.deepcopy` it.",
)
def test_an_object_passed_back_under_lazy_false_is_used_up_but_kept_arrays_are_copied():
    sgd = optax.sgd(0.1)

    def fit(model, opt_state, x):
        loss, grads = eqx.filter_value_and_grad(lambda m: jnp.sum(m(x) ** 2))(model)
        updates, opt_state = sgd.update(grads, opt_state, model)
        return eqx.apply_updates(model, updates), opt_state, loss

    step = autoflat.step(fit, lazy=False)
    model = eqx.nn.MLP(3, 2, 4, 1, key=jax.random.key(0))
    model, opt_state, _ = step(model, sgd.init(eqx.filter(model, eqx.is_array)), jnp.ones(3))
    model, opt_state, _ = step(model, opt_state, jnp.ones(3))
    w = model.layers[0].weight
    expected = np.asarray(w)
    best = model
    kept = copy.deepcopy(model)
    model, opt_state, _ = step(model, opt_state, jnp.ones(3))
    np.testing.assert_array_equal(w, expected)  # held elsewhere: copied first
    np.testing.assert_array_equal(kept.layers[0].weight, expected)
    assert best.layers[1].weight.is_deleted()  # used up: donated


@claim(
    FAQ,
    "To avoid it, return what you log as an output of the step, or read it through a jitted function (`jax.jit(lambda s: s.hyperparams[\"learning_rate\"])(opt_state)`), which takes the handle's arrays without rebuilding it (any handle but a Flax NNX model's).",
)
def test_reading_through_a_jitted_function_does_not_rebuild():
    step = autoflat.step(_fit_hyper)
    p = {"w": jnp.ones(2)}
    p, o = step(p, _tx_hyper.init(p), jnp.ones(2))
    p, o = step(p, o, jnp.ones(2))
    before = autoflat.stats(step)
    lr = jax.jit(lambda s: s.hyperparams["learning_rate"])(o)
    assert float(lr) == pytest.approx(0.1)
    p, o = step(p, o, jnp.ones(2))
    after = autoflat.stats(step)
    assert after.rebuilds == before.rebuilds == 0
    assert (after.flattens, after.copies) == (before.flattens, before.copies)
    assert after.fast_path == before.fast_path + 2


# ==========================================================================================
# "This `params` was consumed by call N"
# ==========================================================================================


@claim(
    FAQ,
    "The default `donate=True` lets each call update state buffers in place, so a handle you passed to a call is used up. Continue with the values the call returned.",
)
def test_a_handle_passed_to_a_call_is_used_up():
    step = autoflat.step(add)
    s1 = step({"w": jnp.zeros(2)}, jnp.ones(2))
    s2 = step(s1, jnp.ones(2))
    with pytest.raises(
        autoflat.ConsumedError, match=r"This `state` was consumed by call 2 of `add`"
    ):
        s1["w"]
    s3 = step(s2, jnp.ones(2))
    np.testing.assert_array_equal(s3["w"], [3.0, 3.0])


@claim(
    FAQ,
    "To keep a copy, `copy.deepcopy(params)` before the call; to keep every returned value valid, decorate with `donate=False`.",
)
@claim(
    FAQ,
    "Keeping a handle aside for later (`best_params = params` for early stopping) needs the copy.",
)
def test_deepcopy_or_donate_false_keep_values():
    step = autoflat.step(add)
    s = step({"w": jnp.zeros(2)}, jnp.ones(2))
    best = s  # kept aside without a copy: consumed by the next call
    s = step(s, jnp.ones(2))
    with pytest.raises(autoflat.ConsumedError):
        best["w"]
    best_copy = copy.deepcopy(s)  # with the copy
    s = step(s, jnp.ones(2))
    np.testing.assert_array_equal(best_copy["w"], [2.0, 2.0])
    np.testing.assert_array_equal(s["w"], [3.0, 3.0])
    keep = autoflat.step(add, donate=False)
    history = [keep({"w": jnp.zeros(2)}, jnp.ones(2))]
    for _ in range(3):
        history.append(keep(history[-1], jnp.ones(2)))
    np.testing.assert_array_equal([h["w"] for h in history], [[i + 1.0] * 2 for i in range(4)])


@claim(
    FAQ,
    'Your own arrays, passed in the first time, are copied and never donated, and neither is a handle you pass as state and as another argument of the same call, or inside one (a target network synced with `target = online`, `{"teacher": params}`): it stays valid.',
)
def test_own_arrays_and_a_handle_passed_twice_stay_valid():
    def update(online, target, x):
        online = {"w": online["w"] + target["w"] * x}
        return online

    step = autoflat.step(update, broadcast="target")
    mine = {"w": jnp.ones(2)}
    s = step(mine, mine, jnp.ones(2))
    assert not mine["w"].is_deleted()
    np.testing.assert_array_equal(mine["w"], [1.0, 1.0])
    target = s  # synced: the same handle as state and as the target
    s2 = step(s, target, jnp.ones(2))
    np.testing.assert_array_equal(s2["w"], [4.0, 4.0])
    np.testing.assert_array_equal(target["w"], [2.0, 2.0])  # still valid
    s3 = step(s2, target, jnp.ones(2))
    np.testing.assert_array_equal(s3["w"], [6.0, 6.0])
    # inside another argument
    nested = autoflat.step(_update_from_teacher, broadcast="aux")
    s = nested(mine, {"teacher": mine}, jnp.ones(2))
    s2 = nested(s, {"teacher": s}, jnp.ones(2))
    np.testing.assert_array_equal(s2["w"], [4.0, 4.0])
    np.testing.assert_array_equal(s["w"], [2.0, 2.0])  # still valid


def _update_from_teacher(online, aux, x):
    return {"w": online["w"] + aux["teacher"]["w"] * x}


# ==========================================================================================
# What autoflat guarantees when something fails
# ==========================================================================================


def _mixed(state, totals, x, y):
    totals["n"] = totals["n"] + 1  # mutation style: written back
    state = {"w": state["w"] + x * y}  # functional: a handle, donated next call
    return state, jnp.sum(x)


def _mixed_setup():
    step = autoflat.step(_mixed, num_steps=2)
    totals = {"n": jnp.zeros(())}
    xs = jnp.ones((2, 3))
    s, _ = step({"w": jnp.zeros(3)}, totals, xs, xs)
    s, _ = step(s, totals, xs, xs)  # `s` is now a handle the next call would donate
    return step, s, totals, xs


def _values(tree):
    """A handle's values, read as JAX reads them (no rebuild)."""
    return [np.asarray(x).tolist() for x in jax.tree.leaves(tree)]


def _check_usable(step, s, totals, xs, w, n):
    """`s` and `totals` hold what they held (`w`, `n`), and a call with them runs."""
    np.testing.assert_array_equal(s["w"], [w] * 3)
    np.testing.assert_array_equal(totals["n"], n)
    s, _ = step(s, totals, xs, xs)
    np.testing.assert_array_equal(s["w"], [w + 2] * 3)
    np.testing.assert_array_equal(totals["n"], n + 2)


@claim(
    FAQ,
    "(`autoflat.AutoflatError` and its kinds: `CallError` is also a `TypeError`, `ShapeError`, `OptionError` and `StateError` are `ValueError`s, `ConsumedError` a `RuntimeError`)",
)
def test_the_error_kinds():
    for kind, base in (
        (autoflat.CallError, TypeError),
        (autoflat.ShapeError, ValueError),
        (autoflat.OptionError, ValueError),
        (autoflat.StateError, ValueError),
        (autoflat.ConsumedError, RuntimeError),
    ):
        assert issubclass(kind, autoflat.AutoflatError) and issubclass(kind, base)


@claim(
    FAQ,
    "are raised before the compiled program runs: nothing is donated, nothing written back, every argument is usable again.",
)
def test_errors_autoflat_raises_leave_every_argument_usable():
    step, s, totals, xs = _mixed_setup()
    for bad, kind in (
        (lambda: step(s, totals, xs), autoflat.CallError),  # a missing argument
        (lambda: step(s, totals, xs, jnp.ones((1, 3))), autoflat.ShapeError),  # axes disagree
        (lambda: step(s, totals, jnp.ones((3, 3)), jnp.ones((3, 3))), autoflat.ShapeError),
    ):
        with pytest.raises(kind):
            bad()
        assert _values(s) == [[4.0] * 3]  # (read without rebuilding: still donated next)
    consumed = s
    fresh, _ = step(s, totals, xs, xs)  # consumes `s`
    with pytest.raises(autoflat.ConsumedError):
        step(consumed, totals, xs, xs)  # with `totals`, which it would have written into
    _check_usable(step, fresh, totals, xs, 6.0, 6.0)
    # an OptionError and a StateError at a first call: the handle and the dict passed to it
    handle = autoflat.step(add)({"w": jnp.zeros(3)}, jnp.ones(3))
    with pytest.raises(autoflat.OptionError):
        autoflat.step(train_step, num_steps=2)(handle, tx_sgd.init(handle), xs, jnp.asarray(0.5))
    cfg = _Config()
    with pytest.raises(autoflat.StateError):
        autoflat.step(_writes_config)(handle, cfg, jnp.ones(3))
    assert cfg.n == 0.0
    np.testing.assert_array_equal(autoflat.step(add)(handle, jnp.ones(3))["w"], [2.0] * 3)


@dataclasses.dataclass(frozen=True)
class _Frozen:
    w: jax.Array
    d: dict


jax.tree_util.register_dataclass(_Frozen, data_fields=["w", "d"], meta_fields=[])


class _Slotted:
    __slots__ = ("w",)

    def __init__(self, w):
        self.w = w


jax.tree_util.register_pytree_node(
    _Slotted, lambda s: ((s.w,), None), lambda _, children: _Slotted(*children)
)


def _writes_tuple(state, box, x):
    box[1]["k"] = box[1]["k"] + x  # a dict inside a tuple: the tuple's array cannot be updated
    state = {"w": state["w"] * 2}
    return state


def _writes_frozen(state, box, x):
    box.d["k"] = box.d["k"] + x
    state = {"w": state["w"] * 2}
    return state


def _writes_slotted(state, box, x):
    box.w = box.w + x
    state = {"w": state["w"] * 2}
    return state


@claim(
    FAQ,
    "That includes a mutation-style write-back the caller's object could not take (a tuple, a frozen dataclass, a class with `__slots__`): it is refused before the call.",
)
def test_a_write_back_the_object_cannot_take_is_refused_before_the_call():
    s = autoflat.step(add)({"w": jnp.ones(2)}, jnp.ones(2))  # a handle a call would donate
    cases = (
        (_writes_tuple, lambda: (jnp.zeros(2), {"k": jnp.zeros(2)}), "tuple"),
        (_writes_frozen, lambda: _Frozen(jnp.zeros(2), {"k": jnp.zeros(2)}), "_Frozen"),
        (_writes_slotted, lambda: _Slotted(jnp.zeros(2)), "_Slotted"),
    )
    for fn, make, name in cases:
        box = make()
        before = jax.tree.leaves(box)
        with pytest.raises(autoflat.StateError, match="immutable") as info:
            autoflat.step(fn)(s, box, jnp.ones(2))
        assert name in str(info.value)
        for a, b in zip(jax.tree.leaves(box), before, strict=True):
            assert a is b  # nothing written back
        assert _values(s) == [[2.0, 2.0]]  # nothing donated
    autoflat.step(add)(s, jnp.ones(2))  # (still a handle a call donates)
    with pytest.raises(autoflat.ConsumedError):
        s["w"]


def _bad_matmul(state, x):
    state = {"w": state["w"] @ x}  # a shape error for some x
    return state


@claim(
    FAQ,
    "Errors while tracing your body (a shape mismatch, a `TypeError` in your code) happen before anything runs, too; the traceback points at your file and line.",
)
def test_errors_while_tracing_point_at_the_users_line():
    import traceback

    step = autoflat.step(_bad_matmul)
    s = step({"w": jnp.ones((2, 2))}, jnp.ones((2, 2)))
    s = step(s, jnp.ones((2, 2)))
    with pytest.raises(TypeError) as info:
        step(s, jnp.ones((3, 3)))  # a new shape: traced again, and it fails
    frames = traceback.extract_tb(info.value.__traceback__)
    line = _bad_matmul.__code__.co_firstlineno + 1
    assert any(f.filename == __file__ and f.lineno == line for f in frames), frames
    np.testing.assert_array_equal(s["w"], [[4.0, 4.0]] * 2)  # nothing ran, nothing donated
    s = step(s, jnp.ones((2, 2)))
    np.testing.assert_array_equal(s["w"], [[8.0, 8.0]] * 2)


class _Flaky:
    """A host function that raises on its `fail_on`-th call."""

    def __init__(self, fail_on):
        self.calls, self.fail_on = 0, fail_on

    def __call__(self, x):
        self.calls += 1
        if self.calls == self.fail_on:
            raise ValueError("the host check failed")
        return np.asarray(x)


def _calls_back(kind, check):
    from jax.experimental import io_callback

    def update(state, x):
        w = state["w"] + x
        if kind == "pure_callback":
            w = jax.pure_callback(check, jax.ShapeDtypeStruct((3,), jnp.float32), w)
        elif kind == "io_callback":
            w = io_callback(check, jax.ShapeDtypeStruct((3,), jnp.float32), w)
        elif kind == "debug.callback":
            jax.debug.callback(check, w)
        elif kind == "debug.print":
            jax.debug.print("w={w}", w=w)
        else:
            w = eqx.error_if(w, w[0] > 100.0, "too big")
        state = {"w": w}
        return state

    return update


@claim(
    FAQ,
    "a program that calls back to the host (`jax.pure_callback`, `io_callback`, `jax.debug.callback` or `print`, `eqx.error_if`) can raise while it runs, after donated buffers would be gone. Such a program is not donated",
)
def test_a_program_that_calls_back_is_not_donated():
    for kind in ("pure_callback", "io_callback", "debug.callback", "error_if"):
        _assert_not_donated(kind)
    plain = autoflat.step(add)
    s = plain({"w": jnp.zeros(3)}, jnp.ones(3))
    plain(s, jnp.ones(3))
    with pytest.raises(autoflat.ConsumedError):  # (without a callback it is donated)
        s["w"]


@claim(
    FAQ,
    "so the state you passed to the failing call, handles and mutation-style objects alike, still holds its values: retry with it.",
)
def test_a_failing_callback_leaves_the_state_passed_in():
    step = autoflat.step(_calls_back("pure_callback", _Flaky(fail_on=3)))
    s = step({"w": jnp.zeros(3)}, jnp.ones(3))
    s = step(s, jnp.ones(3))
    with pytest.raises(Exception, match="the host check failed"):  # noqa: B017
        jax.block_until_ready(step(s, jnp.ones(3)))
    np.testing.assert_array_equal(s["w"], [2.0] * 3)
    s = step(s, jnp.ones(3))  # retry
    np.testing.assert_array_equal(s["w"], [3.0] * 3)

    check = _Flaky(fail_on=3)

    def in_place(totals, x):
        w = jax.pure_callback(check, jax.ShapeDtypeStruct((3,), jnp.float32), totals["w"] + x)
        totals["w"] = w

    step = autoflat.step(in_place)
    totals = {"w": jnp.zeros(3)}
    step(totals, jnp.ones(3))
    step(totals, jnp.ones(3))
    with pytest.raises(Exception, match="the host check failed"):  # noqa: B017
        step(totals, jnp.ones(3))
        jax.block_until_ready(totals["w"])
    np.testing.assert_array_equal(totals["w"], [2.0] * 3)
    step(totals, jnp.ones(3))
    np.testing.assert_array_equal(totals["w"], [3.0] * 3)


@claim(FAQ, '`donate="always"` donates it anyway, if you accept that risk.')
def test_donate_always_donates_a_program_that_calls_back():
    step = autoflat.step(_calls_back("pure_callback", _Flaky(fail_on=-1)), donate="always")
    s = step({"w": jnp.zeros(3)}, jnp.ones(3))
    step(s, jnp.ones(3))
    with pytest.raises(autoflat.ConsumedError):
        s["w"]


def _assert_not_donated(kind):
    step = autoflat.step(_calls_back(kind, _Flaky(fail_on=-1)))
    s = step({"w": jnp.zeros(3)}, jnp.ones(3))
    s2 = step(s, jnp.ones(3))
    np.testing.assert_array_equal(s["w"], [1.0] * 3)  # not consumed
    np.testing.assert_array_equal(s2["w"], [2.0] * 3)


@claim(
    FAQ,
    "a program that calls back to the host (`jax.pure_callback`, `io_callback`, `jax.debug.callback` or `print`, `eqx.error_if`) can raise while it runs, after donated buffers would be gone. Such a program is not donated",
)
def test_a_program_that_calls_jax_debug_print_is_not_donated(capfd):
    _assert_not_donated("debug.print")


def _rebinds(params, x):
    x = x[:, :2] * params["w"]
    params = {"w": params["w"] + 1.0}
    return params, x


@claim(
    FAQ,
    "The same first trace also finds state that comes back with other shapes than it went in (at `num_steps=1`, a parameter returned by name that the body rebinds: `x = f(x); return model, x`): its buffers could not hold the result, so that program is not donated either, and the caller's arrays are not copied for it.",
)
def test_state_that_changes_shape_is_not_donated_or_copied():
    step = autoflat.step(_rebinds)
    p, y = step({"w": jnp.ones(2)}, jnp.ones((4, 3)))
    assert "# x: state (returned)" in header(step)
    copies = autoflat.stats(step).copies
    for _ in range(3):
        x = jnp.ones((4, 3))
        kept = p
        p, y = step(p, x)
        assert not x.is_deleted()
        np.testing.assert_array_equal(kept["w"], p["w"] - 1)  # not donated
    assert autoflat.stats(step).copies == copies  # later calls copy nothing
    assert autoflat.stats(step).traces == 1
    np.testing.assert_array_equal(y, np.full((4, 2), 4.0))


def _logs(state, x):
    state = {"w": state["w"] + jnp.log(x)}
    return state


@claim(
    FAQ,
    "While either flag is on, autoflat launches without donation (as JAX does), also a program compiled before you set the flag (that costs one more compile): the failed call raises JAX's `FloatingPointError` and the state you passed to it still holds its values.",
)
def test_debug_nans_and_infs_lose_nothing():
    for flag, bad in (("debug_nans", -1.0), ("debug_infs", 0.0)):
        step = autoflat.step(_logs)
        s = step({"w": jnp.zeros(3)}, jnp.ones(3))
        s = step(s, jnp.ones(3) * np.e)
        assert autoflat.stats(step).traces == 1
        with getattr(jax, flag)(True):
            with pytest.raises(FloatingPointError):
                step(s, jnp.ones(3) * bad)
            np.testing.assert_allclose(s["w"], [1.0] * 3)
            s2 = step(s, jnp.ones(3) * np.e)
            np.testing.assert_allclose(s["w"], [1.0] * 3)  # not donated under the flag
            s = s2
        assert autoflat.stats(step).traces == 2  # one more compile
        np.testing.assert_allclose(s["w"], [2.0] * 3, rtol=1e-6)


@claim(
    FAQ,
    "An ahead-of-time `Compiled` (`step.lower(...).compile()`) runs the program as lowered: lowered to donate, it consumes its state under the flags too (and says so when you use it).",
)
def test_an_aot_compiled_step_donates_under_the_flags():
    step = autoflat.step(_logs)
    s = step({"w": jnp.zeros(3)}, jnp.ones(3))
    compiled = step.lower(s, jnp.ones(3)).compile()
    s = compiled(s, jnp.ones(3))
    with jax.debug_nans(True):
        with pytest.raises(Exception):  # noqa: B017  (JAX's own, from its Compiled)
            compiled(s, -jnp.ones(3))
    with pytest.raises(autoflat.ConsumedError, match="consumed by call"):
        s["w"]


@claim(
    FAQ,
    "Your own arrays are never donated: autoflat copies them the first time, and donates only buffers it produced itself.",
)
def test_own_arrays_are_never_donated():
    step = autoflat.step(add, num_steps=2)
    mine = {"w": jnp.zeros(3)}
    s = step(mine, jnp.ones((2, 3)))
    for _ in range(3):
        s = step(s, jnp.ones((2, 3)))
    assert not mine["w"].is_deleted()
    np.testing.assert_array_equal(mine["w"], [0.0] * 3)
    assert autoflat.stats(step).copies == 1


@claim(
    FAQ,
    "A buffer it wrote into your object (mutation style) is donated without a copy only when it comes back through that same object and nothing else holds it: one you also passed to another step, or kept in a list, is copied first.",
)
def test_written_buffers_are_donated_only_through_their_object():
    def tally(totals, x):
        totals["sum"] = totals["sum"] + x

    step, other = autoflat.step(tally), autoflat.step(add)
    totals = {"sum": jnp.zeros(2)}
    step(totals, jnp.ones(2))
    step(totals, jnp.ones(2))
    step(totals, jnp.ones(2))
    assert autoflat.stats(step).copies == 1  # donated as they came back, uncopied
    other({"w": totals["sum"]}, jnp.ones(2))  # also passed to another step
    np.testing.assert_array_equal(totals["sum"], [3.0, 3.0])
    history = []
    for _ in range(3):
        history.append(totals["sum"])  # kept in a list
        step(totals, jnp.ones(2))
    np.testing.assert_array_equal(np.stack(history), [[3.0] * 2, [4.0] * 2, [5.0] * 2])
    assert autoflat.stats(step).copies > 1


# --- interrupts ---------------------------------------------------------------------------

_PACKAGE = autoflat.__file__.rsplit("__init__.py", 1)[0]


class _InterruptAt:
    """Raise `KeyboardInterrupt` at the `n`-th line autoflat's own code executes."""

    def __init__(self, n):
        self.n, self.count, self.fired = n, 0, False

    def __enter__(self):
        self._previous = sys.gettrace()
        sys.settrace(self._call)
        return self

    def __exit__(self, *exc):
        sys.settrace(self._previous)

    def _call(self, frame, event, arg):
        return self._line if frame.f_code.co_filename.startswith(_PACKAGE) else None

    def _line(self, frame, event, arg):
        if event == "line" and not self.fired:
            self.count += 1
            if self.count == self.n:
                self.fired = True
                raise KeyboardInterrupt
        return self._line


def _both_styles(state, totals, x):
    totals["n"] = totals["n"] + 1  # written back
    state = {"w": state["w"] * 0.5 + x}  # returned: a handle
    return state, jnp.sum(x)


def _both_reference(w, n, x):
    state, totals = {"w": jnp.asarray(w)}, {"n": jnp.asarray(n)}
    state, out = jax.jit(_both_styles)(state, totals, x)
    return float(np.asarray(state["w"])[0]), float(np.asarray(n) + 1), float(out)


def _in_thread(fn):
    """Run `fn` in a thread that must finish (a lock left held would hang it)."""
    box = {}

    def run():
        try:
            box["result"] = fn()
        except BaseException as e:  # noqa: BLE001
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive(), "the next call hangs"
    if "error" in box:
        raise box["error"]
    return box["result"]


@claim(
    FAQ,
    "An interrupt (Ctrl-C, a `KeyboardInterrupt`) at any point of a call leaves either the inputs intact or the results reachable.",
)
@claim(
    FAQ,
    "Before the compiled program runs, nothing is donated (handles the call had already claimed for donation are given back): call the step again with the same state.",
)
@claim(
    FAQ,
    "After it ran (it consumed the donated state), its results are kept by the step until the call has returned them to you, and `step.recover()` returns them as the call would have, write-backs included; the `KeyboardInterrupt` carries a note that says so.",
)
@claim(
    FAQ,
    "`recover()` raises a `StateError` when there is nothing to recover: then the state you passed in is intact.",
)
@claim(
    FAQ,
    "The test suite checks this with an interrupt at every line autoflat executes during a call, in turn.",
)
@claim(
    FAQ,
    "(the handle is claimed before launch, atomically and with no lock, so an interrupt can never leave a later call waiting)",
)
def test_an_interrupt_at_every_line_of_a_call():
    step = autoflat.step(_both_styles, pack=False)
    x = jnp.ones(3)
    totals = {"n": jnp.zeros(())}
    state, _ = step({"w": jnp.zeros(3)}, totals, x)
    state, _ = step(state, totals, x)  # warm: the next call donates `state`
    counts = {"recovered": 0, "called again": 0}
    for n in range(1, 5000):
        w, count = _values(state)[0][0], float(np.asarray(totals["n"]))
        expected = _both_reference(w, count, x)
        with _InterruptAt(n) as at:
            try:
                result = step(state, totals, x)
                interrupt = None
            except KeyboardInterrupt as e:
                interrupt = e
        if not at.fired:
            assert interrupt is None
            break
        assert interrupt is not None
        try:
            result = _in_thread(step.recover)
            assert ".recover()` returns them" in "".join(getattr(interrupt, "__notes__", []))
            counts["recovered"] += 1
        except autoflat.StateError as e:
            assert "nothing to recover" in str(e)
            assert _values(state)[0][0] == w and float(np.asarray(totals["n"])) == count
            result = _in_thread(lambda: step(state, totals, x))  # the same state again
            counts["called again"] += 1
        state, out = result
        assert (_values(state)[0][0], float(np.asarray(totals["n"])), float(out)) == expected
    else:  # pragma: no cover
        raise AssertionError("no call completed")
    assert counts["recovered"] and counts["called again"], counts
    assert n > 50


def _patched_runner(monkeypatch, after_running):
    """Make the launch stop with a KeyboardInterrupt inside JAX's dispatch: before the
    program runs, or (`after_running`) after it ran, its results lost with the interrupt."""
    import autoflat._runtime.launch as launch_module

    runner = launch_module.runner

    def interrupted(*args, **kwargs):
        jit = runner(*args, **kwargs)

        def run(*a):
            if after_running:
                jax.block_until_ready(jit(*a))
            raise KeyboardInterrupt

        return run

    monkeypatch.setattr(launch_module, "runner", interrupted)
    return lambda: monkeypatch.setattr(launch_module, "runner", runner)


@claim(
    FAQ,
    "One window is left: the first call of a program for some input shapes runs through JAX's Python dispatch, and an interrupt inside it after the program ran loses the donated state with the results. autoflat then says so: the `KeyboardInterrupt` carries a note, and the consumed handles raise a `ConsumedError` that names the interrupted call, not JAX's \"Array has been deleted\"",
)
def test_an_interrupt_inside_jaxs_dispatch_says_what_was_lost(monkeypatch):
    step = autoflat.step(add)
    s = step({"w": jnp.zeros(3)}, jnp.ones(3))
    restore = _patched_runner(monkeypatch, after_running=True)
    with pytest.raises(KeyboardInterrupt) as info:
        step(s, jnp.ones(3))
    restore()
    assert "its results are lost" in "".join(getattr(info.value, "__notes__", []))
    with pytest.raises(autoflat.ConsumedError, match="which an interrupt stopped") as consumed:
        s["w"]
    assert "call 2 of `add`" in str(consumed.value)
    with pytest.raises(autoflat.StateError, match="nothing to recover"):
        step.recover()


@claim(
    FAQ,
    "(on a first call, which donates copies of your arrays, your state is whole and there is no note)",
)
def test_an_interrupt_after_a_first_call_ran_loses_nothing(monkeypatch):
    step = autoflat.step(add)
    mine = {"w": jnp.zeros(3)}
    restore = _patched_runner(monkeypatch, after_running=True)
    with pytest.raises(KeyboardInterrupt) as info:
        step(mine, jnp.ones(3))
    restore()
    assert not getattr(info.value, "__notes__", None)
    np.testing.assert_array_equal(step(mine, jnp.ones(3))["w"], [1.0] * 3)


@claim(
    FAQ,
    "Calling the step again with state the interrupted call consumed (a Flax NNX model it writes into) is refused with a `StateError` that points at `recover()`, and the results stay there.",
)
def test_calling_again_with_consumed_nnx_state_points_at_recover(monkeypatch):
    from flax import nnx

    import autoflat._step as step_module

    class Model(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.zeros(2))

    def train(model, x):
        model.w[...] = model.w[...] + x

    model, step = Model(), autoflat.step(train)
    step(model, jnp.ones(2))
    step(model, jnp.ones(2))
    finish = step_module.finish

    def interrupted(*args, **kwargs):  # after the program ran, before the results landed
        raise KeyboardInterrupt

    monkeypatch.setattr(step_module, "finish", interrupted)
    with pytest.raises(KeyboardInterrupt):
        step(model, jnp.ones(2))
    monkeypatch.setattr(step_module, "finish", finish)
    with pytest.raises(autoflat.StateError, match=r"recover\(\)"):
        step(model, jnp.ones(2))
    step.recover()
    np.testing.assert_array_equal(model.w[...], [3.0, 3.0])


# --- threads ------------------------------------------------------------------------------


@claim(FAQ, "a step may be called from several threads, each with its own state.")
@claim(FAQ, "Each call's results land in that call, never in another thread's")
def test_threads_with_their_own_state():
    step = autoflat.step(add)
    step({"w": jnp.zeros(4)}, jnp.ones(4))
    wrong, errors = [], []

    def worker(t):
        s, expect = {"w": jnp.full((4,), t * 1000.0)}, t * 1000.0
        for _ in range(50):
            try:
                s = step(s, jnp.ones(4))
            except Exception as e:  # noqa: BLE001
                errors.append(e)
                return
            expect += 1
            if _values(s)[0][0] != expect:
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


@claim(
    FAQ,
    "Two threads passing the same handle to donating calls: one call takes it, the other raises the consumed error before it runs",
)
@claim(FAQ, "and the winner's result is whole.")
def test_two_threads_passing_one_handle():
    step = autoflat.step(add)
    s = step({"w": jnp.zeros(2)}, jnp.ones(2))
    barrier = threading.Barrier(2)
    for _ in range(10):
        s = step(s, jnp.ones(2))
        expected = _values(s)[0][0] + 1
        results, errors = [], []

        def worker(s=s, results=results, errors=errors):
            barrier.wait()
            try:
                results.append(step(s, jnp.ones(2)))
            except Exception as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=worker) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(results) == 1 and len(errors) == 1
        assert isinstance(errors[0], autoflat.ConsumedError)
        s = results[0]
        assert _values(s) == [[expected] * 2]


@claim(FAQ, "`recover()` concerns the step's latest call.")
@claim(FAQ, "Call it before the step's next call.")
def test_recover_concerns_the_latest_call(monkeypatch):
    import autoflat._step as step_module

    step = autoflat.step(add)
    finish = step_module.finish

    def interrupted(*args, **kwargs):  # after the program ran, before the results landed
        raise KeyboardInterrupt

    for later_call in (False, True):
        s = step({"w": jnp.zeros(2)}, jnp.ones(2))
        monkeypatch.setattr(step_module, "finish", interrupted)
        with pytest.raises(KeyboardInterrupt):
            step(s, jnp.ones(2))
        monkeypatch.setattr(step_module, "finish", finish)
        if not later_call:
            np.testing.assert_array_equal(step.recover()["w"], [2.0, 2.0])
            continue
        other = _in_thread(lambda: step({"w": jnp.zeros(2)}, jnp.ones(2)))  # another thread's
        np.testing.assert_array_equal(other["w"], [1.0, 1.0])
        with pytest.raises(autoflat.StateError, match="nothing to recover"):
            step.recover()


# --- what is written back -----------------------------------------------------------------


class _Box:
    """A mutable pytree class (with a `__dict__`)."""

    def __init__(self, **fields):
        self.__dict__.update(fields)


jax.tree_util.register_pytree_with_keys(
    _Box,
    lambda b: (
        [(jax.tree_util.GetAttrKey(k), v) for k, v in sorted(vars(b).items())],
        tuple(sorted(vars(b))),
    ),
    lambda keys, children: _Box(**dict(zip(keys, children, strict=True))),
)


def _spelled(spelling):
    """A step that changes `s` in place as `spelling` says, adding `x` to its value."""

    def update(p, s, x):
        if spelling == 'd["k"] = ...':
            s["k"] = s["k"] + x
        elif spelling == "m.x = ...":
            s.k = s.k + x
        elif spelling == "setattr(m, ...)":
            setattr(s, "k", s.k + x)  # noqa: B010  (the spelling under test)
        elif spelling == "d.update(...)":
            s.update({"k": s["k"] + x})
        elif spelling == "d |= ...":
            s |= {"k": s["k"] + x}
        elif spelling == "d.setdefault(...)":
            old = s.pop("k")
            s.setdefault("k", old + x)
        elif spelling == "xs.append(x)":
            s.append(s.pop() + x)
        elif spelling == "xs += [...]":
            s += [s.pop() + x]
        elif spelling == "xs.extend(...)":
            s.extend([s.pop() + x])
        elif spelling == 'del d["k"]':
            if "tmp" in s:
                del s["tmp"]
            old = s["k"]
            del s["k"]
            s["k"] = old + x
        p = p + x
        return p

    return update


_SPELLINGS = [
    'd["k"] = ...',
    "m.x = ...",
    "setattr(m, ...)",
    "d.update(...)",
    "d |= ...",
    "d.setdefault(...)",
    "xs.append(x)",
    "xs += [...]",
    "xs.extend(...)",
    'del d["k"]',
]


def _holder(spelling, k):
    if spelling in ("m.x = ...", "setattr(m, ...)"):
        return _Box(k=jnp.zeros(3)), lambda s: s.k
    if spelling.startswith("xs"):
        return [jnp.zeros(3)], lambda s: s[-1]
    if spelling.startswith("del") and k == 1:  # (with num_steps > 1 no key may go)
        return {"k": jnp.zeros(3), "tmp": jnp.zeros(3)}, lambda s: s["k"]
    return {"k": jnp.zeros(3)}, lambda s: s["k"]


@claim(
    FAQ,
    'a parameter the body assigns into (`d["k"] = ...`, `m.x = ...`, `setattr(m, "x", ...)`), a dict or list it changes in place (`d.update(...)`, `d |= ...`, `d.setdefault(...)`, `xs.append(x)`, `xs += [...]`, `xs.extend(...)`; a `d.pop(k)` or `del d["k"]` beside them), and Flax NNX objects (their Variables).',
)
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("spelling", _SPELLINGS)
def test_in_place_changes_are_written_back(spelling, k):
    step = autoflat.step(_spelled(spelling), num_steps=k)
    s, value = _holder(spelling, k)
    x = jnp.ones((k, 3)) if k > 1 else jnp.ones(3)
    p = step(jnp.zeros(3), s, x)
    np.testing.assert_array_equal(value(s), [float(k)] * 3)
    np.testing.assert_array_equal(p, [float(k)] * 3)
    if spelling.startswith("del"):
        assert "tmp" not in s  # the removal is written back too
    step(p, s, x)
    np.testing.assert_array_equal(value(s), [2.0 * k] * 3)
    if spelling.startswith("xs"):
        assert len(s) == 1


@claim(
    FAQ,
    'a parameter the body assigns into (`d["k"] = ...`, `m.x = ...`, `setattr(m, "x", ...)`), a dict or list it changes in place (`d.update(...)`, `d |= ...`, `d.setdefault(...)`, `xs.append(x)`, `xs += [...]`, `xs.extend(...)`; a `d.pop(k)` or `del d["k"]` beside them), and Flax NNX objects (their Variables).',
)
def test_nnx_variables_are_written_back():
    from flax import nnx

    class Model(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.zeros(2))
            self.count = nnx.BatchStat(jnp.zeros((), jnp.int32))

    def train(model, x):
        model.w[...] = model.w[...] * 0.5 + x
        model.count[...] = model.count[...] + 1
        return jnp.sum(model.w[...])

    ours, theirs = Model(), Model()
    step, ref = autoflat.step(train), nnx.jit(train)
    for _ in range(3):
        np.testing.assert_array_equal(step(ours, jnp.ones(2)), ref(theirs, jnp.ones(2)))
    np.testing.assert_array_equal(ours.w[...], theirs.w[...])
    assert int(ours.count[...]) == 3


def _via_alias(kind):
    def update(p, m, x):
        if kind == "q = m.inner; q.n = ...":
            q = m.inner
            q.n = q.n + x
        elif kind == "for layer in m.layers: layer.w = ...":
            for layer in m.layers:
                layer.n = layer.n + x
        elif kind == 'd2 = d["inner"]; d2["k"] = ...':
            d2 = m["inner"]
            d2["n"] = d2["n"] + x
        else:
            getattr(m, "inner").n = getattr(m, "inner").n + x  # noqa: B009
        p = p + x
        return p

    return update


@claim(
    FAQ,
    'A write through another name that holds a part of the parameter at every place it is bound counts the same (`q = m.inner; q.n = ...`, `for layer in m.layers: layer.w = ...`, `d2 = d["inner"]; d2["k"] = ...`, `getattr(m, "inner").n = ...`).',
)
@pytest.mark.parametrize(
    "kind",
    [
        "q = m.inner; q.n = ...",
        "for layer in m.layers: layer.w = ...",
        'd2 = d["inner"]; d2["k"] = ...',
        'getattr(m, "inner").n = ...',
    ],
)
def test_writes_through_an_alias_are_written_back(kind):
    if kind.startswith("for"):
        m = _Box(layers=[_Box(n=jnp.zeros(2)), _Box(n=jnp.ones(2))])
        read = lambda: [layer.n for layer in m.layers]  # noqa: E731
        expected = [[2.0, 2.0], [3.0, 3.0]]
    elif kind.startswith("d2"):
        m = {"inner": {"n": jnp.zeros(2)}}
        read = lambda: [m["inner"]["n"]]  # noqa: E731
        expected = [[2.0, 2.0]]
    else:
        m = _Box(inner=_Box(n=jnp.zeros(2)))
        read = lambda: [m.inner.n]  # noqa: E731
        expected = [[2.0, 2.0]]
    step = autoflat.step(_via_alias(kind))
    p = step(jnp.zeros(2), m, jnp.ones(2))
    step(p, m, jnp.ones(2))
    np.testing.assert_array_equal(read(), expected)
    assert "state" in header(step).splitlines()[3]


def _takes_labels(p, batch):
    labels = batch.pop("labels")
    p = p + jnp.sum(batch["x"] * labels)
    return p


@claim(
    FAQ,
    'A dict or list the step only takes from (`batch.pop("labels")`) is not written back: the step changes its own copy.',
)
def test_a_dict_the_step_only_takes_from_is_not_written_back():
    batch = {"x": jnp.ones(2), "labels": jnp.full(2, 2.0)}
    step = autoflat.step(_takes_labels)
    p = step(jnp.zeros(()), batch)
    p = step(p, batch)
    assert set(batch) == {"x", "labels"}  # as under jax.jit
    np.testing.assert_array_equal(p, 8.0)
    assert "# batch: state" not in header(step)


def _helper_writes(inner, x):
    inner["k"] = inner["k"] + x


_GLOBAL = {}


def _writes_elsewhere(p, d, x):
    _helper_writes(d["inner"], x)
    _GLOBAL["k"] = p + x
    p = p + jnp.sum(d["inner"]["k"])
    return p


@claim(
    FAQ,
    "Changes the body's source does not show (in a function the step calls, `helper(m.inner)`), and changes to a global, are not: the step sees copies of the arguments' arrays, as under `jax.jit`.",
)
def test_hidden_changes_and_globals_are_not_written_back():
    for run in (jax.jit(_writes_elsewhere), autoflat.step(_writes_elsewhere)):
        d = {"inner": {"k": jnp.zeros(2)}}
        _GLOBAL.clear()
        p = run(jnp.zeros(()), d, jnp.ones(2))
        np.testing.assert_array_equal(p, 2.0)
        np.testing.assert_array_equal(d["inner"]["k"], [0.0, 0.0])  # not written back
        assert isinstance(_GLOBAL["k"], jax.core.Tracer)  # not the new value: as jax.jit


class _Config:
    """A plain object, not a pytree: JAX takes it as one leaf."""

    def __init__(self):
        self.n = 0.0


def _writes_config(state, cfg, x):
    cfg.n = cfg.n + 1  # a write the source shows
    state = {"w": state["w"] * 2}
    return state


def _set_n(cfg, value):
    cfg.n = value


def _writes_config_hidden(state, cfg, x):
    _set_n(cfg, x)  # a write the source does not show
    state = {"w": state["w"] * 2}
    return state


@claim(
    FAQ,
    "An object JAX takes as one leaf (a plain object, not a pytree) reaches the step as it is, as a static argument reaches `jax.jit`: a write into it that the source shows is refused before the call (`autoflat.StateError`: make it a pytree), and one it does not show is found when the step is traced, the previous value put back, and refused the same way, so no traced value is ever left in your object.",
)
def test_writes_into_a_plain_object_are_refused():
    s = autoflat.step(add)({"w": jnp.ones(2)}, jnp.ones(2))
    for fn in (_writes_config, _writes_config_hidden):
        cfg = _Config()
        with pytest.raises(autoflat.StateError, match="Make _Config a pytree") as info:
            autoflat.step(fn)(s, cfg, jnp.ones(2))
        assert cfg.n == 0.0  # the previous value: no tracer left
        if fn is _writes_config_hidden:
            assert "put the previous value back" in str(info.value)
        assert _values(s) == [[2.0, 2.0]]  # nothing donated


# --- a method step's self -----------------------------------------------------------------


class _Trainer:
    SCALE = 2.0

    def __init__(self, lr):
        self.lr = lr

    def helper(self, x):
        return x * 10.0

    @autoflat.step
    def train(self, p, x):
        p = p - self.lr * self.SCALE * x + 0 * self.helper(x)
        return p


@claim(
    FAQ,
    "the attributes its body reads that the instance holds itself are watched; a new value recompiles (class attributes and methods are not watched; `show()` names both kinds, see [Roles](roles.md)).",
)
def test_a_method_steps_watched_attributes():
    _Trainer.train.clear_cache()
    t = _Trainer(0.5)
    p = t.train(jnp.ones(2), jnp.ones(2))
    np.testing.assert_array_equal(p, [0.0, 0.0])  # 1 - 0.5 * 2
    traces = autoflat.stats(_Trainer.train).traces
    t.lr = 0.25
    p = t.train(jnp.ones(2), jnp.ones(2))
    np.testing.assert_array_equal(p, [0.5, 0.5])  # seen: recompiled
    assert autoflat.stats(_Trainer.train).traces == traces + 1
    _Trainer.SCALE = 4.0
    try:
        p = t.train(jnp.ones(2), jnp.ones(2))
    finally:
        _Trainer.SCALE = 2.0
    np.testing.assert_array_equal(p, [0.5, 0.5])  # a class attribute: not watched
    assert autoflat.stats(_Trainer.train).traces == traces + 1
    self_line = header(_Trainer.train).splitlines()[2]
    assert "a new value of self.lr recompiles" in self_line
    assert "self.SCALE" in self_line and "self.helper" in self_line
    assert "of the class: read when traced, not watched" in self_line


@claim(
    FAQ,
    "A plain-object `self` compiles once per instance, as under `jax.jit` with it static, but autoflat holds it weakly: instances you drop are freed with their arrays (the step keeps at most the last one, until `clear_cache()`), where `jax.jit`'s cache would keep every one.",
)
def test_a_method_step_holds_its_instances_weakly():
    class Trainer:
        def __init__(self):
            self.lr = 0.5
            self.big = jnp.ones(100)

        @autoflat.step
        def train(self, p, x):
            p = p - self.lr * x
            return p

    refs = []
    for _ in range(3):
        t = Trainer()
        refs.append(weakref.ref(t))
        t.train(jnp.ones(2), jnp.ones(2))
        del t
    gc.collect()
    assert autoflat.stats(Trainer.train).traces == 3  # once per instance
    assert [r() is None for r in refs] == [True, True, False]  # the last one kept
    Trainer.train.clear_cache()
    gc.collect()
    assert refs[2]() is None

    class Static:
        lr = 0.5

    jitted = jax.jit(lambda self, p: p - self.lr, static_argnums=0)
    static_refs = []
    for _ in range(3):
        t = Static()
        static_refs.append(weakref.ref(t))
        jitted(t, jnp.ones(2))
        del t
    gc.collect()
    assert all(r() is not None for r in static_refs)  # jax.jit keeps every one


@claim(
    FAQ,
    "while a step is called with the same NNX objects, unchanged, it donates their Variables' arrays without walking the graph",
)
@claim(
    FAQ,
    "An array you took out of a Variable (`model.w[...]`) and kept, or an `nnx.clone(model)` (which shares the arrays), stays valid: the next call finds that something else holds those arrays and copies them first, where `nnx.jit` with donation deletes them.",
)
def test_an_array_taken_out_of_an_nnx_variable_stays_valid():
    from flax import nnx

    class Model(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.zeros(2))

    def train(model, x):
        model.w[...] = model.w[...] + x

    model, step = Model(), autoflat.step(train)
    step(model, jnp.ones(2))
    step(model, jnp.ones(2))
    before = autoflat.stats(step)
    step(model, jnp.ones(2))  # nothing kept: donated as it is
    assert autoflat.stats(step).copies == before.copies
    assert autoflat.stats(step).fast_path == before.fast_path + 1
    kept, clone = model.w[...], nnx.clone(model)
    step(model, jnp.ones(2))
    np.testing.assert_array_equal(kept, [3.0, 3.0])
    np.testing.assert_array_equal(clone.w[...], [3.0, 3.0])
    np.testing.assert_array_equal(model.w[...], [4.0, 4.0])
    donating = nnx.jit(train, donate_argnums=0)
    model = Model()
    donating(model, jnp.ones(2))
    kept = model.w[...]
    donating(model, jnp.ones(2))
    assert kept.is_deleted()


# ==========================================================================================
# Does it work with Flax NNX?
# ==========================================================================================


def _nnx_model_class():
    from flax import nnx

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(3, 2, rngs=rngs)

    Model.__qualname__ = "Model"
    return Model


def _nnx_setup():
    from flax import nnx

    model = _nnx_model_class()(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    return model, optimizer, nnx.metrics.Average()


def _nnx_train(model, optimizer, metrics, x):
    from flax import nnx

    loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m.lin(x) ** 2))(model)
    optimizer.update(model, grads)
    metrics.update(values=loss)
    return loss


@claim(
    FAQ,
    "NNX modules, optimizers and metrics are mutable objects that a step changes in place (`optimizer.update(model, grads)`); autoflat treats them as state when it sees one at run time, and writes the new values back into your objects after the call, as `nnx.jit` does.",
)
@claim(
    FAQ,
    "Called again with the same objects, unchanged, a step skips traversing them (a fast path of its own, checked by identity)",
)
def test_nnx_modules_optimizers_and_metrics():
    from flax import nnx

    ours, theirs = _nnx_setup(), _nnx_setup()
    step, ref = autoflat.step(_nnx_train), nnx.jit(_nnx_train)
    xs = jax.random.normal(jax.random.key(0), (4, 8, 3))
    for i in range(4):
        loss, ref_loss = step(*ours, xs[i]), ref(*theirs, xs[i])
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
        if i == 0:
            first = autoflat.stats(step)
    np.testing.assert_allclose(ours[0].lin.kernel[...], theirs[0].lin.kernel[...], rtol=1e-6)
    np.testing.assert_allclose(ours[2].compute(), theirs[2].compute(), rtol=1e-6)
    assert int(ours[1].step[...]) == 4
    lines = header(step)
    assert "# model: state (a Model mutated in place" in lines
    assert "# optimizer: state (a flax.Optimizer mutated in place" in lines
    assert "# metrics: state (a flax.Average mutated in place" in lines
    after = autoflat.stats(step)
    assert after.flattens == first.flattens  # not traversed again
    assert after.fast_path == first.fast_path + 3 * 3


# ==========================================================================================
# Does it work on several devices?
# ==========================================================================================

needs_8_devices = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")


@needs_8_devices
@claim(FAQ, "JAX does the distribution; autoflat adds nothing you need to configure.")
@claim(
    FAQ,
    "State leaves keep their shardings from step to step (the compiled function pins the output shardings of state to its input shardings), and sharded per-step inputs work.",
)
def test_state_keeps_its_shardings_and_sharded_inputs_work():
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("data",))  # automatic axes
    tx = optax.sgd(0.1, momentum=0.9)

    def fit(params, opt_state, x):
        loss, grads = jax.value_and_grad(lambda p: jnp.mean(jnp.tanh(x @ p["w"]) ** 2))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    w = jax.device_put(jnp.ones((4, 16)) * 0.1, NamedSharding(mesh, P(None, "data")))
    params = {"w": w}
    xs = jax.device_put(
        jax.random.normal(jax.random.key(0), (4, 16, 4)), NamedSharding(mesh, P(None, "data"))
    )
    step = autoflat.step(fit, num_steps=2)
    p, o, losses = step(params, tx.init(params), xs[:2])
    p, o, more = step(p, o, xs[2:])
    ref = (params, tx.init(params))
    ref_losses = []
    for i in range(4):
        *ref, loss = jax.jit(fit)(*ref, xs[i])
        ref_losses.append(loss)
    tree_allclose((p, o), tuple(ref))
    np.testing.assert_allclose(jnp.concatenate([losses, more]), jnp.stack(ref_losses), rtol=1e-5)
    assert autoflat.unwrap(p)["w"].sharding.is_equivalent_to(w.sharding, 2)
    assert autoflat.unwrap(o)[0].trace["w"].sharding.is_equivalent_to(w.sharding, 2)


@needs_8_devices
@claim(
    FAQ,
    "On a mesh with explicit axes (`jax.make_mesh(..., axis_types=(AxisType.Explicit, ...))`, sharding in types) the step sees each array's sharding in its type, as under `jax.jit`, inside `jax.set_mesh` or not",
)
def test_a_mesh_with_explicit_axes():
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    seen = []

    def make():
        def fit(params, x):
            seen.append(
                (str(jax.typeof(params["w"]).sharding.spec), str(jax.typeof(x).sharding.spec))
            )
            params = {"w": params["w"] - 0.1 * jnp.mean(x) * params["w"]}
            return params, jnp.sum(x)

        return fit

    w = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P(None, "model")))
    x = jax.device_put(jnp.ones((16, 8)), NamedSharding(mesh, P("data", None)))
    for context in (contextlib.nullcontext(), jax.set_mesh(mesh)):
        with context:
            seen.clear()
            fit = make()
            ref_p, ref_out = jax.jit(fit)({"w": w}, x)
            ref_seen = list(seen)
            seen.clear()
            step = autoflat.step(fit)
            p, out = step({"w": w}, x)
            p, out = step(p, x)
            ref_p, ref_out = jax.jit(fit)(ref_p, x)
        assert seen and all(s == ref_seen[0] for s in seen), (seen, ref_seen)
        assert ref_seen[0] == ("P(None, 'model')", "P('data', None)")
        tree_allclose(p, ref_p)
        assert jax.typeof(autoflat.unwrap(p)["w"]) == jax.typeof(ref_p["w"])
        assert autoflat.unwrap(p)["w"].sharding == ref_p["w"].sharding


# ==========================================================================================
# How do I debug a step?
# ==========================================================================================


@claim(
    FAQ, "`autoflat.show(step)` prints the code that actually runs, with the roles in its header."
)
def test_show_has_the_roles_in_its_header():
    step = autoflat.step(_by_value, num_steps=2)
    params = {"w": jnp.zeros(3)}
    step(params, tx_sgd.init(params), jnp.ones((2, 3)))
    source = autoflat.show(step)
    lines = source.splitlines()
    assert lines[0].startswith("# autoflat: generated from `_by_value`")
    assert any(
        line.startswith("# params: state (matched by value to return position 0)") for line in lines
    )
    assert any(line.startswith("# x: scanned (per-step") for line in lines)
    compile(source, "<show>", "exec")  # the code itself: valid Python


def _raises_in_body(state, x):
    state = {"w": state["w"] + x}
    if x.shape[0] == 3:
        raise ValueError("bad batch")
    return state


@claim(FAQ, "Errors inside your body are reported at your file and line.")
def test_errors_inside_the_body_are_reported_at_the_users_line():
    import traceback

    step = autoflat.step(_raises_in_body)
    with pytest.raises(ValueError, match="bad batch") as info:
        step({"w": jnp.zeros(3)}, jnp.ones(3))
    frames = traceback.extract_tb(info.value.__traceback__)
    line = _raises_in_body.__code__.co_firstlineno + 3
    assert frames[-1].filename == __file__ and frames[-1].lineno == line, frames[-1]


def _prints(state, x):
    jax.debug.print("step sees {x}", x=x)
    state = {"w": state["w"] + x}
    return state


@claim(FAQ, "`jax.debug.print` works inside the step as in any jitted code.")
def test_jax_debug_print_works_inside_the_step(capfd):
    step = autoflat.step(_prints, num_steps=2)
    s = step({"w": jnp.zeros(())}, jnp.array([1.0, 2.0]))
    jax.effects_barrier()
    out = capfd.readouterr().out
    assert "step sees 1.0" in out and "step sees 2.0" in out
    np.testing.assert_array_equal(s["w"], 3.0)


@claim(
    FAQ,
    "`autoflat.stats(step)` tells you whether calls take the fast path and how often the step compiled.",
)
def test_stats_counts_fast_path_and_compiles():
    step = autoflat.step(add)
    s = step({"w": jnp.zeros(2)}, jnp.ones(2))
    assert (autoflat.stats(step).fast_path, autoflat.stats(step).traces) == (0, 1)
    s = step(s, jnp.ones(2))
    s = step(s, jnp.ones(2))
    assert (autoflat.stats(step).fast_path, autoflat.stats(step).traces) == (2, 1)
    step({"w": jnp.zeros(3)}, jnp.ones(3))  # new shapes: a compile, no fast path
    stats = autoflat.stats(step)
    assert (stats.fast_path, stats.traces, stats.calls) == (2, 2, 4)


@claim(
    FAQ,
    "To rule autoflat out, run the same function with `jax.jit`: with `num_steps=1` the results are the same.",
)
def test_num_steps_1_results_are_those_of_jax_jit():
    tx = optax.adam(1e-2)

    def fit(params, opt_state, x):
        loss, grads = jax.value_and_grad(lambda p: jnp.mean(jnp.tanh(x @ p["w"] + p["b"]) ** 2))(
            params
        )
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    params = {"w": jnp.ones((3, 2)) * 0.3, "b": jnp.zeros(2)}
    xs = jax.random.normal(jax.random.key(0), (5, 4, 3))
    step, jitted = autoflat.step(fit), jax.jit(fit)
    got = ref = (params, tx.init(params))
    for i in range(5):
        *got, loss = step(*got, xs[i])
        *ref, ref_loss = jitted(*ref, xs[i])
        np.testing.assert_array_equal(loss, ref_loss)
    tree_allclose(tuple(got), tuple(ref), exact=True)


# ==========================================================================================
# Which `num_steps` should I pick?
# ==========================================================================================

_tx_profile = optax.adam(1e-3)


def _profiled(params, opt_state, x):
    loss, grads = jax.value_and_grad(lambda p: jnp.sum((x @ p["w"]) ** 2))(params)
    updates, opt_state = _tx_profile.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


@claim(
    FAQ,
    "`print(autoflat.profile(train_step, params, opt_state, xs, ys))` runs it on copies of your arguments (your state and handles are not touched) and reports what it measures on your machine",
)
@claim(FAQ, "Profiling compiles nothing new once the step has run on arguments of these shapes")
@claim(FAQ, "so profile with `calls=` lower on a slow step.")
def test_profile_runs_on_copies_and_compiles_nothing_new():
    step = autoflat.step(_profiled, num_steps=4)
    params = {"w": jnp.ones((3, 2))}
    xs = jnp.ones((4, 8, 3))
    p, o, _ = step(params, _tx_profile.init(params), xs)
    p, o, _ = step(p, o, xs)
    before, values = autoflat.stats(step), _values((p, o))
    report = autoflat.profile(step, p, o, xs, calls=3)
    assert autoflat.stats(step) == before  # no compile, and the counters as they were
    assert _values((p, o)) == values  # the handles were not consumed
    p, o, _ = step(p, o, xs)  # and still take the fast path
    assert autoflat.stats(step).fast_path == before.fast_path + 2
    assert report.calls == 3 and report.num_steps == 4
    text = str(report)
    for line in ("host per call", "device per step", "host share", "per call"):
        assert line in text
    assert text.splitlines()[0].startswith("autoflat.profile: `_profiled` (test_faq.py:")


@claim(
    FAQ,
    "The figures are also fields of the returned `autoflat.Profile` (`host_s`, `device_s`, `host_share`, `host_bound`, `suggested_num_steps`, `suggested_input_bytes`, `loop_overhead`, ...).",
)
@claim(
    FAQ,
    "**in a loop** is the time of a step in a loop of calls back to back (awaited at its end), as your training loop makes them, and the share of it beyond the device time.",
)
@claim(FAQ, "**host share** is host time over host plus device time for one call")
@claim(
    FAQ,
    "The suggestion is the smallest `num_steps` at which it falls under 5%, with the memory one call's stacked per-step inputs would then take.",
)
def test_profile_fields_and_their_relations():
    step = autoflat.step(_profiled, num_steps=4)
    params = {"w": jnp.ones((3, 2))}
    xs = jnp.ones((4, 8, 3))
    report = autoflat.profile(step, params, _tx_profile.init(params), xs, calls=3)
    assert isinstance(report, autoflat.Profile)
    host, device, k = report.host_s, report.device_s, report.num_steps
    assert host > 0 and device >= 0
    assert report.host_share == pytest.approx(host / (host + k * device))
    assert report.host_bound == (host > k * device)
    share = lambda n: host / (host + n * device)  # noqa: E731
    best = report.suggested_num_steps
    if 1 < best < 1000:
        assert share(best) < 0.05 <= share(best - 1)
    assert report.suggested_input_bytes == best * 8 * 3 * 4  # one step's x: 8 x 3 float32
    loop = report.loop_s
    assert loop > 0
    assert report.loop_overhead == pytest.approx(max(loop - k * device, 0) / loop)
    assert f"{report.loop_overhead:.0%} of it beyond the device time" in str(report)


@claim(
    FAQ,
    "**per call** counts what the profiled loop (which passes the returned state back, as a training loop does) does beyond the fast path; a line after it reports the rebuilds and copies of your own calls so far, with the lines where handles were rebuilt, and the causes of recompiles.",
)
def test_profile_per_call_and_history_lines():
    step = autoflat.step(_profiled, num_steps=4)
    params = {"w": jnp.ones((3, 2))}
    p, o, _ = step(params, _tx_profile.init(params), jnp.ones((4, 8, 3)))
    kept = p["w"]  # a rebuild, at this line
    line = sys._getframe().f_lineno - 1
    p, o, _ = step(p, o, jnp.ones((4, 8, 3)))
    p, o, _ = step(p, o, jnp.ones((2, 8, 3)))  # a recompile: a shorter chunk
    report = autoflat.profile(step, p, o, jnp.ones((4, 8, 3)), calls=3)
    assert (report.flattens_per_call, report.copies_per_call, report.rebuilds_per_call) == (0, 0, 0)
    text = str(report)
    assert "per call        0.0 flattens, 0.0 copies, 0.0 rebuilds" in text
    assert "1 rebuilds" in text and f"rebuilt at test_faq.py:{line} x1" in text
    assert "recompiled 1 times, last: the shapes, dtypes or weak types of the inputs" in text
    assert kept.shape == (3, 2)


# ==========================================================================================
# `num_steps=10` made my conv net slower on CPU
# ==========================================================================================


@claim(FAQ, "or try `unroll=num_steps`, which removes the loop at the cost of compile time.")
def test_unroll_num_steps_removes_the_loop():
    xs = jax.random.normal(jax.random.key(0), (4, 3))
    looped = autoflat.step(add, num_steps=4)
    unrolled = autoflat.step(add, num_steps=4, unroll=4)
    assert "while" in looped.lower({"w": jnp.zeros(3)}, xs).as_text()
    assert "while" not in unrolled.lower({"w": jnp.zeros(3)}, xs).as_text()
    tree_allclose(unrolled({"w": jnp.zeros(3)}, xs), looped({"w": jnp.zeros(3)}, xs))
    ref = {"w": jnp.zeros(3)}
    for i in range(4):
        ref = jax.jit(add)(ref, xs[i])
    tree_allclose(unrolled({"w": jnp.zeros(3)}, xs), ref)


# ==========================================================================================
# How do I checkpoint state held in handles?
# ==========================================================================================


@claim(
    FAQ,
    "Pass the real objects: `autoflat.unwrap((params, opt_state))` gives a tuple of the real pytrees for orbax-checkpoint or `pickle`",
)
@claim(
    FAQ,
    "`examples/checkpointing.py` saves with orbax, restores into fresh objects, continues training, and checks that the result equals an uninterrupted run bit for bit.",
)
def test_checkpoint_the_unwrapped_state_and_resume_bit_for_bit(tmp_path):
    import orbax.checkpoint as ocp

    tx = optax.adam(1e-2)

    def fit(params, opt_state, x):
        grads = jax.grad(lambda p: jnp.sum(jnp.tanh(x @ p["w"]) ** 2))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    step = autoflat.step(fit, num_steps=2)
    xs = jax.random.normal(jax.random.key(0), (2, 4, 3))
    params = {"w": jnp.ones((3, 2)) * 0.3}
    p, o = step(params, tx.init(params), xs)
    real = autoflat.unwrap((p, o))
    assert type(real) is tuple and not any(autoflat.is_handle(t) for t in real)
    assert type(real[0]) is dict and type(real[1]) is tuple
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(tmp_path / "state", real)
        with ocp.StandardCheckpointer() as checkpointer:
            restored = checkpointer.restore(tmp_path / "state", jax.tree.map(np.zeros_like, real))
    unpickled = pickle.loads(pickle.dumps(real))
    unbroken = step(p, o, xs)
    for fresh in (restored, unpickled):
        resumed = step(*fresh, xs)
        tree_allclose(resumed, unbroken, exact=True)


def _hyper_handles():
    step = autoflat.step(_fit_hyper)
    p = {"w": jnp.ones(2)}
    return step(p, _tx_hyper.init(p), jnp.ones(2))


@claim(
    FAQ,
    "`flax.serialization` takes a handle as the object it stands for: `to_state_dict`, `to_bytes`, `from_state_dict` and `from_bytes` of a handle, or of a dict holding handles, give what they give for the objects",
)
def test_flax_serialization_takes_a_handle_as_its_object():
    from flax import serialization

    p, o = _hyper_handles()
    rp, ro = autoflat.unwrap((p, o))
    for handles, real in ((p, rp), ({"params": p, "opt": o}, {"params": rp, "opt": ro})):
        tree_allclose(
            serialization.to_state_dict(handles), serialization.to_state_dict(real), exact=True
        )
        assert serialization.to_bytes(handles) == serialization.to_bytes(real)
    data, state = serialization.to_bytes(rp), serialization.to_state_dict(rp)
    tree_allclose(serialization.from_bytes(p, data), serialization.from_bytes(rp, data), exact=True)
    tree_allclose(
        serialization.from_state_dict(p, state),
        serialization.from_state_dict(rp, state),
        exact=True,
    )
    both = {"params": p}
    tree_allclose(
        serialization.from_bytes(both, serialization.to_bytes({"params": rp})),
        {"params": rp},
        exact=True,
    )


@claim(
    FAQ,
    "One exception: Flax restores a named tuple by its type, so restoring *into* a handle of one (`from_bytes(opt_state, data)` with `optax.inject_hyperparams`'s state, a `NamedTuple`) raises a `TypeError` that says to pass `autoflat.unwrap(opt_state)`.",
)
def test_restoring_into_a_named_tuple_handle_says_to_unwrap():
    from flax import serialization

    _, o = _hyper_handles()
    data = serialization.to_bytes(autoflat.unwrap(o))
    with pytest.raises(TypeError, match=r"autoflat\.unwrap\(x\)"):
        serialization.from_bytes(o, data)
    restored = serialization.from_bytes(autoflat.unwrap(o), data)
    tree_allclose(restored, autoflat.unwrap(o), exact=True)


@claim(FAQ, "`eqx.tree_serialise_leaves(path, handle)` writes the same bytes as for the object.")
def test_eqx_tree_serialise_leaves_of_a_handle(tmp_path):
    h = _seq_handle()
    eqx.tree_serialise_leaves(tmp_path / "handle.eqx", h)
    eqx.tree_serialise_leaves(tmp_path / "real.eqx", autoflat.unwrap(h))
    assert (tmp_path / "handle.eqx").read_bytes() == (tmp_path / "real.eqx").read_bytes()


@claim(
    FAQ, "Orbax pairs the tree you save with one mapped from it, so save `autoflat.unwrap(state)`"
)
@claim(
    FAQ,
    "Libraries that pair the tree you give them with another fail with JAX's pytree structure error, whose text says to pass `autoflat.unwrap(handle)` (or to decorate the step with `lazy=False`): orbax's `save`, `flax.training.checkpoints.save_checkpoint` (which saves with orbax), `eqx.tree_deserialise_leaves(path, like=handle)` and `optax.contrib.schedule_free_eval_params(opt_state, params)`",
)
def test_libraries_that_pair_trees_say_to_unwrap(tmp_path):
    import orbax.checkpoint as ocp
    from flax.training import checkpoints

    h = _seq_handle()
    eqx.tree_serialise_leaves(tmp_path / "real.eqx", autoflat.unwrap(h))
    sf = optax.contrib.schedule_free_adamw(1e-3)

    def fit(params, opt_state, x):
        grads = jax.grad(lambda p: jnp.sum(p["w"] * x))(params)
        updates, opt_state = sf.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    params = {"w": jnp.ones(2)}
    p, o = autoflat.step(fit)(params, sf.init(params), jnp.ones(2))
    for operation in (
        lambda: ocp.StandardCheckpointer().save(tmp_path / "orbax", {"model": h}),
        lambda: checkpoints.save_checkpoint(tmp_path / "flax", {"model": h}, step=0),
        lambda: eqx.tree_deserialise_leaves(tmp_path / "real.eqx", like=h),
        lambda: optax.contrib.schedule_free_eval_params(o, p),
    ):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(ValueError) as info:
                operation()
        message = str(info.value)
        assert "pytree structure error" in message
        assert "pass autoflat.unwrap(x) there, or decorate the step with lazy=False" in message
    tree_allclose(
        eqx.tree_deserialise_leaves(tmp_path / "real.eqx", like=autoflat.unwrap(h)), h, exact=True
    )
    optax.contrib.schedule_free_eval_params(autoflat.unwrap(o), autoflat.unwrap(p))


# ==========================================================================================
# Can I choose how state travels across `jax.jit`? How do I turn packing off?
# ==========================================================================================


def _scale_floats(params, x):
    params = jax.tree.map(lambda a: a * x if jnp.issubdtype(a.dtype, jnp.floating) else a, params)
    return params


def _buffers(params, **options):
    """How many buffers the state and `x` take across `jax.jit`."""
    step = autoflat.step(_scale_floats, **options)
    return _main_args(step.lower(params, jnp.ones(())).as_text())


@claim(
    FAQ,
    '`"auto"` (the default) packs the small leaves of a state (at most 512 elements: biases, norm scales, their optimizer moments), per dtype, into one buffer when a state holds at least 32 of them; weights keep their own buffers',
)
def test_auto_packs_small_leaves_per_dtype():
    ones = lambda n, size, dtype=jnp.float32: [jnp.ones(size, dtype) for _ in range(n)]  # noqa: E731
    assert _buffers(ones(32, 512)) == 1 + 1  # one buffer, and x
    assert _buffers(ones(31, 512)) == 31 + 1  # too few
    assert _buffers(ones(32, 513)) == 32 + 1  # too large
    assert _buffers(ones(32, 4) + ones(32, 4, jnp.bfloat16)) == 2 + 1  # per dtype
    assert _buffers([jnp.ones((40, 40))] + ones(40, 4)) == 1 + 1 + 1  # the weight apart
    assert _buffers(ones(40, 4), pack="auto") == 2


@claim(
    FAQ,
    "and so does state written back into your objects (Flax NNX mutation style) and the state of a `lazy=False` step (both are real objects, one array per leaf)",
)
def test_auto_leaves_written_back_and_lazy_false_state_unpacked():
    from flax import nnx

    class Model(nnx.Module):
        def __init__(self):
            self.biases = nnx.List([nnx.Param(jnp.ones(4)) for _ in range(40)])

    def train(model, x):
        for b in model.biases:
            b[...] = b[...] * x

    step = autoflat.step(train)
    assert _main_args(step.lower(Model(), jnp.ones(())).as_text()) == 40 + 1
    assert _buffers(_small_leaves(), lazy=False) == 40 + 1


def _scale_each_step(params, xs):
    return jax.tree.map(lambda a: a * xs, params), xs.sum()


@claim(
    FAQ,
    "and on a TPU the state of a step of 8 or more steps a call",
)
def test_auto_leaves_the_state_of_8_or_more_steps_a_call_unpacked_on_a_tpu(monkeypatch):
    """The rule reads `jax.default_backend()`; here it is made to say "tpu" (the CPU's
    programs are lowered all the same): 40 small leaves travel as one buffer at 7 steps a
    call and as 40 at 8, and give the same results as `pack=False`."""
    params, xs = _small_leaves(), jnp.linspace(0.5, 1.5, 8)
    for k, buffers in ((7, 1), (8, 40)):
        step = autoflat.step(_scale_each_step, num_steps=k, pack="auto")
        monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
        assert _main_args(step.lower(params, xs[:k]).as_text()) == buffers + 1
        got = step(params, xs[:k])
        monkeypatch.undo()
        ref = autoflat.step(_scale_each_step, num_steps=k, pack=False)(params, xs[:k])
        tree_allclose(autoflat.unwrap(got), autoflat.unwrap(ref), exact=True)
    assert _main_args(step.lower(params, xs).as_text()) == 1 + 1  # on the CPU: packed
    forced = autoflat.step(_scale_each_step, num_steps=8, pack=True)
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert _main_args(forced.lower(params, xs).as_text()) == 1 + 1  # pack=True packs


@claim(
    FAQ,
    "`False` passes one buffer per array leaf; `True` packs every array leaf (except leaves sharded over several devices, and PRNG keys).",
)
def test_pack_false_and_true():
    params = [jnp.ones((40, 40))] + _small_leaves() + [jax.random.key(0), jax.random.key(1)]
    assert _buffers(params, pack=False) == 43 + 1
    assert _buffers(params, pack=True) == 1 + 2 + 1  # all floats in one; the keys apart
    if jax.device_count() >= 8:
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        mesh = jax.make_mesh((8,), ("d",))
        sharded = jax.device_put(jnp.ones(8), NamedSharding(mesh, P("d")))
        assert _buffers(_small_leaves() + [sharded, sharded * 2], pack=True) == 1 + 2 + 1


@claim(
    FAQ,
    "Inside the compiled step, the elementwise operations that the packed leaves go through alike (an optimizer's update) run once on the whole buffer, and only the leaves something else reads (the biases of a forward pass) are cut out of it",
)
def test_elementwise_updates_run_on_the_whole_buffer():
    tx = optax.adam(1e-2)

    def fit(params, opt_state, x):
        def loss(p):
            h = x
            for b in p[:3]:  # the forward pass reads three of the biases
                h = jnp.tanh(h + b)
            return jnp.sum(h**2)

        grads = jax.grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    params = _small_leaves(32)  # 32 biases of 4
    step = autoflat.step(fit)
    jaxpr = str(step.trace(params, tx.init(params), jnp.ones(4)).jaxpr)
    # Adam's update on the whole buffer of the 32 x 4 leaves
    assert re.search(r"f32\[128\] = (add|mul|div|sub) ", jaxpr), jaxpr
    # and the biases cut out of it for the forward pass
    assert re.search(r"= (slice|dynamic_slice|gather)\[", jaxpr)
    got = step(params, tx.init(params), jnp.ones(4))
    ref = jax.jit(fit)(params, tx.init(params), jnp.ones(4))
    tree_allclose(got, ref, rtol=1e-5, atol=1e-6)


@claim(
    FAQ,
    "Turn it off with `@autoflat.step(..., pack=False)`, or for every step of a process with the environment variable `AUTOFLAT_PACK=off` (`on` and `auto` are the other values; an explicit `pack=` wins).",
)
@claim(FAQ, "while debugging, to see one buffer per leaf in `step.lower(...).as_text()`.")
def test_autoflat_pack_environment_variable(monkeypatch):
    params = [jnp.ones((40, 40))] + _small_leaves()
    expected = {"off": 41 + 1, "on": 1 + 1, "auto": 1 + 1 + 1}
    for value, buffers in expected.items():
        monkeypatch.setenv("AUTOFLAT_PACK", value)
        assert _buffers(params) == buffers, value
        assert _buffers(params, pack=False) == 41 + 1  # an explicit pack= wins
        assert _buffers(params, pack=True) == 1 + 1
    monkeypatch.setenv("AUTOFLAT_PACK", "sideways")
    with pytest.raises(ValueError, match="AUTOFLAT_PACK must be off, on or auto"):
        autoflat.step(_scale_floats)


@claim(FAQ, "when comparing results bit for bit with a hand-written `jax.jit` loop")
def test_pack_false_is_bit_for_bit_a_jit_loop():
    tx = optax.adam(1e-2)

    def fit(params, opt_state, x):
        grads = jax.grad(lambda p: sum(jnp.sum(jnp.sin(b * x)) for b in p))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    params = _small_leaves(8, 3)
    xs = jax.random.normal(jax.random.key(0), (4, 3))
    ref = (params, tx.init(params))
    for i in range(4):
        ref = jax.jit(fit)(*ref, xs[i])
    step = autoflat.step(fit, pack=False)
    got = (params, tx.init(params))
    for i in range(4):
        got = step(*got, xs[i])
    tree_allclose(got, ref, exact=True)


# ==========================================================================================
# More of "What autoflat guarantees when something fails", and of reading handles
# ==========================================================================================


@claim(FAQ, "Logging like that every call copies the whole state every call")
def test_logging_from_a_handle_every_call_copies_the_state_every_call():
    step = autoflat.step(_fit_hyper)
    p = {"w": jnp.ones(2)}
    p, o = step(p, _tx_hyper.init(p), jnp.ones(2))
    for i in range(3):
        before = autoflat.stats(step)
        float(o.hyperparams["learning_rate"])  # the log line
        float(p["w"][0])
        p, o = step(p, o, jnp.ones(2))
        after = autoflat.stats(step)
        assert after.copies == before.copies + 2, i  # both states, every call
        assert after.rebuilds == before.rebuilds + 2


@claim(
    FAQ,
    "A walk of a returned Flax NNX model's handle (`nnx.state(model)`, `jax.tree.map(f, model)`, an `nnx.jit` function taking it) rebuilds it too, since NNX may write into it.",
)
def test_walking_a_returned_nnx_model_rebuilds_it():
    from flax import nnx

    step = autoflat.step(_nnx_forward)
    model, _ = step(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), jnp.ones(2))
    peek = nnx.jit(lambda m: m.kernel[...].sum())
    for walk in (lambda m: nnx.state(m), lambda m: jax.tree.map(jnp.sum, m), peek):
        before = autoflat.stats(step)
        walk(model)
        model, _ = step(model, jnp.ones(2))
        after = autoflat.stats(step)
        assert after.rebuilds == before.rebuilds + 1
        assert after.flattens == before.flattens + 1  # read afresh: NNX may have written


@claim(
    FAQ,
    "when it also writes back into your objects (mutation style), the call waits for it first, so the failure raises from the call and your objects keep their values",
)
def test_a_failure_seen_only_when_waited_for_leaves_written_objects_intact(monkeypatch):
    # XLA:CPU runs a program to its end before the call returns; the failure an accelerator
    # reports only when the results are awaited is simulated by the wait raising once.
    def update(totals, x):
        w = jax.pure_callback(np.asarray, jax.ShapeDtypeStruct((3,), jnp.float32), totals["w"] + x)
        totals["w"] = w

    step = autoflat.step(update)
    totals = {"w": jnp.zeros(3)}
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
    np.testing.assert_array_equal(totals["w"], [2.0] * 3)
    step(totals, jnp.ones(3))
    np.testing.assert_array_equal(totals["w"], [3.0] * 3)


@jax.tree_util.register_pytree_node_class
class _Metrics:
    """A user's pytree class among a step's outputs; `interrupt` makes its rebuild raise
    once, as a Ctrl-C landing there would."""

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


def _with_metrics(state, x):
    state = {"w": state["w"] + x}
    return state, _Metrics(jnp.sum(x))


@claim(
    FAQ,
    "The program's results reach the step without any Python running between (the compiled program returns plain lists of buffers; your own pytree classes among the outputs are rebuilt after that).",
)
def test_an_interrupt_while_user_classes_are_rebuilt_is_recoverable():
    step = autoflat.step(_with_metrics, num_steps=2)
    s, _ = step({"w": jnp.zeros(3)}, jnp.ones((2, 3)))
    _Metrics.interrupt = True
    with pytest.raises(KeyboardInterrupt):
        step(s, jnp.ones((2, 3)))
    s, metrics = step.recover()
    np.testing.assert_array_equal(s["w"], [4.0] * 3)
    np.testing.assert_array_equal(metrics.loss, [3.0, 3.0])


@claim(FAQ, "Once the call has returned, its result is your code's, as `jax.jit`'s is")
def test_a_returned_call_leaves_nothing_in_the_step():
    step = autoflat.step(add)
    s = step({"w": jnp.zeros(3)}, jnp.ones(3))
    s = step(s, jnp.ones(3))
    with pytest.raises(autoflat.StateError, match="nothing to recover"):
        step.recover()
    passed, x = weakref.ref(s), jnp.ones(3)
    returned = weakref.ref(step(s, x))  # the result dropped at once, as at an interrupt there
    kept_x = weakref.ref(x)
    del s, x
    gc.collect()
    assert passed() is None and returned() is None and kept_x() is None  # the step holds none


@claim(
    FAQ,
    "**host per call** is the work a call does on the host whatever its number of steps: autoflat's own (taking the state in, making the handles) and JAX's dispatch of the call's buffers",
)
def test_profile_host_time_is_autoflats_and_the_dispatch():
    step = autoflat.step(_profiled, num_steps=4)
    params = {"w": jnp.ones((3, 2))}
    report = autoflat.profile(step, params, _tx_profile.init(params), jnp.ones((4, 8, 3)), calls=3)
    assert report.host_s == pytest.approx(report.autoflat_s + report.dispatch_s)
    assert report.autoflat_s > 0 and report.dispatch_s > 0


def _episode_returns(w, ep_ret, obs, reward, done):  # (4 environments at num_steps=4)
    loss, g = jax.value_and_grad(lambda w: jnp.mean((obs @ w - reward) ** 2))(w)
    return w - 0.1 * g, jnp.where(done, 0.0, ep_ret + reward), loss


@claim(
    FAQ,
    'but a carry updated elementwise and returned as an expression, `jnp.where(done, 0.0, ep_ret + reward)`, reads like a per-step schedule broadcast against 4 environments: the first call slices it per step, as the header\'s `[rule: leading-axis]` says. The next call, given back what that position returned, raises an `autoflat.ShapeError` naming `state={"ep_ret": 1}` before it takes anything, but the first call\'s results (the new `w` too) came from the sliced reading: declare it, `state="ep_ret"`, or pick another `num_steps`.',
)
def test_a_carry_of_num_steps_environments_updated_elementwise_needs_declaring():
    k, envs = 4, 4
    w0, r0 = jnp.full((3,), 0.1), jnp.zeros(envs)
    obs = jax.random.normal(jax.random.key(0), (2 * k, envs, 3))
    rewards = jax.random.uniform(jax.random.key(1), (2 * k, envs))
    done = jnp.arange(2 * k * envs).reshape(2 * k, envs) % 3 == 0
    ref = jax.jit(_episode_returns)
    w, r = w0, r0
    for t in range(2 * k):
        w, r, _ = ref(w, r, obs[t], rewards[t], done[t])
    step = autoflat.step(_episode_returns, num_steps=k)
    gw, gr, _ = step(w0, r0, obs[:k], rewards[:k], done[:k])
    assert "# ep_ret: scanned" in autoflat.show(step)
    assert "[rule: leading-axis]" in autoflat.show(step).split("# ep_ret:")[1].splitlines()[0]
    with pytest.raises(autoflat.ShapeError) as info:
        step(gw, gr, obs[k:], rewards[k:], done[k:])
    assert "`ep_ret` holds what return position 1 gave back at an earlier call" in str(info.value)
    assert 'state={"ep_ret": 1})' in str(info.value)
    assert not gw.is_deleted()  # nothing was taken: the state passed in is still usable
    step = autoflat.step(_episode_returns, num_steps=k, state="ep_ret")
    gw, gr = w0, r0
    for start in (0, k):
        s = slice(start, start + k)
        gw, gr, _ = step(gw, gr, obs[s], rewards[s], done[s])
    tree_allclose((autoflat.unwrap(gw), autoflat.unwrap(gr)), (w, r), rtol=1e-6)
