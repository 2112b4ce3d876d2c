# Upstream: patrick-kidger/equinox, docs/examples/frozen_layer.ipynb
# (snapshot commit 9336d820b2ef66b360fc6cb3611b3da5cefbb14d).
# Upstream's license: Apache-2.0; copied here with this attribution.
# Copied verbatim: get_data, dataloader, and `make_step(model, x, y, opt_state)` (the loss
# under `@eqx.filter_grad` on the `eqx.partition(model, filter_spec)` half, `eqx.combine`
# inside, `optax.sgd`), which upstream defines inside `main` (its closure values `filter_spec`
# and `optim` are module globals here) and decorates with `@eqx.filter_jit` (the test applies
# it); the filter_spec (`eqx.tree_at` on the last layer) and the final check of which layers
# moved.
# Shrunk: dataset_size 10000 -> 96, batch_size 256 -> 8 (width_size 8, depth 1 unchanged).
# fmt: off
"""Equinox frozen layer: only the last layer trained, via `eqx.partition`/`eqx.combine`."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jrandom
import jax.tree_util as jtu
import optax  # https://github.com/deepmind/optax

from corpus._harness import N_STEPS, Result, calls, real


# Toy data
def get_data(dataset_size, *, key):
    x = jrandom.normal(key, (dataset_size, 1))
    y = 5 * x - 2
    return x, y


# Toy dataloader
def dataloader(arrays, batch_size, *, key):
    dataset_size = arrays[0].shape[0]
    assert all(array.shape[0] == dataset_size for array in arrays)
    indices = jnp.arange(dataset_size)
    while True:
        perm = jrandom.permutation(key, indices)
        (key,) = jrandom.split(key, 1)
        start = 0
        end = batch_size
        while end < dataset_size:
            batch_perm = perm[start:end]
            yield tuple(array[batch_perm] for array in arrays)
            start = end
            end = start + batch_size


dataset_size=96
batch_size=8
learning_rate=3e-3
width_size=8
depth=1
seed=5678

data_key, loader_key, model_key = jrandom.split(jrandom.PRNGKey(seed), 3)

# Step 1
model = eqx.nn.MLP(
    in_size=1, out_size=1, width_size=width_size, depth=depth, key=model_key
)

# Step 2
filter_spec = jtu.tree_map(lambda _: False, model)
filter_spec = eqx.tree_at(
    lambda tree: (tree.layers[-1].weight, tree.layers[-1].bias),
    filter_spec,
    replace=(True, True),
)

# Step 3
def make_step(model, x, y, opt_state):
    @eqx.filter_grad
    def loss(diff_model, static_model, x, y):
        model = eqx.combine(diff_model, static_model)
        pred_y = jax.vmap(model)(x)
        return jnp.mean((y - pred_y) ** 2)

    diff_model, static_model = eqx.partition(model, filter_spec)
    grads = loss(diff_model, static_model, x, y)
    updates, opt_state = optim.update(grads, opt_state)
    model = eqx.apply_updates(model, updates)
    return model, opt_state

optim = optax.sgd(learning_rate)


# ---- corpus harness (not upstream) ----
data = get_data(dataset_size, key=data_key)
_data_iter = dataloader(data, batch_size, key=loader_key)
BATCHES = [next(_data_iter) for _ in range(N_STEPS)]


def run(make_step, chunk=None):
    """Upstream's loop (`model, opt_state = make_step(model, x, y, opt_state)` from
    `opt_state = optim.init(model)`), then its check: the first layer as at initialisation,
    the last one moved."""
    original_model = model
    m = model
    opt_state = optim.init(m)
    for x, y in calls(BATCHES, chunk):
        m, opt_state = make_step(m, x, y, opt_state)
    m = real(m)
    first_unchanged = all(
        bool((a == b).all())
        for a, b in zip(jtu.tree_leaves(original_model.layers[0]), jtu.tree_leaves(m.layers[0]),
                        strict=True)
    )
    last_moved = not all(
        bool((a == b).all())
        for a, b in zip(jtu.tree_leaves(original_model.layers[-1]), jtu.tree_leaves(m.layers[-1]),
                        strict=True)
    )
    assert first_unchanged and last_moved
    return Result((eqx.filter(m, eqx.is_array), opt_state), None, jax.vmap(m)(data[0][:8]))
