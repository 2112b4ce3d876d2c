"""Doc-claims for README.md: every behavioural sentence of the README, backed by a test.

Each test names the sentence it backs with `@claim("README.md", ...)` (tests/claims/claim.py):
it fails if the page no longer says that text, or if autoflat no longer does what it says.
Results are compared with a plain `jax.jit` loop of the same function (for `num_steps=k`, k
calls on the per-step slices); fast-path, copy and compile claims are read from
`autoflat.stats`, roles and generated code from `autoflat.show`. Installation commands,
supported versions, nox sessions and timing figures are not behaviour of the library and
have no test here.
"""

from __future__ import annotations

import copy
import pickle
import re
import threading
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import tree_allclose

import autoflat
from claims.claim import claim

README = "README.md"

tx = optax.adam(1e-3)


def loss_fn(params, x, y):
    return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


def update(params, opt_state, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, opt_state, loss


def _init():
    params = {"w": jnp.zeros((3, 1)), "b": jnp.zeros(1)}
    return params, tx.init(params)


def _data(n, seed=0):
    kx, ky = jax.random.split(jax.random.key(seed))
    return jax.random.normal(kx, (n, 8, 3)), jax.random.normal(ky, (n, 8, 1))


def _reference(params, opt_state, xs, ys):
    """The plain `jax.jit` loop: one call per step on the per-step slices."""
    jitted = jax.jit(update)
    losses = []
    for i in range(xs.shape[0]):
        params, opt_state, loss = jitted(params, opt_state, xs[i], ys[i])
        losses.append(loss)
    return params, opt_state, jnp.stack(losses)


@pytest.fixture(autouse=True)
def _default_transport(monkeypatch):
    # The sentences describe autoflat's defaults; `nox -s tests_pack` sets AUTOFLAT_PACK.
    monkeypatch.delenv("AUTOFLAT_PACK", raising=False)


# ------------------------------------------------------------------------------------------
# The opening example and the quickstart
# ------------------------------------------------------------------------------------------


@claim(
    README,
    "model, opt_state, losses = update(model, opt_state, batches)   # batches: leading axis 10",
)
@claim(README, "print(autoflat.show(update))   # the generated Python that actually runs")
def test_opening_example_runs_ten_steps_a_call_as_a_jit_loop():
    step = autoflat.step(update, num_steps=10)
    params, opt_state = _init()
    xs, ys = _data(10)
    got = step(params, opt_state, xs, ys)
    ref = _reference(params, opt_state, xs, ys)
    tree_allclose(got, ref)
    source = autoflat.show(step)
    assert isinstance(source, str) and "def update(" in source


@claim(
    README, "params, opt_state, losses = update(params, opt_state, xs, ys)   # losses: shape (10,)"
)
@claim(README, "for _ in range(100):")
def test_quickstart_loop_equals_a_jit_loop():
    step = autoflat.step(update, num_steps=10)
    params, opt_state = _init()
    ref_p, ref_o = params, opt_state
    all_losses, ref_losses = [], []
    for call in range(4):
        xs, ys = _data(10, seed=call)
        params, opt_state, losses = step(params, opt_state, xs, ys)
        assert losses.shape == (10,)
        all_losses.append(losses)
        ref_p, ref_o, ref_l = _reference(ref_p, ref_o, xs, ys)
        ref_losses.append(ref_l)
    tree_allclose((params, opt_state), (ref_p, ref_o))
    tree_allclose(all_losses, ref_losses)


# ------------------------------------------------------------------------------------------
# What happens
# ------------------------------------------------------------------------------------------


@claim(
    README,
    "`params` and `opt_state` are returned by name, so they are *state*, carried from step to step.",
)
def test_parameters_returned_by_name_are_state():
    step = autoflat.step(update, num_steps=10)
    params, opt_state = _init()
    xs, ys = _data(20)
    p, o, _ = step(params, opt_state, xs[:10], ys[:10])
    p, o, _ = step(p, o, xs[10:], ys[10:])  # carried across calls too
    header = autoflat.show(step)
    assert "# params: state (returned) [rule: returned-by-name]" in header
    assert "# opt_state: state (returned) [rule: returned-by-name]" in header
    ref = _reference(params, opt_state, xs, ys)
    tree_allclose((p, o), ref[:2])


@claim(README, "`x` and `y` are *per-step inputs* with a leading axis of `num_steps`.")
@claim(README, "Everything else returned (`loss`) is a per-step output, stacked.")
def test_inputs_with_a_leading_axis_are_per_step_and_the_loss_is_stacked():
    step = autoflat.step(update, num_steps=10)
    params, opt_state = _init()
    xs, ys = _data(10)
    _, _, losses = step(params, opt_state, xs, ys)
    header = autoflat.show(step)
    assert "# x: scanned (per-step: leading axis 10 = num_steps" in header
    assert "# y: scanned (per-step: leading axis 10 = num_steps" in header
    assert "output (stacked)" in header
    _, _, ref_losses = _reference(params, opt_state, xs, ys)
    assert losses.shape == (10,)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)


