"""Doc claims of the Roles page (docs/roles.md): every behavioural sentence, with its evidence.

This file is the map from the page to the tests that back it. Each test carries
`@claim("docs/roles.md", "<a fragment of the sentence>")` for each sentence it backs (the
decorator fails the test when the page no longer says that text), and asserts what the
sentence says autoflat does: results equal to a plain `jax.jit` loop of the same function
(k calls, one slice of the per-step inputs each, for `num_steps=k`), the role, evidence and
rule `autoflat.show(step)` prints, the class and key words of an error, and trace counts from
`autoflat.stats(step)`. The sections follow the page: the roles, the rules table row by row,
the paragraphs under it, state by abstract value, state returned twice, per-step, broadcast
or static, Python numbers, what comes back, the patterns table row by row, and overrides.

A test marked `xfail(strict=True)` backs a sentence autoflat does not (yet) make true; its
reason says what happens instead.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import pathlib
import re
import typing
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import tree_allclose

import autoflat
from claims.claim import claim

PAGE = "docs/roles.md"
ROOT = pathlib.Path(__file__).resolve().parents[2]
K = 4


# --- helpers --------------------------------------------------------------------------------


def header(step) -> list[str]:
    """The `# name: ...` lines of `show()`'s header."""
    return [line for line in autoflat.show(step).splitlines() if line.startswith("# ")]


def role_line(step, name: str) -> str:
    """The header line of parameter `name`, without its `# name: ` prefix."""
    prefix = f"# {name}: "
    found = [line for line in header(step) if line.startswith(prefix)]
    assert len(found) == 1, (name, header(step))
    return found[0][len(prefix) :]


def data(n: int, *shape: int, seed: int = 0) -> jax.Array:
    """`n` steps of a float32 input of `shape`."""
    return jax.random.normal(jax.random.key(seed), (n, *shape), jnp.float32)


def jit_loop(fn, state: tuple, per_step: tuple, n: int, rest: tuple = ()):
    """`n` calls of `jax.jit(fn)`: the state is the first len(state) results, fed back; the
    per-step inputs sliced one step a call. Returns (state, the other results stacked)."""
    ref = jax.jit(fn)
    outs = []
    for i in range(n):
        result = ref(*state, *(jax.tree.map(lambda a: a[i], x) for x in per_step), *rest)
        result = result if isinstance(result, tuple) else (result,)
        state, out = tuple(result[: len(state)]), result[len(state) :]
        outs.append(out)
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *outs) if outs and outs[0] else ()
    return state, stacked


def step_loop(step, state: tuple, per_step: tuple, n: int, k: int, rest: tuple = ()):
    """`n` steps of an autoflat step, `k` a call (per-step inputs sliced into chunks of k; at
    k=1 one step's input as it is). Returns (state, the other results joined along steps)."""
    outs = []
    for start in range(0, n, k):
        cut = (lambda a: a[start : start + k]) if k > 1 else (lambda a: a[start])
        xs = [jax.tree.map(cut, x) for x in per_step]
        result = step(*state, *xs, *rest)
        result = result if isinstance(result, tuple) else (result,)
        state, out = tuple(result[: len(state)]), result[len(state) :]
        outs.append(out if k > 1 else jax.tree.map(lambda a: jnp.asarray(a)[None], out))
    joined = jax.tree.map(lambda *a: jnp.concatenate(a), *outs) if outs and outs[0] else ()
    return state, joined


def same_keys(a, b) -> None:
    np.testing.assert_array_equal(jax.random.key_data(a), jax.random.key_data(b))


# === The four roles =========================================================================


@claim(
    PAGE,
    "Every parameter of a step gets one role, and `autoflat.show(step)` prints each with the evidence for it",
)
def test_every_parameter_gets_one_role_with_its_evidence():
    def update(params, xs, full_batch, eos_id):
        params = {"w": params["w"] - 0.1 * (jnp.mean(xs) + jnp.mean(full_batch) + eos_id)}
        return params, jnp.sum(xs)

    step = autoflat.step(update, num_steps=K)
    step({"w": jnp.zeros(2)}, data(K, 3), jnp.ones((5, 2)), 1)
    lines = [
        line
        for line in header(step)
        if not line.startswith(("# autoflat", "# num_steps", "# returns"))
    ]
    names = [line[2:].split(":", 1)[0] for line in lines]
    assert names == ["params", "xs", "full_batch", "eos_id"]  # each parameter once
    for line in lines:
        role, rest = line.split(": ", 1)[1].split(" ", 1)
        assert role in {"state", "scanned", "broadcast", "static"}, line
        assert re.fullmatch(r"\(.+\) \[rule: [a-z-]+\]", rest), line  # evidence and rule
    assert role_line(step, "params").startswith("state (")
    assert role_line(step, "xs").startswith("scanned (")
    assert role_line(step, "full_batch").startswith("broadcast (")
    assert role_line(step, "eos_id").startswith("static (")


@claim(
    PAGE,
    "carried from step to step; crosses `jax.jit` as the leaves of a cached structure and comes back as a lazy handle",
)
def test_state_is_carried_and_comes_back_as_a_lazy_handle():
    tx = optax.adam(0.1)

    def update(params, opt_state, x):
        loss, g = jax.value_and_grad(lambda p: jnp.sum((p["w"] * x - 1.0) ** 2))(params)
        u, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, u), opt_state, loss

    p0 = {"w": jnp.zeros(3)}
    xs = data(8, 3)
    (rp, ro), rl = jit_loop(update, (p0, tx.init(p0)), (xs,), 8)
    step = autoflat.step(update, num_steps=K)
    p, o, l1 = step(p0, tx.init(p0), xs[:K])
    assert autoflat.is_handle(p) and autoflat.is_handle(o)
    first = autoflat.stats(step).flattens
    p, o, l2 = step(p, o, xs[K:])
    # the handles went back in with no host flatten: the leaves of the cached structure
    assert autoflat.stats(step).flattens == first
    tree_allclose(p, rp)
    tree_allclose(o, ro)
    tree_allclose(jnp.concatenate([l1, l2]), rl[0])
    assert autoflat.stats(step).traces == 1


@claim(PAGE, "(or as itself, when it is one array or holds none;")
def test_state_of_one_array_or_no_array_comes_back_as_itself():
    def update(w, extra, tag, x):
        return w + x, extra, tag, jnp.sum(x)

    step = autoflat.step(update, num_steps=K, state=("extra", "tag"))
    w, extra, tag, _ = step(jnp.zeros(3), None, "run", data(K, 3))
    assert type(w) is type(jnp.zeros(3)) and not autoflat.is_handle(w)
    np.testing.assert_allclose(w, jnp.sum(data(K, 3), axis=0), rtol=1e-6)
    assert extra is None and tag == "run"


@claim(PAGE, "per-step (`scanned` in the header)")
@claim(
    PAGE, "sliced along a leading axis of `num_steps`, one slice per step (batches, per-step keys)"
)
def test_per_step_inputs_are_sliced_one_slice_per_step():
    def update(w, x, key):
        w = w + x * jax.random.uniform(key, ())
        return w, jnp.sum(w)

    xs = data(8, 3)
    keys = jax.random.split(jax.random.key(3), 8)  # one key per step
    (rw,), (rs,) = jit_loop(update, (jnp.zeros(3),), (xs, keys), 8)
    step = autoflat.step(update, num_steps=K)
    (w,), (sums,) = step_loop(step, (jnp.zeros(3),), (xs, keys), 8, K)
    tree_allclose(w, rw)
    tree_allclose(sums, rs)
    assert role_line(step, "key").startswith("scanned (per-step")
    assert role_line(step, "x").startswith("scanned (per-step")


@claim(PAGE, "with `num_steps=1`, the call's input as it is")
def test_with_one_step_a_call_the_input_is_passed_as_it_is():
    def update(w, x):
        w = w + jnp.sum(x, axis=0)
        return w, x.shape[0]

    x = jnp.ones((K, 3))  # a leading axis of 4: not sliced with num_steps=1
    w, n = autoflat.step(update)(jnp.zeros(3), x)
    rw, rn = jax.jit(update)(jnp.zeros(3), x)
    tree_allclose(w, rw)
    assert n == rn == K


@claim(
    PAGE,
    "the same value for every step of one call (a teacher, a target network, an optimizer object, a reused key, a full batch)",
)
def test_broadcast_arguments_are_the_same_value_every_step():
    tx = optax.sgd(0.1)

    def update(params, opt_state, x, teacher, target, opt, key, full_batch):
        def loss_fn(p):
            pred = x @ p["w"]
            guide = x @ teacher["w"] + x @ target["w"] + jnp.mean(full_batch)
            return jnp.mean((pred - guide + jax.random.normal(key, ())) ** 2)

        loss, g = jax.value_and_grad(loss_fn)(params)
        u, opt_state = opt.update(g, opt_state, params)
        return optax.apply_updates(params, u), opt_state, loss

    p0 = {"w": jnp.zeros((3, 1))}
    teacher = {"w": jnp.full((3, 1), 0.5)}
    target = {"w": jnp.full((3, 1), 0.1)}
    key, full = jax.random.key(1), data(6, 2, seed=2)
    xs = data(8, 5, 3)
    rest = (teacher, target, tx, key, full)
    ref = jax.jit(update, static_argnums=5)
    rp, ro, rl = p0, tx.init(p0), []
    for x in xs:
        rp, ro, loss = ref(rp, ro, x, *rest)
        rl.append(loss)
    step = autoflat.step(update, num_steps=K)
    (p, o), (losses,) = step_loop(step, (p0, tx.init(p0)), (xs,), 8, K, rest)
    tree_allclose(p, rp)
    tree_allclose(losses, jnp.stack(rl))
    for name in ("teacher", "target", "opt", "key", "full_batch"):
        assert role_line(step, name).startswith("broadcast ("), name


@claim(PAGE, "a hashable Python value that selects a compiled version")
def test_a_static_argument_selects_a_compiled_version():
    def update(w, x, mode):
        w = w + (x if mode == "add" else -x)
        return w

    step = autoflat.step(update, num_steps=K, static_argnames="mode")
    xs = data(K, 3)
    w = step(jnp.zeros(3), xs, "add")
    w = step(w, xs, "add")
    assert autoflat.stats(step).traces == 1
    w = step(w, xs, "sub")  # another value: another compiled version
    assert autoflat.stats(step).traces == 2
    tree_allclose(w, jnp.sum(xs, axis=0), rtol=1e-5, atol=1e-5)
    assert role_line(step, "mode") == "static (static_argnames=) [rule: option-or-self]"


@claim(
    PAGE,
    "Everything a step returns that is not state is a per-step output, stacked along a leading axis when `num_steps > 1`.",
)
def test_everything_else_returned_is_a_per_step_output_stacked():
    def update(w, x):
        w = w * 0.5 + x
        return w, jnp.sum(w), {"x2": x * 2}

    xs = data(8, 3)
    (rw,), (rs, rd) = jit_loop(update, (jnp.zeros(3),), (xs,), 8)
    for k in (1, K):
        step = autoflat.step(update, num_steps=k)
        w, s, d = step(jnp.zeros(3), xs[:k] if k > 1 else xs[0])
        if k == 1:  # not stacked
            assert s.shape == () and d["x2"].shape == (3,)
            tree_allclose((s, d), (rs[0], jax.tree.map(lambda a: a[0], rd)))
        else:
            assert s.shape == (K,) and d["x2"].shape == (K, 3)
            tree_allclose((s, d), (rs[:K], jax.tree.map(lambda a: a[:K], rd)))
        assert "# returns: state w, output" in autoflat.show(step)


# === Where roles come from ==================================================================


@claim(
    PAGE, "The source says what it can when the step is decorated; the first call settles the rest"
)
def test_the_source_decides_at_decoration_and_the_first_call_the_rest():
    def update(p, s, x):
        new_p = {"w": p["w"] + x}
        s = s + 1
        return new_p, s

    step = autoflat.step(update, num_steps=K)
    assert role_line(step, "s") == "state (returned) [rule: returned-by-name]"
    assert role_line(step, "p") == "scanned (per-step input) [rule: as-passed]"  # left open
    step({"w": jnp.zeros(3)}, jnp.zeros(()), data(K, 3))
    assert (
        role_line(step, "p")
        == "state (matched by value to return position 0) [rule: matched-by-value]"
    )
    assert role_line(step, "x") == (
        "scanned (per-step: leading axis 4 = num_steps at the first call) [rule: leading-axis]"
    )


@claim(PAGE, "(again for a call whose arguments have other types)")
def test_a_call_with_arguments_of_other_types_settles_the_roles_again():
    def update(w, b):
        w = w + jnp.sum(jax.tree.leaves(b)[0])
        return w

    step = autoflat.step(update, num_steps=K)
    w = step(jnp.zeros(()), jnp.ones((K, 3)))  # b per-step: one slice of 3 ones a step
    np.testing.assert_allclose(w, 3.0 * K)
    w = step(w, {"a": jnp.float32(2.0)})  # another type, no leading axis: broadcast
    np.testing.assert_allclose(w, 3.0 * K + 2.0 * K)
    assert autoflat.stats(step).traces == 2


def _page_rules_table() -> list[tuple[int, str]]:
    text = (ROOT / PAGE).read_text(encoding="utf-8").split("## Where roles come from", 1)[1]
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        if len(cells) >= 2 and cells[0].isdigit():
            rows.append((int(cells[0]), cells[1].strip("`")))
        elif rows and not line.startswith("|"):
            break
    return rows


@claim(
    PAGE,
    "The rules below are one ordered table in the code, rule for rule (`RULES` in `autoflat/_roles/rules.py`)",
)
def test_the_page_table_is_the_rules_table_of_the_code():
    from autoflat._roles.rules import RULES

    rows = _page_rules_table()
    assert [order for order, _ in rows] == list(range(1, len(rows) + 1))
    assert [name for _, name in rows] == [rule.name for rule in RULES]


@claim(PAGE, "the first rule that applies wins")
def test_the_first_rule_that_applies_wins():
    def update(w, d, x):
        d["n"] = d["n"] + 1  # rule 5 would make `d` state; rule 2 decides first
        return w + x, d

    step = autoflat.step(update, num_steps=K, broadcast="w")  # rule 1 before rule 2
    assert role_line(step, "w") == "broadcast (broadcast=) [rule: option-or-self]"
    assert role_line(step, "d") == "state (returned) [rule: returned-by-name]"


@claim(
    PAGE,
    "`show()` prints every role with its evidence and the name of the rule that decided it: `# params: state (returned) [rule: returned-by-name]`",
)
def test_show_prints_the_rule_that_decided():
    def update(params, x):
        params = {"w": params["w"] + x}
        return params

    step = autoflat.step(update)
    assert "# params: state (returned) [rule: returned-by-name]" in header(step)
    step({"w": jnp.zeros(2)}, jnp.ones(2))
    assert "# params: state (returned) [rule: returned-by-name]" in header(step)
    assert "# x: scanned (per-step input) [rule: as-passed]" in header(step)


# === The rules table, row by row ============================================================
# Row 1: option-or-self


@claim(PAGE, "named in `static_argnames=`, `broadcast=` or `per_step=`")
@claim(PAGE, "`static_argnames=`, `broadcast=`, `per_step=`, `the method's instance`")
def test_rule_1_options_decide_and_name_themselves():
    def update(w, v, x, mode):
        v2 = v * 0.5 + x.sum()
        w = w + (1.0 if mode == "a" else 2.0)
        return w, v2

    # `w` is returned by name (rule 2) but broadcast= wins; `v` alone would be asked about
    # (per-step or state?), per_step= settles it; `mode` is static.
    step = autoflat.step(update, num_steps=K, broadcast="w", per_step="v", static_argnames="mode")
    v, xs = jnp.arange(4.0), data(K, 2)
    ws, vs = step(jnp.zeros(()), v, xs, "a")
    assert role_line(step, "w") == "broadcast (broadcast=) [rule: option-or-self]"
    assert role_line(step, "v") == "scanned (per_step=) [rule: option-or-self]"
    assert role_line(step, "mode") == "static (static_argnames=) [rule: option-or-self]"
    ref = jax.jit(update, static_argnames="mode")
    want = [ref(jnp.zeros(()), v[i], xs[i], "a") for i in range(K)]  # the same w every step
    tree_allclose((ws, vs), jax.tree.map(lambda *a: jnp.stack(a), *want))


@claim(PAGE, "a method's `self` (unless rule 3 finds a pytree `self` given back changed,")
def test_rule_1_a_methods_self_is_broadcast_unless_given_back_changed():
    from flax import struct

    class Trainer:
        def __init__(self):
            self.lr = 0.5

        @autoflat.step
        def train(self, p, x):
            p = p - self.lr * x
            return p

    t = Trainer()
    assert (
        role_line(Trainer.train, "self")
        == "broadcast (the method's instance) [rule: option-or-self]"
    )
    np.testing.assert_allclose(t.train(jnp.ones(2), jnp.ones(2)), [0.5, 0.5])

    class Agent(struct.PyTreeNode):
        w: jax.Array

        def update(self, x):
            w = self.w - 0.1 * (self.w - x)
            return self.replace(w=w), jnp.sum(w)

    step = autoflat.step(Agent.update, num_steps=K)
    step(Agent(jnp.zeros(2)), data(K, 2))
    assert (
        role_line(step, "self")
        == "state (matched by value to return position 0) [rule: matched-by-value]"
    )


@claim(
    PAGE,
    "or it is a Flax NNX module: rule 5 or 7 writes what the method changes back into it, as `nnx.jit` of the method does",
)
def test_rule_1_an_nnx_modules_method_writes_its_changes_back():
    from flax import nnx

    class Counter(nnx.Module):
        def __init__(self):
            self.n = nnx.BatchStat(jnp.zeros(()))
            self.lin = nnx.Linear(2, 1, rngs=nnx.Rngs(0))

        def bump(self):  # (changes it in a function it calls: rule 7)
            self.n[...] = self.n[...] + 1.0

        def count(self, x):
            self.bump()
            return self.lin(x).sum()

        def add(self, x):
            self.n[...] = self.n[...] + x.sum()
            return x.sum()

    ref, got = Counter(), Counter()
    for name, rule in (("count", "mutable-module"), ("add", "assigned-into")):
        step = autoflat.step(getattr(got, name), num_steps=K)
        step(data(K, 2))
        for i in range(K):
            nnx.jit(getattr(Counter, name))(ref, data(K, 2)[i])
        assert role_line(step, "self").endswith(f"[rule: {rule}]")
    tree_allclose(nnx.state(got), nnx.state(ref))
    assert float(got.n[...]) != 0.0


# Row 2: returned-by-name


@claim(PAGE, "returned by name at the same position of every `return`")
@claim(PAGE, "`state (returned)`")
def test_rule_2_returned_by_name_in_every_return():
    def update(p, x, frozen=False):
        if frozen:
            return p, jnp.zeros(())
        p = p * 0.5 + x
        return p, jnp.sum(x)

    xs = data(8, 3)
    (rp,), (rl,) = jit_loop(update, (jnp.ones(3),), (xs,), 8)
    step = autoflat.step(update, num_steps=K)
    (p,), (losses,) = step_loop(step, (jnp.ones(3),), (xs,), 8, K)
    tree_allclose(p, rp)
    tree_allclose(losses, rl)
    assert role_line(step, "p") == "state (returned) [rule: returned-by-name]"


@claim(
    PAGE,
    "one returned by name in some and as another expression at that position in others, `return p, s, loss` and `return new_p, new_s, loss`, goes to rule 3",
)
@claim(
    PAGE, "`state (matched by value to return position 1, returned by name there in some returns)`"
)
def test_rule_2_named_in_some_returns_goes_to_rule_3():
    def update(p, s, x, flag=False):
        loss = jnp.sum(p * x)
        if flag:
            return p, s, loss
        new_p = p - 0.2 * x
        new_s = s + 1
        return new_p, new_s, loss

    xs = data(8, 3)
    (rp, rs), (rl,) = jit_loop(update, (jnp.ones(3), jnp.zeros(())), (xs,), 8)
    step = autoflat.step(update, num_steps=K)
    (p, s), (losses,) = step_loop(step, (jnp.ones(3), jnp.zeros(())), (xs,), 8, K)
    tree_allclose((p, s, losses), (rp, rs, rl))
    assert role_line(step, "s") == (
        "state (matched by value to return position 1, returned by name there in some returns) "
        "[rule: matched-by-value]"
    )
    assert role_line(step, "p").endswith("[rule: matched-by-value]")


@claim(
    PAGE,
    "one named at several positions, `return p, p`, is state at the first, the others per-step outputs",
)
@claim(
    PAGE, "`state (returned at return position 0; position 1 also returns it: a per-step output)`"
)
def test_rule_2_named_at_several_positions():
    def update(p, x):
        p = p - 0.1 * (p * x - 1.0)
        return p, p

    xs = data(8, 3)
    (rp,), (rtraj,) = jit_loop(update, (jnp.ones(3),), (xs,), 8)
    step = autoflat.step(update, num_steps=K)
    (p,), (traj,) = step_loop(step, (jnp.ones(3),), (xs,), 8, K)
    tree_allclose((p, traj), (rp, rtraj))
    assert role_line(step, "p") == (
        "state (returned at return position 0; position 1 also returns it: a per-step output) "
        "[rule: returned-by-name]"
    )


@claim(PAGE, "two parameters named at one position is an error")
def test_rule_2_two_parameters_named_at_one_position_is_an_error():
    def update(p, s, x, flag=False):
        if flag:
            return p, jnp.sum(x)
        return s, jnp.sum(x)

    with pytest.raises(
        autoflat.SourceError,
        match=r"disagree: line \d+ returns \(p, <expr>\) but line \d+ returns \(s, <expr>\)",
    ):
        autoflat.step(update)(jnp.ones(3), jnp.ones(3), jnp.ones(3))


# Row 3: matched-by-value


@claim(PAGE, "a return position whose abstract value matches it at the first call")
@claim(PAGE, "`state (matched by value to return position 1)`")
def test_rule_3_matched_by_value():
    def update(w, p, x):
        new_p = {"a": p["a"] * 0.5 + x}
        w = w + 1.0
        return w, new_p, jnp.sum(x)

    start = (jnp.zeros(()), {"a": jnp.ones(3)})
    xs = data(8, 3)
    ref_state, (rl,) = jit_loop(update, start, (xs,), 8)
    step = autoflat.step(update, num_steps=K)
    state, (losses,) = step_loop(step, start, (xs,), 8, K)
    tree_allclose((state, losses), (ref_state, rl))
    assert (
        role_line(step, "p")
        == "state (matched by value to return position 1) [rule: matched-by-value]"
    )


@claim(
    PAGE,
    "`state (matched by value to return position 0; return position 1 gives back the same value: a per-step output)`",
)
def test_rule_3_matched_by_value_at_two_positions():
    def update(p, x):
        new_p = {"a": p["a"] * 0.5 + x}
        return new_p, new_p

    xs = data(8, 3)
    (rp,), (rtraj,) = jit_loop(update, ({"a": jnp.ones(3)},), (xs,), 8)
    step = autoflat.step(update, num_steps=K)
    (p,), (traj,) = step_loop(step, ({"a": jnp.ones(3)},), (xs,), 8, K)
    tree_allclose((p, traj), (rp, rtraj))
    assert role_line(step, "p") == (
        "state (matched by value to return position 0; return position 1 gives back the same "
        "value: a per-step output) [rule: matched-by-value]"
    )


# Row 4: state-option


@claim(
    PAGE,
    "named in `state=` (then rule 3 must find it, or the body must assign into it or change it in place",
)
@claim(PAGE, "`state (state=)`")
def test_rule_4_state_option():
    def assigned(d, x):
        d["w"] = d["w"] + x

    def changed(d, x):
        d.update(w=d["w"] + x)

    def neither(p, x):
        return jnp.sum(p * x)

    xs = data(K, 2)
    for fn in (assigned, changed):
        step = autoflat.step(fn, num_steps=K, state="d")
        d = {"w": jnp.zeros(2)}
        assert step(d, xs) is None
        tree_allclose(d["w"], jnp.sum(xs, axis=0), rtol=1e-5, atol=1e-6)  # written back
        assert role_line(step, "d") == "state (state=) [rule: state-option]"
    step = autoflat.step(neither, num_steps=K, state="p")
    p = jnp.ones(2)
    with pytest.raises(autoflat.OptionError, match="`p` is named in state="):
        step(p, xs)
    np.testing.assert_allclose(p, 1.0)


@claim(PAGE, '`state={"p": 0}` names the return position')
@claim(PAGE, "`state (state= at return position 0)`")
def test_rule_4_state_option_with_a_position():
    def update(p, q, x):
        a = {"w": p["w"] + x}
        b = {"w": q["w"] * 2.0}
        return a, b  # alike, each computed from one: say which with positions

    start = ({"w": jnp.ones(2)}, {"w": jnp.ones(2)})
    xs = data(8, 2)
    step = autoflat.step(update, num_steps=K, state={"p": 1, "q": 0})  # the swap, declared
    p, q = start
    for c in (xs[:K], xs[K:]):
        q, p = step(p, q, c)  # (position 0, position 1) = (new q, new p)
    ref = jax.jit(update)
    rp, rq = start
    for x in xs:
        rq, rp = ref(rp, rq, x)
    tree_allclose((p, q), (rp, rq))
    assert role_line(step, "p") == "state (state= at return position 1) [rule: state-option]"
    assert role_line(step, "q") == "state (state= at return position 0) [rule: state-option]"


# Row 5: assigned-into


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Meter:
    """A mutable pytree: JAX flattens it, a step may assign into its fields."""

    count: jax.Array
    total: jax.Array


def _meter():
    return Meter(jnp.zeros((), jnp.int32), jnp.zeros(()))


def _assign_item(d, x):
    d["w"] = d["w"] + x


def _assign_attribute(m, x):
    m.count = m.count + 1
    m.total = m.total + jnp.sum(x)


def _assign_setattr(m, x):
    setattr(m, "count", m.count + 1)  # noqa: B010  (the spelling tested)
    setattr(m, "total", m.total + jnp.sum(x))  # noqa: B010


@claim(
    PAGE, 'assigned into in the body (`d["w"] = ...`, `m.count = ...`, `setattr(m, "count", ...)`)'
)
@claim(PAGE, "`state (assigned into at line 12)`")
@pytest.mark.parametrize(
    "fn, make",
    [
        (_assign_item, lambda: {"w": jnp.zeros(2)}),
        (_assign_attribute, _meter),
        (_assign_setattr, _meter),
    ],
    ids=["d[k] = ...", "m.count = ...", "setattr(m, ...)"],
)
def test_rule_5_assigned_into_is_state_written_back(fn, make):
    mutated = jax.jit(lambda obj, x: (fn(obj, x), obj)[1])  # jax.jit handing the object back
    xs = data(8, 2)
    ref = make()
    for x in xs:
        ref = mutated(ref, x)
    step = autoflat.step(fn, num_steps=K)
    obj = make()
    for c in (xs[:K], xs[K:]):
        assert step(obj, c) is None
    tree_allclose(obj, ref)  # the caller's own object holds the new values
    name = fn.__code__.co_varnames[0]
    line = fn.__code__.co_firstlineno + 1  # the first assignment
    assert role_line(step, name) == f"state (assigned into at line {line}) [rule: assigned-into]"


# Row 6: changed-in-place


def _dict_update(d, x):
    d.update(w=d["w"] + x)


def _dict_or(d, x):
    d |= {"w": d["w"] + x}


def _list_append(xs, x):
    xs.append(xs[-1] + x)


def _list_add(xs, x):
    xs += [xs[-1] + x]


def _list_extend(xs, x):
    xs.extend([xs[-1] + x])


def _pop_beside(d, x):
    old = d.pop("old")
    d.update(w=d["w"] + old, new=x)


def _del_beside(d, x):
    del d["old"]
    d |= {"w": d["w"] + x, "new": x}


def _through_a_part(d, x):
    inner = d["inner"]
    inner.update(w=inner["w"] + x)


