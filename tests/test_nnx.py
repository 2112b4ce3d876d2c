"""Flax NNX: mutation-style train steps written as in the Flax docs, functional NNX steps,
and shared references; results equal `nnx.jit` loops."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import noisy_allclose, tree_allclose

import autoflat
from autoflat._api import default_pack

nnx = pytest.importorskip("flax.nnx", reason="Flax is not installed")

pytestmark = pytest.mark.filterwarnings("ignore:.*\\.value.*:DeprecationWarning")


class Model(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(4, 16, rngs=rngs)
        self.bn = nnx.BatchNorm(16, rngs=rngs)
        self.drop = nnx.Dropout(0.2, rngs=rngs)
        self.l2 = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.drop(nnx.relu(self.bn(self.l1(x)))))


def make():
    model = Model(nnx.Rngs(0, dropout=1))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"), accuracy=nnx.metrics.Accuracy())
    return model, optimizer, metrics


def train_step(model, optimizer, metrics, x, y):
    def loss_fn(model):
        logits = model(x)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        return loss, logits

    (loss, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    optimizer.update(model, grads)  # mutation, nothing returned
    metrics.update(loss=loss, logits=logits, labels=y)


def _data(n):
    xs = jax.random.normal(jax.random.key(0), (n, 16, 4))
    ys = jax.random.randint(jax.random.key(1), (n, 16), 0, 3)
    return xs, ys


def _assert_same(objs, ref_objs):
    for a, b in zip(objs, ref_objs, strict=True):
        if default_pack() is True:
            # Every leaf packed (`nox -s tests_pack`): l1's bias, before the BatchNorm, has
            # gradients of float noise, which Adam moves by up to 1e-2 a step whatever the
            # noise; its moments and the BatchNorm's running mean follow it, and once the
            # model is in eval mode (running statistics), every gradient a little (up to
            # 20% of the elements past 1e-5 in test_changes_between_calls_are_seen).
            noisy_allclose(nnx.state(a), nnx.state(b), bound=0.25, outliers=0.3)
        else:
            tree_allclose(nnx.state(a), nnx.state(b), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("k,n", [(1, 3), pytest.param(3, 6, marks=pytest.mark.slow), (4, 10)])
def test_mutation_style_train_step_equals_nnx_jit(k, n):
    xs, ys = _data(n)
    ref_objs = make()
    ref = nnx.jit(train_step)
    objs = make()
    step = autoflat.step(train_step, num_steps=k)
    for start in range(0, n, k):
        stop = min(start + k, n)
        for i in range(start, stop):
            ref(*ref_objs, xs[i], ys[i])
        if k == 1:
            out = step(*objs, xs[start], ys[start])
        else:
            out = step(*objs, xs[start:stop], ys[start:stop])
        assert out is None
        # after every call the caller's own objects show the updates, as with nnx.jit
        _assert_same(objs, ref_objs)
    model, optimizer, metrics = objs
    ref_metrics = ref_objs[2].compute()
    for key, value in metrics.compute().items():
        np.testing.assert_allclose(value, ref_metrics[key], rtol=1e-5)
    assert int(optimizer.step.value) == n
    src = autoflat.show(step)  # after a call: roles include run-time types
    assert (
        "# model: state (a Model mutated in place: its new Variable values are written into the caller's object after the call)"
        in src
    )
    assert "# metrics: state (a flax.MultiMetric mutated in place" in src
    stats = autoflat.stats(step)
    calls = -(-n // k)
    if step.pack is not True:
        # One buffer per leaf (pack="auto" never packs state written back into the caller's
        # objects): the caller's buffers are copied once; later calls donate ours.
        assert stats.copies == 3
    else:
        assert stats.copies == 3 * calls  # packed anew from the caller's Variables every call
    assert stats.traces == (2 if n % k else 1)
    assert stats.calls == calls


def test_eval_mode_between_calls_is_seen():
    xs, ys = _data(4)

    def eval_step(model, metrics, x, y):
        logits = model(x)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        metrics.update(loss=loss, logits=logits, labels=y)

    model, optimizer, metrics = make()
    step = autoflat.step(train_step, num_steps=2)
    evaluate = autoflat.step(eval_step, num_steps=2)
    step(model, optimizer, metrics, xs[:2], ys[:2])
    model.eval()  # a static flag: the next call sees it and compiles the eval version
    before = nnx.state(model, nnx.BatchStat)
    metrics.reset()
    evaluate(model, metrics, xs[2:], ys[2:])
    tree_allclose(nnx.state(model, nnx.BatchStat), before, exact=True)  # no stat updates
    ref_model, _, ref_metrics = make()
    nnx.jit(train_step)(
        ref_model,
        nnx.Optimizer(ref_model, optax.adam(1e-2), wrt=nnx.Param),
        ref_metrics,
        xs[0],
        ys[0],
    )
    model.train()
    step(model, optimizer, metrics, xs[2:], ys[2:])
    assert int(optimizer.step.value) == 4


def _functional_step(model, optimizer, x, y):
    def loss_fn(model):
        return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return model, optimizer, loss


@pytest.mark.parametrize("k", [1, 3])
def test_nnx_objects_returned_by_name_are_the_callers_own_updated(k):
    """`return model, optimizer, loss`: as under `nnx.jit`, the call changes the caller's
    objects and returns them, so a loop that ignores what comes back trains too."""
    xs, ys = _data(6)
    ref_model, ref_opt, _ = make()
    ref = nnx.jit(_functional_step)
    for i in range(6):
        back = ref(ref_model, ref_opt, xs[i], ys[i])
        assert back[0] is ref_model and back[1] is ref_opt
    model, optimizer, _ = make()
    step = autoflat.step(_functional_step, num_steps=k)
    for i in range(0, 6, k):
        batch = (xs[i], ys[i]) if k == 1 else (xs[i : i + k], ys[i : i + k])
        got_model, got_opt, losses = step(model, optimizer, *batch)  # the objects ignored
        assert got_model is model and got_opt is optimizer
    assert jnp.shape(losses) == (() if k == 1 else (k,))
    assert autoflat.stats(step).fast_path == 2 * (6 // k - 1)  # the same objects again
    _assert_same([model, optimizer], [ref_model, ref_opt])
    assert "model: state (returned; a Model given back as itself" in autoflat.show(step)


def _adds_a_head(model, x):
    model.l1.kernel[...] = model.l1.kernel[...] * 0.5
    if not hasattr(model, "head"):
        model.head = nnx.Linear(3, 2, rngs=nnx.Rngs(5))
    return model.head(model(x)).sum()


def _adds_a_head_and_returns_it(model, x):
    return model, _adds_a_head(model, x)


@pytest.mark.parametrize("fn", [_adds_a_head, _adds_a_head_and_returns_it])
def test_a_submodule_the_step_adds_reaches_the_callers_model(fn):
    """A step that adds a submodule at its first call (`model.head = nnx.Linear(...)`):
    the caller's model has it afterwards, as under `nnx.jit` (the write-back raised Flax's
    "Found data ... assigned to static attribute" after writing part of the state)."""
    xs, _ = _data(3)
    ref_model, got_model = Model(nnx.Rngs(0, dropout=1)), Model(nnx.Rngs(0, dropout=1))
    ref_model.eval(), got_model.eval()
    step = autoflat.step(fn)
    for i in range(3):
        want, got = nnx.jit(fn)(ref_model, xs[i]), step(got_model, xs[i])
        if fn is _adds_a_head_and_returns_it:
            assert got[0] is got_model
            want, got = want[1], got[1]
        np.testing.assert_allclose(got, want, rtol=1e-6)
    assert isinstance(got_model.head, nnx.Linear)
    _assert_same([got_model], [ref_model])


class _Normed(nnx.Module):
    def __init__(self):
        self.l1 = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
        self.norm = nnx.BatchNorm(3, use_running_average=True, rngs=nnx.Rngs(0))
        self.extra = nnx.Linear(3, 3, rngs=nnx.Rngs(1))

    def __call__(self, x):
        return self.norm(self.l1(x))


def _reshapes(model, x):
    if isinstance(model.norm, nnx.BatchNorm):
        model.norm = nnx.LayerNorm(3, rngs=nnx.Rngs(1))  # replaced by another type
    if hasattr(model, "extra"):
        del model.extra
    model.norm.scale[...] = model.norm.scale[...] + 0.1
    return (model(x) ** 2).sum()


def test_a_submodule_the_step_replaces_or_deletes_is_so_in_the_callers_model():
    """Found by review: a submodule replaced by one of another type stayed the caller's
    old one (only its Variables overwritten), and a deleted one stayed."""
    xs = jax.random.normal(jax.random.key(0), (3, 5, 4))
    ref, got = _Normed(), _Normed()
    want = [float(nnx.jit(_reshapes)(ref, x)) for x in xs]
    step = autoflat.step(_reshapes)
    np.testing.assert_allclose([float(step(got, x)) for x in xs], want, rtol=1e-6)
    assert isinstance(got.norm, nnx.LayerNorm) and not hasattr(got, "extra")
    _assert_same([got], [ref])


class _Blocks(nnx.Module):
    def __init__(self):
        self.blocks = nnx.List([nnx.Linear(4, 4, rngs=nnx.Rngs(i)) for i in range(2)])

    def __call__(self, x):
        for b in self.blocks:
            x = b(x)
        return x.sum()


def _pops(model, x):
    if len(model.blocks) == 2:
        model.blocks.pop()
    return model(x)


def _appends(model, x):
    model.blocks.append(nnx.Linear(4, 4, rngs=nnx.Rngs(5)))
    return model(x)


@pytest.mark.parametrize("fn", [_pops, _appends])
def test_an_nnx_list_the_step_changes_is_so_in_the_callers_model(fn):
    """`model.blocks.pop()` / `.append(...)` on an `nnx.List` in the step (found by review):
    the caller's list must end as `nnx.jit` leaves it, its length with it (a pop left the list
    broken, an append was never seen)."""
    x = jnp.ones((3, 4))
    ref, got = _Blocks(), _Blocks()
    want = [float(nnx.jit(fn)(ref, x)) for _ in range(3)]
    step = autoflat.step(fn)
    np.testing.assert_allclose([float(step(got, x)) for _ in range(3)], want, rtol=1e-6)
    assert len(got.blocks) == len(ref.blocks) == len(list(got.blocks))
    _assert_same([got], [ref])


def _aliases(model, x):
    if not hasattr(model, "again"):
        model.again = model.l1
    model.again.kernel[...] = model.again.kernel[...] * 0.5
    return model(x).sum()


def test_a_node_the_step_stores_twice_is_a_clear_error_and_works_stored_before():
    """`model.again = model.l1` in the step: carried as a pytree, the two would come back as
    two copies updated apart (silently, found by review); a clear error, nothing changed,
    and the fix it gives (store it twice before the first call) equals `nnx.jit`."""
    xs, _ = _data(3)
    model, _, _ = make()
    model.eval()
    kernel = np.asarray(model.l1.kernel[...])
    with pytest.raises(autoflat.StateError, match=r"`model\.again\..*` \(stored twice"):
        autoflat.step(_aliases)(model, xs[0])
    np.testing.assert_array_equal(model.l1.kernel[...], kernel)
    assert not hasattr(model, "again")
    ref, _, _ = make()
    ref.eval()
    want = [float(nnx.jit(_aliases)(ref, x)) for x in xs]
    model.again = model.l1
    step = autoflat.step(_aliases)
    np.testing.assert_allclose([float(step(model, x)) for x in xs], want, rtol=1e-6)
    assert model.again is model.l1
    _assert_same([model], [ref])


def test_a_model_given_back_after_a_call_with_a_handle_is_the_callers_own():
    """A step first called with another step's handle of a model, then with a model of the
    same class: the second is the caller's own object, given back (the roles settled for
    the handle, which is no caller's object, were reused, and the model stayed stale)."""

    def cloned(model, x):
        model = nnx.clone(model)
        return model, model(x).sum()

    def bump(model, x):
        model.l2.bias[...] = model.l2.bias[...] + 1.0
        return model, model(x).sum()

    xs, _ = _data(2)
    model, _, _ = make()
    model.eval()
    handle, _ = autoflat.step(cloned)(model, xs[0])
    step = autoflat.step(bump)
    assert type(step(handle, xs[0])[0]) is autoflat.LazyHandle
    other, _, _ = make()
    other.eval()
    back, _ = step(other, xs[1])
    assert back is other
    np.testing.assert_allclose(other.l2.bias[...], np.ones(3))


