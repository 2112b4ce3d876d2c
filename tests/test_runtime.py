"""The runtime: fast path counters, compile counts, recompile warnings, structure changes,
mutation-style write-back, chunk lengths, donation corner cases."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autoflat


def _ones(n):
    return jnp.ones((n, 3), jnp.float32)


def accumulate(state, x):
    state = {"sum": state["sum"] + x, "n": state["n"] + 1}
    return state, jnp.sum(x)


def test_fast_path_does_no_host_flatten():
    acc = autoflat.step(accumulate, num_steps=4)
    s = {"sum": jnp.zeros(3), "n": jnp.zeros((), jnp.int32)}
    for _ in range(5):
        s, out = acc(s, _ones(4))
    stats = autoflat.stats(acc)
    assert (stats.calls, stats.flattens, stats.fast_path, stats.copies) == (5, 1, 4, 1)
    assert int(s["n"]) == 20 and out.shape == (4,)


def test_remainder_chunk_and_length_errors():
    acc = autoflat.step(accumulate, num_steps=4)
    s = {"sum": jnp.zeros(3), "n": jnp.zeros((), jnp.int32)}
    s, out = acc(s, _ones(4))
    s, out = acc(s, _ones(2))
    assert out.shape == (2,)
    s, out = acc(s, _ones(2))  # the 2-step version is compiled once
    assert acc.stats.traces == 2
    assert int(s["n"]) == 8
    with pytest.raises(
        autoflat.AutoflatError, match="leading axis of 5, more than num_steps"
    ) as info:
        acc(s, _ones(5))
    assert "accumulate" in str(info.value) and "test_runtime.py" in str(info.value)
    # still usable after the error
    s, _ = acc(s, _ones(4))
    assert int(s["n"]) == 12


def test_inconsistent_leading_axes():
    @autoflat.step(num_steps=3)
    def two(state, x, y):
        state = state + jnp.sum(x) + jnp.sum(y)
        return state

    with pytest.raises(autoflat.AutoflatError, match=r"disagree on their leading axis: \[2, 3\]"):
        two(jnp.float32(0), jnp.ones((3, 2)), jnp.ones((2, 2)))


def test_structure_change_in_scan_is_a_clear_error_but_fine_with_one_step():
    def grow(state, x):
        state = {"w": state["w"] + x, "count": 1}  # `count` becomes a Python int
        return state

    scanned = autoflat.step(grow, num_steps=2)
    s = {"w": jnp.zeros(()), "count": jnp.zeros((), jnp.int32)}
    with pytest.raises(
        autoflat.AutoflatError, match=r"state\['count'\]: an array became non-array int 1"
    ):
        scanned(s, jnp.ones(2))
    single = autoflat.step(grow)
    out = single(s, jnp.float32(1.0))
    assert out["count"] == 1 and float(out["w"]) == 1.0
    out2 = single(out, jnp.float32(1.0))  # the new structure is fine from call to call
    assert float(out2["w"]) == 2.0


def test_shape_change_in_scan():
    def widen(state, x):
        state = jnp.concatenate([state, x[None]])
        return state

    with pytest.raises(
        autoflat.AutoflatError, match=r"array float32\[1\] became array float32\[2\]"
    ):
        autoflat.step(widen, num_steps=2)(jnp.zeros(1), jnp.ones(2))


def test_recompile_warning_names_the_cause():
    def f(state, x, scale):
        state = state + x * scale
        return state

    step = autoflat.step(f, static_argnames="scale", donate=False)
    s = jnp.float32(0.0)
    with pytest.warns(autoflat.AutoflatRecompileWarning, match=r"static argument `scale`"):
        for i in range(autoflat._runtime.RECOMPILE_WARN_AFTER):
            step(s, jnp.float32(1.0), float(i))
    # warned once only
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(s, jnp.float32(1.0), 100.0)


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
    assert "# stats: state (assigned into at line" in autoflat.show(step, print_=False)


def test_mutation_into_immutable_parts_is_a_clear_error():
    def update(state, x):
        state[0]["w"] = state[0]["w"] + x

    step = autoflat.step(update)
    state = ({"w": jnp.zeros(())}, jnp.zeros(()))
    with pytest.raises(autoflat.AutoflatError, match=r"`state\[1\]` is immutable \(tuple\)"):
        step(state, jnp.float32(1.0))
    assert float(state[0]["w"]) == 0.0  # checked before running: nothing half-written


def test_same_handle_twice_and_handles_across_steps():
    @autoflat.step
    def add(a, b):
        a = a + b
        b = b * 1
        return a, b

    @autoflat.step(num_steps=2)
    def other(a, x):
        a = a + jnp.sum(x)
        return a

    a, b = add(jnp.float32(1.0), jnp.float32(2.0))
    a2, b2 = add(a, a)  # the same handle as two donated state arguments
    assert float(a2) == 6.0 and float(b2) == 3.0
    c = other(a2, jnp.ones((2, 2)))  # a handle from one step into another: fast path
    assert other.stats.fast_path == 1 and float(c) == 10.0


def test_numpy_state_and_zero_array_state():
    @autoflat.step(num_steps=2)
    def step(params, config, x):
        params = {"w": params["w"] + x * config["scale"]}
        config = {"scale": config["scale"], "name": config["name"]}
        return params, config

    p, c = step({"w": np.zeros(2, np.float32)}, {"scale": 2.0, "name": "run"}, jnp.ones((2, 2)))
    np.testing.assert_allclose(p["w"], [4.0, 4.0])
    assert c == {"scale": 2.0, "name": "run"}  # non-array leaves are static, as in filter_jit


def test_clear_caches_keeps_steps_usable():
    acc = autoflat.step(accumulate, num_steps=4)
    s = {"sum": jnp.zeros(3), "n": jnp.zeros((), jnp.int32)}
    s, _ = acc(s, _ones(4))
    autoflat.clear_caches()
    s, _ = acc(s, _ones(4))
    assert acc.stats.traces == 2 and int(s["n"]) == 8


def test_unroll_is_passed_to_scan():
    def f(state, x):
        state = state * 0.5 + x
        return state, state * 2

    a = autoflat.step(f, num_steps=4, unroll=2)
    b = autoflat.step(f, num_steps=4)
    xs = jnp.arange(4.0, dtype=jnp.float32)
    (sa, oa), (sb, ob) = a(jnp.float32(1.0), xs), b(jnp.float32(1.0), xs)
    assert float(sa) == float(sb) and oa.tolist() == ob.tolist()
    text = str(jax.make_jaxpr(a._entry, static_argnums=0)(*_spec_args(a, xs)))
    assert "unroll=2" in text


def _spec_args(step, xs):
    """The arguments of a step's traced entry point for a (scalar state, xs) call."""
    structure, arrays = autoflat._structure.flatten(jnp.float32(1.0))
    program = step._base
    spec = step._new_spec(("test",), program, [structure], [None], [], ())
    return spec, ([arrays[0]],), (xs,), ()


