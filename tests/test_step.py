"""The `Step` facade and the public functions: wrapper attributes, `show`'s text, options
read once, errors a caller can catch by kind (each names the step by its qualname and
location)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

import autoflat


def accumulate(total, x):
    """Add x to the total."""
    total = total + x
    return total, x * 2


class Holder:
    @staticmethod
    def nested(total, x):
        total = total + x
        return total


def test_wrapper_attributes_come_from_the_function():
    step = autoflat.step(accumulate)
    assert step.__name__ == "accumulate" and step.__qualname__ == "accumulate"
    assert step.__doc__ == "Add x to the total." and step.__module__ == __name__
    assert step.__wrapped__ is accumulate
    assert functools.WRAPPER_ASSIGNMENTS  # update_wrapper's list, all present:
    for name in functools.WRAPPER_ASSIGNMENTS:
        if hasattr(accumulate, name):
            assert getattr(step, name) == getattr(accumulate, name)


def test_show_returns_the_text_and_prints_nothing(capsys):
    step = autoflat.step(accumulate)
    text = autoflat.show(step)
    assert capsys.readouterr().out == ""
    assert isinstance(text, str) and text.startswith("# autoflat: generated from `accumulate`")
    assert repr(text) == str(text)  # a REPL shows the code, not an escaped one-liner
    print(text)
    assert capsys.readouterr().out == text + "\n"  # printed once
    assert text == step.source


def test_errors_are_catchable_by_kind():
    step = autoflat.step(accumulate, num_steps=2)
    with pytest.raises(TypeError) as info:  # arguments that do not bind
        step(jnp.zeros(()))
    assert isinstance(info.value, autoflat.CallError)
    with pytest.raises(ValueError) as info:  # a missing leading axis
        step(jnp.zeros(()), jnp.ones((3,)))
    assert isinstance(info.value, autoflat.ShapeError)
    with pytest.raises(ValueError) as info:  # an option out of range
        autoflat.step(accumulate, num_steps=0)
    assert isinstance(info.value, autoflat.OptionError) and "num_steps" in str(info.value)
    with pytest.raises(ValueError, match="pack must be"):
        autoflat.step(accumulate, pack="sometimes")
    with pytest.raises(ValueError, match="state= takes"):
        autoflat.step(accumulate, state=[1])
    with pytest.raises(autoflat.OptionError, match="parameters of `accumulate` are"):
        autoflat.step(accumulate, state="nope")
    with pytest.raises(TypeError, match="decorated with @autoflat.step"):
        autoflat.show(accumulate)

    def scaled(total, x, scale):
        total = total + x * scale
        return total

    with pytest.raises(TypeError, match="static argument `scale`") as info:
        autoflat.step(scaled, static_argnames="scale")(jnp.zeros(()), jnp.ones(()), [2.0])
    assert isinstance(info.value, autoflat.CallError)

    def acc_dict(total, x):
        total = {"t": total["t"] + x}
        return total

    total = autoflat.step(acc_dict)({"t": jnp.zeros(())}, jnp.ones(()))
    autoflat.step(acc_dict)(total, jnp.ones(()))  # donates the handle `total`
    with pytest.raises(RuntimeError, match="consumed") as info:
        float(total["t"])
    assert isinstance(info.value, autoflat.ConsumedError)


def test_messages_name_the_step_by_qualname_and_location():
    step = autoflat.step(Holder.nested, num_steps=2)
    with pytest.raises(autoflat.ShapeError) as info:
        step(jnp.zeros(()), jnp.ones((3,)))
    message = str(info.value)
    assert "`Holder.nested`" in message and "test_step.py:" in message
    with pytest.raises(autoflat.CallError) as info:
        step(jnp.zeros(()))
    assert "`Holder.nested`" in str(info.value) and "test_step.py:" in str(info.value)


def test_pack_default_from_the_environment(monkeypatch):
    monkeypatch.delenv("AUTOFLAT_PACK", raising=False)
    assert autoflat.step(accumulate).pack == "auto"  # the default
    monkeypatch.setenv("AUTOFLAT_PACK", "on")
    assert autoflat.step(accumulate).pack is True
    monkeypatch.setenv("AUTOFLAT_PACK", "auto")
    assert autoflat.step(accumulate).pack == "auto"
    assert autoflat.step(accumulate, pack=False).pack is False  # the option wins
    monkeypatch.setenv("AUTOFLAT_PACK", "off")
    assert autoflat.step(accumulate).pack is False
    monkeypatch.setenv("AUTOFLAT_PACK", "maybe")
    with pytest.raises(ValueError, match="AUTOFLAT_PACK"):
        autoflat.step(accumulate)


def test_a_dropped_step_is_freed_with_its_broadcast_arrays():
    import gc
    import weakref

    import jax

    def make():
        def update(params, x, teacher):
            params = params + x * jnp.sum(teacher)
            return params

        return update

    gc.collect()
    before = len(jax.live_arrays())
    refs = []
    for _ in range(3):
        step = autoflat.step(make(), broadcast="teacher")
        out = step(jnp.zeros(8), jnp.ones(8), jnp.ones(64))
        refs.append(weakref.ref(step))
        del step, out
    gc.collect()
    # Nothing outside the step (JAX's caches included) keeps it, its programs or its arrays.
    assert [r() for r in refs] == [None, None, None]
    assert len(jax.live_arrays()) == before


def test_outputs_that_branch_on_a_batch_shape_come_back_as_traced():
    """Per-step inputs of another shape trace the same call spec again; results whose
    structure then differs (code that branches on a shape) come back as that trace built
    them, not in the first trace's structure."""
    import numpy as np

    def update(state, x):
        state = {"w": state["w"] + jnp.sum(x)}
        if x.shape[0] > 2:
            return state, {"big": jnp.sum(x), "n": x.shape[0] * jnp.ones(())}
        return state, jnp.sum(x)

    step = autoflat.step(update)
    s = {"w": jnp.zeros(())}
    s, small = step(s, jnp.ones(2))
    s, big = step(s, jnp.ones(4))
    s, small2 = step(s, jnp.ones(2))
    s, big2 = step(s, jnp.ones(4))
    assert float(small) == float(small2) == 2.0
    assert set(big) == set(big2) == {"big", "n"}
    np.testing.assert_allclose([big["big"], big2["n"]], [4.0, 4.0])
    np.testing.assert_allclose(s["w"], 12.0)
    assert autoflat.stats(step).traces == 2