def test_an_nnx_model_the_step_builds_anew_comes_back_as_a_handle():
    """A model the body builds (`model = nnx.clone(model)`) is a new object, as under
    `nnx.jit`: it comes back as a handle, and the caller's object is left as it was."""

    def rebuilt(model, x):
        model = nnx.clone(model)
        model.l1.kernel.value = model.l1.kernel.value * 2.0
        return model, model(x).sum()

    xs, _ = _data(2)
    model, _, _ = make()
    ref_model, _, _ = make()
    kernel = np.asarray(model.l1.kernel[...])
    ref = nnx.jit(rebuilt)(ref_model, xs[0])[0]
    assert ref is not ref_model
    np.testing.assert_array_equal(np.asarray(ref_model.l1.kernel[...]), kernel)
    step = autoflat.step(rebuilt)
    got, _ = step(model, xs[0])
    assert type(got) is autoflat.LazyHandle
    np.testing.assert_array_equal(np.asarray(model.l1.kernel[...]), kernel)
    np.testing.assert_allclose(got.l1.kernel[...], ref.l1.kernel[...], rtol=1e-6)


class _Counted(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.ones(2))
        self.n = nnx.BatchStat(jnp.zeros(()))

    def __call__(self, x):
        self.n[...] = self.n[...] + 1
        return x * self.w


