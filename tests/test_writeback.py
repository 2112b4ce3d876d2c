"""Mutation-style state (`_writeback`): new values written into the caller's objects, and
objects that cannot be updated in place refused before the call."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from helpers import tree_allclose

import autoflat


def test_mutation_style_writes_back_into_callers_objects():
    def update(stats, x):
        stats["total"] = stats["total"] + jnp.sum(x)
        stats["history"][0] = stats["history"][0] + 1

    ref_stats = {"total": jnp.zeros(()), "history": [jnp.zeros((), jnp.int32)]}
    ref = jax.jit(lambda s, x: (update(s, x), s)[1])
    for i in range(6):
        ref_stats = ref(ref_stats, jnp.full((3,), float(i)))

    step = autoflat.step(update, num_steps=3)
    stats = {"total": jnp.zeros(()), "history": [jnp.zeros((), jnp.int32)]}
    history = stats["history"]
    xs = jnp.stack([jnp.full((3,), float(i)) for i in range(6)])
    assert step(stats, xs[:3]) is None
    assert step(stats, xs[3:]) is None
    assert stats["history"] is history  # updated in place, not replaced
    assert float(stats["total"]) == float(ref_stats["total"]) == 45.0
    assert int(history[0]) == 6
    assert "# stats: state (assigned into at line" in autoflat.show(step)


def test_mutation_into_immutable_parts_is_a_clear_error():
    def update(state, x):
        state[0]["w"] = state[0]["w"] + x

    step = autoflat.step(update)
    state = ({"w": jnp.zeros(())}, jnp.zeros(()))
    with pytest.raises(autoflat.AutoflatError, match=r"`state\[1\]` is immutable \(tuple\)"):
        step(state, jnp.float32(1.0))
    assert float(state[0]["w"]) == 0.0  # checked before running: nothing half-written


@pytest.mark.parametrize("k", [1, 4])
def test_python_numbers_in_a_dict_changed_in_place(k):
    """A Python int the step counts up in a dict it changes in place becomes an array (one
    trace, as for returned state); Python values it leaves alone stay as they are, and a dict
    of Python values only is written back too."""

    def update(params, counters, flags, x):
        counters["n"] = counters["n"] + 1
        flags["mode"] = "train"
        params = {"w": params["w"] - counters["scale"] * x}
        return params, jnp.sum(x)

    step = autoflat.step(update, num_steps=k)
    params = {"w": jnp.ones(3)}
    counters = {"n": 0, "scale": 0.5}
    flags = {"mode": "train", "off": False}
    for _ in range(3):
        x = jnp.ones((k, 3)) if k > 1 else jnp.ones(3)
        params, _ = step(params, counters, flags, x)
    assert isinstance(counters["n"], jax.Array) and int(counters["n"]) == 3 * k
    assert counters["scale"] == 0.5 and type(counters["scale"]) is float
    assert flags == {"mode": "train", "off": False}
    assert float(params["w"][0]) == pytest.approx(1.0 - 0.5 * 3 * k)
    assert autoflat.stats(step).traces == 1


def test_python_numbers_in_a_dict_that_gains_a_key():
    """A running-totals dict that the step also gives a new key (`setdefault`): the count
    it adds to stayed a Python int (matched by leaf index, the trees differed in length), and
    the step traced again on every call."""

    def update(w, totals, x):
        loss = jnp.sum((w * x - 1.0) ** 2)
        w = w - 0.01 * jax.grad(lambda w: jnp.sum((w * x - 1.0) ** 2))(w)
        totals["a_loss"] = totals["a_loss"] + loss
        totals["count"] += 1
        totals.setdefault("max", jnp.asarray(-jnp.inf))
        totals["max"] = jnp.maximum(totals["max"], loss)
        return w

    step = autoflat.step(update)
    w, totals = jnp.zeros(3), {"a_loss": jnp.zeros(()), "count": 0, "tag": 7}
    for _ in range(10):
        w = step(w, totals, jnp.ones(3))
    assert isinstance(totals["count"], jax.Array) and int(totals["count"]) == 10
    assert totals["tag"] == 7 and type(totals["tag"]) is int
    assert autoflat.stats(step).traces == 2  # the dict without, then with, its new key


@pytest.mark.parametrize("k", [1, 2])
def test_dict_subclasses_are_written_back(k):
    """A `defaultdict` of totals was refused as "immutable (defaultdict)" (no `__dict__`),
    where an `OrderedDict` worked."""
    import collections

    def update(w, totals, x):
        totals["loss"] += jnp.sum(w * x)
        w = w + x
        return w

    step = autoflat.step(update, num_steps=k)
    totals = collections.defaultdict(float, loss=jnp.zeros(()))
    xs = jnp.ones((k, 3)) if k > 1 else jnp.ones(3)
    w = step(jnp.zeros(3), totals, xs)
    w = step(w, totals, xs)
    assert type(totals) is collections.defaultdict
    assert float(totals["loss"]) == pytest.approx(3.0 * sum(range(2 * k)))


def test_an_object_jax_takes_as_a_leaf_changed_in_place_says_so():
    class Meter:  # not a pytree: one leaf to JAX
        def __init__(self):
            self.total = jnp.zeros(())

    def update(w, meter, x):
        meter.total = meter.total + jnp.sum(w * x)
        return w + x

    meter = Meter()
    with pytest.raises(autoflat.StateError, match=r"JAX takes a Meter as one leaf") as info:
        autoflat.step(update)(jnp.zeros(3), meter, jnp.ones(3))
    assert "named in state=" not in str(info.value)
    assert float(meter.total) == 0.0


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("where", ["body", "closure", "del"])
def test_an_input_only_taken_from_is_the_steps_own_copy(where, k):
    """A step that takes entries out of its batch (`labels = batch.pop("labels")` at the top
    of the body or in a loss function closing over it, as Hugging Face's Flax examples do, or
    `del batch["mask"]`) changes its own copy under `jax.jit`. It is not state: the caller's
    batch keeps its keys (it lost them, written back, and the next call with it raised a
    KeyError), and at num_steps=4 it is a per-step input (it was a ShapeError asking which)."""
    import numpy as np
    import optax

    opt = optax.sgd(0.1)

    def update(params, opt_state, loss_fn):
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def mse(p, batch, labels):
        return jnp.mean((batch["x"] @ p["w"] - labels) ** 2)

    if where == "body":

        def train_step(params, opt_state, batch):
            labels = batch.pop("labels")
            params, opt_state, loss = update(params, opt_state, lambda p: mse(p, batch, labels))
            return params, opt_state, loss

    elif where == "closure":

        def train_step(params, opt_state, batch):
            def loss_fn(p):
                labels = batch.pop("labels")
                return mse(p, batch, labels)

            params, opt_state, loss = update(params, opt_state, loss_fn)
            return params, opt_state, loss

    else:

        def train_step(params, opt_state, batch):
            labels = batch["labels"]
            del batch["labels"]
            params, opt_state, loss = update(params, opt_state, lambda p: mse(p, batch, labels))
            return params, opt_state, loss

    rng = np.random.default_rng(0)
    batches = [
        {"x": jnp.asarray(rng.normal(size=(2, 3)), jnp.float32), "labels": jnp.ones(2) * i}
        for i in range(8)
    ]
    ref_step = jax.jit(train_step)
    params = {"w": jnp.zeros(3)}
    ref_params, ref_state, ref_losses = params, opt.init(params), []
    for batch in batches:
        ref_params, ref_state, loss = ref_step(ref_params, ref_state, batch)
        ref_losses.append(loss)
    assert all(sorted(b) == ["labels", "x"] for b in batches)

    step = autoflat.step(train_step, num_steps=k)
    chunks = (
        batches
        if k == 1
        else [jax.tree.map(lambda *xs: jnp.stack(xs), *batches[i : i + k]) for i in (0, 4)]
    )
    p, s, losses = params, opt.init(params), []
    for chunk in chunks:
        p, s, loss = step(p, s, chunk)
        losses.append(jnp.atleast_1d(loss))
    assert all(sorted(c) == ["labels", "x"] for c in chunks)
    np.testing.assert_allclose(p["w"], ref_params["w"], rtol=1e-6)
    np.testing.assert_allclose(jnp.concatenate(losses), jnp.stack(ref_losses), rtol=1e-6)
    spelling = {"body": "batch.pop(...)", "closure": "batch.pop(...)", "del": 'del batch["labels"]'}
    assert (
        f"# batch: scanned (per-step{' input' if k == 1 else ': leading axis 4'}"
        in autoflat.show(step)
    )
    assert f"`{spelling[where]}` at line" in autoflat.show(step)
    assert "changes the step's own copy, as under jax.jit, not your object" in autoflat.show(step)
    assert autoflat.stats(step).traces == 1


def test_an_input_taken_from_and_changed_is_still_state():
    """`d.pop(k)` beside a change that adds (`d.update(...)`, `d[k] = ...`) is mutation-style
    state as before: the caller's dict has the new contents, the key taken gone."""

    def update(totals, x):
        old = totals.pop("old")
        totals["sum"] = totals["sum"] + old + jnp.sum(x)
        return jnp.sum(x)

    step = autoflat.step(update)
    totals = {"sum": jnp.zeros(()), "old": jnp.ones(())}
    step(totals, jnp.ones(3))
    assert sorted(totals) == ["sum"]
    assert float(totals["sum"]) == 4.0
    assert "# totals: state (assigned into at line" in autoflat.show(step)


