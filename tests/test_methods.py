"""Method steps: what their instances select, and how long autoflat keeps them.

A method step's `self` that is a plain object is taken as `jax.jit` takes a static argument
(one compile per instance, and per value of the attributes the body reads), but held weakly:
freed instances leave every cache of autoflat's, and the programs JAX compiled for them go at
the step's next compile that finds none alive. A pytree `self` (an Equinox module) passes its
arrays in as broadcast inputs; a Flax NNX module's `self` is state, written back.
"""

from __future__ import annotations

import functools
import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import tree_allclose

import autoflat


def _update(self, w, x):
    return w - self.scale * (x @ self.big).sum() * 1e-3


def _plain_model(k):
    """A plain class holding a large array, its method a step, and the same method under
    `jax.jit` with the instance static (counting its traces; its cache keeps every instance
    it saw)."""
    traces = []

    class Model:
        def __init__(self, n, scale=2.0, fill=1.0):
            self.big = jnp.full((100, n), fill)
            self.scale = scale

        @autoflat.step(num_steps=k)
        def update(self, w, x):
            return w - self.scale * (x @ self.big).sum() * 1e-3

    def counted(self, w, x):
        traces.append(self)
        return _update(self, w, x)

    return Model, jax.jit(counted, static_argnums=0), traces


def _xs(k, i):
    x = jnp.arange(3 * 100, dtype=jnp.float32).reshape(3, 100) / 300 + i
    return jnp.stack([x + j for j in range(k)]) if k > 1 else x


@jax.jit
def _pure(scale, big, w, x):
    """The method's body on the instance's values, as arguments (keeps no instance)."""
    return w - scale * (x @ big).sum() * 1e-3


def _reference(m, w, xs, k):
    for j in range(k):
        w = _pure(m.scale, m.big, w, xs[j] if k > 1 else xs)
    return w


@pytest.mark.parametrize("k", [1, pytest.param(4, marks=pytest.mark.slow)])
def test_freed_instances_of_a_method_step_are_not_kept(k):
    """Four instances of a class holding a large array, each called and deleted: all four
    stayed alive (a global table of structures, the spec cache and JAX's compile cache held
    each), and their arrays with them. Now at most the last is referenced, by the step's
    cache of the last broadcast argument; its arrays too. With the collector off: an
    instance kept until a collection (a cycle through the role inference's values) kept
    its compiled programs past the next compile. One compile per instance, as
    `jax.jit` with the instance static gives (and `jax.jit` keeps all four alive)."""
    Model, ref, ref_traces = _plain_model(k)
    instances, arrays = [], []
    w = ref_w = jnp.zeros(())
    gc.collect()
    gc.disable()  # each instance freed by its reference count: no cycle may hold one
    try:
        for i in range(4):
            m = Model(10 + i)
            xs = _xs(k, i)
            w = m.update(w, xs)
            ref_w = _reference(m, ref_w, xs, k)
            np.testing.assert_allclose(w, ref_w, rtol=1e-6)
            instances.append(weakref.ref(m))
            arrays.append(weakref.ref(m.big))
            del m
    finally:
        gc.enable()
    gc.collect()
    assert sum(r() is not None for r in instances) <= 1
    assert sum(r() is not None for r in arrays) <= 1
    assert [r() is not None for r in instances[:3]] == [False] * 3
    assert autoflat.stats(Model.update).traces == 4
    kept = [Model(10 + i) for i in range(4)]  # what jax.jit compiles, on instances kept
    for m in kept:
        ref(m, jnp.zeros(()), _xs(1, 0))
    assert len(ref_traces) == 4


def test_a_new_instance_never_runs_a_program_traced_for_another():
    """Instances made and freed one after the other (an address may be reused)
    with other attribute values, array and Python number alike: each call gives what
    `jax.jit` gives for that instance."""
    Model, _, _ = _plain_model(1)
    w = ref_w = jnp.zeros(())
    ids = []
    for i in range(4):
        m = Model(8, scale=1.0 + i, fill=0.5 * i)
        ids.append(id(m))
        x = _xs(1, i)
        w = m.update(w, x)
        ref_w = _reference(m, ref_w, x, 1)
        np.testing.assert_allclose(w, ref_w, rtol=1e-6)
        del m
        gc.collect()
    # Each instance compiled once (as under `jax.jit`), whether or not its address was new.
    assert autoflat.stats(Model.update).traces == 4, ids


