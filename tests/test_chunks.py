"""`autoflat.chunks`: stacking, the final chunk, errors, the producer thread, sharding, and a
training loop fed by it equal to a `jax.jit` loop."""

from __future__ import annotations

import functools
import gc
import io
import threading
import time
import traceback
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import tree_allclose
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import autoflat
from autoflat import _jax
from autoflat._feeding import chunks as _chunks
from autoflat._feeding import stacking as _stacking

PRODUCER = "autoflat.chunks producer"


def producers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == PRODUCER]


def wait_no_producer(timeout: float = 5.0) -> None:
    """Assert every producer thread ends within `timeout` seconds (collecting garbage)."""
    deadline = time.monotonic() + timeout
    while producers() and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    assert not producers(), f"producer threads still alive: {producers()}"


@pytest.fixture(autouse=True)
def no_leftover_threads():
    yield
    wait_no_producer()


class Batch(NamedTuple):
    x: np.ndarray
    y: np.ndarray


def numpy_batches(n: int, structure: str = "dict") -> list:
    """`n` per-step batches of distinct values, in one of several pytree structures."""
    out = []
    for i in range(n):
        x = np.arange(6, dtype=np.float32).reshape(2, 3) + 10 * i
        y = np.array([i, -i], np.int32)
        out.append(
            {
                "dict": {"x": x, "y": y},
                "tuple": (x, y),
                "namedtuple": Batch(x, y),
                "nested": {"inputs": (x, {"mask": x > 3}), "y": y},
            }[structure]
        )
    return out


def stack(batches: list) -> object:
    return jax.tree.map(lambda *xs: np.stack(xs), *batches)