# --- every spelling of a change in place that the Roles page and the FAQ list, each alone ----


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Totals:
    """A mutable pytree (JAX flattens it; autoflat writes into its fields)."""

    total: jax.Array
    count: jax.Array


def set_item(d, x):
    d["a"] = d["a"] + jnp.sum(x)


def dict_update(d, x):
    d.update({"a": d["a"] + jnp.sum(x)})


def dict_or_assign(d, x):
    d |= {"a": d["a"] + jnp.sum(x)}


def dict_setdefault(d, x):
    d.setdefault(f"n{len(d)}", jnp.sum(x))


def pop_beside(d, x):
    old = d.pop("b")
    d.update(a=d["a"] + old + jnp.sum(x), b=2.0 * old)


def del_beside(d, x):
    old = d["b"]
    del d["b"]
    d |= {"a": d["a"] + jnp.sum(x), "b": old + 1.0}


def list_set_item(xs, x):
    xs[0] = xs[0] + jnp.sum(x)


def list_append(xs, x):
    xs.append(jnp.sum(x))


def list_add_assign(xs, x):
    xs += [jnp.sum(x)]


def list_extend(xs, x):
    xs.extend([jnp.sum(x), -jnp.sum(x)])


def attribute(t, x):
    t.total = t.total + jnp.sum(x)
    t.count = t.count + 1