def _scaled(w, prev, x, scale, n):
    loss = jnp.sum(w * x) * n
    w = w - 0.1 * scale * x
    return w, loss


@claim(
    README, "Override with `state=`, `broadcast=` (same value every step) and `static_argnames=`."
)
def test_roles_can_be_overridden():
    # `scale` has a leading axis of num_steps (per-step by default); `n` is an int (static
    # anyway at num_steps > 1, so named here to show the evidence); `prev` is a bare array
    # at the place of `loss`: autoflat would ask, `state={"prev": 1}` answers.
    step = autoflat.step(
        _scaled, num_steps=2, state={"prev": 1}, broadcast="scale", static_argnames="n"
    )
    w, scale, xs = jnp.ones(2), jnp.array([1.0, 3.0]), jnp.ones((2, 2))
    new_w, prev = step(w, jnp.zeros(()), xs, scale, 2)
    header = autoflat.show(step)
    assert "# scale: broadcast (broadcast=)" in header
    assert "# n: static (static_argnames=)" in header
    assert "# prev: state (state= at return position 1)" in header
    # broadcast: the whole `scale` every step, as a jax.jit loop that passes it whole
    ref_w = w
    for i in range(2):
        ref_w, ref_loss = jax.jit(_scaled, static_argnames="n")(ref_w, None, xs[i], scale, 2)
    tree_allclose(new_w, ref_w)
    np.testing.assert_allclose(prev, ref_loss, rtol=1e-6)  # state: the last step's value
    assert np.shape(prev) == ()
    with pytest.raises(autoflat.OptionError):
        autoflat.step(_scaled, num_steps=2, broadcast="scale", static_argnames="n")(
            w, jnp.zeros(()), xs, scale, 2
        )


def _two_returns(params, x, flip):
    if flip:
        params = {"w": params["w"] - x}
        return params, jnp.sum(x)
    params = {"w": params["w"] + x}
    return params, -jnp.sum(x)


@claim(
    README,
    "`autoflat.show(update)` returns the exact function that runs: your body, unchanged, inside a `lax.scan` step, with state unflattened from leaf lists and flattened back at each `return`.",
)
def test_show_is_the_body_inside_a_scan_step():
    import inspect

    step = autoflat.step(_two_returns, num_steps=2, static_argnames="flip")
    p, _ = step({"w": jnp.zeros(2)}, jnp.ones((2, 2)), True)
    source = autoflat.show(step)
    body = inspect.getsource(_two_returns).splitlines()[1:]
    for line in body:  # every line of the body, unchanged apart from the returns
        if not line.strip().startswith("return"):
            assert line.strip() in source, line
    assert "_af_scan(" in source and "_af_unflatten(_af_carry[0])" in source
    assert source.count("_af_flatten(_af_spec, 0, params)") == 2  # at each `return`
    np.testing.assert_allclose(p["w"], [-2.0, -2.0])
    # the compiled program is a scan: one loop over the steps
    assert "scan" in str(step.trace({"w": jnp.zeros(2)}, jnp.ones((2, 2)), True).jaxpr)


@claim(README, "State comes back as lazy handles.")
@claim(
    README,
    "Passing them back in costs O(1) Python work: no `tree_flatten`, no rebuild. `autoflat.stats(update)` shows it (`flattens` stays at the first call's count).",
)
def test_state_comes_back_as_handles_and_passing_them_back_is_the_fast_path():
    step = autoflat.step(update, num_steps=10)
    params, opt_state = _init()
    xs, ys = _data(10)
    params, opt_state, _ = step(params, opt_state, xs, ys)
    assert autoflat.is_handle(params) and autoflat.is_handle(opt_state)
    assert type(params) is autoflat.LazyHandle
    first = autoflat.stats(step)
    assert first.flattens > 0
    for _ in range(4):
        params, opt_state, _ = step(params, opt_state, xs, ys)
    after = autoflat.stats(step)
    assert after.flattens == first.flattens
    assert after.rebuilds == 0
    assert after.fast_path == first.fast_path + 4 * 2  # both state arguments, every call