@claim(
    PAGE,
    '`totals.update({...})`, `totals |= {...}`, `xs.append(x)` on a dict or list argument | state, written back as `totals["k"] = ...` is',
)
@claim(
    PAGE,
    "a dict or list changed in place (`d.update(...)`, `d |= ...`, `xs.append(x)`, `xs += [...]`, `xs.extend(...)`; a `d.pop(k)` or `del d[k]` beside them)",
)
@claim(
    PAGE,
    'also through another name that holds a part of it (`inner = d["inner"]; inner.update(...)`)',
)
@pytest.mark.parametrize(
    "fn, make, k, calls",
    [
        (_dict_update, lambda: {"w": jnp.zeros(2)}, K, 2),
        (_dict_or, lambda: {"w": jnp.zeros(2)}, K, 2),
        (_list_append, lambda: [jnp.zeros(2)], 1, 2),  # each step adds an entry: one a call
        (_list_add, lambda: [jnp.zeros(2)], 1, 2),
        (_list_extend, lambda: [jnp.zeros(2)], 1, 2),
        (_pop_beside, lambda: {"w": jnp.zeros(2), "old": jnp.ones(2)}, 1, 1),  # "old" is gone
        (_del_beside, lambda: {"w": jnp.zeros(2), "old": jnp.ones(2)}, 1, 1),
        (_through_a_part, lambda: {"inner": {"w": jnp.zeros(2)}, "b": jnp.ones(())}, K, 2),
    ],
    ids=[
        "d.update",
        "d |=",
        "xs.append",
        "xs +=",
        "xs.extend",
        "d.pop beside",
        "del d[k] beside",
        "through a part",
    ],
)
def test_rule_6_changed_in_place_is_state_written_back(fn, make, k, calls):
    mutated = jax.jit(lambda obj, x: (fn(obj, x), obj)[1])
    xs = data(calls * k, 2)
    ref = make()
    for x in xs:
        ref = mutated(ref, x)
    step = autoflat.step(fn, num_steps=k)
    obj = make()
    for c in range(calls):
        chunk = xs[c * k : (c + 1) * k]
        assert step(obj, chunk if k > 1 else chunk[0]) is None
    tree_allclose(obj, ref)
    name = fn.__code__.co_varnames[0]
    assert role_line(step, name).startswith("state (")


@claim(
    PAGE,
    "`state (a dict changed in place (`totals.update(...)` at line 12): its new value is written into the caller's object after the call)`",
)
def test_rule_6_evidence():
    def update(totals, x):
        totals.update(s=totals["s"] + x)

    step = autoflat.step(update)
    totals = {"s": jnp.zeros(2)}
    step(totals, jnp.ones(2))
    step(totals, jnp.ones(2))
    np.testing.assert_allclose(totals["s"], [2.0, 2.0])
    line = update.__code__.co_firstlineno + 1
    assert role_line(step, "totals") == (
        f"state (a dict changed in place (`totals.update(...)` at line {line}): its new value is "
        "written into the caller's object after the call) [rule: changed-in-place]"
    )


@claim(
    PAGE,
    'One that is only taken from (`labels = batch.pop("labels")`, `del batch["mask"]`) is not state: the step changes its own copy, as under `jax.jit`, and the next rules apply',
)
def test_rule_6_only_taken_from_is_not_state():
    def popping(w, batch):
        labels = batch.pop("labels")
        w = w - 0.1 * jnp.mean(batch["x"] - labels)
        return w

    def deleting(w, batch):
        del batch["mask"]
        w = w - 0.1 * jnp.mean(batch["x"])
        return w

    for fn, key in ((popping, "labels"), (deleting, "mask")):
        batches = {"x": data(8, 3), key: data(8, 3, seed=1)}
        (rw,), _ = jit_loop(fn, (jnp.zeros(()),), (batches,), 8)
        step = autoflat.step(fn, num_steps=K)
        w = jnp.zeros(())
        for start in (0, K):
            chunk = jax.tree.map(lambda a, s=start: a[s : s + K], batches)
            w = step(w, chunk)
            assert sorted(chunk) == sorted(["x", key])  # the caller's dict keeps its entry
        tree_allclose(w, rw)
        line = role_line(step, "batch")
        assert line.startswith("scanned (per-step: leading axis 4 = num_steps at the first call;")
        assert "changes the step's own copy, as under jax.jit, not your object" in line
        assert line.endswith("[rule: leading-axis]")  # the next rules applied


# Row 7: mutable-module


def _nnx_model_class():
    from flax import nnx

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(3, 1, rngs=rngs)

        def __call__(self, x):
            return self.lin(x)

    Model.__qualname__ = "Model"  # as a module-level class reads in show()
    return Model


@claim(PAGE, "a Flax NNX module, optimizer or metric (mutated in place)")
@claim(
    PAGE,
    "`state (a Model mutated in place: its new Variable values are written into the caller's object after the call)`",
)
def test_rule_7_flax_nnx_objects_are_state_written_back():
    from flax import nnx

    Model = _nnx_model_class()

    def train_step(model, optimizer, metrics, x, y):
        def loss_fn(model):
            return jnp.mean((model(x)[:, 0] - y) ** 2)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        metrics.update(values=loss)

    def fresh():
        model = Model(nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param), nnx.metrics.Average()

    xs, ys = data(4, 5, 3), data(4, 5, seed=1)
    ref_objs = fresh()
    ref = nnx.jit(train_step)
    for i in range(4):
        ref(*ref_objs, xs[i], ys[i])
    objs = fresh()
    step = autoflat.step(train_step, num_steps=2)
    for start in (0, 2):
        assert step(*objs, xs[start : start + 2], ys[start : start + 2]) is None
    for a, b in zip(objs, ref_objs, strict=True):
        tree_allclose(nnx.state(a), nnx.state(b))
    np.testing.assert_allclose(objs[2].compute(), ref_objs[2].compute(), rtol=1e-6)
    assert role_line(step, "model") == (
        "state (a Model mutated in place: its new Variable values are written into the caller's "
        "object after the call) [rule: mutable-module]"
    )
    assert role_line(step, "optimizer").startswith("state (a flax.Optimizer mutated in place")
    assert role_line(step, "metrics").startswith("state (a flax.Average mutated in place")


# Row 8: python-scalar


@claim(PAGE, "a string, bytes or `None`; with `num_steps > 1` any Python number too")
@claim(PAGE, "`static (a Python int, static as in eqx.filter_jit)`")
def test_rule_8_python_scalars_and_strings_are_static():
    def update(w, x, act, n):
        w = getattr(jax.nn, act)(w + x) * n
        return w

    step = autoflat.step(update)  # num_steps=1: a string is static
    step(jnp.zeros(2), jnp.ones(2), "relu", 2)
    assert (
        role_line(step, "act")
        == "static (a Python str, static as in eqx.filter_jit) [rule: python-scalar]"
    )
    step = autoflat.step(update, num_steps=K)  # num_steps > 1: any Python number too
    xs = data(K, 2)
    w = step(jnp.zeros(2), xs, "relu", 2)
    w = step(w, xs, "relu", 2)
    assert autoflat.stats(step).traces == 1
    step(w, xs, "relu", 3)  # another value: another compiled version
    assert autoflat.stats(step).traces == 2
    assert (
        role_line(step, "n")
        == "static (a Python int, static as in eqx.filter_jit) [rule: python-scalar]"
    )
    assert (
        role_line(step, "act")
        == "static (a Python str, static as in eqx.filter_jit) [rule: python-scalar]"
    )


@claim(
    PAGE,
    "`def update(w, step, x): ... return w, step + 1, lr` called with `step=0` | `step` state, carried as an array (every step of a call sees its own count)",
)
@claim(
    PAGE,
    "unless the return position at its place among the parameters that could be state gives back a changed Python number, `return w, step + 1, lr` (where a broadcast argument before it shifts its place, the one open position giving back its int plus one or a changed number under its name),",
)
@claim(
    PAGE, "`state (a Python int that return position 1 gives back changed: carried as an array)`"
)
def test_rule_8_a_python_counter_given_back_changed_is_carried():
    def update(w, step, x):
        lr = 0.1 / (1.0 + step)
        return w - lr * jnp.mean(x) * w, step + 1, lr

    xs = jnp.arange(1.0, 9.0).reshape(8, 1)
    (rw, rs), (rl,) = jit_loop(update, (jnp.ones(2), 0), (xs,), 8)
    step = autoflat.step(update, num_steps=K)
    w, s, lr1 = step(jnp.ones(2), 0, xs[:K])
    assert role_line(step, "step") == (
        "state (a Python int that return position 1 gives back changed: carried as an array) "
        "[rule: python-scalar]"
    )
    w, s, lr2 = step(w, s, xs[K:])  # every step of a call sees its own count
    tree_allclose((w, jnp.concatenate([lr1, lr2])), (rw, rl), rtol=1e-6)
    assert int(s) == int(rs) == 8

    def distill(student, teacher, x, step=0):  # the teacher shifts `step`'s place
        lr = 0.1 / (1.0 + step)
        return student - lr * jnp.mean(x) * (student - teacher), step + 1

    teacher = jnp.full(2, 0.5)
    step = autoflat.step(distill, num_steps=K)
    got = step(jnp.ones(2), teacher, xs[:K], step=0)
    assert role_line(step, "step").startswith("state (a Python int")
    want = (jnp.ones(2), 0)
    for x in xs[:K]:
        want = jax.jit(distill)(want[0], teacher, x, step=want[1])
    tree_allclose(got, want, rtol=1e-6)


@claim(PAGE, "with `num_steps=1` a Python number the step needs concrete (a layer size)")
def test_rule_8_a_python_number_needed_concrete_at_one_step_a_call_is_static():
    def update(p, x, size):
        p = p + jnp.sum(jnp.zeros(size) + x)
        return p

    step = autoflat.step(update)
    p = step(jnp.zeros(()), jnp.ones(()), 3)
    np.testing.assert_allclose(p, 3.0)
    assert role_line(step, "size").startswith(
        "static (a Python int the step needs as a concrete value"
    )
    assert role_line(step, "size").endswith("[rule: python-scalar]")


# Row 9: untraceable


@claim(
    PAGE,
    "holds values JAX cannot trace (an Equinox module's functions, an optax `GradientTransformation`)",
)
@claim(PAGE, "`broadcast (a equinox.MLP, holds values JAX cannot trace)`")
def test_rule_9_untraceable_values_are_broadcast():
    import equinox as eqx

    teacher = eqx.nn.MLP(3, 1, 4, 1, key=jax.random.key(1))
    tx = optax.sgd(0.1)

    def update(params, opt_state, teacher, tx, x):
        target = jax.vmap(teacher)(x)[:, 0]
        loss, g = jax.value_and_grad(lambda p: jnp.mean((x @ p - target) ** 2))(params)
        u, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, u), opt_state, loss

    xs = data(8, 5, 3)
    ref = eqx.filter_jit(update)  # jax.jit cannot take the MLP's functions
    rp, ro, rl = jnp.zeros(3), tx.init(jnp.zeros(3)), []
    for x in xs:
        rp, ro, loss = ref(rp, ro, teacher, tx, x)
        rl.append(loss)
    for k in (1, K):
        step = autoflat.step(update, num_steps=k)
        p, o, losses = jnp.zeros(3), tx.init(jnp.zeros(3)), []
        for start in range(0, 8, k):
            p, o, loss = step(p, o, teacher, tx, xs[start : start + k] if k > 1 else xs[start])
            losses.append(jnp.atleast_1d(loss))
        tree_allclose((p, jnp.concatenate(losses)), (rp, jnp.stack(rl)))
        assert role_line(step, "teacher") == (
            "broadcast (a equinox.MLP, holds values JAX cannot trace) [rule: untraceable]"
        )
        assert role_line(step, "tx").startswith("broadcast (a optax.GradientTransformation")
        assert role_line(step, "tx").endswith("holds values JAX cannot trace) [rule: untraceable]")


# Row 10: bound-argument


def _bound_fn(w, x, scale, n, tx, d, tag):
    d["calls"] = d["calls"] + 1
    g = scale * jnp.sum(x) * n
    u, _ = tx.update(g, tx.init(w), w)
    w = optax.apply_updates(w, u)
    return w


@claim(
    PAGE,
    "bound by a `functools.partial` around the step (`jax.jit(functools.partial(train_step, learning_rate_fn=schedule))`): the same value on every call, as `jax.jit` of the partial holds it",
)
@claim(
    PAGE,
    "An array is broadcast (never sliced per step, whatever its leading axis), a Python number a constant (static)",
)
@claim(
    PAGE,
    "Rules 8 and 9 come first, and rules 5 to 7 may make it state written into the bound object",
)
@claim(PAGE, "Every role of a bound parameter says so in `show()`")
def test_rule_10_bound_arguments():
    import functools

    scale = jnp.arange(4.0)  # a leading axis of 4 = num_steps: still never sliced
    ref_d, d = {"calls": jnp.zeros(())}, {"calls": jnp.zeros(())}
    bind = dict(scale=scale, n=2, tx=optax.sgd(0.1), tag="run")
    ref = jax.jit(functools.partial(_bound_fn, d=ref_d, **bind))
    xs = data(8, 3)
    rw = jnp.zeros(4)
    for x in xs:
        rw = ref(rw, x)
    for wrap in (lambda f: f, jax.jit):
        d["calls"] = jnp.zeros(())
        step = autoflat.step(wrap(functools.partial(_bound_fn, d=d, **bind)), num_steps=K)
        (w,), _ = step_loop(step, (jnp.zeros(4),), (xs,), 8, K)
        tree_allclose(w, rw)
        assert float(d["calls"]) == 8.0  # written into the bound dict
        assert role_line(step, "scale") == (
            "broadcast (bound by functools.partial; the same value every call) [rule: bound-argument]"
        )
        # rules 8 and 9 first: a Python number and a string static, an optax object untraceable
        assert role_line(step, "n") == (
            "static (bound by functools.partial; a Python int, static as in eqx.filter_jit) "
            "[rule: python-scalar]"
        )
        assert role_line(step, "tag").startswith("static (bound by functools.partial; a Python str")
        assert role_line(step, "tx").startswith("broadcast (bound by functools.partial; a optax.")
        assert role_line(step, "tx").endswith("[rule: untraceable]")
        # rule 5: state, written into the bound object
        assert role_line(step, "d").startswith(
            "state (bound by functools.partial; assigned into at line"
        )
        assert autoflat.stats(step).traces == 1


@claim(
    PAGE,
    "`broadcast (bound by functools.partial; the same value every call)`, `static (bound by functools.partial; a Python int, a constant as under jax.jit of the partial)`",
)
def test_rule_10_evidence_at_one_step_a_call():
    import functools

    def update(w, x, n, c):
        w = w + jnp.sum(x) * n + c
        return w

    step = autoflat.step(functools.partial(update, n=2, c=jnp.ones(3)))
    ref = jax.jit(functools.partial(update, n=2, c=jnp.ones(3)))
    w = step(jnp.zeros(3), jnp.ones(3))
    tree_allclose(step(w, jnp.ones(3)), ref(ref(jnp.zeros(3), jnp.ones(3)), jnp.ones(3)))
    assert role_line(step, "n") == (
        "static (bound by functools.partial; a Python int, a constant as under jax.jit of the "
        "partial) [rule: bound-argument]"
    )
    assert role_line(step, "c") == (
        "broadcast (bound by functools.partial; the same value every call) [rule: bound-argument]"
    )


@claim(
    PAGE,
    "a `return` that names it, or `state=` naming it, is an error that asks to pass it at the call (its new value could never reach a later step), and rule 3 never matches it",
)
def test_rule_10_a_bound_argument_is_never_state_given_back():
    import functools

    def named(w, x, b):
        b = b + 1
        return w + x, b

    def new_name(w, x, b):
        new_b = b * 2
        return w + x, new_b

    with pytest.raises(
        autoflat.SourceError, match=r"returns `b`, which a functools.partial binds"
    ) as info:
        autoflat.step(functools.partial(named, b=jnp.ones(3)), num_steps=2)(
            jnp.zeros(3), jnp.ones((2, 3))
        )
    assert "could never reach a later step" in str(info.value)
    assert "Pass `b` at the call instead" in str(info.value)
    with pytest.raises(
        autoflat.OptionError, match=r"state= names `b`, which a functools.partial binds"
    ) as info:
        step = autoflat.step(functools.partial(new_name, b=jnp.ones(3)), num_steps=2, state="b")
        step(jnp.zeros(3), jnp.ones((2, 3)))
    assert "could never reach a later step" in str(info.value)
    assert "Pass `b` at the call instead" in str(info.value)
    # `new_b` has `b`'s abstract value: never matched to it, a per-step output
    step = autoflat.step(functools.partial(new_name, b=jnp.ones(3)), num_steps=2)
    w, new_b = step(jnp.zeros(3), jnp.ones((2, 3)))
    np.testing.assert_allclose(new_b, np.full((2, 3), 2.0))
    assert role_line(step, "b").startswith("broadcast (bound by functools.partial")


# Row 11: leading-axis


@claim(PAGE, "An argument whose every array leaf has a leading axis of `num_steps` looks per-step")
@claim(PAGE, "every array leaf has a leading axis of `num_steps`")
@claim(PAGE, "`scanned (per-step: leading axis 4 = num_steps at the first call)`")
def test_rule_11_every_leaf_with_the_leading_axis_is_per_step():
    def update(w, batch):
        w = w + jnp.sum(batch["x"]) * batch["s"]
        return w, batch["s"]

    batch = {"x": data(8, 3), "s": jnp.arange(8.0)}
    (rw,), (rs,) = jit_loop(update, (jnp.zeros(()),), (batch,), 8)
    step = autoflat.step(update, num_steps=K)
    (w,), (s,) = step_loop(step, (jnp.zeros(()),), (batch,), 8, K)
    tree_allclose((w, s), (rw, rs), rtol=1e-5)
    assert role_line(step, "batch") == (
        "scanned (per-step: leading axis 4 = num_steps at the first call) [rule: leading-axis]"
    )


WEIGHTS = jnp.array([1.0, 2.0, 3.0, 4.0])


@claim(
    PAGE,
    "not a default value the call did not pass: that is broadcast, `its default value, the same every step`",
)
def test_rule_11_a_default_never_passed_is_broadcast():
    def update(p, x, class_weights=WEIGHTS):  # a leading axis of 4 = num_steps
        p = p - 0.1 * jnp.sum(class_weights * x)
        return p, jnp.sum(class_weights)

    xs = data(8, 4)
    (rp,), (rt,) = jit_loop(update, (jnp.zeros(()),), (xs,), 8)
    step = autoflat.step(update, num_steps=K)
    (p,), (totals,) = step_loop(step, (jnp.zeros(()),), (xs,), 8, K)
    tree_allclose((p, totals), (rp, rt), rtol=1e-5)
    assert role_line(step, "class_weights") == (
        "broadcast (its default value, the same every step) [rule: leading-axis]"
    )


@claim(
    PAGE,
    "a raw `uint32[2]` PRNG key at `num_steps=2` is an `autoflat.ShapeError` that asks for `broadcast=` or `per_step=`",
)
def test_rule_11_a_raw_key_at_two_steps_a_call_is_asked_about():
    def update(w, x, rng):
        noise = jax.random.normal(jax.random.fold_in(rng, 0), w.shape)
        return w + 0.1 * x + noise, jnp.sum(w)

    rng = jax.random.PRNGKey(0)
    with pytest.raises(autoflat.ShapeError) as info:
        autoflat.step(update, num_steps=2)(jnp.zeros(3), data(2, 3), rng)
    assert 'broadcast="rng"' in str(info.value) and 'per_step="rng"' in str(info.value)
    xs = data(4, 3)
    (rw,), _ = jit_loop(update, (jnp.zeros(3),), (xs,), 4, (rng,))
    step = autoflat.step(update, num_steps=2, broadcast="rng")
    (w,), _ = step_loop(step, (jnp.zeros(3),), (xs,), 4, 2, (rng,))
    tree_allclose(w, rw, rtol=1e-6)


def _halved(v, x):
    v2 = v * 0.5 + x.sum()
    return v2


@claim(
    PAGE,
    "so is one given back one step's slice under another name, `v2 = v * 0.5 + ...; return v2`, asking for `per_step=` or `state=`",
)
@claim(
    PAGE,
    "where a return position gives back one step's slice of it under another name, it could as well be state whose first axis happens to be `num_steps`, and autoflat asks",
)
def test_rule_11_a_slice_given_back_under_another_name_is_asked_about():
    v = jnp.arange(4.0)
    with pytest.raises(autoflat.ShapeError) as info:
        autoflat.step(_halved, num_steps=K)(v, data(K, 2))
    assert 'state="v"' in str(info.value) and 'per_step="v"' in str(info.value)
    np.testing.assert_allclose(v, [0.0, 1.0, 2.0, 3.0])  # nothing consumed


def _sliced_carries():
    """Carries of K rows that the first call reads as per-step by their leading axis, each
    returned as an expression at its own place (nothing in one call tells them from per-step
    data): a per-example EMA of a batch of K, a linear recurrence's hidden state, a Haiku-style
    `s` returned as `ns`, Kendall's per-task log variances."""

    def ema(w, ema, x):
        loss, g = jax.value_and_grad(lambda w: jnp.mean((x @ w - 1.0) ** 2))(w)
        return w - 0.1 * g, 0.9 * ema + 0.1 * jnp.sum(x, axis=-1), loss

    def recurrent(w, h, x):
        loss, g = jax.value_and_grad(lambda w: jnp.mean(jnp.tanh(0.9 * h + x @ w) ** 2))(w)
        return w - 0.1 * g, jnp.tanh(0.9 * h + x @ w), loss

    def haiku(w, s, x):
        ns = 0.5 * s + jnp.mean(x @ w, axis=-1)
        loss, g = jax.value_and_grad(lambda w: jnp.mean((x @ w - ns[:, None]) ** 2))(w)
        return w - 0.1 * g, ns, loss

    def kendall(w, s, x):
        part = jnp.mean((x @ w - 1.0) ** 2, axis=-1)
        g = jax.grad(lambda w: jnp.sum(jnp.exp(-s) * jnp.mean((x @ w - 1.0) ** 2, axis=-1)))(w)
        return w - 0.1 * g, s - 0.01 * (1.0 - jnp.exp(-s) * part), jnp.sum(jnp.exp(-s) * part + s)

    return {"ema": ema, "recurrent": recurrent, "haiku": haiku, "kendall": kendall}


@claim(
    PAGE,
    "and a later call passing back there an array one of the step's first calls returned as a per-step output, one step's value of the argument's shapes (a carry that was sliced), is an `autoflat.ShapeError` that asks for `state=` or `per_step=` before taking anything",
)
@pytest.mark.parametrize("kind", ["ema", "recurrent", "haiku", "kendall"])
def test_rule_11_a_per_step_output_passed_back_as_a_per_step_input_is_asked_about(kind):
    """The first call reads the carry per step (the page's rule, silently); the second, given
    back what position 1 returned, raises before taking anything (the state passed in still
    usable), naming `state={c: 1}`, which gives `jax.jit`'s result."""
    update = _sliced_carries()[kind]
    carry = list(inspect.signature(update).parameters)[1]
    w0 = jnp.full((3, K), 0.1) if kind == "recurrent" else jnp.full((3, 5), 0.1)
    c0 = jnp.zeros((K, K)) if kind == "recurrent" else jnp.zeros(K)  # (a batch of K rows)
    xs = data(2 * K, K, 3, seed=5)
    step = autoflat.step(update, num_steps=K)
    w, c, _ = step(w0, c0, xs[:K])
    assert role_line(step, carry).endswith("[rule: leading-axis]")
    with pytest.raises(autoflat.ShapeError) as info:
        step(w, c, xs[K:])
    message = str(info.value)
    assert f"`{carry}` holds what return position 1 gave back at an earlier call" in message
    assert f'state={{"{carry}": 1}})' in message and f'per_step="{carry}")' in message
    assert not w.is_deleted() and not c.is_deleted()
    fixed = autoflat.step(update, num_steps=K, state={carry: 1})
    (ref_w, ref_c), _ = jit_loop(update, (w0, c0), (xs,), 2 * K)
    (got_w, got_c), _ = step_loop(fixed, (w0, c0), (xs,), 2 * K, K)
    tree_allclose((got_w, got_c), (ref_w, ref_c), rtol=1e-5)


def _ensemble_steps():
    """An ensemble of K members (leading axis K = num_steps) whose new value is returned
    under a name sharing no word with it: camel case, a word for new only, an abbreviation."""

    def camel(P, x):
        newP = jax.vmap(lambda p: p - 0.1 * jnp.mean(x) * p)(P)
        return newP, jnp.sum(newP)

    def updated(ens, x):
        updated = jax.vmap(lambda p: p - 0.1 * jnp.mean(x) * p)(ens)
        return updated, jnp.sum(updated)

    def abbreviated(params, x):
        p_next = jax.vmap(lambda p: p - 0.1 * jnp.mean(x) * p)(params)
        return p_next, jnp.sum(p_next)

    return {"camel": camel, "updated": updated, "abbreviated": abbreviated}


@claim(
    PAGE,
    "under a name that may be its new value (one sharing a word with it, `v2`, `new_v` or `newV`; words for new only, `updated`; a word beginning its name beside a word for new, `p_next` for `params`), and carried whole the step gives back its whole shape there (an ensemble of 4 members at `num_steps=4`)",
)
@pytest.mark.parametrize("kind", ["camel", "updated", "abbreviated"])
def test_rule_11_an_ensemble_of_num_steps_members_under_another_name_is_asked_about(kind):
    """Sliced per step, such an ensemble trains silently wrong (each step one member): a
    name that may be its new value makes it a question, and `state=` gives `jax.jit`'s
    result."""
    update = _ensemble_steps()[kind]
    param = next(iter(inspect.signature(update).parameters))
    P = jnp.arange(12.0).reshape(K, 3)
    xs = data(K, 3, seed=3)
    with pytest.raises(autoflat.ShapeError) as info:
        autoflat.step(update, num_steps=K)(P, xs)
    assert f'state="{param}"' in str(info.value) and f'per_step="{param}"' in str(info.value)
    (ref,), _ = jit_loop(update, (P,), (xs,), K)
    (got,), _ = step_loop(autoflat.step(update, num_steps=K, state=param), (P,), (xs,), K, K)
    tree_allclose(got, ref, rtol=1e-6)


@claim(
    PAGE,
    "Where slicing an argument per step makes the step fail to trace and, carried whole, it traces and is given back whole at a return position (an ensemble in a dict returned under another name, per-environment keys split under `new`), the `autoflat.ShapeError` quotes JAX's error and names `state=` and `per_step=`",
)
def test_rule_11_a_step_that_traces_only_with_an_argument_carried_whole_asks():
    """An ensemble in a dict (returned under another name), and per-environment keys split
    under `new`: sliced, the step fails to trace; carried whole it traces. autoflat asks,
    quoting JAX's error; `state=` gives `jax.jit`'s result."""

    def estep(P, x):
        def one(p):
            loss, g = jax.value_and_grad(lambda p: jnp.mean((x @ p["w"]) ** 2))(p)
            return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), loss

        newP, losses = jax.vmap(one)(P)
        return newP, losses

    def envs(keys, x):
        new = jax.vmap(lambda k: jax.random.split(k)[0])(keys)
        return new, jax.vmap(jax.random.uniform)(keys) + x.sum()

    P = {"w": jnp.stack([jnp.ones((3, 2)) * i for i in range(K)])}
    xs = jnp.ones((K, 6, 3))
    with pytest.raises(autoflat.ShapeError) as info:
        autoflat.step(estep, num_steps=K)(P, xs)
    message = str(info.value)
    assert "dot_general requires contracting dimensions" in message
    assert 'state="P"' in message and 'per_step="P"' in message
    (ref,), _ = jit_loop(estep, (P,), (xs,), K)
    (got,), _ = step_loop(autoflat.step(estep, num_steps=K, state="P"), (P,), (xs,), K, K)
    tree_allclose(got, ref, rtol=1e-6)
    tree_allclose(P["w"][2], jnp.full((3, 2), 2.0))  # the caller's state intact
    keys = jax.random.split(jax.random.key(0), K)
    with pytest.raises(autoflat.ShapeError, match='state="keys"'):
        autoflat.step(envs, num_steps=K)(keys, data(K, 3))
    (ref,), _ = jit_loop(envs, (keys,), (data(K, 3),), K)
    (got,), _ = step_loop(
        autoflat.step(envs, num_steps=K, state="keys"), (keys,), (data(K, 3),), K, K
    )
    tree_allclose(got, ref)


