"""First-call role inference (`_infer`): state matched by abstract value, per-step, broadcast
or static by run-time type and shape, Python scalars in state that become arrays, state that is
one array. Each case runs at num_steps=1 and 4 against a plain `jax.jit` loop from the same
start."""

from __future__ import annotations

import collections
import inspect
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from claims.claim import claim
from helpers import tree_allclose

import autoflat

K = 4


def _batches(n, shape=(3,), seed=0):
    return jax.random.normal(jax.random.key(seed), (n, *shape), jnp.float32)


def _reference(update, state, per_step, n, rest=()):
    """`n` steps of `jax.jit(update)`; state is the first len(state) returns."""
    ref = jax.jit(update)
    outs = []
    for i in range(n):
        result = ref(*state, *(x[i] for x in per_step), *rest)
        state, out = result[: len(state)], result[len(state) :]
        outs.append(out)
    return state, outs


def _run(step, state, per_step, n, k, rest=()):
    """`n` steps of an autoflat step with `k` steps per call, batches stacked."""
    outs = []
    for start in range(0, n, k):
        xs = [x[start : start + k] if k > 1 else x[start] for x in per_step]
        result = step(*state, *xs, *rest)
        result = result if isinstance(result, tuple) else (result,)
        state, out = result[: len(state)], result[len(state) :]
        outs.append(out)
    return state, outs


@pytest.mark.parametrize("k", [1, K])
def test_new_state_under_another_name(k):
    tx = optax.sgd(0.1)

    def update(p, s, x):
        loss, g = jax.value_and_grad(lambda w: jnp.sum((w * x - 1.0) ** 2))(p)
        u, s = tx.update(g, s, p)
        new_p = optax.apply_updates(p, u)
        return new_p, s, loss

    p0 = jnp.arange(3.0, dtype=jnp.float32)
    xs = _batches(8)
    step = autoflat.step(update, num_steps=k)
    (p, _), _ = _run(step, (p0, tx.init(p0)), [xs], 8, k)
    (rp, _), _ = _reference(update, (p0, tx.init(p0)), [xs], 8)
    np.testing.assert_allclose(p, rp, rtol=1e-6)
    assert type(p) is type(rp)  # one array comes back as the array, not a handle
    if k > 1:  # with one step a call, a bare array gains nothing from being state
        assert "# p: state (matched by value to return position 0)" in step.source


@pytest.mark.parametrize("k", [1, K])
def test_example_libraries_optimizer_state_returned_as_an_expression(k):
    from jax.example_libraries import optimizers

    opt_init, opt_update, get_params = optimizers.momentum(0.05, mass=0.9)

    def loss(params, x):
        w, b = params
        return jnp.sum((x @ w + b - 1.0) ** 2)

    # jax's examples/mnist_classifier.py: `update(i, opt_state, batch)`.
    def update(i, opt_state, batch):
        params = get_params(opt_state)
        return opt_update(i, jax.grad(loss)(params, batch), opt_state)

    params = (jnp.ones((3, 2)) * 0.1, jnp.zeros(2))
    xs = _batches(8, (5, 3))
    step = autoflat.step(update, num_steps=k)
    state = opt_init(params)
    ref_state = opt_init(params)
    ref = jax.jit(update)
    for start in range(0, 8, k):
        chunk = xs[start : start + k] if k > 1 else xs[start]
        state = step(0, state, chunk)
        for i in range(k):
            ref_state = ref(0, ref_state, xs[start + i])
    np.testing.assert_allclose(get_params(state)[0], get_params(ref_state)[0], rtol=1e-6)
    assert "# opt_state: state (matched by value" in step.source


@pytest.mark.parametrize("k", [1, K])
def test_list_comprehension_of_new_parameters(k):
    def loss(params, x):
        h = x
        for w, b in params:
            h = jnp.tanh(h @ w + b)
        return jnp.sum(h**2)

    def update(params, x):
        grads = jax.grad(loss)(params, x)
        return [
            (w - 0.1 * dw, b - 0.1 * db) for (w, b), (dw, db) in zip(params, grads, strict=True)
        ]

    params = [(jnp.ones((3, 3)) * 0.2, jnp.zeros(3)), (jnp.ones((3, 2)) * 0.1, jnp.zeros(2))]
    xs = _batches(8, (4, 3))
    step = autoflat.step(update, num_steps=k)
    (p,), _ = _run(step, (params,), [xs], 8, k)
    rp = params
    for i in range(8):
        rp = jax.jit(update)(rp, xs[i])
    np.testing.assert_allclose(p[1][0], rp[1][0], rtol=1e-6)
    assert autoflat.stats(step).flattens == 1  # the handle passed back is the fast path


