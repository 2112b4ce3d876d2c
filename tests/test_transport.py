"""Packed transport (`pack=True` / `"auto"`): layouts, bitwise equality with `pack=False`,
handles over packed state, sharded leaves never packed.

The whole suite also runs with each packing mode as the default (`nox -s tests_pack`); this
module checks packing in the default run too.
"""

from __future__ import annotations

import functools
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import tree_allclose
from jax.sharding import NamedSharding, PartitionSpec

import autoflat
from autoflat._runtime import entry as _entry
from autoflat._transport import host as _host
from autoflat._transport import layout as _transport

tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))


def init_params():
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    return {
        "big": jax.random.normal(k1, (160, 128)),  # 20,480 elements: over the auto limit
        # 40 small float32 leaves: enough for pack="auto" (AUTO_MIN_LEAVES)
        "layers": [
            {"w": jax.random.normal(k, (4, 4)), "b": jnp.zeros(4)} for k in jax.random.split(k2, 20)
        ],
        "scale": jnp.ones((), jnp.bfloat16),
        "steps": jnp.zeros((), jnp.int32),
        "key": jax.random.key(1),
        "proj": jax.random.normal(k3, (128, 4)),
    }


def loss_fn(params, x):
    h = jnp.tanh(x @ params["big"]) @ params["proj"]
    for layer in params["layers"]:
        h = jnp.tanh(h @ layer["w"] + layer["b"])
    return jnp.mean(h**2) * params["scale"].astype(jnp.float32)


def update(params, opt_state, x):
    floats = {k: v for k, v in params.items() if k not in ("steps", "key")}
    loss, grads = jax.value_and_grad(loss_fn)(floats, x)
    updates, opt_state = tx.update(grads, opt_state, floats)
    floats = optax.apply_updates(floats, updates)
    key, _ = jax.random.split(params["key"])
    params = {**floats, "steps": params["steps"] + 1, "key": key}
    return params, opt_state, loss


def _opt_init(params):
    return tx.init({k: v for k, v in params.items() if k not in ("steps", "key")})


def _run(pack, k, n_calls):
    step = autoflat.step(update, num_steps=k, pack=pack)
    params = init_params()
    opt_state = _opt_init(params)
    xs = jax.random.normal(jax.random.key(2), (n_calls, k, 8, 160))
    losses = []
    for i in range(n_calls):
        x = xs[i] if k > 1 else xs[i, 0]
        params, opt_state, loss = step(params, opt_state, x)
        losses.append(loss)
    return step, params, opt_state, losses


def _bits(tree):
    leaves = jax.tree.leaves(autoflat.unwrap(tree))
    return [
        np.asarray(
            jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x
        )
        for x in leaves
    ]


@functools.cache
def _flat(k):
    """The run with one buffer per leaf, which every packed run is compared with (the views
    play no part in it: nothing is packed): (params, opt_state, losses)."""
    return _run(False, k, 3)[1:]


SLOW = pytest.mark.slow
_BITWISE_TRANSPORT = jax.__version_info__ < (0, 12)


# Half of the eight combinations, in which every two values of any two parameters meet; the
# other half in the slow suite (each is a compile of a 20-layer step with Adam).
@pytest.mark.parametrize(
    ("pack", "k", "segments"),
    [
        (True, 1, True),
        pytest.param(True, 1, False, marks=SLOW),
        pytest.param(True, 3, True, marks=SLOW),
        (True, 3, False),
        pytest.param("auto", 1, True, marks=SLOW),
        ("auto", 1, False),
        ("auto", 3, True),
        pytest.param("auto", 3, False, marks=SLOW),
    ],
)
def test_packed_results_are_those_of_flat(pack, k, segments, monkeypatch):
    # The transport alone changes no bit (JAX 0.10). With the views on (`_segments`), the
    # elementwise operations on packed leaves run on whole buffers, which XLA simplifies
    # otherwise (`a / b / c` into `a / (b * c)` in one program and not the other): the last
    # bits. JAX 0.12's XLA:CPU compiles the per-leaf update arithmetic of the k=1 packed program
    # otherwise even with every leaf cut out (parameters up to 6 ulps apart after two calls, in
    # 7 of 20,000 elements; the losses equal): bitwise only on the JAX before it.
    monkeypatch.setattr(_entry, "SEGMENTS", segments)
    ref_params, ref_opt, ref_losses = _flat(k)
    step, params, opt_state, losses = _run(pack, k, 3)
    bitwise = not segments and _BITWISE_TRANSPORT
    if not bitwise:
        np.testing.assert_allclose(np.ravel(losses), np.ravel(ref_losses), rtol=1e-4)
        # The gradient of `big` through 20 tanh layers is partly float noise, which Adam moves
        # by up to its learning rate whatever its size: a program with other last bits moves
        # some of those elements otherwise (up to 3e-4 after 9 steps; 2e-8 with SGD). Bound:
        # each element within the steps taken times the learning rate, at most 5% of them
        # past the usual tolerance.
        a = np.concatenate([np.ravel(x) for x in _bits((params, opt_state))])
        b = np.concatenate([np.ravel(x) for x in _bits((ref_params, ref_opt))])
        diff = np.abs(a.astype(np.float64) - b.astype(np.float64))
        assert np.all(diff <= 3 * k * 1e-2)
        assert np.mean(diff > 1e-5 + 1e-5 * np.abs(b.astype(np.float64))) <= 0.05
    for a, b in zip(
        _bits((params, opt_state, losses)), _bits((ref_params, ref_opt, ref_losses)), strict=True
    ):
        assert a.dtype == b.dtype
        if bitwise:
            np.testing.assert_array_equal(a, b)
    # the state really travelled packed: a few buffers instead of one per leaf
    layout = params._af_layout
    n_leaves = len(jax.tree.leaves(autoflat.unwrap(params)))
    assert layout.n_leaves == n_leaves and layout.n_buffers < n_leaves
    big = 0  # leaf 0: params["big"], 20,480 elements, over the "auto" limit
    assert (big in layout.singles) == (pack == "auto")
    assert autoflat.stats(step).traces == 1