def with_setattr(t, x):
    setattr(t, "total", t.total + jnp.sum(x))  # noqa: B010  (the spelling tested)


def _a_dict():
    return {"a": jnp.zeros(()), "b": jnp.ones(())}


def _a_list():
    return [jnp.zeros(()), jnp.ones(())]


def _totals():
    return Totals(jnp.zeros(()), jnp.zeros((), jnp.int32))


# (step, a new argument, whether the step keeps the argument's structure: then it also runs
# at num_steps=3; a step that adds entries runs one step per call, as each step changes it)
SPELLINGS = {
    'd["a"] = ...': (set_item, _a_dict, True),
    "d.update(...)": (dict_update, _a_dict, True),
    "d |= {...}": (dict_or_assign, _a_dict, True),
    "d.setdefault(...)": (dict_setdefault, _a_dict, False),
    "d.pop(k) beside d.update(...)": (pop_beside, _a_dict, True),
    'del d["b"] beside d |= {...}': (del_beside, _a_dict, True),
    "xs[0] = ...": (list_set_item, _a_list, True),
    "xs.append(x)": (list_append, _a_list, False),
    "xs += [...]": (list_add_assign, _a_list, False),
    "xs.extend(...)": (list_extend, _a_list, False),
    "t.total = ...": (attribute, _totals, True),
    'setattr(t, "total", ...)': (with_setattr, _totals, True),
}


