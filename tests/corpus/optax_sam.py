# Upstream: google-deepmind/optax, examples/contrib/sam.ipynb
# (snapshot commit 2edbcbe2390da13983b92cbef94ac0460ecde1c5).
# Upstream's license: Apache-2.0; copied here with this attribution.
# Copied verbatim: the 2-D loss, the SAM optimizers (`contrib.sam` over sgd, momentum and adam,
# with their baselines), the `Store(NamedTuple)` with a Python int `step: int = 0`, and
# `make_step(opt)`, whose inner `step(store)` returns `store._replace(params=..., state=...,
# step=store.step+1), value` (decorated `@jax.jit` upstream inside make_step: here make_step
# returns the undecorated `step` and the test applies the decorator).
# Shrunk: T = 8000 -> 8 steps (nothing else to shrink: 2 parameters, no data).
# ruff: noqa: E111, E114, E731, E741
# fmt: off
"""optax SAM: one NamedTuple of state with a Python int counter, no per-step input at all."""

from typing import NamedTuple

import jax
import jax.numpy as np
import optax
from optax import contrib

from corpus._harness import N_STEPS, Result, collect

lr = 0.01
rho = 0.1
opt = optax.sgd(lr)
adv_opt = optax.chain(contrib.normalize(), optax.sgd(rho))
sam_opt = contrib.sam(opt, adv_opt, sync_period=2)  # This is the drop-in SAM optimizer.
sgd_opt = optax.sgd(lr)  # Baseline SGD optimizer

def sam_mom(lr=1e-3, momentum=0.1, rho=0.1, sync_period=2):
  opt = optax.sgd(lr, momentum=momentum)
  adv_opt = optax.chain(contrib.normalize(), optax.sgd(rho))
  return contrib.sam(opt, adv_opt, sync_period=sync_period)
mom = 0.9
sam_mom_opt = sam_mom(lr, momentum=mom)
mom_opt = optax.sgd(lr, momentum=mom)

def sam_adam(lr=1e-3, b1=0.9, b2=0.999, rho=0.03, sync_period=5):
  """A SAM optimizer using Adam for the outer optimizer."""
  opt = optax.adam(lr, b1=b1, b2=b2)
  adv_opt = optax.chain(contrib.normalize(), optax.adam(rho))
  return contrib.sam(opt, adv_opt, sync_period=sync_period)
sam_adam_opt = sam_adam(lr)
adam_opt = optax.adam(lr)

# An example 2D loss function. It has two minima at (0,0) and (2,0).
# Both points attain almost zero loss value, but the first one is much sharper.
def loss(params):
  x, y = params
  return -np.exp(-(x - 2)**2 - y**2) - 1.0*np.exp(-((x)**2 + (y)**2*100))

params = np.array([-0.4, -0.4])
class Store(NamedTuple):
  params: jax.typing.ArrayLike
  state: optax.OptState
  step: int = 0

def make_step(opt):
  def step(store):
    value, grads = jax.value_and_grad(loss)(store.params)
    updates, state = opt.update(grads, store.state, store.params)
    params = optax.apply_updates(store.params, updates)
    return store._replace(
        params=params,
        state=state,
        step=store.step+1), value
  return step


# ---- corpus harness (not upstream) ----
OPTIMIZERS = {"sam": sam_opt, "sgd": sgd_opt, "sam_mom": sam_mom_opt, "mom": mom_opt,
              "sam_adam": sam_adam_opt, "adam": adam_opt}


def run(decorate, chunk=None):
    """Upstream's loop over its six optimizers: `sam_store, sam_val = sam_step(sam_store)`
    and so on, T steps each; `decorate` is applied to each `make_step(opt)` (upstream:
    `jax.jit`). With `chunk`, each call makes `chunk` steps (there is no input to stack)."""
    stores = {name: Store(params=params, state=o.init(params)) for name, o in OPTIMIZERS.items()}
    steps = {name: decorate(make_step(o)) for name, o in OPTIMIZERS.items()}
    vals = {name: [] for name in OPTIMIZERS}
    for _ in range(N_STEPS // (chunk or 1)):
        for name in OPTIMIZERS:
            stores[name], val = steps[name](stores[name])
            vals[name].append(val)
    final = {name: (s.params, s.state, s.step) for name, s in stores.items()}
    per_step = {name: collect(v, chunk) for name, v in vals.items()}
    return Result(final, per_step, {name: loss(s.params) for name, s in stores.items()})
