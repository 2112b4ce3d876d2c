"""Plain pytrees of every kind as state: dicts, lists, NamedTuples, flax.struct and
register_dataclass dataclasses, None leaves, Python scalars, mixed dtypes, PRNG keys."""

from __future__ import annotations

import dataclasses
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import tree_allclose

import autoflat


class Pair(NamedTuple):
    a: jax.Array
    b: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Registered:
    w: jax.Array
    step: jax.Array
    name: str = dataclasses.field(metadata=dict(static=True), default="reg")


def _state():
    return {
        "list": [jnp.ones(3), jnp.zeros((2, 2))],
        "pair": Pair(jnp.ones(2), jnp.arange(2, dtype=jnp.int32)),
        "none": None,
        "bf16": jnp.ones(4, jnp.bfloat16),
        "counter": jnp.zeros((), jnp.int32),
        "typed_key": jax.random.key(0),
        "raw_key": jax.random.PRNGKey(1),
        "registered": Registered(jnp.ones(2), jnp.zeros((), jnp.int32)),
        "scale": 0.5,  # a Python scalar: static, as in eqx.filter_jit
        "tag": "run-1",
    }


def update(state, x):
    typed_key, sub = jax.random.split(state["typed_key"])
    raw_key, raw_sub = jax.random.split(state["raw_key"])
    noise = jax.random.normal(sub, (3,)) + jax.random.uniform(raw_sub, (3,))
    state = {
        "list": [state["list"][0] * state["scale"] + x + noise, state["list"][1] + 1.0],
        "pair": Pair(state["pair"].a * 2.0, state["pair"].b + 1),
        "none": None,
        "bf16": (state["bf16"] * 1.5).astype(jnp.bfloat16),
        "counter": state["counter"] + 1,
        "typed_key": typed_key,
        "raw_key": raw_key,
        "registered": Registered(state["registered"].w + 1.0, state["registered"].step + 1),
        "scale": state["scale"],
        "tag": state["tag"],
    }
    return state, jnp.sum(state["list"][0])


@pytest.mark.parametrize("k", [1, 4])
def test_all_kinds_of_leaves(k):
    xs = jnp.arange(8.0, dtype=jnp.float32)
    # jax.jit cannot take the string leaf; eqx.filter_jit treats non-arrays as autoflat does
    eqx = pytest.importorskip("equinox")
    ref = eqx.filter_jit(update)
    rs, ref_out = _state(), []
    for i in range(8):
        rs, o = ref(rs, xs[i])
        ref_out.append(o)
    step = autoflat.step(update, num_steps=k)
    s, outs = _state(), []
    for start in range(0, 8, k):
        s, o = step(s, xs[start] if k == 1 else xs[start : start + k])
        outs.append(jnp.atleast_1d(o))
    real = autoflat.unwrap(s)
    assert real["scale"] == 0.5 and real["tag"] == "run-1" and real["none"] is None
    assert real["bf16"].dtype == jnp.bfloat16 and real["counter"].dtype == jnp.int32
    assert jax.dtypes.issubdtype(real["typed_key"].dtype, jax.dtypes.prng_key)
    assert real["raw_key"].dtype == jnp.uint32
    assert isinstance(real["pair"], Pair) and isinstance(real["registered"], Registered)
    tree_allclose(real, rs, rtol=1e-5)
    np.testing.assert_allclose(jnp.concatenate(outs), jnp.stack(ref_out), rtol=1e-5)
    assert int(real["counter"]) == 8


def test_flax_struct_dataclass():
    struct = pytest.importorskip("flax.struct")

    @struct.dataclass
    class TrainState:
        params: dict
        step: jax.Array
        apply_name: str = struct.field(pytree_node=False, default="mlp")

    def update(ts, x):
        ts = ts.replace(params={"w": ts.params["w"] + x}, step=ts.step + 1)
        return ts

    step = autoflat.step(update, num_steps=3)
    ts = TrainState(params={"w": jnp.zeros(2)}, step=jnp.zeros((), jnp.int32))
    ts = step(ts, jnp.ones((3, 2)))
    ts = step(ts, jnp.ones((3, 2)))
    assert isinstance(ts, TrainState) and ts.apply_name == "mlp"
    assert int(ts.step) == 6 and ts.params["w"].tolist() == [6.0, 6.0]
    assert autoflat.stats(step).fast_path == 1


# jax-ml/jax docs/the-training-cookbook.py, verbatim: a dict whose attributes are its keys (a
# missing attribute raises a KeyError, not an AttributeError).
@jax.tree_util.register_pytree_with_keys_class
class dot_dict(dict):  # noqa: N801
    __setattr__ = dict.__setitem__
    __getattr__ = dict.__getitem__

    def tree_flatten_with_keys(self):
        keys = tuple(sorted(self))
        return tuple((jax.tree_util.DictKey(k), self[k]) for k in keys), keys

    @classmethod
    def tree_unflatten(cls, keys, values):
        return cls(zip(keys, values))  # noqa: B905 (verbatim)