@pytest.mark.parametrize(
    ("spelling", "k"),
    [(s, k) for s, (_, _, keeps) in SPELLINGS.items() for k in ((1, 3) if keeps else (1,))],
)
def test_every_documented_change_in_place_is_written_back(spelling, k):
    """Each spelling that the Roles page and the FAQ list as written back, alone in a step:
    after the calls, the caller's object equals what `jax.jit` of the same mutation-style
    step gives when the step hands its object back. `d |= {...}` and `xs += [...]` alone were
    dropped (the analysis missed an augmented assignment to a parameter's own name): the
    caller's dict and list were left as they were."""
    update, make, _ = SPELLINGS[spelling]
    mutated = jax.jit(lambda obj, x: (update(obj, x), obj)[1])
    xs = jnp.arange(2 * k * 2, dtype=jnp.float32).reshape(2 * k, 2)
    ref = make()
    for x in xs:
        ref = mutated(ref, x)

    step = autoflat.step(update, num_steps=k)
    obj = make()
    for chunk in (xs[:k], xs[k:]):
        assert step(obj, chunk if k > 1 else chunk[0]) is None
    tree_allclose(obj, ref)
    assert "changed in place" in autoflat.show(step) or "assigned into" in autoflat.show(step)


# --- writes through another name: written back, or refused; never a tracer left behind -----


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Counter:
    n: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Model:
    inner: Counter
    layers: list


def through_alias(m, x):
    q = m.inner
    q.n = q.n + jnp.sum(x)


def through_loop(m, x):
    for layer in m.layers:
        layer.n = layer.n * 2.0 + jnp.sum(x)


def through_enumerate(m, x):
    for i, layer in enumerate(m.layers):
        layer.n = layer.n + i * jnp.sum(x)


def through_getattr(m, x):
    getattr(m, "inner").n = m.inner.n + jnp.sum(x)  # noqa: B009  (the spelling tested)


def through_dict_alias(d, x):
    d2 = d["inner"]
    d2["k"] = d2["k"] + jnp.sum(x)


def _model():
    return Model(Counter(jnp.zeros(())), [Counter(jnp.ones(())), Counter(jnp.full((), 2.0))])


ALIASES = {
    "q = m.inner; q.n = ...": (through_alias, _model),
    "for layer in m.layers: layer.n = ...": (through_loop, _model),
    "for i, layer in enumerate(m.layers): ...": (through_enumerate, _model),
    'getattr(m, "inner").n = ...': (through_getattr, _model),
    'd2 = d["inner"]; d2["k"] = ...': (
        through_dict_alias,
        lambda: {"inner": {"k": jnp.zeros(())}, "w": jnp.ones(())},
    ),
}


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("spelling", list(ALIASES))
def test_a_write_through_another_name_is_written_back(spelling, k):
    """A write into a part of an argument through another name is a write into the
    argument: state, written back, as `m.inner.n = ...` is. The caller's object equals what
    `jax.jit` of the same mutation-style step gives when the step hands it back (it kept its
    old value, and with a plain object a tracer)."""
    update, make = ALIASES[spelling]
    mutated = jax.jit(lambda obj, x: (update(obj, x), obj)[1])
    xs = jnp.arange(2 * k * 2, dtype=jnp.float32).reshape(2 * k, 2)
    ref = make()
    for x in xs:
        ref = mutated(ref, x)

    step = autoflat.step(update, num_steps=k)
    obj = make()
    for chunk in (xs[:k], xs[k:]):
        step(obj, chunk if k > 1 else chunk[0])
    tree_allclose(obj, ref)
    assert "[rule: assigned-into]" in autoflat.show(step)


class Plain:
    """Not a pytree: JAX takes it as one leaf (autoflat: broadcast, as it is)."""

    def __init__(self, **fields):
        self.__dict__.update(fields)


def _plain():
    return Plain(
        inner=Plain(n=jnp.zeros(())), layers=[Plain(n=jnp.ones(())), Plain(n=jnp.ones(()))]
    )


def bump(counter, x):
    counter.n = counter.n + jnp.sum(x)


def through_helper(w, m, x):
    bump(m.inner, x)
    return w + jnp.sum(x)


