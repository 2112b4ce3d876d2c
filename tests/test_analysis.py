"""Source analysis and roles: parameters, returns, writes, unsupported constructs, errors."""

from __future__ import annotations

import functools
import typing

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autoflat
from autoflat._analysis.analysis import Return, analyse
from autoflat._roles.roles import Options, assign_roles


def functional(model, opt_state, batch, *, lr: float = 0.1):
    """Doc."""
    loss = jnp.sum(batch)
    if loss > 0:
        return model, opt_state, loss
    return model, opt_state, -loss


def mutating(model, metrics, x):
    model.w = model.w + x
    metrics["n"] += 1
    model.layers[0].b = x
    x.reshape(-1)  # a method call on a non-state parameter


def test_analysis_value():
    a = analyse(functional)
    line = functional.__code__.co_firstlineno
    assert a.name == "functional"
    assert a.def_line == line
    assert a.body_first_line == line + 1
    assert [p.name for p in a.params] == ["model", "opt_state", "batch", "lr"]
    assert [p.kind for p in a.params][-1] == "keyword_only"
    assert a.params[-1].has_default
    assert a.returns == (
        Return(line + 4, "tuple", ("model", "opt_state", "loss")),
        Return(line + 5, "tuple", ("model", "opt_state", None)),
    )
    assert not a.falls_through
    assert a.assigned == frozenset()
    assert {"jnp"} <= a.free_names
    assert a == analyse(functional)  # a plain, comparable value


def test_writes_and_method_calls():
    a = analyse(mutating)
    line = mutating.__code__.co_firstlineno
    assert a.assigned == {"model", "metrics"}
    assert dict(a.assigned_lines) == {"model": line + 1, "metrics": line + 2}
    assert a.method_called == {"x"}
    assert a.falls_through
    roles = assign_roles(a, Options())
    assert roles.roles == ("state", "state", "scanned")
    assert roles.written_back == ("model", "metrics")
    assert roles.layout.kind == "none"


def test_roles_explicit_override():
    a = analyse(functional)
    roles = assign_roles(a, Options(broadcast=frozenset({"opt_state"}), static=frozenset({"lr"})))
    assert roles.roles == ("state", "broadcast", "scanned", "static")
    # opt_state is broadcast, so its returned position becomes a per-step output
    assert roles.layout.entries == (("state", 0), ("out", 0), ("out", 1))


def _square_sum(w):
    return jnp.sum(w**2)


def test_jit_wrappers_are_unwrapped_and_other_wrappers_refused():
    assert analyse(jax.jit(functional)).name == "functional"

    def deco(f):
        @functools.wraps(f)
        def wrapper(*args, **kwargs):
            return f(*args, **kwargs)

        return wrapper

    # A wrapper under the step would silently not run: refused, naming it.
    with pytest.raises(autoflat.SourceError, match=r"wrapped by `.*deco.<locals>.wrapper \("):
        autoflat.step(deco(functional))
    with pytest.raises(autoflat.SourceError, match="wrapped by `.*` under"):
        autoflat.step(jax.vmap(functional))
    # A transformation's function is named as such, not by JAX's traceback filter.
    with pytest.raises(autoflat.SourceError, match=r"wrapped by `a JAX transformation \(jax"):
        autoflat.step(jax.grad(_square_sum))
    # Shardings would be dropped: refused, naming them (where JAX exposes them). Static
    # arguments and donation are taken over (test_step).
    if hasattr(jax.jit(functional), "_jit_info"):
        mesh = jax.sharding.Mesh(jax.devices()[:1], ("x",))
        replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        with pytest.raises(autoflat.SourceError, match="with out_shardings under"):
            autoflat.step(jax.jit(functional, out_shardings=replicated))


def _raises(fn, match, kind=autoflat.SourceError, **options):
    with pytest.raises(autoflat.AutoflatError, match=match) as info:
        autoflat.step(fn, **options)
    assert type(info.value) is kind
    return str(info.value)