# Row 12: no-leading-axis


@claim(PAGE, "`num_steps > 1`: no array leaf has it")
@claim(PAGE, "`broadcast (no leading axis of num_steps=4 at the first call)`")
def test_rule_12_no_leaf_with_the_leading_axis_is_broadcast():
    def update(w, x, full):
        w = w + jnp.sum(x) * jnp.mean(full)
        return w

    xs, full = data(8, 3), data(5, 2, seed=1)
    (rw,), _ = jit_loop(update, (jnp.zeros(()),), (xs,), 8, (full,))
    step = autoflat.step(update, num_steps=K)
    (w,), _ = step_loop(step, (jnp.zeros(()),), (xs,), 8, K, (full,))
    tree_allclose(w, rw, rtol=1e-5)
    assert (
        role_line(step, "full")
        == "broadcast (no leading axis of num_steps=4 at the first call) [rule: no-leading-axis]"
    )


def _shifted(w, extra):
    return w * 0.5 + sum(e.sum() for e in extra)


@claim(
    PAGE,
    "or it holds no array at all (a later call where it holds an array with that leading axis, in one more item or key or in another shape, is an `autoflat.ShapeError` that asks for `per_step=` or `broadcast=`, and for `state=` where a per-step output could be its new value: `loss + total`'s stacked values passed back as `total`)",
)
@claim(PAGE, "`broadcast (no arrays at the first call)`")
def test_rule_12_an_argument_with_no_arrays_is_broadcast_until_it_holds_per_step_ones():
    step = autoflat.step(_shifted, num_steps=K)
    w = step(jnp.ones(3), ())
    assert role_line(step, "extra") == (
        "broadcast (no arrays at the first call) [rule: no-leading-axis]"
    )
    with pytest.raises(autoflat.ShapeError) as info:
        step(w, (data(K, 2),))
    message = str(info.value)
    assert (
        "`extra` was taken as the same for every step (broadcast) by its shapes at the first call (no arrays)"
        in message
    )
    assert 'per_step="extra"' in message and 'broadcast="extra"' in message
    tree_allclose(w, jnp.full(3, 0.5**K))  # nothing consumed
    full = data(2, 3, seed=1)  # no leading axis of K: broadcast, as the rule says
    (rw,), _ = jit_loop(lambda w, e: (_shifted(w, e),), (w,), (), K, ((full,),))
    tree_allclose(step(w, (full,)), rw, rtol=1e-5)
    # An array of another shape with that leading axis, in the same structure, too.
    with pytest.raises(autoflat.ShapeError, match="Now it holds float32\\[4, 3\\]"):
        step(w, (data(K, 3, seed=2),))
    # A running sum's stacked values passed back: `state=` named too, and it works.
    summed = autoflat.step(_loss_plus_total, num_steps=K)
    w, total, _ = summed(jnp.ones(3), jnp.asarray(0), data(K, 3))
    with pytest.raises(autoflat.ShapeError, match=r'state=\{"total": 1\}'):
        summed(w, total, data(K, 3, seed=1))


def _loss_plus_total(w, total, x):
    loss = jnp.sum(x * w)
    return w * 0.5, loss + total, loss


# Row 13: as-passed


@claim(
    PAGE,
    "`num_steps=1`: anything else, passed as it is (as `jax.jit` passes it); before the first call, anything the source leaves open",
)
@claim(PAGE, "`scanned (per-step input)`")
def test_rule_13_as_passed():
    def update(w, x, y):
        w = w + jnp.sum(x) * y
        return w

    step = autoflat.step(update)
    assert (
        role_line(step, "x") == "scanned (per-step input) [rule: as-passed]"
    )  # before the first call
    w = step(jnp.zeros(()), jnp.ones((K, 3)), 2.0)
    w = step(w, jnp.ones((K, 3)), 3.0)
    ref = jax.jit(update)
    tree_allclose(w, ref(ref(jnp.zeros(()), jnp.ones((K, 3)), 2.0), jnp.ones((K, 3)), 3.0))
    assert role_line(step, "x") == "scanned (per-step input) [rule: as-passed]"
    assert role_line(step, "y") == "scanned (per-step input) [rule: as-passed]"
    assert autoflat.stats(step).traces == 1  # the Python float traced, as jax.jit traces it


# === The paragraphs under the table =========================================================


@claim(
    PAGE,
    "Roles are fixed at the first call: a later call with a shorter leading axis on the same per-step arguments is a final chunk, and runs that many steps.",
)
def test_a_shorter_later_call_is_a_final_chunk():
    def update(w, x):
        w = w * 0.9 + x
        return w, jnp.sum(w)

    xs = data(6, 3)
    (rw,), (rs,) = jit_loop(update, (jnp.zeros(3),), (xs,), 6)
    step = autoflat.step(update, num_steps=K)
    w, s1 = step(jnp.zeros(3), xs[:K])
    w, s2 = step(w, xs[K:])  # 2 steps
    assert s2.shape == (2,)
    tree_allclose((w, jnp.concatenate([s1, s2])), (rw, rs))
    assert role_line(step, "x").startswith("scanned (per-step: leading axis 4")


@claim(
    PAGE,
    "state with leaves of mixed or short leading axes, returned under another name | matched by value: state",
)
@claim(PAGE, "State is matched (rule 3) before the leading axes are judged")
@claim(
    PAGE,
    'a state returned under another name may have leaves of mixed or shorter leading axes (an optimizer state whose last layer has `num_steps` outputs, two parameter vectors of 2 entries when `num_steps=4`), and it is state, not a "mixed" argument or a "short first chunk"',
)
def test_state_with_mixed_or_short_leading_axes_is_state():
    def mixed(params, x):
        new = {"w": params["w"] - 0.1 * x[0], "b": params["b"] * 0.9 + jnp.sum(x)}
        return new, jnp.sum(x)

    def short(store, x):
        new = {"a": store["a"] + x, "b": store["b"] * 0.5}
        return new, jnp.sum(new["a"])

    for fn, start, shape in (
        (mixed, {"w": jnp.arange(4.0), "b": jnp.ones(3)}, (4,)),  # w: (4,) = num_steps
        (short, {"a": jnp.ones((2, 3)), "b": jnp.ones(2)}, (3,)),  # every leaf: 2 < 4
    ):
        xs = data(8, *shape)
        (ref,), (rl,) = jit_loop(fn, (start,), (xs,), 8)
        step = autoflat.step(fn, num_steps=K)
        (got,), (losses,) = step_loop(step, (start,), (xs,), 8, K)
        tree_allclose((got, losses), (ref, rl), rtol=1e-5)
        name = fn.__code__.co_varnames[0]
        assert role_line(step, name) == (
            "state (matched by value to return position 0) [rule: matched-by-value]"
        )


# --- a method step's `self` -----------------------------------------------------------------


def _agents():
    """A flax.struct agent and an Equinox agent whose `update` gives back the new agent."""
    import equinox as eqx
    from flax import struct

    class StructAgent(struct.PyTreeNode):
        w: jax.Array

        def update(self, x):
            w = self.w - 0.1 * (self.w - x)
            return self.replace(w=w), {"loss": jnp.sum(w)}

    class EqxAgent(eqx.Module):
        w: jax.Array

        def update(self, x):
            w = self.w - 0.1 * (self.w - x)
            return eqx.tree_at(lambda a: a.w, self, w), {"loss": jnp.sum(w)}

    return StructAgent, EqxAgent


@claim(
    PAGE,
    "A method step's `self` is broadcast, unless it is a pytree that a return position gives back changed (`return self.replace(w=w), info` on a `flax.struct` agent, `eqx.tree_at(..., self, ...)` on an Equinox module): then it is state, matched by value as any parameter",
)
@claim(PAGE, "(`autoflat.step(agent.update)` on an Equinox module is the same method step)")
def test_a_pytree_self_given_back_changed_is_state():
    xs = data(8, 2)
    for Agent in _agents():
        (ra,), (rinfo,) = jit_loop(Agent.update, (Agent(jnp.zeros(2)),), (xs,), 8)
        step = autoflat.step(Agent.update, num_steps=K)
        (a,), (info,) = step_loop(step, (Agent(jnp.zeros(2)),), (xs,), 8, K)
        tree_allclose((a.w, info["loss"]), (ra.w, rinfo["loss"]), rtol=1e-6)
        assert role_line(step, "self") == (
            "state (matched by value to return position 0) [rule: matched-by-value]"
        )
    # an Equinox module's bound method (Equinox's BoundMethod): the same method step
    b, losses = Agent(jnp.zeros(2)), []
    for start in (0, K):
        b, info = autoflat.step(b.update, num_steps=K)(xs[start : start + K])
        losses.append(info["loss"])
    tree_allclose((b.w, jnp.concatenate(losses)), (ra.w, rinfo["loss"]), rtol=1e-6)


@claim(
    PAGE,
    "where some leaf at that position is its own or computed by an operation taking its own arrays (gradients alike `self`, from a helper method, are not)",
)
def test_gradients_alike_self_from_a_helper_method_are_not_self():
    from flax import struct

    class Agent(struct.PyTreeNode):
        w: jax.Array

        def loss_and_grad(self, x):
            return jax.value_and_grad(lambda a: jnp.sum((a.w * x - 1.0) ** 2))(self)

        def grads(self, x):
            loss, g = self.loss_and_grad(x)
            return loss, g

    agent = Agent(jnp.arange(3.0))
    xs = data(K, 3)
    step = autoflat.step(Agent.grads, num_steps=K)
    _, got = step(agent, xs)
    want = jnp.stack([jax.jit(Agent.grads)(agent, x)[1].w for x in xs])  # all at the same agent
    tree_allclose(got.w, want, rtol=1e-6)
    assert role_line(step, "self").startswith("broadcast (the method's instance")


@claim(PAGE, "`t.lr = 0.1` between calls of a method step | seen: a recompile")
@claim(
    PAGE,
    "When it is a plain object (not a pytree), the values of the attributes its body reads (`self.lr`, `self.target`) select the compiled version, as static arguments do: `t.lr = 0.1` between calls recompiles (and the recompile warning names `self.lr`) instead of being ignored.",
)
def test_a_plain_selfs_attributes_select_the_compiled_version():
    class Trainer:
        def __init__(self):
            self.lr = 0.5
            self.target = jnp.zeros(2)

        @autoflat.step
        def train(self, p):
            p = p - self.lr * (p - self.target)
            return p

    t = Trainer()
    p = t.train(jnp.ones(2))
    np.testing.assert_allclose(p, [0.5, 0.5])
    t.lr = 0.1
    np.testing.assert_allclose(t.train(jnp.ones(2)), [0.9, 0.9], rtol=1e-6)  # seen
    t.target = jnp.ones(2)
    np.testing.assert_allclose(t.train(jnp.zeros(2)), [0.1, 0.1], rtol=1e-6)
    assert autoflat.stats(Trainer.train).traces == 3
    with pytest.warns(autoflat.AutoflatRecompileWarning, match=r"`self\.lr`"):
        for i in range(8):
            t.lr = 1.0 / 2 ** (i + 2)
            t.train(p)


@claim(
    PAGE,
    "Only attributes the instance holds itself are watched: attributes read only through other objects, and class attributes and methods (`self.SCALE`, `self.helper(x)`), are read when the step is traced and not watched.",
)
@claim(
    PAGE,
    "After the first call, `show()` says which are which: `# self: broadcast (the method's instance; a new value of self.lr recompiles; self.helper (of the class: read when traced, not watched))`",
)
def test_class_attributes_and_other_objects_are_not_watched():
    class Config:
        def __init__(self):
            self.shift = 0.0

    class Trainer:
        SCALE = 2.0

        def __init__(self):
            self.lr = 0.5
            self.config = Config()

        def helper(self, x):
            return x * self.SCALE + self.config.shift

        @autoflat.step
        def train(self, p):
            return p - self.lr * self.helper(p)

    t = Trainer()
    assert (
        role_line(Trainer.train, "self")
        == "broadcast (the method's instance) [rule: option-or-self]"
    )
    np.testing.assert_allclose(t.train(jnp.ones(2)), [0.0, 0.0])
    assert role_line(Trainer.train, "self") == (
        "broadcast (the method's instance; a new value of self.lr recompiles; self.helper (of "
        "the class: read when traced, not watched)) [rule: option-or-self]"
    )
    Trainer.SCALE = 1.0  # a class attribute: not watched, the program traced with 2.0 runs
    t.config.shift = 1.0  # read only through another object: not watched
    np.testing.assert_allclose(t.train(jnp.ones(2)), [0.0, 0.0])
    assert autoflat.stats(Trainer.train).traces == 1
    t.lr = 1.0  # watched: a recompile, which reads the others anew
    np.testing.assert_allclose(t.train(jnp.ones(2)), [-1.0, -1.0])
    assert autoflat.stats(Trainer.train).traces == 2


@claim(
    PAGE,
    "A pytree `self` (an Equinox module) passes its arrays in as broadcast inputs, as any broadcast argument: new array values do not recompile, a new structure or new static fields do, and `show()` says so.",
)
def test_a_pytree_selfs_arrays_are_inputs():
    import equinox as eqx

    class Model(eqx.Module):
        w: jax.Array
        scale: float = eqx.field(static=True)

        @autoflat.step
        def train(self, p):
            return p - self.w * self.scale

    np.testing.assert_allclose(Model(jnp.ones(2), 1.0).train(jnp.ones(2)), [0.0, 0.0])
    np.testing.assert_allclose(Model(3.0 * jnp.ones(2), 1.0).train(jnp.ones(2)), [-2.0, -2.0])
    assert autoflat.stats(Model.train).traces == 1  # new array values: no recompile
    np.testing.assert_allclose(Model(3.0 * jnp.ones(2), 2.0).train(jnp.ones(2)), [-5.0, -5.0])
    assert autoflat.stats(Model.train).traces == 2  # a new static field
    Model(3.0 * jnp.ones(3), 2.0).train(jnp.ones(3))
    assert autoflat.stats(Model.train).traces == 3  # a new structure (shape)
    assert role_line(Model.train, "self") == (
        "broadcast (the method's instance; a pytree: its arrays are inputs, its structure and "
        "static fields select the compiled version) [rule: option-or-self]"
    )


# === State by abstract value ================================================================


@claim(PAGE, "At the first call autoflat evaluates one step abstractly (a trace: no compile")
def test_the_first_call_evaluates_one_step_abstractly():
    compiles, counting = [], [False]

    def on_event(name, _duration, **_kwargs):
        if counting[0] and name == "/jax/core/compile/backend_compile_duration":
            compiles.append(name)

    jax.monitoring.register_event_duration_secs_listener(on_event)
    # The matching needs one step's abstract value: here it finds that return position 0
    # gives back one step's slice of `v` under another name, and refuses before any compile.
    v, xs = jnp.arange(4.0), data(K, 2)
    step = autoflat.step(_halved, num_steps=K)
    counting[0] = True
    try:
        with pytest.raises(autoflat.ShapeError, match="return position 0 gives back"):
            step(v, xs)
    finally:
        counting[0] = False
    assert compiles == [] and autoflat.stats(step).traces == 0  # evaluated, not compiled
    np.testing.assert_allclose(v, [0.0, 1.0, 2.0, 3.0])
    # a first call that runs: matched by value, one trace (the program itself)
    step = autoflat.step(_halved, num_steps=K)
    step(jnp.arange(3.0), data(K, 2))
    assert role_line(step, "v").startswith("state (matched by value")
    assert autoflat.stats(step).traces == 1


@claim(
    PAGE,
    "a weakly typed leaf (made from a Python number) also where the step gives it back promoted, as `lax.scan` promotes a carry, where more says the position is the new value: an addition whose first operand is its array (`(w, total + loss)` from `total = jnp.asarray(0)`), a value computed from it returned under its name or its name with `new`/`next` (`new_total = loss + total`), or a tree with named parts (a dict of episode counters) computed from it; a bare array only at its place. A weakly typed float32 leaf given back as bfloat16 is promoted too, as under `jax.jit`, where an addition whose first operand is its array makes it (`0.9 * ema + 0.1 * loss`, a bfloat16 loss).",
)
@claim(
    PAGE,
    "A container whose leaf shapes a return position has, but not its dtypes or container types (bfloat16 parameters updated with a float32 rate, a tuple of layers given back as a list), is not matched; where the same evidence says the position is its new value (for a container type, also every leaf computed from it or from per-step arguments alone: a list carry `[h, c]` given back as `(h, c)`), with `num_steps > 1` that is an `autoflat.OptionError`: a `lax.scan` carry keeps its types, so give the new value back as it came in, or name the argument `broadcast=` if that position is something else.",
)
def test_a_weak_leaf_matches_promoted_and_another_dtype_is_refused():
    def body(carry, x):
        w, total = carry
        loss = jnp.sum(x * w)
        return (w - 0.1 * loss, total + loss), loss

    xs = jnp.ones((4, 3))
    step = autoflat.step(body, num_steps=4)
    start = (jnp.ones(3), jnp.asarray(0))
    got, losses = step(start, xs)
    assert role_line(step, "carry").startswith("state (matched by value")
    want, want_losses = jax.lax.scan(body, start, xs)
    np.testing.assert_allclose(autoflat.unwrap(got)[1], want[1], rtol=1e-6)

    def renamed(w, total, x):
        new_total = jnp.sum(x * w) + total
        return w * 0.5, new_total

    def bf16_ema(w, ema, x):
        loss = jnp.sum(x * w).astype(jnp.bfloat16)
        return w * 0.5, 0.9 * ema + 0.1 * loss

    for fn, start in ((renamed, jnp.asarray(0)), (bf16_ema, jnp.asarray(0.1))):
        step = autoflat.step(fn, num_steps=4)
        got = step(jnp.ones(3), start, xs)
        assert role_line(step, fn.__code__.co_varnames[1]).startswith("state (matched by value")
        want = jax.lax.scan(lambda c, x, fn=fn: (fn(*c, x), None), (jnp.ones(3), start), xs)[0]
        tree_allclose(got, want, rtol=1e-6)

    def bf16(params, lr, x):
        g = jax.grad(lambda p: jnp.sum((x @ p["w"]) ** 2))(params)
        return jax.tree.map(lambda p, g: p - lr * g, params, g)

    def as_list(params, x):
        return [(w - 0.1 * x.sum(), b) for w, b in params]

    with pytest.raises(autoflat.OptionError, match="but not its dtypes"):
        autoflat.step(bf16, num_steps=4, broadcast="lr")(
            {"w": jnp.ones((3, 2), jnp.bfloat16)}, jnp.float32(0.1), jnp.ones((4, 5, 3))
        )
    with pytest.raises(autoflat.OptionError, match="but not its tree structure"):
        autoflat.step(as_list, num_steps=4)(((jnp.ones(2), jnp.zeros(2)),), jnp.ones((4, 3)))

    def lstm(w, carry, x):
        h, c = carry
        c = 0.5 * c + jnp.tanh(x * w + h)
        return w * 0.99, (jnp.tanh(c), c)

    with pytest.raises(autoflat.OptionError, match=r"\[\*, \*\] comes back as \(\*, \*\)"):
        autoflat.step(lstm, num_steps=4)(jnp.ones(3), [jnp.zeros(3), jnp.zeros(3)], xs)
    step = autoflat.step(lstm, num_steps=4)
    w, carry = step(jnp.ones(3), (jnp.zeros(3), jnp.zeros(3)), xs)  # as it came: carried
    want, _ = jit_loop(lstm, (jnp.ones(3), (jnp.zeros(3), jnp.zeros(3))), (xs,), 4)
    tree_allclose((w, carry), want, rtol=1e-6)


@claim(
    PAGE,
    "matches each return position that is not a parameter's name to the parameter whose tree structure, shapes and dtypes it equals",
)
@claim(PAGE, "a container or module matches at any position")
def test_a_container_matches_at_any_position():
    def update(p, w, x):
        new_p = {"a": p["a"] * 0.5 + x, "b": p["b"] + 1}
        w = w + 1.0
        return w, jnp.sum(x), new_p  # p (place 0) comes back at position 2

    start = (jnp.zeros(()), {"a": jnp.ones(3), "b": jnp.zeros((), jnp.int32)})
    xs = data(8, 3)
    ref = jax.jit(update)
    rw, rp, rl = start[0], start[1], []
    for x in xs:
        rw, loss, rp = ref(rp, rw, x)
        rl.append(loss)
    step = autoflat.step(update, num_steps=K)
    w, p, losses = start[0], start[1], []
    for c in (xs[:K], xs[K:]):
        w, loss, p = step(p, w, c)
        losses.append(loss)
    tree_allclose((w, p, jnp.concatenate(losses)), (rw, rp, jnp.stack(rl)))
    assert (
        role_line(step, "p")
        == "state (matched by value to return position 2) [rule: matched-by-value]"
    )


@claim(PAGE, "a bare array only at its own place among the parameters that could be state")
def test_a_bare_array_is_matched_only_at_its_own_place():
    def update(a, x):
        return jnp.sum(x * a), x[0] * a  # a's own place is 0; position 1 is alike

    xs = data(K, 3)
    step = autoflat.step(update, num_steps=K)
    sums, weighed = step(jnp.ones(3), xs)
    assert weighed.shape == (K, 3)  # a per-step output, stacked: `a` is not carried
    tree_allclose(weighed, xs[:, :1] * jnp.ones((K, 3)))
    tree_allclose(sums, jnp.sum(xs, axis=1), rtol=1e-5)
    assert role_line(step, "a").startswith("broadcast (")


@claim(
    PAGE,
    'With `num_steps > 1`, a bare array left unmatched where another open position has its shape and dtype and is computed from it (`return w, loss, step + 1` for `(w, step, x)`; not given back as it came, weighed by another value, `g * scale`, or gradients taken at it) is an `autoflat.OptionError` too, naming `state={"step": 2}` and `broadcast="step"`: broadcast, a step counter would stay at its first value.',
)
def test_a_bare_array_given_back_away_from_its_place_is_asked_about():
    def counted(w, step, x):
        loss, g = jax.value_and_grad(lambda w: jnp.sum((w * x - 1.0) ** 2))(w)
        return w - 0.1 * g, loss, step + 1  # step's place (1) holds the loss

    def doubled(a, x):
        return jnp.sum(x * a), a * 2.0

    def wrapped(w, step, x):  # (a counter wrapped: computed from it, not by an addition)
        loss, g = jax.value_and_grad(lambda w: jnp.sum((w * x - 1.0) ** 2))(w)
        return w - 0.1 * g, loss, (step + 1) % 3

    def scaled_back(w, scale, x):  # (weighed by another value: a per-step output)
        loss, g = jax.value_and_grad(lambda w: jnp.sum((w * scale * x - 1.0) ** 2))(w)
        return w - 0.1 * g, loss, g * scale

    xs = data(K, 3)
    args = (jnp.ones(3), jnp.int32(0), xs)
    with pytest.raises(autoflat.OptionError) as e:
        autoflat.step(counted, num_steps=K)(*args)
    message = str(e.value)
    assert "return position 2 (an expression) is made by an operation taking `step`'s" in message
    assert 'state={"step": 2}' in message and 'broadcast="step"' in message
    with pytest.raises(autoflat.OptionError, match=r'state=\{"a": 1\}'):
        autoflat.step(doubled, num_steps=K)(jnp.ones(3), xs)
    with pytest.raises(autoflat.OptionError, match=r"is computed from `step`"):
        autoflat.step(wrapped, num_steps=K)(*args)
    w, scale, outs = jnp.ones(3), jnp.full(3, 0.5), []
    for i in range(K):
        w, *out = jax.jit(scaled_back)(w, scale, xs[i])
        outs.append(out)
    want = (w, *(jnp.stack(o) for o in zip(*outs, strict=True)))
    got = autoflat.step(scaled_back, num_steps=K)(jnp.ones(3), scale, xs)
    tree_allclose(got, want, rtol=1e-5)
    step = autoflat.step(counted, num_steps=K, state={"step": 2})
    want = args[:2]
    losses = []
    for i in range(K):
        w, loss, n = jax.jit(counted)(*want, xs[i])
        want, losses = (w, n), [*losses, loss]
    w, loss, n = step(*args)
    tree_allclose((w, loss, n), (want[0], jnp.stack(losses), want[1]), rtol=1e-5)
    assert int(n) == K
    # at one step a call each position comes back as the body computed it: no question
    assert int(autoflat.step(counted, num_steps=1)(jnp.ones(3), jnp.int32(0), xs[0])[2]) == 1


@claim(
    PAGE,
    "and is not its array times a factor the step picks among constants, which the step also computes with, under a name other than its own or its new value's (`lr_t = lr * jnp.where(step < 2, 0.1, 1.0)` used in `w - lr_t * g`: a warmed-up rate returned to be logged, or a step schedule's next rate; `lr = lr * jnp.where(...)`, `new_lr`, the expression itself at its place, or a value only returned, `decayed_lr`, are carried)",
)
def test_a_rate_times_a_picked_factor_under_a_name_of_its_own_is_asked_about():
    def warmup(w, lr, step, x):
        lr_t = lr * jnp.where(step < 2, 0.1, 1.0)
        g = jax.grad(lambda w: jnp.sum((w * x - 1.0) ** 2))(w)
        return w - lr_t * g, lr_t, step + 1

    def decayed(w, lr, step, x):
        lr = lr * jnp.where(step % 2 == 1, 0.5, 1.0)
        g = jax.grad(lambda w: jnp.sum((w * x - 1.0) ** 2))(w)
        return w - lr * g, lr, step + 1

    def decayed_new(w, lr, step, x):
        new_lr = lr * jnp.where(step % 2 == 1, 0.5, 1.0)
        g = jax.grad(lambda w: jnp.sum((w * x - 1.0) ** 2))(w)
        return w - lr * g, new_lr, step + 1

    def decayed_inline(w, lr, step, x):
        g = jax.grad(lambda w: jnp.sum((w * x - 1.0) ** 2))(w)
        return w - lr * g, lr * jnp.where(step % 2 == 1, 0.5, 1.0), step + 1

    def decayed_only_returned(w, lr, step, x):
        g = jax.grad(lambda w: jnp.sum((w * x - 1.0) ** 2))(w)
        decayed_lr = lr * jnp.where(step % 2 == 1, 0.5, 1.0)
        return w - lr * g, decayed_lr, step + 1

    def warmup_selected(w, lr, step, x):  # (the same warmup as a select between multiples)
        lr_t = jnp.where(step < 2, lr * 0.1, lr)
        g = jax.grad(lambda w: jnp.sum((w * x - 1.0) ** 2))(w)
        return w - lr_t * g, lr_t, step + 1

    xs = data(K, 3)
    start = (jnp.ones(3), jnp.float32(0.1), jnp.int32(0))
    for fn in (warmup, warmup_selected):
        with pytest.raises(autoflat.OptionError) as e:
            autoflat.step(fn, num_steps=K)(*start, xs)
        assert "`lr` times a factor the step picks among constants" in str(e.value)
        assert 'broadcast="lr"' in str(e.value)
    for fn in (decayed, decayed_new, decayed_inline, decayed_only_returned):
        want = start
        for i in range(K):
            want = jax.jit(fn)(*want, xs[i])
        step = autoflat.step(fn, num_steps=K)
        tree_allclose(step(*start, xs), want, rtol=1e-5)
        assert role_line(step, "lr").startswith("state ("), fn.__name__


def _sharded_adam(w, opt_state, x):
    import equinox as eqx

    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    g = jax.grad(lambda w: jnp.sum((w * x - 1.0) ** 2))(w)
    updates, opt_state = optax.adam(0.1).update(g, opt_state)
    w = optax.apply_updates(w, updates)
    return eqx.filter_shard((w, opt_state), sharding)


