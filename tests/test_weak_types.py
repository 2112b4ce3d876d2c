"""Weak types: the step sees the abstract values `jax.jit` gives it, weak types included.

A leaf made from a Python number is weakly typed: `jnp.asarray(0)`, a `jax.jit` output of `0`
(gymnax's and PureJaxRL's `LogWrapper.reset` starts its episode counters so), a Python number
in the state that autoflat makes an array. `jax.jit` traces it weakly typed, and a `lax.scan`
over it (the step's own scan over environment steps) promotes such a carry to the type the
body gives back. autoflat keeps weak types wherever the state travels (one buffer per leaf,
or packed: the layout says which leaves are weakly typed) and compiles as often as `jax.jit`.
"""

from __future__ import annotations

import functools
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import struct
from helpers import tree_allclose

import autoflat
from autoflat import _jax
from autoflat._transport import host as _host
from autoflat._transport import layout as _transport

# -- a gymnax-style environment and PureJaxRL's LogWrapper ------------------------------------


@struct.dataclass
class EnvState:
    pos: jax.Array
    time: jax.Array


class PointEnv:
    """A point on a line, pushed by the action; reward -|pos|; episodes of 5 steps, reset
    automatically (as gymnax's `Environment.step` does)."""

    def reset(self, key, params=None):
        pos = jax.random.uniform(key, (), minval=-1.0, maxval=1.0)
        state = EnvState(pos=pos, time=0)
        return jnp.stack([pos, 1.0]), state

    def step(self, key, state, action, params=None):
        pos = state.pos + 0.1 * action
        time = state.time + 1
        done = time >= 5
        reward = -jnp.abs(pos)
        obs_re, state_re = self.reset(key, params)
        stepped = EnvState(pos=pos, time=time)
        state = jax.tree.map(lambda x, y: jax.lax.select(done, x, y), state_re, stepped)
        obs = jax.lax.select(done, obs_re, jnp.stack([pos, 1.0]))
        return obs, state, reward, done, {}


# PureJaxRL's LogWrapper, as luchris429/purejaxrl writes it (purejaxrl/wrappers.py at commit
# 146b4856d593bcb4114b9c9fdb45798034696551, Apache-2.0); `reset` starts the counters as
# Python numbers, which its `jax.jit` returns weakly typed, and `step` makes some float32.
@struct.dataclass
class LogEnvState:
    env_state: Any
    episode_returns: float
    episode_lengths: int
    returned_episode_returns: float
    returned_episode_lengths: int
    timestep: int


class LogWrapper:
    """Log the episode returns and lengths."""

    def __init__(self, env):
        self._env = env

    @partial(jax.jit, static_argnums=(0,))
    def reset(self, key, params=None):
        obs, env_state = self._env.reset(key, params)
        state = LogEnvState(env_state, 0, 0, 0, 0, 0)
        return obs, state

    @partial(jax.jit, static_argnums=(0,))
    def step(self, key, state, action, params=None):
        obs, env_state, reward, done, info = self._env.step(key, state.env_state, action, params)
        new_episode_return = state.episode_returns + reward
        new_episode_length = state.episode_lengths + 1
        state = LogEnvState(
            env_state=env_state,
            episode_returns=new_episode_return * (1 - done),
            episode_lengths=new_episode_length * (1 - done),
            returned_episode_returns=state.returned_episode_returns * (1 - done)
            + new_episode_return * done,
            returned_episode_lengths=state.returned_episode_lengths * (1 - done)
            + new_episode_length * done,
            timestep=state.timestep + 1,
        )
        info["returned_episode_returns"] = state.returned_episode_returns
        info["returned_episode_lengths"] = state.returned_episode_lengths
        info["timestep"] = state.timestep
        info["returned_episode"] = done
        return obs, state, reward, done, info


NUM_ENVS = 4
ENV_STEPS = 8
env = LogWrapper(PointEnv())
tx = optax.adam(1e-2)


