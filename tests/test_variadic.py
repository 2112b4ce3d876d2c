"""`*args` and `**kwargs` steps, taken as `jax.jit` takes them. A variadic parameter is one
parameter whose value is what Python binds to it (the tuple of the call's extra positional
arguments, the dict of its extra keywords, empty by default) and takes one role, by the same
rules as any tuple or dict argument; the options name it (`per_step="batch"`), and `show()`
writes it as it is written (`*batch`). Each case is compared with a loop of `jax.jit` calls
of the same function, one step a call, feeding the state back.
"""

from __future__ import annotations

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import tree_allclose

import autoflat

K = 4


def _role_line(step, param):
    return next(
        line for line in autoflat.show(step).splitlines() if line.startswith(f"# {param}: ")
    )


def _data(n=K):
    kx, ky = jax.random.split(jax.random.key(0))
    return jax.random.normal(kx, (n, 5, 3)), jax.random.normal(ky, (n, 5))


def _jit_loop(fn, state, per_step, *extra, **kwargs):
    """`fn` by `jax.jit`, one step a call: state given back, the other outputs stacked."""
    jitted = jax.jit(fn)
    outs = []
    for i in range(jax.tree.leaves(per_step)[0].shape[0]):
        step_in = jax.tree.map(lambda a, i=i: a[i], per_step)
        state, out = jitted(state, *step_in, *extra, **kwargs)
        outs.append(out)
    return state, jnp.stack(outs)


# --- `*batch`: the Flax-style `train_step(state, *batch)` ----------------------------------


def regress(w, *batch, lr=0.1):
    x, y = batch
    loss, g = jax.value_and_grad(lambda w: jnp.mean((x @ w - y) ** 2))(w)
    return w - lr * g, loss


@pytest.mark.parametrize("num_steps", [1, K])
def test_star_args_per_step_equal_a_jit_loop(num_steps):
    xs, ys = _data()
    want = _jit_loop(regress, jnp.ones(3), (xs, ys))
    step = autoflat.step(regress, num_steps=num_steps)
    w, losses = jnp.ones(3), []
    for i in range(0, K, num_steps):
        x, y = (xs[i], ys[i]) if num_steps == 1 else (xs[i : i + K], ys[i : i + K])
        w, loss = step(w, x, y)
        losses.append(loss if num_steps > 1 else loss[None])
    tree_allclose((w, jnp.concatenate(losses)), want)
    role = "scanned (per-step" if num_steps > 1 else "scanned (per-step input)"
    assert _role_line(step, "*batch").startswith(f"# *batch: {role}")


def test_keyword_only_after_star_args():
    xs, ys = _data()
    want = _jit_loop(regress, jnp.ones(3), (xs, ys), lr=0.3)
    w, losses = autoflat.step(regress, num_steps=K)(jnp.ones(3), xs, ys, lr=0.3)
    tree_allclose((w, losses), want)


def _scaled(w, *extra):
    return w * 0.5 + sum(e.sum() for e in extra), jnp.float32(len(extra))


def test_star_args_empty_then_per_step_is_refused_and_loses_nothing():
    # No extras at the first call: `extra` is `()`, broadcast for want of evidence. Arrays
    # with a leading axis of num_steps later are not read as broadcast.
    step = autoflat.step(_scaled, num_steps=K)
    w1, n1 = step(jnp.ones(3))
    tree_allclose(n1, jnp.zeros(K))
    assert _role_line(step, "*extra") == (
        "# *extra: broadcast (no arrays at the first call) [rule: no-leading-axis]"
    )
    with pytest.raises(autoflat.ShapeError) as info:
        step(w1, jnp.ones((K, 2)), jnp.ones((K, 3)))
    message = str(info.value)
    assert (
        "`extra` was taken as the same for every step (broadcast) by its shapes at the first call (no arrays)"
        in message
    )
    assert "float32[4, 2]" in message and 'per_step="extra"' in message
    tree_allclose(w1, jnp.full(3, 0.5**K))  # the state is still there
    # Arrays without that axis are broadcast, as the rule says.
    w2, _ = step(w1, jnp.ones(2))
    tree_allclose(w2, jnp.full(3, 0.5 ** (2 * K)) + 2 * (1 - 0.5**K) / (1 - 0.5) * 1.0, rtol=1e-4)