@claim(
    PAGE,
    "so that `return eqx.filter_shard((model, opt_state), sharding)` gives back its items as `return model, opt_state` does",
)
def test_a_tuple_returned_through_a_sharding_constraint_gives_back_its_items():
    xs = data(8, 3)
    start = (jnp.zeros(3), optax.adam(0.1).init(jnp.zeros(3)))
    step = autoflat.step(_sharded_adam, num_steps=K)
    assert role_line_after(step, start, xs[:K], "w") == (
        "state (matched by value to return position 0) [rule: matched-by-value]"
    )
    (ref_w, ref_s), _ = jit_loop(_sharded_adam, start, (xs,), 8)
    (got_w, got_s), _ = step_loop(autoflat.step(_sharded_adam, num_steps=K), start, (xs,), 8, K)
    tree_allclose((got_w, got_s), (ref_w, ref_s), rtol=1e-6)


def role_line_after(step, start, x, name):
    """`name`'s header line after one call."""
    step(*start, x)
    return role_line(step, name)


@jax.jit
def _jitted_helper(w, m, x):
    g = jax.grad(lambda w: jnp.sum((w * x - 1.0) ** 2))(w)
    return w - 0.1 * g, m + g


@claim(
    PAGE,
    "the last operation making the position takes its array or its array times a constant (`w - lr * g`, `step + 1`, `mn = 0.9 * m + 0.1 * g` as Adam keeps its moments; the step's data flow, read into `jax.jit`-ed helpers and through sharding constraints,",
)
@claim(
    PAGE,
    "a product giving a scalar takes only a multiple: `reg = wd * jnp.sum(w ** 2)` weighs `wd`)",
)
def test_a_bare_array_whose_last_operation_takes_its_array_is_matched():
    def sgd(w, lr, x):
        g = jax.grad(lambda w: jnp.sum((w * x - 1.0) ** 2))(w)
        a = w - lr * g
        return a, jnp.sum(g)

    def counted(w, step, x):
        a = w - 0.1 * x
        b = step + 1
        return a, b

    def helped(w, m, x):
        a, b = _jitted_helper(w, m, x)
        return a, b

    def averaged(w, m, x):
        g = jax.grad(lambda w: jnp.sum((w * x - 1.0) ** 2))(w)
        mn = 0.9 * m + 0.1 * g
        return w - 0.1 * mn, mn

    xs = data(8, 3)
    cases = (
        (sgd, (jnp.zeros(3),), (0.1,), {"w": 0}),  # a Python float lr: static
        (counted, (jnp.zeros(3), jnp.zeros((), jnp.int32)), (), {"w": 0, "step": 1}),
        (helped, (jnp.zeros(3), jnp.zeros(3)), (), {"w": 0, "m": 1}),
        (averaged, (jnp.zeros(3), jnp.zeros(3)), (), {"w": 0, "m": 1}),
    )
    for fn, start, rest, matched in cases:
        if fn is sgd:  # lr between the state and the per-step input
            ref_state, ref_out = start, []
            for x in xs:
                a, o = jax.jit(fn)(*ref_state, *rest, x)
                ref_state, ref_out = (a,), [*ref_out, o]
            step = autoflat.step(fn, num_steps=K)
            state, outs = start, []
            for c in (xs[:K], xs[K:]):
                a, o = step(*state, *rest, c)
                state, outs = (a,), [*outs, o]
            tree_allclose(
                (state, jnp.concatenate(outs)), (ref_state, jnp.stack(ref_out)), rtol=1e-5
            )
        else:
            ref_state, _ = jit_loop(fn, start, (xs,), 8)
            step = autoflat.step(fn, num_steps=K)
            state, _ = step_loop(step, start, (xs,), 8, K)
            tree_allclose(state, ref_state, rtol=1e-5)
        for name, pos in matched.items():
            assert role_line(step, name) == (
                f"state (matched by value to return position {pos}) [rule: matched-by-value]"
            ), (fn.__name__, name)


@claim(
    PAGE,
    "or the returned name is its own, with a word for new, or without a word for previous (`new_v`, `v2`, `loss` for `prev_loss`; a name only sharing a word, `kl` beside `kl_weight` or `loss` beside `loss_scale`, says nothing)",
)
def test_a_bare_array_whose_returned_name_shares_a_word_is_matched():
    def halved(v, x):  # shape (3,): `v2` shares a word with `v`
        v2 = v * 0.5 + x.sum()
        return v2

    def renamed(w, v, x):
        new_v = jnp.tanh(v) * 2.0
        w = w + x
        return w, new_v

    def adaptive(w, prev_loss, x):
        loss, g = jax.value_and_grad(lambda w: jnp.sum((w * x - 1.0) ** 2))(w)
        lr = jnp.where(loss < prev_loss, 0.1, 0.01)
        return w - lr * g, loss

    xs = data(8, 3)
    cases = (
        (halved, (jnp.arange(3.0),), "v", 0),
        (renamed, (jnp.zeros(3), jnp.ones(3)), "v", 1),
        (adaptive, (jnp.zeros(3), jnp.float32(jnp.inf)), "prev_loss", 1),
    )
    for fn, start, name, pos in cases:
        ref_state, _ = jit_loop(fn, start, (xs,), 8)
        step = autoflat.step(fn, num_steps=K)
        state, _ = step_loop(step, start, (xs,), 8, K)
        tree_allclose(state, ref_state, rtol=1e-5)
        assert role_line(step, name) == (
            f"state (matched by value to return position {pos}) [rule: matched-by-value]"
        ), fn.__name__

    def weighted(w, kl_weight, x):  # (`kl` at `kl_weight`'s place: a metric, not its value)
        (loss, kl), g = jax.value_and_grad(
            lambda w: (jnp.sum((w * x - 1.0) ** 2) + kl_weight * jnp.sum(w**2), jnp.sum(w**2)),
            has_aux=True,
        )(w)
        return w - 0.1 * g, kl, loss

    def scaled(w, loss_scale, x):
        loss, g = jax.value_and_grad(lambda w: loss_scale * jnp.sum((w * x - 1.0) ** 2))(w)
        return w - 0.1 * g / loss_scale, loss / loss_scale

    for fn, name in ((weighted, "kl_weight"), (scaled, "loss_scale")):
        with pytest.raises(autoflat.OptionError) as e:
            autoflat.step(fn, num_steps=K)(jnp.zeros(3), jnp.float32(0.5), xs[:K])
        assert f'broadcast="{name}"' in str(e.value), fn.__name__
        step = autoflat.step(fn, num_steps=K, broadcast=name)
        w, outs = jnp.zeros(3), []
        for i in range(K):
            w, *out = jax.jit(fn)(w, jnp.float32(0.5), xs[i])
            outs.append(out)
        want = (w, *(jnp.stack(o) for o in zip(*outs, strict=True)))
        tree_allclose(step(jnp.zeros(3), jnp.float32(0.5), xs[:K]), want, rtol=1e-5)


@claim(
    PAGE,
    "or the position is an expression computed from it (`0.9 * v + g`) that does not weigh it by another value (`kd * temp**2` does)",
)
def test_a_bare_array_whose_position_is_an_expression_of_it_is_matched():
    def momentum(w, v, x):
        loss, g = jax.value_and_grad(lambda w: jnp.sum((w * x - 1.0) ** 2))(w)
        return w - 0.1 * (0.9 * v + g), 0.9 * v + g, loss

    def logged(w, temp, x):
        kd, g = jax.value_and_grad(lambda w: jnp.mean(jax.nn.sigmoid(x * w / temp) ** 2))(w)
        return w - 0.1 * g, kd * temp**2

    def weighed(w, wd, x):
        reg = wd * jnp.sum(w**2)
        return w - 0.1 * x * w, reg

    for fn, name in ((logged, "temp"), (weighed, "wd")):
        with pytest.raises(autoflat.OptionError) as e:
            autoflat.step(fn, num_steps=K)(jnp.ones(3), jnp.float32(2.0), data(K, 3))
        assert f'broadcast="{name}"' in str(e.value)

    xs = data(8, 3)
    ref_state, (rl,) = jit_loop(momentum, (jnp.zeros(3), jnp.zeros(3)), (xs,), 8)
    step = autoflat.step(momentum, num_steps=K)
    state, (losses,) = step_loop(step, (jnp.zeros(3), jnp.zeros(3)), (xs,), 8, K)
    tree_allclose((state, losses), (ref_state, rl), rtol=1e-5)
    assert (
        role_line(step, "v")
        == "state (matched by value to return position 1) [rule: matched-by-value]"
    )


@claim(
    PAGE,
    'Else (a `loss` at the place of an `lr` or a `wd` argument, or such an extreme returned as an expression) it is an `autoflat.OptionError` that offers `broadcast="lr"` or a Python float (the same every step), and `state={"lr": 2}` only for a value the step overwrites every step',
)
def test_a_loss_at_a_learning_rates_place_is_an_option_error():
    tx = optax.scale_by_adam()

    def train_step(params, opt_state, batch, lr):
        loss, g = jax.value_and_grad(lambda p: jnp.mean((batch @ p["w"] - 1.0) ** 2))(params)
        updates, opt_state = tx.update(g, opt_state, params)
        params = jax.tree.map(lambda p, u: p - lr * u, params, updates)
        return params, opt_state, loss

    def decayed(params, opt_state, batch, wd):
        def loss_fn(p):
            return jnp.mean((batch @ p["w"] - 1.0) ** 2) + wd * jnp.sum(p["w"] ** 2)

        loss, g = jax.value_and_grad(loss_fn)(params)
        u, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, u), opt_state, loss

    p0 = {"w": jnp.zeros(3)}
    xs = data(4, 8, 3)
    with pytest.raises(autoflat.OptionError) as info:
        autoflat.step(train_step, num_steps=2)(p0, tx.init(p0), xs[:2], jnp.float32(0.01))
    message = str(info.value)
    assert (
        "return position 2 (`loss`, not computed from `lr`) could be the new value of `lr`"
        in message
    )
    fixes = message.index('broadcast="lr"'), message.index("Python float")
    assert max(fixes) < message.index('state={"lr": 2}')  # state= last, only for an overwrite
    with pytest.raises(autoflat.OptionError, match=r"\(`loss`, computed from `wd`\)") as info:
        autoflat.step(decayed, num_steps=2)(p0, tx.init(p0), xs[:2], jnp.float32(1e-3))
    assert 'broadcast="wd"' in str(info.value)
    # both fixes offered first train as jax.jit does
    ref_state, (rl,) = jit_loop(train_step, (p0, tx.init(p0)), (xs,), 4, (jnp.float32(0.01),))
    for step, lr in (
        (autoflat.step(train_step, num_steps=2, broadcast="lr"), jnp.float32(0.01)),
        (autoflat.step(train_step, num_steps=2), 0.01),
    ):
        state, (losses,) = step_loop(step, (p0, tx.init(p0)), (xs,), 4, 2, (lr,))
        tree_allclose((state, losses), (ref_state, rl), rtol=1e-5)


@claim(
    PAGE,
    "A maximum or a minimum taking its array as it came (or a `jnp.clip` by it, or a select by a comparison with it, `jnp.where(loss < floor, floor, loss)`; not AdaMax's `jnp.maximum(0.999 * u, jnp.abs(g))`) that the step only returns counts only under its own name or its new one (`best = jnp.minimum(best, loss)`, `new_best`, `vhat` for `v_hat`) or a name sharing a word for an extreme with it (`best`, `max`, `min`, `peak`: `new_best` for `best_loss`, `running_max` for `max_gnorm`): the same operation is a running best (`jnp.minimum(best, loss)`) or a clamp's fixed bound (`jnp.maximum(floor, loss)`, the clamped loss logged); one the step computes with (AMSGrad's `v_hat_t` in the update) counts as any. Else (a `loss` at the place of an `lr` or a `wd` argument, or such an extreme returned as an expression) it is an `autoflat.OptionError`",
)
def test_a_maximum_or_minimum_at_a_bare_arrays_place_counts_only_under_its_name():
    def loss_of(w, x):
        return jnp.mean((x * w - 1.0) ** 2)

    def clamped(w, floor, x):
        return w * 0.9, jnp.maximum(floor, loss_of(w, x))

    def best_by_name(w, best, x):
        best = jnp.minimum(best, loss_of(w, x))
        return w * 0.9, best

    def new_best(w, best, x):
        new_best = jnp.minimum(best, loss_of(w, x))
        return w * 0.9, new_best

    xs = data(4, 3)
    start = (jnp.ones(3), jnp.float32(0.5))
    with pytest.raises(autoflat.OptionError) as info:
        autoflat.step(clamped, num_steps=K)(*start, xs)
    assert "It is a maximum or a minimum taking `floor`" in str(info.value)
    assert 'broadcast="floor"' in str(info.value)
    w, logged = start[0], []
    for x in xs:
        w, out = jax.jit(clamped)(w, start[1], x)
        logged.append(out)
    got = autoflat.step(clamped, num_steps=K, broadcast="floor")(*start, xs)
    tree_allclose(got, (w, jnp.stack(logged)))
    for fn in (best_by_name, new_best):
        want, _ = jit_loop(fn, start, (xs,), K)
        step = autoflat.step(fn, num_steps=K)
        tree_allclose(step(*start, xs), want)
        assert role_line(step, "best").startswith("state"), fn.__name__

    def clipped(w, floor, x):
        return w * 0.9, jnp.clip(loss_of(w, x), floor, 10.0)

    def selected(w, floor, x):
        loss = loss_of(w, x)
        return w * 0.9, jnp.where(loss < floor, floor, loss)

    def amsgrad(w, v_hat, x):
        g = jax.grad(loss_of)(w, x)
        vhat = jnp.maximum(v_hat, g**2)
        return w - 0.1 * g / (jnp.sqrt(vhat) + 1e-3), vhat

    for fn in (clipped, selected):
        with pytest.raises(autoflat.OptionError, match="a maximum or a minimum taking `floor`"):
            autoflat.step(fn, num_steps=K)(*start, xs)

    def adamax(w, u, x):  # (its decayed own value: no clamp's bound)
        g = jax.grad(loss_of)(w, x)
        u_t = jnp.maximum(0.999 * u, jnp.abs(g))
        return w * 0.9, u_t

    def early_stopping(w, best_loss, x):
        loss = loss_of(w, x)
        new_best = jnp.where(loss < best_loss, loss, best_loss)
        return w * 0.9, new_best

    def tracked(w, max_gnorm, x):
        running_max = jnp.maximum(max_gnorm, jnp.linalg.norm(jax.grad(loss_of)(w, x)))
        return w * 0.9, running_max

    def floored(w, loss_floor, x):  # (`loss` shares no word for an extreme with it)
        loss = jnp.maximum(loss_of(w, x), loss_floor)
        return w * 0.9, loss

    cases = ((amsgrad, jnp.zeros(3)), (adamax, jnp.zeros(3)), (early_stopping, 9.0), (tracked, 0.0))
    for fn, second in cases:
        start = (jnp.ones(3), jnp.asarray(second, jnp.float32))
        want, _ = jit_loop(fn, start, (xs,), K)
        step = autoflat.step(fn, num_steps=K)
        tree_allclose(step(*start, xs), want)
        second_name = list(inspect.signature(fn).parameters)[1]
        assert role_line(step, second_name).startswith("state"), fn.__name__
    with pytest.raises(autoflat.OptionError, match="`loss` is neither `loss_floor` nor"):
        autoflat.step(floored, num_steps=K)(jnp.ones(3), jnp.float32(0.5), xs)


