"""Lazy handles behave as the objects they stand for, rebuild once, and never go stale."""

from __future__ import annotations

import copy
import pickle

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import tree_allclose

import autoflat


def relu(x):
    return jnp.maximum(x, 0.0)


def identity(x):
    return x


def _mlp():
    return eqx.nn.MLP(3, 2, 8, 2, activation=relu, final_activation=identity, key=jax.random.key(0))


def _loss(model, batch):
    x, y = batch
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


tx = optax.adam(1e-2)


@autoflat.step(num_steps=2)
def train(model, opt_state, batch):
    loss, grads = eqx.filter_value_and_grad(_loss)(model, batch)
    updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    model = eqx.apply_updates(model, updates)
    return model, opt_state, loss


def _batches(n=2):
    return jax.random.normal(jax.random.key(1), (n, 4, 3)), jnp.zeros((n, 4, 2))


def _trained():
    model = _mlp()
    opt_state = tx.init(eqx.filter(model, eqx.is_array))
    return train(model, opt_state, _batches())


def test_behaves_as_the_module():
    train.stats.reset()
    model, opt_state, _ = _trained()
    assert autoflat.is_handle(model)
    assert isinstance(model, eqx.nn.MLP)
    assert type(model) is autoflat._handles.LazyHandle
    assert model.__class__ is eqx.nn.MLP
    assert train.stats.rebuilds == 0
    assert model.depth == 2 and model.activation is relu
    y = model(jnp.ones(3))
    assert y.shape == (2,)
    assert repr(model) == repr(autoflat.unwrap(model))
    assert train.stats.rebuilds == 1  # rebuilt once, however often it is used
    assert model == autoflat.unwrap(model)
    assert isinstance(opt_state, tuple) and len(opt_state) == 2
    assert int(opt_state[0].count) == 2


def test_pickle_copy_deepcopy():
    model, opt_state, _ = _trained()
    real = autoflat.unwrap(model)
    for other in (pickle.loads(pickle.dumps(model)), copy.copy(model), copy.deepcopy(model)):
        assert type(other) is eqx.nn.MLP
        tree_allclose(other, real, exact=True)
    assert type(pickle.loads(pickle.dumps(opt_state))) is tuple


def test_pytree_apis():
    model, opt_state, _ = _trained()
    real = autoflat.unwrap(model)
    doubled = jax.tree.map(lambda x: x * 2 if eqx.is_array(x) else x, model)
    assert type(doubled) is eqx.nn.MLP
    tree_allclose(doubled, jax.tree.map(lambda x: x * 2 if eqx.is_array(x) else x, real))
    assert len(jax.tree.leaves(model)) == len(jax.tree.leaves(real))

    out = eqx.filter_jit(lambda m, x: m(x))(model, jnp.ones(3))
    np.testing.assert_allclose(out, real(jnp.ones(3)), rtol=1e-6)
    # gradients with respect to a handle come back as the real type
    params = jax.tree.map(lambda x: x if eqx.is_array(x) else None, model)
    grads = jax.grad(lambda p, b: _loss(eqx.combine(p, real), b))(
        params, jax.tree.map(lambda x: x[0], _batches())
    )
    assert type(grads) is eqx.nn.MLP
    # optax takes a handle as its state
    updates, new_state = tx.update(grads, opt_state, params)
    new_model = eqx.apply_updates(real, updates)
    assert type(new_model) is eqx.nn.MLP and int(new_state[0].count) == 3


def test_multi_tree_operations_need_unwrap_or_lazy_false():
    """A handle is its own pytree node type, so a multi-tree operation that pairs it with a
    real tree fails in JAX (naming autoflat.LazyHandle); unwrap() or lazy=False fix it."""
    model, _, _ = _trained()
    with pytest.raises(ValueError, match="autoflat.LazyHandle"):
        eqx.partition(model, eqx.is_array)
    eqx.partition(autoflat.unwrap(model), eqx.is_array)

    eager = autoflat.step(train.__wrapped__, num_steps=2, lazy=False)
    model = _mlp()
    opt_state = tx.init(eqx.filter(model, eqx.is_array))
    model, opt_state, _ = eager(model, opt_state, _batches())
    assert type(model) is eqx.nn.MLP and type(opt_state) is tuple
    params, static = eqx.partition(model, eqx.is_array)
    assert type(params) is eqx.nn.MLP
    before = autoflat.stats(eager)
    model2, opt_state2, _ = eager(model, opt_state, _batches())
    after = autoflat.stats(eager)
    # the objects returned last time are recognised: no host flatten, no copy
    assert after.flattens == before.flattens and after.copies == before.copies
    assert after.fast_path == before.fast_path + 2
    ref_model, ref_opt, _ = train(_mlp(), tx.init(eqx.filter(_mlp(), eqx.is_array)), _batches())
    ref_model, _, _ = train(ref_model, ref_opt, _batches())
    tree_allclose(model2, ref_model)


