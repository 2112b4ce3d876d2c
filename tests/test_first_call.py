"""A first call traces the step as often as `jax.jit` does: once, where the roles the source
and the arguments' types give are the roles the call settles on.

The role inference of a first call may evaluate one step abstractly (a container that could be
state returned under another name, a per-step container whose slice a return could be). That
evaluation comes from the trace of the program the call runs, which JAX then reuses for the
launch; where the inference settles otherwise, that trace is dropped and the call runs as it
would have. Counted here: how often the step's body runs in Python (once per trace or
abstract evaluation), and `autoflat.stats(step).traces`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import tree_allclose

import autoflat

tx = optax.adam(1e-2)
RUNS = {"body": 0}


def mlp_loss(params, batch):
    x, y = batch
    for layer in params[:-1]:
        x = jnp.tanh(x @ layer["w"] + layer["b"])
    x = x @ params[-1]["w"] + params[-1]["b"]
    return jnp.mean((x - y) ** 2)


def update(params, opt_state, batch):
    RUNS["body"] += 1
    loss, grads = jax.value_and_grad(mlp_loss)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, opt_state, loss


def mlp(width=4, layers=3):
    keys = jax.random.split(jax.random.key(0), layers)
    return [
        {"w": jax.random.normal(k, (width, width)) / width, "b": jnp.zeros(width)} for k in keys
    ]


def batch_of(steps=None):
    x, y = jnp.ones((8, 4)), jnp.zeros((8, 4))
    if steps is None:
        return x, y
    return jnp.stack([x] * steps), jnp.stack([y] * steps)


def reference(params, opt_state, batches):
    """`jax.jit(update)`, one call a step."""
    step = jax.jit(update)
    losses = []
    for b in batches:
        params, opt_state, loss = step(params, opt_state, b)
        losses.append(loss)
    return params, opt_state, losses


@pytest.mark.parametrize("num_steps", [1, 3])
def test_a_container_batch_traces_the_step_once(num_steps):
    """The batch is a tuple: at one step a call a state candidate, at three a per-step
    container that a return could give a slice of. Both ask for one step's abstract value;
    the first call's trace gives it."""
    params = mlp()
    opt_state = tx.init(params)
    step = autoflat.step(update, num_steps=num_steps)
    batch = batch_of(None if num_steps == 1 else num_steps)
    RUNS["body"] = 0
    p, o, loss = step(params, opt_state, batch)
    assert RUNS["body"] == 1
    assert autoflat.stats(step).traces == 1
    p, o, loss = step(p, o, batch)
    assert RUNS["body"] == 1 and autoflat.stats(step).traces == 1
    header = autoflat.show(step).splitlines()
    assert "# batch: scanned (per-step input) [rule: as-passed]" in header or any(
        line.startswith("# batch: scanned (per-step: leading axis 3") for line in header
    )
    batches = [batch] * 2 if num_steps == 1 else [batch_of()] * (2 * num_steps)
    ref_p, ref_o, ref_losses = reference(params, opt_state, batches)
    tree_allclose(p, ref_p)
    tree_allclose(o, ref_o)


def sgd_renamed(params, batch):
    RUNS["body"] += 1
    grads = jax.grad(mlp_loss)(params, batch)
    new_params = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
    return new_params, mlp_loss(params, batch)


def test_state_returned_under_another_name_drops_the_trial():
    """`params` comes back as `new_params`: matched by value, it is state, where the trial
    took it as a per-step input. The trial's trace is dropped, not counted, and `show()`
    gives the program that runs."""
    params = mlp()
    step = autoflat.step(sgd_renamed)
    RUNS["body"] = 0
    new, loss = step(params, batch_of())
    assert RUNS["body"] == 2  # the trial (its value served the matching), then the program
    assert autoflat.stats(step).traces == 1
    assert "# params: state (matched by value" in autoflat.show(step)
    assert len(step.programs) == 1 + (step.programs[0].roles.of("state") == ())
    assert all(p.roles.of("state") == ("params",) for p in step.programs[1:])
    new, loss = step(new, batch_of())
    assert autoflat.stats(step).traces == 1
    expected = params
    for _ in range(2):
        expected, ref_loss = jax.jit(sgd_renamed)(expected, batch_of())
    tree_allclose(new, expected)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)


def count_up(state, batch):
    RUNS["body"] += 1
    x, _ = batch
    state = {"w": state["w"] + x.sum(), "step": state["step"] + 1}
    return state, state["w"]


def test_a_python_counter_in_state_drops_the_trial():
    """A Python int in state that the step counts up is made an array before the call, so
    the program that runs takes another structure than the trial's: one trace counted."""
    step = autoflat.step(count_up)
    RUNS["body"] = 0
    state, w = step({"w": jnp.zeros(()), "step": 0}, batch_of())
    assert autoflat.stats(step).traces == 1
    state, w = step(state, batch_of())
    assert autoflat.stats(step).traces == 1
    assert int(autoflat.unwrap(state)["step"]) == 2
    np.testing.assert_allclose(w, 64.0)


def test_the_trial_is_not_made_for_handles_and_roles_stay():
    """A step's first call with another step's handles: no trial (its spec is the call
    path's); the roles are those the inference finds."""
    params = mlp()
    opt_state = tx.init(params)
    first = autoflat.step(update)
    p, o, _ = first(params, opt_state, batch_of())
    second = autoflat.step(update)
    RUNS["body"] = 0
    p2, o2, _ = second(p, o, batch_of())
    assert RUNS["body"] == 2  # an abstract evaluation, then the program
    assert autoflat.stats(second).traces == 1
    assert "# batch: scanned (per-step input) [rule: as-passed]" in autoflat.show(second)


def broken_in_a_scan(params, batch):
    RUNS["body"] += 1
    x, _ = batch
    params = {"w": params["w"] + x.sum(), "extra": x.sum()}  # a new key: no carry
    return params, x.sum()


def test_a_trial_that_fails_leaves_the_error_to_the_call():
    """A step whose state changes structure cannot run as a scan: the trial's trace raises,
    the inference evaluates the step itself, and the call raises the error it always did."""
    step = autoflat.step(broken_in_a_scan, num_steps=2)
    with pytest.raises(autoflat.ShapeError, match="params"):
        step({"w": jnp.zeros(())}, batch_of(2))
    assert autoflat.stats(step).traces == 1