def _forward(m, x):
    y = m(x)
    return m, y.sum()


@pytest.mark.parametrize("k", [1, 2])
def test_nnx_jit_and_nnx_update_on_a_returned_handle_reach_the_next_call(k):
    """What `nnx.jit` or `nnx.update` writes in place into a returned object's Variables,
    through its handle, is the object's: read back and taken by the next call (the handle
    is rebuilt for them, not walked as a copy)."""
    bump = nnx.jit(lambda m, x: m(x))
    x = jnp.ones((k, 2)) if k > 1 else jnp.ones(2)
    results = []
    for step in (autoflat.step(_forward, num_steps=k), None):
        m = _Counted()
        for _ in range(k):  # the reference: nnx.jit, one step a call
            if step is None:
                m, _ = nnx.jit(_forward)(m, jnp.ones(2))
        if step is not None:
            m, _ = step(m, x)
        bump(m, jnp.ones(2))
        nnx.update(m, jax.tree.map(lambda a: a + 10, nnx.state(m, nnx.BatchStat)))
        seen = float(m.n[...])
        if step is not None:
            m, _ = step(m, x)
        else:
            for _ in range(k):
                m, _ = nnx.jit(_forward)(m, jnp.ones(2))
        results.append((seen, float(m.n[...])))
    assert results[0] == results[1] == (k + 11.0, 2 * k + 11.0)