def test_live_instances_keep_their_programs():
    """Two instances called in turn compile once each; freeing one leaves the other's
    program in place (no recompile), and a changed attribute still recompiles."""
    Model, ref, ref_traces = _plain_model(1)
    a, b = Model(4, scale=1.0), Model(4, scale=3.0)
    x = _xs(1, 0)
    for _ in range(2):
        for m in (a, b):
            np.testing.assert_allclose(m.update(jnp.zeros(()), x), ref(m, jnp.zeros(()), x))
    assert autoflat.stats(Model.update).traces == len(ref_traces) == 2
    del a
    gc.collect()
    np.testing.assert_allclose(b.update(jnp.zeros(()), x), ref(b, jnp.zeros(()), x))
    assert autoflat.stats(Model.update).traces == 2
    b.scale = 0.5
    np.testing.assert_allclose(b.update(jnp.zeros(()), x), _update(b, jnp.zeros(()), x))
    assert autoflat.stats(Model.update).traces == 3


def test_an_attribute_that_refers_back_to_the_instance():
    """An attribute the body reads that holds the instance itself (a closure over `self`,
    a bound method kept as an attribute): held weakly, so it keeps nothing alive."""

    class Model:
        def __init__(self, n):
            self.big = jnp.ones((50, n))
            self.project = lambda x: x @ self.big
            self.reduce = self._reduce

        def _reduce(self, y):
            return y.sum()

        @autoflat.step
        def update(self, w, x):
            return w - self.reduce(self.project(x)) * 1e-3

    instances = []
    w = jnp.zeros(())
    for i in range(3):
        m = Model(5 + i)
        w = m.update(w, jnp.ones((2, 50)))
        np.testing.assert_allclose(w, -0.1 * sum(5 + j for j in range(i + 1)), rtol=1e-5)
        instances.append(weakref.ref(m))
        del m
    gc.collect()
    assert sum(r() is not None for r in instances) <= 1


def test_an_instance_without_weak_references_is_held():
    """A class whose instances take no weak references (`__slots__` without `__weakref__`)
    is held as `jax.jit` holds a static argument: the results are still right."""

    class Model:
        __slots__ = ("__dict__",)

        def __init__(self, scale):
            self.scale = scale

        @autoflat.step
        def update(self, w, x):
            return w * self.scale + x

    for scale in (1.0, 2.0, 3.0):
        m = Model(scale)
        np.testing.assert_allclose(m.update(jnp.ones(2), jnp.ones(2)), [scale + 1] * 2)
        del m
    assert autoflat.stats(Model.update).traces == 3


def test_an_equinox_method_steps_freed_instances_are_not_kept():
    """A pytree `self` (an Equinox module): its arrays are broadcast inputs, so instances of
    the same shapes share one compile (as under `eqx.filter_jit`), and at most the last is
    referenced after they are freed."""
    eqx = pytest.importorskip("equinox")

    class Model(eqx.Module):
        big: jax.Array
        scale: float = eqx.field(static=True)

        @autoflat.step
        def update(self, w, x):
            return w - self.scale * (x @ self.big).sum() * 1e-3

    ref = eqx.filter_jit(_update)
    instances = []
    w = ref_w = jnp.zeros(())
    for i in range(4):
        m = Model(jnp.full((100, 10), 1.0 + i), 2.0)
        w = m.update(w, _xs(1, i))
        ref_w = ref(m, ref_w, _xs(1, i))
        np.testing.assert_allclose(w, ref_w, rtol=1e-6)
        instances.append(weakref.ref(m))
        del m
    gc.collect()
    assert sum(r() is not None for r in instances) <= 1
    assert autoflat.stats(Model.update).traces == 1


def test_a_flax_nnx_method_steps_freed_instances_are_not_kept():
    """A Flax NNX module's method step: equal to `nnx.jit`, one compile for instances of
    the same shapes, and the instances freed."""
    nnx = pytest.importorskip("flax.nnx")

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(5, 1, rngs=rngs)

        @autoflat.step
        def apply(self, x):
            return self.lin(x).sum()

    ref = nnx.jit(lambda m, x: m.lin(x).sum())
    instances = []
    for i in range(4):
        m = Model(nnx.Rngs(i))
        x = jnp.ones((2, 5)) * i
        np.testing.assert_allclose(m.apply(x), ref(m, x), rtol=1e-6)
        instances.append(weakref.ref(m))
        del m
    gc.collect()
    assert sum(r() is not None for r in instances) <= 1
    assert autoflat.stats(Model.apply).traces == 1


