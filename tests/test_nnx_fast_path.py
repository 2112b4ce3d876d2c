"""The Flax NNX fast path: a mutation-style step called again with the same objects, unchanged,
is not traversed, and anything the user changes between calls is seen. Results equal
`nnx.jit` loops on the same objects, changed the same way."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import tree_allclose

import autoflat
from autoflat._api import default_pack

nnx = pytest.importorskip("flax.nnx", reason="Flax is not installed")

pytestmark = pytest.mark.filterwarnings("ignore:.*\\.value.*:DeprecationWarning")

_List = getattr(nnx, "List", list)


class Block(nnx.Module):
    def __init__(self, rngs):
        self.a = nnx.Linear(4, 4, rngs=rngs)
        self.b = nnx.Linear(4, 4, rngs=rngs)
        self.gain = 1.0  # a static attribute

    def __call__(self, x):
        return self.b(nnx.relu(self.a(x))) * self.gain + x


class Net(nnx.Module):
    def __init__(self, rngs):
        self.blocks = _List([Block(rngs), Block(rngs)])
        self.head = nnx.Linear(4, 3, rngs=rngs)

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make(seed=0):
    model = Net(nnx.Rngs(seed))
    return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


def train_step(model, optimizer, x, y):
    def loss_fn(model):
        return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def _data(n):
    xs = jax.random.normal(jax.random.key(0), (n, 8, 4))
    ys = jax.random.randint(jax.random.key(1), (n, 8), 0, 3)
    return xs, ys


def _same(objs, ref_objs):
    rtol, atol = (1e-3, 1e-4) if default_pack() is True else (1e-5, 1e-6)
    for a, b in zip(objs, ref_objs, strict=True):
        tree_allclose(nnx.state(a), nnx.state(b), rtol=rtol, atol=atol)


def test_unchanged_objects_are_not_traversed_and_equal_nnx_jit():
    xs, ys = _data(6)
    objs, ref_objs = make(), make()
    step, ref = autoflat.step(train_step), nnx.jit(train_step)
    for i in range(6):
        loss = step(*objs, xs[i], ys[i])
        ref_loss = ref(*ref_objs, xs[i], ys[i])
        assert jnp.allclose(loss, ref_loss, rtol=1e-5)
        _same(objs, ref_objs)  # reading the caller's objects between calls changes nothing
    stats = autoflat.stats(step)
    assert stats.flattens == 2  # the first call only: model and optimizer
    assert stats.fast_path == 2 * 5
    assert stats.traces == 1
    assert int(objs[1].step[...]) == 6


def _set_item(model, opt):
    model.head.kernel[...] = model.head.kernel[...] * 0.5


def _set_raw(model, opt):
    model.head.bias.set_raw_value(model.head.bias.get_raw_value() + 1.0)


def _new_variable_same_array(model, opt):
    # A new Variable object holding the very array the old one held: only the graph shows it.
    model.blocks[0].a.bias = nnx.Param(model.blocks[0].a.bias.get_raw_value())


def _swap_submodules(model, opt):
    block = model.blocks[1]
    block.a, block.b = block.b, block.a


def _swap_blocks(model, opt):
    model.blocks[0], model.blocks[1] = model.blocks[1], model.blocks[0]


def _static_attribute(model, opt):
    model.blocks[1].gain = 0.5


def _optimizer_moment(model, opt):
    state = nnx.state(opt, nnx.OptState)
    nnx.update(opt, jax.tree.map(lambda a: a * 0 if a.ndim else a, state))


CHANGES = {
    "[...] set": _set_item,
    "set_raw_value": _set_raw,
    "new Variable, same array": _new_variable_same_array,
    "submodules swapped": _swap_submodules,
    "list items swapped": _swap_blocks,
    "static attribute": _static_attribute,
    "optimizer state restored": _optimizer_moment,
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_change_between_calls_is_seen(change):
    xs, ys = _data(5)
    objs, ref_objs = make(), make()
    step, ref = autoflat.step(train_step), nnx.jit(train_step)
    for i in range(5):
        if i == 2:
            CHANGES[change](*objs)
            CHANGES[change](*ref_objs)
        step(*objs, xs[i], ys[i])
        ref(*ref_objs, xs[i], ys[i])
        _same(objs, ref_objs)
    # the call after the change read the objects afresh, and the next one was fast again
    assert autoflat.stats(step).flattens == 4
    assert autoflat.stats(step).fast_path == 2 * 3


def test_an_attribute_renamed_is_seen():
    """Renaming the last attribute keeps every value where it was: only the keys show it."""

    class Renamed(nnx.Module):
        def __init__(self, rngs):
            self.first = nnx.Linear(4, 3, rngs=rngs)

        def __call__(self, x):
            return (self.first if hasattr(self, "first") else self.second)(x)

    def step_fn(model, optimizer, x, y):
        def loss_fn(model):
            return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

        optimizer.update(model, nnx.grad(loss_fn)(model))

    xs, ys = _data(4)
    model = Renamed(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    step = autoflat.step(step_fn)
    for i in range(4):
        if i == 2:
            model.second = model.first
            del model.first
        step(model, optimizer, xs[i], ys[i])
    assert autoflat.stats(step).flattens == 2 * 2
    assert not hasattr(model, "first")
    assert int(optimizer.step[...]) == 4


def test_other_objects_each_call_are_their_own():
    xs, ys = _data(4)
    pairs, ref_pairs = [make(0), make(1)], [make(0), make(1)]
    step, ref = autoflat.step(train_step), nnx.jit(train_step)
    for i in range(4):
        step(*pairs[i % 2], xs[i], ys[i])
        ref(*ref_pairs[i % 2], xs[i], ys[i])
        for objs, ref_objs in zip(pairs, ref_pairs, strict=True):
            _same(objs, ref_objs)
    assert autoflat.stats(step).flattens == 2 * 4  # each call misses the other pair's cache


class Counted(nnx.Param):
    """A Variable type with a setter of its own: autoflat calls it for every write."""

    writes: list[int] = []

    def set_raw_value(self, value, **kwargs):
        Counted.writes.append(id(self))
        super().set_raw_value(value, **kwargs)


def test_a_variable_type_with_its_own_setter_gets_every_write():
    class Small(nnx.Module):
        def __init__(self):
            self.w = Counted(jnp.ones((4, 3)))
            self.b = Counted(jnp.zeros(3))

        def __call__(self, x):
            return x @ self.w[...] + self.b[...]

    def step_fn(model, x, y):
        def loss_fn(model):
            return jnp.mean((model(x) - y[:, None]) ** 2)

        grads = nnx.grad(loss_fn)(model)
        model.w[...] = model.w[...] - 0.1 * grads.w[...]
        model.b[...] = model.b[...] - 0.1 * grads.b[...]

    xs, ys = _data(3)
    model, expected = Small(), Small()
    step = autoflat.step(step_fn)
    for i in range(3):
        Counted.writes.clear()
        step(model, xs[i], ys[i])
        assert {id(model.w), id(model.b)} <= set(Counted.writes)
        step_fn(expected, xs[i], ys[i])
        tree_allclose(nnx.state(model), nnx.state(expected), rtol=1e-5)
    assert autoflat.stats(step).fast_path == 2