def assert_chunks_equal(got: list, batches: list, k: int) -> None:
    """`got` are the chunks of `batches` in runs of `k`: structure, shapes, dtypes, values."""
    assert len(got) == -(-len(batches) // k)
    for c, start in zip(got, range(0, len(batches), k), strict=True):
        want = stack(batches[start : start + k])
        assert jax.tree.structure(c) == jax.tree.structure(want)
        for a, b in zip(jax.tree.leaves(c), jax.tree.leaves(want), strict=True):
            assert isinstance(a, jax.Array)
            assert a.shape == b.shape and a.dtype == b.dtype
            np.testing.assert_array_equal(np.asarray(a), b)


# ------------------------------------------------------------------------------------------
# Stacking
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("prefetch", [0, 2])
def test_final_chunk_is_shorter(prefetch):
    batches = numpy_batches(10)
    it = autoflat.chunks(batches, 4, prefetch=prefetch)
    assert len(it) == 3
    got, steps = [], []
    for c in it:
        got.append(c)
        steps.append((it.last_steps, it.steps_yielded))
    assert [c["x"].shape for c in got] == [(4, 2, 3), (4, 2, 3), (2, 2, 3)]
    assert steps == [(4, 4), (4, 8), (2, 10)]
    assert_chunks_equal(got, batches, 4)
    np.testing.assert_array_equal(got[-1]["y"], [[8, -8], [9, -9]])
    with pytest.raises(StopIteration):
        next(it)


@pytest.mark.parametrize("structure", ["dict", "tuple", "namedtuple", "nested"])
def test_pytrees_of_numpy_arrays(structure):
    batches = numpy_batches(7, structure)
    got = list(autoflat.chunks(iter(batches), 3))
    assert_chunks_equal(got, batches, 3)
    if structure == "namedtuple":
        assert type(got[0]) is Batch


@pytest.mark.parametrize("structure", ["dict", "tuple", "namedtuple", "nested"])
def test_pytrees_of_jax_arrays(structure):
    batches = jax.tree.map(jnp.asarray, numpy_batches(7, structure))
    got = list(autoflat.chunks(batches, 3))
    assert_chunks_equal(got, jax.tree.map(np.asarray, batches), 3)


def test_prng_keys_and_python_numbers():
    keys = jax.random.split(jax.random.key(0), 5)
    batches = [{"key": keys[i], "lr": 0.5 * i, "n": i} for i in range(5)]
    got = list(autoflat.chunks(batches, 2))
    assert [c["key"].shape for c in got] == [(2,), (2,), (1,)]
    np.testing.assert_array_equal(
        jax.random.key_data(jnp.concatenate([c["key"] for c in got])), jax.random.key_data(keys)
    )
    assert got[0]["lr"].dtype == jax.dtypes.canonicalize_dtype(np.float64)
    np.testing.assert_array_equal(np.concatenate([c["n"] for c in got]), np.arange(5))


@pytest.mark.parametrize("structure", ["dict", "nested"])
def test_prefetch_does_not_change_the_chunks(structure):
    batches = numpy_batches(11, structure)
    runs = {p: list(autoflat.chunks((b for b in batches), 4, prefetch=p)) for p in (0, 1, 3)}
    for p in (1, 3):
        tree_allclose(runs[p], runs[0], exact=True)
        assert [a.dtype for a in jax.tree.leaves(runs[p])] == [
            a.dtype for a in jax.tree.leaves(runs[0])
        ]


def test_an_input_that_reuses_its_buffer():
    """Each batch is copied as it arrives, so a loader that refills one buffer is safe."""

    def refilled():
        buf = np.zeros(3, np.float32)
        for i in range(5):
            buf[:] = i
            yield {"x": buf}

    got = list(autoflat.chunks(refilled(), 2))
    np.testing.assert_array_equal(
        np.concatenate([c["x"] for c in got]), np.repeat(np.arange(5.0), 3).reshape(5, 3)
    )


def test_empty_input_has_no_chunks():
    it = autoflat.chunks([], 4)
    assert len(it) == 0
    assert list(it) == []


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_steps must be an int >= 1"):
        autoflat.chunks([], 0)
    with pytest.raises(ValueError, match="prefetch must be an int >= 0"):
        autoflat.chunks([], 2, prefetch=-1)
    with pytest.raises(TypeError):
        autoflat.chunks(3, 2)  # not iterable


# ------------------------------------------------------------------------------------------
# Batches that change, and errors of the input
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("prefetch", [0, 2])
def test_changed_shape_names_the_batch_and_leaf(prefetch):
    batches = numpy_batches(8)
    batches[6] = {"x": np.zeros((1, 3), np.float32), "y": batches[6]["y"]}
    it = autoflat.chunks(batches, 4, prefetch=prefetch)
    first = next(it)
    assert first["x"].shape == (4, 2, 3)
    with pytest.raises(autoflat.ShapeError) as info:
        next(it)
    msg = str(info.value)
    assert "batch 6, leaf ['x']: shape (1, 3) dtype float32" in msg
    assert "batch 0 had shape (2, 3) dtype float32" in msg
    assert isinstance(info.value, ValueError)
    with pytest.raises(StopIteration):
        next(it)


def test_changed_dtype_names_the_batch_and_leaf():
    batches = numpy_batches(5)
    batches[3] = {"x": batches[3]["x"], "y": batches[3]["y"].astype(np.int64)}
    with pytest.raises(autoflat.ShapeError, match=r"batch 3, leaf \['y'\]: .* dtype int64"):
        list(autoflat.chunks(batches, 2))


def test_changed_structure_names_the_batch_and_leaf():
    batches = numpy_batches(5)
    batches[2] = {"x": batches[2]["x"]}
    with pytest.raises(autoflat.ShapeError, match=r"batch 2 has a different .*lacks leaf \['y'\]"):
        list(autoflat.chunks(batches, 4))
    batches = numpy_batches(5, "tuple")
    batches[4] = list(batches[4])
    with pytest.raises(autoflat.ShapeError, match="batch 4 has a different tree structure"):
        list(autoflat.chunks(batches, 4))


def test_a_leaf_that_is_not_an_array():
    with pytest.raises(autoflat.ShapeError, match=r"batch 0, leaf \['name'\] is a str \('a'\)"):
        list(autoflat.chunks([{"x": np.zeros(2), "name": "a"}] * 2, 2))


@pytest.mark.parametrize("prefetch", [0, 2])
def test_producer_exception_is_raised_in_the_consumer(prefetch):
    def batches_then_fail():
        for i in range(5):
            yield {"x": np.full(2, i, np.float32)}
        raise KeyError("the loader broke")

    it = autoflat.chunks(batches_then_fail(), 2, prefetch=prefetch)
    got = [next(it), next(it)]  # batches 0-3: every chunk before the failure arrives
    assert [c["x"][0, 0].item() for c in got] == [0.0, 2.0]
    with pytest.raises(KeyError, match="the loader broke") as info:
        next(it)
    frames = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert "batches_then_fail" in frames  # the producer's traceback comes with it
    assert any("reading batch 5" in note for note in info.value.__notes__)
    with pytest.raises(StopIteration):
        next(it)
    assert not producers()  # ended and joined before the error reached the consumer


def test_bad_sharding_tree_is_raised_in_the_consumer():
    devices = jax.devices()[:1]
    s = NamedSharding(jax.sharding.Mesh(np.array(devices), ("data",)), P())
    it = autoflat.chunks(numpy_batches(2), 2, sharding={"x": s, "z": s})
    with pytest.raises(ValueError, match="a pytree of Shardings that\nis a prefix"):
        next(it)


# ------------------------------------------------------------------------------------------
# No thread left behind
# ------------------------------------------------------------------------------------------


def endless(closed: list[bool]):
    try:
        i = 0
        while True:
            yield {"x": np.full(4, i, np.float32)}
            i += 1
    finally:
        closed.append(True)


def test_break_leaves_no_live_thread():
    closed: list[bool] = []
    for i, _chunk in enumerate(autoflat.chunks(endless(closed), 3, prefetch=2)):
        assert len(producers()) == 1
        if i == 2:
            break
    wait_no_producer()
    assert closed == [True]  # the input generator was closed once the producer let it go


def test_exception_in_the_consumer_leaves_no_live_thread():
    closed: list[bool] = []

    def train():
        for _chunk in autoflat.chunks(endless(closed), 3):
            raise RuntimeError("a step failed")

    with pytest.raises(RuntimeError, match="a step failed"):
        train()
    wait_no_producer()
    assert closed == [True]


def test_close_joins_the_thread():
    it = autoflat.chunks(endless([]), 2)
    next(it)
    it.close()
    assert not producers()  # joined: no waiting needed
    with pytest.raises(StopIteration):
        next(it)
    it.close()  # again: nothing to do

    with autoflat.chunks(endless([]), 2) as it:
        next(it)
    assert not producers()


def test_garbage_collection_without_iterating_stops_the_thread():
    it = autoflat.chunks(endless([]), 2, prefetch=1)
    assert len(producers()) == 1
    del it
    wait_no_producer()


def test_prefetch_zero_has_no_thread():
    it = autoflat.chunks(endless([]), 2, prefetch=0)
    next(it)
    assert not producers()
    it.close()


# ------------------------------------------------------------------------------------------
# Counting steps: len() and progress bars
# ------------------------------------------------------------------------------------------


def test_len_needs_an_input_with_len():
    assert len(autoflat.chunks(numpy_batches(9), 4, prefetch=0)) == 3
    assert len(autoflat.chunks(numpy_batches(8), 4, prefetch=0)) == 2
    with pytest.raises(TypeError, match="needs an input with len"):
        len(autoflat.chunks(iter(numpy_batches(8)), 4, prefetch=0))


def test_tqdm_counts_chunks_or_steps():
    tqdm = pytest.importorskip("tqdm").tqdm
    batches = numpy_batches(10)
    out = io.StringIO()
    bar = tqdm(autoflat.chunks(batches, 4), file=out)
    assert bar.total == 3
    assert sum(1 for _ in bar) == 3
    with tqdm(total=len(batches), file=out) as bar:
        for _chunk in (it := autoflat.chunks(batches, 4)):
            bar.update(it.last_steps)
        assert bar.n == 10


# ------------------------------------------------------------------------------------------
# Sharding, and global arrays across processes
# ------------------------------------------------------------------------------------------

needs_8 = pytest.mark.skipif(
    jax.device_count() < 8,
    reason="needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)",
)


@needs_8
@pytest.mark.parametrize("inputs", ["numpy", "jax"])
def test_sharding_keeps_the_step_axis_unsharded(inputs):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("data",))
    batches = [
        {"x": np.full((16, 4), i, np.float32), "y": np.arange(16, dtype=np.int32) + i}
        for i in range(6)
    ]
    if inputs == "jax":
        batches = jax.tree.map(jnp.asarray, batches)
    got = list(autoflat.chunks(batches, 4, sharding=NamedSharding(mesh, P("data"))))
    want = NamedSharding(mesh, P(None, "data"))
    for c, steps in zip(got, (4, 2), strict=True):
        for leaf in jax.tree.leaves(c):
            assert leaf.sharding.is_equivalent_to(want, leaf.ndim), leaf.sharding
            assert leaf.addressable_shards[0].data.shape == (steps, 2, *leaf.shape[2:])
    assert_chunks_equal(got, jax.tree.map(np.asarray, batches), 4)