@pytest.mark.parametrize("donate", [True, False])
def test_weakly_typed_start_compiles_once(donate):
    import optax

    tx = optax.adam(1e-2)

    def update(params, opt_state, x):
        grads = jax.grad(lambda p: jnp.sum((p["w"] * x) ** 2))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state

    params = {"w": jnp.full((3,), 1.0)}  # weakly typed
    step = autoflat.step(update, num_steps=2, donate=donate)
    p, o = step(params, tx.init(params), jnp.ones((2, 3)))
    for _ in range(2):
        p, o = step(p, o, jnp.ones((2, 3)))
    assert step.stats.traces == 1
    assert params["w"].weak_type  # the caller's own array is left as it was


def test_graph_snapshot_sees_every_kind_of_change():
    from autoflat._nnx import GraphSnapshot

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


# --- replays: the last call's handles passed straight back -----------------------------------


def test_replay_for_handles_and_the_general_path_for_keywords_and_rebuilt_dicts():
    acc = autoflat.step(accumulate, num_steps=4)
    s = {"sum": jnp.zeros(3), "n": jnp.zeros((), jnp.int32)}
    s, _ = acc(s, _ones(4))  # a real dict: the general path
    s, _ = acc(s, _ones(4))  # the handle it returned: a replay
    s, _ = acc(s, x=_ones(4))  # by keyword: the general path
    s, _ = acc(s, _ones(4))  # a replay again
    assert (acc.stats.calls, acc.stats.replays, acc.stats.flattens) == (4, 2, 1)
    # A rebuilt dict may have been changed through the handle: flattened again, not replayed.
    s["sum"] = s["sum"] + 100.0
    s, _ = acc(s, _ones(4))
    assert (acc.stats.replays, acc.stats.flattens) == (2, 2)
    np.testing.assert_allclose(s["sum"], np.full(3, 120.0))
    assert int(s["n"]) == 20