def two_models(model, other, x):
    model.l1.kernel.value = model.l1.kernel.value + jnp.sum(x)
    other.l2.bias.value = other.l2.bias.value + 1.0


def test_one_object_passed_as_two_arguments_matches_nnx_jit():
    xs, _ = _data(3)
    ref_model, _, _ = make()
    ref = nnx.jit(two_models)
    model, _, _ = make()
    step = autoflat.step(two_models)
    for i in range(3):
        ref(ref_model, ref_model, xs[i])
        step(model, model, xs[i])
    _assert_same([model], [ref_model])
    stats = autoflat.stats(step)
    assert (stats.traces, stats.flattens) == (1, 2)  # the first call only reads the objects


class Tied(nnx.Module):
    """One Linear stored twice, and a Variable stored twice: tied weights."""

    def __init__(self, rngs):
        self.enc = nnx.Linear(4, 4, rngs=rngs)
        self.dec = self.enc
        self.scale = nnx.Param(jnp.ones((4,)))
        self.scales = nnx.List([self.scale])
        self.count = nnx.BatchStat(jnp.zeros((), jnp.int32))

    def __call__(self, x):
        self.count[...] += 1
        return self.dec(nnx.tanh(self.enc(x)) * self.scales[0][...])


def tied_step(model, optimizer, x):
    def loss_fn(model):
        return jnp.mean((model(x) - x) ** 2)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


@pytest.mark.parametrize("k,pack", [(1, False), (3, False), (1, True), (3, True)])
def test_tied_weights_and_an_optimizer_match_nnx_jit(k, pack):
    xs = jax.random.normal(jax.random.key(0), (6, 8, 4))

    def fresh():
        model = Tied(nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    ref_model, ref_opt = fresh()
    ref = nnx.jit(tied_step)
    ref_losses = [ref(ref_model, ref_opt, x) for x in xs]
    model, optimizer = fresh()
    step = autoflat.step(tied_step, num_steps=k, pack=pack)
    losses = [step(model, optimizer, xs[i : i + k] if k > 1 else xs[i]) for i in range(0, 6, k)]
    np.testing.assert_allclose(np.ravel(losses), np.ravel(ref_losses), rtol=1e-5)
    _assert_same([model, optimizer], [ref_model, ref_opt])
    assert model.dec is model.enc and model.scales[0] is model.scale
    assert int(model.count[...]) == 6
    stats = autoflat.stats(step)
    assert (stats.traces, stats.flattens) == (1, 2)


class Count(nnx.Variable):
    pass


class Counted(nnx.Module):
    """google/flax docs_nnx/guides/demo.md: a `Count(0)` Variable holding a Python int that
    `__call__` increments; `share` stores one block twice (that page's model surgery)."""

    def __init__(self, rngs, share=False):
        self.blocks = nnx.List([nnx.Linear(4, 4, rngs=rngs) for _ in range(3)])
        if share:
            self.blocks[1] = self.blocks[2]
        self.count = Count(0)
        self.fixed = Count(3)  # never changed: nnx.jit traces it all the same

    def __call__(self, x):
        self.count.value += 1
        for b in self.blocks:
            x = nnx.tanh(b(x))
        return x * self.fixed.value


@pytest.mark.parametrize("k,share", [(1, False), (4, False), (1, True), (4, True)])
def test_python_numbers_in_variables_become_arrays_as_with_nnx_jit(k, share):
    xs = jax.random.normal(jax.random.key(0), (8, 8, 4))

    def fresh():
        model = Counted(nnx.Rngs(0), share)
        return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    ref_model, ref_opt = fresh()
    ref = nnx.jit(tied_step)
    ref_losses = [ref(ref_model, ref_opt, x) for x in xs]
    model, optimizer = fresh()
    step = autoflat.step(tied_step, num_steps=k)
    losses = [step(model, optimizer, xs[i : i + k] if k > 1 else xs[i]) for i in range(0, 8, k)]
    np.testing.assert_allclose(np.ravel(losses), np.ravel(ref_losses), rtol=1e-5)
    _assert_same([model, optimizer], [ref_model, ref_opt])
    assert isinstance(ref_model.count.value, jax.Array)  # what nnx.jit does with them
    for v in (model.count.value, model.fixed.value):
        assert isinstance(v, jax.Array)
    assert (int(model.count.value), int(model.fixed.value)) == (8, 3)
    assert (model.blocks[1] is model.blocks[2]) == share
    assert autoflat.stats(step).traces == 1


class Opaque(nnx.Module, pytree=False):
    """A module JAX flattens as one leaf (Flax suggests `pytree=False` for plain lists)."""

    def __init__(self, rngs):
        self.layers = [nnx.Linear(4, 4, rngs=rngs)]

    def __call__(self, x):
        return self.layers[0](x)


class HoldsOpaque(nnx.Module):
    def __init__(self, rngs):
        self.inner = Opaque(rngs)

    def __call__(self, x):
        return self.inner(x)


@pytest.mark.parametrize("cls,where", [(Opaque, "is a"), (HoldsOpaque, "holds at `model.inner` a")])
@pytest.mark.parametrize("k", [1, 4])
def test_a_module_declared_pytree_false_is_a_clear_error(cls, where, k):
    model = cls(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    before = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))
    step = autoflat.step(tied_step, num_steps=k)
    x = jnp.ones((k, 8, 4) if k > 1 else (8, 4))
    with pytest.raises(autoflat.StateError) as info:
        step(model, optimizer, x)
    message = str(info.value)
    assert message.startswith("`model` of `tied_step` (")
    assert "test_nnx.py:" in message
    assert f"{where} Flax NNX `Opaque` declared with `pytree=False`" in message
    assert "drop `pytree=False`, hold a list of submodules in `nnx.List([...])`" in message
    # nothing ran: the caller's objects are as they were, and nnx.jit still trains them
    tree_allclose(nnx.state(model, nnx.Param), before, rtol=0, atol=0)
    nnx.jit(tied_step)(model, optimizer, x[0] if k > 1 else x)


