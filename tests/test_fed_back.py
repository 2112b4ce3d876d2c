"""A per-step input read so by its shapes, passed back what the step returned as a per-step
output the call before (`_runtime.fed_back`): refused with a `ShapeError`; everything else
that looks alike runs as before."""

from __future__ import annotations

import gc
import re
import weakref

import jax
import jax.numpy as jnp
import optax
import pytest
from claims.claim import claim
from helpers import tree_allclose

import autoflat
from autoflat._runtime import fed_back

K = 4


def _running(params, opt_state, ret, x):
    """`ret` of K environments, updated elementwise and returned as an expression."""
    loss, g = jax.value_and_grad(lambda p: jnp.mean(((x @ p["w"]).sum(-1) - ret) ** 2))(params)
    updates, opt_state = optax.sgd(0.1).update(g, opt_state)
    return optax.apply_updates(params, updates), opt_state, 0.9 * ret + x.sum(-1), loss


def _start():
    params = {"w": jnp.full((3, 2), 0.1)}
    return params, optax.sgd(0.1).init(params), jnp.zeros(K)


def _xs(n: int, seed: int = 0) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), (n, K, 3))


def test_passed_back_it_raises_before_taking_the_state():
    """The state handles passed in stay usable after the error: nothing was consumed."""
    xs = _xs(2 * K)
    step = autoflat.step(_running, num_steps=K)
    params, opt_state, ret, _ = step(*_start(), xs[:K])
    before = autoflat.stats(step)
    with pytest.raises(autoflat.ShapeError, match=re.escape('state={"ret": 2})')):
        step(params, opt_state, ret, xs[K:])
    after = autoflat.stats(step)
    assert (after.traces, after.fast_path, after.flattens) == (
        before.traces,
        before.fast_path,
        before.flattens,
    )  # refused before taking anything
    assert jnp.isfinite(params["w"]).all()  # the handle, not consumed
    step(params, opt_state, jnp.zeros(K), xs[K:])  # fresh data: runs


def test_fresh_per_step_data_and_copies_run_and_per_step_says_so():
    """New per-step inputs every call run; `per_step=` says the rows passed back are inputs
    (then each step takes its row, equal to `jax.jit` of the step on each row)."""
    xs = _xs(2 * K)
    step = autoflat.step(_running, num_steps=K)
    state = _start()
    for start in (0, K):
        *_, ret, _ = step(*state[:2], jnp.arange(float(K)), xs[start : start + K])
    step(*state[:2], ret + 0.0, xs[:K])  # a copy of what came back: told apart by identity
    said = autoflat.step(_running, num_steps=K, per_step="ret")
    params, opt_state, ret = _start()
    got_params, got_opt, got_ret, _ = said(params, opt_state, jnp.zeros((K, K)), xs[:K])
    got_params, got_opt, got_ret, _ = said(got_params, got_opt, got_ret, xs[K:])
    want = (params, opt_state)
    rows = jnp.zeros((K, K))
    for chunk in (xs[:K], xs[K:]):
        new_rows = []
        for i in range(K):
            *want, r, _ = jax.jit(_running)(*want, rows[i], chunk[i])
            new_rows.append(r)
        rows = jnp.stack(new_rows)
    tree_allclose((got_params, got_ret), (want[0], rows), rtol=1e-5)


def test_one_step_a_call_passes_anything_back():
    """At num_steps=1 nothing is read by its leading axis: `ret` is passed as it is, as
    `jax.jit` passes it, and passing back what the step returned is the loop it is."""
    xs = _xs(3)
    step = autoflat.step(_running, num_steps=1)
    got = _start()
    want = _start()
    for x in xs:
        *got, _ = step(*got, x)
        *want, _ = jax.jit(_running)(*want, x)
    tree_allclose(tuple(got), tuple(want), rtol=1e-6)


def test_the_outputs_are_not_kept_alive():
    """The step holds its last per-step outputs weakly: deleted, they are freed."""
    step = autoflat.step(_running, num_steps=K)
    *_, ret, loss = step(*_start(), _xs(K))
    refs = [weakref.ref(ret), weakref.ref(loss)]
    del ret, loss
    gc.collect()
    assert [r() for r in refs] == [None, None]


def _pooled(d, real, pool):
    """A discriminator fed last call's fakes from a pool: one per step, never a carry (one
    step's fake has the shape of a row of the pool, not of the pool)."""
    fake = real * 0.5 + 1.0
    return d + 0.01 * (real.mean() - pool.mean()), fake


