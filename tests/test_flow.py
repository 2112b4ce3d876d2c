"""One step's data flow (`autoflat._roles.flow.flows`), read off its jaxpr: what each return
position is computed from, through while loops, conds and reductions."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from autoflat._roles.flow import flows


def _flows(fn, **values):
    params = tuple(values)
    return flows(fn, params, values, dict.fromkeys(params, "broadcast"), 1, list)


def test_a_while_loop_s_carry_is_followed_through_its_body():
    """A loop's outputs are computed from what its carry starts from and what the body and
    the condition read, not from every input of the loop."""

    def f(a, b, c):
        t, s = jax.lax.while_loop(
            lambda carry: carry[0] < b, lambda carry: (carry[0] + 1.0, carry[1] * c), (0.0, a)
        )
        u, _ = jax.lax.while_loop(
            lambda carry: carry[1] < 3, lambda carry: (carry[0] * 2.0, carry[1] + 1), (c, 0)
        )
        return t, s, u

    t, s, u = _flows(f, a=jnp.float32(1), b=jnp.float32(3), c=jnp.float32(2))
    assert t.sources == {"b"}  # the count: from the condition's bound alone
    assert s.sources == {"a", "b", "c"}
    assert u.sources == {"c"}
    assert t.owners == s.owners == (None,)


def test_a_cond_s_outputs_come_from_its_index_and_their_own_branches():
    def f(p, a, b):
        return jax.lax.cond(p > 0, lambda: (a, jnp.float32(0)), lambda: (a * 2, b))

    first, second = _flows(
        lambda p, a, b: list(f(p, a, b)), p=jnp.float32(1), a=jnp.ones(2), b=jnp.float32(0)
    )
    assert first.sources == {"p", "a"}
    assert second.sources == {"p", "b"}


def test_a_reduction_drops_what_was_spread_over_what_it_reduces():
    """`smooth`: a value computed from a parameter other than only through a reduction of
    arrays the parameter was spread over (`x - mu`); stacked with others, it stays."""

    def f(mu, x, best, loss):
        return jnp.mean(x - mu), jnp.min(jnp.stack([best, loss])), jnp.sum(mu * x), mu + 1.0

    normalised, stacked, weighted, shifted = _flows(
        f, mu=jnp.float32(0), x=jnp.ones(3), best=jnp.float32(9), loss=jnp.float32(1)
    )
    assert normalised.sources == {"mu", "x"} and normalised.smooth == ({"x"},)
    assert stacked.smooth == ({"best", "loss"},)
    assert weighted.smooth == ({"x"},)
    assert shifted.smooth == ({"mu"},) and shifted.direct == {"mu"}


def test_an_operation_takes_a_parameter_times_a_constant_as_its_own_leaf():
    """`direct`: `0.9 * m + 0.1 * g` (an average, as Adam keeps its moments) takes `m`'s own
    leaf, as `m + g` does; a product with another parameter (`b * m`) or a reciprocal
    (`2 / m`) is no multiple of `m`."""
    beta = jnp.float32(0.9)  # (a constant the step closes over)

    def f(m, v, b, g):
        loss = jnp.sum(g * g)
        return [0.9 * m + 0.1 * loss, beta * (-v / 2) + loss, b * m + loss, 2.0 / m + loss, v - g]

    ema, scaled, by_param, reciprocal, plain = _flows(
        f, m=jnp.ones(2), v=jnp.ones(2), b=jnp.float32(0.9), g=jnp.ones(2)
    )
    assert ema.direct == {"m"}
    assert scaled.direct == {"v"}
    assert by_param.direct == reciprocal.direct == frozenset()
    assert plain.direct == {"v", "g"}
    assert ema.owners == (None,)  # (a multiple is computed from `m`, not `m` given back)


def test_a_sum_s_weights_are_a_parameter_s_leaf_times_a_value_computed_from_others():
    """`weighted`: `alpha * kd` in a sum, `loss / scale`, through a mean; not `0.9 * ema`,
    a leaf times a select between constants, nor a leaf normalised by a sum taking it."""

    def f(alpha, ema, scale, x):
        kd = jnp.mean(x**2)
        finite = jnp.isfinite(kd)
        return [
            alpha * kd + (1 - alpha) * jnp.mean(x),
            jnp.mean(x / scale),
            0.9 * ema + 0.1 * kd,
            scale * jnp.where(finite, 2.0, 0.5),
            ema / (ema + kd),
        ]

    weighed, over, average, stepped, normalised = _flows(
        f, alpha=jnp.float32(0.5), ema=jnp.float32(0), scale=jnp.float32(2), x=jnp.ones(3)
    )
    assert ("alpha", frozenset({"x"})) in {(w.param, w.by) for w in weighed.weighted[0]}
    assert [{w.param for w in ws} for ws in over.weighted] == [{"scale", "x"}]  # (each)
    assert average.weighted == stepped.weighted == normalised.weighted == (frozenset(),)
    assert stepped.direct == {"scale"}  # (a leaf times constants the data picks between)


def test_a_callback_that_returns_nothing_is_no_part_of_the_flow():
    """`jax.debug.print` in a step (an operation with no outputs), read when state is matched
    by value at num_steps > 1, as in the README's step: it runs, in order, once a step."""
    import optax

    import autoflat

    def train_step(params, opt_state, batch):
        def loss_fn(p):
            return jnp.mean((batch["x"] @ p["w"] - batch["y"]) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        jax.debug.print("loss {l}", l=loss)
        jax.lax.cond(loss > 0, lambda: jax.debug.callback(seen.append, loss), lambda: None)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    (z,) = _flows(lambda x: (jax.debug.print("{x}", x=x), x + 1.0)[1:], x=jnp.float32(1))
    assert z.sources == {"x"}
    tx = optax.adam(0.1)
    params = {"w": jnp.ones((3, 2))}
    xs = jnp.arange(24.0).reshape(4, 2, 3) / 10
    batches = {"x": xs, "y": jnp.ones((4, 2, 2))}
    seen: list = []
    ref, ref_opt, ref_losses = params, tx.init(params), []
    jitted = jax.jit(train_step)
    for i in range(4):
        ref, ref_opt, loss = jitted(ref, ref_opt, jax.tree.map(lambda b, i=i: b[i], batches))
        ref_losses.append(float(loss))
    jax.effects_barrier()
    assert [float(v) for v in seen] == ref_losses
    seen.clear()
    step = autoflat.step(train_step, num_steps=4)
    p, o, losses = step(params, tx.init(params), batches)
    jax.effects_barrier()
    assert [float(v) for v in seen] == ref_losses
    assert losses.tolist() == ref_losses
    assert jax.tree.map(lambda a, b: bool((a == b).all()), autoflat.unwrap(p), ref) == {"w": True}


def test_a_sharding_constraint_of_an_update_still_takes_its_leaf():
    """`direct` looks through a sharding constraint (`eqx.filter_shard((p + u, ...))` takes
    `p` as `p + u` does), not through a cast or a reshape: a residual cast to bfloat16 is
    no update of what it subtracts."""
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    constrained, cast, reshaped = _flows(
        lambda p, u: (
            jax.lax.with_sharding_constraint(p + u, sharding),
            (p - u).astype(jnp.bfloat16),
            (p + u).reshape(-1),
        ),
        p=jnp.ones((2, 3)),
        u=jnp.ones((2, 3)),
    )
    assert constrained.direct == {"p", "u"}
    assert cast.direct == reshaped.direct == frozenset()
    assert constrained.owners == (None,)  # (computed, not `p` given back as it came)