def update_step(runner_state):
    """PureJaxRL's `_update_step` in small: a `lax.scan` over environment steps collects a
    trajectory, then one gradient step on it (REINFORCE on a linear Gaussian policy). The
    environments are vectorized (`jax.vmap`) when the observations are."""

    def _env_step(runner_state, unused):
        params, opt_state, env_state, last_obs, rng = runner_state
        rng, _rng = jax.random.split(rng)
        noise = jax.random.normal(_rng, last_obs.shape[:-1])
        action = last_obs @ params["w"] + noise
        rng, _rng = jax.random.split(rng)
        if last_obs.ndim == 2:
            rng_step = jax.random.split(_rng, last_obs.shape[0])
            obsv, env_state, reward, done, info = jax.vmap(env.step)(rng_step, env_state, action)
        else:
            obsv, env_state, reward, done, info = env.step(_rng, env_state, action)
        runner_state = (params, opt_state, env_state, obsv, rng)
        return runner_state, (last_obs, noise, reward, info["returned_episode_returns"])

    runner_state, (obs, noise, reward, returned) = jax.lax.scan(
        _env_step, runner_state, None, ENV_STEPS
    )
    params, opt_state, env_state, last_obs, rng = runner_state

    def loss_fn(params):
        mean = obs @ params["w"]
        logp = -0.5 * (mean + noise - jax.lax.stop_gradient(mean)) ** 2
        return -jnp.mean(logp * reward)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    runner_state = (params, opt_state, env_state, last_obs, rng)
    return runner_state, (loss, returned.mean())


def _runner_state(jitted_reset: bool) -> Any:
    """PureJaxRL's runner state after `reset`: vectorized environments from the jitted
    `reset` (counters weakly typed int32 arrays), or one environment from `reset` run outside
    any jit (counters Python numbers, which `jax.jit` traces, and autoflat passes, weakly
    typed)."""
    if jitted_reset:
        keys = jax.random.split(jax.random.key(0), NUM_ENVS)
        obsv, env_state = jax.vmap(env.reset)(keys)
    else:
        obsv, env_state = env.reset.__wrapped__(env, jax.random.key(0))
        assert env_state.episode_returns == 0 and type(env_state.timestep) is int
    params = {"w": jnp.zeros((2,), jnp.float32)}
    return (params, tx.init(params), env_state, obsv, jax.random.key(1))


def _counted(fn: Any, traces: list[int]) -> Any:
    """`fn`, counting its traces (a `jax.jit` of it compiles once per trace)."""

    def counted(*args: Any) -> Any:
        traces.append(1)
        return fn(*args)

    return counted


def _weak(tree: Any) -> list[Any]:
    return [(x.dtype, _jax.weak_type(x)) for x in jax.tree.leaves(autoflat.unwrap(tree))]


@functools.cache
def _jit_loop(jitted_reset: bool) -> tuple[Any, list[Any], int]:
    """Three calls of `jax.jit(update_step)` from `_runner_state(jitted_reset)`: the final
    state, each call's metrics, and its traces (computed once for both `pack`s; only read)."""
    ref_traces: list[int] = []
    ref = jax.jit(_counted(update_step, ref_traces))
    r = _runner_state(jitted_reset)
    metrics = []
    for _ in range(3):
        r, r_metric = ref(r)
        metrics.append(r_metric)
    return r, metrics, len(ref_traces)


# (pack, jitted_reset): a state from a jitted reset (gymnax's) with either transport; from an
# eager reset, packed at four steps a call (the rest of it in the slow session).
_SLOW = pytest.mark.slow
_RL_CASES = [(False, True), (True, True), (True, False), pytest.param(False, False, marks=_SLOW)]


@pytest.mark.parametrize(
    ("pack", "jitted_reset"),
    [(False, True), (True, True), pytest.param(True, False, marks=_SLOW)]
    + [pytest.param(False, False, marks=_SLOW)],
)
def test_rl_state_with_weakly_typed_counters_at_one_step_a_call(pack, jitted_reset):
    start = _runner_state(jitted_reset)
    if jitted_reset:
        assert _jax.weak_type(start[2].episode_returns)  # as gymnax + LogWrapper hand it over
    r, r_metrics, ref_traces = _jit_loop(jitted_reset)
    step = autoflat.step(update_step, pack=pack)
    a = start
    for r_metric in r_metrics:
        a, a_metric = step(a)
        tree_allclose(a_metric, r_metric)
    tree_allclose(a, r)
    assert _weak(a) == _weak(r)
    # as many compiles as jax.jit: the counters' types settle after the first call
    assert step.stats.traces == ref_traces == 2