def test_star_args_count_changes_retrace_as_under_jit():
    step = autoflat.step(_scaled, num_steps=K, per_step="extra")
    w = jnp.ones(3)
    w1, n1 = step(w)
    w2, n2 = step(w1, jnp.ones((K, 2)), jnp.ones((K, 3)))
    tree_allclose(n1, jnp.zeros(K))
    tree_allclose(n2, jnp.full(K, 2.0))
    want = w
    for _ in range(K):
        want = want * 0.5
    for _ in range(K):
        want = want * 0.5 + 5.0
    tree_allclose(w2, want)
    assert step.stats.traces == 2


def test_star_args_mixing_per_step_and_broadcast_asks_to_name_them():
    def with_rate(w, *batch):
        x, y, lr = batch
        return w - lr * jnp.mean(x), jnp.mean(y)

    xs, ys = _data()
    with pytest.raises(autoflat.ShapeError) as info:
        autoflat.step(with_rate, num_steps=K)(jnp.ones(3), xs, ys, jnp.float32(0.1))
    message = str(info.value)
    assert "`batch[2]` is float32[]" in message
    assert "`batch` is `*batch`: its items take one role together" in message
    assert "def step(model, x, y, lr)" in message
    # One step a call, nothing to slice: as under jax.jit.
    w, m = autoflat.step(with_rate)(jnp.ones(3), xs[0], ys[0], jnp.float32(0.1))
    tree_allclose((w, m), jax.jit(with_rate)(jnp.ones(3), xs[0], ys[0], jnp.float32(0.1)))


@pytest.mark.parametrize("option", ["per_step", "broadcast"])
def test_options_name_star_args(option):
    xs, ys = _data()
    if option == "per_step":
        args, want = (xs, ys), _jit_loop(regress, jnp.ones(3), (xs, ys))
    else:
        args = (xs[0], ys[0])  # one batch, every step
        w, outs = jnp.ones(3), []
        for _ in range(K):
            w, loss = jax.jit(regress)(w, *args)
            outs.append(loss)
        want = (w, jnp.stack(outs))
    step = autoflat.step(regress, num_steps=K, **{option: "batch"})
    tree_allclose(step(jnp.ones(3), *args), want)
    role = {"per_step": "scanned", "broadcast": "broadcast"}[option]
    assert _role_line(step, "*batch").startswith(f"# *batch: {role}")


def halved(w, *counts):
    for _ in range(counts[0]):
        w = w * 0.5
    return w, w.sum()


def test_static_star_args():
    jitted = jax.jit(halved, static_argnums=(1,))
    w, outs = jnp.ones(3), []
    for _ in range(K):
        w, out = jitted(w, 2)
        outs.append(out)
    step = autoflat.step(halved, num_steps=K, static_argnames="counts")
    tree_allclose(step(jnp.ones(3), 2), (w, jnp.stack(outs)))
    assert _role_line(step, "*counts").startswith("# *counts: static")


# --- `**kwargs` ----------------------------------------------------------------------------


def regress_kw(w, **batch):
    x, y = batch["x"], batch["y"]
    loss, g = jax.value_and_grad(lambda w: jnp.mean((x @ w - y) ** 2))(w)
    return w - 0.1 * g, loss