def test_replay_needs_the_same_static_objects():
    def scaled(state, x, scale):
        state = state + x * scale
        return state

    step = autoflat.step(scaled, static_argnames="scale")
    two, three = 2.0, 3.0
    s = step(jnp.zeros(3), jnp.ones(3), two)
    s = step(s, jnp.ones(3), two)
    s = step(s, jnp.ones(3), float("2.0"))  # equal, another object: the general path
    assert (step.stats.replays, step.stats.traces) == (1, 1)  # the same compiled entry
    s = step(s, jnp.ones(3), three)
    s = step(s, jnp.ones(3), three)
    np.testing.assert_allclose(s, np.full(3, 12.0))
    assert (step.stats.replays, step.stats.traces) == (2, 2)


def test_no_replay_for_a_static_object_whose_hash_can_change():
    class Config:  # hashed by value, and mutable
        def __init__(self, k):
            self.k = k

        def __hash__(self):
            return hash(self.k)

        def __eq__(self, other):
            return isinstance(other, Config) and other.k == self.k

    def scaled(state, x, cfg):
        state = state + x * cfg.k
        return state

    step = autoflat.step(scaled, static_argnames="cfg")
    cfg = Config(2.0)
    s = step(jnp.zeros(3), jnp.ones(3), cfg)
    s = step(s, jnp.ones(3), cfg)
    cfg.k = 3.0
    s = step(s, jnp.ones(3), cfg)  # compiled again for the new value
    np.testing.assert_allclose(s, np.full(3, 7.0))
    assert (step.stats.replays, step.stats.traces) == (0, 2)


def test_replay_never_reuses_a_mutable_broadcast_argument():
    def shift(state, consts):
        state = state + consts["by"]
        return state

    step = autoflat.step(shift, broadcast="consts")
    consts = {"by": jnp.float32(2.0)}
    s = step(jnp.float32(0.0), consts)
    s = step(s, consts)
    consts["by"] = jnp.float32(5.0)  # changed in place between calls
    s = step(s, consts)
    assert float(s) == 9.0 and step.stats.replays == 0

    frozen = (jnp.float32(2.0),)

    def shift_by(state, consts):
        state = state + consts[0]
        return state

    step = autoflat.step(shift_by, broadcast="consts")
    s = step(jnp.float32(0.0), frozen)
    s = step(s, frozen)
    s = step(s, frozen)
    assert float(s) == 6.0 and step.stats.replays == 2


def test_a_failed_replay_leaves_the_handles_usable():
    acc = autoflat.step(accumulate, num_steps=4)
    s = {"sum": jnp.zeros(3), "n": jnp.zeros((), jnp.int32)}
    s, _ = acc(s, _ones(4))
    with pytest.raises(autoflat.AutoflatError, match="leading axis of 5, more than num_steps"):
        acc(s, _ones(5))
    s, _ = acc(s, _ones(4))
    assert int(s["n"]) == 8 and acc.stats.replays == 2