def test_layouts_group_by_dtype_and_keep_large_keys_and_sharded_leaves_apart():
    f32, i32, bf16 = jnp.dtype("float32"), jnp.dtype("int32"), jnp.dtype("bfloat16")
    key = jax.random.key(0).dtype
    enough = _transport.AUTO_MIN_LEAVES
    avals = [
        ((4, 4), f32),  # 0
        ((4,), f32),  # 1
        ((200, 100), f32),  # 2: 20,000 elements
        ((), i32),  # 3: the only int32 leaf: a group of one saves nothing
        ((3,), bf16),  # 4
        ((3,), bf16),  # 5: two bfloat16 leaves: too few for "auto"
        ((), key),  # 6: PRNG keys never packed
        ((8,), f32),  # 7: sharded over several devices
    ] + [((2,), f32)] * (enough - 2)  # 8...: small float32 leaves, "auto"'s fewest with 0, 1
    multi = [False] * 7 + [True] + [False] * (enough - 2)
    rest = tuple(range(8, len(avals)))
    assert _transport.layout_for(avals, multi, False) is None
    auto = _transport.layout_for(avals, multi, "auto")
    assert auto.singles == (2, 3, 4, 5, 6, 7)
    assert {(str(g.dtype), g.indices) for g in auto.groups} == {("float32", (0, 1, *rest))}
    full = _transport.layout_for(avals, multi, True)
    assert full.singles == (3, 6, 7)
    assert {(str(g.dtype), g.indices) for g in full.groups} == {
        ("float32", (0, 1, 2, *rest)),
        ("bfloat16", (4, 5)),
    }
    assert _transport.layout_for(avals, multi, "auto") is auto  # interned
    # one leaf fewer: nothing for "auto" to pack
    assert _transport.layout_for(avals[:-1], multi[:-1], "auto") is None
    # nothing to pack: no layout at all
    assert _transport.layout_for([((4,), f32), ((), i32)], [False, False], True) is None


@pytest.mark.parametrize("n", [1, 2, 8, 9, 17, 18, 19, 40, 64, 65, 301])
def test_unpack_and_repack_are_exact_for_any_number_of_leaves(n):
    rng = np.random.default_rng(n)
    shapes = [tuple(int(d) for d in rng.integers(0, 5, rng.integers(0, 3))) for _ in range(n)]
    leaves = [jnp.asarray(rng.normal(size=s), jnp.float32) for s in shapes]
    layout = _transport.layout_for([(s, jnp.float32) for s in shapes], [False] * n, True)
    if layout is None:  # one leaf: nothing to pack
        assert n == 1
        return
    (buf,) = _host.pack_on_device(layout, leaves)
    np.testing.assert_array_equal(buf, np.concatenate([np.ravel(x) for x in leaves]))
    assert [x.shape for x in _host.unpack_on_device(layout, [buf])] == shapes
    for x, y in zip(_host.unpack_on_device(layout, [buf]), leaves, strict=True):
        np.testing.assert_array_equal(x, y)
    # the compiled programs that take over from the host copies (`_HOST_CALLS`)
    (compiled,) = _host._pack_jit(layout, leaves)
    np.testing.assert_array_equal(compiled, buf)
    for x, y in zip(_host._unpack_jit(layout, [buf]), leaves, strict=True):
        assert x.shape == y.shape
        np.testing.assert_array_equal(x, y)
    # inside a program, where the repack runs in pieces
    twice = jax.jit(lambda b: _transport.pack(layout, _transport.unpack(layout, [b * 2]))[0])
    np.testing.assert_array_equal(twice(buf), buf * 2)