def test_an_object_returned_as_itself_may_share_variables_with_another_argument():
    """`return other` where `other` is `model` passed twice: as under `nnx.jit`, the change
    reaches the caller's object once, and the call returns it."""
    model, _, _ = make()
    xs, _ = _data(2)

    def returns_other(model, other, x):
        model.l1.kernel.value = model.l1.kernel.value + jnp.sum(x)
        return other

    ref_model, _, _ = make()
    back = nnx.jit(returns_other)(ref_model, ref_model, xs[0])
    assert back is ref_model
    step = autoflat.step(returns_other)
    assert step(model, model, xs[0]) is model
    np.testing.assert_array_equal(model.l1.kernel[...], ref_model.l1.kernel[...])


def test_shared_variables_with_a_returned_new_object_are_a_clear_error():
    model, optimizer, metrics = make()
    xs, ys = _data(2)

    def returns_other(model, other, x):
        model.l1.kernel.value = model.l1.kernel.value + jnp.sum(x)
        other = jax.tree.map(lambda a: a, other)
        return other

    step = autoflat.step(returns_other)
    kernel = model.l1.kernel[...]
    with pytest.raises(
        autoflat.AutoflatError, match=r"reachable as `model.*` and as `other.*`, and not every"
    ):
        step(model, model, xs[0])
    # nothing was lost
    np.testing.assert_array_equal(model.l1.kernel[...], kernel)
    train = autoflat.step(train_step)
    train(model, optimizer, metrics, xs[0], ys[0])
    assert int(optimizer.step.value) == 1


def test_alternating_train_and_eval_steps_copy_nothing_after_the_first_call():
    def eval_step(model, metrics, x, y):
        logits = model(x)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        metrics.update(loss=loss, logits=logits, labels=y)

    xs, ys = _data(2)
    model, optimizer, metrics = make()
    train = autoflat.step(train_step, num_steps=2)
    evaluate = autoflat.step(eval_step, num_steps=2)
    for _ in range(3):
        train(model, optimizer, metrics, xs, ys)
        evaluate(model, metrics, xs, ys)
    if not train.pack:
        # only the first call copies the caller's own buffers; every later call (of either
        # step) donates buffers autoflat wrote into the objects
        assert (train.stats.copies, evaluate.stats.copies) == (3, 0)
    assert int(optimizer.step[...]) == 6


def test_unchanged_objects_take_the_fast_path():
    xs, ys = _data(4)
    model, optimizer, metrics = make()
    step = autoflat.step(train_step)
    for i in range(4):
        step(model, optimizer, metrics, xs[i], ys[i])
    stats = autoflat.stats(step)
    assert stats.flattens == 3  # the first call only: later calls find the same objects unchanged
    assert stats.fast_path == 3 * 3
    assert stats.traces == 1
    if not step.pack:
        assert stats.copies == 3