@claim(
    PAGE,
    "The exception is a PRNG key (a typed key, or a raw `uint32[2]` one), which also matches a position no other parameter fits (`return state, metrics, new_dropout_rng`, as Hugging Face's Flax steps carry their dropout key)",
)
@pytest.mark.parametrize("make_key", [jax.random.key, jax.random.PRNGKey], ids=["typed", "raw"])
def test_a_key_matches_a_position_no_other_parameter_fits(make_key):
    tx = optax.sgd(0.1)

    def train_step(params, opt_state, x, dropout_rng):
        dropout_rng, new_dropout_rng = jax.random.split(dropout_rng)

        def loss_fn(p):
            keep = jax.random.bernoulli(dropout_rng, 0.5, x.shape)
            return jnp.mean((x * keep * p["w"] - 1.0) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        metrics = {"loss": loss}
        return optax.apply_updates(params, updates), opt_state, metrics, new_dropout_rng

    p0, xs = {"w": jnp.ones(3)}, data(8, 3)
    ref = jax.jit(train_step)
    rp, rs, rkey, rl = p0, tx.init(p0), make_key(0), []
    for x in xs:
        rp, rs, m, rkey = ref(rp, rs, x, rkey)
        rl.append(m["loss"])
    step = autoflat.step(train_step, num_steps=K)
    p, s, key, losses = p0, tx.init(p0), make_key(0), []
    for c in (xs[:K], xs[K:]):
        p, s, m, key = step(p, s, c, key)
        losses.append(m["loss"])
    tree_allclose((p, jnp.concatenate(losses)), (rp, jnp.stack(rl)), rtol=1e-5)
    same_keys(key, rkey) if make_key is jax.random.key else np.testing.assert_array_equal(key, rkey)
    assert role_line(step, "dropout_rng") == (
        "state (matched by value to return position 3) [rule: matched-by-value]"
    )


@claim(PAGE, "one candidate: it is state")
@claim(
    PAGE,
    "several alike (`ema_params` and `params`, a GAN's two models of one shape, an online network and its target): each position goes to the parameter it is computed from (the step's data flow, read off its jaxpr",
)
def test_alike_parameters_follow_data_flow():
    def gan(generator, discriminator, x):
        new_d = {"w": discriminator["w"] * 0.9 + x}
        new_g = {"w": generator["w"] - 0.1 * x}
        return new_d, new_g  # the order of neither the parameters nor their names

    start = ({"w": jnp.ones(3)}, {"w": jnp.full(3, 3.0)})
    xs = data(8, 3)
    ref = jax.jit(gan)
    rg, rd = start
    for x in xs:
        rd, rg = ref(rg, rd, x)
    step = autoflat.step(gan, num_steps=K)
    g, d = start
    for c in (xs[:K], xs[K:]):
        d, g = step(g, d, c)
    tree_allclose((g, d), (rg, rd), rtol=1e-5)
    assert role_line(step, "generator") == (
        "state (matched by value and data flow to return position 1) [rule: matched-by-value]"
    )
    assert role_line(step, "discriminator") == (
        "state (matched by value and data flow to return position 0) [rule: matched-by-value]"
    )


@claim(
    PAGE,
    "where each is computed from several, to the one whose own arrays the last operation takes, `online + updates` beside a target read in the loss",
)
def test_an_online_network_beside_its_target():
    tx = optax.sgd(0.1)

    def train_step(online, target, opt_state, x, y):
        tgt = y + 0.5 * (x @ target["w"])
        loss, g = jax.value_and_grad(
            lambda p: jnp.mean((x @ p["w"] + p["b"] - jax.lax.stop_gradient(tgt)) ** 2)
        )(online)
        updates, opt_state = tx.update(g, opt_state, online)
        return optax.apply_updates(online, updates), opt_state, loss

    online = {"w": jnp.full((3, 1), 0.1), "b": jnp.zeros(1)}
    target = {"w": jnp.full((3, 1), 0.3), "b": jnp.zeros(1)}
    xs, ys = data(8, 5, 3), data(8, 5, 1, seed=1)
    ref = jax.jit(train_step)
    ro, rs, rl = online, tx.init(online), []
    for i in range(8):
        ro, rs, loss = ref(ro, target, rs, xs[i], ys[i])
        rl.append(loss)
    step = autoflat.step(train_step, num_steps=K)
    o, s, losses = online, tx.init(online), []
    for start in (0, K):
        o, s, loss = step(o, target, s, xs[start : start + K], ys[start : start + K])
        losses.append(loss)
    tree_allclose((o, jnp.concatenate(losses)), (ro, jnp.stack(rl)), rtol=1e-5)
    assert role_line(step, "online") == (
        "state (matched by value and data flow to return position 0) [rule: matched-by-value]"
    )
    assert role_line(step, "target") == (
        "broadcast (no leading axis of num_steps=4 at the first call) [rule: no-leading-axis]"
    )


@claim(
    PAGE,
    "else to the parameter whose name shares most words with the returned name (`new_ema` and `ema_params`); parameters left over are broadcast, and parameter order alone is not taken as evidence",
)
def test_alike_parameters_follow_names_then_are_left_broadcast():
    def ema(ema_params, params, x):  # each new value computed from both: names decide
        new_params = {"w": 0.5 * (params["w"] - ema_params["w"]) + x}
        new_ema = {"w": 0.5 * (ema_params["w"] + params["w"])}
        return new_params, new_ema

    start = ({"w": jnp.zeros(3)}, {"w": jnp.ones(3)})
    xs = data(8, 3)
    ref = jax.jit(ema)
    re, rp = start
    for x in xs:
        rp, re = ref(re, rp, x)
    step = autoflat.step(ema, num_steps=K)
    e, p = start
    for c in (xs[:K], xs[K:]):
        p, e = step(e, p, c)
    tree_allclose((e, p), (re, rp), rtol=1e-5)
    assert role_line(step, "ema_params") == (
        "state (matched by value and name to return position 1) [rule: matched-by-value]"
    )
    assert role_line(step, "params") == (
        "state (matched by value and name to return position 0) [rule: matched-by-value]"
    )

    def three(a, b, x, c):  # three alike, two positions alike: `c` is computed into neither
        return {"w": a["w"] + x}, {"w": b["w"] * 2.0}, jnp.sum(c["w"])

    start = ({"w": jnp.ones(3)}, {"w": jnp.ones(3)})
    step = autoflat.step(three, num_steps=K)
    (a, b), _ = step_loop(step, start, (data(8, 3),), 8, K, ({"w": jnp.ones(3)},))
    (ra, rb), _ = jit_loop(three, start, (data(8, 3),), 8, ({"w": jnp.ones(3)},))
    tree_allclose((a, b), (ra, rb), rtol=1e-5)
    assert role_line(step, "c").startswith("broadcast (")


@claim(
    PAGE,
    'Anything else is an `autoflat.OptionError` that lists the candidates and the `state={"p": 0}` that settles it',
)
def test_alike_parameters_with_no_evidence_are_an_option_error():
    def anonymous(a, b, x):  # each computed from both, names that say nothing
        c = {"w": a["w"] + b["w"] + x}
        d = {"w": a["w"] - b["w"]}
        return c, d

    start = ({"w": jnp.ones(3)}, {"w": jnp.full(3, 3.0)})
    with pytest.raises(
        autoflat.OptionError, match=r"could each be the new value of `a`, `b`"
    ) as info:
        autoflat.step(anonymous, num_steps=2)(*start, data(2, 3))
    assert 'state={"a": <position>, "b": <position>}' in str(info.value)
    step = autoflat.step(anonymous, num_steps=2, state={"a": 0, "b": 1})
    (a, b), _ = step_loop(step, start, (data(4, 3),), 4, 2)
    (ra, rb), _ = jit_loop(anonymous, start, (data(4, 3),), 4)
    tree_allclose((a, b), (ra, rb), rtol=1e-5)


def _loss_aux(params, x):
    pred = jnp.tanh(x @ params["w"] + params["b"])
    return jnp.mean(pred**2), pred


def _by_name(params, x):
    (loss, _), grads = jax.value_and_grad(_loss_aux, has_aux=True)(params, x)
    return loss, grads


def _through_grad_fn(params, x):
    grad_fn = jax.value_and_grad(_loss_aux, has_aux=True)
    (loss, _), grads = grad_fn(params, x)
    return grads, loss


def _aux_by_position(params, x):
    grads, _ = jax.grad(_loss_aux, 0, True)(params, x)
    return jnp.sum(x), grads


def _returned_as_called(params, x):
    return jax.grad(lambda p: _loss_aux(p, x)[0])(params), jnp.sum(x)


def _equinox_grad(params, x):
    import equinox as eqx

    grads = eqx.filter_grad(lambda p: _loss_aux(p, x)[0])(params)
    return grads, jnp.sum(x)


def _nnx_grad(params, x):
    from flax import nnx

    grads = nnx.grad(lambda p: _loss_aux(p, x)[0])(params)
    return grads, jnp.sum(x)


def _rebound(params, x):
    grads = jax.grad(lambda p: jnp.sum((x @ p["w"] + p["b"]) ** 2))(params)
    grads = jax.tree.map(lambda g: jnp.clip(g, -1.0, 1.0), grads)
    return grads


def _mapped_anew(params, x):
    grads = jax.grad(lambda p: jnp.sum((x @ p["w"] + p["b"]) ** 2))(params)
    updates = jax.tree.map(lambda g: -0.1 * g, grads)
    return updates


def _optimizer_updates(params, x):
    grads = jax.grad(lambda p: jnp.sum((x @ p["w"] + p["b"]) ** 2))(params)
    updates, _ = optax.sgd(0.1).update(grads, optax.sgd(0.1).init(params))
    return updates


@claim(
    PAGE,
    "gradients are not the new value of the parameters they are taken at: a returned name only ever bound to what a gradient transformation's function gives (`loss, grads = jax.value_and_grad(loss_fn)(params, x)`, also through `grad_fn = jax.value_and_grad(...)`, with `has_aux` by name or by position, or `eqx.filter_grad` and `nnx.grad`; also mapped leaf by leaf alone, `grads = jax.tree.map(clip, grads)`, `updates = jax.tree.map(lambda g: -lr * g, grads)`, where mapped with another tree, `jax.tree.map(lambda g, m: 0.9 * m + g, grads, momentum)`, it may be that tree's new value; and an optimizer's updates of them, `updates, opt_state = tx.update(grads, opt_state)`: an optax optimizer's always, another optimizer's unless the operation making them last takes the parameters' own arrays, as a hand-written `update` giving `p - lr * g` does), or such a call returned as it is, does not match the parameters passed to that call, however alike",
)
@claim(
    PAGE,
    "`return loss, grads` leaves `params` broadcast (at `num_steps=4`, four steps' gradients at the same params)",
)
@pytest.mark.parametrize(
    "fn",
    [
        _by_name,
        _through_grad_fn,
        _aux_by_position,
        _returned_as_called,
        _equinox_grad,
        _nnx_grad,
        _rebound,
        _mapped_anew,
        _optimizer_updates,
    ],
)
def test_gradients_are_not_the_new_value_of_their_parameters(fn):
    params = {"w": jnp.ones((3, 2)), "b": jnp.full((2,), 0.5)}
    xs = data(K, 5, 3)
    want = [jax.jit(fn)(params, x) for x in xs]  # each step at the same params
    step = autoflat.step(fn, num_steps=K)
    got = step(params, xs)
    tree_allclose(got, jax.tree.map(lambda *a: jnp.stack(a), *want), rtol=1e-5)
    assert role_line(step, "params").startswith("broadcast (")
    assert float(params["w"][0, 0]) == 1.0  # not donated: still usable


@claim(
    PAGE,
    "It may match another parameter: `return params, g` carries `g` as the new value of a `prev_g`.",
)
@claim(
    PAGE,
    "A name computed from the gradients (`new = jax.tree.map(lambda p, g: p - lr * g, params, grads)`) is matched as usual",
)
def test_gradients_may_be_another_parameters_new_value():
    def loss(p, x):
        return jnp.sum((p["w"] * x - 1.0) ** 2)

    def previous(params, prev_g, x):
        g = jax.grad(loss)(params, x)
        d = jax.tree.map(lambda a, b: a + 0.5 * b, g, prev_g)
        params = jax.tree.map(lambda p, u: p - 0.1 * u, params, d)
        return params, g

    def computed(params, x):
        grads = jax.grad(loss)(params, x)
        new = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
        return new, grads

    xs = data(8, 3)
    for fn, start, name in (
        (previous, ({"w": jnp.arange(3.0)}, {"w": jnp.ones(3)}), "prev_g"),
        (computed, ({"w": jnp.arange(3.0)},), "params"),
    ):
        ref_state, ref_out = jit_loop(fn, start, (xs,), 8)
        step = autoflat.step(fn, num_steps=K)
        state, out = step_loop(step, start, (xs,), 8, K)
        tree_allclose((state, out), (ref_state, ref_out), rtol=1e-5)
        assert role_line(step, name).startswith("state (matched by value"), fn.__name__


@claim(
    PAGE,
    "a parameter named in `state=` that no position matches is an error: state is never carried unchanged because nothing gave it back",
)
def test_state_option_that_no_position_matches_is_an_error():
    def update(p, x):
        return jnp.sum(p * x)

    step = autoflat.step(update, num_steps=K, state="p")
    p = jnp.ones(3)
    with pytest.raises(autoflat.OptionError, match="`p` is named in state= but no `return`"):
        step(p, data(K, 3))
    np.testing.assert_allclose(p, 1.0)
    assert autoflat.stats(step).traces == 0


def _adam_update(params, opt_state, x):
    tx = optax.adam(0.1)
    loss, grads = jax.value_and_grad(lambda p: jnp.mean((x[:3] * p["w"] - 1.0) ** 2))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def _varying_update(params, opt_state, x):
    result = _adam_update(params, opt_state, x)
    return result if x.shape[-1] == 3 else (*result, jnp.zeros(()))


def _returns_a_call(params, opt_state, x):
    return _varying_update(params, opt_state, x)


@claim(
    PAGE,
    "`return update(params, opt_state, batch)` (a helper returning the new pair and the loss) | the tuple's items are the return positions: `params` and `opt_state` matched by value, state",
)
@claim(
    PAGE,
    "a step that returns one expression whose value is a tuple (`return update(params, opt_state, batch)`, `return result`) has the tuple's items as its return positions when no parameter is the whole value and state is among the items",
)
@claim(PAGE, "`show()` prints `_af_ret0, _af_ret1, _af_ret2 = update(...)` before the return")
@claim(PAGE, "A later trace whose tuple has another length raises Python's unpacking error.")
@claim(PAGE, '`state={"params": 0, "opt_state": 1}` counts positions along those items too')
def test_a_returned_tuple_has_its_items_as_return_positions():
    params, xs = {"w": jnp.zeros(3)}, data(8, 3)
    (rp, rs), (rl,) = jit_loop(_returns_a_call, (params, optax.adam(0.1).init(params)), (xs,), 8)
    for options in ({}, {"state": {"params": 0, "opt_state": 1}}):
        step = autoflat.step(_returns_a_call, num_steps=K, **options)
        (p, s), (losses,) = step_loop(step, (params, optax.adam(0.1).init(params)), (xs,), 8, K)
        assert autoflat.is_handle(p) and autoflat.is_handle(s)
        tree_allclose((p, s, losses), (rp, rs, rl), rtol=1e-5)
        how = "state= at" if options else "matched by value to"
        assert role_line(step, "params").startswith(f"state ({how} return position 0)")
        assert role_line(step, "opt_state").startswith(f"state ({how} return position 1)")
        assert "_af_ret0, _af_ret1, _af_ret2 = _varying_update(params, opt_state, x)" in (
            autoflat.show(step)
        )
        with pytest.raises(ValueError, match="too many values to unpack"):
            step(p, s, data(K, 4))  # another trace: a tuple of 4


@claim(
    PAGE,
    '`return {"params": params, "opt_state": opt_state, "loss": loss}` | the dict\'s values are the return positions: state by value, the loss a per-step output',
)
@claim(
    PAGE,
    'a returned dict with string or integer keys (`return {"params": params, "opt_state": opt_state, "step": step + 1, "loss": loss}`) likewise has its values as return positions, in sorted key order',
)
@claim(
    PAGE,
    "(`show()` prints `_af_items(..., ('loss', 'opt_state', 'params', 'step'))`); a bare array or a Python number matches the key that is its name, and the call returns the dict, as `jax.jit` does",
)
@claim(PAGE, "A later trace whose dict has other keys raises an `autoflat.ShapeError`")
def test_a_returned_dict_has_its_values_as_return_positions():
    tx = optax.adam(0.1)

    def train_step(params, opt_state, step, x):
        loss, grads = jax.value_and_grad(lambda p: jnp.mean((x[:3] * p["w"] - 1.0) ** 2))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = jax.tree.map(lambda p, u: p + u / (1.0 + step), params, updates)
        if x.shape[-1] == 5:
            return {"params": params, "opt_state": opt_state, "step": step + 1}
        return {"params": params, "opt_state": opt_state, "step": step + 1, "loss": loss}

    params, xs = {"w": jnp.zeros(3)}, data(8, 3)
    ref = jax.jit(train_step)
    out, rl = {"params": params, "opt_state": tx.init(params), "step": 0}, []
    for x in xs:
        out = ref(out["params"], out["opt_state"], out["step"], x)
        rl.append(out["loss"])
    step = autoflat.step(train_step, num_steps=K)
    got, losses = {"params": params, "opt_state": tx.init(params), "step": 0}, []
    for c in (xs[:K], xs[K:]):
        got = step(got["params"], got["opt_state"], got["step"], c)
        losses.append(got["loss"])
        if not len(losses) > 1:
            assert role_line(step, "step") == (
                "state (a Python int that return key 'step' gives back changed: carried as an "
                "array) [rule: python-scalar]"
            )
    assert isinstance(got, dict) and list(got) == ["loss", "opt_state", "params", "step"]
    tree_allclose(
        (got["params"], jnp.concatenate(losses)), (out["params"], jnp.stack(rl)), rtol=1e-5
    )
    assert int(got["step"]) == int(out["step"]) == 8
    assert (
        role_line(step, "params")
        == "state (matched by value to return key 'params') [rule: matched-by-value]"
    )
    assert "('loss', 'opt_state', 'params', 'step'))" in autoflat.show(step)
    assert "= _af_items(" in autoflat.show(step)
    with pytest.raises(autoflat.ShapeError, match="where its first call returned a dict with"):
        step(got["params"], got["opt_state"], got["step"], data(K, 5))


@claim(
    PAGE,
    "so is one the body never changes whose array leaves all have a leading axis of `num_steps`, `return w, loss, x` for a per-step `x`, an `autoflat.ShapeError` that asks for `per_step=` or `state=`",
)
@claim(
    PAGE,
    "and one the body binds again from itself alone, nothing of the per-step inputs or other state, and then computes with, `x = x / 255.0; return w, loss, x`, the same `autoflat.ShapeError` where some array is a float: a decay after use, `lrs = lrs * 0.99` for four ensemble members, per-environment keys and int counters, `t = t + 1`, are carried)",
)
def test_a_per_step_input_returned_as_it_came_or_bound_from_itself_is_asked_about():
    def update(w, x):
        w = w - 0.1 * x.sum()
        return w, jnp.sum(w), x

    def rebound(w, x):
        x = x / 255.0
        w = w - 0.1 * x.sum()
        return w, jnp.sum(w), x

    xs = data(K, 2)
    for fn in (update, rebound):
        with pytest.raises(autoflat.ShapeError, match=r'per_step="x"(?s:.*)state="x"'):
            autoflat.step(fn, num_steps=K)(jnp.ones(3), xs)
        step = autoflat.step(fn, num_steps=K, per_step="x")
        (w,), outs = step_loop(step, (jnp.ones(3),), (xs,), K, K)
        (want_w,), want = jit_loop(fn, (jnp.ones(3),), (xs,), K)
        tree_allclose((w, outs), (want_w, want), rtol=1e-6)
        assert role_line(step, "x").startswith("scanned (per_step=)")

    def counted(w, t, x):  # (4 environments' step counters at num_steps=4)
        t = t + 1
        return w - 0.1 * x.sum(), t

    def decayed(ws, lrs, x):  # (four members' rates, decayed after use)
        ws = ws - lrs[:, None] * x.sum()
        lrs = lrs * 0.99
        return ws, lrs

    for fn, second in ((counted, jnp.zeros(K, jnp.int32)), (decayed, jnp.full(K, 0.1))):
        start = (jnp.ones((K, 3)) if fn is decayed else jnp.ones(3), second)
        want, _ = jit_loop(fn, start, (xs,), K)
        tree_allclose(autoflat.step(fn, num_steps=K)(*start, xs), want)


@claim(
    PAGE,
    "a tuple written inside the returned tuple with a parameter's name among its items (`return (params, opt_state), loss`) is looked into: its items are return positions of their own, counted in order (`params` 0, `opt_state` 1, `loss` 2, for `state=` too), and the call returns the value nested as written, `(params, opt_state), losses = step(...)`.",
)
@claim(
    PAGE,
    "`return (params, opt_state), loss` | both returned by name inside the written tuple: state; the call returns `(params, opt_state), losses`",
)
def test_a_tuple_written_with_parameters_names_is_looked_into():
    def nested(params, opt_state, x):
        params, opt_state, loss = _adam_update(params, opt_state, x)
        return (params, opt_state), loss

    tx = optax.adam(0.1)
    params, xs = {"w": jnp.zeros(3)}, data(2 * K, 3)
    ref = jax.jit(nested)
    rp, ro, rl = params, tx.init(params), []
    for i in range(2 * K):
        (rp, ro), loss = ref(rp, ro, xs[i])
        rl.append(loss)
    for options in ({}, {"state": {"params": 0, "opt_state": 1}}):
        step = autoflat.step(nested, num_steps=K, **options)
        (p, o), losses = step(params, tx.init(params), xs[:K])
        (p, o), more = step(p, o, xs[K:])
        assert type(p) is autoflat.LazyHandle and losses.shape == (K,)
        tree_allclose((p, o), (rp, ro), rtol=1e-6)
        np.testing.assert_allclose(np.concatenate([losses, more]), rl, rtol=1e-6)
        assert role_line(step, "opt_state").startswith("state (")


@claim(
    PAGE,
    "It stays one position where it names no parameter but per-step inputs and an argument could be the whole tuple's new value, a tuple, list or named tuple of its length whose items have the abstract values of the parameters named there (`return w, (h, x)` beside `carry = (h, prev_x)`).",
)
@claim(
    PAGE,
    "With `num_steps > 1`, a tuple argument no position gives back whose items come back among a looked-into tuple's items (`return (params, mom, key), loss` beside `train_state = (params, mom)`) is an `autoflat.OptionError` that asks for them written as a tuple of their own, `((params, mom), key)`, or `broadcast=`",
)
def test_a_written_tuple_an_argument_could_be_stays_one_position():
    def rnn(w, carry, x):
        h, prev_x = carry
        h = jnp.tanh(prev_x * w + h)
        return w * 0.99, (h, x)

    def spread(train_state, key, x):
        params, mom = train_state
        key, sub = jax.random.split(key)
        mom = 0.9 * mom + params * x + 0.01 * jax.random.normal(sub, (3,))
        params = params - 0.1 * mom
        return (params, mom, key), jnp.sum(params)

    xs, carry = data(K, 3), (jnp.zeros(3), jnp.zeros(3))
    step = autoflat.step(rnn, num_steps=K)
    (w, c), outs = step_loop(step, (jnp.ones(3), carry), (xs,), K, K)
    (want_w, want_c), want = jit_loop(rnn, (jnp.ones(3), carry), (xs,), K)
    tree_allclose((w, c), (want_w, want_c), rtol=1e-6)
    assert role_line(step, "carry").startswith("state (matched by value to return position 1)")
    with pytest.raises(
        autoflat.OptionError, match=r"`\(params, mom\)`(?s:.*)broadcast=\"train_state\""
    ):
        autoflat.step(spread, num_steps=K)(carry, jax.random.key(0), xs)


@claim(
    PAGE,
    'For a container of scalar arrays, a leaf made from per-step arguments alone, or given back as another argument came, is not a carry\'s input: per-step rewards and batch statistics look as much like metrics logged beside hyperparameters (`(reward, done)` beside `(gamma, lam)`, `(jnp.mean(x), jnp.std(x))` beside the `(mu, sd)` the step normalises by): the same `autoflat.OptionError`, where `state={"prev": 1}` carries a `(prev_r, prev_done)`.',
)
@claim(
    PAGE,
    '`def update(w, norm, x, y): mu, sd = norm; ... return w, (jnp.mean(x), jnp.std(x))`, `num_steps > 1` | an `OptionError`: the statistics are made from the batch alone, not from `norm`; `broadcast="norm"` or `state={"norm": 1}`',
)
def test_per_step_values_beside_a_container_of_scalars_are_asked_about():
    def update(w, norm, x, y):
        mu, sd = norm
        xn = (x - mu) / sd
        g = jax.grad(lambda w: jnp.mean((xn @ w - y) ** 2))(w)
        return w - 0.1 * g, (jnp.mean(x), jnp.std(x))

    def td(w, prev, r, done):  # the carry holds this step's reward and flag as they came
        prev_r, prev_done = prev
        w = w + 0.1 * prev_r * (1.0 - prev_done)
        return w, (r, done)

    xs, ys = data(K, 8, 3), data(K, 8, seed=1)
    norm = (jnp.float32(1.0), jnp.float32(2.0))
    with pytest.raises(
        autoflat.OptionError, match=r"its leaf at `\[0\]` is not computed from `norm`"
    ):
        autoflat.step(update, num_steps=K)(jnp.zeros(3), norm, xs, ys)
    w, _ = autoflat.step(update, num_steps=K, broadcast="norm")(jnp.zeros(3), norm, xs, ys)
    rw = jnp.zeros(3)
    for i in range(K):
        rw, _ = jax.jit(update)(rw, norm, xs[i], ys[i])
    np.testing.assert_allclose(w, rw, rtol=1e-6)
    rs, dones = data(K), (jnp.arange(K) % 2).astype(jnp.float32)
    prev = (jnp.float32(1.0), jnp.float32(0.0))
    with pytest.raises(
        autoflat.OptionError, match=r"its leaf at `\[0\]` is not computed from `prev`"
    ):
        autoflat.step(td, num_steps=K)(jnp.zeros(()), prev, rs, dones)
    step = autoflat.step(td, num_steps=K, state={"prev": 1})
    (w, p), _ = step_loop(step, (jnp.zeros(()), prev), (rs, dones), K, K)
    (want_w, want_p), _ = jit_loop(td, (jnp.zeros(()), prev), (rs, dones), K)
    tree_allclose((w, p), (want_w, want_p), rtol=1e-6)


@claim(
    PAGE,
    "with `num_steps > 1`, state inside it is an `autoflat.OptionError` that asks for the parameters' names there or a position of its own (a container given back there, or an array, not a scalar, whose same-shaped leaf there is computed from it other than through reductions alone: `(new_mu, new_var)` for `mu` and `var`);",
)
def test_state_inside_a_tuple_written_without_names_is_asked_about():
    def flat(w, mu, var, x):
        new_mu = 0.9 * mu + 0.1 * x.mean(0)
        new_var = 0.9 * var + 0.1 * x.var(0)
        return w + new_mu.sum(), (new_mu, new_var), jnp.sum(x)

    def named(w, mu, var, x):
        w, (mu, var), total = flat(w, mu, var, x)
        return w, (mu, var), total

    xs, start = data(K, 5, 3), (jnp.ones(()), jnp.zeros(3), jnp.ones(3))
    with pytest.raises(autoflat.OptionError, match=r"`mu` comes back inside return position 1"):
        autoflat.step(flat, num_steps=K)(*start, xs)
    w, (mu, var), _ = autoflat.step(named, num_steps=K)(*start, xs)
    want = start
    for i in range(K):
        w2, (m2, v2), _ = jax.jit(named)(*want, xs[i])
        want = (w2, m2, v2)
    tree_allclose((w, mu, var), want, rtol=1e-6)


@claim(
    PAGE,
    'a `state={"p": 0}` position the return does not have, or one that holds `p` inside it (`return (new_p, new_s), loss`), is an `autoflat.OptionError` before anything runs',
)
def test_a_state_position_that_does_not_fit_is_an_option_error():
    tx = optax.adam(0.1)

    def two(params, opt_state, x):
        params, opt_state, loss = _adam_update(params, opt_state, x)
        return params, loss

    def nested(params, opt_state, x):
        new_p, new_s, loss = _adam_update(params, opt_state, x)
        return (new_p, new_s), loss

    params, x = {"w": jnp.zeros(3)}, data(K, 3)
    step = autoflat.step(two, num_steps=K, state={"opt_state": 2})
    with pytest.raises(
        autoflat.OptionError,
        match=r"comes back at return position 2, but the step returns 2 values",
    ):
        step(params, tx.init(params), x)
    assert autoflat.stats(step).traces == 0
    step = autoflat.step(nested, num_steps=K, state={"params": 0})
    with pytest.raises(
        autoflat.OptionError, match=r"but its new value is inside that position, at `\[0\]\[0\]`"
    ):
        step(params, tx.init(params), x)
    assert autoflat.stats(step).traces == 0
    np.testing.assert_allclose(params["w"], 0.0)


@claim(PAGE, "`return new_p, s, loss` | `p` matched by value: state")
@claim(
    PAGE,
    'assert "# p: state (matched by value to return position 0) [rule: matched-by-value]" in (',
)
def test_the_example_of_state_by_abstract_value():
    tx = optax.sgd(0.1)

    def update(p, s, x):
        loss, g = jax.value_and_grad(lambda w: jnp.sum((w * x - 1.0) ** 2))(p)
        u, s = tx.update(g, s, p)
        new_p = optax.apply_updates(p, u)
        return new_p, s, loss

    p0, xs = jnp.arange(3.0), data(8, 3)
    ref_state, (rl,) = jit_loop(update, (p0, tx.init(p0)), (xs,), 8)
    step = autoflat.step(update, num_steps=K)
    state, (losses,) = step_loop(step, (p0, tx.init(p0)), (xs,), 8, K)
    tree_allclose((state, losses), (ref_state, rl), rtol=1e-5)
    assert "# p: state (matched by value to return position 0) [rule: matched-by-value]" in header(
        step
    )


# === State also returned as a per-step output ===============================================


def _loss(params, x):
    return jnp.mean((x * params["w"] + params["b"] - 1.0) ** 2)


def _params():
    return {"b": jnp.zeros(()), "w": jnp.zeros(3)}


TX = optax.adam(0.1)


def _log_params(params, opt_state, x):
    loss_value, grads = jax.value_and_grad(_loss)(params, x)
    updates, opt_state = TX.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, opt_state, params


def _log_in_a_dict(params, x):
    grads = jax.grad(_loss)(params, x)
    params = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
    return {"params": params, "log": params}


@claim(
    PAGE,
    '`return params, opt_state, params` (the trajectory logged), `return {"params": params, "log": params}` | `params` state at its first position, the other a per-step output',
)
@claim(
    PAGE,
    'A step may give back a state parameter at more than one position, to log its trajectory: `return p, p`, `return params, opt_state, params`, `return {"params": params, "log": params}`. Every such position holds the new value, as under `jax.jit`; autoflat carries the first of them as the state and makes the others per-step outputs, stacked along a leading axis when `num_steps > 1`.',
)
@claim(
    PAGE, "or in a returned dict the first item the step writes that gives back the very same value"
)
@pytest.mark.parametrize("k", [1, K])
def test_state_also_returned_as_a_per_step_output(k):
    xs = data(8, 3)
    # return params, opt_state, params
    (rp, ro), (rlog,) = jit_loop(_log_params, (_params(), TX.init(_params())), (xs,), 8)
    step = autoflat.step(_log_params, num_steps=k)
    (p, o), (log,) = step_loop(step, (_params(), TX.init(_params())), (xs,), 8, k)
    tree_allclose((p, o, log), (rp, ro, rlog), rtol=1e-5)
    assert role_line(step, "params").startswith("state (returned at return position 0; position 2")
    out = "output (stacked)" if k > 1 else "output"
    assert f"# returns: state params, state opt_state, {out}" in header(step)
    # return {"params": params, "log": params}
    ref, logs = _params(), []
    for x in xs:
        result = jax.jit(_log_in_a_dict)(ref, x)
        ref, logs = result["params"], [*logs, result["log"]]
    step = autoflat.step(_log_in_a_dict, num_steps=k)
    got, got_logs = _params(), []
    for start in range(0, 8, k):
        result = step(got, xs[start : start + k] if k > 1 else xs[start])
        got = result["params"]
        got_logs.append(result["log"] if k > 1 else jax.tree.map(lambda a: a[None], result["log"]))
    tree_allclose(got, ref, rtol=1e-5)
    tree_allclose(
        jax.tree.map(lambda *a: jnp.concatenate(a), *got_logs),
        jax.tree.map(lambda *a: jnp.stack(a), *logs),
        rtol=1e-5,
    )
    assert role_line(step, "params") == (
        "state (matched by value to return key 'params'; return key 'log' gives back the same "
        "value: a per-step output) [rule: matched-by-value]"
    )


@claim(
    PAGE,
    "The first is the first position any `return` names the parameter at (in one branch `return p, p`, in another `return new_p, new_p` or `return new_p, p`: the state is at position 0, `new_p` matched by value there)",
)
def test_state_is_at_the_first_position_any_return_names():
    def both_new(p, x, frozen=False):
        if frozen:
            return p, p
        new_p = jax.tree.map(lambda a, g: a - 0.1 * g, p, jax.grad(_loss)(p, x))
        return new_p, new_p

    def old_and_new(p, x, frozen=False):
        if frozen:
            return p, p
        new_p = jax.tree.map(lambda a, g: a - 0.1 * g, p, jax.grad(_loss)(p, x))
        return new_p, p

    xs = data(8, 3)
    for fn in (both_new, old_and_new):
        (rp,), (rlog,) = jit_loop(fn, (_params(),), (xs,), 8)
        step = autoflat.step(fn, num_steps=K)
        (p,), (log,) = step_loop(step, (_params(),), (xs,), 8, K)
        tree_allclose((p, log), (rp, rlog), rtol=1e-5)
        assert role_line(step, "p") == (
            "state (matched by value to return position 0, returned by name there in some "
            "returns) [rule: matched-by-value]"
        ), fn.__name__
        assert "# returns: state p, output (stacked)" in header(step)


@claim(PAGE, '`state={"p": 1}` picks another position.')
def test_state_option_picks_another_of_the_positions():
    def relax(p, x):
        p = p - 0.1 * (p * x - 1.0)
        return p, p

    xs = data(8, 3)
    step = autoflat.step(relax, num_steps=K, state={"p": 1})
    p, logs = jnp.ones(3), []
    for c in (xs[:K], xs[K:]):
        log, p = step(p, c)
        logs.append(log)
    (rp,), (rlog,) = jit_loop(relax, (jnp.ones(3),), (xs,), 8)
    tree_allclose((p, jnp.concatenate(logs)), (rp, rlog), rtol=1e-5)
    assert "# returns: output (stacked), state p" in header(step)


@claim(
    PAGE,
    "A position that names a parameter is never matched by value to another one (an `anchor` alike `params` stays what its own rules make it)",
)
def test_a_position_naming_a_parameter_is_never_matched_to_another():
    def update(params, anchor, x):
        def loss(p):
            return _loss(p, x) + jnp.sum((p["w"] - anchor["w"]) ** 2)

        params = jax.tree.map(lambda p, g: p - 0.1 * g, params, jax.grad(loss)(params))
        return params, params

    anchor = {"b": jnp.ones(()), "w": jnp.ones(3)}
    xs = data(8, 3)
    ref = jax.jit(update)
    rp, rlog = _params(), []
    for x in xs:
        rp, log = ref(rp, anchor, x)
        rlog.append(log)
    step = autoflat.step(update, num_steps=K)
    p, logs = _params(), []
    for c in (xs[:K], xs[K:]):
        p, log = step(p, anchor, c)
        logs.append(log)
    tree_allclose(p, rp, rtol=1e-5)
    tree_allclose(
        jax.tree.map(lambda *a: jnp.concatenate(a), *logs),
        jax.tree.map(lambda *a: jnp.stack(a), *rlog),
        rtol=1e-5,
    )
    assert role_line(step, "anchor") == (
        "broadcast (no leading axis of num_steps=4 at the first call) [rule: no-leading-axis]"
    )


@claim(
    PAGE,
    "The returns must still agree: two parameters named at one position (`return p, loss` in one branch, `return s, loss` in another), or a parameter named in one return only at a position where another gives something else (`return p, loss` and `return loss, p`), is an `autoflat.SourceError` naming both lines.",
)
def test_returns_that_disagree_are_a_source_error_naming_both_lines():
    def two_at_one_position(p, s, x, flag=False):
        if flag:
            return p, jnp.sum(x)
        return s, jnp.sum(x)

    def swapped(p, x, flag=False):
        if flag:
            return p, jnp.sum(x)
        return jnp.sum(x), p

    line = two_at_one_position.__code__.co_firstlineno
    with pytest.raises(autoflat.SourceError) as info:
        autoflat.step(two_at_one_position, num_steps=K)(jnp.ones(3), jnp.ones(3), data(K, 3))
    assert f"line {line + 2} returns (p, <expr>) but line {line + 3} returns (s, <expr>)" in str(
        info.value
    )
    line = swapped.__code__.co_firstlineno
    with pytest.raises(autoflat.SourceError) as info:
        autoflat.step(swapped)(jnp.ones(3), jnp.ones(3))
    assert f"line {line + 2} returns (p, <expr>) but line {line + 3} returns (<expr>, p)" in str(
        info.value
    )


@claim(
    PAGE, "assert p.shape == (3,) and trajectory.shape == (4, 3) # the state, and one entry a step"
)
@claim(PAGE, 'assert "# returns: state p, output (stacked)" in autoflat.show(relax)')
def test_the_example_of_state_returned_twice():
    def relax(p, x):
        p = p - 0.1 * (p * x - 1.0)
        return p, p

    step = autoflat.step(relax, num_steps=4)
    p, trajectory = step(jnp.ones(3), jnp.ones((4, 3)))
    assert p.shape == (3,) and trajectory.shape == (4, 3)
    (rp,), (rtraj,) = jit_loop(relax, (jnp.ones(3),), (jnp.ones((4, 3)),), 4)
    tree_allclose((p, trajectory), (rp, rtraj), rtol=1e-6)
    assert "# returns: state p, output (stacked)" in autoflat.show(step)


# === Per-step, broadcast or static ==========================================================


@claim(
    PAGE,
    "With `num_steps > 1` the first call's shapes decide. An argument whose array leaves all have a leading axis of `num_steps` is per-step; one with none is the same for every step",
)
@claim(
    PAGE,
    'assert "# eos_id: static (a Python int, static as in eqx.filter_jit) [rule: python-scalar]" in header',
)
def test_the_example_of_per_step_broadcast_and_static():
    def fit(w, xs, full_batch, key, eos_id):
        noise = jax.random.normal(key, w.shape) * 0.0
        w = w - 0.1 * (jnp.mean(full_batch) + jnp.mean(xs) + eos_id) + noise
        return w

    step = autoflat.step(fit, num_steps=4)
    w = step(jnp.zeros(2), jnp.ones((4, 5)), jnp.ones((3, 2)), jax.random.key(0), 2)
    ref = jax.jit(fit, static_argnums=4)
    rw = jnp.zeros(2)
    for i in range(4):
        rw = ref(rw, jnp.ones((4, 5))[i], jnp.ones((3, 2)), jax.random.key(0), 2)
    tree_allclose(w, rw, rtol=1e-6)
    lines = header(step)
    assert (
        "# xs: scanned (per-step: leading axis 4 = num_steps at the first call) [rule: leading-axis]"
        in lines
    )
    assert (
        "# full_batch: broadcast (no leading axis of num_steps=4 at the first call) [rule: no-leading-axis]"
        in lines
    )
    assert (
        "# key: broadcast (no leading axis of num_steps=4 at the first call) [rule: no-leading-axis]"
        in lines
    )
    assert (
        "# eos_id: static (a Python int, static as in eqx.filter_jit) [rule: python-scalar]"
        in lines
    )


@claim(
    PAGE, "Where two readings of the shapes cannot be told apart, autoflat asks instead of guessing"
)
@claim(
    PAGE,
    "Mixed: some array leaves of one argument have the leading axis and some do not (and no return position gives it back). The error names the leaf, its shape and the options.",
)
def test_mixed_leading_axes_are_an_error_naming_the_leaf():
    def update(p, batch):
        p = p + jnp.sum(batch["x"]) + jnp.sum(batch["mask"])
        return p

    with pytest.raises(autoflat.ShapeError) as info:
        autoflat.step(update, num_steps=K)(
            jnp.zeros(()), {"x": jnp.ones((4, 2)), "mask": jnp.ones(3)}
        )
    message = str(info.value)
    assert "`batch['mask']` is float32[3]" in message
    assert 'per_step="batch"' in message and 'broadcast="batch"' in message


@claim(
    PAGE,
    "a batch of 3 with `num_steps=4` as the only candidate | an error: `per_step=` or `broadcast=`",
)
@claim(
    PAGE,
    'A first call with no per-step argument where an argument\'s arrays all share a shorter leading axis: a short first chunk, or a batch reused by every step (`num_steps=4` and a batch of 3 examples)? Say `per_step="batch"` or `broadcast="batch"`, or pass a full chunk first.',
)
def test_a_short_first_call_is_asked_about():
    def update(p, batch):
        p = p - 0.1 * jnp.mean(batch, axis=0)
        return p

    step = autoflat.step(update, num_steps=K)
    with pytest.raises(
        autoflat.ShapeError, match="short chunk of 3 steps or one value reused"
    ) as info:
        step(jnp.ones(2), jnp.ones((3, 2)))
    assert 'per_step="batch"' in str(info.value) and 'broadcast="batch"' in str(info.value)
    batches = data(7, 2)
    ref = jax.jit(update)
    # broadcast=: the batch of 3 each of the 4 steps
    rp = jnp.ones(2)
    for _ in range(K):
        rp = ref(rp, batches[:3])
    tree_allclose(
        autoflat.step(update, num_steps=K, broadcast="batch")(jnp.ones(2), batches[:3]),
        rp,
        rtol=1e-6,
    )
    # per_step=: 3 steps, one row each
    (rp,), _ = jit_loop(update, (jnp.ones(2),), (batches[:3],), 3)
    tree_allclose(
        autoflat.step(update, num_steps=K, per_step="batch")(jnp.ones(2), batches[:3]),
        rp,
        rtol=1e-6,
    )
    # a full chunk first: then the 3 is a final chunk
    (rp,), _ = jit_loop(update, (jnp.ones(2),), (batches,), 7)
    p = step(jnp.ones(2), batches[:K])
    tree_allclose(step(p, batches[K:]), rp, rtol=1e-6)


@claim(PAGE, "per-step values mapped one by one, or state?")
@claim(
    PAGE,
    "a bare array where the position is its place among the parameters that could be state, under a name that may be its new value",
)
@claim(
    PAGE,
    '`def f(v, x): v2 = v * 0.5 + x.sum(); return v2` at `num_steps=4` type-checks both ways with `v` of shape (4,) (of shape (3,), `v` is state, matched by value). The `autoflat.ShapeError` names `state="v"` and `per_step="v"`.',
)
def test_per_step_or_state_is_asked_about():
    xs = data(8, 2)
    v = jnp.arange(4.0)
    with pytest.raises(autoflat.ShapeError, match="return position 0 gives back") as info:
        autoflat.step(_halved, num_steps=K)(v, xs[:K])
    assert 'state="v"' in str(info.value) and 'per_step="v"' in str(info.value)
    # state=: carried, as a jax.jit loop
    (rv,), _ = jit_loop(_halved, (v,), (xs,), 8)
    (got,), _ = step_loop(autoflat.step(_halved, num_steps=K, state="v"), (v,), (xs,), 8, K)
    tree_allclose(got, rv, rtol=1e-6)
    # per_step=: one entry of v a step
    got = autoflat.step(_halved, num_steps=K, per_step="v")(v, xs[:K])
    tree_allclose(got, jnp.stack([jax.jit(_halved)(v[i], xs[i]) for i in range(K)]), rtol=1e-6)
    # shape (3,): state, matched by value
    step = autoflat.step(_halved, num_steps=K)
    (got,), _ = step_loop(step, (jnp.arange(3.0),), (xs,), 8, K)
    (rv,), _ = jit_loop(_halved, (jnp.arange(3.0),), (xs,), 8)
    tree_allclose(got, rv, rtol=1e-6)
    assert (
        role_line(step, "v")
        == "state (matched by value to return position 0) [rule: matched-by-value]"
    )

    def renamed(w, v, x):  # `new_v` at v's place (1), v's whole shape: asked about too
        new_v = v * 0.5 + x.sum()
        w = w + 1.0
        return w, new_v

    with pytest.raises(autoflat.ShapeError, match="return position 1 gives back") as info:
        autoflat.step(renamed, num_steps=K)(jnp.zeros(()), v, xs[:K])
    assert 'state="v"' in str(info.value) and 'per_step="v"' in str(info.value)


@claim(PAGE, "A container is asked about at any return position")
def test_a_container_of_num_steps_entries_is_asked_about_at_any_position():
    def update(w, params, x):
        new = {"w": params["w"] - 0.1 * x, "b": params["b"] * 0.5}
        w = w + 1.0
        return w, jnp.sum(x), new  # params (place 1) at position 2

    start = {"w": jnp.ones((4, 3)), "b": jnp.ones(4)}  # every leaf: a leading axis of 4
    with pytest.raises(autoflat.ShapeError, match="return position 2 gives back") as info:
        autoflat.step(update, num_steps=K)(jnp.zeros(()), start, data(K, 3))
    assert 'state="params"' in str(info.value) and 'per_step="params"' in str(info.value)


@claim(
    PAGE,
    "An expression of one step's slice's shape at that place (`return key, noise + x`) or a value that fits one step only (`v_sum = jnp.sum(v * x)`) is a per-step output, as the leading axis says.",
)
def test_expressions_and_one_step_values_are_per_step_outputs():
    def noisy(key, x):
        key, sub = jax.random.split(key)
        return key, jax.random.normal(sub, ()) + x

    def summed(w, v, x):
        v_sum = jnp.sum(v * x)
        return w + v_sum, v_sum

    xs = jnp.arange(4.0)
    key, out = autoflat.step(noisy, num_steps=K)(jax.random.key(0), xs)
    rkey, routs = jax.random.key(0), []
    for i in range(K):
        rkey, o = jax.jit(noisy)(rkey, xs[i])
        routs.append(o)
    tree_allclose(out, jnp.stack(routs), rtol=1e-6)
    same_keys(key, rkey)
    w, sums = autoflat.step(summed, num_steps=K)(jnp.zeros(()), jnp.arange(4.0), jnp.ones((K, 2)))
    np.testing.assert_allclose(sums, [0.0, 2.0, 4.0, 6.0])
    np.testing.assert_allclose(w, 12.0)


@claim(
    PAGE,
    "One coincidence cannot be caught: an array the same every step whose first axis happens to equal `num_steps` (a batch of exactly 4 examples with `num_steps=4`) looks per-step. The header says so; `broadcast=` fixes it.",
)
def test_a_batch_of_exactly_num_steps_examples_looks_per_step():
    def update(w, batch):
        w = w - 0.1 * jnp.mean(batch, axis=0)
        return w

    batch = data(K, 2)  # 4 examples, the same batch every step
    step = autoflat.step(update, num_steps=K)
    step(jnp.zeros(2), batch)
    assert role_line(step, "batch") == (
        "scanned (per-step: leading axis 4 = num_steps at the first call) [rule: leading-axis]"
    )
    fixed = autoflat.step(update, num_steps=K, broadcast="batch")
    rw = jnp.zeros(2)
    for _ in range(K):
        rw = jax.jit(update)(rw, batch)
    tree_allclose(fixed(jnp.zeros(2), batch), rw, rtol=1e-6)
    assert role_line(fixed, "batch") == "broadcast (broadcast=) [rule: option-or-self]"


@claim(
    PAGE,
    "per-step inputs passed with another leading axis (4 batches, or 2, beside `num_steps=3`) read as broadcast; where the state then changes shape and its new shape holds that axis, the `autoflat.ShapeError` names the argument, its leading axis and that it was read as broadcast, with the fix.",
)
@pytest.mark.parametrize("axis", [4, 2])
def test_per_step_inputs_with_another_leading_axis_read_as_broadcast(axis):
    def update(w, xs, ys):
        w = w - 0.1 * xs + ys
        return w, jnp.sum(w)

    with pytest.raises(autoflat.ShapeError) as info:
        autoflat.step(update, num_steps=3)(jnp.zeros(2), jnp.ones((3, 2)), jnp.ones((axis, 2)))
    message = str(info.value)
    assert (
        f"`ys` was read as broadcast, the same value for every step, because its leading axis is {axis}, not num_steps=3"
        in message
    )
    fix = "pass 3 per call" if axis == 4 else 'say so with `per_step="ys"`'
    assert fix in message


# --- `*args` and `**kwargs` -----------------------------------------------------------------


def _star_batch(w, *batch):
    x, y = batch
    loss, g = jax.value_and_grad(lambda w: jnp.mean((x @ w - y) ** 2))(w)
    return w - 0.1 * g, loss


def _star_kwargs(w, **batch):
    return _star_batch(w, batch["x"], batch["y"])


@claim(
    PAGE,
    'A variadic parameter is one parameter, as Python binds it: `*batch` holds the tuple of the call\'s extra positional arguments, `**kwargs` the dict of its extra keywords (empty when there are none). It takes one role for all its items, by the rules above as any tuple or dict argument, and the options name it without the stars (`per_step="batch"`); `show()` writes it as the signature does:',
)
def test_variadic_parameters_take_one_role_each():
    xs, ys = data(8, 5, 3), data(8, 5, seed=1)
    (rw,), (rl,) = jit_loop(_star_batch, (jnp.ones(3),), (xs, ys), 8)
    step = autoflat.step(_star_batch, num_steps=K)
    (w,), (losses,) = step_loop(step, (jnp.ones(3),), (xs, ys), 8, K)
    tree_allclose((w, losses), (rw, rl), rtol=1e-5)
    assert role_line(step, "*batch").startswith("scanned (per-step: leading axis 4")
    kw = autoflat.step(_star_kwargs, num_steps=K)
    w, losses = kw(jnp.ones(3), x=xs[:K], y=ys[:K])
    w, more = kw(w, x=xs[K:], y=ys[K:])
    tree_allclose((w, jnp.concatenate([losses, more])), (rw, rl), rtol=1e-5)
    assert role_line(kw, "**batch").startswith("scanned (per-step")
    # Named by the options without the stars; with no extras, `()`.
    bc = autoflat.step(_star_batch, num_steps=K, broadcast="batch")
    bc(jnp.ones(3), xs[0], ys[0])
    assert role_line(bc, "*batch").startswith("broadcast (broadcast=)")


def _with_rate(w, *batch):
    x, y, lr = batch
    return w - lr * jnp.mean(x), jnp.mean(y)


@claim(
    PAGE,
    "Items that need different roles (a per-step batch beside a learning rate the same every step, or beside a string or an optimizer) are the mixed case above: the `autoflat.ShapeError` says to name them as parameters of their own.",
)
@claim(
    PAGE,
    'not a plain tuple, list or dict with `num_steps > 1` where an item, an array or a plain container of them, has that leading axis on all its arrays (`(xs, "sum")`: the mixed case below)',
)
def test_variadic_items_of_different_roles_ask_to_name_them():
    w = jnp.ones(3)
    with pytest.raises(autoflat.ShapeError) as info:
        autoflat.step(_with_rate, num_steps=K)(w, data(K, 5), data(K, 5), jnp.float32(0.1))
    assert "its items take one role together" in str(info.value)
    assert "name them as parameters" in str(info.value)
    tree_allclose(w, jnp.ones(3))
    with pytest.raises(autoflat.ShapeError, match="`batch\\[2\\]` is non-array str"):
        autoflat.step(_with_rate, num_steps=K)(w, data(K, 5), data(K, 5), "sgd")


def _extras(w, *extra):
    return w * 0.5 + sum(e.sum() for e in extra), jnp.float32(len(extra))


@claim(
    PAGE,
    "A variadic parameter with no arrays at the first call (no extras passed) is broadcast for want of evidence, and a later call that passes arrays with a leading axis of `num_steps` there is an `autoflat.ShapeError` naming `per_step=` and `broadcast=`, as for any argument read as broadcast by its shapes. A different number of extras compiles again, as under `jax.jit`.",
)
def test_variadic_with_no_extras_then_extras():
    step = autoflat.step(_extras, num_steps=K)
    w, _ = step(jnp.ones(3))
    assert role_line(step, "*extra").startswith("broadcast (no arrays at the first call)")
    with pytest.raises(autoflat.ShapeError, match='per_step="extra"'):
        step(w, data(K, 2))
    counted = autoflat.step(_extras, num_steps=K, per_step="extra")
    w, n0 = counted(jnp.ones(3))
    w, n2 = counted(w, data(K, 2), data(K, 3, seed=1))
    (rw,), (rn,) = jit_loop(_extras, (jnp.ones(3),), (), K)
    (rw,), (rn2,) = jit_loop(_extras, (rw,), (data(K, 2), data(K, 3, seed=1)), K)
    tree_allclose((w, n0, n2), (rw, rn, rn2), rtol=1e-5)
    assert autoflat.stats(counted).traces == 2


def _popping(params, x, **kwargs):
    rng = kwargs.pop("rng")
    kwargs.setdefault("scale", 1.0)
    kwargs["noise"] = jax.random.normal(rng, x.shape) * 0.01
    loss, g = jax.value_and_grad(
        lambda p: jnp.mean(((x + kwargs["noise"]) @ p) ** 2) * kwargs["scale"]
    )(params)
    return params - 0.1 * g, loss


def _merged_kwargs(w, x, **kwargs):
    kwargs |= {"scale": kwargs["scale"] * 2}
    kwargs["scale"] *= 0.5
    g = jax.grad(lambda w: jnp.mean((x @ w - 1.0) ** 2))(w)
    return w - kwargs["scale"] * g


def _into_a_value(w, x, **kwargs):
    kwargs["stats"]["n"] = kwargs["stats"]["n"] + 1.0
    return w * 0.5 + x.sum(), w.sum()


@claim(
    PAGE,
    'The dict `**kwargs` holds is the call\'s own, as under `jax.jit`: writes into it (`kwargs["noise"] = ...`, `rng = kwargs.pop("rng")`, `kwargs.setdefault(...)`, `kwargs |= {...}`) stay inside the step and give it no role (a write into a value it holds, `kwargs["stats"]["n"] = ...`, is a write into the caller\'s object, rule 5).',
)
def test_writes_into_the_kwargs_dict_stay_in_the_step():
    xs, keys = data(8, 5, 3), jax.random.split(jax.random.PRNGKey(0), 8)
    w, losses = jnp.ones(3), []
    for i in range(8):
        w, loss = jax.jit(_popping)(w, xs[i], rng=keys[i], scale=jnp.float32(2.0))
        losses.append(loss)
    step = autoflat.step(_popping, num_steps=K, per_step="kwargs")
    got, out = jnp.ones(3), []
    for c in range(8 // K):
        chunk = slice(c * K, (c + 1) * K)
        got, loss = step(got, xs[chunk], rng=keys[chunk], scale=jnp.full((K,), 2.0))
        out.append(loss)
    tree_allclose((got, jnp.concatenate(out)), (w, jnp.stack(losses)), rtol=1e-5)
    assert role_line(step, "**kwargs").startswith("scanned (per_step=)")
    one = autoflat.step(_popping)
    tree_allclose(
        one(jnp.ones(3), xs[0], rng=keys[0]),
        jax.jit(_popping)(jnp.ones(3), xs[0], rng=keys[0]),
        rtol=1e-6,
    )
    assert role_line(one, "**kwargs").startswith("scanned (per-step input)")
    # `kwargs |= {...}` and `kwargs["k"] *= ...` too
    merged = autoflat.step(_merged_kwargs, num_steps=K)
    want = jnp.zeros(3)
    for x in xs[:K]:
        want = jax.jit(_merged_kwargs)(want, x, scale=jnp.float32(0.05))
    tree_allclose(merged(jnp.zeros(3), xs[:K], scale=jnp.float32(0.05)), want, rtol=1e-5)
    assert role_line(merged, "**kwargs").startswith("broadcast")
    # A value inside it is the caller's: assigned into, state.
    inner = autoflat.step(_into_a_value)
    inner(jnp.ones(3), data(1, 3)[0], stats={"n": jnp.float32(0.0)})
    assert role_line(inner, "**kwargs").startswith("state (assigned into at line")


@claim(
    PAGE,
    "A `functools.partial` that binds some of `*args` binds the parameters before it (rule 10); the variadic one is the call's, and with `num_steps > 1` a partial that binds into it is an `autoflat.OptionError` unless `broadcast=` or `per_step=` names it.",
)
def test_partial_into_variadic_binds_the_named_ones():
    x, y = data(1, 5, 3)[0], data(1, 5, seed=1)[0]
    fn = functools.partial(_star_batch, jnp.ones(3), x)
    step = autoflat.step(fn)
    tree_allclose(step(y), jax.jit(fn)(y), rtol=1e-6)
    assert role_line(step, "w").startswith("broadcast (bound by functools.partial")
    assert "bound" not in role_line(step, "*batch")
    with pytest.raises(autoflat.OptionError, match="binds 1 positional argument into `\\*batch`"):
        autoflat.step(fn, num_steps=K)
    bc = autoflat.step(fn, num_steps=K, broadcast="batch")  # x and y, every step
    want = jax.jit(fn)(y)
    tree_allclose(bc(y), jax.tree.map(lambda a: jnp.stack([a] * K), want), rtol=1e-6)


@claim(
    PAGE,
    "Flax NNX objects inside it, or inside any tuple, list or dict, that the step changes in place (`step(model, optimizer, x, y)` for `def step(*objs)`) are an `autoflat.StateError`: what the step changes in them is written back only into objects passed as parameters of their own. Ones the step only reads (an ensemble, a teacher) are fine.",
)
def test_flax_nnx_objects_inside_a_variadic_parameter_are_refused():
    from flax import nnx

    def step(*objs):
        model, optimizer, x, y = objs
        loss, g = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        optimizer.update(model, g)
        return loss

    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    with pytest.raises(autoflat.StateError, match="parameter of its own"):
        autoflat.step(step)(model, optimizer, jnp.ones((5, 3)), jnp.zeros((5, 2)))

    def distill(student, optimizer, teachers, x):  # the teachers, in a tuple, only read
        target = jnp.mean(jnp.stack([t(x) for t in teachers]), axis=0)
        loss, g = nnx.value_and_grad(lambda m: jnp.mean((m(x) - target) ** 2))(student)
        optimizer.update(student, g)
        return loss

    def parts():
        student = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
        teachers = (nnx.Linear(3, 2, rngs=nnx.Rngs(1)), nnx.Linear(3, 2, rngs=nnx.Rngs(2)))
        return student, nnx.Optimizer(student, optax.sgd(0.1), wrt=nnx.Param), teachers

    xs = data(K, 5, 3)
    s0, o0, t0 = parts()
    want = jnp.stack([nnx.jit(distill)(s0, o0, t0, x) for x in xs])
    s1, o1, t1 = parts()
    tree_allclose(autoflat.step(distill, num_steps=K)(s1, o1, t1, xs), want, rtol=1e-5)
    tree_allclose(s1.kernel[...], s0.kernel[...], rtol=1e-5)


def _models_spread(*models):
    a, b = models
    return a * 0.5, b + a.sum(), a.sum()


def _models_as_one(*models):
    a, b = models
    return (a * 0.5, b + a.sum()), a.sum()


@claim(
    PAGE,
    "so is one whose items come back one by one at positions of the returned tuple itself, each computed from it other than through reductions alone (`return a * 0.5, b + a.sum(), loss` for `a, b = models`; not a loss and a metric computed with it, and not a tuple of scalars), which asks for them as one tuple, `return (a * 0.5, b + a.sum()), loss`, or parameters of their own",
)
def test_tuple_state_spread_over_flat_positions_asks():
    with pytest.raises(autoflat.OptionError, match="come back one by one at return positions 0, 1"):
        autoflat.step(_models_spread, num_steps=K)(jnp.ones(3), jnp.zeros(2))
    (ra, rb), (rl,) = jit_loop(
        lambda a, b: (*_models_as_one(a, b)[0], _models_as_one(a, b)[1]),
        (jnp.ones(3), jnp.zeros(2)),
        (),
        8,
    )
    step = autoflat.step(_models_as_one, num_steps=K)
    got, losses = step(jnp.ones(3), jnp.zeros(2))
    got, more = step(*got)
    tree_allclose((got, jnp.concatenate([losses, more])), ((ra, rb), rl), rtol=1e-5)


# === Python numbers with num_steps=1 ========================================================


@claim(
    PAGE,
    "With one step a call, a Python number is traced as `jax.jit` traces it: a step counter `i` passed as `update(i, opt_state, batch)` compiles once for every value.",
)
def test_a_python_counter_at_one_step_a_call_is_traced():
    def update(i, p, x):
        p = p + x * i
        return p

    step = autoflat.step(update)
    ref = jax.jit(update)
    p, rp = jnp.zeros(()), jnp.zeros(())
    for i in range(4):
        p, rp = step(i, p, jnp.ones(())), ref(i, rp, jnp.ones(()))
    tree_allclose(p, rp)
    assert autoflat.stats(step).traces == 1 == ref._cache_size()
    assert role_line(step, "i") == "scanned (per-step input) [rule: as-passed]"


@claim(
    PAGE,
    "A number the step needs as a concrete value (`nn.Dense(latents)`, `jnp.zeros(n)`, `if flag:`), which `jax.jit` rejects with a `ConcretizationTypeError`, is made static instead, as `static_argnames` would: found by the first call's abstract evaluation, and shown as `static (a Python int the step needs as a concrete value ...)`. Each value then compiles once.",
)
def test_a_python_number_needed_concrete_is_static():
    def sized(p, x, n):
        return p + jnp.sum(jnp.zeros(n) + x)

    def flagged(p, x, flag):
        if flag:
            return p + x
        return p - x

    step = autoflat.step(sized)
    p = step(jnp.zeros(()), jnp.ones(()), 3)
    p = step(p, jnp.ones(()), 3)
    np.testing.assert_allclose(p, 6.0)
    assert autoflat.stats(step).traces == 1
    p = step(p, jnp.ones(()), 2)  # a new value: compiled once more
    p = step(p, jnp.ones(()), 2)
    np.testing.assert_allclose(p, 10.0)
    assert autoflat.stats(step).traces == 2
    assert role_line(step, "n").startswith(
        "static (a Python int the step needs as a concrete value"
    )
    with pytest.raises(TypeError):  # what jax.jit does with it
        jax.jit(sized)(jnp.zeros(()), jnp.ones(()), 3)
    step = autoflat.step(flagged)
    np.testing.assert_allclose(step(jnp.zeros(()), jnp.ones(()), True), 1.0)
    np.testing.assert_allclose(step(jnp.zeros(()), jnp.ones(()), False), -1.0)
    assert role_line(step, "flag").startswith(
        "static (a Python bool the step needs as a concrete value"
    )
    with pytest.raises(jax.errors.ConcretizationTypeError):
        jax.jit(flagged)(jnp.zeros(()), jnp.ones(()), True)


@claim(
    PAGE,
    "`nn.Dense(self.latents)` with `latents` a Python int, `num_steps=1` | static: one compile per value",
)
def test_pattern_a_flax_linen_layer_size_is_static():
    from flax import linen as nn

    class Decoder(nn.Module):
        latents: int

        @nn.compact
        def __call__(self, x):
            return nn.Dense(self.latents)(x)

    def update(params, x, latents):
        out = Decoder(latents).apply({"params": params}, x)
        return params, jnp.sum(out)

    params = Decoder(2).init(jax.random.key(0), jnp.ones(3))["params"]
    step = autoflat.step(update)
    params, s1 = step(params, jnp.ones(3), 2)
    params, s2 = step(params, jnp.ones(3), 2)
    assert autoflat.stats(step).traces == 1
    ref = jax.jit(update, static_argnames="latents")
    tree_allclose(s2, ref(params, jnp.ones(3), 2)[1])
    assert role_line(step, "latents").startswith(
        "static (a Python int the step needs as a concrete value"
    )


# === Python scalars in state ================================================================


@claim(
    PAGE,
    "`flax.training.train_state.TrainState.create(...)` starts `step` as the Python int `0`, and `apply_gradients` counts it up.",
)
@claim(
    PAGE,
    "A Python scalar in state that the step changes becomes an array before the first call, as `jax.jit` would trace it; scalars the step gives back unchanged (a config value) stay static.",
)
@claim(PAGE, "`TrainState.create(step=0)` | `step` becomes an array: one compile")
@pytest.mark.parametrize("k", [1, K])
def test_a_train_states_python_int_step_becomes_an_array(k):
    from flax.training import train_state

    state = train_state.TrainState.create(
        apply_fn=lambda params, x: x @ params["w"],
        params={"w": jnp.ones((3, 1))},
        tx=optax.sgd(0.1),
    )
    assert type(state.step) is int

    def train_step(state, config, x):
        def loss_fn(params):
            return jnp.mean((state.apply_fn(params, x) * config["scale"] - 1.0) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), config, loss

    config = {"scale": 2.0, "name": "run"}  # given back unchanged: Python values, static
    xs = data(8, 2, 3)
    (rs, _), (rl,) = jit_loop(train_step, (state, {"scale": 2.0}), (xs,), 8)  # jax.jit: no str
    step = autoflat.step(train_step, num_steps=k)
    (s, c), (losses,) = step_loop(step, (state, config), (xs,), 8, k)
    assert int(s.step) == 8 and isinstance(s.step, jax.Array)
    tree_allclose((s.params, losses), (rs.params, rl), rtol=1e-5)
    assert c["scale"] == 2.0 and type(c["scale"]) is float and c["name"] == "run"
    assert autoflat.stats(step).traces == 1


@claim(PAGE, 'The same holds for state the step changes in place (a dict: `counters["n"] += 1`)')
def test_a_python_int_in_a_dict_changed_in_place_becomes_an_array():
    def update(counters, x):
        counters["n"] += 1
        counters["total"] = counters["total"] + jnp.sum(x)

    counters = {"n": 0, "total": jnp.zeros(()), "mode": "train"}
    step = autoflat.step(update, num_steps=K)
    xs = data(8, 3)
    step(counters, xs[:K])
    step(counters, xs[K:])
    assert isinstance(counters["n"], jax.Array) and int(counters["n"]) == 8
    np.testing.assert_allclose(counters["total"], jnp.sum(xs), rtol=1e-5)
    assert counters["mode"] == "train"
    assert autoflat.stats(step).traces == 1


@claim(
    PAGE,
    "in a Flax NNX object every Variable holding a Python number becomes an array, changed or not, as `nnx.jit` traces them",
)
@pytest.mark.filterwarnings("ignore:.*\\.value.*:DeprecationWarning")
def test_python_numbers_in_nnx_variables_become_arrays():
    from flax import nnx

    class Count(nnx.Variable):
        pass

    class Counted(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(3, 3, rngs=rngs)
            self.count = Count(0)
            self.fixed = Count(3)

        def __call__(self, x):
            self.count.value += 1
            return self.lin(x) * self.fixed.value

    def train_step(model, x):
        model(x)

    ref_model, model = Counted(nnx.Rngs(0)), Counted(nnx.Rngs(0))
    ref = nnx.jit(train_step)
    xs = data(8, 3)
    for x in xs:
        ref(ref_model, x)
    step = autoflat.step(train_step, num_steps=K)
    step(model, xs[:K])
    step(model, xs[K:])
    assert isinstance(ref_model.count.value, jax.Array) and isinstance(
        ref_model.fixed.value, jax.Array
    )
    assert isinstance(model.count.value, jax.Array) and isinstance(model.fixed.value, jax.Array)
    assert (int(model.count.value), int(model.fixed.value)) == (8, 3)
    assert autoflat.stats(step).traces == 1


@claim(
    PAGE,
    'And a Python number put where the first call had an array (`opt_state.hyperparams["b2"] = 0.95` between calls, as `optax.inject_hyperparams` documents) goes in as an array too, weakly typed as `jax.jit` passes a Python number: one compile more, as under `jax.jit`, and then no more.',
)
def test_a_python_number_set_into_the_state_between_calls():
    tx = optax.inject_hyperparams(optax.adam)(learning_rate=1e-2, b2=0.999)

    def update(params, opt_state, x):
        loss, grads = jax.value_and_grad(_loss)(params, x)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    xs = data(8, 3)
    ref = jax.jit(update)
    rp, ro = _params(), tx.init(_params())
    step = autoflat.step(update, num_steps=K)
    p, o = _params(), tx.init(_params())
    for start in (0, K):
        if start:
            ro.hyperparams["b2"] = 0.95
            o = autoflat.unwrap(o)
            o.hyperparams["b2"] = 0.95
        for x in xs[start : start + K]:
            rp, ro, _ = ref(rp, ro, x)
        p, o, _ = step(p, o, xs[start : start + K])
        if start:  # and once more: no further compile
            o = autoflat.unwrap(o)
            o.hyperparams["b2"] = 0.9
            p, o, _ = step(p, o, xs[start : start + K])
            ro.hyperparams["b2"] = 0.9
            for x in xs[start : start + K]:
                rp, ro, _ = ref(rp, ro, x)
    tree_allclose((p, o), (rp, ro), rtol=1e-5)
    assert isinstance(o.hyperparams["b2"], jax.Array)  # an array again
    assert autoflat.stats(step).traces == 2  # one compile more, as jax.jit's
    assert ref._cache_size() == 2


# === What comes back ========================================================================


@claim(
    PAGE,
    "State that is a container or module comes back as a lazy handle. State that is one array (a carried PRNG key, a counter) comes back as that array, and state with no arrays (`None`, a Python int or string) as it is",
)
@claim(PAGE, "a carried PRNG key or counter as state | returned as the array")
def test_what_comes_back():
    import equinox as eqx

    def update(model, params, key, count, extra, n, tag, x):
        key, sub = jax.random.split(key)
        params = {"w": params["w"] + x + jax.random.normal(sub, ())}
        model = eqx.tree_at(lambda m: m.weight, model, model.weight * 0.5)
        count = count + 1
        return model, params, key, count, extra, n, tag

    model = eqx.nn.Linear(3, 3, key=jax.random.key(0))
    step = autoflat.step(update, num_steps=K, state=("extra", "n", "tag"))
    out = step(
        model,
        {"w": jnp.zeros(3)},
        jax.random.key(1),
        jnp.zeros((), jnp.int32),
        None,
        3,
        "run",
        data(K, 3),
    )
    model2, params, key, count, extra, n, tag = out
    assert autoflat.is_handle(model2) and autoflat.is_handle(params)
    assert isinstance(autoflat.unwrap(model2), eqx.nn.Linear)
    for a in (key, count):
        assert isinstance(a, jax.Array) and not autoflat.is_handle(a)
    assert int(count) == K
    jax.random.split(key)  # a real key array
    assert extra is None and n == 3 and type(n) is int and tag == "run"
    ref = jax.jit(lambda m, p, k, c, x: update(m, p, k, c, None, 3, "run", x)[:4])
    r = (model, {"w": jnp.zeros(3)}, jax.random.key(1), jnp.zeros((), jnp.int32))
    for x in data(K, 3):
        r = ref(*r, x)
    tree_allclose(params, r[1], rtol=1e-6)
    same_keys(key, r[2])


@claim(PAGE, "key, extra, out = sample(jax.random.key(0), None, jnp.ones(2))")
def test_the_example_of_what_comes_back():
    def sample(key, extra, x):
        key, sub = jax.random.split(key)
        return key, extra, jax.random.normal(sub, ()) + x

    step = autoflat.step(sample, num_steps=2)
    key, extra, out = step(jax.random.key(0), None, jnp.ones(2))
    assert extra is None
    key, sub = jax.random.split(key)
    rkey, routs = jax.random.key(0), []
    for x in jnp.ones(2):
        rkey, _, o = jax.jit(sample)(rkey, None, x)
        routs.append(o)
    tree_allclose(out, jnp.stack(routs), rtol=1e-6)


# === The patterns table, row by row (rows whose test is above carry its claim there too) ====


@claim(
    PAGE,
    "`return opt_update(i, g, opt_state)` (jax `example_libraries.optimizers`) | `opt_state` matched by value: state; a Python int `i` is static with `num_steps > 1`, the same for every step of a call (per-step indices `jnp.arange(i, i + k)` give each step its own, in one compile; `jnp.asarray(i)` is one traced value for every step of a call)",
)
@claim(
    PAGE,
    'The next call shows it: a Python int grown or shrunk by `num_steps` since the last call is an `autoflat.OptionError` that names per-step indices, `jnp.arange(i, i + num_steps)` (a leading axis of `num_steps`: per-step, traced, one compile), and `broadcast="i"` or `static_argnames="i"` for one value a call.',
)
def test_pattern_example_libraries_optimizer():
    from jax.example_libraries import optimizers

    opt_init, opt_update, get_params = optimizers.momentum(0.05, mass=0.9)

    def loss(params, x):
        w, b = params
        return jnp.sum((x @ w + b - 1.0) ** 2)

    def update(i, opt_state, batch):
        params = get_params(opt_state)
        return opt_update(i, jax.grad(loss)(params, batch), opt_state)

    params = (jnp.ones((3, 2)) * 0.1, jnp.zeros(2))
    xs = data(8, 5, 3)
    ref = jax.jit(update)
    rs = opt_init(params)
    for i in range(8):
        rs = ref(i, rs, xs[i])
    # a Python int i: static, the same for every step of a call; grown by num_steps, asked
    step = autoflat.step(update, num_steps=K)
    s = step(0, opt_init(params), xs[:K])
    assert role_line(step, "opt_state").startswith("state (matched by value")
    assert (
        role_line(step, "i")
        == "static (a Python int, static as in eqx.filter_jit) [rule: python-scalar]"
    )
    with pytest.raises(autoflat.OptionError) as info:
        step(K, s, xs[K:])
    assert "jnp.arange(i, i + 4)" in str(info.value) and 'broadcast="i"' in str(info.value)
    assert 'static_argnames="i"' in str(info.value)
    # per-step indices: one compile across values, as a jax.jit loop
    step = autoflat.step(update, num_steps=K)
    s = opt_init(params)
    for c in range(2):
        s = step(jnp.arange(c * K, (c + 1) * K), s, xs[c * K : (c + 1) * K])
    assert autoflat.stats(step).traces == 1
    tree_allclose(get_params(s), get_params(rs), rtol=1e-5)
    # jnp.asarray(i): broadcast, one compile, the same i for every step of a call
    step = autoflat.step(update, num_steps=K)
    s, rs = opt_init(params), opt_init(params)
    for c in range(2):
        s = step(jnp.asarray(c), s, xs[c * K : (c + 1) * K])
        for i in range(c * K, (c + 1) * K):
            rs = ref(c, rs, xs[i])
    assert autoflat.stats(step).traces == 1
    tree_allclose(get_params(s), get_params(rs), rtol=1e-5)


@claim(
    PAGE,
    "`return [(w - lr * dw, b - lr * db) for ...]` | the parameter list matched by value: state",
)
def test_pattern_a_list_comprehension_of_new_parameters():
    def loss(params, x):
        h = x
        for w, b in params:
            h = jnp.tanh(h @ w + b)
        return jnp.sum(h**2)

    def update(params, x):
        grads = jax.grad(loss)(params, x)
        lr = 0.1
        return [(w - lr * dw, b - lr * db) for (w, b), (dw, db) in zip(params, grads, strict=True)]

    params = [(jnp.ones((3, 3)) * 0.2, jnp.zeros(3)), (jnp.ones((3, 2)) * 0.1, jnp.zeros(2))]
    xs = data(8, 4, 3)
    (rp,), _ = jit_loop(update, (params,), (xs,), 8)
    step = autoflat.step(update, num_steps=K)
    (p,), _ = step_loop(step, (params,), (xs,), 8, K)
    tree_allclose(p, rp, rtol=1e-5)
    assert (
        role_line(step, "params")
        == "state (matched by value to return position 0) [rule: matched-by-value]"
    )


@claim(
    PAGE,
    "`return eqx.combine(params, static), opt_state, loss` | the model parameter matched by value: state",
)
def test_pattern_eqx_combine():
    import equinox as eqx

    tx = optax.sgd(0.1)

    def update(model, opt_state, x, y):
        params, static = eqx.partition(model, eqx.is_array)

        def loss_fn(p):
            m = eqx.combine(p, static)
            return jnp.mean((jax.vmap(m)(x) - y) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return eqx.combine(params, static), opt_state, loss

    model = eqx.nn.Linear(3, 2, key=jax.random.key(0))
    opt_state = tx.init(eqx.filter(model, eqx.is_array))
    xs, ys = data(8, 5, 3), data(8, 5, 2, seed=1)
    ref = eqx.filter_jit(update)
    rm, ro, rl = model, opt_state, []
    for i in range(8):
        rm, ro, loss = ref(rm, ro, xs[i], ys[i])
        rl.append(loss)
    step = autoflat.step(update, num_steps=K)
    m, o, losses = model, opt_state, []
    for c in (slice(0, K), slice(K, 8)):
        m, o, loss = step(m, o, xs[c], ys[c])
        losses.append(loss)
    tree_allclose(
        (autoflat.unwrap(m).weight, jnp.concatenate(losses)), (rm.weight, jnp.stack(rl)), rtol=1e-5
    )
    assert (
        role_line(step, "model")
        == "state (matched by value to return position 0) [rule: matched-by-value]"
    )


@claim(PAGE, "`discriminator_opt_state` taken, `opt_state` returned | matched by value: state")
def test_pattern_state_taken_and_returned_under_different_names():
    tx = optax.adam(1e-2)

    def update(params, discriminator_opt_state, x):
        loss, grads = jax.value_and_grad(lambda p: jnp.sum((p["w"] * x) ** 2))(params)
        updates, opt_state = tx.update(grads, discriminator_opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, loss

    params, xs = {"w": jnp.arange(3.0)}, data(8, 3)
    ref_state, (rl,) = jit_loop(update, (params, tx.init(params)), (xs,), 8)
    step = autoflat.step(update, num_steps=K)
    state, (losses,) = step_loop(step, (params, tx.init(params)), (xs,), 8, K)
    tree_allclose((state, losses), (ref_state, rl), rtol=1e-5)
    assert role_line(step, "discriminator_opt_state") == (
        "state (matched by value to return position 1) [rule: matched-by-value]"
    )


@claim(
    PAGE,
    '`state="p"` and `p` not returned by name | matched by value, or an error naming `p`: never carried unchanged',
)
def test_pattern_state_option_not_returned_by_name():
    def update(p, x):
        q = p - 0.1 * x
        return q, jnp.sum(q)

    xs = data(8, 3)
    (rp,), (rs,) = jit_loop(update, (jnp.full(3, 2.0),), (xs,), 8)
    step = autoflat.step(update, num_steps=K, state="p")
    (p,), (sums,) = step_loop(step, (jnp.full(3, 2.0),), (xs,), 8, K)
    tree_allclose((p, sums), (rp, rs), rtol=1e-5)
    assert role_line(step, "p").startswith("state (matched by value to return position 0)")

    def unmatched(p, x):
        return jnp.sum(p * x)

    with pytest.raises(autoflat.OptionError, match="`p` is named in state="):
        autoflat.step(unmatched, num_steps=K, state="p")(jnp.ones(3), data(K, 3))


@claim(
    PAGE,
    "a second model, an optax `GradientTransformation`, a reused key, `eos_id`, a full batch | broadcast or static",
)
def test_pattern_values_the_same_every_step():
    import equinox as eqx

    teacher = eqx.nn.MLP(3, 1, 4, 1, key=jax.random.key(1))
    tx = optax.sgd(0.05)

    def update(params, opt_state, teacher, tx, key, eos_id, full_batch, x):
        noise = jax.random.normal(key, ()) * 0.01
        target = jax.vmap(teacher)(full_batch)[:, 0] + eos_id
        loss, g = jax.value_and_grad(
            lambda p: jnp.mean((full_batch @ p + noise - target * x) ** 2)
        )(params)
        u, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, u), opt_state, loss

    rest = (teacher, tx, jax.random.key(7), 2, data(6, 3, seed=3))
    xs = jnp.linspace(1.0, 2.0, 8)
    ref = eqx.filter_jit(update)
    rp, ro = jnp.zeros(3), tx.init(jnp.zeros(3))
    for x in xs:
        rp, ro, _ = ref(rp, ro, *rest, x)
    step = autoflat.step(update, num_steps=K)
    p, o = jnp.zeros(3), tx.init(jnp.zeros(3))
    for c in (xs[:K], xs[K:]):
        p, o, _ = step(p, o, *rest, c)
    tree_allclose(p, rp, rtol=1e-5)
    assert role_line(step, "teacher").startswith("broadcast (")
    assert role_line(step, "tx").startswith("broadcast (")
    assert role_line(step, "key").startswith("broadcast (")
    assert role_line(step, "eos_id").startswith("static (")
    assert role_line(step, "full_batch").startswith("broadcast (")
    assert autoflat.stats(step).traces == 1


@claim(
    PAGE,
    '`labels = batch.pop("labels")` in the step or in a loss function closing over `batch` (Hugging Face\'s Flax examples) | per-step input: the step pops from its own copy, as under `jax.jit`; your batch keeps its labels',
)
@pytest.mark.parametrize("k", [1, K])
@pytest.mark.parametrize("where", ["body", "closure"])
def test_pattern_labels_popped_from_the_batch(where, k):
    if where == "body":

        def update(w, batch):
            labels = batch.pop("labels")
            loss, g = jax.value_and_grad(lambda w: jnp.mean((batch["x"] @ w - labels) ** 2))(w)
            return w - 0.1 * g, loss

    else:

        def update(w, batch):
            def loss_fn(w):
                labels = batch.pop("labels")
                return jnp.mean((batch["x"] @ w - labels) ** 2)

            loss, g = jax.value_and_grad(loss_fn)(w)
            return w - 0.1 * g, loss

    batches = {"x": data(8, 2, 3), "labels": data(8, 2, seed=1)}
    (rw,), (rl,) = jit_loop(update, (jnp.zeros(3),), (batches,), 8)
    assert sorted(batches) == ["labels", "x"]
    step = autoflat.step(update, num_steps=k)
    w, losses = jnp.zeros(3), []
    for start in range(0, 8, k):
        cut = (lambda a, s=start: a[s : s + k]) if k > 1 else (lambda a, s=start: a[s])
        chunk = jax.tree.map(cut, batches)
        w, loss = step(w, chunk)
        losses.append(jnp.atleast_1d(loss))
        assert sorted(chunk) == ["labels", "x"]  # your batch keeps its labels
    tree_allclose((w, jnp.concatenate(losses)), (rw, rl), rtol=1e-5)
    assert role_line(step, "batch").startswith("scanned (per-step")
    assert "`batch.pop(...)` at line" in role_line(step, "batch")


@claim(
    PAGE,
    "`def train_step(state, batch, dropout_rng)` returning `new_state, metrics, new_dropout_rng` | the key matched by value at its position: state, a new key every step",
)
def test_pattern_a_dropout_key_returned_after_the_metrics():
    from flax.training import train_state

    def apply_fn(params, x, key):
        keep = jax.random.bernoulli(key, 0.5, x.shape)
        return (x * keep) @ params["w"]

    def train_step(state, batch, dropout_rng):
        dropout_rng, new_dropout_rng = jax.random.split(dropout_rng)

        def loss_fn(params):
            return jnp.mean((state.apply_fn(params, batch, dropout_rng) - 1.0) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        new_state = state.apply_gradients(grads=grads)
        metrics = {"loss": loss, "key": jax.random.key_data(dropout_rng)}
        return new_state, metrics, new_dropout_rng

    state = train_state.TrainState.create(
        apply_fn=apply_fn, params={"w": jnp.ones((3, 1))}, tx=optax.sgd(0.1)
    )
    xs = data(8, 4, 3)
    ref = jax.jit(train_step)
    rs, rkey, rm = state, jax.random.key(0), []
    for x in xs:
        rs, m, rkey = ref(rs, x, rkey)
        rm.append(m)
    step = autoflat.step(train_step, num_steps=K)
    s, key, ms = state, jax.random.key(0), []
    for c in (xs[:K], xs[K:]):
        s, m, key = step(s, c, key)
        ms.append(m)
    got = jax.tree.map(lambda *a: jnp.concatenate(a), *ms)
    want = jax.tree.map(lambda *a: jnp.stack(a), *rm)
    tree_allclose((s.params, got), (rs.params, want), rtol=1e-5)
    assert len({tuple(np.ravel(k)) for k in np.asarray(got["key"])}) == 8  # a new key every step
    same_keys(key, rkey)
    assert role_line(step, "dropout_rng") == (
        "state (matched by value to return position 2) [rule: matched-by-value]"
    )


def _nnx_shared():
    """An NNX optimizer holding the model's own Variables (Flax's FSDP example), tied weights."""
    from flax import nnx

    class SGDState(nnx.Variable):
        pass

    class SGD(nnx.Pytree):
        def __init__(self, params, lr):
            self.lr = lr
            self.params = nnx.data(params)
            self.momentum = nnx.data(
                jax.tree.map(
                    lambda v: SGDState(jnp.zeros_like(v[...])),
                    self.params,
                    is_leaf=lambda x: isinstance(x, nnx.Variable),
                )
            )

        def update(self, grads):
            def update_fn(p, m, g):
                m[...] = 0.9 * m[...] + 0.1 * g[...]
                p[...] -= self.lr * m[...]

            jax.tree.map(
                update_fn,
                self.params,
                self.momentum,
                grads,
                is_leaf=lambda x: isinstance(x, nnx.Variable),
            )

    class Tied(nnx.Module):
        def __init__(self, rngs):
            self.enc = nnx.Linear(3, 3, rngs=rngs)
            self.dec = self.enc  # tied weights

        def __call__(self, x):
            return self.dec(jnp.tanh(self.enc(x)))

    return nnx, SGD, Tied


@claim(
    PAGE,
    "an NNX optimizer holding the model's own Variables (`SGD(nnx.variables(model, nnx.Param))`), tied weights, one object passed twice, both mutated in place | shared as with `nnx.jit`: the same Variable objects in the trace, written back once",
)
def test_pattern_shared_nnx_variables():
    nnx, SGD, Tied = _nnx_shared()

    def train_step(model, optimizer, x):
        def loss_fn(model):
            return jnp.mean((model(x) - x) ** 2)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(grads)
        return loss

    def fresh():
        model = Tied(nnx.Rngs(0))
        return model, SGD(nnx.variables(model, nnx.Param), 0.1)

    xs = data(8, 4, 3)
    ref_model, ref_opt = fresh()
    ref = nnx.jit(train_step)
    rl = [ref(ref_model, ref_opt, x) for x in xs]
    model, opt = fresh()
    step = autoflat.step(train_step, num_steps=K)
    losses = [step(model, opt, xs[s : s + K]) for s in (0, K)]
    tree_allclose(jnp.concatenate(losses), jnp.stack(rl), rtol=1e-5)
    tree_allclose(nnx.state(model), nnx.state(ref_model), rtol=1e-5)
    assert model.dec is model.enc
    held = jax.tree.leaves(opt.params, is_leaf=lambda v: isinstance(v, nnx.Variable))
    assert any(v is model.enc.kernel for v in held)  # still the model's own Variables

    def two(model, other, x):  # one object passed twice, both mutated
        model.enc.kernel[...] = model.enc.kernel[...] + jnp.sum(x)
        other.enc.bias[...] = other.enc.bias[...] + 1.0

    ref_model, model = Tied(nnx.Rngs(0)), Tied(nnx.Rngs(0))
    ref = nnx.jit(two)
    for x in xs[:3]:
        ref(ref_model, ref_model, x)
    step = autoflat.step(two)
    for x in xs[:3]:
        step(model, model, x)
    tree_allclose(nnx.state(model), nnx.state(ref_model), rtol=1e-5)


@claim(
    PAGE,
    "`x = f(x); return params, x` with `num_steps=1` (a parameter rebound to another shape) | state, returned as the new array; that program is not donated (its buffers could not hold the result)",
)
def test_pattern_a_parameter_rebound_to_another_shape():
    def update(params, x):
        x = x[:, :2] * params["w"]
        params = {"w": params["w"] + 1.0}
        return params, x

    step = autoflat.step(update)
    ref = jax.jit(update)
    p, rp = {"w": jnp.ones(2)}, {"w": jnp.ones(2)}
    for _ in range(3):
        x = jnp.ones((4, 3))
        p, y = step(p, x)
        rp, ry = ref(rp, x)
        assert y.shape == (4, 2) and not x.is_deleted()  # not donated
        tree_allclose((p, y), (rp, ry))
    assert role_line(step, "x") == "state (returned) [rule: returned-by-name]"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "donated buffers were not usable"
        step(p, jnp.ones((4, 3)))


# === Overrides ==============================================================================


@claim(
    PAGE,
    "`state=`, `broadcast=`, `static_argnames=` and `per_step=` take a name or a sequence of names and win over everything inferred",
)
def test_overrides_take_names_or_sequences_and_win():
    def update(a, b, x, y, n, m):
        a = a + x * n
        b = b + y * m
        return a, b

    xs = data(K, 3)
    # inferred: a, b state (returned by name); n, m static (Python numbers at num_steps > 1)
    step = autoflat.step(update, num_steps=K, broadcast=["a", "b"], per_step=("n", "m"))
    a, b = step(jnp.zeros(3), jnp.zeros(3), xs, xs, jnp.arange(4.0), jnp.arange(4.0))
    want = [
        jax.jit(update)(jnp.zeros(3), jnp.zeros(3), xs[i], xs[i], float(i), float(i))
        for i in range(K)
    ]
    tree_allclose((a, b), jax.tree.map(lambda *t: jnp.stack(t), *want))  # the same a, b each step
    for name in ("a", "b"):
        assert role_line(step, name) == "broadcast (broadcast=) [rule: option-or-self]"
    for name in ("n", "m"):
        assert role_line(step, name) == "scanned (per_step=) [rule: option-or-self]"
    # inferred at num_steps=1: Python floats traced (one compile); static_argnames= wins
    step = autoflat.step(update, static_argnames=["n", "m"])
    a, b = step(jnp.zeros(3), jnp.zeros(3), xs[0], xs[0], 1.0, 2.0)
    step(a, b, xs[0], xs[0], 3.0, 2.0)
    assert autoflat.stats(step).traces == 2
    assert role_line(step, "n") == "static (static_argnames=) [rule: option-or-self]"
    # inferred: asked about (per-step or state?); state= as a sequence wins
    step = autoflat.step(_halved, num_steps=K, state=["v"])
    (v,), _ = step_loop(step, (jnp.arange(4.0),), (data(8, 2),), 8, K)
    (rv,), _ = jit_loop(_halved, (jnp.arange(4.0),), (data(8, 2),), 8)
    tree_allclose(v, rv, rtol=1e-6)
    assert role_line(step, "v").startswith("state (")


@claim(
    PAGE,
    '`state=` also takes a mapping from parameter to the return position that gives it back (`state={"generator": 0, "discriminator": 1}`)',
)
def test_state_takes_a_mapping_to_return_positions():
    def update(generator, discriminator, x):
        g = {"w": generator["w"] + discriminator["w"] + x}
        d = {"w": generator["w"] - discriminator["w"]}
        return g, d

    start = ({"w": jnp.ones(3)}, {"w": jnp.full(3, 3.0)})
    xs = data(8, 3)
    step = autoflat.step(update, num_steps=K, state={"generator": 0, "discriminator": 1})
    state, _ = step_loop(step, start, (xs,), 8, K)
    ref_state, _ = jit_loop(update, start, (xs,), 8)
    tree_allclose(state, ref_state, rtol=1e-5)
    assert (
        role_line(step, "generator") == "state (state= at return position 0) [rule: state-option]"
    )
    assert (
        role_line(step, "discriminator")
        == "state (state= at return position 1) [rule: state-option]"
    )


@claim(
    PAGE,
    "A name that is not a parameter, or one given two roles, is an `autoflat.OptionError` at decoration.",
)
@pytest.mark.parametrize(
    "options",
    [
        {"state": "q"},
        {"broadcast": ["p", "nope"]},
        {"static_argnames": "nope"},
        {"per_step": "nope"},
        {"state": {"nope": 0}},
        {"state": "p", "broadcast": "p"},
        {"per_step": "x", "static_argnames": "x"},
        {"broadcast": "x", "per_step": "x"},
    ],
)
def test_bad_option_names_fail_at_decoration(options):
    def update(p, x):
        p = p + x
        return p

    with pytest.raises(autoflat.OptionError):
        autoflat.step(update, num_steps=K, **options)


BODY_RUNS = [0]


def _sgd_updates(params, opt_state, batch):
    BODY_RUNS[0] += 1
    x, y = batch
    loss, g = jax.value_and_grad(lambda p: jnp.mean((x @ p["w"] - y) ** 2))(params)
    updates, opt_state = _TX.update(g, opt_state)
    return updates, opt_state, loss


def _counted(params, opt_state, batch):
    updates, opt_state, loss = _sgd_updates(params, opt_state, batch)
    params = optax.apply_updates(params, updates)
    return params, opt_state, loss


def _renamed(params, opt_state, batch):
    updates, new_opt_state, loss = _sgd_updates(params, opt_state, batch)
    new_params = optax.apply_updates(params, updates)
    return new_params, new_opt_state, loss


_TX = optax.sgd(0.1)


@claim(
    PAGE,
    "where it matches nothing new (a batch tuple that only could have been state), the call "
    "compiles that very trace, and the step is traced once, as under `jax.jit`",
)
@pytest.mark.parametrize("num_steps", [1, K])
def test_an_evaluation_that_matches_nothing_new_is_the_programs_trace(num_steps):
    params = {"w": jnp.ones((3, 2))}
    opt_state = _TX.init(params)
    batch = data(num_steps, 4, 3), data(num_steps, 4, 2)
    if num_steps == 1:
        batch = batch[0][0], batch[1][0]
    step = autoflat.step(_counted, num_steps=num_steps)
    BODY_RUNS[0] = 0
    p, o, loss = step(params, opt_state, batch)
    assert BODY_RUNS[0] == 1 and autoflat.stats(step).traces == 1  # one trace, as jax.jit
    assert role_line(step, "batch").startswith("scanned (per-step")
    ref, ref_opt = params, opt_state
    bs = [batch] if num_steps == 1 else [(batch[0][i], batch[1][i]) for i in range(num_steps)]
    for b in bs:
        ref, ref_opt, ref_loss = jax.jit(_counted)(ref, ref_opt, b)
    tree_allclose(p, ref)
    tree_allclose(o, ref_opt)


@claim(
    PAGE,
    "where it matches state returned under another name, the program of the roles it settles "
    "is traced too",
)
def test_state_matched_under_another_name_traces_its_program_too():
    params = {"w": jnp.ones((3, 2))}
    opt_state = _TX.init(params)
    step = autoflat.step(_renamed)
    BODY_RUNS[0] = 0
    p, o, _ = step(params, opt_state, (jnp.ones((4, 3)), jnp.zeros((4, 2))))
    assert role_line(step, "params").startswith("state (matched by value")
    assert BODY_RUNS[0] == 2 and autoflat.stats(step).traces == 1
    BODY_RUNS[0] = 0
    step(p, o, (jnp.ones((4, 3)), jnp.zeros((4, 2))))
    assert BODY_RUNS[0] == 0  # compiled once, kept


@claim(
    PAGE,
    'By name (rule 2), `params` comes back unchanged and only `prev` trains; as a `lax.scan` carry `(params, prev)`, position 0 is the new `params` and `prev` takes the old one. With `num_steps > 1` the `autoflat.OptionError` names `state={"params": 0, "prev": 1}` for the carry, and `state={"prev": 0}, broadcast="params"` for a `params` that is the same every step.',
)
@claim(
    PAGE,
    "(With `num_steps=1` each position comes back as the body computed it, either way: no error.)",
)
def test_by_name_or_by_position_asks():
    def train(params, prev, x):
        g = jax.grad(lambda p: jnp.sum((p * x - 1.0) ** 2))(params)
        new = params - 0.1 * g + 0.5 * (params - prev)
        return new, params, jnp.sum(g)

    xs = jnp.linspace(0.5, 1.5, 12).reshape(4, 3)
    start = jnp.zeros(3)
    with pytest.raises(autoflat.OptionError) as raised:
        autoflat.step(train, num_steps=4)(start, start, xs)
    assert 'state={"params": 0, "prev": 1}' in str(raised.value)
    assert 'state={"prev": 0}, broadcast="params"' in str(raised.value)
    carry = autoflat.step(train, num_steps=4, state={"params": 0, "prev": 1})
    got = carry(start, start, xs)
    want = (start, start)
    for x in xs:
        *want, loss = jax.jit(train)(*want, x)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-6)
    one = autoflat.step(train)(start, start, xs[0])  # one step a call: no error
    np.testing.assert_allclose(one[0], jax.jit(train)(start, start, xs[0])[0])


@claim(
    PAGE,
    "| `def update(w, total, x): ... return w, total + loss` called with `total=0.0` | `total` state, carried as an array: the sum over every step |",
)
@claim(
    PAGE,
    "or a scalar array made by an addition whose first operand is the number, `return w, total + loss` from `total=0.0` (at its place, or else at the one open position made by a sum, `+`: `return w, loss, total + loss`, or a broadcast full batch before it shifting its place), or a value computed from the number returned under its name or its name with `new`/`next` (`new_ema = 0.9 * ema + 0.1 * loss; return w, new_ema`, from any start; a name only sharing a word, `loss` beside `loss_weight`, says nothing): then state, carried as an array, as a `lax.scan` carries it; a loss beside a number it is not computed from, a product such as `loss * scale`, a number added to a loss, `loss + eps` or `loss - f_star`, or a number the step needs concrete leaves the number static; a sum resumed from a number that is not 0 at the first call is an error naming `state=` and `static_argnames=`",
)
@claim(
    PAGE,
    "| `def update(w, opt_state, x, *, scale=1.0): ... return w, opt_state, loss * scale` | `scale` static: a product is not a running sum |",
)
@claim(
    PAGE,
    '| `def update(w, total, x): ... return w, total + loss` called with `total=3.0` | an `OptionError`: a sum resumed, or a constant added to? `state={"total": 1}` or `static_argnames="total"` |',
)
@claim(
    PAGE,
    "| `def update(w, eps, x): ... return w, loss + eps` | `eps` static: the loss is added to, not `eps` |",
)
@claim(
    PAGE,
    "| `def update(w, full_batch, total, x): ... return w, total + loss` called with `total=0.0`, `full_batch` broadcast | `total` state: found by its addition, where the full batch shifted its place |",
)
def test_a_python_number_summed_at_its_place_is_state():
    def update(w, total, x):
        loss = jnp.sum((w * x - 1.0) ** 2)
        return w - 0.01 * x, total + loss

    def with_rate(w, lr, x):
        w = w - lr * x
        return w, jnp.sum((w * x - 1.0) ** 2)

    xs = jnp.ones((4, 3)) * jnp.arange(4.0)[:, None]
    w, total = autoflat.step(update, num_steps=4)(jnp.zeros(3), 0.0, xs)
    want = (jnp.zeros(3), 0.0)
    for x in xs:
        want = jax.jit(update)(*want, x)
    np.testing.assert_allclose(total, want[1], rtol=1e-6)

    def shifted(w, full_batch, total, x):
        loss = jnp.sum((w * x - full_batch.mean()) ** 2)
        return w - 0.01 * x, total + loss

    full = data(10, 3)
    step = autoflat.step(shifted, num_steps=4)
    w, total = step(jnp.zeros(3), full, 0.0, xs)
    assert role_line(step, "total").startswith("state (a Python float")
    want = (jnp.zeros(3), 0.0)
    for x in xs:
        want = jax.jit(shifted)(want[0], full, want[1], x)
    np.testing.assert_allclose(total, want[1], rtol=1e-6)

    def logged(w, total, x):  # the loss at its place, the sum after it
        loss = jnp.sum((w * x - 1.0) ** 2)
        return w - 0.01 * x, loss, total + loss

    step = autoflat.step(logged, num_steps=4)
    w, losses, total = step(jnp.zeros(3), 0.0, xs)
    assert role_line(step, "total").startswith("state (a Python float")
    want = (jnp.zeros(3), 0.0)
    for x in xs:
        *want, total_want = jax.jit(logged)(*want, x)
        want = (want[0], total_want)
    np.testing.assert_allclose(total, want[1], rtol=1e-6)

    def weighted(w, x, loss_weight=0.5):  # `loss` shares a word only: static
        loss, g = jax.value_and_grad(lambda w: loss_weight * jnp.sum((x * w - 1.0) ** 2))(w)
        return w - 0.1 * g, loss

    step = autoflat.step(weighted, num_steps=4)
    w, losses = step(jnp.ones(3), xs)
    assert role_line(step, "loss_weight").startswith("static")
    want = jit_loop(weighted, (jnp.ones(3),), (xs,), 4)
    np.testing.assert_allclose(w, want[0][0], rtol=1e-6)
    np.testing.assert_allclose(losses, want[1][0], rtol=1e-6)

    def averaged(w, ema, x):
        loss = jnp.sum((w * x - 1.0) ** 2)
        new_ema = 0.9 * ema + 0.1 * loss
        return w - 0.01 * x, new_ema

    step = autoflat.step(averaged, num_steps=4)
    w, ema = step(jnp.zeros(3), 1.0, xs)
    assert role_line(step, "ema").startswith("state (a Python float")
    want = (jnp.zeros(3), 1.0)
    for x in xs:
        want = jax.jit(averaged)(*want, x)
    np.testing.assert_allclose(ema, want[1], rtol=1e-6)
    step = autoflat.step(with_rate, num_steps=4)
    _, losses = step(jnp.zeros(3), 0.1, xs)
    assert losses.shape == (4,)
    assert "# lr: static (a Python float" in autoflat.show(step)

    def scaled(w, opt_state, x, *, scale=1.0):
        loss = jnp.sum((w * x - 1.0) ** 2) * scale
        return w - 0.01 * x, opt_state, loss

    step = autoflat.step(scaled, num_steps=4)
    _, _, losses = step(jnp.zeros(3), jnp.zeros(()), xs)
    assert losses.shape == (4,)
    assert "# scale: static (a Python float" in autoflat.show(step)

    def plus_eps(w, eps, x):
        return w - 0.01 * x, jnp.sum((w * x - 1.0) ** 2) + eps

    step = autoflat.step(plus_eps, num_steps=4)
    _, losses = step(jnp.zeros(3), 1e-3, xs)
    assert losses.shape == (4,)
    assert "# eps: static (a Python float" in autoflat.show(step)
    with pytest.raises(autoflat.OptionError, match='state=\\{"total": 1\\}') as e:
        autoflat.step(update, num_steps=4)(jnp.zeros(3), 3.0, xs)
    assert 'static_argnames="total"' in str(e.value)


@claim(
    PAGE,
    'With `num_steps > 1`, a container matched by its type alone, where some leaf of the position is neither computed from it nor another argument given back as it came or made from per-step arguments alone (the input in an RNN carry `(h, x)` or `(h, x / 2)`) and nothing else says the position is its new value (one of the above, or a returned name holding its head word, its last word or its last other than `state` or a word for a container: `g` for `prev_g`, `new_bounds` for `clip_bounds`, `new_lr` or `sched_state` for `lr_state`, where `clip_stats`, sharing a word beside another, says nothing, nor does `loss` for `loss_weights`; gradients given back for a parameter named for them, `prev_grads`, or under a name sharing a word with it, are its new value, unless only that name says gradients, `params_grads` beside `teacher_params`), such as a tuple of clip bounds `(lo, hi)` beside a metrics tuple `(loss, jnp.mean(w))`, also under `clip_stats`, or a teacher\'s parameters beside the gradients returned, is an `autoflat.OptionError` naming that leaf: carried, every step would start from what may be a metric; `state={"bounds": 2}` or `broadcast="bounds"` says which it is.',
)
@claim(
    PAGE,
    'an `OptionError`: the metrics tuple has the bounds\' types, but its loss is not computed from them; `broadcast="bounds"` or `state={"bounds": 2}`',
)
@claim(
    PAGE,
    "matched by value: state (every leaf computed from it; an addition taking its own leaf)",
)
def test_a_container_linked_to_a_position_by_its_type_alone_is_asked_about():
    def update(w, x, bounds):
        lo, hi = bounds
        loss, g = jax.value_and_grad(lambda w: jnp.sum((x * w) ** 2))(w)
        w = w - 0.1 * jnp.clip(g, lo, hi)
        return w, (loss, jnp.mean(w))

    def rnn(w, carry, x):
        h, c = carry
        c = 0.5 * c + jnp.tanh(x * w + h)
        return w * 0.99, (jnp.tanh(c), c)

    def with_input(w, carry, x):  # the carry holds this step's input as it came
        h, prev_x = carry
        h = jnp.tanh(prev_x * w + h)
        return w * 0.99, (h, x)

    def tracked(w, tracker, x):
        count, _ = tracker
        loss = jnp.sum((x * w) ** 2)
        return w * 0.99, (count + 1.0, loss)

    xs = data(4, 3)
    bounds = (jnp.float32(-1.0), jnp.float32(1.0))
    with pytest.raises(autoflat.OptionError, match=r"its leaf at `\[0\]` is not computed from"):
        autoflat.step(update, num_steps=4)(jnp.ones(3), xs, bounds)
    step = autoflat.step(update, num_steps=4, broadcast="bounds")
    (w,), outs = step_loop(step, (jnp.ones(3),), (xs,), 4, 4, rest=(bounds,))
    (want_w,), want = jit_loop(update, (jnp.ones(3),), (xs,), 4, rest=(bounds,))
    np.testing.assert_allclose(w, want_w, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), outs, want)

    def distill(params, x, teacher):
        def loss(p):
            return jnp.sum((x @ p["w"] - x @ teacher["w"]) ** 2)

        grads = jax.grad(loss)(params)
        params = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
        return params, grads

    teacher = {"w": jnp.ones((3, 2))}
    with pytest.raises(
        autoflat.OptionError, match="it holds gradients, computed from whatever the loss reads"
    ):
        autoflat.step(distill, num_steps=4)({"w": jnp.zeros((3, 2))}, xs, teacher)

    def momentum(params, prev_grads, x):  # gradients given back for `prev_grads`
        g = jax.grad(lambda p: jnp.sum((x @ p["w"]) ** 2))(params)
        params = jax.tree.map(lambda p, a, b: p - 0.1 * (a + 0.5 * b), params, g, prev_grads)
        return params, g

    start = ({"w": jnp.zeros((3, 2))}, {"w": jnp.ones((3, 2))})
    got = autoflat.unwrap(autoflat.step(momentum, num_steps=4)(*start, xs))
    want = jit_loop(momentum, start, (xs,), 4)[0]
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), got, want)
    scalars = (jnp.float32(0.0), jnp.float32(0.0))
    zeros = (jnp.zeros(3), jnp.zeros(3))
    for fn, start in ((rnn, zeros), (with_input, zeros), (tracked, scalars)):
        step = autoflat.step(fn, num_steps=4)
        got = step(jnp.ones(3), start, xs)
        assert role_line(step, "tracker" if fn is tracked else "carry").startswith(
            "state (matched by value"
        )
        state = (jnp.ones(3), start)
        for i in range(4):
            state = jax.jit(fn)(*state, xs[i])
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), autoflat.unwrap(got), state
        )

    def clip_stats_step(w, clip_bounds, x):  # the clipped gradients' extremes, logged
        lo, hi = clip_bounds
        g = jnp.clip(jax.grad(lambda w: jnp.sum((x * w - 1.0) ** 2))(w), lo, hi)
        clip_stats = (jnp.min(g), jnp.max(g))
        return w - 0.1 * g, clip_stats

    def new_bounds_step(w, clip_bounds, x):  # running bounds, under a name of its words
        lo, hi = clip_bounds
        g = jax.grad(lambda w: jnp.sum((x * w - 1.0) ** 2))(w)
        new_bounds = (jnp.minimum(lo, jnp.min(g)), jnp.maximum(hi, jnp.max(g)))
        return w - 0.1 * jnp.clip(g, -1.0, 1.0), new_bounds

    bounds = (jnp.float32(-0.5), jnp.float32(0.5))
    with pytest.raises(autoflat.OptionError, match="only through a reduction"):
        autoflat.step(clip_stats_step, num_steps=4)(jnp.ones(3), bounds, xs)
    step = autoflat.step(new_bounds_step, num_steps=4)
    got = autoflat.unwrap(step(jnp.ones(3), bounds, xs))
    assert role_line(step, "clip_bounds").startswith("state (matched by value")
    state = (jnp.ones(3), bounds)
    for i in range(4):
        state = jax.jit(new_bounds_step)(*state, xs[i])
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), got, state)