@pytest.mark.parametrize("kind", ["plain", "equinox"])
@pytest.mark.parametrize("clear", ["clear_caches", "clear_cache"])
def test_clearing_the_caches_lets_the_last_instance_go(kind, clear):
    """`autoflat.clear_caches()` and `step.clear_cache()` let go of the last instance too,
    and its arrays: nothing of autoflat's or of JAX's compile cache keeps them."""
    if kind == "plain":
        Model, _, _ = _plain_model(1)
        make = Model
    else:
        eqx = pytest.importorskip("equinox")

        class Module(eqx.Module):
            big: jax.Array
            scale: float = eqx.field(static=True)

            @autoflat.step
            def update(self, w, x):
                return w - self.scale * (x @ self.big).sum() * 1e-3

        Model = Module

        def make(n):
            return Module(jnp.ones((100, n)), 2.0)

    m = make(6)
    m.update(jnp.zeros(()), _xs(1, 0))
    instance, array = weakref.ref(m), weakref.ref(m.big)
    del m
    if clear == "clear_caches":
        autoflat.clear_caches()
    else:
        Model.update.clear_cache()
    gc.collect()
    assert instance() is None and array() is None


def test_the_header_says_what_selects_a_compiled_version():
    """Issue 26, item 14: the header listed class attributes and methods as recompiling, and
    said new array values of a pytree `self` recompile. Class attributes are not watched (a
    new value gives the old program: this test shows it), a pytree's arrays are inputs."""

    class Trainer:
        SCALE = 2.0

        def __init__(self):
            self.lr = 0.5

        def helper(self, x):
            return x * self.SCALE

        @autoflat.step
        def train(self, p):
            return p - self.lr * self.helper(p)

    t = Trainer()
    assert "# self: broadcast (the method's instance) [rule: option-or-self]" in (
        autoflat.show(t.train)
    )
    np.testing.assert_allclose(t.train(jnp.ones(2)), [0.0, 0.0])
    assert (
        "# self: broadcast (the method's instance; a new value of self.lr recompiles; "
        "self.helper (of the class: read when traced, not watched)) [rule: option-or-self]"
    ) in autoflat.show(t.train)
    Trainer.SCALE = 1.0  # not watched, as the header says: the old program runs
    np.testing.assert_allclose(t.train(jnp.ones(2)), [0.0, 0.0])
    assert autoflat.stats(Trainer.train).traces == 1
    t.lr = 1.0  # watched: recompiles, and reads the class attribute anew
    np.testing.assert_allclose(t.train(jnp.ones(2)), [0.0, 0.0])
    assert autoflat.stats(Trainer.train).traces == 2


def test_the_header_of_a_pytree_self_says_its_arrays_are_inputs():
    eqx = pytest.importorskip("equinox")

    class Model(eqx.Module):
        w: jax.Array

        @autoflat.step
        def train(self, p):
            return p - self.w

    Model(jnp.ones(2)).train(jnp.ones(2))
    header = autoflat.show(Model.train)
    assert (
        "# self: broadcast (the method's instance; a pytree: its arrays are inputs, its "
        "structure and static fields select the compiled version) [rule: option-or-self]"
    ) in header
    assert "recompiles" not in header.splitlines()[2]
    Model(jnp.array([3.0, 4.0], jnp.float32)).train(jnp.ones(2))  # new arrays: no recompile
    assert autoflat.stats(Model.train).traces == 1