def test_recompile_warning_from_a_replay_points_at_the_caller():
    def total(state, x):
        state = state + jnp.sum(x)
        return state

    step = autoflat.step(total)
    s = step(jnp.float32(0.0), jnp.ones(1))
    with pytest.warns(autoflat.AutoflatRecompileWarning, match="shape") as record:
        for n in range(2, autoflat._runtime.RECOMPILE_WARN_AFTER + 2):
            s = step(s, jnp.ones(n))
    assert step.stats.replays == autoflat._runtime.RECOMPILE_WARN_AFTER
    assert record[0].filename == __file__


def test_no_replay_when_the_same_handle_is_passed_twice_or_lazy_is_off():
    @autoflat.step
    def add(a, b):
        a = a + b
        b = b * 1
        return a, b

    a, b = add(jnp.float32(1.0), jnp.float32(2.0))
    a, b = add(a, a)  # the same handle twice: the general path copies the repeat
    assert float(a) == 6.0 and float(b) == 3.0 and add.stats.replays == 0

    eager = autoflat.step(accumulate, lazy=False)
    s = {"sum": jnp.zeros(3), "n": jnp.zeros((), jnp.int32)}
    for _ in range(3):
        s, _ = eager(s, jnp.ones(3))
    assert type(s) is dict and eager.stats.replays == 0 and int(s["n"]) == 3


def test_replay_with_older_handles_and_after_clearing_or_switching_off():
    step = autoflat.step(accumulate, num_steps=2, donate=False)
    s0 = {"sum": jnp.zeros(3), "n": jnp.zeros((), jnp.int32)}
    s1, _ = step(s0, _ones(2))
    s2, _ = step(s1, _ones(2))
    s3, _ = step(s1, _ones(2))  # an older handle, not donated: same values as s2
    assert step.stats.replays == 2
    # (jax.tree.leaves reads a handle without rebuilding it: a rebuilt dict is never replayed)
    for a, b in zip(jax.tree.leaves(s2), jax.tree.leaves(s3), strict=True):
        np.testing.assert_array_equal(a, b)
    step.clear_cache()
    s4, _ = step(s3, _ones(2))
    assert step.stats.replays == 2
    s5, _ = step(s4, _ones(2))
    assert step.stats.replays == 3
    step._use_replay = False  # what benchmarks/bench_replay.py compares against
    s6, _ = step(s5, _ones(2))
    assert step.stats.replays == 3 and int(s6["n"]) == 10


@pytest.mark.parametrize("replay", [True, False])
def test_a_recompile_warning_raised_as_an_error_loses_no_caller_state(replay):
    def add_x(state, x):
        state["total"] = state["total"] + jnp.sum(x)  # mutation style: written back

    def total(state, x):
        state = state + jnp.sum(x)
        return state

    step = autoflat.step(total)
    step._use_replay = replay
    s = step(jnp.float32(0.0), jnp.ones(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error", autoflat.AutoflatRecompileWarning)
        with pytest.raises(autoflat.AutoflatRecompileWarning):
            for n in range(2, autoflat._runtime.RECOMPILE_WARN_AFTER + 2):
                old = s
                s = step(s, jnp.ones(n))
    # The call that warned donated `old`: it says so, rather than failing inside JAX.
    with pytest.raises(autoflat.AutoflatError, match="consumed"):
        float(old)

    writer = autoflat.step(add_x)
    state = {"total": jnp.zeros(())}
    writer(state, jnp.ones(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error", autoflat.AutoflatRecompileWarning)
        with pytest.raises(autoflat.AutoflatRecompileWarning):
            for n in range(2, autoflat._runtime.RECOMPILE_WARN_AFTER + 2):
                writer(state, jnp.ones(n))
    # Written back before the warning: every call, the failing one too, is in the total.
    assert float(state["total"]) == sum(range(1, autoflat._runtime.RECOMPILE_WARN_AFTER + 1))