def test_lambda_exec_and_builtins_have_no_source():
    msg = _raises(lambda m: m, "it is a lambda")
    assert "test_analysis.py" in msg and "def update" in msg
    ns: dict = {}
    exec("def f(m):\n    return m\n", ns)
    _raises(ns["f"], "cannot read the source of `f`")
    _raises(len, "cannot read the source")


def test_unsupported_constructs_name_file_line_and_fix():
    def gen(model):
        yield model

    def writes_global(model):
        global GLOBAL_THING
        GLOBAL_THING = 1
        return model

    counter = 0

    def writes_nonlocal(model):
        nonlocal counter
        counter += 1
        return model

    async def coro(model):
        return model

    line = gen.__code__.co_firstlineno
    msg = _raises(gen, r"uses `yield`")
    assert f"test_analysis.py:{line + 1}" in msg and "replace `yield` by `return`" in msg
    _raises(writes_global, r"a `global` statement.*\n\n.*Return the value instead")
    _raises(writes_nonlocal, r"a `nonlocal` statement")
    _raises(coro, r"`async`/`await`")


def test_nested_generators_and_nonlocal_are_fine():
    def ok(model, x):
        def g():
            yield x

        total = 0

        def add():
            nonlocal total
            total = 1

        add()
        model = model + sum(g())
        return model, x

    autoflat.step(ok)


def test_returns_disagree():
    def arity(model, x):
        if x > 0:
            return model, x
        return model

    def positions(model, opt, x):
        if x > 0:
            return model, opt, x
        return opt, model, x

    def falls(model, x):
        if x > 0:
            return model, x

    def two_names(model, opt, x):  # one parameter here, another there, at one position
        if x > 0:
            return model, x
        return opt, x

    msg = _raises(arity, "disagree")
    line = arity.__code__.co_firstlineno
    assert f"line {line + 2} returns (model, x)" in msg and f"line {line + 3} returns model" in msg
    _raises(positions, "disagree")
    _raises(two_names, "disagree")
    _raises(falls, "returns nothing")


def test_bad_options():
    line = functional.__code__.co_firstlineno
    msg = _raises(
        functional,
        "state= names `nope`, which is not a parameter",
        autoflat.OptionError,
        state="nope",
    )
    assert "`functional` (" in msg and f"test_analysis.py:{line})" in msg
    assert "model, opt_state, batch, lr" in msg
    _raises(
        functional,
        "given two roles",
        autoflat.OptionError,
        broadcast="batch",
        static_argnames=["batch"],
    )
    _raises(functional, "num_steps must be an int", autoflat.OptionError, num_steps=0)


def test_option_errors_are_value_errors_and_source_errors_are_not():
    with pytest.raises(ValueError, match="not a parameter"):
        autoflat.step(functional, broadcast="nope")
    with pytest.raises(ValueError, match="given two roles"):
        assign_roles(
            analyse(functional),
            Options(state=frozenset({"batch"}), broadcast=frozenset({"batch"})),
        )
    with pytest.raises(autoflat.SourceError) as info:
        autoflat.step(lambda m: m)
    assert not isinstance(info.value, (TypeError, ValueError))


def test_a_functools_partial_is_analysed_as_the_function_it_wraps():
    """(tests/test_partial.py runs them.)"""
    analysis = analyse(functools.partial(functional, lr=0.5))
    assert analysis.name == "functional"
    assert analysis.where == f"{__file__}:{functional.__code__.co_firstlineno}"


def test_messages_name_the_function_by_its_qualname():
    class Trainer:
        def update(self, model, x):
            if x > 0:
                return model, x
            return model

    msg = _raises(Trainer.update, "disagree")
    assert "`test_messages_name_the_function_by_its_qualname.<locals>.Trainer.update`" in msg