@functools.cache
def _scanned_loops(jitted_reset: bool, k: int) -> tuple[Any, list[Any], int, Any, Any]:
    """Two calls of a hand-written `jax.jit` of a k-step `lax.scan` of `update_step`, and 2 * k
    calls of `jax.jit(update_step)`, from `_runner_state(jitted_reset)`: the scan's final state,
    each of its calls' metrics and its traces; the plain loop's final state and last metric
    (computed once for both `pack`s; only read)."""
    scanned_traces: list[int] = []

    @jax.jit
    def scanned(runner_state):  # the k-step loop written by hand
        scanned_traces.append(1)
        return jax.lax.scan(lambda c, _: update_step(c), runner_state, None, k)

    plain = jax.jit(update_step)
    s, p = _runner_state(jitted_reset), _runner_state(jitted_reset)
    metrics = []
    for _ in range(2):
        s, s_metrics = scanned(s)
        metrics.append(s_metrics)
        for _ in range(k):
            p, p_metric = plain(p)
    return s, metrics, len(scanned_traces), p, p_metric


@pytest.mark.parametrize(("pack", "jitted_reset"), _RL_CASES)
def test_rl_state_with_weakly_typed_counters_at_four_steps_a_call(pack, jitted_reset):
    k = 4
    start = _runner_state(jitted_reset)
    step = autoflat.step(update_step, num_steps=k, pack=pack)
    s, s_calls, scanned_traces, p, p_metric = _scanned_loops(jitted_reset, k)
    a = start
    for s_metrics in s_calls:
        a, a_metrics = step(a)
        tree_allclose(a_metrics, s_metrics)
    tree_allclose(a, s)
    tree_allclose(a, p)
    tree_allclose(a_metrics[0][-1], p_metric[0])
    assert _weak(a) == _weak(s)
    # the num_steps scan promotes the weakly typed counters, as lax.scan does: its second
    # call sees them float32, as the hand-written scan's does
    assert step.stats.traces == scanned_traces == 2


# -- what the step sees -----------------------------------------------------------------------


def _state() -> dict[str, Any]:
    """Leaves that stay weakly typed, that become strongly typed, and strongly typed ones,
    enough of each dtype to be packed."""
    return {
        "count": jnp.asarray(0),  # weak int32, stays weak (count + 1)
        "scale": jnp.asarray(2.0),  # weak float32, stays weak (scale * 0.5)
        "ema": [jnp.full((3,), 1.0) for _ in range(3)],  # weak, made strong by the step
        "w": [jnp.ones((3,), jnp.float32) for _ in range(3)],
        "steps": jnp.zeros((), jnp.int32),
    }


def _recording(seen: list[Any]):
    def step(state, x):
        seen.append(_weak(state))
        state = {
            "count": state["count"] + 1,
            "scale": state["scale"] * 0.5,
            "ema": [e * 0.9 + 0.1 * x.astype(jnp.float32) for e in state["ema"]],
            "w": [w - 0.1 * (state["scale"] * x).astype(jnp.float32) for w in state["w"]],
            "steps": state["steps"] + 1,
        }
        # weak float32 * bfloat16 is bfloat16 (strong float32 * bfloat16 would be float32)
        return state, state["scale"] * x

    return step