# ------------------------------------------------------------------------------------------
# Lazy handles
# ------------------------------------------------------------------------------------------


def _linear():
    return eqx.nn.Linear(3, 2, key=jax.random.key(0))


def _eqx_update(model, x):
    model = jax.tree.map(lambda a: a * 0.5 if eqx.is_array(a) else a, model)
    return model, jnp.sum(model(x))


def _model_handle():
    step = autoflat.step(_eqx_update)
    model, _ = step(_linear(), jnp.ones(3))
    return step, model


@claim(
    README,
    "behave as the objects they stand for (`isinstance`, attributes, calling, `repr`, `pickle`, `copy`, `jax.tree.map`, `jax.jit`, `eqx.filter_jit`)",
)
def test_handles_behave_as_the_objects_they_stand_for():
    _, model = _model_handle()
    real = jax.tree.map(lambda a: a * 0.5 if eqx.is_array(a) else a, _linear())
    assert autoflat.is_handle(model)
    assert isinstance(model, eqx.nn.Linear)
    np.testing.assert_array_equal(model.weight, real.weight)
    assert model.in_features == 3
    np.testing.assert_array_equal(model(jnp.ones(3)), real(jnp.ones(3)))
    assert repr(model) == repr(real)
    for other in (pickle.loads(pickle.dumps(model)), copy.copy(model), copy.deepcopy(model)):
        assert type(other) is eqx.nn.Linear
        tree_allclose(other, real, exact=True)
    mapped = jax.tree.map(lambda a: a + 1, model)
    assert type(mapped) is eqx.nn.Linear
    tree_allclose(mapped, jax.tree.map(lambda a: a + 1, real), exact=True)
    np.testing.assert_allclose(
        jax.jit(lambda m, x: m(x))(model, jnp.ones(3)), real(jnp.ones(3)), rtol=1e-6
    )
    np.testing.assert_allclose(
        eqx.filter_jit(lambda m, x: m(x))(model, jnp.ones(3)), real(jnp.ones(3)), rtol=1e-6
    )


@claim(
    README,
    "`autoflat.unwrap(x)` returns the real object; `lazy=False` returns real objects after every call.",
)
def test_unwrap_and_lazy_false_give_real_objects():
    _, model = _model_handle()
    real = autoflat.unwrap(model)
    assert type(real) is eqx.nn.Linear and not autoflat.is_handle(real)
    eager = autoflat.step(_eqx_update, lazy=False)
    m = _linear()
    for _ in range(3):
        m, _ = eager(m, jnp.ones(3))
        assert type(m) is eqx.nn.Linear and not autoflat.is_handle(m)
    tree_allclose(m, jax.tree.map(lambda a: a * 0.125 if eqx.is_array(a) else a, _linear()))


@claim(
    README,
    "A multi-tree pytree operation that pairs a handle with a real tree (`eqx.partition(handle, ...)`, `optax.apply_updates(handle, updates)`) needs `unwrap` first, since a handle is its own pytree node type.",
)
def test_multi_tree_operations_need_unwrap():
    _, model = _model_handle()
    real = autoflat.unwrap(model)
    updates = jax.tree.map(jnp.ones_like, real)
    assert jax.tree.structure(model) != jax.tree.structure(real)  # its own node type
    with pytest.raises(ValueError, match="autoflat.unwrap"):
        eqx.partition(model, eqx.is_array)
    with pytest.raises(ValueError, match="autoflat.unwrap"):
        optax.apply_updates(model, updates)
    params, static = eqx.partition(autoflat.unwrap(model), eqx.is_array)
    assert type(params) is eqx.nn.Linear
    new = optax.apply_updates(autoflat.unwrap(model), updates)
    tree_allclose(new, jax.tree.map(lambda a: a + 1, real))


# ------------------------------------------------------------------------------------------
# Donation
# ------------------------------------------------------------------------------------------


