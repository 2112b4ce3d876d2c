"""`autoflat.profile` against a plain loop: the narrow ResNet50 with Adam at one and ten steps
a call, its report, and the time a step takes in a plain training loop of the same calls.

    python benchmarks/bench_profile.py [--calls N]

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

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import autoflat  # noqa: E402
from benchmarks import models  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=30)
    args = parser.parse_args()
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}")
    setup = models.Setup(2, 8, 16)
    for k in (1, 10):
        step = autoflat.step(models.update, num_steps=k)
        model, opt = setup.fresh()
        xs = setup.args[0]
        if k > 1:
            xs = jax.tree.map(lambda a, k=k: jnp.stack([a] * k), xs)
        model, opt, loss = step(model, opt, xs)
        jax.block_until_ready(loss)
        print(f"--- num_steps={k}\n{autoflat.profile(step, model, opt, xs, calls=args.calls)}")
        per_step = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(args.calls):
                model, opt, loss = step(model, opt, xs)
            jax.block_until_ready(loss)
            per_step.append((time.perf_counter() - t0) / (args.calls * k) * 1e6)
        print(
            f"plain loop: {statistics.median(per_step):.1f} us a step "
            f"({min(per_step):.1f}-{max(per_step):.1f}, 5 loops of {args.calls} calls)"
        )


if __name__ == "__main__":
    main()