@pytest.mark.parametrize("pack", [False, True, "auto"])
@pytest.mark.parametrize("donate", [True, False])
def test_the_step_sees_weak_types_as_under_jax_jit_on_every_call(pack, donate):
    x = jnp.ones((3,), jnp.bfloat16)
    seen_ref: list[Any] = []
    seen: list[Any] = []
    ref = jax.jit(_recording(seen_ref))
    step = autoflat.step(_recording(seen), pack=pack, donate=donate)
    start = _state()
    r, a = start, start
    for _ in range(3):
        r, r_out = ref(r, x)
        a, a_out = step(a, x)
        assert a_out.dtype == r_out.dtype == jnp.bfloat16
        tree_allclose(a_out, r_out)
    assert seen == seen_ref  # each trace saw what jax.jit's did: two, as types settle
    tree_allclose(a, r)
    assert _weak(a) == _weak(r)
    assert step.stats.traces == ref._cache_size() == 2
    assert _jax.weak_type(start["count"])  # the caller's arrays are left as they were


def test_a_weakly_typed_leaf_that_stays_weak_compiles_once():
    # PAX's EMA starts `debias = jnp.array(0.0)` and sets `jnp.array(1.0)`: weakly typed in
    # and out, one compile (as under jax.jit), packed or not, at one step a call or four
    def update(ema, x):
        debias = jnp.array(1.0)
        averages = [jnp.where(ema["debias"] > 0, a, x) * 0.9 + 0.1 * x for a in ema["averages"]]
        return {"averages": averages, "debias": debias}

    for pack in (False, True):
        for k in (1, 4):
            ema = {"averages": [jnp.zeros(2) for _ in range(3)], "debias": jnp.array(0.0)}
            step = autoflat.step(update, num_steps=k, pack=pack)
            xs = jnp.ones((2,)) if k == 1 else jnp.ones((k, 2))
            for _ in range(3):
                ema = step(ema, xs)
            assert _jax.weak_type(autoflat.unwrap(ema)["debias"])
            assert step.stats.traces == 1, (pack, k)


def test_a_packed_state_keeps_its_leaves_weak_types():
    leaves = [jnp.asarray(1.0), jnp.ones(3), jnp.full((2,), 1.0), jnp.asarray(0)]
    weak = [bool(_jax.weak_type(x)) for x in leaves]
    assert weak == [True, False, True, True]
    avals = [(x.shape, x.dtype) for x in leaves]
    layout = _transport.layout_for(avals, [False] * 4, True, weak)
    assert layout is not None and layout.weak == tuple(weak)
    assert layout is not _transport.layout_for(avals, [False] * 4, True)  # a key of its own
    for _ in range(_host._HOST_CALLS + 1):  # the host copies, then the compiled pack
        buffers = _host.pack_on_device(layout, leaves)
        assert not any(_jax.weak_type(b) for b in buffers)  # buffers are strongly typed
        back = _host.unpack_on_device(layout, buffers)
        assert [bool(_jax.weak_type(x)) for x in back] == weak
        for x, y in zip(back, leaves, strict=True):
            np.testing.assert_array_equal(x, y)


def test_jax_weakly_typed():
    x = jnp.ones(3)
    assert _jax.weakly_typed(x).weak_type and _jax.weakly_typed(x).dtype == jnp.float32
    w = jnp.asarray(1.0)
    assert _jax.weakly_typed(w) is w
    seen = []
    jax.jit(lambda y: seen.append(_jax.weak_type(_jax.weakly_typed(y))))(x)
    assert seen == [True]


# -- state given back under another name, its types changed -----------------------------------


def _scan_body(carry, x):
    """A `lax.scan`-shaped step: the carry comes back as an expression (never by name)."""
    w, total = carry
    loss = jnp.mean(x * w)
    return (w - 0.1 * loss, total + loss), loss


@pytest.mark.parametrize("k", [1, 4])
def test_a_weakly_typed_carry_given_back_under_another_name_is_promoted_state(k):
    """`(w, total + loss)` from `total = jnp.asarray(0)` (weak int32) comes back float32:
    matched as the new carry, as `lax.scan` promotes it. It was left broadcast and the
    result stacked: every step restarted from the carry passed in, silently."""
    xs = jnp.ones((k, 3)) * jnp.arange(1.0, k + 1.0)[:, None]
    step = autoflat.step(_scan_body, num_steps=k)
    got = want = (jnp.ones(3), jnp.asarray(0))
    scan = jax.jit(lambda c, xs: jax.lax.scan(_scan_body, c, xs))
    for _ in range(3):
        got, losses = step(got, xs if k > 1 else xs[0])
        want, want_losses = scan(want, xs)
    assert "# carry: state (matched by value to return position 0, weakly typed" in (
        autoflat.show(step)
    )
    tree_allclose(autoflat.unwrap(got), want)
    tree_allclose(losses, want_losses if k > 1 else want_losses[0])
    assert autoflat.stats(step).traces == 2  # the weak carry, then the promoted one


