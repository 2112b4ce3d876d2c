"""`autoflat.profile` against a plain loop: the narrow ResNet50 with Adam at one and ten steps
a call (Equinox; with `--nnx` also Flax NNX's mutation-style step), its report, and the time a
step takes in a plain training loop of the same calls.

    python benchmarks/bench_profile.py [--calls N] [--nnx]

The profile's device time and its "in a loop" figure should agree with the plain loop where
the step is device-bound (a figure to read, not a test: benchmarks/results/tpu/profile.txt
holds a TPU run).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import autoflat  # noqa: E402
from benchmarks import models  # noqa: E402


def _stacked(batch: tuple[Any, ...], k: int) -> tuple[Any, ...]:
    return batch if k == 1 else jax.tree.map(lambda a: jnp.stack([a] * k), batch)


def _equinox(k: int) -> tuple[Any, tuple[Any, ...], bool]:
    setup = models.Setup(2, 8, 16)
    step = autoflat.step(models.update, num_steps=k)
    return step, (*setup.fresh(), *_stacked(setup.args, k)), True


def _nnx(k: int) -> tuple[Any, tuple[Any, ...], bool]:
    from benchmarks import nnx_models

    setup = nnx_models.Setup(2, 8, 16, batchnorm=False)
    step = autoflat.step(nnx_models.train_step, num_steps=k)
    return step, (*setup.fresh(), *_stacked(setup.args, k)), False


def compare(name: str, make: Any, k: int, calls: int) -> None:
    """The profile of one step, then a plain loop of its calls (state fed back where the
    step returns it; else written back into the arguments)."""
    step, args, returns_state = make(k)
    jax.block_until_ready(step(*args))
    print(f"--- {name}, num_steps={k}\n{autoflat.profile(step, *args, calls=calls)}")
    per_step = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            out = step(*args)
            if returns_state:
                args, out = (*out[:2], *args[2:]), out[-1]
        jax.block_until_ready(out)  # the loss (the handles stay unbuilt)
        per_step.append((time.perf_counter() - t0) / (calls * k) * 1e6)
    print(
        f"plain loop: {statistics.median(per_step):.1f} us a step "
        f"({min(per_step):.1f}-{max(per_step):.1f}, 5 loops of {calls} calls)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--nnx", action="store_true", help="also the Flax NNX mutation step")
    args = parser.parse_args()
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}")
    for k in (1, 10):
        compare("Equinox", _equinox, k, args.calls)
    for k in (1, 10) if args.nnx else ():
        compare("Flax NNX, mutation style", _nnx, k, args.calls)


if __name__ == "__main__":
    main()
