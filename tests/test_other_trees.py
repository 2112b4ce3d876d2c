"""State a step returned, paired with other trees between calls.

What a training loop does with returned state besides passing it back: re-initialise an
optimizer on it (`optim.init(eqx.filter(model, eqx.is_inexact_array))`, the second phase of
diffrax's neural ODE example), `eqx.partition` / `eqx.combine`, an EMA of the parameters kept
outside the step, `optax.apply_updates` in a hand-written loop, walking it with an `is_leaf`,
serialising it with `flax.serialization`. Each spelling on an Equinox model and on a dict of
arrays:

- with lazy handles, every operation on one tree (or on handles of one structure) gives what
  it gives on the real objects;
- an operation that pairs a handle with a real tree fails in JAX, whose message then says what
  to do (`autoflat.unwrap(x)`, or `lazy=False`);
- with `lazy=False` every spelling works, equal to a plain `jax.jit` / `eqx.filter_jit` loop,
  and the objects passed back are neither flattened (immutable ones) nor copied again.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import tree_allclose

import autoflat
from autoflat._api import default_pack


def relu(x):
    return jnp.maximum(x, 0.0)


def _mlp(seed=0):
    return eqx.nn.MLP(2, 2, 8, 2, activation=relu, key=jax.random.key(seed))


tx = optax.adam(1e-2)


def _eqx_step(model, opt_state, x):
    loss, grads = eqx.filter_value_and_grad(lambda m: jnp.mean(jax.vmap(m)(x) ** 2))(model)
    updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    model = eqx.apply_updates(model, updates)
    return model, opt_state, loss


def _dict_step(params, opt_state, x):
    def loss_fn(p):
        return jnp.mean((x @ p["w"] + p["b"]) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, opt_state, loss


def _start(kind):
    if kind == "eqx":
        model = _mlp()
        return _eqx_step, model, tx.init(eqx.filter(model, eqx.is_array))
    params = {"w": jnp.ones((2, 3)), "b": jnp.zeros(3)}
    return _dict_step, params, tx.init(params)


X = jax.random.normal(jax.random.key(1), (4, 2))


def _returned(kind, **options):
    """(state as the step returns it, the same state as real objects from `jax.jit`)."""
    fn, state, opt_state = _start(kind)
    step = autoflat.step(fn, **options)
    got = step(state, opt_state, X)[:2]
    want = eqx.filter_jit(fn)(state, opt_state, X)[:2]
    return got, want


def _is_linear(x):
    return isinstance(x, eqx.nn.Linear)


def _is_dict(x):
    return isinstance(x, dict)


# --- one tree at a time: a handle gives what its object gives ---------------------------------


@pytest.mark.parametrize("kind", ["eqx", "dict"])
def test_is_leaf_sees_every_node_of_the_object(kind):
    """`jax.tree.leaves(model, is_leaf=is_linear)` (Equinox's FAQ on weight initialisation)
    gives the object's nodes, not its array leaves: JAX flattens a handle one level at a time,
    as it flattens its object (with or without key paths, the same tree)."""
    (h, _), (real, _) = _returned(kind)
    assert autoflat.is_handle(h)
    is_node = _is_linear if kind == "eqx" else _is_dict
    nodes = jax.tree.leaves(h, is_leaf=lambda x: x is not h and is_node(x))
    want = jax.tree.leaves(real, is_leaf=lambda x: x is not real and is_node(x))
    assert [type(x) for x in nodes] == [type(x) for x in want]
    if kind == "eqx":
        assert [type(x) for x in nodes if is_node(x)] == [eqx.nn.Linear] * 3
    children, _ = eqx.tree_flatten_one_level(h)
    assert [type(c) for c in children] == [type(c) for c in eqx.tree_flatten_one_level(real)[0]]
    assert jax.tree.structure(h) == jax.tree_util.tree_flatten_with_path(h)[1]
    double = lambda x: x * 2 if eqx.is_array(x) else x  # noqa: E731
    tree_allclose(jax.tree.map(double, h), jax.tree.map(double, real))


@pytest.mark.parametrize("kind", ["eqx", "dict"])
def test_handles_of_one_structure_pair_with_and_without_key_paths(kind):
    (h1, o1), (real, real_o) = _returned(kind)
    (h2, o2), _ = _returned(kind)
    twice = jax.tree.map(lambda a, b: a + b if eqx.is_array(a) else a, h1, h2)
    tree_allclose(twice, jax.tree.map(lambda a: a * 2 if eqx.is_array(a) else a, real))
    paths = jax.tree_util.tree_map_with_path(lambda p, a, b: jax.tree_util.keystr(p), h1, h2)
    want = jax.tree_util.tree_map_with_path(lambda p, a: jax.tree_util.keystr(p), real)
    assert jax.tree.leaves(paths) == jax.tree.leaves(want)
    if kind == "dict":
        tree_allclose(tx.init(h1), tx.init(real))
    # optax takes a handle as its state (and one as the parameters it pairs with grads: a
    # dict handle's pairs with the real dict of grads only through `unwrap`, see below)
    grads = jax.tree.map(jnp.ones_like, eqx.filter(real, eqx.is_array))
    updates, new_o = tx.update(grads, o1)
    want_updates, want_o = tx.update(grads, real_o)
    tree_allclose((updates, new_o), (want_updates, want_o))


def test_inference_mode_and_tree_at_take_a_handle():
    class Model(eqx.Module):
        linear: eqx.nn.Linear
        dropout: eqx.nn.Dropout

        def __call__(self, x, key=None):
            return self.dropout(self.linear(x), key=key)

    @autoflat.step
    def shift(model, x):
        return eqx.tree_at(lambda m: m.linear.bias, model, model.linear.bias + x)

    model = shift(Model(eqx.nn.Linear(2, 2, key=jax.random.key(0)), eqx.nn.Dropout(0.5)), 1.0)
    assert autoflat.is_handle(model)
    assert eqx.nn.inference_mode(model).dropout.inference is True
    zeroed = eqx.tree_at(lambda m: m.linear.weight, model, jnp.zeros((2, 2)))
    np.testing.assert_array_equal(zeroed.linear.weight, np.zeros((2, 2)))


# --- a handle paired with a real tree: JAX's message says what to do --------------------------


def _init_on_filtered(h, real):
    # diffrax's neural ODE example, second phase: `optim.init(eqx.filter(model, ...))`
    return tx.init(eqx.filter(h, eqx.is_inexact_array))


def _partition(h, real):
    return eqx.partition(h, eqx.is_array)


def _combine(h, real):
    return eqx.combine(h, eqx.partition(real, eqx.is_array)[1])


def _ema(h, real):
    ema = jax.tree.map(lambda x: x, eqx.filter(real, eqx.is_array))  # kept outside the step
    return jax.tree.map(lambda e, p: 0.9 * e + 0.1 * p, ema, eqx.filter(h, eqx.is_array))


def _apply_updates(h, real):
    updates = jax.tree.map(jnp.ones_like, eqx.filter(real, eqx.is_array))
    return eqx.apply_updates(h, updates)


PAIRINGS = [_init_on_filtered, _partition, _combine, _ema, _apply_updates]


@pytest.mark.parametrize("kind", ["eqx", "dict"])
@pytest.mark.parametrize("pairing", PAIRINGS, ids=lambda f: f.__name__.strip("_"))
def test_pairing_a_handle_with_a_real_tree_says_what_to_do(kind, pairing):
    """The first thing the user reads, in JAX's own error, is the handle's type, whose repr
    says what to do; the two remedies it names work and give what the real objects give."""
    (h, _), (real, _) = _returned(kind)
    with pytest.raises(ValueError) as info:
        pairing(h, real)
    message = str(info.value)
    assert message.startswith("pytree structure error: different types")
    assert "<class 'autoflat.LazyHandle'> (a lazy handle that an autoflat step returned" in message
    assert "pass autoflat.unwrap(x) there, or decorate the step with lazy=False" in message
    tree_allclose(pairing(autoflat.unwrap(h), real), pairing(real, real))
    (eager, _), _ = _returned(kind, lazy=False)
    assert not autoflat.is_handle(eager)
    tree_allclose(pairing(eager, real), pairing(real, real))


def test_a_handles_treedef_names_its_object_and_the_remedy():
    (h, _), _ = _returned("eqx")
    text = str(jax.tree.structure(h))
    assert text.startswith(
        "PyTreeDef(CustomNode(LazyHandle[autoflat handle of MLP (autoflat.unwrap(x) is the MLP; "
        "or lazy=False)]"
    )


def test_a_handle_built_by_its_type_says_what_to_do():
    """Code that rebuilds a value by its type (`type(x)(...)`) gets a TypeError naming the
    remedy, not one about `LazyHandle.__init__`'s parameters."""

    class Pair(tuple):
        pass

    (h, _), _ = _returned("dict")
    with pytest.raises(TypeError, match=r"autoflat.LazyHandle cannot be made from values"):
        type(h)(**{"w": 1})
    with pytest.raises(TypeError, match=r"Pass the real object, `autoflat.unwrap\(x\)`"):
        type(h)(x for x in [1, 2])


# --- lazy=False: real objects, the spellings of upstream loops, no flatten or copy again -----


class Func(eqx.Module):
    mlp: eqx.nn.MLP

    def __call__(self, t, y):
        return self.mlp(y)


class NeuralODE(eqx.Module):
    """diffrax's `NeuralODE` of examples/neural_ode.ipynb with its solver replaced by Euler
    steps over `ts` (no diffrax dependency): `model(ts, y0)` is the trajectory."""

    func: Func

    def __init__(self, data_size, width_size, depth, *, key):
        self.func = Func(
            eqx.nn.MLP(data_size, data_size, width_size, depth, activation=jax.nn.softplus, key=key)
        )

    def __call__(self, ts, y0):
        def euler(y, dt):
            y = y + dt * self.func(None, y)
            return y, y

        _, ys = jax.lax.scan(euler, y0, jnp.diff(ts))
        return jnp.concatenate([y0[None], ys])


@eqx.filter_value_and_grad
def grad_loss(model, ti, yi):
    y_pred = jax.vmap(model, in_axes=(None, 0))(ti, yi[:, 0])
    return jnp.mean((yi - y_pred) ** 2)


def make_step(ti, yi, model, opt_state):
    # diffrax examples/neural_ode.ipynb (patrick-kidger/diffrax, Apache-2.0), as written there
    loss, grads = grad_loss(model, ti, yi)
    updates, opt_state = optim.update(grads, opt_state)
    model = eqx.apply_updates(model, updates)
    return loss, model, opt_state


optim = optax.adabelief(3e-3)


def _two_phases(step_fn):
    """diffrax's training loop: two phases, the second on longer trajectories with a new
    optimizer initialised on the model the first phase returned."""
    global optim
    ts = jnp.linspace(0.0, 1.0, 10)
    ys = jnp.sin(ts[None, :, None] * jnp.arange(1.0, 5.0)[:, None, None]) * jnp.ones((1, 1, 2))
    model = NeuralODE(2, 8, 2, key=jax.random.key(0))
    losses = []
    for lr, steps, length in zip((3e-3, 3e-3), (3, 3), (0.5, 1.0), strict=True):
        optim = optax.adabelief(lr)
        opt_state = optim.init(eqx.filter(model, eqx.is_inexact_array))
        _ts, _ys = ts[: int(10 * length)], ys[:, : int(10 * length)]
        for _ in range(steps):
            loss, model, opt_state = step_fn(_ts, _ys, model, opt_state)
            losses.append(loss)
    return model, losses


def test_diffrax_two_phase_loop_with_lazy_false_equals_filter_jit():
    want_model, want_losses = _two_phases(eqx.filter_jit(make_step))
    model, losses = _two_phases(autoflat.step(make_step, lazy=False))
    assert type(model) is NeuralODE
    tree_allclose(model, want_model)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    with pytest.raises(ValueError, match=r"autoflat.unwrap\(x\)"):
        _two_phases(autoflat.step(make_step))


@pytest.mark.parametrize("kind", ["eqx", "dict"])
@pytest.mark.parametrize("k", [1, 3])
def test_lazy_false_takes_back_its_objects_without_a_flatten_or_copy(kind, k):
    """The objects a `lazy=False` step returned go back in as they are: of immutable structure
    (an Equinox module, optax's tuples) by identity, with no flatten and no copy; a dict of
    arrays is flattened (it may have been changed in place) but its arrays, still the ones
    the step made, are donated without a copy. An array the caller kept is copied first, so
    it stays valid. Results equal `jax.jit`'s."""
    fn, state, opt_state = _start(kind)
    step = autoflat.step(fn, num_steps=k, lazy=False)
    xs = jnp.stack([X + i for i in range(k)]) if k > 1 else X
    ref = eqx.filter_jit(fn)
    want = (state, opt_state)
    for _ in range(3):
        for i in range(k):
            want = ref(*want[:2], xs[i] if k > 1 else xs)
    s, o = state, opt_state
    s, o, _ = step(s, o, xs)
    before = autoflat.stats(step)
    s, o, _ = step(s, o, xs)
    kept = jax.tree.leaves(s)[-1]
    s, o, _ = step(s, o, xs)
    after = autoflat.stats(step)
    assert not autoflat.is_handle(s) and not autoflat.is_handle(o)
    tree_allclose((s, o), want[:2])
    if kind == "eqx":
        assert after.fast_path == before.fast_path + 4 and after.flattens == before.flattens
    else:
        assert after.fast_path == before.fast_path and after.flattens == before.flattens + 4
        if default_pack() is not True:  # (every leaf packed: the buffer is a copy already)
            assert after.copies == before.copies + 1  # the params holding `kept`, once
    np.asarray(kept)  # still valid


def test_lazy_false_under_auto_packing_travels_one_buffer_per_leaf(monkeypatch):
    """Real objects hold one array per leaf: under `pack="auto"` a `lazy=False` step's state
    is not packed (rebuilding from packed buffers would unpack them with a device call on
    every call); `pack=True` still packs it."""
    from autoflat._transport import host

    unpacks = []
    real_unpack = host.unpack_on_device
    monkeypatch.setattr(host, "unpack_on_device", lambda *a: unpacks.append(1) or real_unpack(*a))
    model = eqx.nn.MLP(2, 2, 4, 8, key=jax.random.key(0))  # 18 small leaves, and Adam's
    opt_state = tx.init(eqx.filter(model, eqx.is_array))
    results = {}
    for pack in ("auto", True):
        step = autoflat.step(_eqx_step, lazy=False, pack=pack)
        m, o = model, opt_state
        for _ in range(3):
            m, o, _ = step(m, o, X)
        results[pack] = (m, o, len(unpacks))
    assert results["auto"][2] == 0 and results[True][2] > 0
    tree_allclose(results["auto"][:2], results[True][:2])


# --- flax.serialization ------------------------------------------------------------------------


def test_flax_serialization_takes_handles_as_their_objects():
    """`to_state_dict`, `to_bytes`, `from_state_dict` and `from_bytes` give for a handle what
    they give for its object (a dict, optax's state, a Flax `TrainState`)."""
    serialization = pytest.importorskip("flax.serialization")
    train_state = pytest.importorskip("flax.training.train_state")
    (p, o), (real_p, real_o) = _returned("dict")

    def fit(state, x):
        grads = jax.grad(lambda q: jnp.sum((x @ q["w"]) ** 2))(state.params)
        return state.apply_gradients(grads=grads)

    ts = train_state.TrainState.create(apply_fn=None, params=real_p, tx=tx)
    ts_handle = autoflat.step(fit)(ts, X)
    ts_real = jax.jit(fit)(ts, X)
    for h, real in ((p, real_p), (o, real_o), (ts_handle, ts_real)):
        assert autoflat.is_handle(h)
        state = serialization.to_state_dict(h)
        assert type(state) is dict and not autoflat.is_handle(state)
        tree_allclose(state, serialization.to_state_dict(real))
        data = serialization.to_bytes(h)
        if default_pack() is not True:  # (every leaf packed: equal up to the last bits)
            assert data == serialization.to_bytes(real)
        for restored in (
            serialization.from_bytes(h, data),
            serialization.from_state_dict(h, state),
        ):
            assert type(restored) is type(real)
            tree_allclose(restored, real)
    nested = {"params": p, "opt_state": o}
    real_nested = {"params": real_p, "opt_state": real_o}
    if default_pack() is not True:
        assert serialization.to_bytes(nested) == serialization.to_bytes(real_nested)
    tree_allclose(serialization.to_state_dict(nested), serialization.to_state_dict(real_nested))


def test_flax_restore_into_a_named_tuple_handle_says_what_to_do():
    """Flax restores a named tuple by its type (`type(target)(**fields)`): a handle of one as
    the target raises a TypeError that names the remedy; saving it works."""
    serialization = pytest.importorskip("flax.serialization")
    injected = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    params = {"w": jnp.ones(2)}

    @autoflat.step
    def fit(params, opt_state, x):
        updates, opt_state = injected.update(
            jax.grad(lambda p: jnp.sum(p["w"] * x))(params), opt_state
        )
        return optax.apply_updates(params, updates), opt_state

    p, o = fit(params, injected.init(params), jnp.ones(2))
    assert autoflat.is_handle(o) and hasattr(autoflat.unwrap(o), "_fields")
    data = serialization.to_bytes(o)
    with pytest.raises(TypeError, match=r"flax.serialization.from_state_dict does for a named"):
        serialization.from_bytes(o, data)
    restored = serialization.from_bytes(autoflat.unwrap(o), data)
    tree_allclose(restored, autoflat.unwrap(o))


def test_equinox_serialise_leaves_of_a_handle_writes_the_objects_bytes(tmp_path):
    (h, _), _ = _returned("eqx")
    eqx.tree_serialise_leaves(tmp_path / "handle.eqx", h)
    eqx.tree_serialise_leaves(tmp_path / "real.eqx", autoflat.unwrap(h))
    assert (tmp_path / "handle.eqx").read_bytes() == (tmp_path / "real.eqx").read_bytes()


def _orbax_save(tmp_path, p, o):
    ocp = pytest.importorskip("orbax.checkpoint")
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "state", {"params": p, "opt_state": o})