@claim(
    PAGE,
    "A container of scalar arrays (`(count, total)`, `(mu, sd)`, `(lr, wd)`) asks more: no leaf of the position is computed from it only through a reduction (a mean, a sum, a norm) of arrays it was spread over (the loss of a step that normalises its inputs by `(mu, sd)`; the gradient norm beside `(lr, wd)` with `wd * jnp.sum(w**2)` in the loss), with the same exceptions and evidence; else the same `autoflat.OptionError`. `count + 1`, `0.9 * ema + 0.1 * loss`, `jnp.min(jnp.stack([best, loss]))` and a flag `wait >= 2` made from a sibling leaf are computed from it otherwise.",
)
@claim(
    PAGE,
    'an `OptionError`: the loss is computed from `mu` only through a mean; `broadcast="stats"` or `state={"stats": 1}`',
)
def test_a_container_of_scalars_is_computed_from_its_own_leaves():
    def normalised(w, stats, x):
        mu, sd = stats
        loss, g = jax.value_and_grad(lambda w: jnp.mean((((x - mu) / sd) * w - 1.0) ** 2))(w)
        return w - 0.1 * g, (loss, jnp.sqrt(jnp.sum(g**2)))

    def decayed(w, hp, x):
        lr, wd = hp
        loss, g = jax.value_and_grad(lambda w: jnp.sum((x * w) ** 2) + wd * jnp.sum(w**2))(w)
        return w - lr * g, (loss, jnp.sqrt(jnp.sum(g**2)))

    def tracked(w, st, x):
        (count, total), (ema, best, wait, stop) = st
        loss = jnp.sum((x * w) ** 2)
        wait = jnp.where(loss < best, 0.0, wait + 1.0)
        return w * 0.99, (
            (count + 1.0, total + loss),
            (0.9 * ema + 0.1 * loss, jnp.min(jnp.stack([best, loss])), wait, wait >= 2),
        )

    xs = data(4, 3)
    pair = (jnp.float32(0.5), jnp.float32(2.0))
    for fn, name in ((normalised, "stats"), (decayed, "hp")):
        with pytest.raises(autoflat.OptionError) as e:
            autoflat.step(fn, num_steps=4)(jnp.ones(3), pair, xs)
        message = str(e.value)
        assert f"is computed from `{name}` only through a reduction" in message
        assert f'broadcast="{name}"' in message and f'state={{"{name}": 1}}' in message
        got = autoflat.step(fn, num_steps=4, broadcast=name)(jnp.ones(3), pair, xs)
        w, outs = jnp.ones(3), []
        for i in range(4):
            w, out = jax.jit(fn)(w, pair, xs[i])
            outs.append(out)
        tree_allclose(got, (w, jax.tree.map(lambda *o: jnp.stack(o), *outs)))

    f32 = jnp.float32
    start = ((f32(0.0), f32(0.0)), (f32(1.0), f32(9.0), f32(0.0), jnp.bool_(False)))
    step = autoflat.step(tracked, num_steps=4)
    got = step(jnp.ones(3), start, xs)
    assert "# st: state (matched by value" in autoflat.show(step)
    want = (jnp.ones(3), start)
    for i in range(4):
        want = jax.jit(tracked)(*want, xs[i])
    tree_allclose(got, want)