@claim(
    README,
    "Donation of state buffers is on by default and only ever touches buffers autoflat produced: your own arrays are copied once on the way in.",
)
def test_donation_never_touches_the_callers_arrays():
    step = autoflat.step(update, num_steps=10)
    params, opt_state = _init()
    mine = jax.tree.leaves((params, opt_state))
    xs, ys = _data(10)
    p, o, _ = step(params, opt_state, xs, ys)
    assert autoflat.stats(step).copies == 2  # the two state arguments, copied on the way in
    first = p
    p, o, _ = step(p, o, xs, ys)
    with pytest.raises(autoflat.ConsumedError):  # donation is on by default
        first["w"]
    p, o, _ = step(p, o, xs, ys)
    assert autoflat.stats(step).copies == 2  # once: later calls donate autoflat's own buffers
    assert not any(a.is_deleted() for a in mine)
    assert not xs.is_deleted() and not ys.is_deleted()
    # the caller's arrays still hold their values and can start another run
    tree_allclose(step(params, opt_state, xs, ys)[:2], _reference(params, opt_state, xs, ys)[:2])


@claim(
    README,
    "A handle passed to a later call is consumed; using it raises an `AutoflatError` that says which call consumed it and how to keep a copy (`copy.deepcopy`, or `donate=False`).",
)
def test_a_consumed_handle_says_which_call_and_how_to_keep_a_copy():
    step = autoflat.step(update, num_steps=10)
    params, opt_state = _init()
    xs, ys = _data(10)
    p1, o1, _ = step(params, opt_state, xs, ys)
    step(p1, o1, xs, ys)
    with pytest.raises(autoflat.AutoflatError) as info:
        p1["w"]
    message = str(info.value)
    assert "consumed by call 2 of `update`" in message
    assert "copy.deepcopy(params)" in message and "donate=False" in message
    # both ways of keeping a copy work
    one_call = _reference(params, opt_state, xs, ys)[0]
    p1, o1, _ = step(params, opt_state, xs, ys)
    kept = copy.deepcopy(p1)
    step(p1, o1, xs, ys)
    tree_allclose(kept, one_call)
    keep = autoflat.step(update, num_steps=10, donate=False)
    q1, r1, _ = keep(params, opt_state, xs, ys)
    keep(q1, r1, xs, ys)
    tree_allclose(q1, one_call)


@claim(
    README, "Nothing is lost on errors. After any exception, the state you passed in still works."
)
def test_after_any_exception_the_state_passed_in_still_works():
    step = autoflat.step(update, num_steps=10)
    params, opt_state = _init()
    xs, ys = _data(10)
    p, o, _ = step(params, opt_state, xs, ys)  # handles, donated by the next calls
    ref = _reference(*_reference(params, opt_state, xs, ys)[:2], xs, ys)
    bad_calls = [
        lambda: step(p, o, xs),  # a missing argument: CallError
        lambda: step(p, o, jnp.ones((10, 8, 4)), ys),  # a shape error inside the body
        lambda: step(p, o, jnp.ones((12, 8, 3)), jnp.ones((12, 8, 1))),  # too many steps
        lambda: step(p, o, xs, ys, extra=1),  # an unknown keyword
    ]
    for bad in bad_calls:
        with pytest.raises(Exception):  # noqa: B017  (any exception)
            bad()
    got = step(p, o, xs, ys)
    tree_allclose(got, ref)


# ------------------------------------------------------------------------------------------
# num_steps=1 and write-back
# ------------------------------------------------------------------------------------------


@claim(README, "`num_steps=1` (the default) is a drop-in replacement for `jax.jit(update)`")
def test_num_steps_1_is_a_drop_in_for_jax_jit():
    step = autoflat.step(update)
    jitted = jax.jit(update)
    params, opt_state = _init()
    xs, ys = _data(4)
    p, o = params, opt_state
    rp, ro = params, opt_state
    for i in range(4):
        p, o, loss = step(p, o, xs[i], ys[i])
        rp, ro, ref_loss = jitted(rp, ro, xs[i], ys[i])
        assert np.shape(loss) == ()
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    tree_allclose((p, o), (rp, ro))


def _count(params, totals, x):
    totals["n"] = totals["n"] + 1
    params = params + x
    return params