def test_writes_follow_scopes():
    """A name refers to the parameter only where the parameter is one of the bindings it can
    see: nested functions' own parameters and locals, comprehension variables and lambda
    parameters of the same name are not the parameter; a rebound parameter still may be."""

    def step(model, cfg, opt, batch, key):
        def local_model():
            model = {}
            model["w"] = 1  # a local of the nested function
            return model

        def param_model(model):
            model.w = 2  # the nested function's own parameter
            model.reset()

        _ = [opt.append(1) for opt in range(2)]  # a comprehension variable
        _ = lambda key: key.update()  # noqa: E731  (a lambda parameter)

        def writes_outer():
            batch["seen"] = True  # the step's parameter, from a nested function

        cfg = dict(cfg)
        cfg["lr"] = 0.1  # after a rebinding: may still be the caller's object
        writes_outer()
        return local_model(), param_model(model)

    a = analyse(step)
    line = step.__code__.co_firstlineno
    assert a.assigned == {"cfg", "batch"}
    assert dict(a.assigned_lines) == {"batch": line + 14, "cfg": line + 17}
    assert a.method_called == set()


def test_one_line_function_and_kwargs_message():
    def one(x): return x * 2  # noqa: E704  # fmt: skip

    step = autoflat.step(one)
    assert float(step(jnp.float32(2.0))) == 4.0
    assert "return (), (x * 2,)" in autoflat.show(step)

    def kw(x, **options):
        return x

    # `**options` is one parameter, the dict of the call's extra keywords (tests/test_variadic.py).
    assert float(autoflat.step(kw)(jnp.float32(2.0), scale=3.0)) == 2.0


def test_state_option_on_a_value_not_returned_by_name():
    def f(w, x):
        return w + x

    step = autoflat.step(f, state="w")  # matched by value: `w + x` is the new `w`
    assert float(step(jnp.ones(2), jnp.ones(2))[0]) == 2.0
    assert "# w: state (matched by value to return position 0)" in step.source

    def g(w, x):
        return jnp.sum(w * x)

    with pytest.raises(autoflat.OptionError, match="`w` is named in state= but no `return`"):
        autoflat.step(g, state="w")(jnp.ones(2), jnp.ones(2))