def _sgd_bf16(params, lr, x):
    g = jax.grad(lambda p: jnp.sum((x @ p["w"]) ** 2))(params)
    return jax.tree.map(lambda p, g: p - lr * g, params, g)


def _sgd_bf16_cast(params, lr, x):
    new = _sgd_bf16(params, lr, x)
    return jax.tree.map(lambda n, o: n.astype(o.dtype), new, params)


def _stax_step(params, x):
    grads = jax.grad(lambda ps: jnp.mean((x @ ps[0][0] + ps[0][1]) ** 2))(params)
    return [(w - 0.1 * dw, b - 0.1 * db) for (w, b), (dw, db) in zip(params, grads, strict=True)]


def _stax_step_tuple(params, x):
    return tuple(_stax_step(params, x))


@pytest.mark.parametrize(
    ("fn", "fixed", "state", "what"),
    [
        (
            _sgd_bf16,
            _sgd_bf16_cast,
            lambda: {"w": jnp.ones((3, 2), jnp.bfloat16)},
            "dtypes (['w']: bfloat16 comes back as float32)",
        ),
        (
            _stax_step,
            _stax_step_tuple,
            lambda: ((jnp.ones((3, 2)) * 0.1, jnp.zeros(2)),),
            "tree structure (((*, *),) comes back as [(*, *)])",
        ),
    ],
)
def test_state_given_back_with_another_dtype_or_container_is_an_error_at_several_steps(
    fn, fixed, state, what
):
    """bfloat16 parameters updated with a float32 rate, a tuple of layers given back as a
    list: not a `lax.scan` carry (its types must stay), so not matched, and left broadcast
    every step restarted from the value passed in (silently; the list case failed with a
    shape error at the second call). Refused with both fixes; at one step a call it runs as
    `jax.jit` does, and the fixed step (types kept) is carried, equal to `jax.jit`."""
    xs = jnp.ones((4, 5, 3))
    extra = (jnp.float32(0.1),) if fn is _sgd_bf16 else ()
    options = {"broadcast": "lr"} if extra else {}
    with pytest.raises(autoflat.OptionError) as e:
        autoflat.step(fn, num_steps=4, **options)(state(), *extra, xs)
    assert f"has the leaf shapes of `params`, but not its {what}" in str(e.value)
    assert 'broadcast="params"' in str(e.value)
    one, ref = autoflat.step(fn, **options), jax.jit(fn)
    got = want = state()
    for x in xs:
        got, want = one(got, *extra, x), ref(want, *extra, x)
    tree_allclose(autoflat.unwrap(got), want)
    carried = autoflat.step(fixed, num_steps=4, **options)(state(), *extra, xs)
    want = state()
    for x in xs:
        want = jax.jit(fixed)(want, *extra, x)
    tree_allclose(autoflat.unwrap(carried), want)


def _summed(w, total, x):
    loss = jnp.sum((w * x - 1.0) ** 2)
    return w - 0.1 * x, total + loss