@pytest.mark.parametrize("k", [1, K])
def test_state_taken_and_returned_under_different_names(k):
    tx = optax.adam(1e-2)

    def update(params, discriminator_opt_state, x):
        loss, grads = jax.value_and_grad(lambda p: jnp.sum((p["w"] * x) ** 2))(params)
        updates, opt_state = tx.update(grads, discriminator_opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, loss

    params = {"w": jnp.arange(3.0, dtype=jnp.float32)}
    xs = _batches(8)
    step = autoflat.step(update, num_steps=k)
    (p, o), outs = _run(step, (params, tx.init(params)), [xs], 8, k)
    (rp, ro), routs = _reference(update, (params, tx.init(params)), [xs], 8)
    np.testing.assert_allclose(p["w"], rp["w"], rtol=1e-6)
    losses = np.concatenate([np.atleast_1d(o[0]) for o in outs])
    np.testing.assert_allclose(losses, [float(o[0]) for o in routs], rtol=1e-5)
    assert "discriminator_opt_state: state (matched by value" in step.source


def test_declared_state_not_returned_by_name_matches_by_value():
    def update(p, x):
        q = p - 0.1 * x
        return q, jnp.sum(q)

    xs = jnp.ones((4, 3))
    step = autoflat.step(update, num_steps=4, state="p")
    p, sums = step(jnp.full((3,), 2.0), xs)
    np.testing.assert_allclose(p, jnp.full((3,), 1.6), rtol=1e-6)
    np.testing.assert_allclose(sums, [5.7, 5.4, 5.1, 4.8], rtol=1e-5)  # not [6, 6, 6, 6]


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("pack", [False, "auto"])
def test_state_matched_by_value_when_the_first_call_gets_handles(k, pack):
    """A step's first call taking another step's results (pre-training, then fine-tuning):
    the handles match the returned values as the objects they stand for would. They were
    taken for broadcast inputs: every step restarted from the same params, silently."""
    tx = optax.sgd(0.1)

    def pretrain_fn(params, opt_state, x):
        grads = jax.grad(lambda p: jnp.sum((p["w"] - x) ** 2))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state

    def finetune_fn(params, opt_state, x):
        grads = jax.grad(lambda p: jnp.sum((p["w"] - 2 * x) ** 2))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    start = {"w": jnp.zeros(3), "b": [jnp.zeros(())] * 40}  # 40 small leaves: packed
    pretrain = autoflat.step(pretrain_fn, num_steps=k, pack=pack)
    finetune = autoflat.step(finetune_fn, num_steps=k, pack=pack)
    xs = _batches(2 * k)
    chunks = [xs[:k], xs[k:]] if k > 1 else [xs[0], xs[1]]
    params, opt_state = pretrain(start, tx.init(start), chunks[0])
    params, opt_state = finetune(params, opt_state, chunks[1])  # its first call: handles
    assert "# params: state (matched by value to return position 0)" in finetune.source
    ref = jax.jit(pretrain_fn), jax.jit(finetune_fn)
    rp, ro = start, tx.init(start)
    for i in range(2 * k):
        rp, ro = ref[i // k](rp, ro, xs[i])
    tree_allclose(params, rp)
    tree_allclose(opt_state, ro)


def test_handle_and_dict_alike_are_matched_as_two_dicts_are():
    """Self-distillation: the student and the teacher alike, the new student computed from
    both. A handle and a dict are matched as two dicts are: by data flow, the student's own
    arrays being operands of the update (`p - 0.1 * g`), the teacher's not."""

    def distill(params, teacher, x):
        grads = jax.grad(lambda p: jnp.sum((p["w"] - teacher["w"] * x) ** 2))(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    shift = autoflat.step(lambda_free_shift, num_steps=K)
    handle = shift({"w": jnp.zeros(3)}, jnp.ones((K, 3)))
    results = []
    for params in (handle, {"w": jnp.full(3, 0.4)}):
        step = autoflat.step(distill, num_steps=K)
        results.append(step(params, {"w": jnp.ones(3)}, jnp.ones((K, 3))))
        shown = autoflat.show(step)
        assert "# params: state (matched by value and data flow to return position 0)" in shown
        assert "# teacher: broadcast (no leading axis of num_steps=4 at the first call)" in shown
    tree_allclose(results[0], results[1])


def lambda_free_shift(params, x):
    params = {"w": params["w"] + 0.1 * jnp.mean(x)}
    return params


def test_declared_state_that_nothing_matches_is_an_error():
    def update(p, x):
        loss = jnp.sum(p * x)
        return loss

    step = autoflat.step(update, num_steps=4, state="p")
    p = jnp.ones(3)
    with pytest.raises(autoflat.OptionError, match="`p` is named in state= but no `return`"):
        step(p, jnp.ones((4, 3)))
    np.testing.assert_array_equal(p, jnp.ones(3))  # nothing consumed


def test_alike_state_follows_data_flow_then_names_or_is_an_error():
    """Parameters alike (one tree structure, shapes, dtypes) returned under other names: each
    position goes to the parameter it is computed from, else to the one whose name it shares
    a word with; parameter order alone is no evidence (it was, and `(ema_params, params)`
    returning `new_params, new_ema` swapped the two at num_steps > 1, silently)."""

    def update(a, b, x):
        return {"w": a["w"] + x}, {"w": b["w"] * 2}

    def swapped(b, a, x):
        return {"w": a["w"] + x}, {"w": b["w"] * 2}

    start = ({"w": jnp.ones(3)}, {"w": jnp.full(3, 3.0)}, jnp.ones((2, 3)))
    step = autoflat.step(update, num_steps=2)
    a, b = step(*start)
    np.testing.assert_allclose(a["w"], [3.0] * 3)
    np.testing.assert_allclose(b["w"], [12.0] * 3)
    assert "# b: state (matched by value and data flow to return position 1)" in step.source
    step = autoflat.step(swapped, num_steps=2)
    a, b = step(start[1], start[0], start[2])
    np.testing.assert_allclose(a["w"], [3.0] * 3)
    np.testing.assert_allclose(b["w"], [12.0] * 3)
    assert "# b: state (matched by value and data flow to return position 1)" in step.source

    def ema(ema_params, params, x):
        new_params = {"w": params["w"] - 0.1 * x}
        new_ema = {"w": 0.9 * ema_params["w"] + 0.1 * new_params["w"]}
        return new_params, new_ema

    step = autoflat.step(ema, num_steps=2)
    new_params, new_ema = step({"w": jnp.zeros(3)}, {"w": jnp.ones(3)}, jnp.ones((2, 3)))
    np.testing.assert_allclose(new_params["w"], [0.8] * 3, rtol=1e-6)
    np.testing.assert_allclose(new_ema["w"], [0.9 * 0.09 + 0.08] * 3, rtol=1e-6)
    assert "# ema_params: state (matched by value and data flow to return position 1)" in (
        step.source
    )

    def mixed(fast, slow, x):  # each new value computed from both: names decide
        new_slow = {"w": slow["w"] + 0.5 * (fast["w"] - slow["w"])}
        new_fast = {"w": new_slow["w"] + x}
        return new_fast, new_slow

    step = autoflat.step(mixed, num_steps=2)
    step(*start)
    assert "# slow: state (matched by value and name to return position 1)" in step.source

    def anonymous(a, b, x):  # computed from both, names that say nothing: an error
        c = {"w": a["w"] + b["w"] + x}
        d = {"w": a["w"] - b["w"]}
        return c, d

    with pytest.raises(autoflat.OptionError, match=r"could each be the new value of `a`, `b`"):
        autoflat.step(anonymous, num_steps=2)(*start)

    def three(a, b, x):
        # three alike, two parameters: the third is computed from neither
        return {"w": a["w"] + x}, {"w": b["w"] * 2}, {"w": x}

    a, b, xs = autoflat.step(three, num_steps=2)(*start)
    np.testing.assert_allclose(b["w"], [12.0] * 3)
    assert xs["w"].shape == (2, 3)  # the third is a per-step output, stacked

    def mixed_three(a, b, x):  # each computed from both: no evidence, an error
        return {"w": a["w"] + b["w"]}, {"w": b["w"] - a["w"]}, {"w": a["w"] * b["w"] + x}

    with pytest.raises(autoflat.OptionError, match=r"`a`, `b`") as info:
        autoflat.step(mixed_three, num_steps=2)(*start)
    assert 'state={"a": <position>, "b": <position>}' in str(info.value)
    mapped = autoflat.step(mixed_three, num_steps=2, state={"a": 0, "b": 1})
    a, b, xs = mapped(*start)
    np.testing.assert_allclose(b["w"], [-2.0] * 3)  # b: 3 - 1 = 2, then 2 - (1 + 3)
    assert xs["w"].shape == (2, 3)


@pytest.mark.parametrize("k", [1, K])
def test_same_every_step_arguments_are_broadcast_or_static(k):
    eqx = pytest.importorskip("equinox")
    teacher = eqx.nn.MLP(3, 1, 8, 1, key=jax.random.key(1))  # holds jax.nn.relu: not traceable
    tx = optax.sgd(0.05)
    key = jax.random.key(7)
    full_batch = _batches(6, (3,), seed=3)  # reused by every step: no leading axis of k

    def update(params, opt_state, teacher, tx, key, eos_id, data, scale):
        noise = jax.random.normal(key, (3,)) * 0.0
        target = jax.vmap(teacher)(data)[:, 0] * scale + eos_id
        loss, g = jax.value_and_grad(lambda p: jnp.mean((data @ p + noise[0] - target) ** 2))(
            params
        )
        u, opt_state = tx.update(g, opt_state, params)
        params = optax.apply_updates(params, u)
        return params, opt_state, loss

    params = jnp.zeros(3)
    step = autoflat.step(update, num_steps=k)
    scales = jnp.linspace(1.0, 2.0, 8)  # per step
    p, o = params, tx.init(params)
    rp, ro = params, tx.init(params)
    ref = eqx.filter_jit(update)  # jax.jit cannot take the teacher's functions
    for start in range(0, 8, k):
        s = scales[start : start + k] if k > 1 else scales[start]
        p, o, _ = step(p, o, teacher, tx, key, 2, full_batch, s)
        for i in range(k):
            rp, ro, _ = ref(rp, ro, teacher, tx, key, 2, full_batch, scales[start + i])
    np.testing.assert_allclose(p, rp, rtol=1e-5)
    src = step.source
    assert "# teacher: broadcast (a equinox.MLP, holds values JAX cannot trace)" in src
    assert "# tx: broadcast" in src
    if k > 1:
        assert "# eos_id: static (a Python int, static as in eqx.filter_jit)" in src
        assert "# key: broadcast (no leading axis of num_steps=4 at the first call)" in src
        assert "# data: broadcast" in src
        assert "# scale: scanned (per-step: leading axis 4 = num_steps" in src
    assert autoflat.stats(step).traces == 1


def test_a_full_batch_shorter_than_num_steps_must_be_declared():
    def update(p, batch):
        p = p - 0.1 * jnp.mean(batch, axis=0)
        return p

    step = autoflat.step(update, num_steps=4)
    with pytest.raises(autoflat.ShapeError, match="short chunk of 3 steps or one value reused"):
        step(jnp.ones(2), jnp.ones((3, 2)))
    as_broadcast = autoflat.step(update, num_steps=4, broadcast="batch")
    np.testing.assert_allclose(as_broadcast(jnp.ones(2), jnp.ones((3, 2))), [0.6, 0.6], rtol=1e-6)
    as_chunk = autoflat.step(update, num_steps=4, per_step="batch")
    np.testing.assert_allclose(as_chunk(jnp.ones(2), jnp.ones((3, 2))), [0.7, 0.7], rtol=1e-6)


def test_mixed_leading_axes_name_the_leaf():
    def update(p, batch):
        p = p + jnp.sum(batch["x"]) + jnp.sum(batch["mask"])
        return p

    step = autoflat.step(update, num_steps=4)
    with pytest.raises(autoflat.ShapeError, match=r"`batch\['mask'\]` is float32\[3\]"):
        step(jnp.zeros(()), {"x": jnp.ones((4, 2)), "mask": jnp.ones(3)})


def test_mixed_leading_axes_error_names_state_too():
    def update(p, batch):
        p = p + jnp.sum(batch["x"]) + jnp.sum(batch["mask"])
        return p

    step = autoflat.step(update, num_steps=4)
    with pytest.raises(autoflat.ShapeError) as info:
        step(jnp.zeros(()), {"x": jnp.ones((4, 2)), "mask": jnp.ones(3)})
    assert 'state="batch"' in str(info.value)
    assert 'per_step="batch"' in str(info.value) and 'broadcast="batch"' in str(info.value)


def test_state_with_mixed_leading_axes_returned_under_another_name():
    """Leaves with a leading axis of num_steps and others without: state matched by value
    before the leading axes are judged (JAX's mnist_classifier with a Dense(10) last layer at
    num_steps=10); it was a "mixed argument" error naming only per_step= and broadcast=."""

    def update(params, x):
        new_params = {"w": params["w"] - 0.1 * x[0], "b": params["b"] * 0.9 + jnp.sum(x)}
        return new_params, jnp.sum(x)

    start = {"w": jnp.arange(4.0), "b": jnp.ones(3)}  # w has a leading axis of 4 = num_steps
    xs = _batches(8, (4,))
    (ref,), ref_outs = _reference(update, (start,), (xs,), 8)
    step = autoflat.step(update, num_steps=K)
    (got,), outs = _run(step, (start,), (xs,), 8, K)
    tree_allclose(ref, got, rtol=1e-6)
    np.testing.assert_allclose(np.ravel(outs), np.stack([o[0] for o in ref_outs]), rtol=1e-6)
    assert "# params: state (matched by value to return position 0)" in autoflat.show(step)


def test_state_shorter_than_num_steps_returned_under_another_name():
    """Every leaf of the state with a leading axis shorter than num_steps (optax's SAM example
    keeps two parameter vectors of 2 entries): state matched by value, not "a short first
    chunk"; and a non-state argument like that still raises."""

    def update(store, x):
        new = {"a": store["a"] + x, "b": store["b"] * 0.5}
        return new, jnp.sum(new["a"])

    start = {"a": jnp.ones((2, 3)), "b": jnp.ones((2,))}
    xs = _batches(8, (3,))
    (ref,), _ = _reference(update, (start,), (xs,), 8)
    step = autoflat.step(update, num_steps=K)
    (got,), _ = _run(step, (start,), (xs,), 8, K)
    tree_allclose(ref, got, rtol=1e-6)

    def not_state(p, batch):
        return p + jnp.sum(batch), jnp.sum(batch)

    step = autoflat.step(not_state, num_steps=K)
    with pytest.raises(autoflat.ShapeError, match="short chunk of 2 steps") as info:
        step(jnp.zeros(()), jnp.ones((2, 3)))
    assert 'state="batch"' in str(info.value)


def test_a_python_int_used_as_a_shape_at_one_step_a_call_is_static():
    """With num_steps=1 Python ints are traced as jax.jit traces them, except one the step
    needs concrete (a layer size: Flax's VAE example passes `latents`): static then, each value
    compiled once, where jax.jit raises (a TypeError or a ConcretizationTypeError)."""

    def update(p, x, size):
        p = p + jnp.sum(jnp.zeros(size) + x)
        return p

    step = autoflat.step(update, num_steps=1)
    p = step(jnp.zeros(()), jnp.ones(()), 3)
    p = step(p, jnp.ones(()), 3)
    np.testing.assert_allclose(p, 6.0)
    assert autoflat.stats(step).traces == 1
    assert "# size: static (a Python int the step needs as a concrete value" in autoflat.show(step)
    with pytest.raises(TypeError, match="concrete values of integer type"):
        jax.jit(update)(jnp.zeros(()), jnp.ones(()), 3)


def test_a_python_int_counter_at_one_step_a_call_is_traced():
    """A Python int the step only computes with (jax's mnist_classifier passes the step
    number `i`) stays traced at num_steps=1: one compile for every value."""

    def update(i, p, x):
        p = p + x * i
        return p

    step = autoflat.step(update, num_steps=1)
    p = jnp.zeros(())
    for i in range(4):
        p = step(i, p, jnp.ones(()))
    np.testing.assert_allclose(p, 6.0)
    assert autoflat.stats(step).traces == 1


@pytest.mark.parametrize("k", [1, K])
def test_train_state_with_a_python_int_step_compiles_once(k):
    train_state = pytest.importorskip("flax.training.train_state")

    def apply_fn(params, x):
        return x @ params["w"]

    state = train_state.TrainState.create(
        apply_fn=apply_fn, params={"w": jnp.ones((3, 1))}, tx=optax.sgd(0.1)
    )
    assert state.step == 0 and type(state.step) is int

    def train_step(state, x):
        def loss_fn(params):
            return jnp.mean((state.apply_fn(params, x) - 1.0) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        state = state.apply_gradients(grads=grads)
        return state, loss

    xs = _batches(8, (2, 3))
    step = autoflat.step(train_step, num_steps=k)
    s = state
    for start in range(0, 8, k):
        s, _ = step(s, xs[start : start + k] if k > 1 else xs[start])
    ref = jax.jit(train_step)
    rs = state
    for i in range(8):
        rs, _ = ref(rs, xs[i])
    assert int(s.step) == 8
    np.testing.assert_allclose(s.params["w"], rs.params["w"], rtol=1e-6)
    assert autoflat.stats(step).traces == 1


@pytest.mark.parametrize("k", [1, K])
def test_a_fresh_train_state_with_another_tx_on_a_later_call(k):
    """A new `TrainState` per seed or per optimizer in one process: its `tx` is another
    object, so its tree differs from the first call's (its static data, or its optimizer
    state too), and its Python int `step` went in as an int at num_steps > 1, where the step
    makes it an array: refused, blaming the step for changing its state's structure. The
    leaf at the path the first call made an array goes in as an array; equal to a `jax.jit`
    loop per state."""
    train_state = pytest.importorskip("flax.training.train_state")

    def train_step(state, x):
        loss_fn = lambda p: jnp.mean((x @ p["w"] - 1.0) ** 2)  # noqa: E731
        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    def fresh(tx):
        params = {"w": jnp.ones(3)}
        return train_state.TrainState.create(apply_fn=None, params=params, tx=tx)

    xs = _batches(K, (2, 3))
    step = autoflat.step(train_step, num_steps=k)
    for tx in (optax.sgd(0.1), optax.sgd(0.1), optax.adam(0.1)):
        s = fresh(tx)
        for start in range(0, K, k):
            s, _ = step(s, xs[start : start + k] if k > 1 else xs[start])
        want = fresh(tx)
        for i in range(K):
            want, _ = jax.jit(train_step)(want, xs[i])
        assert int(s.step) == K
        np.testing.assert_allclose(s.params["w"], want.params["w"], rtol=1e-6)


class Config(NamedTuple):
    size: int


@pytest.mark.parametrize("k", [1, K])
def test_a_python_int_the_step_divides_by_is_traced_as_jax_jit_traces_it(k):
    """`TrainState.create` starts `step=0`; Flax's lm1b and wmt schedules compute
    `(count + shift) ** -0.5` at that count, inside a `jnp.where`. The first call's abstract
    evaluation kept the 0 a Python int, so the step raised ZeroDivisionError from the
    user's line, where `jax.jit` traces the 0 and computes an inf the where masks. Such an
    evaluation is done again with the numbers of one argument traced, then another's: a
    config's sizes beside it must stay concrete."""

    def update(state, x, config):
        s = state["step"]
        lr = jnp.where(s > 0, 1.0 / s, 1.0) * jnp.ones(config.size)
        state = {"w": state["w"] - lr * x, "step": s + 1}
        return state, lr

    def start():
        return {"w": jnp.zeros(2), "step": 0}

    xs = _batches(8, (2,))
    config = Config(size=2)
    ref, outs = start(), []
    for x in xs:
        ref, out = jax.jit(update, static_argnums=2)(ref, x, config)
        outs.append((out,))
    # At num_steps=4 the config's Python ints are static, as Python numbers are there.
    step = autoflat.step(update, num_steps=k, static_argnames="config" if k == 1 else ())
    (got,), got_outs = _run(step, (start(),), (xs,), 8, k, (config,))
    tree_allclose(got, ref, rtol=1e-6)
    join = jnp.concatenate if k > 1 else jnp.stack
    stacked = join([o[0] for o in got_outs])
    tree_allclose(stacked, jnp.stack([o[0] for o in outs]), rtol=1e-6)


def test_state_that_is_one_array_or_none_comes_back_as_it_is():
    def update(key, extra, x):
        key, sub = jax.random.split(key)
        return key, extra, jax.random.normal(sub, ()) + x

    step = autoflat.step(update, num_steps=2)
    key, extra, out = step(jax.random.key(0), None, jnp.ones(2))
    assert extra is None and out.shape == (2,)
    key2, _ = jax.random.split(key)  # a real key array, not a handle
    assert jnp.asarray(key).dtype == key2.dtype
    key, extra, _ = step(key, extra, jnp.ones(2))
    assert autoflat.stats(step).flattens == 0 and autoflat.stats(step).traces == 1


def test_state_whose_first_axis_is_num_steps_returned_under_another_name():
    """Every leaf of `params` has a leading axis of 4 = num_steps, so it looked per-step; the
    step returns one step's slice of it as `new`, and the stacked "outputs" came back in its
    place: silently wrong training. Now an error names state= and per_step=; state= works."""

    def update(params, x):
        new = {"w": params["w"] - 0.1 * x, "b": params["b"] * 0.5}
        return new, jnp.sum(x)

    start = {"w": jnp.ones((4, 3)), "b": jnp.ones(4)}
    xs = _batches(8, (3,))
    with pytest.raises(autoflat.ShapeError, match="return position 0 gives back") as info:
        autoflat.step(update, num_steps=K)(start, xs[:K])
    assert 'state="params"' in str(info.value) and 'per_step="params"' in str(info.value)
    (ref,), _ = _reference(update, (start,), (xs,), 8)
    step = autoflat.step(update, num_steps=K, state="params")
    (got,), _ = _run(step, (start,), (xs,), 8, K)
    tree_allclose(ref, got, rtol=1e-6)


def _halved(v, x):
    v2 = v * 0.5 + x.sum()
    return v2


def _carry(step, v, xs, k):
    """`v` carried through the steps of `xs`, `k` steps a call."""
    for start in range(0, len(xs), k):
        v = step(v, xs[start] if k == 1 else xs[start : start + k])
    return v


def test_a_bare_array_of_num_steps_entries_returned_under_another_name_asks():
    """`v2 = v * 0.5 + x.sum(); return v2` at num_steps=4: with `v` of shape (3,) it is state
    (matched by value), but with shape (4,) it was taken as per-step and the result stacked,
    silently; both readings type-check. An error names `state="v"` and `per_step="v"`, and
    each runs as `jax.jit` does under its reading."""
    xs = _batches(8, (2,))
    step = autoflat.step(_halved, num_steps=K)
    v = jnp.arange(4.0)
    with pytest.raises(autoflat.ShapeError, match="return position 0 gives back") as info:
        step(v, xs[:K])
    assert 'state="v"' in str(info.value) and 'per_step="v"' in str(info.value)
    np.testing.assert_allclose(v, [0.0, 1.0, 2.0, 3.0])  # still usable
    # state=: carried, as a loop of jax.jit
    carried = autoflat.step(_halved, num_steps=K, state="v")
    np.testing.assert_allclose(
        _carry(carried, v, xs, K), _carry(jax.jit(_halved), v, xs, 1), rtol=1e-6
    )
    # per_step=: one entry of v per step, each step's result stacked
    mapped = autoflat.step(_halved, num_steps=K, per_step="v")
    got = mapped(v, xs[:K])
    want = jnp.stack([jax.jit(_halved)(v[i], xs[i]) for i in range(K)])
    np.testing.assert_allclose(got, want, rtol=1e-6)
    # shape (3,): state, matched by value, as before
    short = autoflat.step(_halved, num_steps=K)
    got = _carry(short, jnp.arange(3.0), xs, K)
    ref = _carry(jax.jit(_halved), jnp.arange(3.0), xs, 1)
    np.testing.assert_allclose(got, ref, rtol=1e-6)
    assert "# v: state (matched by value to return position 0)" in autoflat.show(short)


def test_a_per_step_array_mapped_to_a_per_step_output_is_not_asked_about():
    """The neighbours the question above must not catch: an expression at the argument's place
    (`noise + x`), a name like it whose value only fits one step (`v_sum`), and a per-step
    argument whose place is taken by state: per-step, stacked, as the leading axis says."""

    def noisy(key, x):
        key, sub = jax.random.split(key)
        return key, jax.random.normal(sub, ()) + x

    def summed(w, v, x):
        v_sum = jnp.sum(v * x)
        return w + v_sum, v_sum

    key, out = autoflat.step(noisy, num_steps=K)(jax.random.key(0), jnp.arange(4.0))
    assert out.shape == (K,)
    w, sums = autoflat.step(summed, num_steps=K)(jnp.zeros(()), jnp.arange(4.0), jnp.ones((K, 2)))
    np.testing.assert_allclose(sums, [0.0, 2.0, 4.0, 6.0])
    np.testing.assert_allclose(w, 12.0)


@pytest.mark.parametrize("k", [1, 4])
def test_state_returned_by_name_inside_a_written_tuple(k):
    """`return (params, opt_state), loss`: the tuple written with the parameters' names is
    looked into, its items return positions of their own; the call returns the value nested
    as written, equal to a Python loop over jax.jit. Before, the two were broadcast: at
    num_steps=4 an OptionError (STATE_NESTED), at 1 plain outputs, not handles."""
    tx = optax.adam(0.1)

    def update(params, opt_state, x):
        loss, grads = jax.value_and_grad(lambda p: jnp.mean((x * p["w"] - 1.0) ** 2))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        if x.shape[0] > 8:  # a second return, nested alike
            return (params, opt_state), loss
        params = optax.apply_updates(params, updates)
        return (params, opt_state), loss

    params = {"w": jnp.zeros(3)}
    xs = jax.random.normal(jax.random.key(0), (8, 3))
    step = autoflat.step(update, num_steps=k)
    p, o = params, tx.init(params)
    losses = []
    for i in range(0, 8, k):
        (p, o), loss = step(p, o, xs[i : i + k] if k > 1 else xs[i])
        losses.append(np.atleast_1d(loss))
    ref = jax.jit(update)
    rp, ro, rl = params, tx.init(params), []
    for i in range(8):
        (rp, ro), loss = ref(rp, ro, xs[i])
        rl.append(loss)
    tree_allclose((p, o), (rp, ro), rtol=1e-6)
    np.testing.assert_allclose(np.concatenate(losses), rl, rtol=1e-6)
    assert isinstance(p, autoflat.LazyHandle) and isinstance(o, autoflat.LazyHandle)
    assert autoflat.stats(step).traces == 1
    text = autoflat.show(step)
    stacked = " (stacked)" if k > 1 else ""
    assert f"# returns: ((state params, state opt_state), output{stacked})" in text
    assert "# params: state (returned) [rule: returned-by-name]" in text
    assert (
        "return (_af_flatten(_af_spec, 0, params), _af_flatten(_af_spec, 1, opt_state)), (loss,)"
        in text
    )


def test_a_per_step_input_returned_by_name_as_it_came_is_asked_about():
    """`return w, w.sum(), x` with `x` per-step at num_steps=4: returned by name, `x` was state
    carried unchanged, so every step saw the whole chunk (w -10.2 where a jax.jit loop over
    the slices gives -1.8), silently. The body never changes it and its leading axis is
    num_steps: a ShapeError naming `per_step=` and `state=`, each then as it says."""

    def update(w, x):
        w = w - 0.1 * x.sum()
        return w, w.sum(), x

    xs = jnp.arange(8.0).reshape(4, 2)
    with pytest.raises(
        autoflat.ShapeError,
        match=r"`x` is returned by name \(return position 2\), which makes it state; the body "
        r"never changes it.*\n\n.*per_step=\"x\".*\n.*state=\"x\"",
    ):
        autoflat.step(update, num_steps=4)(jnp.ones(3), xs)
    w, sums, x = autoflat.step(update, num_steps=4, per_step="x")(jnp.ones(3), xs)
    rw = jnp.ones(3)
    for i in range(4):
        rw, _, _ = jax.jit(update)(rw, xs[i])
    np.testing.assert_allclose(w, rw, rtol=1e-6)
    np.testing.assert_array_equal(x, xs)  # the slices stacked
    w, _, x = autoflat.step(update, num_steps=4, state="x")(jnp.ones(3), xs)
    np.testing.assert_allclose(w, 1.0 - 4 * 0.1 * 28.0, rtol=1e-6)  # the whole chunk each step

    # Changed by the body, or not all of leading axis num_steps: state, as rule 2 says.
    def grown(w, x):
        x = x + w.sum()
        return w * 0.5, x

    w, x = autoflat.step(grown, num_steps=4)(jnp.ones(3), jnp.zeros((4, 2)))
    np.testing.assert_allclose(x, jnp.full((4, 2), 3.0 + 1.5 + 0.75 + 0.375))


def test_a_per_step_input_rebound_from_itself_alone_and_returned_is_asked_about():
    """`x = x * 0.5 + 1.0; return w - 0.1 * g, x, loss` with `x` per-step at num_steps=4:
    returned by name, `x` was state carried whole, so every step saw the whole chunk,
    transformed again every step, silently (both readings type-check). Bound again from
    itself alone, every array of leading axis num_steps: a ShapeError naming `per_step=` and
    `state=`, and `per_step=` equals the `jax.jit` loop. State computed from the step's
    per-step inputs or its other state (an RNN carry whose batch is num_steps, an ensemble
    of num_steps members trained on the batch) is carried as before."""

    def augmented(w, x):
        x = x * 0.5 + 1.0
        loss, g = jax.value_and_grad(lambda w: jnp.mean((x * w - 1.0) ** 2))(w)
        return w - 0.1 * g, x, loss

    w0, xs = jnp.ones(3), _batches(4, (3,))
    with pytest.raises(autoflat.ShapeError) as e:
        autoflat.step(augmented, num_steps=4)(w0, xs)
    message = str(e.value)
    assert "`x` is returned by name (return position 1), which makes it state, and the body " in (
        message
    )
    assert 'per_step="x"' in message and 'state="x"' in message
    got = autoflat.step(augmented, num_steps=4, per_step="x")(w0, xs)
    want, outs = w0, []
    for i in range(4):
        want, *out = jax.jit(augmented)(want, xs[i])
        outs.append(out)
    tree_allclose(got, (want, *(jnp.stack(o) for o in zip(*outs, strict=True))), rtol=1e-6)

    def rnn(wh, h, x):  # (a batch of 4 hidden states, 4 = num_steps)
        h = jnp.tanh(h @ wh + x)
        return wh * 0.99, h

    def ensemble(ws, x, y):  # (4 members, 4 = num_steps)
        g = jax.grad(lambda ws: jnp.mean((ws @ x - y) ** 2))(ws)
        ws = ws - 0.1 * g
        return ws

    h0, wh = jnp.zeros((4, 3)), jnp.eye(3) * 0.5
    xs3 = _batches(4, (4, 3), seed=1)
    got = autoflat.step(rnn, num_steps=4)(wh, h0, xs3)
    want = (wh, h0)
    for i in range(4):
        want = jax.jit(rnn)(*want, xs3[i])
    tree_allclose(got, want, rtol=1e-6)
    ws0, ys = jnp.ones((4, 3)), _batches(4, (4,), seed=2)
    got = autoflat.step(ensemble, num_steps=4)(ws0, _batches(4, (3,)), ys)
    want = ws0
    for i in range(4):
        want = jax.jit(ensemble)(want, _batches(4, (3,))[i], ys[i])
    tree_allclose(got, want, rtol=1e-6)

    def envs(w, keys, t, x):  # (4 environments' keys and step counters, 4 = num_steps)
        keys = jax.vmap(lambda k: jax.random.split(k)[0])(keys)
        t = t + 1
        return w - 0.1 * x, keys, t

    start = (jnp.ones(3), jax.random.split(jax.random.key(0), 4), jnp.zeros(4, jnp.int32))
    got = autoflat.step(envs, num_steps=4)(*start, xs)
    want = start
    for i in range(4):
        want = jax.jit(envs)(*want, xs[i])
    tree_allclose(
        (got[0], jax.random.key_data(got[1]), got[2]),
        (want[0], jax.random.key_data(want[1]), want[2]),
    )


def test_a_written_tuple_of_parameters_names_wins_over_an_argument_alike():
    """`return (params, ema), loss` beside a broadcast `teacher = (tp, te)` of the same trees,
    and `return (w, b), loss` beside `hp = (lr, wd)` of scalars like `w` and `b`: the
    written tuple was kept one position, so the teacher was carried as the new state and
    params and ema broadcast (silently wrong), or for `hp` an OptionError whose fixes went
    wrong. Every item a parameter's name: the names decide, as rule 2 comes before rule 3."""

    def distill(params, ema, teacher, x):
        tp, te = teacher
        g = jax.grad(lambda p: jnp.sum((p * x - 1.0) ** 2) + 0.1 * jnp.sum((p - tp) ** 2))(params)
        params = params - 0.1 * g
        ema = 0.9 * ema + 0.1 * params + 0.0 * te
        return (params, ema), jnp.sum(params)

    def fit(w, b, hp, x, y):
        lr, wd = hp
        loss, (gw, gb) = jax.value_and_grad(
            lambda w, b: jnp.mean((w * x + b - y) ** 2) + wd * w**2, argnums=(0, 1)
        )(w, b)
        w = w - lr * gw
        b = b - lr * gb
        return (w, b), loss

    xs = jax.random.normal(jax.random.key(0), (4, 3))
    (p, e), _ = autoflat.step(distill, num_steps=4)(
        jnp.ones(3), jnp.ones(3), (jnp.zeros(3), jnp.zeros(3)), xs
    )
    want = (jnp.ones(3), jnp.ones(3))
    for i in range(4):
        want, _ = jax.jit(distill)(*want, (jnp.zeros(3), jnp.zeros(3)), xs[i])
    tree_allclose((p, e), want, rtol=1e-6)

    xs, ys = jnp.linspace(-1, 1, 32).reshape(4, 8), jnp.linspace(-1, 3, 32).reshape(4, 8)
    hp = (jnp.float32(0.1), jnp.float32(0.01))
    (w, b), _ = autoflat.step(fit, num_steps=4)(jnp.float32(0), jnp.float32(0), hp, xs, ys)
    want = (jnp.float32(0), jnp.float32(0))
    for i in range(4):
        want, _ = jax.jit(fit)(*want, hp, xs[i], ys[i])
    tree_allclose((w, b), want, rtol=1e-6)


@pytest.mark.parametrize("container", ["namedtuple", "list"])
def test_a_carry_like_the_written_tuple_keeps_it_one_position(container):
    """`return w, (h, x)` beside a namedtuple or list carry `(h, prev_x)`: the written tuple
    names `x`, but the carry could be its new value, so it stays one position, and the carry
    given back as another container type is the OptionError that says to keep its type (for
    the namedtuple it was a ShapeError offering `per_step="x"`, which then ran silently
    wrong; the list carry was broadcast, every step restarting from it, silently: every
    leaf computed from it or made from the step's input is now evidence enough)."""
    Carry = collections.namedtuple("Carry", ["h", "prev_x"])

    def step(w, carry, x):
        h, prev_x = carry
        h = jnp.tanh(w * h + x - 0.5 * prev_x)
        return w - 0.01 * jnp.sum(h) * w, (h, x)

    carry = Carry(jnp.zeros(3), jnp.zeros(3))
    carry = carry if container == "namedtuple" else list(carry)
    with pytest.raises(autoflat.OptionError, match="give it back as it came in"):
        autoflat.step(step, num_steps=4)(jnp.ones(3), carry, jnp.ones((4, 3)))


def test_a_tuple_argument_spread_over_a_written_tuple_is_refused():
    """`return (params, mom, key), loss` beside `train_state = (params, mom)`: the written
    tuple is looked into (it names `key`), so no position gave `train_state` back whole; it
    was broadcast, each step restarting from it and params stacked, silently. An
    OptionError naming the tuple to write and `broadcast=`; the tuple written as it says
    equals a jax.jit loop."""

    def spread(train_state, key, x):
        params, mom = train_state
        key, sub = jax.random.split(key)
        g = jax.grad(lambda p: jnp.sum((p * x - 1.0) ** 2))(params)
        g = g + 0.01 * jax.random.normal(sub, (3,))
        mom = 0.9 * mom + g
        params = params - 0.1 * mom
        return (params, mom, key), jnp.sum(params)

    def grouped(train_state, key, x):
        (params, mom, key), loss = spread(train_state, key, x)
        return ((params, mom), key), loss

    state, key, xs = (jnp.ones(3), jnp.zeros(3)), jax.random.key(0), jnp.ones((4, 3))
    with pytest.raises(
        autoflat.OptionError,
        match=r"the items of `train_state` have the abstract values of return positions "
        r"`\[0\]\[0\]`, `\[0\]\[1\]`, inside the tuple written at `\[0\]`.*"
        r"`\(params, mom\)`(?s:.*)broadcast=\"train_state\"",
    ):
        autoflat.step(spread, num_steps=4)(state, key, xs)
    ((got, got_key), _) = autoflat.step(grouped, num_steps=4)(state, key, xs)
    ref = jax.jit(grouped)
    want, want_key = state, key
    for i in range(4):
        (want, want_key), _ = ref(want, want_key, xs[i])
    tree_allclose(got, want, rtol=1e-6)
    np.testing.assert_array_equal(jax.random.key_data(got_key), jax.random.key_data(want_key))


def test_a_written_tuple_naming_state_beside_a_new_name_wins_over_an_argument_alike():
    """`return (params, new_ema), loss` beside a broadcast teacher pair `(tp, te)` of the
    same shapes: the written tuple was kept one position and the teacher carried as the new
    state (params stacked, silently). A parameter named there that does not look per-step
    makes the names decide; `ema` is matched at its place."""

    def step(params, ema, teacher, x, y):
        tp, _ = teacher
        loss, g = jax.value_and_grad(
            lambda p: jnp.mean((x @ p - y) ** 2) + 0.1 * jnp.mean((x @ p - x @ tp) ** 2)
        )(params)
        params = params - 0.05 * g
        new_ema = 0.9 * ema + 0.1 * params
        return (params, new_ema), loss

    p0, teacher = jnp.full(3, 0.1), (jnp.full(3, 0.4), jnp.full(3, -0.2))
    xs = jax.random.normal(jax.random.key(0), (4, 5, 3))
    ys = jax.random.normal(jax.random.key(1), (4, 5))
    (p, e), _ = autoflat.step(step, num_steps=4)(p0, p0, teacher, xs, ys)
    want = (p0, p0)
    for i in range(4):
        want, _ = jax.jit(step)(*want, teacher, xs[i], ys[i])
    tree_allclose((p, e), want, rtol=1e-6)


def test_an_array_whose_new_value_is_nested_in_an_output_is_refused():
    """`return (params, opt_state), (new_mu, new_var), loss` with `mu` and `var` arrays: a
    bare array matches only at its place, so the two were broadcast, every step normalising
    by the first statistics, and the stacked outputs failed the next call (an unclear
    TypeError). An array whose same-shaped leaf inside an output is computed from it (not
    through reductions alone) is STATE_NESTED, naming its own position, its name in a
    written tuple, and broadcast=; written so, equal to a jax.jit loop."""
    tx = optax.sgd(0.1)

    def nested(params, opt_state, mu, var, x, y):
        new_mu = 0.9 * mu + 0.1 * x.mean(0)
        new_var = 0.9 * var + 0.1 * x.var(0)
        xn = (x - new_mu) / jnp.sqrt(new_var + 1e-5)
        loss, g = jax.value_and_grad(lambda p: jnp.mean((xn @ p - y) ** 2))(params)
        u, opt_state = tx.update(g, opt_state, params)
        return (optax.apply_updates(params, u), opt_state), (new_mu, new_var), loss

    def named(params, opt_state, mu, var, x, y):
        (params, opt_state), (mu, var), loss = nested(params, opt_state, mu, var, x, y)
        return (params, opt_state), (mu, var), loss

    p0, stats = jnp.ones(3), (jnp.zeros(3), jnp.ones(3))
    xs = jax.random.normal(jax.random.key(0), (4, 5, 3)) + 1
    ys = jnp.ones((4, 5))
    with pytest.raises(
        autoflat.OptionError,
        match=r"(?s)`mu` comes back inside return position 2, at `\[2\]\[0\]`.*"
        r"broadcast=\"mu\"",
    ):
        autoflat.step(nested, num_steps=4)(p0, tx.init(p0), *stats, xs, ys)
    (p, o), (mu, var), _ = autoflat.step(named, num_steps=4)(p0, tx.init(p0), *stats, xs, ys)
    want = (p0, tx.init(p0)), stats
    for i in range(4):
        *want, _ = jax.jit(named)(*want[0], *want[1], xs[i], ys[i])
    tree_allclose(((p, o), (mu, var)), tuple(want), rtol=1e-6)


def test_state_inside_a_tuple_written_without_its_name_is_refused_at_k_steps():
    """`return (new_params, new_opt_state), loss`: no parameter's name in the written tuple,
    so it is one position; the two would be broadcast and at num_steps=4 every step would
    restart from the params passed in, silently (losses [1, 1, 1, 1]). An OptionError naming
    both fixes; at num_steps=1 the call is right (the values come back as outputs), as under
    jax.jit."""
    tx = optax.adam(0.1)

    def update(params, opt_state, x):
        loss, grads = jax.value_and_grad(lambda p: jnp.mean((x * p["w"] - 1.0) ** 2))(params)
        updates, new_opt_state = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        return (new_params, new_opt_state), loss

    params = {"w": jnp.zeros(3)}
    step = autoflat.step(update, num_steps=4)
    with pytest.raises(
        autoflat.OptionError,
        match=r"(?s)`params` comes back inside return position 0, at `\[0\]\[0\]`.*"
        r"return params, \.\.\.\n    return \(params, \.\.\.\), \.\.\.",
    ):
        step(params, tx.init(params), jnp.ones((4, 3)))
    np.testing.assert_allclose(params["w"], 0.0)  # still usable
    (p, _), loss = autoflat.step(update)(params, tx.init(params), jnp.ones(3))
    (rp, _), rloss = jax.jit(update)(params, tx.init(params), jnp.ones(3))
    tree_allclose(p, rp)


@pytest.mark.parametrize("k", [1, 4])
def test_keyword_only_parameters(k):
    """`def update(params, opt_state, *, x, y, num_classes)`: the first call's evaluation
    passed every argument by position (a TypeError, or at k=4 a misleading leading-axis
    error)."""
    tx = optax.sgd(0.1)

    def update(params, opt_state, *, x, y, num_classes):
        def loss_fn(p):
            logits = x @ p["w"] + p["b"]
            return -jnp.mean(jnp.sum(jax.nn.one_hot(y, num_classes) * logits, axis=-1))

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    params = {"w": jnp.zeros((3, 4)), "b": jnp.zeros(4)}
    xs = jax.random.normal(jax.random.key(0), (k, 5, 3))
    ys = jnp.arange(k * 5).reshape(k, 5) % 4
    step = autoflat.step(update, num_steps=k)
    if k == 1:
        p, o, losses = step(params, tx.init(params), x=xs[0], y=ys[0], num_classes=4)
    else:
        p, o, losses = step(params, tx.init(params), x=xs, y=ys, num_classes=4)
    ref = jax.jit(update, static_argnames="num_classes")
    rp, ro, rl = params, tx.init(params), []
    for i in range(k):
        rp, ro, loss = ref(rp, ro, x=xs[i], y=ys[i], num_classes=4)
        rl.append(loss)
    tree_allclose(p, rp)
    np.testing.assert_allclose(losses, rl[0] if k == 1 else rl, rtol=1e-5)


def _adam_update(params, opt_state, x):
    """A helper returning the step's whole result, as `return update(...)` steps call."""
    tx = optax.adam(0.1)
    loss, grads = jax.value_and_grad(lambda p: jnp.mean((x * p["w"] - 1.0) ** 2))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def _returns_a_call(params, opt_state, x):
    return _adam_update(params, opt_state, x)


def _returns_a_local(params, opt_state, x):
    result = _adam_update(params, opt_state, x)
    return result


@pytest.mark.parametrize("k", [1, K])
@pytest.mark.parametrize("fn", [_returns_a_call, _returns_a_local])
@pytest.mark.parametrize("declared", [None, "names", "positions"])
def test_a_return_of_one_call_that_gives_a_tuple(fn, declared, k):
    """`return update(params, opt_state, x)`: one expression whose value is the tuple. At
    num_steps=4 it was refused (`params` comes back inside return position 0) and at 1 the
    state was a per-step input, copied in and out on every call; `state={"params": 0,
    "opt_state": 1}` raised a misleading error. Its items are now the return positions."""
    options = {
        None: {},
        "names": {"state": ["params", "opt_state"]},
        "positions": {"state": {"params": 0, "opt_state": 1}},
    }[declared]
    params = {"w": jnp.zeros(3)}
    xs = _batches(8)
    (rp, rs), routs = _reference(fn, (params, optax.adam(0.1).init(params)), [xs], 8)
    step = autoflat.step(fn, num_steps=k, **options)
    (p, s), outs = _run(step, (params, optax.adam(0.1).init(params)), [xs], 8, k)
    assert isinstance(p, autoflat.LazyHandle) and isinstance(s, autoflat.LazyHandle)
    tree_allclose((p, s), (rp, rs))
    losses = jnp.concatenate([jnp.atleast_1d(o[0]) for o in outs])
    np.testing.assert_allclose(losses, jnp.stack([o[0] for o in routs]), rtol=1e-6)
    assert autoflat.stats(step).traces == 1
    shown = autoflat.show(step)
    how = "state= at" if declared == "positions" else "matched by value to"
    assert f"# params: state ({how} return position 0)" in shown
    assert f"# opt_state: state ({how} return position 1)" in shown
    assert "# returns: state params, state opt_state, output" in shown
    line = "return _adam_update(params, opt_state, x)" if fn is _returns_a_call else "return result"
    value = line.removeprefix("return ")
    indent = " " * (12 if k > 1 else 8)
    assert (
        f"{indent}_af_ret0, _af_ret1, _af_ret2 = {value}\n"
        f"{indent}return (_af_flatten(_af_spec, 0, _af_ret0), _af_flatten(_af_spec, 1, _af_ret1)),"
        " (_af_ret2,)\n"
    ) in shown


class _OptStep(NamedTuple):  # jaxopt's `base.OptStep`
    params: Any
    state: Any


def _solver_update(params, state, x):
    g = jax.grad(lambda p: jnp.sum((p - x) ** 2))(params)
    return _OptStep(params=params - 0.1 * g, state=state + 1)


def _returns_an_opt_step(params, state, x):
    return _solver_update(params, state, x)


@pytest.mark.parametrize("k", [1, 4])
def test_a_named_tuple_returned_whole_has_its_items_as_positions(k):
    """A step returning a NamedTuple (a jaxopt solver's `update` returns `OptStep(params,
    state)`): its items are the return positions, as a plain tuple's, and the call returns
    the same NamedTuple class (it was an `OptionError` at num_steps=4)."""
    xs = jnp.arange(12.0).reshape(4, 3)
    p, s = jnp.zeros(3), jnp.asarray(0)
    for i in range(4):
        p, s = jax.jit(_returns_an_opt_step)(p, s, xs[i])
    step = autoflat.step(_returns_an_opt_step, num_steps=k)
    got = (jnp.zeros(3), jnp.asarray(0))
    for i in range(0, 4, k):
        got = step(*got, xs[i] if k == 1 else xs[i : i + k])
        assert type(got) is _OptStep
    tree_allclose(tuple(got), (p, s))
    if k > 1:  # (at one step a call, as under `jax.jit`, nothing needs carrying)
        assert "_af_ret0, _af_ret1 = _solver_update(params, state, x)" in autoflat.show(step)


def test_a_return_of_one_call_whose_tuple_holds_no_state_is_one_output():
    """A tuple of outputs only (`return metrics(...)`) stays one output, as before."""

    def update(x):
        return jnp.sum(x), jnp.mean(x)

    def step_fn(params, x):
        return update(x * params["w"])

    step = autoflat.step(step_fn, num_steps=K)
    total, mean = step({"w": jnp.ones(3)}, jnp.ones((K, 3)))
    np.testing.assert_allclose(total, [3.0] * K)
    assert "# returns: output (stacked)" in autoflat.show(step)


@pytest.mark.parametrize("k", [1, K])
def test_state_positions_that_the_return_does_not_have(k):
    """`state={"opt_state": 2}` beside `return params, loss`, and `state={"params": 0}` beside
    `return (new_params, new_opt_state), loss`: clear errors before anything runs (the second trained
    at num_steps=1 with `params` given the pair, and at 4 raised a structure error)."""
    tx = optax.adam(0.1)

    def nested(params, opt_state, x):
        new_params, new_opt_state, loss = _adam_update(params, opt_state, x)
        return (new_params, new_opt_state), loss

    def two(params, opt_state, x):
        params, opt_state, loss = _adam_update(params, opt_state, x)
        return params, loss

    params = {"w": jnp.zeros(3)}
    x = jnp.ones((k, 3)) if k > 1 else jnp.ones(3)
    step = autoflat.step(two, num_steps=k, state={"opt_state": 2})
    with pytest.raises(
        autoflat.OptionError,
        match=r"state= says `opt_state` comes back at return position 2, but the step returns "
        r"2 values \(line \d+ returns \(params, loss\)\); positions count from 0",
    ):
        step(params, tx.init(params), x)
    step = autoflat.step(nested, num_steps=k, state={"params": 0, "opt_state": 1})
    with pytest.raises(
        autoflat.OptionError,
        match=r"state= says `params` comes back at return position 0, but its new value is "
        r"inside that position, at `\[0\]\[0\]`",
    ):
        step(params, tx.init(params), x)
    np.testing.assert_allclose(params["w"], 0.0)  # still usable


@pytest.mark.parametrize("k", [1, K])
def test_a_state_position_holding_a_bare_array_inside_it(k):
    """`state={"p": 0}` beside `return (new_p, new_s), loss` with `p` one array: the Roles page
    calls it an OptionError before anything runs, as for a dict `p`; it was a ShapeError at
    num_steps=2 about the state's structure (and at num_steps=1 ran, giving `p` the pair)."""
    tx = optax.sgd(0.1)

    def update(p, opt_state, x):
        loss, g = jax.value_and_grad(lambda w: jnp.sum((w * x - 1.0) ** 2))(p)
        u, new_s = tx.update(g, opt_state, p)
        return (optax.apply_updates(p, u), new_s), loss

    p = jnp.ones(3)
    x = jnp.ones((k, 3)) if k > 1 else jnp.ones(3)
    step = autoflat.step(update, num_steps=k, state={"p": 0})
    with pytest.raises(
        autoflat.OptionError,
        match=r"state= says `p` comes back at return position 0, but its new value is inside "
        r"that position, at `\[0\]\[0\]`",
    ):
        step(p, tx.init(p), x)
    np.testing.assert_allclose(p, 1.0)  # still usable
    assert autoflat.stats(step).traces == 0


@pytest.mark.parametrize("make_key", [jax.random.key, jax.random.PRNGKey])
def test_a_carried_key_returned_at_another_position(make_key):
    """`return params, opt_state, loss, new_dropout_rng` (Hugging Face's Flax steps carry their
    dropout key so, after the metrics): a bare array was matched only at its own place among
    the parameters, so the key was broadcast. Every step of a call used the same key, and the
    next call, given the stacked keys, raised JAX's "split accepts a single key". A key is
    matched where no other parameter fits."""
    tx = optax.sgd(0.1)

    def update(params, opt_state, x, dropout_rng):
        dropout_rng, new_dropout_rng = jax.random.split(dropout_rng)

        def loss_fn(p):
            keep = jax.random.bernoulli(dropout_rng, 0.5, x.shape)
            return jnp.mean((x * keep * p["w"] - 1.0) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, new_dropout_rng

    params = {"w": jnp.ones(3)}
    xs = _batches(8)
    ref = jax.jit(update)
    rp, rs, rkey, rlosses = params, tx.init(params), make_key(0), []
    for i in range(8):
        rp, rs, loss, rkey = ref(rp, rs, xs[i], rkey)
        rlosses.append(loss)
    step = autoflat.step(update, num_steps=K)
    p, s, key, losses = params, tx.init(params), make_key(0), []
    for start in (0, K):
        p, s, loss, key = step(p, s, xs[start : start + K], key)
        losses.append(loss)
    np.testing.assert_allclose(jnp.concatenate(losses), jnp.stack(rlosses), rtol=1e-6)
    tree_allclose(p, rp)
    np.testing.assert_array_equal(jax.random.key_data(key), jax.random.key_data(rkey))
    assert "# dropout_rng: state (matched by value to return position 3)" in autoflat.show(step)


def test_a_reused_key_beside_a_carried_one_stays_broadcast():
    """Two keys, one returned at its own place: the other (an evaluation key used every step)
    is not taken for it."""

    def update(params, key, eval_key, x):
        new_key, sub = jax.random.split(key)
        noise = jax.random.normal(sub, x.shape) + jax.random.normal(eval_key, x.shape)
        return params + jnp.mean(x + noise), new_key, jnp.sum(params)

    step = autoflat.step(update, num_steps=K)
    params, key, loss = step(jnp.zeros(()), jax.random.key(0), jax.random.key(1), _batches(K))
    shown = autoflat.show(step)
    assert "# key: state (matched by value and data flow to return position 1)" in shown
    assert "# eval_key: broadcast (no leading axis of num_steps=4 at the first call)" in shown


def test_a_python_counter_given_back_changed_is_carried():
    """`return w, step + 1, lr` with `step=0` a Python int (a counter for a schedule): at
    num_steps=4 it was static, as Python numbers are, so every step of a call saw 0 (learning
    rates 0.1 0.1 0.1 0.1, then 0.05 x4 from the stacked counters), silently. A Python number
    given back changed at its place is carried, as an array. One whose place holds an array
    (a loss, for a `num_classes`) stays static."""

    def update(w, step, x):
        lr = 0.1 / (1.0 + step)
        return w - lr * jnp.mean(x) * w, step + 1, lr

    def decay(w, lr, x):
        return w - lr * jnp.mean(x) * w, lr * 0.5, jnp.sum(w)

    xs = jnp.arange(1.0, 9.0).reshape(8, 1)
    for fn, start in ((update, 0), (decay, 0.1)):
        ref = jax.jit(fn)
        w, s, ref_outs = jnp.ones(2), start, []
        for x in xs:
            w, s, out = ref(w, s, x)
            ref_outs.append(out)
        step = autoflat.step(fn, num_steps=K)
        w2, s2, outs = jnp.ones(2), start, []
        for c in range(2):
            w2, s2, out = step(w2, s2, xs[K * c : K * (c + 1)])
            outs.append(out)
            if c == 0:
                name = fn.__code__.co_varnames[1]
                kind = type(start).__name__
                assert (
                    f"# {name}: state (a Python {kind} that return position 1 gives back "
                    "changed: carried as an array)" in autoflat.show(step)
                )
        np.testing.assert_allclose(jnp.concatenate(outs), jnp.stack(ref_outs), rtol=1e-6)
        np.testing.assert_allclose(w2, w, rtol=1e-6)
        np.testing.assert_allclose(s2, s, rtol=1e-6)

    def classify(w, num_classes, x):
        loss = -jnp.mean(jax.nn.one_hot(jnp.argmax(x @ w, -1), num_classes) * (x @ w))
        return w - 0.1 * loss, loss

    step = autoflat.step(classify, num_steps=K)
    step(jnp.ones((3, 4)), 4, jnp.ones((K, 2, 3)))
    assert "# num_classes: static (a Python int, static as in eqx.filter_jit)" in autoflat.show(
        step
    )


def test_state_inside_a_returned_dict_is_named_where_it_is():
    """`return {"ema": ..., "params": ..., "loss": ...}` for a step taking `params` only, and
    another taking `params` inside a tuple: the dict's values are its return positions, and
    `params` is the one computed from it whose key is its name (the "ema" alike is a per-step
    output). The nested-state error names `params`'s own key, not the first subtree alike."""

    def update(params, x):
        new = {"w": params["w"] - 0.1 * x}
        return {"ema": {"w": 0.5 * new["w"]}, "params": new, "loss": jnp.sum(x)}

    step = autoflat.step(update, num_steps=K)
    out = step({"w": jnp.ones(3)}, jnp.ones((K, 3)))
    np.testing.assert_allclose(out["params"]["w"], [1.0 - 0.1 * K] * 3, rtol=1e-6)
    assert out["ema"]["w"].shape == (K, 3)
    assert "# params: state (matched by value and data flow to return key 'params')" in (
        autoflat.show(step)
    )

    def nested(params, x):
        new = {"w": params["w"] - 0.1 * x}
        return ({"ema": {"w": 0.5 * new["w"]}, "params": new}, jnp.sum(x))

    step = autoflat.step(nested, num_steps=K)
    with pytest.raises(autoflat.OptionError, match=r"at `\[0\]\['params'\]`, not at a position"):
        step({"w": jnp.ones(3)}, jnp.ones((K, 3)))


@pytest.mark.parametrize("k", [1, K])
def test_a_returned_dict_has_its_values_as_return_positions(k):
    """`return {"params": ..., "opt_state": ..., "step": step + 1, "loss": ...}`: refused at
    num_steps=4 (state inside return position 0), and at 1 the state was a per-step input.
    The dict's values are the return positions: state matched by value (a bare array or a
    Python counter by the key that is its name), the call returns the dict (keys sorted, as
    `jax.jit` returns it), and a later trace giving other keys raises a ShapeError."""
    tx = optax.adam(0.1)

    def train_step(params, opt_state, step, x):
        loss, grads = jax.value_and_grad(lambda p: jnp.mean((x[:3] * p["w"] - 1.0) ** 2))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        lr_scale = 1.0 / (1.0 + step)
        params = jax.tree.map(lambda p, u: p + lr_scale * u, params, updates)
        if x.shape[-1] == 5:
            return {"params": params, "opt_state": opt_state, "step": step + 1}
        return {"params": params, "opt_state": opt_state, "step": step + 1, "loss": loss}

    params = {"w": jnp.zeros(3)}
    xs = _batches(8)
    ref = jax.jit(train_step)
    out = {"params": params, "opt_state": tx.init(params), "step": 0}
    ref_losses = []
    for i in range(8):
        out = ref(out["params"], out["opt_state"], out["step"], xs[i])
        ref_losses.append(out["loss"])
    step = autoflat.step(train_step, num_steps=k)
    got = {"params": params, "opt_state": tx.init(params), "step": 0}
    losses = []
    for start in range(0, 8, k):
        x = xs[start : start + k] if k > 1 else xs[start]
        got = step(got["params"], got["opt_state"], got["step"], x)
        losses.append(jnp.atleast_1d(got["loss"]))
    assert list(got) == ["loss", "opt_state", "params", "step"]
    np.testing.assert_allclose(jnp.concatenate(losses), jnp.stack(ref_losses), rtol=1e-6)
    tree_allclose(got["params"], out["params"])
    assert int(got["step"]) == int(out["step"]) == 8
    shown = autoflat.show(step)
    assert "# params: state (matched by value to return key 'params')" in shown
    assert "# returns: 'loss': output" in shown
    assert "_af_ret0, _af_ret1, _af_ret2, _af_ret3 = _af_items(" in shown
    assert "('loss', 'opt_state', 'params', 'step'))" in shown
    before = got["params"]
    bad = jnp.ones((k, 5)) if k > 1 else jnp.ones(5)
    with pytest.raises(autoflat.ShapeError, match=r"where its first call returned a dict with"):
        step(got["params"], got["opt_state"], got["step"], bad)
    np.testing.assert_allclose(autoflat.unwrap(before)["w"], out["params"]["w"], rtol=1e-6)


@pytest.mark.parametrize("how", ["method", "module"])
def test_a_method_steps_array_state_is_matched_at_its_own_place(how):
    """`def step(self, w, x): return w - self.lr * g, loss` with `w` one array: the instance
    counted among the parameters that could be state, so `w` was looked for at return
    position 1 (the loss), left broadcast, and every step of a call restarted from the `w`
    passed in, silently. Also for an Equinox module passed as the step (`autoflat.step(
    stepper)`, as `eqx.filter_jit(stepper)`: it was refused as having no source)."""
    eqx = pytest.importorskip("equinox")

    class Trainer:
        lr = 0.1

        def step(self, w, x):
            loss, g = jax.value_and_grad(lambda w: jnp.sum((w * x - 1.0) ** 2))(w)
            return w - self.lr * g, loss

    class Stepper(eqx.Module):
        lr: float = eqx.field(static=True)

        def __call__(self, w, x):
            loss, g = jax.value_and_grad(lambda w: jnp.sum((w * x - 1.0) ** 2))(w)
            return w - self.lr * g, loss

    fn = Trainer().step if how == "method" else Stepper(0.1)
    xs = _batches(8)
    ref = jax.jit(fn)
    w, ref_losses = jnp.zeros(3), []
    for x in xs:
        w, loss = ref(w, x)
        ref_losses.append(loss)
    step = autoflat.step(fn, num_steps=K)
    w2, losses = jnp.zeros(3), []
    for start in (0, K):
        w2, loss = step(w2, xs[start : start + K])
        losses.append(loss)
    np.testing.assert_allclose(jnp.concatenate(losses), jnp.stack(ref_losses), rtol=1e-6)
    np.testing.assert_allclose(w2, w, rtol=1e-6)
    assert "# w: state (matched by value to return position 0)" in autoflat.show(step)


@pytest.mark.parametrize("kind", ["flax.struct", "equinox", "equinox bound"])
def test_a_method_step_that_gives_back_a_new_self_carries_it(kind):
    """A pytree agent whose method returns the new agent (`return self.replace(w=w), info`,
    jaxrl_m's pattern, with flax.struct or Equinox): `self` was broadcast, so at num_steps=4
    every step restarted from the agent passed in (losses 0 .2 .4 .6 against 0 .2 .58 1.12)
    and the new agents came back stacked, silently. The instance is matched by value, as any
    parameter. `autoflat.step(agent.update)` on an Equinox module (bound by Equinox's
    `BoundMethod`) was refused as a wrapper."""
    if kind == "flax.struct":
        struct = pytest.importorskip("flax.struct")

        class Agent(struct.PyTreeNode):
            w: jax.Array

            def update(self, x):
                w = self.w - 0.1 * (self.w - x)
                return self.replace(w=w), {"loss": jnp.sum(w)}

    else:
        eqx = pytest.importorskip("equinox")

        class Agent(eqx.Module):  # type: ignore[no-redef]
            w: jax.Array

            def update(self, x):
                w = self.w - 0.1 * (self.w - x)
                return eqx.tree_at(lambda a: a.w, self, w), {"loss": jnp.sum(w)}

    xs = jnp.arange(8.0)[:, None] * jnp.ones((8, 2))
    ref = jax.jit(type(Agent(jnp.zeros(2))).update)
    a, ref_losses = Agent(jnp.zeros(2)), []
    for x in xs:
        a, info = ref(a, x)
        ref_losses.append(info["loss"])
    for k in (1, K):
        b, losses = Agent(jnp.zeros(2)), []
        step = None if kind == "equinox bound" else autoflat.step(Agent.update, num_steps=k)
        for start in range(0, 8, k):
            x = xs[start : start + k] if k > 1 else xs[start]
            if step is None:
                b, info = autoflat.step(b.update, num_steps=k)(x)
            else:
                b, info = step(b, x)
            losses.append(jnp.atleast_1d(info["loss"]))
        np.testing.assert_allclose(jnp.concatenate(losses), jnp.stack(ref_losses), rtol=1e-6)
        np.testing.assert_allclose(b.w, a.w, rtol=1e-6)
        if step is not None:
            assert "# self: state (matched by value to return position 0)" in autoflat.show(step)


def test_a_scalar_argument_at_the_losss_place_is_not_taken_for_state():
    """`train_step(params, opt_state, x, lr)` returning `params, opt_state, loss` with `lr` a
    float32 array: `lr` ranks third among the parameters that could be state, as the loss
    does among the returns, so it was matched to the loss; at num_steps=4 every step trained
    with the previous loss as its learning rate and the losses were lost (w -0.72 against
    0.04 after one call), silently. A bare array at its place is state only where more
    agrees: the last operation takes its array (also inside a jitted helper, whose
    operations are walked into), the returned name shares a word with it (`prev_loss`
    overwritten by `loss`), or the return is an expression computed from it (`0.9 * v + g`).
    Else an OptionError asks, `lr` and a loss with `wd * l2` alike."""
    tx = optax.scale_by_adam()

    def train_step(params, opt_state, x, lr):
        loss, g = jax.value_and_grad(lambda p: jnp.mean((x @ p["w"] - 1.0) ** 2))(params)
        u, opt_state = tx.update(g, opt_state, params)
        params = jax.tree.map(lambda p, u: p - lr * u, params, u)
        return params, opt_state, loss

    def decayed(params, opt_state, x, wd):
        def loss_fn(p):
            return jnp.mean((x @ p["w"] - 1.0) ** 2) + wd * jnp.sum(p["w"] ** 2)

        loss, g = jax.value_and_grad(loss_fn)(params)
        u, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, u), opt_state, loss

    @jax.jit
    def inner(w, x, lr):  # a jitted helper taking lr: one operation outside
        loss, g = jax.value_and_grad(lambda w: jnp.sum((w * x - 1.0) ** 2))(w)
        return w - lr * g, loss

    def helper(w, x, lr):
        w, loss = inner(w, x, lr)
        return w, loss

    def momentum(w, v, x):
        loss, g = jax.value_and_grad(lambda w: jnp.sum((w * x - 1.0) ** 2))(w)
        return w - 0.1 * (0.9 * v + g), 0.9 * v + g, loss

    def adaptive(w, prev_loss, x):
        loss, g = jax.value_and_grad(lambda w: jnp.sum((w * x - 1.0) ** 2))(w)
        lr = jnp.where(loss < prev_loss, 0.1, 0.01)
        return w - lr * g, loss

    p0 = {"w": jnp.zeros(3)}
    xs = _batches(8, (8, 3))
    lr = jnp.float32(0.01)
    with pytest.raises(
        autoflat.OptionError, match=r"return position 2 \(`loss`, not computed from `lr`\)"
    ):
        autoflat.step(train_step, num_steps=K)(p0, tx.init(p0), xs[:K], lr)
    with pytest.raises(
        autoflat.OptionError, match=r"return position 2 \(`loss`, computed from `wd`\)"
    ):
        autoflat.step(decayed, num_steps=K)(p0, tx.init(p0), xs[:K], jnp.float32(1e-3))
    with pytest.raises(autoflat.OptionError, match=r"\(`loss`, not computed from `lr`\)"):
        autoflat.step(helper, num_steps=K)(jnp.zeros(3), _batches(K), lr)
    for fn, hyper in ((train_step, lr), (decayed, jnp.float32(1e-3))):
        name = fn.__code__.co_varnames[3]
        state, ref = _reference(fn, (p0, tx.init(p0)), (xs,), 8, (hyper,))
        step = autoflat.step(fn, num_steps=K, broadcast=name)
        got, outs = _run(step, (p0, tx.init(p0)), (xs,), 8, K, (hyper,))
        tree_allclose(got, state, rtol=1e-6)
        tree_allclose(jnp.concatenate([o[0] for o in outs]), jnp.stack([o[0] for o in ref]))

    for fn, start, name in (
        (momentum, jnp.zeros(3), "v"),
        (adaptive, jnp.float32(jnp.inf), "prev_loss"),
    ):
        state, _ = _reference(fn, (jnp.zeros(3), start), (_batches(8),), 8)
        step = autoflat.step(fn, num_steps=K)
        got, _ = _run(step, (jnp.zeros(3), start), (_batches(8),), 8, K)
        assert f"# {name}: state (matched by value to return position 1)" in autoflat.show(step)
        tree_allclose(got, state, rtol=1e-6)


def test_a_default_never_passed_is_broadcast():
    """`def step(p, x, *, class_weights=W)` with W of length 4 = num_steps, never passed: it
    was taken as per-step (its first axis is num_steps) and sliced, a raw IndexError or wrong
    outputs ([1, 2, 3, 4] for [10, 10, 10, 10]). A default the call does not pass is the same
    every step, as under jax.jit."""
    weights = jnp.array([1.0, 2.0, 3.0, 4.0])

    def update(p, x, *, class_weights=weights):
        p = p - 0.1 * jnp.sum(class_weights * x)
        return p, jnp.sum(class_weights)

    step = autoflat.step(update, num_steps=K)
    p, totals = step(jnp.float32(0.0), jnp.ones((K, 4)))
    np.testing.assert_allclose(totals, [10.0] * K)
    np.testing.assert_allclose(p, -1.0 * K, rtol=1e-6)  # 0.1 * (1 + 2 + 3 + 4) a step
    assert "# class_weights: broadcast (its default value, the same every step)" in (
        autoflat.show(step)
    )


def test_the_learning_rate_question_offers_the_fixes_that_fit():
    """The FAQ's `train_step(params, opt_state, batch, lr)` returning `params, opt_state, loss`
    at num_steps=2, `lr` an array: the error offered `state={"lr": 2}` as the fix (carrying
    the loss as the next rate) and said "the step does not return its state by name",
    although it returns `params` and `opt_state` by name. It offers `broadcast="lr"` and a
    Python float, as the FAQ says, and `state=` only for a value the step overwrites; both
    fixes it offers first train as `jax.jit` does."""
    tx = optax.scale_by_adam()

    def train_step(params, opt_state, batch, lr):
        loss, g = jax.value_and_grad(lambda p: jnp.mean((batch @ p["w"] - 1.0) ** 2))(params)
        updates, opt_state = tx.update(g, opt_state, params)
        params = jax.tree.map(lambda p, u: p - lr * u, params, updates)
        return params, opt_state, loss

    p0 = {"w": jnp.zeros(3)}
    xs = _batches(4, (8, 3))
    with pytest.raises(autoflat.OptionError) as info:
        autoflat.step(train_step, num_steps=2)(p0, tx.init(p0), xs[:2], jnp.float32(0.01))
    message = str(info.value)
    assert "return position 2 (`loss`, not computed from `lr`) could be the new value of `lr`" in (
        message
    )
    assert "does not return its state by name" not in message
    fixes = message.index('broadcast="lr"'), message.index("Python float")
    carried = message.index('state={"lr": 2}')
    assert max(fixes) < carried  # the fixes that fit come first
    assert "Only if each step's `lr` is what return position 2 gave back" in message
    state, ref = _reference(train_step, (p0, tx.init(p0)), (xs,), 4, (jnp.float32(0.01),))
    for step, lr in (
        (autoflat.step(train_step, num_steps=2, broadcast="lr"), jnp.float32(0.01)),
        (autoflat.step(train_step, num_steps=2), 0.01),
    ):
        got, outs = _run(step, (p0, tx.init(p0)), (xs,), 4, 2, (lr,))
        tree_allclose(got, state, rtol=1e-6)
        np.testing.assert_allclose(
            jnp.concatenate([o[0] for o in outs]), jnp.stack([o[0] for o in ref]), rtol=1e-6
        )


def test_the_ambiguity_error_says_whether_state_is_returned_by_name():
    """Two parameters alike beside one returned by name: the error does not claim the step
    returns no state by name; with none returned by name, it says so."""

    def beside(params, a, b, x):
        c = {"w": a["w"] + b["w"] + x}
        d = {"w": a["w"] - b["w"]}
        return params, c, d

    def alone(a, b, x):
        c = {"w": a["w"] + b["w"] + x}
        d = {"w": a["w"] - b["w"]}
        return c, d

    w = {"w": jnp.ones(3)}
    with pytest.raises(autoflat.OptionError, match="could each be the new value") as info:
        autoflat.step(beside, num_steps=2)(jnp.ones(5), w, w, jnp.ones((2, 3)))
    assert "does not return its state by name" not in str(info.value)
    with pytest.raises(autoflat.OptionError, match="does not return its state by name"):
        autoflat.step(alone, num_steps=2)(w, w, jnp.ones((2, 3)))


@pytest.mark.parametrize("k", [1, K])
def test_state_returned_by_name_in_one_branch_and_as_a_new_name_in_another(k):
    """`return p, s, loss` in an early branch and `return new_p, new_s, loss` at the end: it
    was a SourceError ("the returns disagree"), even with state= given. Matched by value."""

    def update(p, s, x, flag=False):
        loss = jnp.sum(p * x)
        if flag:
            s = s + 1
            return p - 0.1 * x, s, loss
        new_p = p - 0.2 * x
        new_s = s + 1
        return new_p, new_s, loss

    xs = _batches(8)
    (rp, rs), routs = _reference(update, (jnp.ones(3), jnp.zeros(())), [xs], 8)
    step = autoflat.step(update, num_steps=k)
    (p, s), outs = _run(step, (jnp.ones(3), jnp.zeros(())), [xs], 8, k)
    np.testing.assert_allclose(p, rp, rtol=1e-6)
    np.testing.assert_allclose(s, 8.0)
    shown = autoflat.show(step)
    if k > 1:
        assert "# p: state (matched by value to return position 0)" in shown
    assert (
        "# s: state (matched by value to return position 1, returned by name there in some "
        "returns) [rule: matched-by-value]"
    ) in shown

    def scaled(scale, w, x, frozen=False):  # `w` named at position 0, not at its rank (1)
        if frozen:
            return w, jnp.sum(x)
        loss, g = jax.value_and_grad(lambda w: jnp.sum((w * x - 1.0) ** 2))(w)
        return w - scale * g, loss

    ref = jax.jit(scaled, static_argnames="frozen")
    rw = jnp.zeros(3)
    for i in range(8):
        rw, _ = ref(0.1, rw, xs[i])
    step = autoflat.step(scaled, num_steps=k)
    w = jnp.zeros(3)
    for start in range(0, 8, k):
        w, _ = step(0.1, w, xs[start : start + k] if k > 1 else xs[start])
    np.testing.assert_allclose(w, rw, rtol=1e-5)

    def disagree(p, x, flag=False):  # named at 0 here, a value unlike `p` there
        if flag:
            return p, jnp.sum(x)
        return jnp.sum(x), p

    with pytest.raises(autoflat.SourceError, match="disagree"):
        autoflat.step(disagree, num_steps=k)(jnp.ones(3), xs[:k] if k > 1 else xs[0])


def test_an_online_network_beside_its_target_alike():
    """DQN: `(online, target, opt_state, x, y)` returning `optax.apply_updates(online, ...)`,
    the target read in the loss. The new online network is computed from both, but its last
    operation takes the online network's own arrays (`p + u`): it was an ambiguity error
    ("could be the new value of `online` or `target`"). The target stays broadcast."""
    tx = optax.sgd(0.1)

    def train_step(online, target, opt_state, x, y):
        tgt = y + 0.5 * (x @ target["w"])
        loss, g = jax.value_and_grad(
            lambda p: jnp.mean((x @ p["w"] + p["b"] - jax.lax.stop_gradient(tgt)) ** 2)
        )(online)
        updates, opt_state = tx.update(g, opt_state, online)
        return optax.apply_updates(online, updates), opt_state, loss

    online = {"w": jnp.full((3, 1), 0.1), "b": jnp.zeros(1)}
    target = {"w": jnp.full((3, 1), 0.3), "b": jnp.zeros(1)}
    xs, ys = _batches(8, (5, 3)), _batches(8, (5, 1), seed=1)
    ref = jax.jit(train_step)
    ro, rs, ref_losses = online, tx.init(online), []
    for i in range(8):
        ro, rs, loss = ref(ro, target, rs, xs[i], ys[i])
        ref_losses.append(loss)
    step = autoflat.step(train_step, num_steps=K)
    o, s, losses = online, tx.init(online), []
    for start in (0, K):
        o, s, loss = step(o, target, s, xs[start : start + K], ys[start : start + K])
        losses.append(loss)
    np.testing.assert_allclose(jnp.concatenate(losses), jnp.stack(ref_losses), rtol=1e-5)
    tree_allclose(o, ro)
    shown = autoflat.show(step)
    assert "# online: state (matched by value and data flow to return position 0)" in shown
    assert "# target: broadcast (no leading axis of num_steps=4 at the first call)" in shown


def test_review_cases_of_matching_by_value():
    """Cases where matching by value went wrong or now could (each at num_steps=4 against
    `jax.jit`, or the error that says what to declare):

    - `return jax.value_and_grad(loss)(params, x)`: the gradients look like `params`; a
      transformation's items are never a parameter's new value: a loss and gradients per
      step, `params` the same every step, as `jax.jit` calls give (not gradients carried
      as params, nor the nested-state error, which said `params` came back inside);
    - `(w, lr, b, x)` returning `w - lr * gw, lr * 0.5, b - lr * gb`: the carried `lr` takes
      position 1, `b` its place at 2 (it was looked for at 1 and left broadcast);
    - `(w, lr, x)` returning `w - lr * g, 0`: a constant `0` is not a new value of a float
      `lr`, which stays static;
    - two keys, `return new, loss, new_dropout, new_noise`: each key to the position
      computed from it (the rank put `noise_rng` on the new dropout key);
    - `(totals, w, x)` with `totals.update(...)` written back, returning `w - 0.1 * g, loss`:
      `totals` takes no return place, so `w` is found at position 0."""

    def loss_fn(p, x):
        return jnp.sum((p["w"] * x - 1.0) ** 2)

    def grad_step(params, x):
        return jax.value_and_grad(loss_fn)(params, x)

    got = autoflat.step(grad_step, num_steps=K)({"w": jnp.arange(3.0)}, jnp.ones((K, 3)))
    want = jax.jit(grad_step)({"w": jnp.arange(3.0)}, jnp.ones(3))
    tree_allclose(autoflat.unwrap(got), jax.tree.map(lambda a: jnp.stack([a] * K), want))

    def decaying(w, lr, b, x):
        gw, gb = jax.grad(lambda w, b: jnp.sum((w * x + b - 1.0) ** 2), argnums=(0, 1))(w, b)
        return w - lr * gw, lr * 0.5, b - lr * gb

    def constant(w, lr, x):
        g = jax.grad(lambda w: jnp.sum((w * x - 1.0) ** 2))(w)
        return w - lr * g, 0

    def two_keys(params, dropout_rng, noise_rng, x):
        new_d, d = jax.random.split(dropout_rng)
        new_n, n = jax.random.split(noise_rng)
        new = {"w": params["w"] + 0.1 * jax.random.normal(d, (3,)) + x}
        return new, jnp.sum(jax.random.normal(n, (3,))), new_d, new_n

    xs = _batches(2 * K)
    cases = [
        (decaying, (jnp.zeros(3), 0.1, jnp.zeros(())), 3),
        (constant, (jnp.zeros(3), 0.1), 1),
        (two_keys, ({"w": jnp.zeros(3)}, jax.random.key(1), jax.random.key(2)), 1),
    ]
    for fn, start, n_state in cases:
        ref = jax.jit(fn)
        state, ref_outs = start, []
        for x in xs:
            out = ref(*state, x)
            if fn is constant:
                state, ref_outs = (out[0], state[1]), [*ref_outs, out[1]]
            elif fn is two_keys:
                state, ref_outs = (out[0], out[2], out[3]), [*ref_outs, out[1]]
            else:
                state = out
        step = autoflat.step(fn, num_steps=K)
        got, outs = start, []
        for c in range(2):
            out = step(*got, xs[K * c : K * (c + 1)])
            if fn is constant:
                got, outs = (out[0], got[1]), [*outs, *out[1]]
            elif fn is two_keys:
                got, outs = (out[0], out[2], out[3]), [*outs, *out[1]]
            else:
                got = out
        for a, b in zip(got[:n_state], state[:n_state], strict=True):
            if isinstance(b, jax.Array) and jax.dtypes.issubdtype(b.dtype, jax.dtypes.prng_key):
                np.testing.assert_array_equal(jax.random.key_data(a), jax.random.key_data(b))
            else:
                tree_allclose(a, b)
        if outs:
            np.testing.assert_allclose(jnp.stack(outs), jnp.stack(ref_outs), rtol=1e-5)
        if fn is constant:
            assert "# lr: static (a Python float" in autoflat.show(step)

    def counted(totals, w, x):
        loss, g = jax.value_and_grad(lambda w: jnp.sum((w * x - 1.0) ** 2))(w)
        totals.update(n=totals["n"] + 1)
        return w - 0.1 * g, loss

    totals = {"n": jnp.array(0)}
    w, losses = autoflat.step(counted, num_steps=K)(totals, jnp.zeros(3), jnp.ones((K, 3)))
    assert w.shape == (3,) and int(totals["n"]) == K
    rw = jnp.zeros(3)
    for _ in range(K):
        rw = rw - 0.1 * jax.grad(lambda w: jnp.sum((w - 1.0) ** 2))(rw)
    np.testing.assert_allclose(w, rw, rtol=1e-6)


def test_gradients_returned_are_never_a_parameters_new_value():
    """`loss, grads = jax.value_and_grad(loss_fn)(params, x); return loss, grads`: the
    gradients have the params' abstract value, so they were matched to `params` by value; at
    num_steps=4 every step after the first computed its gradients at the previous step's
    gradients (losses 8.2 34 55 260 against 8.2 2.3 3.2 7.3), silently, and at num_steps=1
    the params were donated, so calling again with them raised the consumed error. A name only
    ever bound to what a gradient transformation's function gives (bound directly, or through
    `grad_fn = jax.value_and_grad(...)`, with or without `has_aux`), or such a call returned
    as it is, is no parameter's new value: the params are broadcast. A name computed from
    the gradients (`new = jax.tree.map(...)`) is still matched."""

    def loss_fn(params, x):
        pred = jnp.tanh(x @ params["w"] + params["b"])
        return jnp.mean(pred**2), pred

    def value_and_grads(params, x):
        (loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, x)
        return loss, grads

    def through_a_name(params, x):
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        (loss, pred), grads = grad_fn(params, x)
        return grads, loss

    def returned_as_called(params, x):
        return jax.grad(lambda p: loss_fn(p, x)[0])(params), jnp.sum(x)

    def sgd(params, x):
        grads, _ = jax.grad(loss_fn, has_aux=True)(params, x)
        new = jax.tree.map(lambda p, g: p - 0.5 * g, params, grads)
        return new, grads

    params = {"w": jnp.ones((3, 2)), "b": jnp.full((2,), 0.5)}
    xs = _batches(2 * K, (5, 3))
    for fn in (value_and_grads, through_a_name, returned_as_called):
        ref = [jax.jit(fn)(params, x) for x in xs]
        for k in (1, K):
            step = autoflat.step(fn, num_steps=k)
            outs = [step(params, xs[i : i + k] if k > 1 else xs[i]) for i in range(0, 2 * K, k)]
            if k > 1:
                outs = [jax.tree.map(lambda a, i=i: a[i], o) for o in outs for i in range(k)]
            tree_allclose(outs, ref, rtol=1e-6)
            role = "broadcast" if k > 1 else "scanned (per-step input)"
            assert f"# params: {role}" in autoflat.show(step)
            assert float(params["w"][0, 0]) == 1.0  # not donated, still usable

    def rebound(params, x):
        grads, pred = jax.grad(loss_fn, has_aux=True)(params, x)
        grads = jax.tree.map(lambda p, g: p - 0.5 * g, params, grads)  # now the new params
        return grads, jnp.mean(pred)

    for fn in (sgd, rebound):
        state, ref = _reference(fn, (params,), (xs,), 2 * K)
        step = autoflat.step(fn, num_steps=K)
        got, outs = _run(step, (jax.tree.map(jnp.copy, params),), (xs,), 2 * K, K)
        assert "# params: state (matched by value" in autoflat.show(step)
        tree_allclose(got, state, rtol=1e-6)
        stacked = jax.tree.map(lambda *a: jnp.stack(a), *ref)
        tree_allclose(jax.tree.map(lambda *a: jnp.concatenate(a), *outs), stacked, rtol=1e-6)


def test_a_raw_key_at_two_steps_a_call_is_asked_about():
    """A raw `jax.random.PRNGKey(0)` (uint32[2]) passed beside per-step inputs at
    num_steps=2 has a leading axis of 2: it was sliced per step, and JAX raised 'invalid PRNG
    key data' with nothing from autoflat. It may also be two steps' uint32 counts, so a
    ShapeError asks; `broadcast=` then trains as jax.jit does. A typed key array of two keys
    is two steps' keys."""

    def update(w, x, rng):
        noise = jax.random.normal(jax.random.fold_in(rng, 0), w.shape)
        return w + 0.1 * x + noise, jnp.sum(w)

    rng = jax.random.PRNGKey(0)
    xs = _batches(4)
    with pytest.raises(autoflat.ShapeError, match='broadcast="rng"'):
        autoflat.step(update, num_steps=2)(jnp.zeros(3), xs[:2], rng)
    state, _ = _reference(update, (jnp.zeros(3),), (xs,), 4, (rng,))
    step = autoflat.step(update, num_steps=2, broadcast="rng")
    got, _ = _run(step, (jnp.zeros(3),), (xs,), 4, 2, (rng,))
    tree_allclose(got, state, rtol=1e-6)

    keys = jax.random.split(jax.random.key(1), 2)
    step = autoflat.step(update, num_steps=2)
    step(jnp.zeros(3), xs[:2], keys)
    assert "# rng: scanned" in autoflat.show(step)


def test_gradients_at_other_parameters_may_be_state():
    """Review cases of the gradient rule, each against a jax.jit loop at num_steps=4: a
    gradient is the new value of no parameter it is taken at, but it may be another's (a
    carried previous gradient, `return params, g` for `prev_g`); a return in another branch
    giving gradients does not close that position to momentum; `has_aux` passed by position
    (`jax.grad(f, 0, True)`) is read; a name rebound from a transformation to another
    function (`f = jax.grad(loss)`, later `f = sgd`) makes no gradients of what it gives."""

    def loss(p, x):
        return jnp.sum((p["w"] * x - 1.0) ** 2)

    def sgd(p, g):
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, g)

    def previous(params, prev_g, x):
        g = jax.grad(loss)(params, x)
        d = jax.tree.map(lambda a, b: a + 0.5 * b, g, prev_g)
        params = sgd(params, d)
        return params, g

    def branches(params, prev_m, x, warm=False):
        g = jax.grad(loss)(params, x)
        if warm:
            return params, g
        m = jax.tree.map(lambda a, b: 0.9 * a + b, prev_m, g)
        new_params = sgd(params, m)
        return new_params, m

    def aux(params, stats, x):
        def loss_fn(p):
            return loss(p, x), {"w": 0.9 * stats["w"] + 0.1 * x}

        grads, new_stats = jax.grad(loss_fn, 0, True)(params)
        new_params = sgd(params, grads)
        return new_params, new_stats

    def rebound(params, other, x):
        f = jax.grad(loss)
        g = f(params, x)
        f = sgd
        new_params = f(params, g)
        return new_params, f(other, g)

    xs = _batches(8)
    for fn in (previous, branches, aux, rebound):
        start = ({"w": jnp.arange(3.0)}, {"w": jnp.ones(3)})
        state, _ = _reference(fn, start, (xs,), 8)
        step = autoflat.step(fn, num_steps=K)
        got, _ = _run(step, start, (xs,), 8, K)
        second = fn.__code__.co_varnames[1]
        assert f"# {second}: state (matched by value" in autoflat.show(step), fn.__name__
        tree_allclose(got, state, rtol=1e-6)


def test_a_method_steps_self_is_not_matched_to_gradients_alike_it():
    """A pytree agent's method returning `loss, grads` through a helper method (no gradient
    transformation in the step's own source): the gradients have `self`'s abstract value, and
    `self` was matched to them, so at num_steps=4 each step took its gradients at the last
    step's gradients. `self` is matched only where some leaf is its own or computed by an
    operation taking its own arrays."""
    struct = pytest.importorskip("flax.struct")

    class Agent(struct.PyTreeNode):
        w: jax.Array

        def loss_and_grad(self, x):
            return jax.value_and_grad(lambda a: jnp.sum((a.w * x - 1.0) ** 2))(self)

        def grads(self, x):
            loss, g = self.loss_and_grad(x)
            return loss, g

    agent = Agent(jnp.arange(3.0))
    xs = _batches(K)
    ref = [jax.jit(Agent.grads)(agent, x)[1].w for x in xs]
    step = autoflat.step(Agent.grads, num_steps=K)
    _, got = step(agent, xs)
    np.testing.assert_allclose(got.w, jnp.stack(ref), rtol=1e-6)
    assert "# self: broadcast" in autoflat.show(step)


def _heavy_ball(params, prev, x):
    """Heavy-ball momentum written as a positional carry: the old `params` comes back at the
    place of `prev`, never assigned (a step nobody wrote for autoflat, from an adversarial
    sweep)."""
    g = jax.grad(lambda p: jnp.sum((p["w"] * x - 1.0) ** 2))(params)
    new = jax.tree.map(lambda p, q, g: p - 0.1 * g + 0.5 * (p - q), params, prev, g)
    return new, params, jnp.sum(g["w"])


def _heavy_ball_array(w, prev_w, x):
    g = jax.grad(lambda w: jnp.sum((w * x - 1.0) ** 2))(w)
    new_w = w - 0.1 * g + 0.5 * (w - prev_w)
    return new_w, w, jnp.sum(g)


@pytest.mark.parametrize("fn", [_heavy_ball, _heavy_ball_array])
def test_a_parameter_given_back_as_it_came_at_anothers_place_is_refused(fn):
    """`return new, params` for `(params, prev)`, `params` never assigned: by name (rule 2)
    `params` would be carried unchanged and `prev` trained; as a `lax.scan` carry, position 0
    is the new `params`. Both type-check, and they train differently: it silently took the
    first. Now an error naming `state=` for each reading; the positional one equals
    `jax.jit` of a `lax.scan`, the other runs as it says."""
    first, second = _params_of(fn)
    start = {"w": jnp.zeros(3)} if fn is _heavy_ball else jnp.zeros(3)
    xs = jnp.linspace(0.5, 1.5, 12).reshape(4, 3)
    with pytest.raises(autoflat.OptionError) as raised:
        autoflat.step(fn, num_steps=4)(start, start, xs)
    message = str(raised.value)
    assert f"returns `{first}` by name at return position 1, and never assigns" in message
    assert f'state={{"{first}": 0, "{second}": 1}}' in message
    assert f'state={{"{second}": 0}}, broadcast="{first}"' in message

    def scan(a, b, xs):
        def body(carry, x):
            n, p, loss = fn(*carry, x)
            return (n, p), loss

        (a, b), losses = jax.lax.scan(body, (a, b), xs)
        return a, b, losses

    positional = autoflat.step(fn, num_steps=4, state={first: 0, second: 1})
    got = want = (start, start)
    for _ in range(3):
        *got, loss = positional(*got, xs)
        *want, ref = jax.jit(scan)(*want, xs)
    tree_allclose((*got, loss), (*want, ref))
    through = autoflat.step(fn, num_steps=4, state={second: 0}, broadcast=first)

    def scan_through(a, b, xs):
        def body(b, x):
            n, p, loss = fn(a, b, x)
            return n, (p, loss)

        return jax.lax.scan(body, b, xs)

    new, passed = through(start, start, xs)[:2]
    want_new, (want_passed, _) = jax.jit(scan_through)(start, start, xs)
    tree_allclose((new, passed), (want_new, want_passed))
    # one step a call: each position comes back as the body computed it, no error
    one = autoflat.step(fn)
    got = want = (start, start)
    for x in xs:
        *got, loss = one(*got, x)
        *want, ref = jax.jit(fn)(*want, x)
    tree_allclose((*got, loss), (*want, ref))


def _params_of(fn):
    import inspect

    return list(inspect.signature(fn).parameters)[:2]


def _summed(w, total, x):
    loss = jnp.sum((w * x - 1.0) ** 2)
    w = w - 0.01 * x
    return w, total + loss


def _counted(w, correct, x):
    w = w - 0.01 * x
    return w, correct + jnp.sum(x > 1.5)


@pytest.mark.parametrize(("fn", "start"), [(_summed, 0.0), (_counted, 0)])
def test_a_python_number_accumulated_at_its_place_is_state(fn, start):
    """`return w, total + loss` from `total=0.0` at num_steps > 1: a `lax.scan` carries the
    sum. It was static (every step started from 0.0, the output stacked) and, passed back,
    read as per-step at the next call: silently wrong. Now state, carried as an array, equal
    to `jax.jit` of a `lax.scan`, compiling as often as it does (the first call's Python
    number, then the array)."""
    xs = jnp.ones((4, 3)) * jnp.arange(4.0)[:, None]

    def scan(w, t, xs):
        return jax.lax.scan(lambda c, x: (fn(*c, x), None), (w, t), xs)[0]

    step = autoflat.step(fn, num_steps=4)
    got = want = (jnp.zeros(3), start)
    for i in range(3):
        got = step(*got, xs)
        want = jax.jit(scan)(*want, xs)
        if i == 0:
            name = list(inspect.signature(fn).parameters)[1]
            kind = type(start).__name__
            assert f"# {name}: state (a Python {kind} that return position 1" in (
                autoflat.show(step)
            )
    tree_allclose(got, want)
    assert autoflat.stats(step).traces == 2


def test_a_python_number_beside_a_loss_it_does_not_make_stays_static():
    """A learning rate beside a loss computed after the update, or a class count the step
    needs concrete: the scalar at their place is not made by an operation taking them, so
    they stay static (carrying the loss as the rate trained silently wrong)."""

    def lr_step(w, lr, x):
        w = w - lr * x
        return w, jnp.sum((w * x - 1.0) ** 2)

    def classes(w, num_classes, x):
        y = jax.nn.one_hot(jnp.argmax(x), num_classes)
        return w - 0.01 * x, jnp.sum(y) * 1.0

    xs = jnp.ones((4, 3))
    for fn, name, value in ((lr_step, "lr", 0.1), (classes, "num_classes", 3)):
        step = autoflat.step(fn, num_steps=4)
        w, out = step(jnp.zeros(3), value, xs)
        assert out.shape == (4,)  # a per-step output
        assert f"# {name}: static (a Python" in autoflat.show(step)


def _adam_by_hand(p, m, v, x):
    """Adam written by hand, its moments returned in another order than the parameters."""
    g = jax.grad(lambda p: jnp.sum((p * x - 1.0) ** 2))(p)
    m1 = 0.9 * m + 0.1 * g
    v1 = 0.999 * v + 0.001 * g * g
    return p - 0.01 * m1 / (jnp.sqrt(v1) + 1e-8), v1, m1, jnp.sum(g)


def test_returns_in_another_order_than_the_parameters_are_named_in_the_error():
    """`return p, v1, m1, loss` for `(p, m, v, x)`: the error about `v1` at `m`'s place
    offered only `broadcast="m"` and `state={"m": 1}`, both silently wrong here. It now also
    names the reading where the returns are reordered, and that one equals `jax.jit`."""
    z = jnp.zeros(3)
    xs = jnp.ones((4, 3))
    with pytest.raises(autoflat.OptionError) as raised:
        autoflat.step(_adam_by_hand, num_steps=4)(z, z, z, xs)
    message = str(raised.value)
    assert "Return position 2 (`m1`) is computed from `m` and looks like its new value" in message
    assert 'state={"m": 2, "v": 1}' in message
    step = autoflat.step(_adam_by_hand, num_steps=4, state={"m": 2, "v": 1})
    p, v, m, losses = step(z, z, z, xs)
    want = (z, z, z)
    for x in xs:
        new_p, v1, m1, _ = jax.jit(_adam_by_hand)(*want, x)
        want = (new_p, m1, v1)
    tree_allclose((p, m, v), want)


def _adam_moments(w, m, v, t, x):
    """Adam by hand as tutorials write it: the moments' new values named `mn`, `vn`."""
    g = jax.grad(lambda w: jnp.sum((w * x - 1.0) ** 2))(w)
    mn = 0.9 * m + 0.1 * g
    vn = 0.999 * v + 0.001 * g * g
    wn = w - 0.01 * (mn / (1 - 0.9**t)) / (jnp.sqrt(vn / (1 - 0.999**t)) + 1e-8)
    return wn, mn, vn, t + 1


def test_an_average_kept_at_a_parameter_s_place_is_its_new_value():
    """`mn = 0.9 * m + 0.1 * g` at `m`'s place: an addition taking `m` times a constant, as
    an average is kept, says it is `m`'s new value as `m + g` would (this was an OptionError
    asking whether `m` is a learning rate). Equal to `jax.jit` over the steps."""
    state = (jnp.ones(3), jnp.zeros(3), jnp.zeros(3), jnp.float32(1))
    xs = _batches(8)
    step = autoflat.step(_adam_moments, num_steps=K)
    got, _ = _run(step, state, [xs], 8, K)
    want, _ = _reference(_adam_moments, state, [xs], 8)
    tree_allclose(got, want)
    header = autoflat.show(step)
    for name, pos in (("m", 1), ("v", 2)):
        assert f"# {name}: state (matched by value to return position {pos})" in header


def _scaled(w, opt_state, x, *, scale=1.0):
    loss = jnp.sum((w * x - 1.0) ** 2) * scale
    return w - 0.01 * x, opt_state + 1.0, loss


def test_a_python_number_multiplying_the_loss_at_its_place_stays_static():
    """`loss * scale` at the place of `scale=1.0` (a keyword default) is not a running sum:
    `scale` stays static and the loss is a per-step output. It was carried as state, so the
    second step of a call took the first step's loss as its scale: silently wrong."""
    xs = jnp.ones((4, 3)) * jnp.arange(4.0)[:, None]
    step = autoflat.step(_scaled, num_steps=4)
    w, o, losses = step(jnp.zeros(3), jnp.zeros(()), xs)
    assert "# scale: static (a Python float" in autoflat.show(step)
    want_w, want_o, want = jnp.zeros(3), jnp.zeros(()), []
    for x in xs:
        want_w, want_o, loss = jax.jit(_scaled)(want_w, want_o, x)
        want.append(loss)
    tree_allclose((w, o, losses), (want_w, want_o, jnp.stack(want)))


def _plus_eps(w, eps, x):
    loss = jnp.sum((w * x - 1.0) ** 2)
    return w - 0.01 * x, loss + eps


def _minus_best(w, f_star, x):
    loss = jnp.sum((w * x - 1.0) ** 2)
    return w - 0.01 * x, loss - f_star


def _resumed(w, total, x):
    loss = jnp.sum((w * x - 1.0) ** 2)
    return w - 0.01 * x, total + loss


def test_a_python_number_added_to_a_loss_stays_static_and_a_resumed_sum_is_an_error():
    """`loss + eps` and `loss - f_star` at the number's place do not accumulate it (the
    number is not the first operand, as in `total + loss` and `total - x`), so it stays
    static, whatever its value (`f_star=0.0` was carried, each step subtracting the
    previous output). A running sum resumed from a nonzero value is an error naming both
    readings; either fix runs as `jax.jit` does."""
    xs = jnp.ones((4, 3)) * jnp.arange(4.0)[:, None]
    cases = ((_plus_eps, 1e-3), (_plus_eps, 0.0), (_minus_best, 0.0), (_minus_best, 0.25))
    for fn, value in cases:
        step = autoflat.step(fn, num_steps=4)
        w, outs = step(jnp.zeros(3), value, xs)
        want_w, want = jnp.zeros(3), []
        for x in xs:
            want_w, out = jax.jit(fn, static_argnums=1)(want_w, value, x)
            want.append(out)
        tree_allclose((w, outs), (want_w, jnp.stack(want)))
    with pytest.raises(autoflat.OptionError) as e:
        autoflat.step(_resumed, num_steps=4)(jnp.zeros(3), 3.0, xs)
    message = str(e.value)
    assert "`total` (a Python float, 3.0 at this call)" in message
    assert 'state={"total": 1}' in message and 'static_argnames="total"' in message
    carried = autoflat.step(_resumed, num_steps=4, state={"total": 1})

    def scan(w, t, xs):
        return jax.lax.scan(lambda c, x: (_resumed(*c, x), None), (w, t), xs)[0]

    tree_allclose(carried(jnp.zeros(3), 3.0, xs), jax.jit(scan)(jnp.zeros(3), 3.0, xs))


_TX = optax.sgd(0.1)


def _clipped(w, opt_state, bounds, x):
    lo, hi = bounds
    loss, g = jax.value_and_grad(lambda w: jnp.mean((x @ w) ** 2))(w)
    u, opt_state = _TX.update(jnp.clip(g, lo, hi), opt_state)
    w = optax.apply_updates(w, u)
    return w, opt_state, (loss, jnp.mean(w))


def _tracked(w, opt_state, tracker, x):
    count, _ = tracker
    loss, g = jax.value_and_grad(lambda w: jnp.mean((x @ w) ** 2))(w)
    u, opt_state = _TX.update(g, opt_state)
    return optax.apply_updates(w, u), opt_state, (count + 1.0, loss)


def _lstm_carry(w, carry, x):
    h, c = carry
    c = 0.5 * c + jnp.tanh(x @ w + h)
    h = jnp.tanh(c) * 0.9
    return w - 0.01 * jnp.outer(x, h).sum(0), (h, c)


def test_a_container_alike_an_output_that_is_not_computed_from_it_is_asked_about():
    """A tuple of clip bounds beside a metrics tuple of the same types: the metrics' loss is
    not computed from the bounds, so only the types link them. It was carried as the bounds'
    new value at num_steps > 1, each step clipping with the previous step's metrics: silently
    wrong. Now an error naming the leaf and both fixes; `broadcast=` runs as `jax.jit`. At one
    step a call nothing is carried: it runs as before. A tuple whose every leaf is computed
    from it (an LSTM's carry) or made by an addition taking its own leaf (`count + 1` beside
    the last loss) is still its new value."""
    xs = jnp.arange(12.0).reshape(4, 1, 3) / 10
    w0, bounds = jnp.ones(3), (jnp.float32(-1.0), jnp.float32(1.0))
    with pytest.raises(autoflat.OptionError) as e:
        autoflat.step(_clipped, num_steps=4)(w0, _TX.init(w0), bounds, xs)
    message = str(e.value)
    assert "return position 2 has the tree structure, shapes and dtypes of `bounds`" in message
    assert "its leaf at `[0]` is not computed from `bounds`" in message
    assert 'state={"bounds": 2}' in message and 'broadcast="bounds"' in message
    assert "test_infer.py" in message

    def reference(state, n, fn, rest=()):
        outs = []
        for i in range(n):
            *state, out = jax.jit(fn)(*state, *rest, xs[i])
            outs.append(out)
        return state, outs

    (want_w, want_o), want = reference((w0, _TX.init(w0)), 4, _clipped, (bounds,))
    step = autoflat.step(_clipped, num_steps=4, broadcast="bounds")
    w, o, metrics = step(w0, _TX.init(w0), bounds, xs)
    tree_allclose((w, o, metrics), (want_w, want_o, jax.tree.map(lambda *m: jnp.stack(m), *want)))
    one = autoflat.step(_clipped)
    w, o = w0, _TX.init(w0)
    for i in range(4):
        w, o, _ = one(w, o, bounds, xs[i])
    tree_allclose((w, o), (want_w, want_o))

    tracker = (jnp.float32(0.0), jnp.float32(0.0))
    step = autoflat.step(_tracked, num_steps=4)
    got = step(w0, _TX.init(w0), tracker, xs)
    assert "# tracker: state (matched by value" in autoflat.show(step)
    ref = (w0, _TX.init(w0), tracker)
    for i in range(4):
        ref = jax.jit(_tracked)(*ref, xs[i])
    tree_allclose(got, ref)

    carry = (jnp.zeros(3), jnp.zeros(3))
    xs3 = jnp.arange(12.0).reshape(4, 3) / 10
    step = autoflat.step(_lstm_carry, num_steps=4)
    got = step(jnp.eye(3), carry, xs3)
    ref = (jnp.eye(3), carry)
    for i in range(4):
        ref = jax.jit(_lstm_carry)(*ref, xs3[i])
    tree_allclose(got, ref)


def _normalised(w, stats, x, y):
    mu, sd = stats
    loss, g = jax.value_and_grad(lambda w: jnp.mean((((x - mu) / sd) @ w - y) ** 2))(w)
    return w - 0.1 * g, (loss, jnp.sqrt(jnp.sum(g**2)))


def _projected(w, bounds, x, y):
    lo, hi = bounds
    w = jnp.clip(w, lo, hi)
    loss, g = jax.value_and_grad(lambda w: jnp.mean((x @ w - y) ** 2))(w)
    return w - 0.1 * g, (loss, jnp.mean(w))


def _decayed(w, hp, x, y):
    lr, wd = hp
    loss, g = jax.value_and_grad(lambda w: jnp.mean((x @ w - y) ** 2) + wd * jnp.sum(w**2))(w)
    return w - lr * g, (loss, jnp.sqrt(jnp.sum(g**2)))


def _scalar_loss(w, x, y):
    return jax.value_and_grad(lambda w: jnp.mean((x @ w - y) ** 2))(w)


def _ema_metrics(w, ema, x, y):
    loss, g = _scalar_loss(w, x, y)
    return w - 0.1 * g, (0.9 * ema[0] + 0.1 * loss, 0.9 * ema[1] + 0.1 * jnp.sum(g**2))


def _early_stopping(w, es, x, y):
    best, patience = es
    loss, g = _scalar_loss(w, x, y)
    patience = jnp.where(loss < best, 0.0, patience + 1.0)
    return w - 0.1 * g, (jnp.minimum(best, loss), patience)


def _welford(w, st, x, y):
    n, mean, m2 = st
    xm, n = jnp.mean(x), n + 1.0
    delta = xm - mean
    mean = mean + delta / n
    loss, g = _scalar_loss(w, x, y)
    return w - 0.1 * g, (n, mean, m2 + delta * (xm - mean))


def _loss_scale(w, ls, x, y):
    scale, good = ls
    g = jax.grad(lambda w: scale * jnp.mean((x @ w - y) ** 2))(w) / scale
    finite = jnp.all(jnp.isfinite(g))
    good = jnp.where(finite, good + 1.0, 0.0)
    scale = jnp.where(finite, jnp.where(good >= 2.0, scale * 2.0, scale), scale / 2.0)
    return w - 0.1 * g, (scale, jnp.where(good >= 2.0, 0.0, good))


def _shares(w, st, x, y):
    loss, g = _scalar_loss(w, x, y)
    a = st[0] + loss
    return w - 0.1 * g, (a / (a + st[1]), st[1] / (a + st[1]))


def _counted_in_scan(w, st, x, y):
    def body(c, xy):
        return (c[0] + 1.0, c[1] + (xy[0] @ w - xy[1]) ** 2), None

    st, _ = jax.lax.scan(body, st, (x, y))
    loss, g = _scalar_loss(w, x, y)
    return w - 0.1 * g, st


def _stopping_flag(w, es, x, y):
    best, wait, stop = es
    loss, g = _scalar_loss(w, x, y)
    improved = loss < best
    wait = jnp.where(improved, 0.0, wait + 1.0)
    stop = wait >= 2.0
    return jnp.where(stop, w, w - 0.1 * g), (jnp.where(improved, loss, best), wait, stop)


def _stacked_best(w, st, x, y):
    loss, g = _scalar_loss(w, x, y)
    best = jnp.min(jnp.stack([st[0], loss]))
    return w - 0.1 * g, (best, jax.nn.logsumexp(jnp.stack([st[1], -loss])))


def _debiased(w, st, x, y):
    ema, _, beta_pow = st
    loss, g = _scalar_loss(w, x, y)
    ema, beta_pow = 0.9 * ema + 0.1 * loss, beta_pow * 0.9
    return w - 0.1 * g, (ema, ema / (1 - beta_pow), beta_pow)


def _scheduled(w, st, x, y):
    count, lr = st
    _, g = _scalar_loss(w, x, y)
    count = optax.safe_int32_increment(count)
    return w - lr * g, (count, optax.cosine_decay_schedule(0.1, 10)(count))


def _guarded(w, hp, x, y):  # (an update skipped on a non-finite loss)
    lr, max_norm = hp
    loss, g = _scalar_loss(w, x, y)

    def apply(_):
        clipped = g * jnp.minimum(1.0, max_norm / optax.tree.norm(g))
        return w - lr * clipped, (loss, optax.tree.norm(clipped))

    def skip(_):
        return w, (jnp.float32(0.0), jnp.float32(0.0))

    w, metrics = jax.lax.cond(jnp.isfinite(loss), apply, skip, None)
    return w, metrics


def _hinton(w, hp, x, y):  # (knowledge distillation, its weight and temperature as arrays)
    alpha, temp = hp
    teacher = x @ jnp.ones(3)

    def full(w):
        s = x @ w
        kd = jnp.mean((jax.nn.sigmoid(s / temp) - jax.nn.sigmoid(teacher / temp)) ** 2)
        return alpha * kd + (1 - alpha) * jnp.mean((s - y) ** 2), kd

    (loss, kd), g = jax.value_and_grad(full, has_aux=True)(w)
    return w - 0.1 * g, (loss, kd * temp**2)


def _weighted_terms(w, hp, x, y):  # (a VAE's reconstruction and KL weights)
    w_rec, w_kl = hp
    mse, kl = jnp.mean((x @ w - y) ** 2), jnp.sum(w**2)
    g = jax.grad(lambda w: w_rec * jnp.mean((x @ w - y) ** 2) + w_kl * jnp.sum(w**2))(w)
    return w - 0.1 * g, (w_rec * mse, w_kl * kl)


def _unscaled(w, hp, x, y):  # (a static loss scale and a clipping norm)
    loss_scale, max_norm = hp
    scaled, g = jax.value_and_grad(lambda w: loss_scale * jnp.mean((x @ w - y) ** 2))(w)
    g = g / loss_scale
    factor = jnp.minimum(1.0, max_norm / jnp.sqrt(jnp.sum(g**2)))
    return w - 0.1 * g * factor, (scaled / loss_scale, factor)


def _denormalised(w, st, x, y):  # (targets standardised by fixed statistics)
    y_mean, y_std = st
    _, g = jax.value_and_grad(lambda w: jnp.mean((x @ w - (y - y_mean) / y_std) ** 2))(w)
    pred = x @ w
    return w - 0.1 * g, (jnp.mean(pred) * y_std + y_mean, jnp.std(pred) * y_std)


def _decay_logged(w, hp, x, y):
    wd, lr = hp
    mse, reg = jnp.mean((x @ w - y) ** 2), jnp.sum(w**2)
    g = jax.grad(lambda w: jnp.mean((x @ w - y) ** 2) + wd * jnp.sum(w**2))(w)
    return w - lr * g, (mse + wd * reg, lr)


def _lerped(w, hp, x, y):  # (the distillation loss written as a lerp, a weight T**2 in it)
    alpha, temp = hp
    teacher = x @ jnp.ones(3)

    def full(w):
        s = x @ w
        kd = jnp.mean((jax.nn.sigmoid(s / temp) - jax.nn.sigmoid(teacher / temp)) ** 2)
        ce = jnp.mean((s - y) ** 2)
        return ce + alpha * (temp**2 * kd - ce), kd

    (loss, kd), g = jax.value_and_grad(full, has_aux=True)(w)
    return w - 0.1 * g, (loss, kd * temp**2)


def _skipped_unscaled(w, hp, x, y):  # (the unscaled loss zeroed where not finite)
    loss_scale, max_norm = hp
    scaled, g = jax.value_and_grad(lambda w: loss_scale * jnp.mean((x @ w - y) ** 2))(w)
    g = g / loss_scale
    factor = jnp.minimum(1.0, max_norm / jnp.sqrt(jnp.sum(g**2)))
    return w - 0.1 * g * factor, (jnp.where(jnp.isfinite(scaled), scaled / loss_scale, 0.0), factor)


def _linear_fit(w, st, x, y):  # (a model of two scalars, `y = a * x + b`, trained by SGD)
    loss, (ga, gb) = jax.value_and_grad(lambda p: jnp.mean((p[0] * x[:, 0] + p[1] - y) ** 2))(st)
    return w * 0.9, (st[0] - 0.1 * ga, st[1] - 0.1 * gb)


def _irregular_ema(w, st, x, y):  # (an EMA over irregular intervals, its time accumulated)
    level, elapsed = st
    dt = jnp.abs(x[0, 0]) + 0.1
    decay = jnp.exp(-dt / 0.3)
    loss, g = _scalar_loss(w, x, y)
    return w - 0.1 * g, (decay * level + (1 - decay) * loss, elapsed + dt)


def _ema_by(w, ema, x, y, decay=jnp.float32(0.9)):  # (the decay an array)
    loss, g = _scalar_loss(w, x, y)
    new = (ema[0] * decay + loss * (1 - decay), ema[1] * decay + jnp.sum(g**2) * (1 - decay))
    return w - 0.1 * g, new


def _running_mean(w, st, x, y):
    n, mean = st
    loss, g = _scalar_loss(w, x, y)
    n = n + 1.0
    return w - 0.1 * g, (n, mean * (n - 1) / n + loss / n)


def _scale_times(w, ls, x, y):  # (a dynamic loss scale, multiplied up or down)
    scale, good = ls
    g = jax.grad(lambda w: scale * jnp.mean((x @ w - y) ** 2))(w) / scale
    finite = jnp.all(jnp.isfinite(g))
    return w - 0.1 * g, (scale * jnp.where(finite, 2.0, 0.5), jnp.where(finite, good + 1, 0.0))


def _td_logged(w, hp, x, y):  # (TD(0) on linear values, the TD error logged beside the rates)
    gamma, alpha = hp
    td = y[0] + gamma * (x[1] @ w) - x[0] @ w
    return w + alpha * td * x[0], (jnp.abs(td), td**2)


_WEIGHS = "sums a leaf of `{}` times a value computed from the step's other arguments"
_SCALARS_XS = jax.random.normal(jax.random.key(2), (4, 8, 3))
_SCALARS_YS = jax.random.normal(jax.random.key(3), (4, 8))


def _jit_loop(fn, w, st, broadcast=False):
    outs = []
    for i in range(4):
        w, out = jax.jit(fn)(w, st, _SCALARS_XS[i], _SCALARS_YS[i])
        if broadcast:
            outs.append(out)
        else:
            st = out
    return w, (jax.tree.map(lambda *o: jnp.stack(o), *outs) if broadcast else st)


@pytest.mark.parametrize(
    ("fn", "name", "why", "start"),
    [
        (
            _normalised,
            "stats",
            "[0]` is computed from `stats` only through a reduction",
            (0.5, 2.0),
        ),
        (_projected, "bounds", "[0]` is computed from `bounds` only through a reduction", (-1, 1)),
        (_decayed, "hp", "[1]` is computed from `hp` only through a reduction", (0.1, 0.01)),
        (_guarded, "hp", "[0]` is not computed from `hp`", (0.1, 0.5)),
        (_hinton, "hp", f"[0]` {_WEIGHS.format('hp')}", (0.9, 2.0)),
        (_weighted_terms, "hp", f"[0]` {_WEIGHS.format('hp')}", (1.0, 0.1)),
        (_unscaled, "hp", f"[0]` {_WEIGHS.format('hp')}", (2.0**8, 1.0)),
        (_denormalised, "st", f"[1]` {_WEIGHS.format('st')}", (0.5, 2.0)),
        (_decay_logged, "hp", f"[0]` {_WEIGHS.format('hp')}", (0.01, 0.1)),
        (_lerped, "hp", f"[0]` {_WEIGHS.format('hp')}", (0.9, 2.0)),
        (_skipped_unscaled, "hp", f"[0]` {_WEIGHS.format('hp')}", (2.0**8, 1.0)),
        (_td_logged, "hp", "[1]` is not computed from `hp[1]`, which the step reads", (0.9, 0.1)),
    ],
)
def test_scalars_a_metrics_tuple_is_not_computed_from_at_their_place_are_asked_about(
    fn, name, why, start
):
    """A tuple of scalar arrays beside a metrics tuple of as many scalars, where a metric is
    computed from the tuple only through a mean or a norm over arrays it was spread over
    (input statistics `(mu, sd)`, projection bounds applied before the loss, the gradient
    norm beside `(lr, wd)` with the weight decay in the loss), or not at all from a `cond`'s
    branches, or sums one of its leaves times a loss or other value of the step (Hinton
    distillation's `alpha * kd` beside `(alpha, T)`, loss weights, a loss unscaled by its
    scale, predictions denormalised, a logged weight decay term), or gives way at a leaf the
    step reads to a value not computed from it (a TD error's square at `alpha`'s place beside
    `(gamma, alpha)`): carried as the metrics at
    num_steps > 1, silently wrong. Now an error naming the leaf and both fixes;
    `broadcast=` equals `jax.jit`."""
    w0, start = jnp.ones(3), tuple(jnp.float32(v) for v in start)
    with pytest.raises(autoflat.OptionError) as e:
        autoflat.step(fn, num_steps=4)(w0, start, _SCALARS_XS, _SCALARS_YS)
    message = str(e.value)
    assert f"return position 1 has the tree structure, shapes and dtypes of `{name}`" in message
    assert f"its leaf at `{why}" in message
    assert f'state={{"{name}": 1}}' in message and f'broadcast="{name}"' in message
    step = autoflat.step(fn, num_steps=4, broadcast=name)
    tree_allclose(step(w0, start, _SCALARS_XS, _SCALARS_YS), _jit_loop(fn, w0, start, True))


@pytest.mark.parametrize(
    ("fn", "start"),
    [
        (_ema_metrics, (jnp.float32(1.0), jnp.float32(2.0))),
        (_early_stopping, (jnp.float32(9.0), jnp.float32(0.0))),
        (_welford, (jnp.float32(0.0), jnp.float32(0.0), jnp.float32(0.0))),
        (_loss_scale, (jnp.float32(2.0**8), jnp.float32(0.0))),
        (_shares, (jnp.float32(1.0), jnp.float32(2.0))),
        (_counted_in_scan, (jnp.float32(0.0), jnp.float32(0.0))),
        (_stopping_flag, (jnp.float32(9.0), jnp.float32(0.0), jnp.bool_(False))),
        (_stacked_best, (jnp.float32(9.0), jnp.float32(0.0))),
        (_debiased, (jnp.float32(0.0), jnp.float32(0.0), jnp.float32(1.0))),
        (_scheduled, (jnp.int32(0), jnp.float32(0.1))),
        (_ema_by, (jnp.float32(1.0), jnp.float32(2.0))),
        (_running_mean, (jnp.float32(0.0), jnp.float32(0.0))),
        (_scale_times, (jnp.float32(2.0**8), jnp.float32(0.0))),
        (_linear_fit, (jnp.float32(0.5), jnp.float32(-0.5))),
        (_irregular_ema, (jnp.float32(0.0), jnp.float32(0.0))),
    ],
)
def test_scalar_state_computed_from_itself_is_carried(fn, start):
    """Scalar state a step computes from its own leaves (an EMA of metrics, early stopping's
    best loss and patience, Welford's running moments, a dynamic loss scale, shares of a
    total, counters summed in the step's own `lax.scan`, a minimum or a logsumexp over a
    stack of the old value and the loss), or from another leaf's new value (a stop flag, a
    debiased EMA, a learning rate scheduled on optax's count), or times constants or its own
    other leaves (an EMA whose decay is an array, a running mean `mean * (n - 1) / n`, a
    loss scale times `jnp.where(finite, 2.0, 0.5)`), or updated by an operation taking its
    own leaf though its gradient weighs one leaf by the batch (a model `y = a * x + b` of two
    scalars), or beside a leaf accumulated (an EMA over irregular intervals, its decay from
    the batch), is still matched by value and carried: equal to a loop of `jax.jit` over
    four steps."""
    w0 = jnp.ones(3)
    step = autoflat.step(fn, num_steps=4)
    got = step(w0, start, _SCALARS_XS, _SCALARS_YS)
    assert "state (matched by value" in autoflat.show(step)
    tree_allclose(got, _jit_loop(fn, w0, start))


def _clamped(w, floor, x, y):  # (the loss clamped from below by a fixed floor, logged)
    loss, g = _scalar_loss(w, x, y)
    return w - 0.1 * g, jnp.maximum(floor, loss)


def _best_so_far(w, best, x, y):  # (the best loss so far, given back as an expression)
    loss, g = _scalar_loss(w, x, y)
    return w - 0.1 * g, jnp.minimum(best, loss)


def _loss_clipped(w, lo, x, y):  # (`jnp.clip`: a minimum of a maximum, in a jitted helper)
    loss, g = _scalar_loss(w, x, y)
    return w - 0.1 * g, jnp.clip(loss, lo, 10.0)


def _floored_by_where(w, floor, x, y):
    loss, g = _scalar_loss(w, x, y)
    return w - 0.1 * g, jnp.where(loss < floor, floor, loss)


@pytest.mark.parametrize(
    ("fn", "name"),
    [
        (_clamped, "floor"),
        (_best_so_far, "best"),
        (_loss_clipped, "lo"),
        (_floored_by_where, "floor"),
    ],
)
def test_a_maximum_or_minimum_taking_a_bare_array_at_its_place_is_asked_about(fn, name):
    """`jnp.maximum(floor, loss)` (a clamp: `floor` the same every step, the clamped loss
    logged) and `jnp.minimum(best, loss)` (a running best) are the same operations: the last
    operation takes the bare array at its place either way, and both readings type-check.
    It was carried as state, so a clamp's floor became a running maximum at num_steps > 1,
    silently; so was a clip's lower bound and a select by a comparison with it (`jnp.where(loss
    < floor, floor, loss)`). Now the error naming both fixes, each equal to its `jax.jit`
    loop."""
    w0, start = jnp.ones(3), jnp.float32(0.5)
    with pytest.raises(autoflat.OptionError) as e:
        autoflat.step(fn, num_steps=4)(w0, start, _SCALARS_XS, _SCALARS_YS)
    message = str(e.value)
    assert f"It is a maximum or a minimum taking `{name}`" in message
    assert f'broadcast="{name}"' in message and f'state={{"{name}": 1}}' in message
    step = autoflat.step(fn, num_steps=4, broadcast=name)
    tree_allclose(step(w0, start, _SCALARS_XS, _SCALARS_YS), _jit_loop(fn, w0, start, True))
    step = autoflat.step(fn, num_steps=4, state={name: 1})
    tree_allclose(step(w0, start, _SCALARS_XS, _SCALARS_YS), _jit_loop(fn, w0, start))


def _new_best(w, best, x, y):
    loss, g = _scalar_loss(w, x, y)
    new_best = jnp.maximum(best, -loss)
    return w - 0.1 * g, new_best


def _best_by_name(w, best, x, y):
    loss, g = _scalar_loss(w, x, y)
    best = jnp.minimum(best, loss)
    return w - 0.1 * g, best


def _amsgrad(w, v_hat, x, y):  # (AMSGrad's running maximum, `vhat` for `v_hat`)
    _, g = _scalar_loss(w, x, y)
    vhat = jnp.maximum(v_hat, g**2)
    return w - 0.1 * g / (jnp.sqrt(vhat) + 1e-3), vhat


@pytest.mark.parametrize(
    ("fn", "start"),
    [(_new_best, jnp.float32(-9.0)), (_best_by_name, jnp.float32(9.0)), (_amsgrad, jnp.zeros(3))],
)
def test_a_running_extreme_whose_name_says_so_is_carried(fn, start):
    """Returned under its parameter's new name (`new_best`), its own, or it without the
    underscore (`vhat` for `v_hat`), a maximum or a minimum taking it is its new value:
    carried, equal to a `jax.jit` loop feeding it back."""
    w0 = jnp.ones(3)
    step = autoflat.step(fn, num_steps=4)
    got = step(w0, start, _SCALARS_XS, _SCALARS_YS)
    assert ": state" in autoflat.show(step).splitlines()[3]
    tree_allclose(got, _jit_loop(fn, w0, start))


def _weighted_parts(w, weights, x, y):  # (fixed loss weights, the weighted parts logged)
    def parts(w):
        return {"ce": jnp.mean((x @ w - y) ** 2), "l2": jnp.sum(w**2)}

    g = jax.grad(lambda w: sum(weights[k] * v for k, v in parts(w).items()))(w)
    return w - 0.1 * g, {k: weights[k] * v for k, v in parts(w).items()}


def test_loss_weights_beside_weighted_loss_parts_of_the_same_keys_are_asked_about():
    """A dict of loss weights beside the weighted loss parts under the same keys: the dict's
    named parts computed from it were taken as evidence that the parts are its new value,
    so at num_steps=4 each step was weighted by the last step's weighted losses, silently.
    A leaf that weighs a value of the step by a leaf of it now needs an addition taking its
    own leaf as evidence; the error names both fixes, and `broadcast=` equals `jax.jit`."""
    w0, start = jnp.ones(3), {"ce": jnp.float32(1.0), "l2": jnp.float32(0.01)}
    with pytest.raises(autoflat.OptionError) as e:
        autoflat.step(_weighted_parts, num_steps=4)(w0, start, _SCALARS_XS, _SCALARS_YS)
    message = str(e.value)
    assert "its leaf at `['ce']` sums a leaf of `weights` times a value computed" in message
    assert 'broadcast="weights"' in message and 'state={"weights": 1}' in message
    step = autoflat.step(_weighted_parts, num_steps=4, broadcast="weights")
    got = step(w0, start, _SCALARS_XS, _SCALARS_YS)
    tree_allclose(got, _jit_loop(_weighted_parts, w0, start, True), rtol=1e-6)


def _loss_parts(w, loss_weights, x, y):  # (the same, the names sharing a word)
    def parts(w):
        return {"ce": jnp.mean((x @ w - y) ** 2), "l2": jnp.sum(w**2)}

    g = jax.grad(lambda w: sum(loss_weights[k] * v for k, v in parts(w).items()))(w)
    loss_parts = {k: loss_weights[k] * v for k, v in parts(w).items()}
    return w - 0.1 * g, loss_parts


def _loss_parts_camel(w, lossWeights, x, y):  # noqa: N803 (camel case, as some code has it)
    def parts(w):
        return {"ce": jnp.mean((x @ w - y) ** 2), "l2": jnp.sum(w**2)}

    g = jax.grad(lambda w: sum(lossWeights[k] * v for k, v in parts(w).items()))(w)
    lossParts = {k: lossWeights[k] * v for k, v in parts(w).items()}  # noqa: N806
    return w - 0.1 * g, lossParts


@claim(
    "docs/roles.md",
    "nor is a word its returned name shares with it beside others (only a name of its own words, beside words for new, is: `new_weights` for `expert_weights`)",
)
def _asked_then_broadcast(fn, start):
    """`fn(w, weights, x, y)` at num_steps=4 asks whether its dict is broadcast; declared
    so, it equals the jax.jit loop."""
    w0 = jnp.ones(3)
    param = list(inspect.signature(fn).parameters)[1]
    with pytest.raises(autoflat.OptionError, match=f'broadcast="{param}"'):
        autoflat.step(fn, num_steps=4)(w0, start, _SCALARS_XS, _SCALARS_YS)
    got = autoflat.step(fn, num_steps=4, broadcast=param)(w0, start, _SCALARS_XS, _SCALARS_YS)
    tree_allclose(got, _jit_loop(fn, w0, start, True), rtol=1e-6)


@claim("docs/roles.md", "`loss_parts` beside `loss_weights` too")
@pytest.mark.parametrize("fn", [_loss_parts, _loss_parts_camel])
def test_loss_weights_and_parts_sharing_a_word_of_their_names_are_asked_about(fn):
    """`loss_weights` beside `loss_parts` (or `lossWeights`, `lossParts`): a word of the names
    is no more evidence than the keys; only the dict's own name, or it with a word for new,
    is."""
    _asked_then_broadcast(fn, {"ce": jnp.float32(1.0), "l2": jnp.float32(0.01)})


def _log_space_parts(w, log_weights, x, y):  # (loss weights kept as logs)
    def parts(w):
        return {"ce": jnp.mean((x @ w - y) ** 2), "l2": jnp.sum(w**2)}

    g = jax.grad(lambda w: sum(jnp.exp(log_weights[k]) * v for k, v in parts(w).items()))(w)
    return w - 0.1 * g, {k: jnp.exp(log_weights[k]) * v for k, v in parts(w).items()}


def _normalised_parts(w, weights, x, y):  # (loss weights normalised to sum to one)
    total = weights["ce"] + weights["l2"]

    def parts(w):
        return {"ce": jnp.mean((x @ w - y) ** 2), "l2": jnp.sum(w**2)}

    g = jax.grad(lambda w: sum(weights[k] / total * v for k, v in parts(w).items()))(w)
    return w - 0.1 * g, {k: weights[k] / total * v for k, v in parts(w).items()}


@pytest.mark.parametrize("fn", [_log_space_parts, _normalised_parts])
def test_loss_weights_through_a_value_of_their_own_beside_the_parts_are_asked_about(fn):
    """The weighted parts weigh by a value of the dict's leaf alone (`jnp.exp(log_w)`, `w /
    total`), not the leaf itself: the keys are no evidence either (carried silently
    before, each step weighing by the last step's weighted losses)."""
    _asked_then_broadcast(fn, {"ce": jnp.float32(1.0), "l2": jnp.float32(0.1)})


def _named_scale(w, ls, x, y):  # (a dynamic loss scale kept in a dict)
    g = jax.grad(lambda w: ls["scale"] * jnp.mean((x @ w - y) ** 2))(w) / ls["scale"]
    finite = jnp.all(jnp.isfinite(g))
    return w - 0.1 * g, {
        "scale": ls["scale"] * jnp.where(finite, 2.0, 0.5),
        "good": jnp.where(finite, ls["good"] + 1, 0.0),
    }


def _named_extremes(w, st, x, y):  # (the largest and smallest loss so far, in a dict)
    loss, g = _scalar_loss(w, x, y)
    return w - 0.1 * g, {"max": jnp.maximum(st["max"], loss), "min": jnp.minimum(st["min"], loss)}


def _ema_by_step(w, ema, x, y):  # (TF's ExponentialMovingAverage(num_updates=...) in a dict)
    loss, g = _scalar_loss(w, x, y)
    d = jnp.minimum(0.99, (1.0 + ema["n"]) / (10.0 + ema["n"]))
    d = d * jnp.where(jnp.isfinite(loss), 1.0, 0.0) + jnp.abs(jnp.mean(x)) * 0.0
    return w - 0.1 * g, {
        "loss": d * ema["loss"] + (1 - d) * loss,
        "gnorm": (1 - d) * jnp.linalg.norm(g) + d * ema["gnorm"],
        "n": ema["n"] + 1.0,
    }


def _welford_literal_first(w, st, x, y):  # (the count updated as `b + n`)
    b = 8.0
    mean = (st["n"] * st["mean"] + b * jnp.mean(y)) / (st["n"] + b)
    return w - 0.1 * _scalar_loss(w, x, y)[1], {"mean": mean, "n": b + st["n"]}


@pytest.mark.parametrize(
    ("fn", "start"),
    [
        (_named_scale, {"scale": 2.0**8, "good": 0.0}),
        (_named_extremes, {"max": -9, "min": 9}),
        (_ema_by_step, {"loss": 0.0, "gnorm": 0.0, "n": 0.0}),
        (_welford_literal_first, {"mean": 0.0, "n": 1.0}),
    ],
)
def test_scalar_state_with_named_parts_computed_from_itself_is_still_carried(fn, start):
    """The named-parts evidence still holds where no leaf is a value of the step times the
    dict's own leaf and nothing more: a dynamic loss scale times `jnp.where(finite, 2.0,
    0.5)`, a dict of running extremes, EMAs whose decay comes from the data (`d * ema["loss"]
    + (1 - d) * loss`, either term first), a mean over a count `(n * mean + b * m) / (n + b)`.
    Carried, equal to a `jax.jit` loop."""
    w0, start = jnp.ones(3), {k: jnp.float32(v) for k, v in start.items()}
    step = autoflat.step(fn, num_steps=4)
    got = step(w0, start, _SCALARS_XS, _SCALARS_YS)
    assert "state (matched by value" in autoflat.show(step)
    tree_allclose(got, _jit_loop(fn, w0, start))


def _reg_logged(w, wd, x, y):
    g = jax.grad(lambda w: jnp.mean((x @ w - y) ** 2) + 0.5 * wd * jnp.sum(w**2))(w)
    reg = 0.5 * wd * jnp.sum(w**2)
    return w - 0.1 * g, reg


def _kd_logged(w, temp, x, y):
    teacher = x @ jnp.ones(3)

    def kd_of(w):
        return jnp.mean((jax.nn.sigmoid(x @ w / temp) - jax.nn.sigmoid(teacher / temp)) ** 2)

    kd, g = jax.value_and_grad(kd_of)(w)
    return w - 0.1 * g, kd * temp**2


@pytest.mark.parametrize("fn", [_reg_logged, _kd_logged])
def test_a_scalar_hyperparameter_weighing_a_logged_term_at_its_place_is_asked_about(fn):
    """A scalar array at its own place beside a logged term it weighs (`reg = 0.5 * wd *
    jnp.sum(w**2)`, `kd * temp**2`): a product of it and a value of the step does not update
    it, as `w - lr * g` or `0.9 * m + 0.1 * g` would, so it is not its new value by its
    last operation (`wd * reg` was carried as the new `wd`, silently). Now the error
    naming `broadcast=`, which equals `jax.jit`."""
    w0, hp = jnp.ones(3), jnp.float32(0.5)
    with pytest.raises(autoflat.OptionError) as e:
        autoflat.step(fn, num_steps=4)(w0, hp, _SCALARS_XS, _SCALARS_YS)
    name = "wd" if fn is _reg_logged else "temp"
    assert f'broadcast="{name}"' in str(e.value)
    step = autoflat.step(fn, num_steps=4, broadcast=name)
    tree_allclose(step(w0, hp, _SCALARS_XS, _SCALARS_YS), _jit_loop(fn, w0, hp, True))


def _warmup_logged(w, lr, step, x, y):  # (the rate this step used, returned to be logged)
    lr_t = lr * jnp.where(step < 2, 0.1, 1.0)
    _, g = _scalar_loss(w, x, y)
    return w - lr_t * g, lr_t, step + 1


def _step_decay(w, lr, step, x, y):  # (a step schedule kept as state: the new rate as `lr`)
    lr = lr * jnp.where(step % 2 == 1, 0.5, 1.0)
    _, g = _scalar_loss(w, x, y)
    return w - lr * g, lr, step + 1


def _step_decay_new(w, lr, step, x, y):
    new_lr = lr * jnp.where(step % 2 == 1, 0.5, 1.0)
    _, g = _scalar_loss(w, x, y)
    return w - lr * g, new_lr, step + 1


def _step_decay_inline(w, lr, step, x, y):
    _, g = _scalar_loss(w, x, y)
    return w - lr * g, lr * jnp.where(step % 2 == 1, 0.5, 1.0), step + 1


def _rate_loop(fn, lr_is_state):
    w, lr, step, lrs = jnp.ones(3), jnp.float32(0.1), jnp.int32(0), []
    for i in range(4):
        w, lr_out, step = jax.jit(fn)(w, lr, step, _SCALARS_XS[i], _SCALARS_YS[i])
        lrs.append(lr_out)
        lr = lr_out if lr_is_state else lr
    return w, (lr if lr_is_state else jnp.stack(lrs)), step


def test_a_rate_times_a_picked_factor_under_a_name_of_its_own_is_asked_about():
    """A warmup: `lr_t = lr * jnp.where(step < 2, 0.1, 1.0)`, the rate this step used,
    returned at `lr`'s place to be logged. Read as a schedule on the rate, it was carried at
    num_steps > 1 (every step of a call multiplied the rate by 0.1 again), silently wrong.
    Now the error naming both fixes; `broadcast="lr"` equals `jax.jit`."""
    args = (jnp.ones(3), jnp.float32(0.1), jnp.int32(0), _SCALARS_XS, _SCALARS_YS)
    with pytest.raises(autoflat.OptionError) as e:
        autoflat.step(_warmup_logged, num_steps=4)(*args)
    message = str(e.value)
    assert "return position 1 (`lr_t`, computed from `lr`)" in message
    assert "`lr` times a factor the step picks among constants" in message
    assert 'broadcast="lr"' in message and 'state={"lr": 1}' in message
    # (with `lr` broadcast, `step` ranks second among what could be state: its place is
    # `lr_t`'s, so `step + 1` is given back away from it, and that is asked too)
    with pytest.raises(autoflat.OptionError, match=r'state=\{"step": 2\}'):
        autoflat.step(_warmup_logged, num_steps=4, broadcast="lr")(*args)
    step = autoflat.step(_warmup_logged, num_steps=4, broadcast="lr", state={"step": 2})
    tree_allclose(step(*args), _rate_loop(_warmup_logged, False))


@pytest.mark.parametrize("fn", [_step_decay, _step_decay_new, _step_decay_inline])
def test_a_step_schedule_on_a_rate_given_back_as_its_new_value_is_carried(fn):
    """A step schedule kept as state (`lr * jnp.where(step % 2 == 1, 0.5, 1.0)`) given back
    under the rate's own name, its new value's (`new_lr`) or as an expression at its place:
    carried, equal to a `jax.jit` loop feeding the rate back."""
    args = (jnp.ones(3), jnp.float32(0.1), jnp.int32(0), _SCALARS_XS, _SCALARS_YS)
    step = autoflat.step(fn, num_steps=4)
    tree_allclose(step(*args), _rate_loop(fn, True))


def _reg_strength(w, reg_strength, x, y):  # (the penalty logged at its weight's place)
    def total(w):
        reg = jnp.sum(w**2)
        return jnp.mean((x @ w - y) ** 2) + reg_strength * reg, reg

    (loss, reg), g = jax.value_and_grad(total, has_aux=True)(w)
    return w - 0.1 * g, reg, loss


def _grad_clip(w, grad_clip, x, y):  # (the gradient norm logged at the threshold's place)
    loss, g = _scalar_loss(w, x, y)
    grad_norm = jnp.linalg.norm(g)
    return w - 0.1 * g * jnp.minimum(1.0, grad_clip / grad_norm), grad_norm, loss


def _best_loss(w, best_loss, x, y):  # (the loss at the best loss's place, the best after it)
    loss, g = _scalar_loss(w, x, y)
    return w - 0.1 * g, loss, jnp.minimum(best_loss, loss)


def _clipped_velocity(w, v, x, y):  # (the new velocity after the loss)
    loss, g = _scalar_loss(w, x, y)
    vel = jnp.clip(0.9 * v - 0.1 * g, -1.0, 1.0)
    return w + vel, loss, vel


@pytest.mark.parametrize(
    ("fn", "name", "fix", "start"),
    [
        (_reg_strength, "reg_strength", {"broadcast": "reg_strength"}, jnp.float32(0.1)),
        (_grad_clip, "grad_clip", {"broadcast": "grad_clip"}, jnp.float32(1.0)),
        (_best_loss, "best_loss", {"state": {"best_loss": 2}}, jnp.float32(9.0)),
        (_clipped_velocity, "v", {"state": {"v": 2}}, jnp.zeros(3)),
    ],
)
def test_a_bare_array_beside_a_value_only_sharing_a_word_or_away_from_its_place_is_asked_about(
    fn, name, fix, start
):
    """A review's silent wrong results at num_steps > 1: a value at a bare array's place
    whose name only shares a word with it (`reg` for `reg_strength`, `grad_norm` for
    `grad_clip`, `loss` for `best_loss`) was carried as its new value; a new value given
    back after the loss but not made by an addition (`jnp.clip(0.9 * v - 0.1 * g, -1, 1)`)
    left it broadcast. Now each is the error naming the fix, which equals `jax.jit`."""
    w0 = jnp.ones(3)
    with pytest.raises(autoflat.OptionError) as e:
        autoflat.step(fn, num_steps=4)(w0, start, _SCALARS_XS, _SCALARS_YS)
    [(option, value)] = fix.items()
    assert (f'broadcast="{name}"' if option == "broadcast" else f'"{name}": 2') in str(e.value)
    step = autoflat.step(fn, num_steps=4, **fix)
    w, p, outs = w0, start, []
    for i in range(4):
        w, a, b = jax.jit(fn)(w, p, _SCALARS_XS[i], _SCALARS_YS[i])
        outs.append((a, b))
        p = b if option == "state" else p
    stacked = [jnp.stack(o) for o in zip(*outs, strict=True)]
    want = (w, *stacked) if option == "broadcast" else (w, stacked[0], p)
    tree_allclose(step(w0, start, _SCALARS_XS, _SCALARS_YS), want)


def _distill_step(student, opt_state, teacher, x, y, distill_weight=0.5):
    t = x @ teacher

    def full(w):
        s = x @ w
        distill_loss = distill_weight * jnp.mean((s - t) ** 2)
        return jnp.mean((s - y) ** 2) + distill_loss, distill_loss

    (loss, distill_loss), g = jax.value_and_grad(full, has_aux=True)(student)
    u, opt_state = _TX.update(g, opt_state, student)
    return optax.apply_updates(student, u), opt_state, loss, distill_loss


def test_a_hyperparameter_sharing_a_word_with_a_returned_metric_stays_static():
    """`distill_weight` (a default, its place shifted by the broadcast teacher onto the
    returned `distill_loss`, computed from it and sharing a word): it was carried, so each
    step weighted by the one before's loss and one loss came back for four steps. A name
    only sharing a word says nothing; it stays static, as `jax.jit` loops give."""
    s0, teacher = jnp.ones(3), jnp.full(3, 0.5)
    xs = jax.random.normal(jax.random.key(0), (4, 8, 3))
    ys = jax.random.normal(jax.random.key(1), (4, 8))
    step = autoflat.step(_distill_step, num_steps=4)
    s, o, losses, distill = step(s0, _TX.init(s0), teacher, xs, ys)
    assert "# distill_weight: static" in autoflat.show(step)
    ref, outs = (s0, _TX.init(s0)), []
    for i in range(4):
        *ref, loss, d = jax.jit(_distill_step)(ref[0], ref[1], teacher, xs[i], ys[i])
        outs.append((loss, d))
    tree_allclose((s, o, losses, distill), (*ref, *(jnp.stack(m) for m in zip(*outs, strict=True))))


def _dqn_update(online, target, opt_state, x, y):
    def td_loss(p):
        bootstrap = y + 0.9 * (x @ target["w"] + target["b"])
        return jnp.mean((x @ p["w"] + p["b"] - bootstrap) ** 2)

    loss, grads = jax.value_and_grad(td_loss)(online)
    grads = jax.tree.map(lambda g: jnp.clip(g, -1.0, 1.0), grads)
    updates, opt_state = _TX.update(grads, opt_state, online)
    return optax.apply_updates(online, updates), opt_state, loss, grads


def test_gradients_rebound_leaf_by_leaf_are_still_gradients():
    """A DQN step logging its gradients after clipping them (`grads = jax.tree.map(clip,
    grads)`) beside a target network of their type: the rebound name was not taken for
    gradients, so the target matched the logged gradients by value and was carried, each
    step bootstrapping from the one before's gradients. Now the position holds gradients:
    an error asks, and `broadcast="target"` equals a `jax.jit` loop."""
    online = {"w": jnp.ones(3), "b": jnp.zeros(())}
    target = {"w": jnp.full(3, 0.5), "b": jnp.ones(())}
    xs = jax.random.normal(jax.random.key(0), (4, 8, 3))
    ys = jax.random.normal(jax.random.key(1), (4, 8))
    with pytest.raises(autoflat.OptionError, match="it holds gradients") as e:
        autoflat.step(_dqn_update, num_steps=4)(online, target, _TX.init(online), xs, ys)
    assert 'broadcast="target"' in str(e.value)
    step = autoflat.step(_dqn_update, num_steps=4, broadcast="target", lazy=False)
    got = step(online, target, _TX.init(online), xs, ys)
    ref, outs = (online, _TX.init(online)), []
    for i in range(4):
        *ref, loss, g = jax.jit(_dqn_update)(ref[0], target, ref[1], xs[i], ys[i])
        outs.append((loss, g))
    want = (*ref, *(jax.tree.map(lambda *m: jnp.stack(m), *o) for o in zip(*outs, strict=True)))
    tree_allclose(got, want)


def _get_updates(params, opt_state, batch):
    # dm-haiku examples/mnist_pruning.py's `get_updates`: the caller applies the updates
    # (masked) between calls
    grads = jax.grad(lambda p: jnp.sum((batch @ p["w"]) ** 2))(params)
    updates, opt_state = _TX.update(grads, opt_state)
    return updates, opt_state


_DECAY_LAST = optax.chain(optax.adam(0.1), optax.add_decayed_weights(1e-2))


def _get_decayed_updates(params, opt_state, batch):
    # the decay is the last operation: it takes `params`' own arrays, and still gives updates
    grads = jax.grad(lambda p: jnp.sum((batch @ p["w"]) ** 2))(params)
    updates, opt_state = _DECAY_LAST.update(grads, opt_state, params)
    return updates, opt_state


_CONFIG = {"tx": _DECAY_LAST}


def _get_updates_of_a_looked_up_optimizer(params, opt_state, batch):
    # the optimizer written so that the first call cannot look it up: its state tells
    grads = jax.grad(lambda p: jnp.sum((batch @ p["w"]) ** 2))(params)
    updates, opt_state = _CONFIG["tx"].update(grads, opt_state, params)
    return updates, opt_state


def _scaled_gradients(params, batch):
    grads = jax.grad(lambda p: jnp.sum((batch @ p["w"]) ** 2))(params)
    updates = jax.tree.map(lambda g: -0.1 * g, grads)
    return updates


@pytest.mark.parametrize(
    "fn",
    [_get_updates, _get_decayed_updates, _get_updates_of_a_looked_up_optimizer, _scaled_gradients],
)
def test_an_optimizers_updates_are_not_the_new_parameters(fn):
    """`updates, opt_state = tx.update(grads, opt_state)` and `updates = jax.tree.map(f,
    grads)` are gradients transformed: at num_steps=4 they were matched by value as the new
    `params` (each step's updates taken as the next step's parameters, silently). They are
    per-step outputs, and `params` is broadcast, as in four `jax.jit` calls."""
    params = {"w": jnp.ones(3)}
    xs = jax.random.normal(jax.random.key(0), (4, 2, 3))
    tx = {
        _get_updates: _TX,
        _get_decayed_updates: _DECAY_LAST,
        _get_updates_of_a_looked_up_optimizer: _DECAY_LAST,
    }.get(fn)
    rest = (tx.init(params),) if tx is not None else ()
    step = autoflat.step(fn, num_steps=4)
    got = autoflat.unwrap(step(params, *rest, xs))
    assert "params: broadcast" in autoflat.show(step)
    outs, state = [], rest
    for i in range(4):
        out = jax.jit(fn)(params, *state, xs[i])
        outs.append(out[0] if rest else out)
        state = out[1:] if rest else ()
    stacked = jax.tree.map(lambda *u: jnp.stack(u), *outs)
    tree_allclose(got, (stacked, *state) if rest else stacked)


class _HandWrittenSGD:
    """An optimizer whose `update` gives the new parameters (not optax's updates)."""

    def update(self, grads, state, params):
        new = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
        return new, state + 1


def _hand_written_update(params, opt_state, batch):
    grads = jax.grad(lambda p: jnp.sum((batch @ p["w"]) ** 2))(params)
    new_params, opt_state = _HandWrittenSGD().update(grads, opt_state, params)
    return new_params, opt_state


def test_a_hand_written_optimizers_update_giving_new_parameters_is_matched():
    """`new_params, opt_state = opt.update(grads, opt_state, params)` where `update` gives
    the new parameters (its last operation takes `params`' own arrays): state, as in a
    `jax.jit` loop; optax's updates (taking no parameter's arrays last) are not."""
    params, xs = {"w": jnp.ones(3)}, jax.random.normal(jax.random.key(0), (4, 2, 3))
    want = (params, jnp.asarray(0))
    for i in range(4):
        want = jax.jit(_hand_written_update)(*want, xs[i])
    step = autoflat.step(_hand_written_update, num_steps=4)
    tree_allclose(autoflat.unwrap(step(params, jnp.asarray(0), xs)), want)
    assert "# params: state (matched by value to return position 0)" in autoflat.show(step)


def _mse(p, x, y):
    return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)


def _stage_metric(params, x, y, epoch):  # an int metric made from a static epoch
    loss, g = jax.value_and_grad(_mse)(params, x, y)
    params = jax.tree.map(lambda p, g: p - 0.1 / (1 + epoch) * g, params, g)
    return params, loss, epoch // 10 + 1


def _seen(params, step, x, y, n_devices=2):  # a counter, and examples seen from a static int
    loss, g = jax.value_and_grad(_mse)(params, x, y)
    params = jax.tree.map(lambda p, g: p - 0.1 / n_devices * g, params, g)
    return params, step + 1, loss, x.shape[0] * n_devices


def _entropy_gap(params, x, y, target_entropy):  # a number minus a metric: no sum
    loss, g = jax.value_and_grad(_mse)(params, x, y)
    ent = -jnp.mean(jax.nn.log_softmax(x @ params["w"]))
    params = jax.tree.map(lambda p, g: p - 0.1 * g, params, g)
    return params, loss, target_entropy - ent


def _momentum_sgd(params, momentum, x, y):  # gradients mapped with the momentum: its new value
    loss, grads = jax.value_and_grad(_mse)(params, x, y)
    grads = jax.tree.map(lambda g, m: 0.9 * m + g, grads, momentum)
    params = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
    return params, grads, loss


def _halved_input(carry, x, w):  # an RNN carry holding this step's input, transformed
    h, prev = carry
    h = jnp.tanh(h * w + x - prev)
    return (h, x / 2.0), h.sum()


@pytest.mark.parametrize(
    ("fn", "state", "rest"),
    [
        (_stage_metric, {0: 0}, (3,)),
        (_seen, {0: 0, 1: 1}, ()),
        (_entropy_gap, {0: 0}, (-3.0,)),
        (_entropy_gap, {0: 0}, (0.0,)),
        (_momentum_sgd, {0: 0, 1: 1}, ()),
        (_halved_input, {0: 0}, ()),
    ],
)
def test_numbers_gradients_and_carries_read_as_jax_jit_loops_read_them(fn, state, rest):
    """Steps a too-wide reading of rule 8, of gradients and of unlinked containers got
    wrong (found by review; each runs under `jax.jit`): a static `epoch` carried as the
    int metric made from it, `n_devices` as the examples seen, `target_entropy` as a sum
    (or refused); gradients mapped with a momentum refused as gradients; an RNN carry
    holding `x / 2` refused. Each equals a loop of `jax.jit` over four steps."""
    params = {"w": jnp.ones(3), "b": jnp.zeros(())}
    xs = jax.random.normal(jax.random.key(0), (4, 8, 3))
    ys = jax.random.normal(jax.random.key(1), (4, 8))
    starts = {
        _stage_metric: (params, xs, ys),
        _seen: (params, 0, xs, ys),
        _entropy_gap: (params, xs, ys),
        _momentum_sgd: (params, jax.tree.map(jnp.zeros_like, params), xs, ys),
        _halved_input: ((jnp.zeros((8, 3)), jnp.zeros((8, 3))), xs, 0.5),
    }
    args = [*starts[fn], *rest]
    per_step = [i for i, a in enumerate(args) if a is xs or a is ys]
    got = autoflat.step(fn, num_steps=4, lazy=False)(*args)
    outs = []
    for i in range(4):
        out = jax.jit(fn)(*(a[i] if j in per_step else a for j, a in enumerate(args)))
        for j, pos in state.items():
            args[j] = out[pos]
        outs.append([o for pos, o in enumerate(out) if pos not in state.values()])
    want = [args[j] for j in state] + [jnp.stack(o) for o in zip(*outs, strict=True)]
    tree_allclose(list(got), want)


def _epoch_then_step(w, epoch, step, x):
    lr = 0.1 / (1 + step) * 0.5**epoch
    return w - lr * jnp.mean(x) * w, step + 1


def _teacher_epoch_step(w, teacher, epoch, step, x):
    lr = 0.1 / (1 + step) * 0.5**epoch
    return w - lr * jnp.mean(x) * (w - teacher), step + 1


@pytest.mark.parametrize("epoch", [2, 0])
def test_a_counter_given_back_at_another_number_s_place_is_its_own(epoch):
    """`(w, epoch, step, x)` returning `w, step + 1`: the position at `epoch`'s place among
    the parameters that could be state is `step + 1`, computed from `step` alone. It was
    taken for `epoch`'s new value (a ShapeError blaming `epoch`, at num_steps > 1), and with
    `epoch=0` also `step`'s: both ints plus one. Now `step` is carried and `epoch` static,
    as a loop of `jax.jit` reads them; also where a broadcast teacher shifts the places."""
    xs = jnp.arange(12.0).reshape(4, 3) / 10
    for fn, rest in ((_epoch_then_step, ()), (_teacher_epoch_step, (jnp.full(3, 0.5),))):
        step = autoflat.step(fn, num_steps=4)
        got = step(jnp.ones(3), *rest, epoch, 0, xs)
        header = autoflat.show(step)
        assert "# epoch: static (a Python int" in header
        assert "# step: state (a Python int that return position 1 gives back changed" in header
        w, count = jnp.ones(3), 0
        for i in range(4):
            w, count = jax.jit(fn, static_argnums=len(rest) + 1)(w, *rest, epoch, count, xs[i])
        tree_allclose(got, (w, count))


def _clip_update(p, g, lr):
    return {"w": jnp.clip(p["w"] - lr * g["w"], -0.5, 0.5)}


def _twin_critics(q1, q2, x):
    """Twin critics with clipped updates: each new value computed from both (the target),
    its last operation a clip, so the data flow ties and the names' digits tell them apart."""
    t = jax.lax.stop_gradient(jnp.minimum(x @ q1["w"], x @ q2["w"]))
    l1, g1 = jax.value_and_grad(lambda q: jnp.mean((x @ q["w"] - t - 1.0) ** 2))(q1)
    l2, g2 = jax.value_and_grad(lambda q: jnp.mean((x @ q["w"] - t - 1.0) ** 2))(q2)
    new_q1 = _clip_update(q1, g1, 0.1)
    new_q2 = _clip_update(q2, g2, 0.05)
    return new_q2, new_q1, l1 + l2


@pytest.mark.parametrize("k", [1, K])
def test_twins_told_apart_by_the_digits_of_their_names(k):
    q1, q2 = {"w": jnp.array([0.3, -0.2, 0.1])}, {"w": jnp.array([-0.1, 0.4, 0.2])}
    xs = _batches(8, (5, 3), seed=3)
    ref = jax.jit(_twin_critics)
    r1, r2 = q1, q2
    for i in range(8):
        r2, r1, _ = ref(r1, r2, xs[i])
    step = autoflat.step(_twin_critics, num_steps=k)
    a1, a2 = q1, q2
    for start in range(0, 8, k):
        a2, a1, _ = step(a1, a2, xs[start : start + k] if k > 1 else xs[start])
    tree_allclose((a1, a2), (r1, r2), rtol=1e-6)
    assert "# q1: state (matched by value" in autoflat.show(step)


def _logged_batch(w, xs):
    x = xs / 255.0
    w = w + 0.01 * jnp.mean(x)
    return w, x


def test_a_per_step_input_logged_under_a_shorter_name_is_per_step():
    """`x` for `xs` (no word for new): a preprocessed batch given back, per step, as the
    leading axis says; no question asked."""
    xs = _batches(K, (K,), seed=5)
    (rw,), outs = _reference(_logged_batch, (jnp.zeros(K),), (xs,), K)
    step = autoflat.step(_logged_batch, num_steps=K)
    w, logged = step(jnp.zeros(K), xs)
    tree_allclose(w, rw, rtol=1e-6)
    tree_allclose(logged, jnp.stack([o[0] for o in outs]), rtol=1e-6)


def _hedge(w, expert_weights, x, y):
    """Hedge-style expert weights, each decayed by its expert's loss, returned as
    `new_weights`: a name of the dict's own words (beside a word for new)."""
    losses = {"a": jnp.mean((x @ w - y) ** 2), "b": jnp.mean((x @ (2.0 * w) - y) ** 2)}
    new_weights = {k: expert_weights[k] * jnp.exp(-0.1 * losses[k]) for k in losses}
    g = jax.grad(lambda w: jnp.mean((x @ w - y) ** 2))(w)
    return w - 0.1 * g, new_weights


def test_multiplicative_dict_state_under_a_name_of_its_own_words_is_carried():
    w0, start = jnp.ones(3), {"a": jnp.float32(1.0), "b": jnp.float32(1.0)}
    step = autoflat.step(_hedge, num_steps=4)
    got = step(w0, start, _SCALARS_XS, _SCALARS_YS)
    tree_allclose(got, _jit_loop(_hedge, w0, start, False), rtol=1e-6)
    assert "# expert_weights: state (matched by value" in autoflat.show(step)


def _indexes_too_deep(w, batch):
    def loss_fn(w):  # (a bug: x is 2-D in a step; the whole chunk is 3-D)
        return jnp.mean(batch["x"][:, :, 0]) * jnp.sum(w**2) + jnp.mean(batch["y"])

    loss, g = jax.value_and_grad(loss_fn)(w)
    w = w - 0.1 * g
    return w, loss


def test_a_bug_of_the_step_on_a_per_step_batch_is_its_own_error():
    """Carried whole, the batch would make the buggy step trace, but nothing the step gives
    back could be it: JAX's own error, with the step's line, as under `jax.jit`."""
    batch = {"x": jnp.ones((K, 5, 3)), "y": jnp.ones((K, 5))}
    with pytest.raises(IndexError, match="Too many indices"):
        jax.jit(_indexes_too_deep)(jnp.ones(3), jax.tree.map(lambda a: a[0], batch))
    with pytest.raises(IndexError, match="Too many indices"):
        autoflat.step(_indexes_too_deep, num_steps=K)(jnp.ones(3), batch)


def _rnn(W, h, x):
    """A hidden state of a batch of 4 carried across steps: at num_steps=4 `h` looks per-step,
    and one step's slice of it, broadcast against the batch, gives back its whole shape."""
    h_next = jnp.tanh(x @ W["wx"] + h @ W["wh"])
    loss, g = jax.value_and_grad(lambda W: jnp.mean(jnp.tanh(x @ W["wx"] + h @ W["wh"]) ** 2))(W)
    return jax.tree.map(lambda p, g: p - 0.1 * g, W, g), h_next, loss


@claim(
    "docs/roles.md",
    "so is one whose slice, broadcast against another per-step input, gives back its whole shape there (an RNN's hidden state `h` of a batch of 4 at `num_steps=4`, `return W, h_next, loss`)",
)
def test_a_hidden_state_of_a_batch_of_num_steps_is_asked_about():
    W = {"wx": jnp.full((3, 5), 0.1), "wh": jnp.eye(5) * 0.5}
    h0 = jnp.full((K, 5), 0.1)
    xs = _batches(K, (K, 3), seed=7)
    with pytest.raises(autoflat.ShapeError) as info:
        autoflat.step(_rnn, num_steps=K)(W, h0, xs)
    message = str(info.value)
    assert "its whole shape computed from one step's slice of it" in message
    assert 'state="h"' in message and 'per_step="h"' in message
    (rW, rh), _ = _reference(_rnn, (W, h0), (xs,), K)
    (gW, gh), _ = _run(autoflat.step(_rnn, num_steps=K, state="h"), (W, h0), (xs,), K, K)
    tree_allclose((gW, gh), (rW, rh), rtol=1e-5)


def _rnn_expression(W, h, x):
    """`_rnn`, its hidden state returned as an expression: no name to go by."""
    h_next = jnp.tanh(x @ W["wx"] + h @ W["wh"])
    loss, g = jax.value_and_grad(lambda W: jnp.mean(jnp.tanh(x @ W["wx"] + h @ W["wh"]) ** 2))(W)
    return jax.tree.map(lambda p, g: p - 0.1 * g, W, g), jax.lax.stop_gradient(h_next), loss


def _lstm_tuple(W, carry, x):
    """An LSTM-style carry `(h, c)` of a batch of 4, written as a tuple in the return."""
    h, c = carry

    def loss_fn(W):
        c_new = 0.9 * c + jnp.tanh(x @ W["wx"] + h @ W["wh"])
        h_new = jnp.tanh(c_new)
        return jnp.mean(h_new**2), (h_new, c_new)

    (loss, (h_new, c_new)), g = jax.value_and_grad(loss_fn, has_aux=True)(W)
    return jax.tree.map(lambda p, g: p - 0.1 * g, W, g), (h_new, c_new), loss


def _carry_with_counter(W, carry, x):
    """A hidden state beside a per-sequence counter: sliced, the counter keeps one step's
    shape while the hidden state comes back whole."""
    h, t = carry
    h = jnp.tanh(x @ W["wx"] + h @ W["wh"] + 0.01 * t[..., None])
    new_carry = (h, t + 1.0)
    return W, new_carry, jnp.mean(h)


def _lstm_dict(W, state, x):
    """The same carry as a dict written in the return, the weights only read."""
    c_new = 0.9 * state["c"] + jnp.tanh(x @ W["wx"] + state["h"] @ W["wh"])
    h_new = jnp.tanh(c_new)
    return W, {"h": h_new, "c": c_new}, jnp.mean(h_new**2)


@claim(
    "docs/roles.md",
    "and so at any open return position computed from a contraction that takes its own value (a matrix product, `h @ wh`, as a recurrent cell computes its new state), where it is an expression (`return W, jax.lax.stop_gradient(h_next), loss`) or a tuple or a dict written in the return (an LSTM's carry `(h_new, c_new)`, or `(h_new, t + 1)` whose counter keeps one step's shape)",
)
@pytest.mark.parametrize(
    ("update", "name", "carry"),
    [
        (_rnn_expression, "h", lambda h: h),
        (_lstm_tuple, "carry", lambda h: (h, h + 0.1)),
        (_lstm_dict, "state", lambda h: {"h": h, "c": h + 0.1}),
        (_carry_with_counter, "carry", lambda h: (h, jnp.zeros(K))),
    ],
)
def test_a_carry_of_a_batch_of_num_steps_given_back_unnamed_is_asked_about(update, name, carry):
    """Sliced per step, each step would start from one row of the last chunk's carry (all
    three trained silently wrong before)."""
    W = {"wx": jnp.full((3, 5), 0.1), "wh": jnp.eye(5) * 0.5}
    c0 = carry(jnp.full((K, 5), 0.1))
    xs = _batches(2 * K, (K, 3), seed=7)
    with pytest.raises(autoflat.ShapeError) as info:
        autoflat.step(update, num_steps=K)(W, c0, xs[:K])
    message = str(info.value)
    assert f"every array of `{name}` has a leading axis of 4" in message
    assert "return position 1 gives back a value with its whole" in message
    assert f'state="{name}"' in message and f'per_step="{name}"' in message
    ref, _ = _reference(update, (W, c0), (xs,), 2 * K)
    got, _ = _run(autoflat.step(update, num_steps=K, state=name), (W, c0), (xs,), 2 * K, K)
    tree_allclose(autoflat.unwrap(got), ref, rtol=1e-5)


def _predictions_of_a_batch(w, x, y):
    """Residuals of a batch of 4 at num_steps=4, computed from the labels: of one step's
    slice's shape, a per-step output, as the leading axis says."""
    pred = x @ w
    loss, g = jax.value_and_grad(lambda w: jnp.mean((x @ w - y) ** 2))(w)
    return w - 0.1 * g, pred - y, loss


def test_a_per_step_output_of_a_slice_s_shape_is_not_asked_about():
    w0 = jnp.full((3,), 0.1)
    xs, ys = _batches(K, (K, 3), seed=3), _batches(K, (K,), seed=4)
    (rw,), routs = _reference(_predictions_of_a_batch, (w0,), (xs, ys), K)
    (gw,), gouts = _run(autoflat.step(_predictions_of_a_batch, num_steps=K), (w0,), (xs, ys), K, K)
    tree_allclose(gw, rw, rtol=1e-5)
    tree_allclose(gouts[0][0], jnp.stack([o[0] for o in routs]), rtol=1e-5)


def _envs_raw_keys(w, keys, x):
    """Per-environment raw keys (4 environments at num_steps=4) split under `new_keys`,
    beside weights given back as an expression (matched by value)."""
    split = jax.vmap(jax.random.split)(keys)
    new_keys, subs = split[:, 0], split[:, 1]
    noise = jax.vmap(lambda k: jax.random.normal(k, (3,)))(subs)
    loss, g = jax.value_and_grad(lambda w: jnp.mean((x @ w + noise.mean()) ** 2))(w)
    return w - 0.1 * g, new_keys, loss


def test_per_environment_keys_that_fail_sliced_while_matching_ask():
    """The step fails sliced while state is matched by value (before the checks): the
    question still, quoting JAX's key error (which raised bare before)."""
    keys = jax.random.split(jax.random.PRNGKey(0), K)
    w0, xs = jnp.full((3,), 0.1), _batches(2 * K, (5, 3), seed=2)
    with pytest.raises(autoflat.ShapeError) as info:
        autoflat.step(_envs_raw_keys, num_steps=K)(w0, keys, xs[:K])
    message = str(info.value)
    assert "invalid PRNG key data" in message
    assert 'state="keys"' in message and 'per_step="keys"' in message
    assert isinstance(info.value.__context__, TypeError)
    ref, _ = _reference(_envs_raw_keys, (w0, keys), (xs,), 2 * K)
    got, _ = _run(
        autoflat.step(_envs_raw_keys, num_steps=K, state="keys"), (w0, keys), (xs,), 2 * K, K
    )
    tree_allclose(got, ref, rtol=1e-5)


def _annealed(w, beta, x, y):  # (a per-step KL weight times per-example losses, logged)
    per_example = (x @ w - y) ** 2
    loss, g = jax.value_and_grad(lambda w: jnp.mean(beta * (x @ w - y) ** 2))(w)
    return w - 0.1 * g, loss, beta * per_example


def _annealed_logged_at_its_place(w, beta, x, y):  # (as `_annealed`, the log before the loss)
    per_example = (x @ w - y) ** 2
    loss, g = jax.value_and_grad(lambda w: jnp.mean(beta * (x @ w - y) ** 2))(w)
    return w - 0.1 * g, beta * per_example, loss


def _masked(w, valid, x, y):  # (a per-step flag masking the batch's losses, logged)
    per_example = (x @ w - y) ** 2
    loss, g = jax.value_and_grad(lambda w: jnp.mean(valid * (x @ w - y) ** 2))(w)
    return w - 0.1 * g, jnp.where(valid > 0, per_example, 0.0), loss


def _shifted(w, shift, x, y):  # (a per-step feature shift, the augmented batch logged)
    x_aug = x + shift
    loss, g = jax.value_and_grad(lambda w: jnp.mean((x_aug @ w - y) ** 2))(w)
    return w - 0.1 * g, loss, x_aug


def _conditioned(w, style, x, y):  # (a per-step style vector added before a layer)
    loss, g = jax.value_and_grad(lambda w: jnp.mean(((x + style) @ w - y) ** 2))(w)
    return w - 0.1 * g, loss, (x + style) @ w


def _updated_then_predicted(w, beta, x, y):  # (the updated model's predictions logged)
    loss, g = jax.value_and_grad(lambda w: jnp.mean(beta * (x @ w - y) ** 2))(w)
    w = w - 0.1 * g
    return w, loss, x @ w


def _heads(wb, x, y):  # (four heads' per-example losses against the labels)
    per = ((x @ wb).T - y) ** 2
    loss, g = jax.value_and_grad(lambda wb: jnp.mean(((x @ wb).T - y) ** 2))(wb)
    return wb - 0.1 * g, per, loss


@claim(
    "docs/roles.md",
    "a schedule, a shift or labels broadcast elementwise against a batch of 4 (`beta * per_example`, `x + shift`, or `(x + style) @ w`) give back per-step outputs",
)
@pytest.mark.parametrize(
    ("update", "state", "per_step"),
    [
        (_annealed, jnp.zeros(3), (jnp.linspace(0.1, 1.0, K), (K, 3), (K,))),
        (_annealed_logged_at_its_place, jnp.zeros(3), (jnp.linspace(0.1, 1, K), (K, 3), (K,))),
        (_masked, jnp.zeros(3), (jnp.array([1.0, 1.0, 1.0, 0.0]), (K, 3), (K,))),
        (_shifted, jnp.zeros(3), (jnp.full((K, 3), 0.1), (K, 3), (K,))),
        (_heads, jnp.zeros((3, K)), ((8, 3), (8,))),
        (_conditioned, jnp.zeros(3), (jnp.full((K, 3), 0.1), (K, 3), (K,))),
        (_updated_then_predicted, jnp.zeros(3), (jnp.linspace(0.1, 1.0, K), (K, 3), (K,))),
    ],
)
def test_a_per_step_input_broadcast_against_a_batch_of_num_steps_is_per_step(
    update, state, per_step
):
    """A schedule, a shift or labels whose slice, broadcast against a batch (or heads) of
    num_steps, gives back their whole shape, only elementwise: per-step outputs, as the
    leading axis says (a review found them asked about by a first version of the check of
    carries of a batch of num_steps, and the log of a KL weight or a mask written at its
    own place by a rule asking about expressions there). Batches of shape (num_steps,
    batch, ...)."""
    xs = [_batches(K, s, seed=i) if isinstance(s, tuple) else s for i, s in enumerate(per_step)]
    ref, routs = _reference(update, (state,), xs, K)
    got, gouts = _run(autoflat.step(update, num_steps=K), (state,), xs, K, K)
    tree_allclose(got, ref, rtol=1e-5)
    want = jax.tree.map(lambda *o: jnp.stack(o), *routs)
    tree_allclose(gouts[0], want, rtol=1e-5)


def _rnn_einsum(W, h, x):  # (fails sliced: the einsum wants h of a batch)
    h_new = jnp.tanh(jnp.einsum("bd,de->be", h, W) + x)
    return W, h_new, jnp.mean(h_new)


def test_the_sliced_fails_question_quotes_jax_s_error():
    """The question asked while state was matched is not asked again around itself."""
    with pytest.raises(autoflat.ShapeError) as info:
        autoflat.step(_rnn_einsum, num_steps=K)(jnp.eye(5), jnp.zeros((K, 5)), jnp.ones((K, K, 5)))
    assert "fails to trace (ValueError: Einstein sum subscript" in str(info.value)
    assert isinstance(info.value.__context__, ValueError)


def _parts_as_loss(w, loss_weights, x, y):  # (the parts logged under `loss`)
    a, b = loss_weights
    g = jax.grad(lambda w: a * jnp.mean((x @ w - y) ** 2) + b * jnp.sum(w**2))(w)
    loss = (jnp.mean((x @ w - y) ** 2), jnp.sum(w**2))
    return w - 0.1 * g, loss


def test_a_metric_tuple_under_a_modifier_of_the_parameter_s_name_is_asked_about():
    """`loss` for `loss_weights`: a word of its name, but not its head word (`weights`):
    no evidence (carried silently before, each step weighing by the last step's parts)."""
    w0, start = jnp.ones(3), (jnp.float32(1.0), jnp.float32(0.01))
    with pytest.raises(autoflat.OptionError, match='broadcast="loss_weights"'):
        autoflat.step(_parts_as_loss, num_steps=K)(w0, start, _SCALARS_XS, _SCALARS_YS)
    step = autoflat.step(_parts_as_loss, num_steps=K, broadcast="loss_weights")
    got = step(w0, start, _SCALARS_XS, _SCALARS_YS)
    tree_allclose(got, _jit_loop(_parts_as_loss, w0, start, True), rtol=1e-6)


def _plateau(w, lr_state, x, y, *, name):  # (ReduceLROnPlateau: the last loss and the rate)
    prev_loss, lr = lr_state
    loss, g = _scalar_loss(w, x, y)
    new_lr = jnp.where(loss > prev_loss, lr * 0.5, lr)
    return w - new_lr * g, (loss, new_lr)


def _sched_state(w, lr_state, x, y):
    w, sched_state = _plateau(w, lr_state, x, y, name="sched_state")
    return w, sched_state


def _new_lr(w, lr_state, x, y):
    w, new_lr = _plateau(w, lr_state, x, y, name="new_lr")
    return w, new_lr


def _kl_controller(w, kl_state, x, y):  # (a KL target controller's coefficient and last KL)
    beta, _ = kl_state
    loss, g = _scalar_loss(w, x, y)
    kl = jnp.abs(loss - 1.0)
    kl_stats = (beta * jnp.where(kl > 0.5, 1.5, 1 / 1.5), kl)
    return w - 0.1 * g, kl_stats


@pytest.mark.parametrize("fn", [_sched_state, _new_lr, _kl_controller])
def test_tuple_state_with_a_metric_slot_under_its_head_word_is_carried(fn):
    """A plateau scheduler's `(prev_loss, lr)` or a KL controller's `(beta, kl)`, whose
    last-loss slot is not computed from it, returned under a name holding its head word
    (`sched_state` or `new_lr` for `lr_state`, `kl_stats` for `kl_state`): carried, as
    under jax.jit (refused by a first version of the head-word rule)."""
    w0, start = jnp.ones(3), (jnp.float32(9.0), jnp.float32(0.1))
    got = autoflat.step(fn, num_steps=4)(w0, start, _SCALARS_XS, _SCALARS_YS)
    tree_allclose(got, _jit_loop(fn, w0, start), rtol=1e-6)


def _uncertainty_terms(w, sigmas, x, y):  # (terms over fixed variances, logged by key)
    def parts(w):
        return {"mse": jnp.mean((x @ w - y) ** 2), "l2": jnp.sum(w**2)}

    g = jax.grad(lambda w: sum(v / (2 * sigmas[k] ** 2) for k, v in parts(w).items()))(w)
    return w - 0.1 * g, {k: v / (2 * sigmas[k] ** 2) for k, v in parts(w).items()}


def test_loss_terms_over_a_value_of_the_weights_beside_them_are_asked_about():
    """`part / (2 * sigma[k] ** 2)` by key beside the dict of sigmas: the parts over a value
    of its leaf weigh them as a product does (carried silently before)."""
    w0, start = jnp.ones(3), {"mse": jnp.float32(1.0), "l2": jnp.float32(2.0)}
    with pytest.raises(autoflat.OptionError, match='broadcast="sigmas"'):
        autoflat.step(_uncertainty_terms, num_steps=4)(w0, start, _SCALARS_XS, _SCALARS_YS)
    step = autoflat.step(_uncertainty_terms, num_steps=4, broadcast="sigmas")
    got = step(w0, start, _SCALARS_XS, _SCALARS_YS)
    tree_allclose(got, _jit_loop(_uncertainty_terms, w0, start, True), rtol=1e-6)


def _batch_norm_state(w, state, x):
    """Running statistics of 4 features, updated elementwise, returned under the state's
    new name: at num_steps=4 every array of `state` has a leading axis of 4."""
    feats = x @ w
    new_state = {"mean": 0.9 * state["mean"] + 0.1 * jnp.mean(feats, 0)}
    return new_state, jnp.mean((feats - state["mean"]) ** 2)


@claim(
    "docs/roles.md",
    "or elementwise, under a name sharing a word with it (running statistics of 4 features returned as `new_state`)",
)
def test_statistics_of_num_steps_features_under_their_new_name_are_asked_about():
    """Sliced per step, each step would update one feature's statistic from every feature's
    batch mean (silently before)."""
    w = jnp.full((3, K), 0.1)
    s0 = {"mean": jnp.zeros(K)}
    xs = _batches(2 * K, (16, 3), seed=5)
    with pytest.raises(autoflat.ShapeError, match='state="state"'):
        autoflat.step(_batch_norm_state, num_steps=K)(w, s0, xs[:K])
    ref = jax.jit(_batch_norm_state)
    state = s0
    for i in range(2 * K):
        state, _ = ref(w, state, xs[i])
    step = autoflat.step(_batch_norm_state, num_steps=K, state="state")
    got = s0
    for start in range(0, 2 * K, K):
        got, _ = step(w, got, xs[start : start + K])
    tree_allclose(autoflat.unwrap(got), state, rtol=1e-6)


def _env_step(es, a):  # (a linear environment: the next state from the action)
    nes = 0.95 * es + 0.1 * jnp.array([[0.9, 0.1, 0.0], [0.0, 0.9, 0.1]])[a]
    return nes, nes * 2.0, -jnp.sum(es**2)


def _ppo_transition(P, env_state, last_obs, rng):  # (PureJaxRL's shape: 4 environments)
    a = jax.random.categorical(rng, last_obs @ P["pi"])
    value = last_obs @ P["v"]
    env_state, obsv, r = jax.vmap(_env_step)(env_state, a)
    transition = {"obs": last_obs, "action": a, "value": value, "reward": r}
    return P, env_state, obsv, transition


def test_per_environment_arrays_that_fail_sliced_in_a_data_flow_read_ask():
    """`env_state` is rebound and returned by name, so its data flow is read first; with
    `last_obs` of 4 environments sliced per step that trace fails: the question, quoting
    JAX's error (which raised bare before)."""
    P = {"pi": jnp.full((3, 2), 0.1), "v": jnp.full((3,), 0.1)}
    obs0 = jax.random.normal(jax.random.key(1), (K, 3))
    rngs = jax.random.split(jax.random.key(9), 2 * K)
    with pytest.raises(autoflat.ShapeError) as info:
        autoflat.step(_ppo_transition, num_steps=K)(P, obs0 * 0.5, obs0, rngs[:K])
    message = str(info.value)
    assert "vmap was requested to map its argument" in message
    assert 'state="last_obs"' in message
    state = ["env_state", "last_obs"]
    ref, _ = _reference(_ppo_transition, (P, obs0 * 0.5, obs0), (rngs,), 2 * K)
    step = autoflat.step(_ppo_transition, num_steps=K, state=state)
    got, _ = _run(step, (P, obs0 * 0.5, obs0), (rngs,), 2 * K, K)
    tree_allclose(autoflat.unwrap(got), ref, rtol=1e-6)


def _distilled(student, x, y, teacher_params):  # (the new gradients under `params_grads`)
    def loss_fn(s):
        t = jax.lax.stop_gradient(jnp.tanh(x @ teacher_params[0]) @ teacher_params[1])
        return jnp.mean((jnp.tanh(x @ s[0]) @ s[1] - t) ** 2)

    loss, params_grads = jax.value_and_grad(loss_fn)(student)
    student = jax.tree.map(lambda p, g: p - 0.1 * g, student, params_grads)
    return student, params_grads, loss


def test_gradients_under_a_name_saying_so_are_no_teacher_s_new_value():
    """`params_grads` beside `teacher_params`: a shared word, but the name says gradients
    and the parameter's does not (carried as the teacher silently before)."""
    s0 = (jnp.full((3, 4), 0.1), jnp.full((4,), 0.2))
    t0 = (jnp.full((3, 4), 0.3), jnp.full((4,), -0.1))
    xs, ys = _SCALARS_XS, _SCALARS_YS
    with pytest.raises(autoflat.OptionError, match="it holds gradients"):
        autoflat.step(_distilled, num_steps=K)(s0, xs, ys, t0)
    step = autoflat.step(_distilled, num_steps=K, broadcast="teacher_params")
    (got,), _ = _run(step, (s0,), (xs, ys), K, K, rest=(t0,))
    ref, _ = _reference(_distilled, (s0,), (xs, ys), K, rest=(t0,))
    tree_allclose(got, ref[0], rtol=1e-6)


def _update_logged(w, lr, x, y):  # (a per-step rate times the gradients, logged as `upd`)
    loss, g = jax.value_and_grad(lambda w: jnp.mean((x @ w - y) ** 2))(w)
    upd = lr * g
    return w - upd, loss, upd


def test_a_per_step_rate_times_gradients_logged_as_upd_is_per_step():
    """Four weights at num_steps=4 declared state; `upd = lr * g` has the rates' whole shape
    from a slice, elementwise, under a word for new only: a per-step output (asked about by
    a first version of the name clause of the carry check)."""
    w0 = jnp.full((K,), 0.1)
    lrs, xs, ys = jnp.linspace(0.1, 0.01, K), _batches(K, (K, K), seed=3), _batches(K, (K,), 2)
    (rw,), routs = _reference(_update_logged, (w0,), (lrs, xs, ys), K)
    step = autoflat.step(_update_logged, num_steps=K, state="w")
    (gw,), gouts = _run(step, (w0,), (lrs, xs, ys), K, K)
    tree_allclose(autoflat.unwrap(gw), rw, rtol=1e-5)
    tree_allclose(gouts[0], jax.tree.map(lambda *o: jnp.stack(o), *routs), rtol=1e-5)


# Upstream: google-deepmind/optax, examples/lbfgs.ipynb: `run_opt`'s `step(carry)` verbatim
# (upstream runs it in a `lax.while_loop`), on upstream's Rosenbrock function.
def _rosenbrock(w):
    return jnp.sum(100.0 * (w[1:] - w[:-1] ** 2) ** 2 + (1.0 - w[:-1]) ** 2)


_lbfgs = optax.lbfgs()
value_and_grad_fun = optax.value_and_grad_from_state(_rosenbrock)


def lbfgs_step(carry):
    params, state = carry
    value, grad = value_and_grad_fun(params, state=state)
    updates, state = _lbfgs.update(
        grad, state, params, value=value, grad=grad, value_fn=_rosenbrock
    )
    params = optax.apply_updates(params, updates)
    return params, state


def _halving(carry):
    w, n = carry
    return w - 0.5 * w, n + 1


@claim(
    "docs/roles.md",
    "but where they are the whole return, in order, each an update of its own (`params + updates`, an optimizer's new state), and nothing else comes back (`def step(carry): params, state = carry; ...; return params, state`, a `lax.fori_loop` body as optax's L-BFGS example writes it), the whole return is its new value: carried, and returned as one tuple, as `jax.jit` callers pass it back, shown as `state (the whole return: ...)`.",
)
@pytest.mark.parametrize("fn", [lbfgs_step, _halving])
def test_a_whole_return_that_is_one_tuple_argument_s_new_value_is_carried(fn):
    """`def step(carry): ...; return params, state` (a `lax.fori_loop` or `while_loop` body,
    as optax's L-BFGS example writes it): its items are the tuple argument's, one by one, and
    nothing else comes back, so the whole return is its new value, carried at num_steps=4 as
    `jax.jit` callers pass it back (it was refused, asking to rewrite the return)."""
    start = (jnp.zeros(8), _lbfgs.init(jnp.zeros(8))) if fn is lbfgs_step else (jnp.ones(3), 0.0)
    start = jax.tree.map(jnp.asarray, start)
    want = start
    for _ in range(8):
        want = jax.jit(fn)(want)
    step = autoflat.step(fn, num_steps=4)
    got = start
    for _ in range(2):
        got = step(got)
    header = autoflat.show(step)
    assert "state (the whole return: its items are the tuple's, one by one)" in header
    assert type(autoflat.unwrap(got)) is tuple
    tree_allclose(autoflat.unwrap(got), want, rtol=1e-5)


def _hyper(hp, x):  # a tuple of scalars beside metrics made with them
    lr, wd = hp
    loss = jnp.sum(x**2)
    return lr * loss, wd * loss


def _grads(models, x):  # gradients taken at the tuple's items
    actor, critic = models
    return jax.grad(lambda a: jnp.sum((a * x) ** 2))(actor), jax.grad(
        lambda c: jnp.sum(jnp.sin(c * x))
    )(critic)


def _standardised(stats, x):  # made with the statistics, no update of them
    mu, sd = stats
    z = (x - mu) / sd
    return z, z * sd + mu


def _swapped_grads(state, x):  # the optimizer state beside gradients, not params
    params, opt_state = state
    g = jax.grad(lambda p: jnp.sum((p * x - 1.0) ** 2))(params)
    _, opt_state = optax.sgd(0.1, momentum=0.9).update(g, opt_state, params)
    return g, opt_state


@pytest.mark.parametrize("fn", [_hyper, _grads, _standardised, _swapped_grads])
def test_a_return_alike_a_tuple_argument_s_items_that_updates_none_is_not_its_new_value(fn):
    """Items that have the tuple's abstract values but are no update of them (metrics made
    with hyperparameters, gradients, standardised data) are not its new value: at
    num_steps=4 the tuple is not carried (asked about, or broadcast as before), never
    silently fed the outputs."""
    first = {
        _hyper: (jnp.float32(0.1), jnp.float32(0.01)),
        _grads: (jnp.ones(3), jnp.ones(3)),
        _standardised: (jnp.zeros(3), jnp.ones(3)),
        _swapped_grads: (jnp.ones(3), optax.sgd(0.1, momentum=0.9).init(jnp.ones(3))),
    }[fn]
    xs = jax.random.normal(jax.random.key(0), (4, 3))
    step = autoflat.step(fn, num_steps=4)
    try:
        step(first, xs)
    except autoflat.OptionError:
        return  # (asked, as before)
    assert "the whole return" not in autoflat.show(step)
    assert not autoflat.show(step).splitlines()[2].split(": ", 1)[1].startswith("state")


def test_a_whole_return_with_another_argument_given_back_is_not_one_carry():
    """Two tuple arguments alike: no one of them is the whole return; asked as before."""

    def two(a, b):
        return a[0] * 0.5, a[1] + b[1]

    with pytest.raises(autoflat.OptionError, match="come back one by one"):
        autoflat.step(two, num_steps=4)((jnp.ones(3), jnp.zeros(())), (jnp.ones(3), jnp.zeros(())))


def _square_loss(p, x):
    return jnp.sum(p["w"] ** 2 * x) + jnp.sum(p["s"] ** 2) * x[0]


def _value_and_grads(params, x):
    return jax.value_and_grad(_square_loss)(params, x)


def _both_grads(w, s, x):
    return jax.grad(lambda w, s: _square_loss({"w": w, "s": s}, x), argnums=(0, 1))(w, s)


@claim(
    "docs/roles.md",
    "and so does `return jax.value_and_grad(loss_fn)(params, x)`, whose items are never a parameter's new value.",
)
@pytest.mark.parametrize("fn", [_value_and_grads, _both_grads])
def test_a_step_returning_a_transformation_s_call_gives_gradients_not_state(fn):
    """`return jax.value_and_grad(loss)(params, x)` at num_steps=4: a loss and gradients per
    step, the parameters the same every step, as four `jax.jit` calls give. The gradient of
    `p ** 2` is made by an operation taking `p`'s own array, which carried `params` as its
    gradients (silently) or asked for a rewrite."""
    params = {"w": jnp.ones(3), "s": jnp.ones(2)}
    start = (params,) if fn is _value_and_grads else (params["w"], params["s"])
    xs = jax.random.normal(jax.random.key(0), (4, 3))
    got = autoflat.step(fn, num_steps=4)(*start, xs)
    want = [jax.jit(fn)(*start, x) for x in xs]
    tree_allclose(autoflat.unwrap(got), jax.tree.map(lambda *a: jnp.stack(a), *want))


def test_a_leading_axis_question_quotes_the_step_s_own_failure():
    """A step that fails for its own reasons (`lax.pmean` with no `pmap` around it) with a
    state of mixed leading axes (a bias of num_steps entries beside a Python int): the
    question about the argument's role also quotes the step's error, which no role mends."""
    from flax.training import train_state

    def step(state, x):
        grads = jax.grad(lambda p: jnp.sum((x @ p["w"] + p["b"]) ** 2))(state.params)
        grads = jax.lax.pmean(grads, axis_name="batch")
        return state.apply_gradients(grads=grads), jnp.sum(x)

    params = {"w": jnp.ones((3, 4)), "b": jnp.zeros(4)}
    state = train_state.TrainState.create(apply_fn=None, params=params, tx=optax.sgd(0.1))
    with pytest.raises(autoflat.ShapeError) as info:
        autoflat.step(step, num_steps=4)(state, jnp.zeros((4, 2, 3)))
    message = str(info.value)
    assert "some array leaves of `state` have a leading axis of 4" in message
    assert "raised NameError: Found an unbound axis name: batch" in message
    assert "no role mends it" in message
