"""The packed transport's model zoo: is `pack="auto"` ever slower than one buffer per leaf?

    python benchmarks/bench_zoo.py [--quick] [--models abcde] [--repeats N] [--out DIR]

Five models, each trained with Adam by `@autoflat.step(num_steps=k, pack=...)` for k in 1 and
10 and pack in False (one buffer per leaf), "auto" and, with `--packed`, True:

a. the narrow ResNet50-structured Equinox model of `models.py` (161 arrays, 484 with Adam);
b. a tiny MLP of 50 layers of 4x4 weights and biases (301 state arrays with Adam);
c. a wide MLP of 8.5M parameters (two 2048x2048 layers; 25 state arrays with Adam);
d. a small transformer as a dict of arrays: token and position embeddings, 6 pre-norm blocks
   (LayerNorm scales and biases, attention and MLP weights with biases), a final LayerNorm
   and a head (78 parameter arrays, 235 with Adam);
e. the Flax NNX narrow ResNet50 of `nnx_models.py` with `nnx.Optimizer`, mutation style (the
   caller's model and optimizer passed every call and updated in place, as with `nnx.jit`).

Reported per (model, k, pack): the median time per step over round-robin blocks (calls back
to back, one `block_until_ready` per block: `harness.time_methods`), its spread, and the
ratio to pack=False; and per (model, pack) the first call at num_steps=1 (trace, compile and
one step, from a fresh step after clearing JAX's and autoflat's caches:
`harness.time_compiles`), median of the repeats. Before timing, every method runs the same
2k steps from the same state and must agree with pack=False (`harness.agree`).

Writes `zoo.md` and `zoo.json` to `--out` (default benchmarks/results).

`--first-call` instead compares first calls with `jax.jit`'s, each in a fresh process, at the
defaults (`bench_first_call.py`: one step a call against `jax.jit` of the step, ten against
`jax.jit` of a hand-written `lax.scan`), and writes `first_call.md` and `first_call.json`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `benchmarks`, this autoflat

import autoflat  # noqa: E402
from benchmarks import bench_first_call, bench_transport, harness, models, nnx_models  # noqa: E402
from benchmarks.harness import Method, Plan  # noqa: E402

# ==========================================================================================
# d. a small transformer (plain dict of arrays)
# ==========================================================================================

VOCAB, D, LAYERS, FF, SEQ, HEADS = 64, 32, 6, 64, 16, 4


def transformer_params(key: jax.Array) -> dict[str, Any]:
    def normal(k: jax.Array, shape: tuple[int, ...], scale: float) -> jax.Array:
        return jax.random.normal(k, shape) * scale

    keys = iter(jax.random.split(key, 8 * LAYERS + 8))
    layers = [
        {
            "ln1_scale": jnp.ones(D),
            "ln1_bias": jnp.zeros(D),
            "wqkv": normal(next(keys), (D, 3 * D), D**-0.5),
            "bqkv": jnp.zeros(3 * D),
            "wo": normal(next(keys), (D, D), D**-0.5),
            "bo": jnp.zeros(D),
            "ln2_scale": jnp.ones(D),
            "ln2_bias": jnp.zeros(D),
            "w1": normal(next(keys), (D, FF), D**-0.5),
            "b1": jnp.zeros(FF),
            "w2": normal(next(keys), (FF, D), FF**-0.5),
            "b2": jnp.zeros(D),
        }
        for _ in range(LAYERS)
    ]
    return {
        "embed": normal(next(keys), (VOCAB, D), 0.02),
        "pos": normal(next(keys), (SEQ, D), 0.02),
        "layers": layers,
        "lnf_scale": jnp.ones(D),
        "lnf_bias": jnp.zeros(D),
        "head": normal(next(keys), (D, VOCAB), D**-0.5),
        "head_bias": jnp.zeros(VOCAB),
    }


def _layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array) -> jax.Array:
    mean = x.mean(-1, keepdims=True)
    var = x.var(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * scale + bias


def transformer_loss(params: dict[str, Any], tokens: jax.Array) -> jax.Array:
    """Next-token cross entropy of a causal pre-norm transformer on `tokens` (batch, SEQ)."""
    x = params["embed"][tokens] + params["pos"]
    b, t, _ = x.shape
    mask = jnp.tril(jnp.ones((t, t), bool))
    for p in params["layers"]:
        h = _layer_norm(x, p["ln1_scale"], p["ln1_bias"])
        q, k, v = jnp.split(h @ p["wqkv"] + p["bqkv"], 3, axis=-1)
        q, k, v = (a.reshape(b, t, HEADS, D // HEADS) for a in (q, k, v))
        att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D // HEADS)
        att = jax.nn.softmax(jnp.where(mask, att, -1e9), axis=-1)
        y = jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, t, D)
        x = x + y @ p["wo"] + p["bo"]
        h = _layer_norm(x, p["ln2_scale"], p["ln2_bias"])
        x = x + jax.nn.gelu(h @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]
    x = _layer_norm(x, params["lnf_scale"], params["lnf_bias"])
    logits = x[:, :-1] @ params["head"] + params["head_bias"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def transformer_case(quick: bool) -> tuple[Any, Any, Any]:
    params = transformer_params(jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (8, SEQ), 0, VOCAB)
    return params, tokens, transformer_loss


# ==========================================================================================
# e. the Flax NNX model, mutation style
# ==========================================================================================


def nnx_methods(s: nnx_models.Setup, k: int, packs: tuple[Any, ...]) -> list[Method]:
    """`autoflat.step(train_step, num_steps=k, pack=...)` called with the caller's model and
    optimizer every time, one per pack."""
    out = []
    for pack in packs:

        def make(pack: Any = pack) -> Plan:
            model, optimizer = s.fresh()
            step = lambda: autoflat.step(nnx_models.train_step, num_steps=k, pack=pack)  # noqa: E731
            return Plan(step, fixed=(model, optimizer))

        out.append(Method(str(pack), f"pack={pack}", make, steps_per_call=k))
    return out


# ==========================================================================================
# Runs
# ==========================================================================================

CASES = {
    "a": ("narrow ResNet50 (Equinox)", bench_transport.resnet_case),
    "b": ("tiny MLP, 50 layers of 4x4", bench_transport.tiny_mlp_case),
    "c": ("wide MLP, 8.5M parameters", bench_transport.wide_mlp_case),
    "d": ("small transformer (dict of arrays)", transformer_case),
    "e": ("narrow ResNet50 (Flax NNX, mutation style)", None),
}


def _state_arrays(case: Any) -> tuple[int, int]:
    model = case[0]
    opt_state = models.tx.init(eqx.filter(model, eqx.is_array))
    arrays = len(jax.tree.leaves(eqx.filter((model, opt_state), eqx.is_array)))
    params = sum(x.size for x in jax.tree.leaves(eqx.filter(model, eqx.is_array)))
    return arrays, int(params)


def methods_for(key: str, k: int, packs: tuple[Any, ...], quick: bool) -> tuple[Any, ...]:
    """(methods, one step's args, the check batches, state arrays, parameters)."""
    if key == "e":
        s = nnx_models.Setup(width=2, batch_size=4, image_size=16, batchnorm=False)
        model, optimizer = s.fresh()
        counts = nnx_models.count_leaves(model, optimizer)
        n_params = sum(x.size for x in jax.tree.leaves(nnx_models.nnx.state(model)))
        return nnx_methods(s, k, packs), s.args, s.checks, counts["arrays"], int(n_params)
    case = CASES[key][1](quick)
    arrays, n_params = _state_arrays(case)
    batch = case[1]
    checks = [(batch,)] * harness.CHECK_STEPS
    return bench_transport.pack_methods(case, k, packs), (batch,), checks, arrays, n_params


def run_model(key: str, packs: tuple[Any, ...], repeats: int, quick: bool) -> dict[str, Any]:
    name = CASES[key][0]
    harness.log(f"running {key}. {name} ...")
    rows, compiles = [], []
    for k in (1, 10):
        methods, args, checks, arrays, n_params = methods_for(key, k, packs, quick)
        n_check = 2 * k
        batches = [checks[i % len(checks)] for i in range(n_check)]
        harness.first_calls(methods, args, batches)
        harness.agree(methods, n_check)
        block_s = 0.1 if quick else 0.3
        harness.time_methods(methods, repeats, block_s, title=f"{key}, num_steps={k}")
        base = np.median(methods[0].totals) if methods[0].totals else float("nan")
        for m in methods:
            row: dict[str, Any] = {
                "model": f"{key}. {name}",
                "arrays": arrays,
                "params": n_params,
                "num_steps": k,
                "pack": m.key,
            }
            if m.error is not None or not m.totals:
                row["error"] = m.error or "not timed"
            else:
                step = float(np.median(m.totals))
                row |= {
                    "us_per_step": step * 1e6,
                    "min": min(m.totals) * 1e6,
                    "max": max(m.totals) * 1e6,
                    "vs_flat": step / base,
                    "buffers": _buffers(m),
                    "repeats_us": [t * 1e6 for t in m.totals],
                }
            rows.append(row)
    # first calls at num_steps=1, each from a fresh step and cleared caches
    by_key = {str(p): p for p in packs}

    def method(pack_key: str) -> Method:
        return methods_for(key, 1, (by_key[pack_key],), quick)[0][0]

    args1 = methods_for(key, 1, (False,), quick)[1]
    found = harness.time_compiles(method, list(by_key), max(2, repeats // 3), args1)
    flat = next(r for r in found if r["key"] == "False")
    for r in found:
        c: dict[str, Any] = {"model": f"{key}. {name}", "pack": r["key"]}
        if "error" in r:
            c["error"] = r["error"]
        else:
            c |= {
                "first_call_s": r["first_call_s"]["median"],
                "min_s": r["first_call_s"]["min"],
                "max_s": r["first_call_s"]["max"],
                "vs_flat": r["first_call_s"]["median"] / flat["first_call_s"]["median"],
            }
        compiles.append(c)
    return {"rows": rows, "compiles": compiles}


def _buffers(m: Method) -> int | None:
    """State buffers a call passes (the packed ones where packed); None in mutation style."""
    return len(harness.device_buffers(m.state)) if m.state else None


def render(results: list[dict[str, Any]], env: list[str], command: str) -> str:
    f = harness.fmt
    lines = ["# Packed transport: the model zoo", "", f"`{command}`", "", *env, ""]
    header = ["model", "arrays", "num_steps", "pack", "buffers", "µs/step (median)", "spread"]
    header += ["× flat"]
    body = []
    for res in results:
        for r in res["rows"]:
            if "error" in r:
                body.append([r["model"], str(r["arrays"]), str(r["num_steps"]), r["pack"]])
                body[-1] += ["", "failed", "", ""]
                continue
            body.append(
                [r["model"], str(r["arrays"]), str(r["num_steps"]), r["pack"]]
                + ["–" if r["buffers"] is None else str(r["buffers"]), f(r["us_per_step"])]
                + [f"{f(r['min'])}–{f(r['max'])}", f"{r['vs_flat']:.2f}"]
            )
    lines += harness.table(header, "lrrlrrrr", body)
    lines += ["", "First call at num_steps=1 (trace, compile, one step), seconds:", ""]
    header = ["model", "pack", "first call s (median)", "spread", "× flat"]
    body = []
    for res in results:
        for c in res["compiles"]:
            if "error" in c:
                body.append([c["model"], c["pack"], "failed", "", ""])
                continue
            body.append(
                [c["model"], c["pack"], f"{c['first_call_s']:.2f}"]
                + [f"{c['min_s']:.2f}–{c['max_s']:.2f}", f"{c['vs_flat']:.2f}"]
            )
    lines += harness.table(header, "llrrr", body)
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = harness.parser(__doc__.splitlines()[0])
    ap.add_argument("--models", default="abcde", help="which of the models a-e (default: all)")
    ap.add_argument("--packed", action="store_true", help="also pack=True")
    ap.add_argument("--out", default=str(harness.ROOT / "benchmarks" / "results"))
    ap.add_argument(
        "--first-call", action="store_true", help="first calls against jax.jit's (see above)"
    )
    bench_first_call.parser(ap)
    args = ap.parse_args()
    if args.first_call:
        bench_first_call.run(args, "benchmarks/bench_zoo.py")
        return
    repeats = args.repeats or (5 if args.quick else 9)
    machine, versions = harness.machine(), harness.versions()
    harness.log("\n".join(harness.environment_lines(machine, versions)))
    packs: tuple[Any, ...] = (False, "auto", True) if args.packed else (False, "auto")
    results = [run_model(key, packs, repeats, args.quick) for key in args.models]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = harness.environment_lines(machine, versions, end_load=os.getloadavg())
    command = harness.command("benchmarks/bench_zoo.py", sys.argv[1:])
    text = render(results, env, command.strip())
    (out / "zoo.md").write_text(text)
    harness.write_json({"environment": env, "results": results}, out / "zoo.json")
    print(text)


if __name__ == "__main__":
    main()