def test_an_output_passed_back_where_it_cannot_be_the_new_value_runs():
    real = jax.random.normal(jax.random.key(0), (2, K, 8, 3))
    step = autoflat.step(_pooled, num_steps=K)
    d, fakes = step(jnp.zeros(()), real[0], jnp.zeros((K, 8, 3)))
    d, fakes = step(d, real[1], fakes)
    want = jnp.zeros(())
    pool = jnp.zeros((K, 8, 3))
    for chunk in real:
        new_pool = []
        for i in range(K):
            want, fake = jax.jit(_pooled)(want, chunk[i], pool[i])
            new_pool.append(fake)
        pool = jnp.stack(new_pool)
    tree_allclose((d, fakes), (want, pool), rtol=1e-6)


def _running_dict(w, ret, x):
    loss, g = jax.value_and_grad(lambda w: jnp.mean(((x @ w).sum(-1) - ret) ** 2))(w)
    return {"w": w - 0.1 * g, "episode": 0.9 * ret + x.sum(-1), "loss": loss}


def test_a_returned_dict_names_its_key_and_the_option_that_carries_it():
    xs = _xs(2 * K)
    step = autoflat.step(_running_dict, num_steps=K)
    out = step(jnp.full((3, 2), 0.1), jnp.zeros(K), xs[:K])
    with pytest.raises(autoflat.ShapeError) as info:
        step(out["w"], out["episode"], xs[K:])
    assert "`ret` holds what the returned key 'episode' gave back at an earlier call" in str(
        info.value
    )
    assert 'num_steps=4, state="ret")' in str(info.value)
    fixed = autoflat.step(_running_dict, num_steps=K, state="ret")
    got = {"w": jnp.full((3, 2), 0.1), "episode": jnp.zeros(K)}
    want = dict(got)
    for start in (0, K):
        got = fixed(got["w"], got["episode"], xs[start : start + K])
    for x in xs:
        want = jax.jit(_running_dict)(want["w"], want["episode"], x)
    tree_allclose((got["w"], got["episode"]), (want["w"], want["episode"]), rtol=1e-5)


def test_only_a_program_s_first_calls_are_recorded():
    """Later calls pay nothing: what the call after the checked ones returns is not
    recorded."""
    xs = _xs(K)
    step = autoflat.step(_running, num_steps=K)
    state = _start()
    for _ in range(fed_back.CHECKED_CALLS + 1):
        *_, ret, _ = step(*state[:2], jnp.zeros(K), xs)
    step(*state[:2], ret, xs)  # (not refused: a carry shows at the second call)
    with pytest.raises(autoflat.ShapeError):
        fresh = autoflat.step(_running, num_steps=K)
        *_, ret, _ = fresh(*state[:2], jnp.zeros(K), xs)
        fresh(*state[:2], ret, xs)


def test_two_streams_taking_turns_are_checked_each_against_its_own_last_call():
    """Two agents trained by one step in turn: the second stream's call comes between a
    stream's call and the next, which passes back its own carry."""
    xs = _xs(K)
    step = autoflat.step(_running, num_steps=K)
    a, b = _start(), _start()
    *a_state, a_ret, _ = step(*a[:2], jnp.zeros(K), xs)
    *b_state, b_ret, _ = step(*b[:2], jnp.zeros(K), xs)
    with pytest.raises(autoflat.ShapeError, match=re.escape('state={"ret": 2}')):
        step(*a_state, a_ret, xs)
    step(*a_state, jnp.zeros(K), xs)  # (a's state, not taken by the refusal)


def test_profiling_keeps_what_the_last_call_returned():
    xs = _xs(K)
    step = autoflat.step(_running, num_steps=K)
    params, opt_state, ret, _ = step(*_start(), xs)
    autoflat.profile(step, params, opt_state, jnp.zeros(K), xs, calls=2)
    with pytest.raises(autoflat.ShapeError):
        step(params, opt_state, ret, xs)


def _noisy(i, w):  # (jax's examples/advi.py: a key made from the step index)
    return w + jax.random.normal(jax.random.key(i), ())