def through_method_of_a_part(w, m, x):
    m.layers.append(jnp.sum(x))
    return w + jnp.sum(x)


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize(
    "update",
    [through_alias, through_loop, through_getattr, through_helper, through_method_of_a_part],
)
def test_a_write_into_a_plain_object_never_leaves_a_tracer(update, k):
    """A plain object (not a pytree) reaches the step as it is. A write into it through
    another name (`q = m.inner; q.n = ...`) left a `DynamicJaxprTracer` in the caller's
    `m.inner.n`. Now the aliases the source shows are refused before the call, as `m.inner.n
    = ...` is, and a write it does not show (in a function the step calls, or a method of a
    part) is found after the trace: the previous value put back, and a `StateError` naming
    where."""
    m = _plain()
    layers, values = list(m.layers), [layer.n for layer in m.layers]
    inner = m.inner.n
    step = autoflat.step(update, num_steps=k)
    x = jnp.ones((k, 2)) if k > 1 else jnp.ones(2)
    args = (m, x) if update.__code__.co_argcount == 2 else (jnp.zeros(()), m, x)
    for _ in range(2):  # and again: the same error, nothing left behind
        with pytest.raises(autoflat.StateError) as info:
            step(*args)
        assert m.inner.n is inner
        assert m.layers == layers and [layer.n for layer in m.layers] == values
    message = str(info.value)
    assert f"`{update.__name__}` ({__file__}:" in message
    if update in (through_helper, through_method_of_a_part):
        path = "m.inner.n" if update is through_helper else "m.layers"
        assert f"left a traced value in `{path}`" in message
        assert "autoflat put the previous value back" in message
    else:
        assert "changes its argument `m` in place" in message
    assert "Make Plain a pytree" in message


class Trainer:
    """A method step on a plain object, whose helper writes into `self`."""

    def __init__(self):
        self.n = jnp.zeros(())
        self.scale = jnp.float32(2.0)

    @autoflat.step
    def update(self, w, x):
        bump(self, x)
        return w * self.scale


def test_a_helper_writing_into_a_method_steps_plain_self_leaves_no_tracer():
    t = Trainer()
    n = t.n
    with pytest.raises(autoflat.StateError, match=r"left a traced value in `self\.n`"):
        t.update(jnp.ones(()), jnp.ones(2))
    assert t.n is n


def test_the_tracer_check_runs_only_while_the_step_is_traced(monkeypatch):
    """The check for traced values left in the caller's objects runs around each trace of the
    body (the abstract evaluation at the first call, each compile), never on a call that runs
    a compiled program: it costs the fast path nothing."""
    from autoflat._handles import writeback

    checks = []

    class Counted(writeback._Noted):
        def __init__(self, roots):
            super().__init__(roots)
            checks.append(len(self.held))

    monkeypatch.setattr(writeback, "_Noted", Counted)

    def update(w, m, x):
        return w + m.scale * jnp.sum(x)

    step = autoflat.step(update)
    m, w = Plain(scale=jnp.float32(2.0)), jnp.zeros(())
    w = step(w, m, jnp.ones(2))
    first = len(checks)
    assert first >= 1 and all(n == 1 for n in checks)  # the plain object, noted
    for _ in range(20):
        w = step(w, m, jnp.ones(2))
    assert len(checks) == first
    assert autoflat.stats(step).traces == 1
    assert float(w) == 2.0 * 2.0 * 21


def test_untouched_puts_back_traced_values_and_keeps_the_rest():
    """`untouched` on its own: around a trace, the caller's objects among the static leaves
    that now hold a traced value get their previous values back (and a new entry holding one
    goes), and a `StateError` names the first place; Python values written at trace time stay,
    as under `jax.jit`; when the trace raises, its exception is the one that propagates."""
    from autoflat._errors import Location
    from autoflat._handles import writeback

    fn = Location("update", "train.py:3")
    m = Plain(inner=Plain(n=jnp.zeros(()), seen=0), log=[1], cfg={"lr": 0.1})
    n, log = m.inner.n, m.log

    def traced(x):
        m.inner.n = m.inner.n + x
        m.inner.seen += 1  # a Python side effect at trace time
        m.log.append(x)
        m.cfg["new"] = {"x": x}
        return x

    with pytest.raises(autoflat.StateError) as info:
        with writeback.untouched(("m", "x"), (m, jnp.ones(2)), fn):
            jax.make_jaxpr(traced)(jnp.ones(2))
    assert m.inner.n is n and m.log is log and m.log == [1] and m.cfg == {"lr": 0.1}
    assert m.inner.seen == 1
    assert str(info.value).startswith(
        "`update` (train.py:3) left a traced value in `m.cfg['new']`, in your object: JAX takes "
        "a Plain as one static leaf"
    )

    def fails(x):
        m.inner.n = x
        raise ValueError("in the body")

    with pytest.raises(ValueError, match="in the body"):
        with writeback.untouched(("m",), (m,), fn):
            jax.make_jaxpr(fails)(jnp.ones(2))
    assert m.inner.n is n