def test_a_bare_weak_total_added_to_at_its_place_is_promoted_state():
    """`total + loss` from `total = jnp.asarray(0)` (a bare weakly typed int32) at its place:
    carried promoted, as `jax.jit` of a `lax.scan` carries it. A residual of int targets
    (`y - X @ w`) or a loss divided by a weakly typed count at their place is not their new
    value: per-step outputs, as a `jax.jit` loop gives them."""
    xs = jnp.ones((4, 3)) * jnp.arange(4.0)[:, None]
    start = (jnp.zeros(3), jnp.asarray(0))
    step = autoflat.step(_summed, num_steps=4)
    got = step(*start, xs)
    assert "# total: state (matched by value to return position 1, weakly typed" in (
        autoflat.show(step)
    )
    scan = jax.jit(lambda c, xs: jax.lax.scan(lambda c, x: (_summed(*c, x), None), c, xs))
    tree_allclose(got, scan(start, xs)[0])

    def residual(w, y, x):
        return w - 0.1 * x, y - x @ w

    def mean_loss(w, n, x):
        return w - 0.1 * x, jnp.sum(w * x) / n

    for fn, other in ((residual, jnp.arange(3, dtype=jnp.int32)), (mean_loss, jnp.asarray(3))):
        w, outs = autoflat.step(fn, num_steps=4)(jnp.zeros(3), other, xs)
        want_w, want = jnp.zeros(3), []
        for x in xs:
            want_w, out = jax.jit(fn)(want_w, other, x)
            want.append(out)
        tree_allclose((w, outs), (want_w, jnp.stack(want)))


def _renamed_total(w, total, x):
    loss = jnp.sum((w * x - 1.0) ** 2)
    new_total = loss + total
    return w - 0.1 * x, new_total


def _bf16_ema(state, x):
    loss = jnp.mean(x).astype(jnp.bfloat16)
    return {"ema": 0.9 * state["ema"] + 0.1 * loss, "w": state["w"] * 0.5}, loss


def test_a_renamed_weak_total_is_promoted_state():
    """`new_total = loss + total` (returned under its own name with a word for new) from a
    weakly typed `jnp.asarray(0)`: carried promoted, as a `lax.scan` carries it (it was
    broadcast, each step restarting from 0)."""
    fn = _renamed_total
    xs = jnp.ones((4, 3)) * jnp.arange(4.0)[:, None]
    start = (jnp.zeros(3), jnp.asarray(0))
    step = autoflat.step(fn, num_steps=4)
    got = step(*start, xs)
    assert "state (matched by value to return position 1, weakly typed" in autoflat.show(step)
    scan = jax.jit(lambda c, xs: jax.lax.scan(lambda c, x: (fn(*c, x), None), c, xs))
    tree_allclose(got, scan(start, xs)[0])


def _added_second(w, total, x):
    loss = jnp.sum((w * x - 1.0) ** 2)
    return w - 0.1 * x, loss + total, loss


def _max_second(w, best, x):
    loss = jnp.sum((w * x - 1.0) ** 2)
    return w - 0.1 * x, jnp.maximum(best, loss), loss


@pytest.mark.parametrize(("fn", "name"), [(_added_second, "total"), (_max_second, "best")])
def test_stacked_outputs_passed_back_as_a_broadcast_argument_name_its_position(fn, name):
    """`loss + total` does not accumulate `total` by the rules (`loss + eps`), nor does
    `jnp.maximum(best, loss)` keep a running maximum (`jnp.maximum(floor, loss)` is a clamp),
    so a weakly typed `total` or `best` is broadcast and position 1 stacked; passing those
    stacked values back is the ShapeError for a broadcast argument gaining a leading axis,
    which also names `state={name: 1}`, the fix that carries it as a `jax.jit` loop does."""
    xs = jnp.ones((8, 3)) * jnp.arange(8.0)[:, None]
    step = autoflat.step(fn, num_steps=4)
    w, total, _ = step(jnp.zeros(3), jnp.asarray(0), xs[:4])
    with pytest.raises(autoflat.ShapeError) as info:
        step(w, total, xs[4:])
    assert (
        "Or it is what return position 1 gives back, passed in again: that position could be "
        f"`{name}`'s new value" in str(info.value)
    )
    assert f'state={{"{name}": 1}})' in str(info.value)
    fixed = autoflat.step(fn, num_steps=4, state={name: 1})
    w, total, _ = fixed(jnp.zeros(3), jnp.asarray(0), xs[:4])
    w, total, _ = fixed(w, total, xs[4:])
    want = (jnp.zeros(3), jnp.asarray(0))
    for x in xs:
        *want, _ = jax.jit(fn)(*want, x)
    tree_allclose((w, total), tuple(want), rtol=1e-6)