@needs_8
def test_a_pytree_of_shardings():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
    shardings = {"x": NamedSharding(mesh, P("data", "model")), "y": NamedSharding(mesh, P())}
    batches = numpy_batches(3)
    batches = [{"x": np.tile(b["x"], (4, 2)), "y": b["y"]} for b in batches]  # x: (8, 6)
    (c, short) = list(autoflat.chunks(batches, 2, sharding=shardings))
    assert c["x"].sharding.spec == P(None, "data", "model")
    assert c["x"].addressable_shards[0].data.shape == (2, 2, 3)
    assert c["y"].sharding.is_fully_replicated
    assert short["x"].shape == (1, 8, 6)


def test_chunk_sharding():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    s = NamedSharding(mesh, P("data"), memory_kind=None)
    assert _stacking.chunk_sharding(s).spec == P(None, "data")
    single = _jax.single_device_sharding(jax.devices()[0])
    assert _stacking.chunk_sharding(single) is single


@needs_8
def test_global_shape_from_process_local_data():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("data",))
    first_half = np.arange(8) < 4  # this "process" holds devices 0-3
    chunk = NamedSharding(mesh, P(None, "data"))
    assert _stacking.global_shape(chunk, (4, 16, 3), first_half) == (4, 32, 3)
    assert _stacking.global_shape(chunk, (4, 16, 3), np.ones(8, bool)) == (4, 16, 3)
    replicated = NamedSharding(mesh, P())
    assert _stacking.global_shape(replicated, (4, 16, 3), first_half) == (4, 16, 3)
    with pytest.raises(autoflat.ShapeError, match="make it a multiple of 4"):
        _stacking.global_shape(chunk, (4, 6, 3), first_half)

    grid = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    row_0 = np.array([[True] * 4, [False] * 4])  # a process holding every "model" position
    both = NamedSharding(grid, P(None, "data", "model"))
    assert _stacking.global_shape(both, (4, 8, 12), row_0) == (4, 16, 12)
    joint = NamedSharding(grid, P(None, ("data", "model")))
    assert _stacking.global_shape(joint, (4, 8), row_0) == (4, 16)