@pytest.mark.parametrize("num_steps", [1, K])
def test_star_kwargs_per_step_equal_a_jit_loop(num_steps):
    xs, ys = _data()
    jitted = jax.jit(regress_kw)
    w, outs = jnp.ones(3), []
    for i in range(K):
        w, loss = jitted(w, x=xs[i], y=ys[i])
        outs.append(loss)
    step = autoflat.step(regress_kw, num_steps=num_steps)
    got, losses = jnp.ones(3), []
    for i in range(0, K, num_steps):
        x, y = (xs[i], ys[i]) if num_steps == 1 else (xs[i : i + K], ys[i : i + K])
        got, loss = step(got, x=x, y=y)
        losses.append(loss if num_steps > 1 else loss[None])
    tree_allclose((got, jnp.concatenate(losses)), (w, jnp.stack(outs)))
    assert _role_line(step, "**batch").startswith("# **batch: scanned")


# --- state in a variadic parameter ---------------------------------------------------------


def two_models(*models):
    a, b = models
    models = (a * 0.5, b + a.sum())
    return models, a.sum()


@pytest.mark.parametrize("num_steps", [1, K])
def test_star_args_returned_by_name_is_state(num_steps):
    a, b = jnp.ones(3), jnp.zeros(2)
    want_a, want_b, outs = a, b, []
    for _ in range(K):
        (want_a, want_b), out = jax.jit(two_models)(want_a, want_b)
        outs.append(out)
    step = autoflat.step(two_models, num_steps=num_steps)
    got, losses = (a, b), []
    for _ in range(K // num_steps):
        got, out = step(*got)
        losses.append(out if num_steps > 1 else out[None])
    tree_allclose((got, jnp.concatenate(losses)), ((want_a, want_b), jnp.stack(outs)))
    assert _role_line(step, "*models").startswith("# *models: state (returned)")


# --- a method, a jit wrapper, a partial, lazy=False, profile --------------------------------


class Scaler:
    def __init__(self, scale):
        self.scale = scale

    @autoflat.step(num_steps=K)
    def step(self, w, *batch):
        x, y = batch
        return w * self.scale - jnp.mean(x), jnp.mean(y)


def test_method_with_star_args():
    xs, ys = _data()
    w, outs = jnp.ones(3), []
    for i in range(K):
        w, out = w * 0.9 - jnp.mean(xs[i]), jnp.mean(ys[i])
        outs.append(out)
    tree_allclose(Scaler(0.9).step(jnp.ones(3), xs, ys), (w, jnp.stack(outs)))


def optimize(loss_fn, opt, opt_state, params, max_grad_norm, *args, **kwargs):
    """The shape of a common RL-library helper: `jax.jit` with the loss, the optimizer and the
    clipping norm static by position, the loss's inputs forwarded as `*args, **kwargs`."""
    (loss, aux), grad = jax.value_and_grad(loss_fn, has_aux=True)(params, *args, **kwargs)
    if max_grad_norm is not None:
        grad = jax.tree.map(lambda g: jnp.clip(g, -max_grad_norm, max_grad_norm), grad)
    update, opt_state = opt.update(grad, opt_state)
    params = optax.apply_updates(params, update)
    return opt_state, params, loss, aux


def _critic_loss(params, x, y, *, weight):
    err = x @ params["w"] + params["b"] - y
    return weight * jnp.mean(err**2), jnp.abs(err).max()


@pytest.mark.parametrize("num_steps", [1, K])
def test_jit_wrapped_helper_with_star_args_and_kwargs(num_steps):
    opt = optax.adam(1e-2)
    params = {"w": jnp.ones(3), "b": jnp.zeros(())}
    xs, ys = _data()
    jitted = jax.jit(optimize, static_argnums=(0, 1, 4))
    opt_state, p, want = opt.init(params), params, []
    for i in range(K):
        opt_state, p, loss, aux = jitted(
            _critic_loss, opt, opt_state, p, 1.0, xs[i], ys[i], weight=2.0
        )
        want.append((loss, aux))
    step = autoflat.step(jitted, num_steps=num_steps)
    s, q, got = opt.init(params), params, []
    for i in range(0, K, num_steps):
        x, y = (xs[i], ys[i]) if num_steps == 1 else (xs[i : i + K], ys[i : i + K])
        s, q, loss, aux = step(_critic_loss, opt, s, q, 1.0, x, y, weight=2.0)
        got.append((loss, aux) if num_steps > 1 else (loss[None], aux[None]))
    tree_allclose((s, q), (opt_state, p))
    losses, auxes = (jnp.concatenate(g) for g in zip(*got, strict=True))
    tree_allclose((losses, auxes), tuple(jnp.stack(w) for w in zip(*want, strict=True)))
    assert _role_line(step, "*args").startswith("# *args: scanned")
    if num_steps > 1:  # `{"weight": 2.0}`: no array, the same every step
        assert _role_line(step, "**kwargs").startswith("# **kwargs: broadcast")


def test_partial_binding_into_star_args_is_not_bound():
    xs, ys = _data()
    fn = functools.partial(regress, jnp.ones(3), xs[0])  # binds `w` and the first of `*batch`
    step = autoflat.step(fn)
    tree_allclose(step(ys[0]), jax.jit(fn)(ys[0]))
    assert "bound by functools.partial" in _role_line(step, "w")
    assert "bound" not in _role_line(step, "*batch")


def test_star_args_with_lazy_false_and_filter_jit():
    xs, ys = _data()
    want = _jit_loop(regress, jnp.ones(3), (xs, ys))
    tree_allclose(autoflat.step(regress, num_steps=K, lazy=False)(jnp.ones(3), xs, ys), want)
    tree_allclose(autoflat.step(eqx.filter_jit(regress), num_steps=K)(jnp.ones(3), xs, ys), want)


def test_profile_of_a_star_args_step_leaves_the_state():
    xs, ys = _data()
    step = autoflat.step(regress, num_steps=K)
    w = jnp.ones(3)
    report = autoflat.profile(step, w, xs, ys, calls=2)
    assert report.num_steps == K
    tree_allclose(w, jnp.ones(3))
    tree_allclose(step(w, xs, ys), _jit_loop(regress, jnp.ones(3), (xs, ys)))


# --- what no role can take: refused, nothing lost -------------------------------------------


def _lookup(*args):
    table, i = args
    return table[i] * 2.0


def test_partial_binding_into_star_args_with_num_steps_needs_a_role():
    table = jnp.arange(12.0).reshape(K, 3)  # four rows: sliced per step if read per-step
    fn = functools.partial(_lookup, table)
    with pytest.raises(autoflat.OptionError) as info:
        autoflat.step(fn, num_steps=K)
    message = str(info.value)
    assert "binds 1 positional argument into `*args`" in message
    assert 'broadcast="args"' in message
    idx = jnp.array([0, 2, 1, 3])
    want = jnp.stack([jax.jit(fn)(i) for i in idx])
    # One step a call nothing is sliced: as jax.jit of the partial.
    tree_allclose(jnp.stack([autoflat.step(fn)(i) for i in idx]), want)


def _kw_lookup(i, **kw):
    return kw["table"][i] * 2.0


def test_partial_binding_into_star_kwargs_with_num_steps_needs_a_role():
    fn = functools.partial(_kw_lookup, table=jnp.arange(12.0).reshape(K, 3))
    with pytest.raises(autoflat.OptionError, match=r"binds the keyword `table` into `\*\*kw`"):
        autoflat.step(fn, num_steps=K)
    idx = jnp.array([0, 2, 1, 3])
    step = autoflat.step(fn, num_steps=K, broadcast="kw")
    tree_allclose(step(idx), jnp.stack([jax.jit(fn)(i) for i in idx]))


def test_an_item_added_later_with_the_leading_axis_is_refused():
    step = autoflat.step(_scaled, num_steps=K)
    w, _ = step(jnp.ones(3), jnp.ones(6))  # `extra` is (b,): broadcast by its shape
    assert _role_line(step, "*extra").startswith(
        "# *extra: broadcast (no leading axis of num_steps=4 at the first call)"
    )
    with pytest.raises(autoflat.ShapeError) as info:
        step(w, jnp.ones(6), jnp.ones((K, 3)))
    message = str(info.value)
    assert "by its shapes at the first call (no leading axis of num_steps=4)" in message
    assert "float32[4, 3]" in message and 'per_step="extra"' in message
    tree_allclose(w, jnp.full(3, 0.5**K) + 6.0 * (1 - 0.5**K) / 0.5)  # the state is intact


def test_a_dict_gaining_a_per_step_key_is_refused():
    def f(w, aux, x):
        return w * 0.5 + sum(v.sum() for v in aux.values()) + x.sum(), w.sum()

    step = autoflat.step(f, num_steps=K)
    w, _ = step(jnp.ones(3), {"bias": jnp.ones(3)}, jnp.ones((K, 2)))
    with pytest.raises(autoflat.ShapeError, match='per_step="aux"'):
        step(w, {"bias": jnp.ones(3), "noise": jnp.ones((K, 2))}, jnp.ones((K, 2)))


def _reduce(w, *batch):
    xs, how = batch
    return w + (jnp.sum(xs) if how == "sum" else jnp.mean(xs)), w.sum()


def test_a_string_beside_per_step_arrays_is_mixed():
    with pytest.raises(autoflat.ShapeError) as info:
        autoflat.step(_reduce, num_steps=K)(jnp.ones(3), jnp.ones((K, 2)), "sum")
    assert "`batch[1]` is non-array str" in str(info.value)
    # One step a call: `how` is a Python string, as `jax.jit` with it static would take it.
    got = autoflat.step(_reduce)(jnp.ones(3), jnp.ones(2), "sum")
    tree_allclose(got, jax.jit(_reduce, static_argnums=(2,))(jnp.ones(3), jnp.ones(2), "sum"))


def test_flax_nnx_objects_inside_star_args_are_refused():
    from flax import nnx

    def step_objs(*objs):
        model, optimizer, x, y = objs
        loss, g = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        optimizer.update(model, g)
        return loss

    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    before = model.kernel[...]
    with pytest.raises(autoflat.StateError) as info:
        autoflat.step(step_objs)(model, optimizer, jnp.ones((5, 3)), jnp.zeros((5, 2)))
    message = str(info.value)
    assert "holds a Flax NNX `Linear` at `objs[0]`" in message
    assert "def train_step(model, optimizer, *batch)" in message
    tree_allclose(model.kernel[...], before)


def _static_last(w, *args):
    for _ in range(args[-1]):
        w = w * 0.5
    return w, w.sum()


def _static_kw(w, **kw):
    for _ in range(kw["n"]):
        w = w * 0.5
    return w, w.sum()


def test_jit_static_arguments_without_a_parameter_name_are_refused():
    with pytest.raises(autoflat.SourceError, match=r"static_argnums=\(-1,\) \(no parameter name\)"):
        autoflat.step(jax.jit(_static_last, static_argnums=-1))
    with pytest.raises(autoflat.SourceError, match=r"keys of `\*\*kwargs`: make each a keyword"):
        autoflat.step(jax.jit(_static_kw, static_argnames="n"))


def _noisy(w, *keys):
    (key,) = keys
    return w * 0.5 + jax.random.normal(key, w.shape), w.sum()


def test_a_raw_key_inside_star_args_at_two_steps_asks():
    # uint32[2]: one raw key, or two steps' values? As for a raw key passed by itself.
    with pytest.raises(autoflat.ShapeError) as info:
        autoflat.step(_noisy, num_steps=2)(jnp.ones(3), jax.random.PRNGKey(3))
    message = str(info.value)
    assert "`keys[0]` is uint32[2], which is a raw PRNG key" in message
    assert 'broadcast="keys"' in message
    w, outs, key = jnp.ones(3), [], jax.random.PRNGKey(3)
    for _ in range(2):
        w, out = jax.jit(_noisy)(w, key)
        outs.append(out)
    step = autoflat.step(_noisy, num_steps=2, broadcast="keys")
    tree_allclose(step(jnp.ones(3), key), (w, jnp.stack(outs)))


def _spread(*models):
    a, b = models
    return a * 0.5, b + a.sum(), a.sum()


def _spread_as_one(*models):
    a, b = models
    return (a * 0.5, b + a.sum()), a.sum()


def test_star_args_state_spread_over_return_positions_asks():
    with pytest.raises(autoflat.OptionError) as info:
        autoflat.step(_spread, num_steps=K)(jnp.ones(3), jnp.zeros(2))
    message = str(info.value)
    assert "the items of `models` come back one by one at return positions 0, 1" in message
    assert "a tuple written at one position of the `return`" in message
    # The fix it names: one tuple, state matched by value, equal to the jax.jit loop.
    a, b, outs = jnp.ones(3), jnp.zeros(2), []
    for _ in range(K):
        (a, b), out = jax.jit(_spread_as_one)(a, b)
        outs.append(out)
    step = autoflat.step(_spread_as_one, num_steps=K)
    tree_allclose(step(jnp.ones(3), jnp.zeros(2)), ((a, b), jnp.stack(outs)))
    assert _role_line(step, "*models").startswith("# *models: state (matched by value")
    # One step a call: as jax.jit, nothing is carried.
    tree_allclose(
        autoflat.step(_spread)(jnp.ones(3), jnp.zeros(2)),
        jax.jit(_spread)(jnp.ones(3), jnp.zeros(2)),
    )


def _sgd_step(train_state, x, y):
    params, opt_state = train_state
    loss, grads = jax.value_and_grad(lambda p: jnp.mean((x @ p["w"] - y) ** 2))(params)
    updates, opt_state = _SGD.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


_SGD = optax.sgd(0.1)


def test_a_train_state_whose_optimizer_holds_no_arrays_spread_over_the_return_asks():
    # optax.sgd's state is `(EmptyState(), EmptyState())`: no leaf to match, the params
    # alone tell that `train_state` comes back at positions 0 and 1 (it was broadcast,
    # the params stacked as an output).
    params = {"w": jnp.ones(3)}
    xs, ys = jnp.linspace(0, 1, K * 15).reshape(K, 5, 3), jnp.ones((K, 5))
    with pytest.raises(autoflat.OptionError, match="come back one by one at return positions 0, 1"):
        autoflat.step(_sgd_step, num_steps=K)((params, _SGD.init(params)), xs, ys)
    # At one step a call nothing is carried: as jax.jit.
    state = (params, _SGD.init(params))
    tree_allclose(
        autoflat.step(_sgd_step)(state, xs[0], ys[0]), jax.jit(_sgd_step)(state, xs[0], ys[0])
    )


def _adam_inner(params, opt_state, x, y):
    loss, grads = jax.value_and_grad(lambda p: jnp.mean((x @ p["w"] - y) ** 2))(params)
    updates, opt_state = _ADAM.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


_ADAM = optax.adam(0.1)


def _through_a_helper(train_state, x, y):
    return _adam_inner(*train_state, x, y)


def _through_a_helper_as_one(train_state, x, y):
    params, opt_state, loss = _adam_inner(*train_state, x, y)
    return (params, opt_state), loss


def test_a_train_state_spread_over_the_tuple_a_helper_returns_asks():
    params = {"w": jnp.ones(3)}
    state = (params, _ADAM.init(params))
    xs, ys = jnp.linspace(0, 1, K * 15).reshape(K, 5, 3), jnp.ones((K, 5))
    with pytest.raises(autoflat.OptionError) as info:
        autoflat.step(_through_a_helper, num_steps=K)(state, xs, ys)
    assert (
        "the items of `train_state` come back one by one at return positions 0, 1 (the items"
        " of the tuple its `return` gives)" in str(info.value)
    )
    # The fix it names, equal to the jax.jit loop.
    want, losses = state, []
    for i in range(K):
        want, loss = jax.jit(_through_a_helper_as_one)(want, xs[i], ys[i])
        losses.append(loss)
    got = autoflat.step(_through_a_helper_as_one, num_steps=K)(state, xs, ys)
    tree_allclose(got, (want, jnp.stack(losses)), rtol=1e-5)


# --- what those refusals leave alone ---------------------------------------------------------


def test_flax_nnx_objects_only_read_inside_a_container_run():
    from flax import nnx

    def ensemble(members, x):
        return jnp.mean(jnp.stack([m(x) for m in members]), axis=0).sum()

    members = [nnx.Linear(3, 2, rngs=nnx.Rngs(i)) for i in range(3)]
    xs = jnp.ones((K, 5, 3))
    want = jnp.stack([nnx.jit(ensemble)(members, x) for x in xs])
    tree_allclose(autoflat.step(ensemble, num_steps=K)(members, xs), want, rtol=1e-5)
    tree_allclose(autoflat.step(ensemble)(members, xs[0]), want[0], rtol=1e-5)


def test_flax_nnx_objects_changed_inside_a_written_back_dict_are_refused():
    from flax import nnx

    def train(model, optimizer, x, y, extras):
        loss, g = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        optimizer.update(model, g)
        extras["metrics"].update(loss=loss)
        return loss

    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    extras = {"metrics": nnx.MultiMetric(loss=nnx.metrics.Average("loss"))}
    with pytest.raises(autoflat.StateError, match=r"`MultiMetric` at `extras\['metrics'\]`"):
        autoflat.step(train)(model, optimizer, jnp.ones((5, 3)), jnp.zeros((5, 2)), extras)


def test_hyperparameters_and_gradients_are_not_taken_for_spread_state():
    def with_hp(w, x, hp):  # a loss and a metric computed with (lr, wd)
        lr, wd = hp
        loss, g = jax.value_and_grad(lambda w: jnp.mean((x @ w) ** 2) + wd * jnp.sum(w**2))(w)
        return w - lr * g, loss, jnp.linalg.norm(g) * lr

    def grads_of(params, x):  # gradients at fixed params, returned unpacked
        loss, (gw, gb) = jax.value_and_grad(lambda p: jnp.mean((x @ p[0] + p[1]) ** 2))(params)
        return gw, gb, loss

    xs = jnp.ones((K, 5, 3))
    hp = (jnp.float32(0.1), jnp.float32(1e-3))
    w, outs = jnp.ones(3), []
    for x in xs:
        w, loss, norm = jax.jit(with_hp)(w, x, hp)
        outs.append((loss, norm))
    got = autoflat.step(with_hp, num_steps=K)(jnp.ones(3), xs, hp)
    tree_allclose(got, (w, *(jnp.stack(o) for o in zip(*outs, strict=True))), rtol=1e-5)
    params = (jnp.ones(3), jnp.float32(0.5))
    want = [jax.jit(grads_of)(params, x) for x in xs]
    got = autoflat.step(grads_of, num_steps=K)(params, xs)
    tree_allclose(got, tuple(jnp.stack(o) for o in zip(*want, strict=True)), rtol=1e-5)


def test_a_frozen_module_with_a_layer_the_size_of_num_steps_is_broadcast():
    def distill(w, frozen, x):
        enc, head = frozen
        return w + head(enc(x)).sum(), w.sum()

    frozen = (
        eqx.nn.MLP(3, 6, 8, 1, key=jax.random.key(0)),
        eqx.nn.Linear(6, K, key=jax.random.key(1)),
    )
    xs = jnp.ones((K, 3))
    w, outs = jnp.zeros(()), []
    for x in xs:
        w, out = eqx.filter_jit(distill)(w, frozen, x)
        outs.append(out)
    got = autoflat.step(distill, num_steps=K)(jnp.zeros(()), frozen, xs)
    tree_allclose(got, (w, jnp.stack(outs)), rtol=1e-5)