@claim(
    PAGE,
    "Nor does a leaf of the position that the step reads give way to a value computed from the model or the batch but not from that leaf (a TD error's square at `alpha`'s place beside `(gamma, alpha)`, the error computed from `gamma` and weighed into the values by `alpha`); a leaf made from its container's other leaves is a schedule (`(count + 1, schedule(count))`), and one the step does not read may take any value (`(count + 1, loss)`); else the same `autoflat.OptionError`.",
)
def test_a_read_leaf_of_scalars_giving_way_to_a_metric_is_asked_about():
    def td(v, hp, x, r):  # TD(0) on linear values, the TD error logged beside the rates
        gamma, alpha = hp
        err = r[0] + gamma * (x[1] @ v) - x[0] @ v
        return v + alpha * err * x[0], (jnp.abs(err), err**2)

    def scheduled(w, st, x, r):
        count, lr = st
        g = jax.grad(lambda w: jnp.sum((w * x[0] - r[0]) ** 2))(w)
        count = count + 1
        return w - lr * g, (count, 0.1 / jnp.sqrt(count.astype(jnp.float32)))

    def tracked(w, st, x, r):
        count, _ = st
        loss, g = jax.value_and_grad(lambda w: jnp.sum((w * x[0] - r[0]) ** 2))(w)
        return w - 0.1 * g, (count + 1, loss)

    xs, rs = data(K, 2, 3), data(K, 3, seed=1)
    hp = (jnp.float32(0.9), jnp.float32(0.1))
    with pytest.raises(autoflat.OptionError) as e:
        autoflat.step(td, num_steps=K)(jnp.ones(3), hp, xs, rs)
    message = str(e.value)
    assert "its leaf at `[1]` is not computed from `hp[1]`, which the step reads" in message
    assert 'broadcast="hp"' in message and 'state={"hp": 1}' in message
    got = autoflat.step(td, num_steps=K, broadcast="hp")(jnp.ones(3), hp, xs, rs)
    v, outs = jnp.ones(3), []
    for i in range(K):
        v, out = jax.jit(td)(v, hp, xs[i], rs[i])
        outs.append(out)
    tree_allclose(got, (v, jax.tree.map(lambda *o: jnp.stack(o), *outs)), rtol=1e-5)
    for fn, st in (
        (scheduled, (jnp.int32(1), jnp.float32(0.1))),
        (tracked, (jnp.int32(0), jnp.float32(0.0))),
    ):
        want = (jnp.ones(3), st)
        for i in range(K):
            want = jax.jit(fn)(*want, xs[i], rs[i])
        step = autoflat.step(fn, num_steps=K)
        tree_allclose(step(jnp.ones(3), st, xs, rs), want, rtol=1e-5)
        assert role_line(step, "st").startswith("state (matched by value"), fn.__name__