@needs_8
def test_multiprocess_chunks_are_global_arrays(monkeypatch):
    """Across processes each chunk is built by `make_array_from_process_local_data` from this
    process's stacked batches, with the chunk's sharding and global shape. (One process here:
    two processes holding devices 0-3 and 4-7 are simulated; tests/test_multihost.py runs
    real ones.)"""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("data",))
    first_half = np.arange(8) < 4
    calls = []

    def record(sharding, local_data, shape):
        calls.append((sharding, type(local_data), local_data.shape, shape))
        return np.zeros(shape, local_data.dtype)

    monkeypatch.setattr(_chunks, "_is_multiprocess", lambda: True)
    monkeypatch.setattr(
        _stacking,
        "global_shape",
        functools.partial(_stacking.global_shape, local_devices=first_half),
    )
    monkeypatch.setattr(jax, "make_array_from_process_local_data", record)
    batches = [{"x": jnp.full((8, 3), i, jnp.float32)} for i in range(6)]  # JAX, local
    got = list(autoflat.chunks(batches, 4, sharding=NamedSharding(mesh, P("data"))))
    assert [c["x"].shape for c in got] == [(4, 16, 3), (2, 16, 3)]
    (s1, t1, local1, global1), (_, _, local2, global2) = calls
    assert s1.spec == P(None, "data") and s1.mesh == mesh
    assert t1 is np.ndarray  # stacked on the host: JAX inputs are this process's data
    assert (local1, global1, local2, global2) == ((4, 8, 3), (4, 16, 3), (2, 8, 3), (2, 16, 3))