@pytest.mark.parametrize("k", [1, 4])
def test_a_flax_nnx_module_s_method_that_changes_it_writes_back_as_nnx_jit(k):
    """A trainer module whose method updates its own model and optimizer in place (the
    optimizer's update, a call counter written in the body, dropout's rng count): `self` is
    state written back into the instance, as `nnx.jit` of the method leaves it (it was the
    method's broadcast instance, and every change was lost)."""
    nnx = pytest.importorskip("flax.nnx")
    import optax

    class Trainer(nnx.Module):
        def __init__(self, rngs):
            self.model = nnx.Sequential(
                nnx.Linear(4, 8, rngs=rngs),
                nnx.Dropout(0.3, rngs=rngs),
                nnx.Linear(8, 2, rngs=rngs),
            )
            self.optimizer = nnx.Optimizer(self.model, optax.adam(1e-2), wrt=nnx.Param)
            self.calls = nnx.BatchStat(jnp.zeros((), jnp.int32))

        def train_step(self, x, y):
            self.calls[...] = self.calls[...] + 1
            loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(self.model)
            self.optimizer.update(self.model, grads)
            return loss

    xs = jax.random.normal(jax.random.key(0), (8, 6, 4))
    ys = jax.random.normal(jax.random.key(1), (8, 6, 2))
    ref, got = Trainer(nnx.Rngs(0, dropout=1)), Trainer(nnx.Rngs(0, dropout=1))
    ref_losses = [nnx.jit(Trainer.train_step)(ref, xs[i], ys[i]) for i in range(8)]
    step = autoflat.step(got.train_step, num_steps=k)
    losses = []
    for i in range(0, 8, k):
        batch = (xs[i], ys[i]) if k == 1 else (xs[i : i + k], ys[i : i + k])
        losses.extend(jnp.atleast_1d(step(*batch)))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    tree_allclose(nnx.state(got), nnx.state(ref), rtol=1e-5, atol=1e-6)
    assert int(got.calls[...]) == 8 and int(got.optimizer.step[...]) == 8
    assert "# self: state (assigned into at line" in autoflat.show(step)


@pytest.mark.parametrize("k", [1, 4])
def test_a_flax_nnx_method_that_returns_self_updates_and_returns_the_instance(k):
    """`return self, loss` from a Flax NNX module's method (a fluent style): as under
    `nnx.jit`, the instance holds the new values and is what comes back (a handle stood for
    a new object, and a bound method step restarted from the old instance every call)."""
    nnx = pytest.importorskip("flax.nnx")

    class Ticker(nnx.Module):
        def __init__(self):
            self.count = nnx.BatchStat(jnp.zeros((), jnp.int32))
            self.w = nnx.Param(jnp.ones(2))

        def tick(self, x):
            self.count[...] += 1
            self.w[...] = self.w[...] * 0.5 + x
            return self, (self.w[...] * x).sum()

    xs = jax.random.normal(jax.random.key(0), (8, 2))
    ref, got = Ticker(), Ticker()
    for x in xs:
        back, _ = nnx.jit(Ticker.tick)(ref, x)
        assert back is ref
    step = autoflat.step(got.tick, num_steps=k)
    for i in range(0, 8, k):
        back, _ = step(xs[i] if k == 1 else xs[i : i + k])
        assert back is got
    assert int(got.count[...]) == 8
    tree_allclose(nnx.state(got), nnx.state(ref), rtol=1e-6)


class _Solver:
    """As jaxopt's solvers: `__post_init__` holds `self.update = jax.jit(self.update)`."""

    lr = 0.1

    def __init__(self):
        self.update = jax.jit(self.update)

    def update(self, params, x):
        g = jax.grad(lambda p: jnp.sum((p - x) ** 2))(params)
        return params - self.lr * g


@pytest.mark.parametrize("k", [1, 4])
def test_a_jax_jit_of_a_bound_method_is_the_method_step(k):
    """`autoflat.step(jax.jit(solver.update))`, or jaxopt's jitted `solver.update` itself,
    is the method as a method step (it was a SourceError: "it is a method")."""
    solver = _Solver()
    xs = jnp.arange(12.0).reshape(4, 3)
    want = jnp.zeros(3)
    for x in xs:
        want = solver.update(want, x)
    for wrapped in (solver.update, jax.jit(_Solver.update.__get__(solver))):
        step = autoflat.step(wrapped, num_steps=k)
        got = jnp.zeros(3)
        for i in range(0, 4, k):
            got = step(got, xs[i] if k == 1 else xs[i : i + k])
        np.testing.assert_allclose(autoflat.unwrap(got), want, rtol=1e-6)
        assert "# self: broadcast (the method's instance" in autoflat.show(step)
    # inside a partial or another jit: the instance bound as a partial binds it
    method = _Solver.update.__get__(solver)
    for wrapped in (functools.partial(jax.jit(method)), jax.jit(jax.jit(method))):
        step = autoflat.step(wrapped, num_steps=k)
        got = jnp.zeros(3)
        for i in range(0, 4, k):
            got = step(got, xs[i] if k == 1 else xs[i : i + k])
        np.testing.assert_allclose(autoflat.unwrap(got), want, rtol=1e-6)