@claim(
    README,
    "state the step changes in place (a Flax NNX object, a dict it assigns into) is written back into your objects, as `nnx.jit` does, where `jax.jit` drops such changes.",
)
def test_in_place_changes_are_written_back_where_jax_jit_drops_them():
    from flax import nnx

    totals = {"n": jnp.zeros(())}
    jax.jit(_count)(jnp.zeros(2), totals, jnp.ones(2))
    assert float(totals["n"]) == 0.0  # jax.jit drops the change
    step = autoflat.step(_count)
    p = jnp.zeros(2)
    for _ in range(3):
        p = step(p, totals, jnp.ones(2))
    assert float(totals["n"]) == 3.0  # autoflat writes it back
    np.testing.assert_allclose(p, [3.0, 3.0])

    class Counter(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.zeros(2))

    def bump(model, x):
        model.w[...] = model.w[...] * 2 + x
        return jnp.sum(model.w[...])

    ours, theirs = Counter(), Counter()
    step, ref = autoflat.step(bump), nnx.jit(bump)
    for _ in range(3):
        a, b = step(ours, jnp.ones(2)), ref(theirs, jnp.ones(2))
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(ours.w[...], theirs.w[...])
    np.testing.assert_array_equal(ours.w[...], [7.0, 7.0])


# ------------------------------------------------------------------------------------------
# Feeding k steps from a data loader
# ------------------------------------------------------------------------------------------


def _loader(n, threads=None):
    rng = np.random.default_rng(0)
    for _ in range(n):
        if threads is not None:
            threads.append(threading.current_thread())
        x = rng.normal(size=(8, 3)).astype(np.float32)  # NumPy
        yield x, jnp.asarray(rng.normal(size=(8, 1)), jnp.float32)  # and JAX


@claim(
    README,
    "`autoflat.chunks` stacks per-step batches (any pytree of NumPy or JAX arrays, from any iterable) into chunks of `num_steps`, with a shorter final chunk",
)
@claim(
    README, "bar.update(chunks.last_steps)      # a tqdm bar of steps: 10, ..., 10, then the rest"
)
def test_chunks_stack_batches_with_a_shorter_final_chunk():
    batches = list(_loader(25))
    chunks = autoflat.chunks(iter(batches), 10)  # any iterable: here an iterator
    got, steps = [], []
    for xs, ys in chunks:
        assert isinstance(xs, jax.Array) and isinstance(ys, jax.Array)
        got.append((xs, ys))
        steps.append(chunks.last_steps)
    assert steps == [10, 10, 5]
    assert [xs.shape for xs, _ in got] == [(10, 8, 3), (10, 8, 3), (5, 8, 3)]
    np.testing.assert_array_equal(
        np.concatenate([np.asarray(xs) for xs, _ in got]), np.stack([b[0] for b in batches])
    )
    np.testing.assert_array_equal(
        np.concatenate([np.asarray(ys) for _, ys in got]), np.stack([b[1] for b in batches])
    )
    # dict batches too (any pytree)
    dicts = autoflat.chunks([{"a": np.ones(2) * i} for i in range(3)], 2)
    assert [c["a"].shape for c in dicts] == [(2, 2), (1, 2)]


@claim(README, "and copies them to the device on a background thread ahead of use")
def test_chunks_are_made_on_a_background_thread_ahead_of_use():
    threads, produced = [], []

    def loader():
        for b in _loader(40, threads):
            produced.append(1)
            yield b

    chunks = autoflat.chunks(loader(), 10)
    first = next(chunks)
    assert all(t is not threading.main_thread() for t in threads)
    deadline = time.monotonic() + 10
    while len(produced) <= 10 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(produced) > 10  # the next chunk is read before it is asked for
    assert isinstance(first[0], jax.Array)
    assert all(d.platform == jax.devices()[0].platform for d in first[0].devices())
    chunks.close()


@claim(README, "`sharding=` places them on a mesh")
def test_chunks_sharding_places_them_on_a_mesh():
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((8,), ("data",))
    sharding = NamedSharding(mesh, P("data"))
    chunks = autoflat.chunks(_loader(4), 2, sharding=sharding)
    for xs, _ys in chunks:
        assert xs.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "data")), xs.ndim)
        assert len(xs.devices()) == 8