def _sgd(params, x):
    grads = jax.grad(lambda p: jnp.sum((x @ p.w) ** 2))(params)
    new_params = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
    return new_params, jnp.sum(x)


def _sgd_update(param, grad):  # (the cookbook's `adam_update`: written into a jax.Ref)
    param[...] -= 0.1 * grad


def _ref_step(train_state, batch):  # (the cookbook's `train_step`)
    params = jax.tree.map(jax.ref.get, train_state)
    loss, grad = jax.value_and_grad(lambda p: jnp.sum((batch["x"] @ p.w) ** 2))(params)
    jax.tree.map(_sgd_update, train_state, grad)
    return {"loss": loss}


@pytest.mark.parametrize("k", [1, 4])
def test_a_dict_whose_missing_attributes_raise_key_error(k):
    """The JAX training cookbook's `dot_dict`: as a state returned under another name, and
    holding `jax.Ref`s that the step writes into (the cookbook's train state), equal to
    `jax.jit` (the roles' `getattr(value, "dtype", None)` raised its `KeyError`)."""
    xs = jax.random.normal(jax.random.key(0), (8, 2, 3))
    want = dot_dict(w=jnp.ones((3, 1)))
    for x in xs:
        want, _ = jax.jit(_sgd)(want, x)
    step = autoflat.step(_sgd, num_steps=k)
    got = dot_dict(w=jnp.ones((3, 1)))
    for i in range(0, 8, k):
        got, _ = step(got, xs[i] if k == 1 else xs[i : i + k])
    tree_allclose(autoflat.unwrap(got), want, rtol=1e-5)

    refs = jax.tree.map(jax.ref.new_ref, dot_dict(w=jnp.ones((3, 1))))
    ref_losses = [jax.jit(_ref_step)(refs, {"x": x})["loss"] for x in xs]
    state = jax.tree.map(jax.ref.new_ref, dot_dict(w=jnp.ones((3, 1))))
    ref_step = autoflat.step(_ref_step, num_steps=k)
    losses = [ref_step(state, {"x": xs[i] if k == 1 else xs[i : i + k]}) for i in range(0, 8, k)]
    np.testing.assert_allclose(
        jnp.concatenate([jnp.atleast_1d(m["loss"]) for m in losses]), ref_losses, rtol=1e-5
    )
    np.testing.assert_allclose(state.w[...], refs.w[...], rtol=1e-5)


@jax.tree_util.register_pytree_node_class
class _CheckedScale:
    """As jmp's loss scales: the class checks its leaf when built (jax.jit never builds it
    around anything but arrays and tracers)."""

    def __init__(self, scale):
        if isinstance(scale, tuple):
            raise TypeError("a loss scale must be an array")
        if isinstance(scale, int):
            warnings.warn("Expected floating type for loss_scale", UserWarning, stacklevel=2)
        self.scale = jnp.asarray(scale) if isinstance(scale, float) else scale

    def tree_flatten(self):
        return (self.scale,), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children)


def _scaled(w, ls, x):
    g = jax.grad(lambda w: jnp.sum((w - x) ** 2) * ls.scale)(w) / ls.scale
    return w - 0.1 * g, _CheckedScale(jnp.minimum(ls.scale * 2.0, 2.0**16)), ls.scale


@pytest.mark.parametrize("k", [1, 4])
def test_a_class_that_checks_its_leaves_is_never_built_around_placeholders(k):
    """A class checking its leaves when built (dm-haiku's imagenet example's jmp loss scale):
    autoflat's bookkeeping rebuilt it around (shape, dtype) tuples (a TypeError where
    `jax.jit` runs) and, describing a structure, around int placeholders (a warning)."""
    xs = jnp.ones((4, 3))
    want = (jnp.ones(3), _CheckedScale(2.0**15))
    for i in range(4):
        want = jax.jit(_scaled)(*want, xs[i])[:2]
    step = autoflat.step(_scaled, num_steps=k)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = (jnp.ones(3), _CheckedScale(2.0**15))
        for i in range(0, 4, k):
            got = step(*got, xs[i] if k == 1 else xs[i : i + k])[:2]
    tree_allclose(autoflat.unwrap(got), want)
    # as a per-step input
    assert jnp.shape(autoflat.step(lambda_free_scale)(_CheckedScale(jnp.ones(3)), 2.0)) == (3,)


def lambda_free_scale(ls, x):
    return ls.scale * x