def test_source_edited_since_import_is_a_clear_error(tmp_path, monkeypatch):
    import importlib
    import linecache

    path = tmp_path / "edited_mod.py"
    path.write_text("def update(model, x):\n    model = model + x\n    return model\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    mod = importlib.import_module("edited_mod")
    path.write_text("# a new first line\ndef other(a, b, c):\n    return a\n")
    linecache.checkcache(str(path))
    with pytest.raises(autoflat.SourceError, match="no longer matches the function"):
        autoflat.step(mod.update)


def test_body_edited_since_import_with_the_same_signature(tmp_path, monkeypatch):
    """The file changed after import but the `def` line did not (issue 13, item 8): the body
    on disk compiles to other code than the function imported, and autoflat refuses it rather
    than compile the new body."""
    import importlib
    import linecache

    path = tmp_path / "edited_body.py"
    path.write_text("def update(model, x):\n    model = model + x\n    return model\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    mod = importlib.import_module("edited_body")
    path.write_text("def update(model, x):\n    model = model - 2 * x\n    return model\n")
    linecache.checkcache(str(path))
    with pytest.raises(autoflat.SourceError, match="no longer matches the function"):
        autoflat.step(mod.update)
    # Moving the function in its file (a new first line) is not an edit.
    path.write_text(
        "\n# a comment\ndef update(model, x):\n    model = model + x\n    return model\n"
    )
    linecache.checkcache(str(path))
    np.testing.assert_allclose(autoflat.step(mod.update)(jnp.ones(2), jnp.ones(2)), [2.0, 2.0])


def _make_step_with_a_class():
    def step(params, x):
        class Out(typing.NamedTuple):
            params: jax.Array
            loss: jax.Array

        out = Out(params - 0.1 * x, jnp.sum(x))
        return out.params, out.loss

    return step


class _TrainerWithAClass:
    def update(self, params, x):
        class Out(typing.NamedTuple):
            params: jax.Array

        return Out(params - 0.1 * x).params


def test_a_class_defined_in_a_step_not_at_module_level_is_not_an_edit():
    """A class statement in a step made by a factory, or in a method step: its body stores
    its qualified name, which says where the `def` was compiled. It was taken for an edit of
    the file ("no longer matches the function") where `jax.jit` runs it."""
    made = _make_step_with_a_class()
    got = autoflat.step(made)(jnp.ones(3), jnp.ones(3))
    want = jax.jit(made)(jnp.ones(3), jnp.ones(3))
    np.testing.assert_allclose(got[0], want[0])
    np.testing.assert_allclose(got[1], want[1])
    trainer = _TrainerWithAClass()
    np.testing.assert_allclose(
        autoflat.step(trainer.update)(jnp.ones(3), jnp.ones(3)), jnp.full(3, 0.9)
    )


def test_a_renamed_function_is_not_taken_for_an_edited_one():
    def update(model, x):
        model = model + x
        return model

    update.__name__ = "renamed"
    update.__qualname__ = "renamed"
    step = autoflat.step(update)
    np.testing.assert_allclose(step(jnp.ones(2), jnp.ones(2)), [2.0, 2.0])


def test_closures_methods_and_future_annotations_match_their_source():
    """What the unedited-source check compiles the `def` in: a closure's free variables, a
    method's `__class__` cell (zero-argument super()), this module's `from __future__`."""
    from autoflat._analysis.source import matches_code, read_source

    scale = 2.0

    def closure(p: jax.Array, x: float) -> jax.Array:
        def inner(y: jax.Array) -> jax.Array:
            return y * scale

        return inner(p) + x

    class Base:
        def update(self, p, x):
            return p + x

    class Child(Base):
        def update(self, p, x):
            p = super().update(p, x) * scale
            return p

    for fn in (closure, Child.update, test_a_renamed_function_is_not_taken_for_an_edited_one):
        assert matches_code(fn, read_source(fn)[0]) is True, fn


def test_augmented_assignment_to_a_parameter_is_a_change_in_place():
    """`d |= {...}` and `xs += [...]` were missed: libcst counts the target of an augmented
    assignment as a binding only, not as a read of the parameter it names."""

    def update(d, xs, w, x):
        d |= {"a": x}
        xs += [x]
        w += x  # an array: rebound, not changed (rule 6 reads the type at the first call)

    a = analyse(update)
    line = update.__code__.co_firstlineno
    assert a.in_place == (
        ("d", "d |= ...", line + 1),
        ("w", "w += ...", line + 3),
        ("xs", "xs += ...", line + 2),
    )
    assert a.assigned == frozenset()


def test_writes_through_aliases():
    """A write through a name that holds a part of a parameter at every binding it can see
    is a write into the parameter, wherever the binding is (before, in a loop, in a nested
    function's enclosing scope)."""

    def step(m, d, params, batch, cfg, pairs, x):
        q = m.inner
        q.n = x  # line 2
        for _, (layer, other) in enumerate(zip(params["layers"], [{}, {}], strict=True)):
            layer["w"] = x  # line 4: params
            other["w"] = x  # a fresh dict: nothing
        inner = d.get("inner")
        inner.update(k=x)  # line 7: d, in place
        getattr(cfg, "opt").lr = x  # noqa: B009  (line 8)
        h = batch["x"]
        h += x  # an array rebound: not a change of batch
        c = cfg.model
        c = dict(c)
        c["k"] = x  # not only an alias of cfg: nothing
        for _, v in pairs.items():
            v["seen"] = True  # line 15: pairs

        def later():
            r.count = 0  # line 18: m, through `r` bound below

        r = m.counter
        later()

    a = analyse(step)
    line = step.__code__.co_firstlineno
    assert dict(a.assigned_lines) == {
        "m": line + 2,
        "params": line + 4,
        "cfg": line + 8,
        "pairs": line + 15,
    }
    assert a.in_place == (("d", "inner.update(...)", line + 7),)