@pytest.mark.parametrize("k", [1, 3])
def test_a_bound_method_is_taken_as_jax_jit_takes_it(k):
    """Trainers compile `self.train_step` in `__init__` (`jax.jit(self.train_step)`): autoflat
    refused it as "a method" and pointed at lambdas and REPLs."""
    import numpy as np
    import optax

    class Trainer:
        def __init__(self, lr):
            self.tx = optax.sgd(lr)
            self.step = autoflat.step(self.train_step, num_steps=k)
            self.ref = jax.jit(self.train_step)

        def train_step(self, params, opt_state, x):
            loss, grads = jax.value_and_grad(lambda p: jnp.sum((p["w"] * x - 1.0) ** 2))(params)
            updates, opt_state = self.tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

    t = Trainer(0.1)
    p = {"w": jnp.zeros(5)}
    xs = jnp.arange(1.0, 1.0 + 5 * k).reshape(k, 5) / 8
    params, _, losses = t.step(p, t.tx.init(p), xs if k > 1 else xs[0])
    rp, ro = p, t.tx.init(p)
    ref_losses = []
    for i in range(k):
        rp, ro, loss = t.ref(rp, ro, xs[i])
        ref_losses.append(loss)
    np.testing.assert_allclose(params["w"], rp["w"], rtol=1e-6)
    np.testing.assert_allclose(losses, ref_losses if k > 1 else ref_losses[0], rtol=1e-6)
    assert autoflat.stats(t.step).traces == 1


@pytest.mark.parametrize("k", [1, 2])
def test_a_jax_jit_with_static_arguments_and_donation_is_taken_over(k):
    """`@functools.partial(jax.jit, static_argnums=3, donate_argnums=(0, 1))` under autoflat,
    as training code decorates its steps: it was refused ("options autoflat would drop"). Its
    static arguments are static here (by name; numbers and names alike), its donation is the
    state autoflat carries. Shardings are still refused (test_analysis)."""
    import functools

    import numpy as np
    import optax

    tx = optax.sgd(0.1)

    def train_step(params, opt_state, x, num_classes):
        def loss_fn(p):
            logits = x @ p["w"]
            return -jnp.mean(jax.nn.one_hot(jnp.arange(x.shape[0]) % num_classes, 4) * logits)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    jitted = functools.partial(jax.jit, static_argnums=3, donate_argnums=(0, 1))(train_step)
    named = jax.jit(train_step, static_argnames="num_classes")
    xs = jax.random.normal(jax.random.key(0), (2 * k, 5, 3))
    p0 = {"w": jnp.zeros((3, 4))}
    rp, rs, ref_losses = p0, tx.init(p0), []
    for i in range(2 * k):
        rp, rs, loss = jitted({"w": rp["w"] + 0}, jax.tree.map(lambda a: a + 0, rs), xs[i], 4)
        ref_losses.append(loss)
    for wrapped in (jitted, named):
        step = autoflat.step(wrapped, num_steps=k)
        p, s, losses = p0, tx.init(p0), []
        for start in range(0, 2 * k, k):
            chunk = xs[start : start + k] if k > 1 else xs[start]
            p, s, loss = step(p, s, chunk, 4)
            losses.append(jnp.atleast_1d(loss))
        np.testing.assert_allclose(p["w"], rp["w"], rtol=1e-6)
        np.testing.assert_allclose(jnp.concatenate(losses), jnp.stack(ref_losses), rtol=1e-6)
        assert "# num_classes: static (static_argnames=)" in autoflat.show(step)
        assert autoflat.stats(step).traces == 1
        np.testing.assert_allclose(p0["w"], 0.0)  # the caller's arrays were not donated


def test_a_step_of_a_user_without_flax_never_imports_it(tmp_path):
    """autoflat looks for Flax NNX objects only where Flax is imported: a step on plain
    arrays runs with Flax unimportable (the PAX session's environment has none; a check
    that imported Flax to look for shared Variables broke it there)."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "sys.modules['flax'] = None\n"
        "import jax.numpy as jnp, autoflat\n"
        "def step(w, x):\n"
        "    w = w - 0.1 * x\n"
        "    return w, (w * x).sum()\n"
        "f = autoflat.step(step, num_steps=2)\n"
        "w, s = f(jnp.ones(2), jnp.ones((2, 2)))\n"
        "w, s = f(w, jnp.ones((2, 2)))\n"
        "print(float(autoflat.unwrap(w)[0]))\n"
    )
    path = tmp_path / "no_flax.py"
    path.write_text(script)
    done = subprocess.run([sys.executable, str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert abs(float(done.stdout) - 0.6) < 1e-6  # four steps of w - 0.1 * 1