def test_unwrap_containers_and_passthrough():
    model, opt_state, loss = _trained()
    m, (o,), d = autoflat.unwrap((model, [opt_state], {"x": 1}))
    assert type(m) is eqx.nn.MLP and type(o) is tuple and d == {"x": 1}
    assert autoflat.unwrap(loss) is loss
    # dicts keep their order (and keys that do not sort); other objects are returned as
    # they are, never rebuilt
    assert list(autoflat.unwrap({"b": model, 1: 2, "a": 3})) == ["b", 1, "a"]
    real = autoflat.unwrap(model)
    assert autoflat.unwrap(real) is real and autoflat.unwrap([real])[0] is real


def test_immutable_rebuilt_handle_stays_on_fast_path():
    model, opt_state, _ = _trained()
    model(jnp.ones(3))  # rebuild
    before = autoflat.stats(train)
    train(model, opt_state, _batches())
    after = autoflat.stats(train)
    assert after.flattens == before.flattens
    assert after.fast_path == before.fast_path + 2


def test_mutable_rebuilt_handle_is_reread():
    @autoflat.step(num_steps=2)
    def step(params, x):
        params = {"w": params["w"] + x}
        return params, x * 1

    p, _ = step({"w": jnp.float32(0.0)}, jnp.ones(2, jnp.float32))
    assert float(p["w"]) == 2.0
    p["w"] = jnp.float32(100.0)  # the rebuilt dict is changed in place by the user
    p2, _ = step(p, jnp.ones(2, jnp.float32))
    assert step.stats.flattens == 2  # the rebuilt, mutable dict was read again
    p3, _ = step(p2, jnp.ones(2, jnp.float32))  # p2 was never rebuilt: fast path
    assert step.stats.flattens == 2 and step.stats.fast_path == 1
    assert float(p3["w"]) == 104.0  # the user's change was seen: never stale


def test_array_state_handle_supports_operators():
    @autoflat.step
    def step(total, x):
        total = total + x
        return total

    t = step(jnp.float32(1.0), jnp.float32(2.0))
    assert float(t) == 3.0 and int(t) == 3 and float(t + 1) == 4.0 and float(2 * t) == 6.0
    assert np.asarray(t).shape == () and float(jnp.add(t, 1.0)) == 4.0
    assert f"{t:.1f}" == "3.0"


def test_new_handle_fills_every_slot_as_the_constructor_does():
    from autoflat._handles import LazyHandle, Origin, new_handle

    args = (object(), [jnp.ones(2)], None, Origin("f", "here", None), "state", None)
    a, b = LazyHandle(*args), new_handle(*args)
    for name in LazyHandle.__slots__:
        if name != "__weakref__":
            assert object.__getattribute__(a, name) is object.__getattribute__(b, name), name


def test_consumed_handle_raises_consumed_error_a_runtime_error():
    from autoflat._handles import Origin, new_handle

    structure, arrays = autoflat._structure.flatten({"w": jnp.ones(2)})
    origin = Origin("Trainer.update", "train.py:12", None)
    h = new_handle(structure, arrays, None, origin, "model", None)
    object.__setattr__(h, "_af_consumed_by", 3)
    with pytest.raises(RuntimeError, match="consumed by call 3 of `Trainer.update`") as info:
        h["w"]
    assert type(info.value) is autoflat.ConsumedError
    msg = str(info.value)
    assert "(train.py:12)" in msg and "model, ... = Trainer.update(model, ...)" in msg
    with pytest.raises(autoflat.ConsumedError):
        autoflat.unwrap([h])
    with pytest.raises(autoflat.ConsumedError):
        jax.tree.leaves(h)