@claim(
    PAGE,
    'Nor does a leaf of the position sum one of its leaves (or a value of them alone, `T**2`) times, or over, a value computed from the batch or the model, as a hyperparameter weighs a loss (Hinton distillation\'s `alpha * kd + (1 - alpha) * ce` beside `(alpha, T)`, `w_kl * kl`, `loss / loss_scale`, `jnp.std(pred) * y_std`), unless the leaf\'s last operation takes its own leaf (`b - lr * gb`: a model `y = a * x + b` of two scalars, whose gradient weighs `a` by the batch); else the same `autoflat.OptionError`, with the same evidence (`elapsed + dt` beside an EMA whose decay comes from the batch; a named tuple or a dataclass of its type built again), where a dict\'s keys are none for a leaf that is a value of the step times its own leaf (or a value of it alone, `jnp.exp(log_w)`, `w / total`) and nothing more, nor is a word its returned name shares with it beside others (only a name of its own words, beside words for new, is: `new_weights` for `expert_weights`): loss weights `{"ce": w_ce, "l2": w_l2}` beside the weighted parts `{"ce": w_ce * ce, "l2": w_l2 * l2}` are asked about, `loss_parts` beside `loss_weights` too (`{"loss": d * ema["loss"] + (1 - d) * loss}` keeps a running value). A running value is kept otherwise: its leaf times constants or its sibling leaves (`0.9 * ema + 0.1 * loss`, `mean * (n - 1) / n + x / n`, `scale * jnp.where(finite, 2.0, 0.5)`), or normalised by a sum taking it (`a / (a + b)`).',
)
@claim(
    PAGE,
    '| `def distill(w, hp, x, y): alpha, T = hp; ... return w, (alpha * kd + (1 - alpha) * ce, kd * T**2)`, `num_steps > 1` | an `OptionError`: the metrics tuple has `hp`\'s types, and its loss sums `alpha` times a loss; `broadcast="hp"` or `state={"hp": 1}` |',
)
def test_a_container_of_scalars_weighing_a_loss_is_asked_about():
    teacher = jnp.full(3, 0.5)

    def distill(w, hp, x, y):
        alpha, temp = hp

        def full(w):
            s, t = x * w, x * teacher
            kd = jnp.mean((jax.nn.sigmoid(s / temp) - jax.nn.sigmoid(t / temp)) ** 2)
            return alpha * kd + (1 - alpha) * jnp.mean((s - y) ** 2), kd

        (loss, kd), g = jax.value_and_grad(full, has_aux=True)(w)
        return w - 0.1 * g, (loss, kd * temp**2)

    def unscaled(w, hp, x, y):
        loss_scale, _ = hp
        scaled, g = jax.value_and_grad(lambda w: loss_scale * jnp.mean((x * w - y) ** 2))(w)
        return w - 0.1 * g / loss_scale, (scaled / loss_scale, scaled)

    def denormalised(w, st, x, y):
        y_mean, y_std = st
        g = jax.grad(lambda w: jnp.mean((x * w - (y - y_mean) / y_std) ** 2))(w)
        return w - 0.1 * g, (jnp.mean(x * w) * y_std + y_mean, jnp.std(x * w) * y_std)

    def named(w, hp, x, y):  # (a named tuple of the same type: its new value)
        loss = jnp.mean((x * w - y) ** 2)
        return w * 0.9, _Control(hp.coef * (1.0 + 0.1 * jnp.tanh(loss)), hp.target)

    def kept(w, st, x, y):
        n, mean, scale, a, b = st
        loss = jnp.mean((x * w - y) ** 2)
        n = n + 1.0
        finite = jnp.isfinite(loss)
        return w * 0.9, (
            n,
            mean * (n - 1) / n + loss / n,
            scale * jnp.where(finite, 2.0, 0.5),
            (a + loss) / (a + loss + b),
            b / (a + loss + b),
        )

    def fitted(w, ab, x, y):  # (a model `y = a * x + b` of two scalars)
        _, (ga, gb) = jax.value_and_grad(lambda p: jnp.mean((p[0] * x + p[1] - y) ** 2))(ab)
        return w * 0.9, (ab[0] - 0.1 * ga, ab[1] - 0.1 * gb)

    def irregular(w, st, x, y):  # (an EMA whose decay comes from the batch)
        level, elapsed = st
        dt = jnp.abs(x[0]) + 0.1
        decay = jnp.exp(-dt)
        return w * 0.9, (decay * level + (1 - decay) * jnp.mean(y), elapsed + dt)

    xs, ys = data(4, 3), data(4, 3, seed=1)
    pair = (jnp.float32(0.9), jnp.float32(2.0))
    for fn, name, at in ((distill, "hp", 0), (unscaled, "hp", 0), (denormalised, "st", 1)):
        with pytest.raises(autoflat.OptionError) as e:
            autoflat.step(fn, num_steps=4)(jnp.ones(3), pair, xs, ys)
        message = str(e.value)
        assert f"its leaf at `[{at}]` sums a leaf of `{name}` times a value computed" in message
        assert f'broadcast="{name}"' in message and f'state={{"{name}": 1}}' in message
        got = autoflat.step(fn, num_steps=4, broadcast=name)(jnp.ones(3), pair, xs, ys)
        w, outs = jnp.ones(3), []
        for i in range(4):
            w, out = jax.jit(fn)(w, pair, xs[i], ys[i])
            outs.append(out)
        tree_allclose(got, (w, jax.tree.map(lambda *o: jnp.stack(o), *outs)))

    f32 = jnp.float32
    for fn, start in (
        (named, _Control(f32(0.1), f32(0.02))),
        (kept, (f32(0.0), f32(0.0), f32(2.0**8), f32(1.0), f32(2.0))),
        (fitted, (f32(0.5), f32(-0.5))),
        (irregular, (f32(0.0), f32(0.0))),
    ):
        step = autoflat.step(fn, num_steps=4)
        got = step(jnp.ones(3), start, xs, ys)
        assert "state (matched by value to return position 1)" in autoflat.show(step)
        want = (jnp.ones(3), start)
        for i in range(4):
            want = jax.jit(fn)(*want, xs[i], ys[i])
        tree_allclose(got, want)


class _Control(typing.NamedTuple):
    coef: jax.Array
    target: jax.Array


@claim(
    PAGE,
    "so is a changed number at its place given back under a name neither its own (nor it with `new`/`next`) nor another parameter's, unless it is its int plus one: `lr = base_lr * 0.1 ** (epoch // 30); return params, lr`",
)
@claim(
    PAGE,
    '| `def update(params, base_lr, epoch, x): lr = base_lr * 0.1 ** (epoch // 30); ... return params, lr`, `num_steps > 1` | an `OptionError`: `base_lr`\'s new value, or a rate computed from it and logged? `state={"base_lr": 1}` or `static_argnames="base_lr"` |',
)
def test_a_python_number_changed_at_its_place_under_another_name_is_asked_about():
    def update(params, base_lr, epoch, x):
        lr = base_lr * 0.1 ** (epoch // 30)
        return params - lr * jnp.mean(x) * params, lr

    def counted(w, step, x):  # its int plus one, under another name
        count = step + 1
        return w * jnp.mean(x), count

    def decayed(w, lr, x):  # it with `new`
        new_lr = lr * 0.5
        return w - new_lr * jnp.mean(x) * w, new_lr

    xs = data(K, 2)
    with pytest.raises(autoflat.OptionError) as e:
        autoflat.step(update, num_steps=K)(jnp.ones(2), 0.1, 30, xs)
    message = str(e.value)
    assert "return position 1 gives back `lr`, a Python float" in message
    assert 'state={"base_lr": 1}' in message and 'static_argnames="base_lr"' in message
    (want,), (rates,) = jit_loop(lambda p, x: update(p, 0.1, 30, x), (jnp.ones(2),), (xs,), K)
    step = autoflat.step(update, num_steps=K, static_argnames="base_lr")
    got, got_rates = step(jnp.ones(2), 0.1, 30, xs)
    tree_allclose((got, got_rates), (want, rates))
    state = (jnp.ones(2), 0.1)
    for i in range(K):
        state = jax.jit(update, static_argnums=2)(*state, 30, xs[i])
    step = autoflat.step(update, num_steps=K, state={"base_lr": 1})
    tree_allclose(step(jnp.ones(2), 0.1, 30, xs), state)
    for fn, start in ((counted, 0), (decayed, 0.1)):
        state = (jnp.ones(2), start)
        for i in range(K):
            state = jax.jit(fn)(*state, xs[i])
        step = autoflat.step(fn, num_steps=K)
        tree_allclose(step(jnp.ones(2), start, xs), state)
        assert role_line(step, fn.__code__.co_varnames[1]).startswith("state (a Python")


@claim(
    PAGE,
    "an expression there counts for the number only if computed from it, so `step + 1` at the place of an `epoch` before `step` is `step`'s",
)
def test_an_expression_at_a_number_s_place_counts_only_for_what_it_is_computed_from():
    def update(w, epoch, step, x):
        lr = 0.1 / (1 + step) * 0.5**epoch
        return w - lr * jnp.mean(x) * w, step + 1

    xs = data(K, 2)
    step = autoflat.step(update, num_steps=K)
    got = step(jnp.ones(2), 2, 0, xs)
    assert role_line(step, "epoch").startswith("static (a Python int")
    assert role_line(step, "step").startswith("state (a Python int")
    want = (jnp.ones(2), 0)
    for i in range(K):
        want = jax.jit(update, static_argnums=1)(want[0], 2, want[1], xs[i])
    tree_allclose(got, want)
