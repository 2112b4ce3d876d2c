"""`autoflat.profile`: what it reports is right in kind (host- or device-bound, the rebuild
lines, the recompile causes, per-step input bytes), and it takes nothing from the caller.

No timing is asserted: the steps here are lopsided on purpose (hundreds of tiny leaves against
one large matmul), so which side dominates does not depend on this machine's speed.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import tree_allclose

import autoflat

TX = optax.sgd(1e-2)


def _tiny_leaves_step():
    @autoflat.step(pack=False)
    def update(params, opt_state, x):
        loss, grads = jax.value_and_grad(lambda p: sum(jnp.sum(v * x) for v in p.values()))(params)
        updates, opt_state = TX.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    params = {f"w{i}": jnp.ones((2,)) for i in range(300)}
    return update, params, TX.init(params)


def test_a_state_of_many_leaves_the_step_barely_touches_is_host_bound():
    """Host-heavy on purpose: 1,000 buffers cross `jax.jit` each call, one of them changes.
    The device has next to nothing to do (unchanged donated buffers are aliased), so the
    host's share does not depend on this machine's speed."""

    @autoflat.step(pack=False)
    def touch_one(state, x):
        state = dict(state)
        state["w0"] = state["w0"] + x
        return state

    state = touch_one({f"w{i}": jnp.ones((2,)) for i in range(1000)}, jnp.ones(2))
    p = autoflat.profile(touch_one, state, jnp.ones(2), calls=5)
    assert p.host_bound
    assert p.host_share > 0.5
    assert p.loop_overhead > 0.5 and "beyond the device time" in str(p)
    assert p.suggested_num_steps > 1
    assert p.dispatch_s > 0 and p.autoflat_s >= 0
    assert "host-bound" in str(p)
    assert p.step.endswith("<locals>.touch_one") and p.num_steps == 1


def test_a_device_round_trip_is_neither_host_work_nor_the_step_s(monkeypatch):
    """On an accelerator, awaiting any program takes a round trip to the device (about
    0.7 ms on a TPU): it is not host work that more steps a call would share, nor device time
    of the step. Simulated here: every await takes 50 ms longer; the 50 ms goes into
    `roundtrip_s` only (the sleep's jitter leaves the device figure too noisy to compare with
    the host's here)."""
    step, params, opt_state = _tiny_leaves_step()
    params, opt_state, _ = step(params, opt_state, jnp.ones(2))
    wait = jax.block_until_ready

    def slow_wait(x):
        out = wait(x)
        time.sleep(0.05)
        return out

    monkeypatch.setattr(jax, "block_until_ready", slow_wait)
    p = autoflat.profile(step, params, opt_state, jnp.ones(2), calls=3)
    assert p.roundtrip_s >= 0.05 > p.dispatch_s  # a dispatch does not wait for the device
    assert p.host_s < 0.05 and p.device_s < 0.05


def test_a_large_matmul_step_is_device_bound():
    @autoflat.step
    def heavy(w, x):
        for _ in range(3):
            x = jnp.tanh(x @ w)
        return w - 1e-3 * x.mean(), x.sum()

    w = jnp.full((768, 768), 1e-3)
    p = autoflat.profile(heavy, w, jnp.ones((768, 768)), calls=3)
    assert not p.host_bound
    assert p.host_share < 0.05
    assert p.loop_overhead < 0.5  # (a loop of 3 calls against the program's median)
    assert p.suggested_num_steps == 1
    assert "device-bound" in str(p) and "num_steps=1 keeps host work under 5%" in str(p)


def test_the_device_time_of_a_loop_that_waits_on_the_device(monkeypatch):
    """On a TPU, awaiting the 484 buffers an empty program gave back took most of what the
    step's program took to await, so their difference made a device-bound step of 2.4 ms a
    call about 0.13 ms, and host-bound. Simulated here: the step's results taken as on an
    accelerator, and the empty program doing the step's work. The program's calls back to back, which wait
    on the device, still tell the device time."""
    from autoflat._runtime import profile as profile_module

    def busy_noop(state, xs, bcast):
        x = xs[0]
        for _ in range(3):
            x = jnp.tanh(x @ x)
        return state, x.sum()

    @autoflat.step
    def heavy(w, x):
        for _ in range(3):
            x = jnp.tanh(x @ w)
        return w - 1e-3 * x.mean(), x.sum()

    w, x = jnp.full((768, 768), 1e-3), jnp.ones((768, 768))
    monkeypatch.setattr(profile_module, "_noop", busy_noop)
    monkeypatch.setattr(profile_module, "_on_accelerator", lambda ran: True)
    p = autoflat.profile(heavy, w, x, calls=3)
    assert p.roundtrip_s > 0.5 * p.loop_s  # the empty program costs as much as the step
    assert p.device_s > 0.5 * p.loop_s  # the program's calls back to back wait on the device
    # Device-bound; not how far (with the suite's workers on every core, the host's figures
    # here are noisy: once its share was 40%, where it is about 1% alone).
    assert not p.host_bound


def test_the_device_a_step_ran_on_is_where_its_results_are(monkeypatch):
    """A step whose results are on the CPU ran there, whatever JAX's default backend (a GPU
    machine's default, with the step placed on its CPU); with no array, the default says."""
    from autoflat._runtime import profile as profile_module

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert not profile_module._on_accelerator((jnp.ones(2), {"w": jnp.zeros(3)}))
    assert profile_module._on_accelerator((1, None))


# Medians measured on a TPU v5e (microseconds a call: the program's launch, its calls back to
# back (a loop of 20's time over its calls), its awaited time less the empty program's;
# benchmarks/results/tpu/profile.txt): the narrow ResNet50 with Adam at one step a call
# (3 buffers) and ten (484 buffers; the "hidden" run's launch is the step's own), and a step
# of 1,000 buffers that changes one (host-bound); then that step on a 2-core CPU.
_MEASURED = {
    "tpu, device-bound": (True, 146, 419, 404, (419, 419)),
    "tpu, 484 buffers, device-bound": (True, 1771, 2456, 431, (2456, 2456)),
    "tpu, 484 buffers, hidden": (True, 2138, 2404, 88, (88, 2404)),
    "tpu, host-bound": (True, 3382, 3932, -2736, (0, 3932)),
    "cpu, host-bound": (False, 1216, 1559, -587, (0, 0)),
}


@pytest.mark.parametrize("case", sorted(_MEASURED))
def test_the_device_time_from_measured_medians(case):
    """Where the program's calls back to back take clearly longer than one takes to launch,
    the device time is a call's time among them; where about as long, the device's time
    hides behind the host's: the difference is the figure, the loop's time the most it can
    be; on a CPU the difference alone."""
    from autoflat._runtime.profile import _device_per_call

    accelerator, launch, loop, difference, expected = _MEASURED[case]
    medians = {
        "program_launch": launch * 1e-6,
        "program_loop": loop * 1e-6,
        "program": (difference + 800) * 1e-6,
        "roundtrip": 800e-6,
    }
    found = _device_per_call(medians, accelerator)
    assert found == pytest.approx(tuple(x * 1e-6 for x in expected))


def test_a_hidden_device_time_is_reported_with_the_most_it_can_be():
    """The report gives the range where the device's time hides behind the host's."""
    p = autoflat.Profile(
        step="update", where="train.py:1", num_steps=10, calls=20, autoflat_s=1e-4,
        launch_s=2.1e-3, dispatch_s=2.1e-3, roundtrip_s=4.8e-3, device_s=8.8e-6,
        device_max_s=240e-6, loop_s=2.7e-3, step_input_bytes=0, flattens_per_call=0.0,
        copies_per_call=0.0, rebuilds_per_call=0.0, history={}, rebuilt_at=(), recompiles=(),
    )  # fmt: skip
    hidden = "device per step      8.8 us  (up to 240.0 us: the program's calls back to back"
    assert hidden in str(p)
    exact = dataclasses.replace(p, device_max_s=p.device_s)
    assert "device per step      8.8 us\n" in str(exact)


def test_a_step_that_returns_nothing_is_waited_for():
    """State written back into the caller's dict, nothing returned (as a Flax NNX step in
    mutation style): the loop waits for the program's outputs, not only for the step's
    result, so a call of it takes at least about the device time of a call (it measured
    dispatch alone, about 0.3% of it, when only the result was awaited)."""

    @autoflat.step
    def heavy_in_place(d, x):
        for _ in range(3):
            x = jnp.tanh(x @ d["w"])
        d["w"] = d["w"] - 1e-3 * x.mean()

    d = {"w": jnp.full((768, 768), 1e-3)}
    heavy_in_place(d, jnp.ones((768, 768)))
    p = autoflat.profile(heavy_in_place, d, jnp.ones((768, 768)), calls=3)
    assert p.loop_s >= 0.5 * p.num_steps * p.device_s > 0


def test_profile_takes_nothing_from_the_caller():
    """Handles stay unbuilt and usable, the counters and the fast path are as before."""
    update, params, opt_state = _tiny_leaves_step()
    x = jnp.ones(2)
    params, opt_state, _ = update(params, opt_state, x)
    ref = jax.tree.map(np.asarray, autoflat.unwrap(params))  # rebuilds: counted below
    before = autoflat.stats(update)
    autoflat.profile(update, params, opt_state, x, calls=3)
    assert autoflat.stats(update) == before
    tree_allclose(params, ref, exact=True)
    params, opt_state, _ = update(params, opt_state, x)
    after = autoflat.stats(update)
    assert after.calls == before.calls + 1 and after.traces == before.traces


def test_profile_leaves_handles_unbuilt_and_the_next_call_on_the_fast_path():
    update, params, opt_state = _tiny_leaves_step()
    x = jnp.ones(2)
    params, opt_state, _ = update(params, opt_state, x)
    before = autoflat.stats(update)
    autoflat.profile(update, params, opt_state, x, calls=3)
    params, opt_state, _ = update(params, opt_state, x)
    after = autoflat.stats(update)
    assert after.fast_path == before.fast_path + 2  # both handles: nothing was rebuilt
    assert after.flattens == before.flattens and after.copies == before.copies


def test_profile_of_a_mutation_style_step_leaves_the_callers_object():
    @autoflat.step
    def accumulate(totals, x):
        totals["sum"] = totals["sum"] + x.sum()

    totals = {"sum": jnp.zeros(())}
    accumulate(totals, jnp.ones(3))
    autoflat.profile(accumulate, totals, jnp.ones(3), calls=3)
    assert float(totals["sum"]) == 3.0
    accumulate(totals, jnp.ones(3))
    assert float(totals["sum"]) == 6.0


def test_profile_of_a_flax_nnx_step_leaves_the_callers_model():
    nnx = pytest.importorskip("flax.nnx")
    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    @autoflat.step
    def train_step(model, optimizer, x):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    x = jnp.ones((4, 3))
    train_step(model, optimizer, x)
    kernel = np.asarray(model.kernel[...])
    p = autoflat.profile(train_step, model, optimizer, x, calls=3)
    np.testing.assert_array_equal(np.asarray(model.kernel[...]), kernel)
    assert p.num_steps == 1
    train_step(model, optimizer, x)
    assert not np.array_equal(np.asarray(model.kernel[...]), kernel)


def test_profile_names_the_line_that_rebuilt_handles():
    update, params, opt_state = _tiny_leaves_step()
    x = jnp.ones(2)
    params, opt_state, _ = update(params, opt_state, x)
    _ = params["w0"] + 1  # rebuilds the handle: the next call copies it
    line = test_profile_names_the_line_that_rebuilt_handles.__code__.co_firstlineno + 4
    params, opt_state, _ = update(params, opt_state, x)
    p = autoflat.profile(update, params, opt_state, x, calls=3)
    assert p.rebuilt_at == ((f"test_profile.py:{line}", 1),)
    assert p.history["rebuilds"] == 1 and p.history["copies"] >= 1
    assert f"rebuilt at test_profile.py:{line} x1" in str(p)
    assert p.rebuilds_per_call == 0  # the profiled loop reads nothing


def test_profile_says_why_the_step_recompiled():
    @autoflat.step(static_argnames="scale")
    def scaled(w, x, scale):
        return w - scale * x

    w = jnp.ones(3)
    for scale in (0.1, 0.2):
        w = scaled(w, jnp.ones(3), scale)
    p = autoflat.profile(scaled, w, jnp.ones(3), 0.2, calls=3)
    assert p.recompiles == ("the value of static argument `scale` (0.1 -> 0.2)",)
    assert "recompiled 1 times, last: the value of static argument `scale`" in str(p)


def test_per_step_input_bytes_and_the_memory_at_the_suggestion():
    @autoflat.step(num_steps=4)
    def update(w, x):
        return w - 0.1 * x.mean(), x.sum()

    xs = jnp.ones((4, 8, 16), jnp.float32)
    w, _ = update(jnp.zeros(()), xs)
    p = autoflat.profile(update, w, xs, calls=3)
    assert p.num_steps == 4
    assert p.step_input_bytes == 8 * 16 * 4
    assert p.suggested_input_bytes == p.step_input_bytes * p.suggested_num_steps


def test_a_method_step_through_its_instance():
    class Trainer:
        def __init__(self):
            self.lr = 0.5

        @autoflat.step
        def update(self, w, x):
            return w - self.lr * x

    t = Trainer()
    w = t.update(jnp.ones(2), jnp.ones(2))
    p = autoflat.profile(t.update, w, jnp.ones(2), calls=3)
    assert p.step == "test_a_method_step_through_its_instance.<locals>.Trainer.update"
    np.testing.assert_allclose(np.asarray(w), 0.5)


def test_not_a_step_and_bad_calls_are_errors():
    with pytest.raises(autoflat.CallError, match="autoflat.profile expected a function"):
        autoflat.profile(lambda x: x, jnp.ones(2))

    @autoflat.step
    def f(w):
        return w + 1

    with pytest.raises(ValueError, match="calls must be a positive int"):
        autoflat.profile(f, jnp.ones(2), calls=0)