def _flax_save_checkpoint(tmp_path, p, o):
    checkpoints = pytest.importorskip("flax.training.checkpoints")
    checkpoints.save_checkpoint(tmp_path / "flax", {"params": p, "opt_state": o}, step=1)


def _eqx_deserialise_like(tmp_path, p, o):
    eqx.tree_serialise_leaves(tmp_path / "p.eqx", autoflat.unwrap(p))
    return eqx.tree_deserialise_leaves(tmp_path / "p.eqx", like=p)


def _schedule_free_eval(tmp_path, p, o):
    return optax.contrib.schedule_free_eval_params(o, p)


@pytest.mark.parametrize(
    "use", [_orbax_save, _flax_save_checkpoint, _eqx_deserialise_like, _schedule_free_eval]
)
def test_libraries_that_pair_trees_say_what_to_do(tmp_path, use):
    """The FAQ's list of libraries that pair the tree they are given with another: with
    handles JAX's message says what to do; with `autoflat.unwrap` they work."""
    sf = optax.contrib.schedule_free_adamw(1e-2)

    @autoflat.step
    def fit(params, opt_state, x):
        grads = jax.grad(lambda p: jnp.sum((x @ p["w"] + p["b"]) ** 2))(params)
        updates, opt_state = sf.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    params = {"w": jnp.ones((2, 3)), "b": jnp.zeros(3)}
    p, o = fit(params, sf.init(params), X)
    for folder in ("handles", "real"):
        (tmp_path / folder).mkdir()
    with pytest.raises(ValueError, match=r"pass autoflat.unwrap\(x\) there"):
        use(tmp_path / "handles", p, o)
    use(tmp_path / "real", *autoflat.unwrap((p, o)))