def test_packing_outside_a_step_copies_on_the_host_first_then_compiles(monkeypatch):
    # A step packs its state once, on its first call: on a CPU device, that copy is made on
    # the host rather than by a program compiled for it; the compiled one takes over when the
    # same layout keeps being packed.
    shapes = [(4, 4), (4,), (), (2, 3)] * 10
    leaves = [jnp.full(s, float(i)) for i, s in enumerate(shapes)]
    layout = _transport.layout_for([(s, jnp.float32) for s in shapes], [False] * 40, True)
    compiled = []
    real = _host._pack_jit
    monkeypatch.setattr(_host, "_pack_jit", lambda *a: compiled.append(1) or real(*a))
    expected = np.concatenate([np.ravel(x) for x in leaves])
    for i in range(_host._HOST_CALLS + 2):
        (buf,) = _host.pack_on_device(layout, leaves)
        np.testing.assert_array_equal(buf, expected)
        assert buf.dtype == jnp.float32 and not buf.committed and not buf.weak_type
        assert len(compiled) == max(0, i + 1 - _host._HOST_CALLS)
    # fresh buffers, placed as `jax.jit` places its outputs: committed if an input is
    device = jax.devices()[-1]
    committed = [jax.device_put(x, device) for x in leaves]
    big = jax.device_put(jnp.arange(1000.0), device)  # over the "auto" limit: travels alone
    avals = [((1000,), jnp.float32)] + [(s, jnp.float32) for s in shapes]
    layout = _transport.layout_for(avals, [False] * 41, "auto")
    assert layout.singles == (0,)
    # on the host, then by the compiled programs: never sharing memory either way
    for host_calls in (0, _host._HOST_CALLS):
        layout.host_calls[:] = [host_calls, host_calls]
        buffers = _host.pack_on_device(layout, [big, *committed])
        assert all(b.committed and b.devices() == {device} for b in buffers)
        pointers = {x.unsafe_buffer_pointer() for x in [big, *committed]}
        assert not pointers & {b.unsafe_buffer_pointer() for b in buffers}
        unpacked = _host.unpack_on_device(layout, buffers)
        assert all(x.committed and x.devices() == {device} for x in unpacked)
        assert not {b.unsafe_buffer_pointer() for b in buffers} & {
            x.unsafe_buffer_pointer() for x in unpacked
        }
        for b in buffers:
            b.delete()  # as donating them to a step would: the unpacked leaves are copies
        for x, y in zip(unpacked, [big, *leaves], strict=True):
            np.testing.assert_array_equal(x, y)


def test_weakly_typed_leaves_compile_the_step_once_whichever_copy_packs_them(monkeypatch):
    # The first packs of a layout are host copies, whose buffers are strongly typed; the
    # compiled pack that takes over must make them so too (of a `jnp.array(0)` single and of a
    # buffer packed from `jnp.full(..., 1.0)` leaves), or the step compiles again. The leaves'
    # weak types travel in the layout: the step and its results have them, as under jax.jit.
    autoflat.clear_caches()  # layouts are interned with their count of host copies
    compiled = []
    real = _host._pack_jit
    monkeypatch.setattr(_host, "_pack_jit", lambda *a: compiled.append(1) or real(*a))

    def update(state, g):
        count, xs = state
        state = (count + 1, [x * 0.99 + g for x in xs])
        return state

    step = autoflat.step(update, pack="auto")
    for _ in range(_host._HOST_CALLS + 2):
        # a fresh state every call: each call packs the caller's arrays
        state = (jnp.array(0), [jnp.full((8,), 1.0) for _ in range(40)])
        assert state[0].weak_type
        count, xs = step(state, 0.5)
        assert int(count) == 1 and count.weak_type and xs[3].weak_type  # as jax.jit's
        np.testing.assert_allclose(xs[3], np.full(8, 1.49), rtol=1e-6)
    ref_count, ref_xs = jax.jit(update)(state, 0.5)
    assert ref_count.weak_type and ref_xs[3].weak_type
    stats = autoflat.stats(step)
    assert stats.traces == 1 and stats.copies == _host._HOST_CALLS + 2, stats
    assert len(compiled) == 2