def test_a_weak_float32_leaf_given_back_as_bfloat16_is_promoted_state():
    """A weakly typed float32 `ema` updated with a bfloat16 loss comes back bfloat16 under
    `jax.jit` (a weak type takes the other operand's dtype); a `lax.scan` carry promotes so
    too. Carried, equal to the `jax.jit` loop (it was refused, asking to cast it back to
    float32, which would differ from it)."""
    xs = jnp.arange(8.0).reshape(4, 2)
    start = {"ema": jnp.asarray(0.1), "w": jnp.ones(2)}
    state, losses = autoflat.step(_bf16_ema, num_steps=4)(dict(start), xs)
    want, want_losses = start, []
    for x in xs:
        want, loss = jax.jit(_bf16_ema)(want, x)
        want_losses.append(loss)
    state = autoflat.unwrap(state)
    assert state["ema"].dtype == want["ema"].dtype == jnp.bfloat16
    tree_allclose((state, losses), (want, jnp.stack(want_losses)))


def test_a_tuple_output_with_a_broadcast_dicts_leaf_shapes_is_not_refused():
    """A rollout step whose per-step `(reward, done)` has the leaf shapes of the policy's
    `{"w", "b"}` scalars: another kind of tree (a dict is not a tuple), so no refusal;
    the output is stacked and `params` broadcast, as a `jax.jit` loop gives it."""

    def rollout(params, pos, key, x):
        key, sub = jax.random.split(key)
        action = jnp.tanh(params["w"] * pos + params["b"]) + 0.1 * jax.random.normal(sub) + x
        pos = pos + action
        return pos, key, (-jnp.abs(pos), pos > 1.0)

    params = {"w": jnp.float32(0.5), "b": jnp.float32(0.1)}
    xs = jnp.linspace(0.0, 0.3, 4)
    pos, key, (rewards, done) = autoflat.step(rollout, num_steps=4)(
        params, jnp.float32(0.0), jax.random.key(0), xs
    )
    want_pos, want_key, want = jnp.float32(0.0), jax.random.key(0), []
    for x in xs:
        want_pos, want_key, out = jax.jit(rollout)(params, want_pos, want_key, x)
        want.append(out)
    tree_allclose((pos, rewards, done), (want_pos, *map(jnp.stack, zip(*want, strict=True))))


def test_broadcast_containers_beside_outputs_of_their_leaf_shapes_are_not_refused():
    """Found refused by the type-change check before it asked for evidence: a dict of
    hyperparameter arrays beside a metrics dict of other keys, and int `(labels, mask)`
    beside per-token float `(loss, correct)`. Neither output is the new value of the input:
    per-step outputs, as a `jax.jit` loop gives them."""

    def with_hp(w, hp, x):
        g = x - w
        w = w - hp["lr"] * g - hp["wd"] * w
        return w, {"loss": jnp.sum(g**2), "gnorm": jnp.sqrt(jnp.sum(g**2))}

    def per_token(w, targets, x):
        labels, mask = targets
        logits = x[:, None] * w
        loss = (logits - labels) ** 2 * mask
        correct = (jnp.round(logits) == labels).astype(jnp.float32)
        return w - 0.01 * jnp.mean(loss), (loss, correct)

    hp = {"lr": jnp.float32(0.1), "wd": jnp.float32(0.01)}
    targets = (jnp.ones((3, 2), jnp.int32), jnp.ones((3, 2), jnp.int32))
    xs = jnp.ones((4, 3)) * jnp.arange(4.0)[:, None]
    for fn, other, n in ((with_hp, hp, 3), (per_token, targets, 2)):
        w, outs = autoflat.step(fn, num_steps=4)(jnp.full(n, 0.5), other, xs)
        want_w, want = jnp.full(n, 0.5), []
        for x in xs:
            want_w, out = jax.jit(fn)(want_w, other, x)
            want.append(out)
        stacked = jax.tree.map(lambda *a: jnp.stack(a), *want)
        tree_allclose((w, outs), (want_w, stacked))