@claim("docs/faq.md", "a step counter passed that way is refused at the next call")
def test_a_python_int_grown_by_num_steps_is_a_step_counter_and_asked_about():
    """Static, a Python int is the same for each step of a call; grown by num_steps at the
    next call, it is a step counter: an `OptionError` naming per-step indices, which give
    `jax.jit`'s result, and the options that keep one value a call."""
    want = jnp.zeros(())
    for t in range(8):
        want = jax.jit(_noisy)(t, want)
    step = autoflat.step(_noisy, num_steps=K)
    w = step(0, jnp.zeros(()))
    with pytest.raises(autoflat.OptionError) as info:
        step(K, w)
    message = str(info.value)
    assert "`i` went from 0 to 4 since the last call, num_steps apart" in message
    assert "jnp.arange(i, i + 4)" in message and 'broadcast="i"' in message
    assert 'static_argnames="i"' in message
    per_step = autoflat.step(_noisy, num_steps=K)
    got = jnp.zeros(())
    for t in range(0, 8, K):
        got = per_step(jnp.arange(t, t + K), got)
    tree_allclose(got, want, rtol=1e-6)
    for option in ({"broadcast": "i"}, {"static_argnames": "i"}):
        said = autoflat.step(_noisy, num_steps=K, **option)
        w = jnp.zeros(())
        for t in range(0, 8, K):
            w = said(t, w)  # (one value a call, as said)
    assert autoflat.stats(said).traces == 2  # static: compiled per value


def test_other_python_ints_run():
    """An int that changes otherwise (an epoch, one more a call) or stays runs as before."""
    step = autoflat.step(_noisy, num_steps=K)
    w = jnp.zeros(())
    for t in (0, 1, 2, 2):
        w = step(t, w)


def _scheduled(w, x, epoch):
    lr = 0.1 if epoch < 2 else 0.01  # (a concrete int: static at one step a call)
    return w - lr * x, jnp.sum(w * x)


def test_one_step_a_call_takes_any_static_int():
    """At num_steps=1 an int the step needs concrete is static, as `static_argnums` makes it:
    one more each call is no step counter read as one value for several steps."""
    step = autoflat.step(_scheduled, num_steps=1)
    w = jnp.ones(3)
    for epoch in range(3):
        w, _ = step(w, jnp.ones(3), epoch)
    want = jnp.ones(3)
    for epoch in range(3):
        want, _ = jax.jit(_scheduled, static_argnums=2)(want, jnp.ones(3), epoch)
    tree_allclose(w, want)


def test_a_countdown_by_num_steps_is_asked_about_too():
    step = autoflat.step(_noisy, num_steps=K)
    w = step(8, jnp.zeros(()))
    with pytest.raises(autoflat.OptionError, match="went from 8 to 4 since the last call"):
        step(4, w)


_opt = optax.adam(1e-2)


@jax.jit
def _lstm_loss(params, x, y):
    return jnp.mean(jnp.square(x @ params["w"] - y))


def _lstm_update(step, params, opt_state, x, y):  # (dm-haiku examples/haiku_lstms.ipynb)
    l, grads = jax.value_and_grad(_lstm_loss)(params, x, y)  # noqa: E741 (verbatim)
    grads, opt_state = _opt.update(grads, opt_state)
    params = optax.apply_updates(params, grads)
    return l, params, opt_state


@claim("docs/roles.md", "is no such question: its value selects no compiled version")
@pytest.mark.parametrize("k", [1, K])
def test_a_step_counter_the_body_never_reads_is_no_counter_and_compiles_once(k):
    """Haiku's LSTM example passes `step` and never reads it: no question about a counter,
    and its value selects no compiled version (one trace for every call)."""
    xs = jax.random.normal(jax.random.key(0), (8, 5, 3))
    ys = jax.random.normal(jax.random.key(1), (8, 5, 2))
    params = {"w": jnp.full((3, 2), 0.1, jnp.float32)}  # (not weakly typed: one trace)
    want = (params, _opt.init(params))
    for i in range(8):
        _, *want = jax.jit(_lstm_update)(i, *want, xs[i], ys[i])
    step = autoflat.step(_lstm_update, num_steps=k)
    got = (params, _opt.init(params))
    for i in range(0, 8, k):
        batch = (xs[i], ys[i]) if k == 1 else (xs[i : i + k], ys[i : i + k])
        _, *got = step(i, *got, *batch)
    tree_allclose(got, want, rtol=1e-5)
    assert autoflat.stats(step).traces == 1