def test_packed_leaves_compile_to_the_kernels_of_flat_leaves():
    # A leaf read at a static offset of the packed buffer made every kernel reading it
    # distinct: XLA:CPU compiled one kernel per packed leaf instead of one per distinct
    # computation (17 s against 0.9 s at 1,000 leaves). Its dumps list one LLVM module per
    # compiled kernel: packed leaves must compile to as few as flat ones.
    import re
    import tempfile
    from pathlib import Path

    n = 64

    def step(state, g):
        state = [x * 0.99 + g for x in state]
        return state

    def kernels(pack):
        with tempfile.TemporaryDirectory() as d:
            f = autoflat.step(step, pack=pack)
            state = [jnp.arange(8.0) + i for i in range(n)]
            lowered = f.lower(state, jnp.float32(0.5))
            lowered.jax.compile({"xla_dump_to": d})
            names = [p.name for p in Path(d).glob("*entry*.ir-no-opt.ll")]
        return {re.sub(r"\.\d+_", "_", x) for x in names}, len(names)

    flat_names, flat_count = kernels(False)
    packed_names, packed_count = kernels(True)
    assert flat_count < 10
    assert packed_count <= flat_count + 10  # the repack's concatenates: a handful


def test_a_repack_of_few_leaves_is_one_concatenate_of_many_in_runs():
    # XLA:CPU compiles every concatenate of the repack as a kernel of its own: a group of a
    # few dozen leaves is repacked in one (one kernel), a larger one in runs (each a kernel
    # LLVM schedules in linear time), then the runs.
    def concatenates(n):
        shapes = [(32,)] * n  # 128 bytes each: 64 of them, `_ONE_BLOCK_BYTES`
        layout = _transport.layout_for([(s, jnp.float32) for s in shapes], [False] * n, True)
        repack = lambda b: _transport.pack(layout, _transport.unpack(layout, [b * 2]))  # noqa: E731
        jaxpr = jax.make_jaxpr(repack)(jnp.zeros(32 * n)).jaxpr
        return sum(e.primitive.name == "concatenate" for e in jaxpr.eqns)

    assert concatenates(_transport._ONE_BLOCK_PARTS) == 1
    assert concatenates(_transport._ONE_BLOCK_PARTS + 1) > 2


def test_handles_over_packed_state_behave_as_before(monkeypatch):
    step = autoflat.step(update, pack=True)
    params, opt_state, _ = step(init_params(), _opt_init(init_params()), jnp.ones((8, 160)))
    ref = autoflat.step(update, pack=False)
    ref_params, _, _ = ref(init_params(), _opt_init(init_params()), jnp.ones((8, 160)))

    calls = []
    real = _host.unpack_on_device
    monkeypatch.setattr(_host, "unpack_on_device", lambda *a: calls.append(1) or real(*a))
    # attribute access rebuilds once, with one device call
    assert params["layers"][0]["w"].shape == (4, 4)
    assert params["steps"].dtype == jnp.int32
    assert len(calls) == 1
    # (to the last bits: see test_packed_results_are_those_of_flat)
    tree_allclose(autoflat.unwrap(params), ref_params, atol=1e-5)
    assert len(calls) == 1
    # pickling, jax.tree.map, another jitted function
    tree_allclose(pickle.loads(pickle.dumps(opt_state)), autoflat.unwrap(opt_state), exact=True)
    doubled = jax.tree.map(lambda x: x * 2, opt_state)
    tree_allclose(doubled, jax.tree.map(lambda x: x * 2, autoflat.unwrap(opt_state)), exact=True)

    def norm(p):
        return jnp.sqrt(jnp.sum(p["big"] ** 2) + jnp.sum(p["proj"] ** 2))

    np.testing.assert_allclose(jax.jit(norm)(params), jax.jit(norm)(ref_params), rtol=1e-6)


def test_state_spanning_several_devices_is_never_packed():
    # (a mix of single- and multi-device leaves is packed apart: see the layout test above)
    devices = np.array(jax.devices()[:8])
    if devices.size < 8:
        pytest.skip("needs 8 devices")
    mesh = jax.sharding.Mesh(devices, ("d",))
    sharded = NamedSharding(mesh, PartitionSpec("d"))
    replicated = NamedSharding(mesh, PartitionSpec())

    @autoflat.step(num_steps=2, pack=True)
    def decay(state, g):
        state = {k: v * 0.5 + g for k, v in state.items()}
        return state

    state = {
        "a": jax.device_put(jnp.arange(16.0), sharded),
        "b": jax.device_put(jnp.arange(16.0) + 1, sharded),
        "c": jax.device_put(jnp.ones(4), replicated),
        "d": jax.device_put(jnp.ones(4) * 2, replicated),
    }
    out = decay(state, jnp.ones(2))
    # every leaf spans the 8 devices (sharded or replicated): none is packed
    assert out._af_layout is None
    real = autoflat.unwrap(out)
    assert real["a"].sharding.is_equivalent_to(sharded, 1)
    assert real["c"].sharding.is_equivalent_to(replicated, 1)
    np.testing.assert_allclose(real["a"], jnp.arange(16.0) * 0.25 + 1.5)
    np.testing.assert_allclose(real["d"], 2 * 0.25 + 1.5)