class _Scaled(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(4, 3, rngs=rngs)
        self.scales = [1.0, 2.0]  # a plain list of Python floats: static, part of the structure

    def __call__(self, x):
        return self.l1(x) * self.scales[0]


def _restore(model, saved):
    nnx.update(model, saved)


CHANGES = {
    "eval mode": lambda model, opt: model.eval(),
    "value set by hand": lambda model, opt: setattr(
        model.l1.kernel, "value", model.l1.kernel.value * 0.5
    ),
    "submodule replaced": lambda model, opt: setattr(
        model, "l2", nnx.Linear(16, 3, rngs=nnx.Rngs(5))
    ),
    "new attribute": lambda model, opt: setattr(model, "extra", nnx.BatchStat(jnp.ones(2))),
    "checkpoint restored": lambda model, opt: _restore(
        model, jax.tree.map(lambda a: a + 1.0, nnx.state(model, nnx.Param))
    ),
    "optimizer step reset": lambda model, opt: setattr(opt.step, "value", jnp.array(0, jnp.uint32)),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_changes_between_calls_are_seen(change):
    xs, ys = _data(4)
    ref_objs = make()
    ref = nnx.jit(train_step)
    objs = make()
    step = autoflat.step(train_step)
    for i in range(4):
        if i == 2:
            CHANGES[change](*ref_objs[:2])
            CHANGES[change](*objs[:2])
        ref(*ref_objs, xs[i], ys[i])
        step(*objs, xs[i], ys[i])
        _assert_same(objs, ref_objs)
    assert autoflat.stats(step).flattens > 3  # the call after the change flattened again


def test_static_attributes_changed_between_calls_are_seen():
    def step_fn(model, x):
        model.l1.bias.value = model.l1.bias.value + jnp.sum(model(x))

    model = _Scaled(nnx.Rngs(0))
    expected = _Scaled(nnx.Rngs(0))  # run eagerly, no compiled-function cache at all
    step = autoflat.step(step_fn)
    x = jnp.ones((2, 4))
    for i in range(4):
        if i == 2:
            model.scales = [3.0, 2.0]  # a new static value
            expected.scales = [3.0, 2.0]
        step(model, x)
        step_fn(expected, x)
        tree_allclose(nnx.state(model), nnx.state(expected), rtol=1e-6)
    assert autoflat.stats(step).traces == 2  # compiled again for the new value
    assert autoflat.stats(step).flattens == 2  # the first call and the one after the change

    # Changed in place, the list is seen too (the call flattens again). Note that JAX's own
    # caches compare static values by equality with the treedef they hold, which holds this
    # same list object, so the compiled step keeps the old value, exactly as `nnx.jit` does.
    model.scales[0] = 5.0
    step(model, x)
    assert autoflat.stats(step).flattens == 3


def test_the_fast_path_does_not_keep_dropped_objects_alive():
    import gc
    import weakref

    xs, ys = _data(1)
    model, optimizer, metrics = make()
    step = autoflat.step(train_step)
    step(model, optimizer, metrics, xs[0], ys[0])
    kernel = weakref.ref(model.l1.kernel.get_raw_value())
    dropped = weakref.ref(model)
    del model, optimizer, metrics
    gc.collect()
    assert dropped() is None
    assert kernel() is None  # nor the buffers it wrote into them


def test_graph_snapshot_sees_every_kind_of_change():
    from autoflat._handles.snapshot import GraphSnapshot

    class Node:
        def __init__(self):
            self.child = None
            self.flag = False
            self.items = [1, 2]
            self.table = {"a": (1, [3])}
            self.tags = {"x"}

    def snapshot(root):
        return GraphSnapshot([root], lambda x: isinstance(x, (int, str, bool)))

    changes = [
        lambda n: setattr(n, "flag", True),
        lambda n: setattr(n, "new", 1),
        lambda n: delattr(n, "flag"),
        lambda n: n.items.append(3),
        lambda n: n.items.__setitem__(0, 5),
        lambda n: n.table.__setitem__("b", 1),
        lambda n: n.table["a"][1].append(4),  # a list inside a tuple inside a dict
        lambda n: n.tags.add("y"),
        lambda n: setattr(n.child, "flag", True),  # a nested object
    ]
    for change in changes:
        root = Node()
        root.child = Node()
        snap = snapshot(root)
        assert snap.unchanged()
        change(root)
        assert not snap.unchanged()
    root = Node()
    snap = snapshot(root)
    root.flag = False  # the same object again: no change
    assert snap.unchanged()


@pytest.mark.parametrize("k", [1, 2])
def test_called_through_nnx_cached_partial(k):
    """Flax's performance guide calls a train step as `nnx.cached_partial(train_step, model,
    optimizer)(batch)`: the partial clones the objects once (the clones hold the caller's
    Variables) and expects the step to take Flax's graph cache. The updates land in the
    caller's objects, as with nnx.jit; before, Flax raised after the update was applied."""
    n = 4
    xs, ys = _data(n)
    ref_objs = make()
    ref = nnx.cached_partial(nnx.jit(train_step), *ref_objs)
    objs = make()
    step = autoflat.step(train_step, num_steps=k)
    cached = nnx.cached_partial(step, *objs)
    for start in range(0, n, k):
        for i in range(start, start + k):
            ref(xs[i], ys[i])
        if k == 1:
            assert cached(xs[start], ys[start]) is None
        else:
            assert cached(xs[start : start + k], ys[start : start + k]) is None
        _assert_same(objs, ref_objs)
    assert autoflat.stats(step).traces == 1
    stats = autoflat.stats(step)
    # The three objects are flattened at the first call; later calls hit autoflat's NNX cache.
    assert stats.flattens == 3 and stats.fast_path == 3 * (stats.calls - 1)


def test_an_nnx_jit_step_is_taken_as_its_function():
    """An existing `@nnx.jit` step handed to autoflat was refused with the advice to put the
    wrapper above (as for `functools.wraps`); `jax.jit` and `eqx.filter_jit` were taken.
    With options autoflat would drop, it is refused, naming them."""
    xs, ys = _data(3)
    ref_objs, objs = make(), make()
    ref = nnx.jit(train_step)
    step = autoflat.step(nnx.jit(train_step), num_steps=3)
    for i in range(3):
        ref(*ref_objs, xs[i], ys[i])
    step(*objs, xs, ys)
    _assert_same(objs, ref_objs)
    with pytest.raises(autoflat.SourceError, match=r"with donate_argnums=\(0,\)"):
        autoflat.step(nnx.jit(train_step, donate_argnums=0))


def simple_step(model, optimizer, x, y):
    def loss_fn(model):
        return jnp.mean((model(x) - y) ** 2)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


@pytest.mark.parametrize("state", [None, "model"])
def test_a_model_whose_arrays_all_have_num_steps_rows_is_state(state):
    """`nnx.Linear(4, 4)` (or four layers scanned over) at num_steps=4: every array of the
    model has a leading axis of 4, so the mutated model was refused as looking per-step, and
    the fix the error offered, `state="model"`, was refused too (no return gives it back).
    An NNX object is state whatever its shapes."""
    xs = jax.random.normal(jax.random.key(0), (8, 16, 4))
    ys = jnp.zeros((8, 16, 4))

    def fresh():
        model = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    model, optimizer = fresh()
    ref = nnx.jit(simple_step)
    losses = [ref(model, optimizer, x, y) for x, y in zip(xs, ys, strict=True)]
    opts = {} if state is None else {"state": state}
    step = autoflat.step(simple_step, num_steps=4, **opts)
    m2, o2 = fresh()
    got = [step(m2, o2, xs[i : i + 4], ys[i : i + 4]) for i in (0, 4)]
    np.testing.assert_allclose(jnp.concatenate(got), jnp.stack(losses), rtol=1e-5)
    tree_allclose(nnx.state(m2), nnx.state(model), rtol=1e-5)


@pytest.mark.parametrize("k", [1, 4])
def test_a_module_holding_no_variables(k):
    """An NNX module of no Variables (a config-only module) beside the state: it is state
    with no arrays and comes back as itself; writing it back looked for the arrays of a
    handle after the program ran (AttributeError `_af_layout`)."""

    class Scale(nnx.Module):
        def __init__(self):
            self.factor = 2.0

    def update(m, w, x):
        w = w - 0.1 * m.factor * x
        return w

    scale, w = Scale(), jnp.ones(2)
    step = autoflat.step(update, num_steps=k)
    for _ in range(3):
        w = step(scale, w, jnp.ones((k, 2)) if k > 1 else jnp.ones(2))
    np.testing.assert_allclose(w, 1.0 - 3 * k * 0.2, rtol=1e-6)
    assert scale.factor == 2.0


def test_a_clone_or_a_kept_value_of_the_model_stays_valid():
    """`best = nnx.clone(model)` (an early-stopping snapshot) shares the model's arrays, as
    does a value read out of a Variable and kept: the next call copies those before donating
    them (they were deleted), and only those calls copy. Values as under `nnx.jit`."""
    nnx = pytest.importorskip("flax.nnx")

    def train(model, optimizer, x):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    def run(step):
        model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
        x = jnp.ones((4, 3))
        for _ in range(3):
            step(model, optimizer, x)
        copies.append(autoflat.stats(step).copies if step is fast else 0)
        best = nnx.clone(model)
        kept = model.bias[...]
        for _ in range(2):
            step(model, optimizer, x)
            copies.append(autoflat.stats(step).copies if step is fast else 0)
        return [np.asarray(a) for a in (best.kernel[...], kept, model.kernel[...])]

    fast, copies = autoflat.step(train), []
    got = run(fast)
    if fast.pack is not True:  # (every leaf packed: packed anew from the Variables every call)
        assert copies[1:] == [copies[0] + 1] * 2  # the model's arrays once, then none
    assert autoflat.stats(fast).fast_path >= 4
    for a, b in zip(got, run(nnx.jit(train)), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_tied_weights_are_not_copied_every_call_and_a_kept_one_stays_valid():
    """A tied Variable is one array at several leaves of the cached lists: those are not
    someone else holding it (every call copied the model's tied arrays before donating).
    A value of the tied weight kept by the caller is copied once, and stays valid."""
    xs = jax.random.normal(jax.random.key(0), (8, 8, 4))

    def run(step, keep_at):
        model = Tied(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
        copies, kept = [], None
        for i, x in enumerate(xs):
            if i == keep_at:
                kept = model.enc.kernel[...]
            step(model, optimizer, x)
            copies.append(autoflat.stats(step).copies if isinstance(step, autoflat.Step) else 0)
        return copies, np.asarray(kept), np.asarray(model.dec.kernel[...])

    fast = autoflat.step(tied_step)
    copies, kept, final = run(fast, keep_at=5)
    first = copies[0]
    if fast.pack is not True:  # (every leaf packed: packed anew from the Variables every call)
        assert copies[1:5] == [first] * 4  # nothing copied at rest
        assert copies[5:] == [first + 1] * 3  # the kept array's argument, once
    _, ref_kept, ref_final = run(nnx.jit(tied_step), keep_at=5)
    np.testing.assert_allclose(kept, ref_kept, rtol=1e-6)
    np.testing.assert_allclose(final, ref_final, rtol=1e-5)


class _CountedLinear(nnx.Module):
    """A module that counts its calls in a Variable (as a BatchNorm's statistics change)."""

    def __init__(self, rngs):
        self.linear = nnx.Linear(4, 3, rngs=rngs)
        self.calls = nnx.BatchStat(jnp.zeros((), jnp.int32))

    def __call__(self, x):
        self.calls[...] += 1
        return self.linear(x)


def _inner(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    optimizer.update(model, grads)
    return loss


def _train_through_a_helper(model, optimizer, x, y):
    return _inner(model, optimizer, x, y)


@pytest.mark.parametrize("k", [1, 4])
def test_a_helper_called_in_the_return_updates_the_caller_s_objects(k):
    """`return helper(model, optimizer, x, y)`: what the call changes in place reaches the
    caller, as with `nnx.jit` (state was flattened before the call ran, and every step
    restarted from the model passed in)."""
    xs = jax.random.normal(jax.random.key(0), (8, 5, 4))
    ys = jax.random.normal(jax.random.key(1), (8, 5, 3))

    def fresh():
        model = _CountedLinear(nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    ref, got = fresh(), fresh()
    ref_losses = [nnx.jit(_train_through_a_helper)(*ref, xs[i], ys[i]) for i in range(8)]
    step = autoflat.step(_train_through_a_helper, num_steps=k)
    chunk = (lambda a, i: a[i]) if k == 1 else (lambda a, i: a[i : i + k])
    losses = [step(*got, chunk(xs, i), chunk(ys, i)) for i in range(0, 8, k)]
    losses = [step_loss for chunk in losses for step_loss in jnp.atleast_1d(chunk)]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    tree_allclose(nnx.state(got[0]), nnx.state(ref[0]), rtol=1e-5, atol=1e-6)
    assert int(got[1].step[...]) == 8 and int(got[0].calls[...]) == 8


class _Dropped(nnx.Module):
    def __init__(self):
        self.drop = nnx.Dropout(0.5)

    def __call__(self, x, rngs):
        return self.drop(x, rngs=rngs)


def _forward_with_rngs(model, x, rngs):  # (Flax's randomness guide: `model(x, rngs=rngs)`)
    return model(x, rngs=rngs)


def test_rngs_advanced_by_a_call_in_the_return_advance_for_the_caller():
    """Each call draws a new dropout mask, as under `nnx.jit`: the `nnx.Rngs` count the
    call advances reaches the caller's object."""
    got, ref = [], []
    for f, out in ((autoflat.step(_forward_with_rngs), got), (nnx.jit(_forward_with_rngs), ref)):
        rngs, model = nnx.Rngs(0), _Dropped()
        out.extend(f(model, jnp.ones(16), rngs) for _ in range(3))
        out.append(rngs.default.count[...])
    tree_allclose(got, ref)
    assert int(got[-1]) == 3 and not bool(jnp.all(got[0] == got[1]))


class _Tallied(nnx.Module):
    def __init__(self):
        self.calls = nnx.BatchStat(jnp.zeros((), jnp.int32))
        self.w = nnx.Param(jnp.ones(3))


def _counted_in_finally(model, x):
    try:
        return (x * model.w[...]).sum()
    finally:
        model.calls[...] = model.calls[...] + 1


@pytest.mark.parametrize("k", [1, 4])
def test_a_change_in_a_finally_block_after_the_return_reaches_the_caller(k):
    """A `finally` block runs after the `return`'s expression, before the function returns:
    what it changes is in the state, as `nnx.jit` flattens what the function returned."""
    ref, got = _Tallied(), _Tallied()
    for _ in range(k):
        nnx.jit(_counted_in_finally)(ref, jnp.ones(3))
    step = autoflat.step(_counted_in_finally, num_steps=k)
    step(got, jnp.ones((k, 3)) if k > 1 else jnp.ones(3))
    assert int(got.calls[...]) == int(ref.calls[...]) == k


class _Flagged(nnx.Module):
    def __init__(self):
        self.n = 0  # a plain Python int attribute
        self.w = nnx.Param(jnp.zeros(()))
        self.drop = nnx.Dropout(0.5, rngs=nnx.Rngs(0))


def _count_and_switch(model, x):
    model.n = model.n + 1
    model.w[...] = model.w[...] + x.sum()
    model.eval()  # sets the Dropout's `deterministic`
    model.seen = True  # a new plain attribute
    return model.drop(x).sum()


def test_plain_attributes_a_step_changes_reach_the_caller_as_with_nnx_jit():
    """`model.n = model.n + 1` on a Python int and `model.eval()` inside the step: what
    `nnx.jit` leaves in the caller's modules, autoflat leaves too (it set the Variables
    only, and every call restarted from `n = 0`, dropout on)."""
    ref, got = _Flagged(), _Flagged()
    step = autoflat.step(_count_and_switch)
    for _ in range(3):
        want = nnx.jit(_count_and_switch)(ref, jnp.ones(2))
        have = step(got, jnp.ones(2))
    assert (got.n, float(got.w[...]), got.drop.deterministic, got.seen) == (3, 6.0, True, True)
    assert (ref.n, float(ref.w[...]), ref.drop.deterministic, ref.seen) == (3, 6.0, True, True)
    np.testing.assert_allclose(have, want)