# ------------------------------------------------------------------------------------------
# A training loop fed by chunks
# ------------------------------------------------------------------------------------------

tx = optax.adam(1e-2)


def loss_fn(params, x, y):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] - y) ** 2)


def update(params, opt_state, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, opt_state, loss


def init():
    k1, k2 = jax.random.split(jax.random.key(0))
    params = {
        "w1": jax.random.normal(k1, (4, 16)) * 0.5,
        "b1": jnp.zeros(16),
        "w2": jax.random.normal(k2, (16, 2)) * 0.5,
    }
    return params, tx.init(params)


def data(n: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [
        (rng.normal(size=(16, 4)).astype(np.float32), rng.normal(size=(16, 2)).astype(np.float32))
        for _ in range(n)
    ]


def jit_loop(batches):
    params, opt_state = init()
    step, losses = jax.jit(update), []
    for x, y in batches:
        params, opt_state, loss = step(params, opt_state, x, y)
        losses.append(loss)
    return params, opt_state, jnp.stack(losses)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_training_loop_fed_by_chunks_equals_a_jit_loop(prefetch):
    batches = data(10)
    ref_params, ref_opt_state, ref_losses = jit_loop(batches)

    train = autoflat.step(update, num_steps=4)
    params, opt_state = init()
    losses = []
    for x, y in autoflat.chunks(batches, 4, prefetch=prefetch):
        params, opt_state, loss = train(params, opt_state, x, y)
        losses.append(loss)
    assert [loss.shape for loss in losses] == [(4,), (4,), (2,)]
    tree_allclose(params, ref_params, rtol=1e-5)
    tree_allclose(opt_state, ref_opt_state, rtol=1e-5)
    np.testing.assert_allclose(jnp.concatenate(losses), ref_losses, rtol=1e-5)
    stats = autoflat.stats(train)
    assert stats.traces == 2  # full chunks compile once, the final shorter one once more
    assert stats.flattens == 2  # every later call took the fast path


@needs_8
def test_data_parallel_loop_fed_by_sharded_chunks_equals_a_jit_loop():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("data",))
    batches = data(6)
    ref_params, _, ref_losses = jit_loop(batches)

    train = autoflat.step(update, num_steps=3)
    params, opt_state = jax.device_put(init(), NamedSharding(mesh, P()))
    losses = []
    for x, y in autoflat.chunks(batches, 3, sharding=NamedSharding(mesh, P("data"))):
        params, opt_state, loss = train(params, opt_state, x, y)
        losses.append(loss)
    tree_allclose(params, ref_params, rtol=1e-5)
    np.testing.assert_allclose(jnp.concatenate(losses), ref_losses, rtol=1e-5)
    assert autoflat.unwrap(params)["w1"].sharding.is_fully_replicated
    assert autoflat.stats(train).traces == 1