@claim(README, "for xs, ys in chunks:                  # xs: (10, 32, 3), on device")
def test_a_step_fed_from_chunks_equals_a_jit_loop_over_the_batches():
    batches = list(_loader(25))
    step = autoflat.step(update, num_steps=10)
    params, opt_state = _init()
    chunks = autoflat.chunks(batches, 10)
    p, o = params, opt_state
    seen = []
    for xs, ys in chunks:
        p, o, losses = step(p, o, xs, ys)
        seen.append(losses.shape[0])
    assert seen == [10, 10, 5]  # the final chunk runs its 5 steps
    xs = jnp.stack([b[0] for b in batches])
    ys = jnp.stack([b[1] for b in batches])
    tree_allclose((p, o), _reference(params, opt_state, xs, ys)[:2])


# ------------------------------------------------------------------------------------------
# Packing
# ------------------------------------------------------------------------------------------


def _many_leaves():
    """A model with one weight over the packing limit and 40 small leaves per dtype."""
    return {
        "w": jnp.ones((40, 40)),
        "biases": [jnp.full((4,), 0.1 * i) for i in range(40)],
        "scales": [jnp.full((3,), 1.0 + i, jnp.bfloat16) for i in range(40)],
    }


def _sgd(params, x):
    params = jax.tree.map(lambda a: a - (0.01 * x).astype(a.dtype) * a, params)
    return params


def _main_args(lowered_text):
    m = re.search(r"func\.func public @main\((.*?)\) ->", lowered_text, re.S)
    assert m is not None
    return m.group(1).count("%arg")


@claim(
    README,
    "by default the small state leaves (biases, norm scales and their optimizer moments) travel packed into one buffer per dtype",
)
def test_small_leaves_travel_packed_by_default():
    params = _many_leaves()
    default = autoflat.step(_sgd)
    flat = autoflat.step(_sgd, pack=False)
    x = jnp.ones(())
    # the weight, one float32 buffer, one bfloat16 buffer, and x
    assert _main_args(default.lower(params, x).as_text()) == 4
    assert _main_args(flat.lower(params, x).as_text()) == 81 + 1
    p = default(params, x)
    tree_allclose(p, jax.jit(_sgd)(params, x))


@claim(README, "the elementwise updates they all go through alike run once on the whole buffer")
def test_elementwise_updates_run_on_the_whole_buffer():
    def sgd(params, x):
        lr = 0.01 * x
        params = jax.tree.map(lambda a: a - lr * a, params)
        return params

    params = {"w": jnp.ones((40, 40)), "biases": [jnp.full((4,), 0.1 * i) for i in range(40)]}
    step = autoflat.step(sgd)
    jaxpr = str(step.trace(params, jnp.ones(())).jaxpr)
    # the 40 biases of 4 elements, updated as one buffer
    assert re.search(r"f32\[160\] = (add|mul|sub) ", jaxpr), jaxpr
    tree_allclose(step(params, jnp.ones(())), jax.jit(sgd)(params, jnp.ones(())))
    assert autoflat.stats(step).leaf_by_leaf == 0


@claim(
    README,
    "Turn it off with `pack=False` or `AUTOFLAT_PACK=off` to compare results bit for bit with a hand-written loop",
)
def test_pack_off_is_bit_for_bit_a_jit_loop(monkeypatch):
    tx_many = optax.adam(1e-2)

    def fit(params, opt_state, x):
        grads = jax.grad(lambda p: sum(jnp.sum(jnp.sin(b * x)) for b in p))(params)
        updates, opt_state = tx_many.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state

    params = [jnp.full((3,), 0.1 * i) for i in range(32)]
    xs = jax.random.normal(jax.random.key(0), (3, 3))
    jitted = jax.jit(fit)
    ref = (params, tx_many.init(params))
    for i in range(3):
        ref = jitted(*ref, xs[i])
    packed = autoflat.step(fit)  # the default packs these 97 small leaves
    assert _main_args(packed.lower(params, tx_many.init(params), xs[0]).as_text()) < 10
    monkeypatch.setenv("AUTOFLAT_PACK", "off")
    by_env = autoflat.step(fit)
    by_option = autoflat.step(fit, pack=False)
    for step in (by_env, by_option):
        # one buffer per leaf: 32 parameters, Adam's count, 32 + 32 moments, and x
        assert _main_args(step.lower(params, tx_many.init(params), xs[0]).as_text()) == 98
        got = (params, tx_many.init(params))
        for i in range(3):
            got = step(*got, xs[i])
        tree_allclose(got, ref, exact=True)
