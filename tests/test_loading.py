"""Loading: live globals and closure cells, linecache, tracebacks at the user's file and line,
calling conventions, wrapped functions."""

from __future__ import annotations

import functools
import inspect
import linecache
import re
import traceback

import jax
import jax.numpy as jnp
import pytest

import autoflat

SCALE = 2.0


def scaled(x, y):
    x = x * SCALE + y
    return x, y


def test_live_globals():
    global SCALE
    step = autoflat.step(scaled, donate=False)
    x, _ = step(jnp.float32(1.0), jnp.float32(0.0))
    assert float(x) == 2.0
    SCALE = 3.0
    try:
        autoflat.clear_caches()  # a retrace sees the new global value, as with jax.jit
        x, _ = step(jnp.float32(1.0), jnp.float32(0.0))
        assert float(x) == 3.0
    finally:
        SCALE = 2.0


def test_live_closure_cells():
    factor = jnp.float32(2.0)

    @autoflat.step(num_steps=2)
    def step(total, x):
        total = total + factor * x
        return total, x * 1

    t, _ = step(jnp.float32(0.0), jnp.ones(2, jnp.float32))
    assert float(t) == 4.0
    factor = jnp.float32(5.0)  # noqa: F841  (the generated code sees the same cell)
    autoflat.clear_caches()
    t, _ = step(t, jnp.ones(2, jnp.float32))
    assert float(t) == 14.0


def test_linecache_and_inspect():
    step = autoflat.step(scaled)
    program = step.programs[0]
    line = scaled.__code__.co_firstlineno
    assert re.fullmatch(rf"<autoflat:scaled:\d+ from test_loading.py:{line}>", program.filename)
    assert "".join(linecache.getlines(program.filename)) == autoflat.show(step)
    assert inspect.getsource(program.fn).startswith("    def scaled(")


def boom(model, x):
    y = model + x
    z = jnp.dot(y, jnp.ones((3, 3)))  # shape error for a length-2 vector
    return model, z


def test_error_in_user_body_points_at_user_line():
    step = autoflat.step(boom, num_steps=4)
    model = jnp.zeros(2)
    with pytest.raises(TypeError) as info:
        step(model, jnp.ones((4, 2)))
    err_line = boom.__code__.co_firstlineno + 2
    frames = traceback.extract_tb(info.value.__traceback__)
    user_frames = [f for f in frames if f.filename == __file__]
    assert any(f.lineno == err_line and "jnp.dot" in (f.line or "") for f in user_frames), frames
    assert any(f"test_loading.py:{err_line}" in n for n in info.value.__notes__)
    # nothing was lost: the caller's model still works
    assert not model.is_deleted() and float(model.sum()) == 0.0


def _raises_inside(model, x):
    return jnp.dot(model, x)  # a shape error for the shapes below


def _returns_a_call(model, x):
    return model, _raises_inside(model, x)


def test_an_error_in_a_call_in_the_first_statement_s_return_points_at_the_user_line():
    """`return helper(...)` as the body's only statement (its call bound before state is
    flattened): the step's frame in the traceback is the user's line."""
    step = autoflat.step(_returns_a_call)
    with pytest.raises(TypeError) as info:
        step(jnp.zeros(2), jnp.ones(3))
    frames = traceback.extract_tb(info.value.__traceback__)
    line = _returns_a_call.__code__.co_firstlineno + 1
    assert any(f.filename == __file__ and f.lineno == line for f in frames), frames
    assert not any(f.filename.startswith("<autoflat:") for f in frames), frames


def _user_frames(exc, name):
    """The frames of a traceback that run `name` in this file, innermost last."""
    frames, tb = [], exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_filename == __file__ and code.co_name == name:
            frames.append(tb.tb_frame)
        tb = tb.tb_next
    return frames


def boom_inside(model, x):
    offset = jnp.ones(2)

    def project(v):
        scaled = v * 2
        return jnp.dot(scaled, jnp.ones((3, 3)))  # shape error for a length-2 vector

    y = model + x + offset
    z = project(y)
    return model, z


@pytest.mark.parametrize("k", [1, 4])
def test_the_users_frame_in_a_traceback_has_the_bodys_locals(k):
    """Post-mortem debugging (`pdb.pm()`, IDE debuggers, pytest's --showlocals): the entry
    at the user's line is a frame of the user's function with its locals, as under
    `jax.jit`, and the user's globals; it held only autoflat's marker. A function the body
    defines keeps its own frame's locals."""
    xs = jnp.ones((k, 2)) if k > 1 else jnp.ones(2)
    with pytest.raises(TypeError) as ours:
        autoflat.step(boom, num_steps=k)(jnp.zeros(2), xs)
    with pytest.raises(TypeError) as jit:
        jax.jit(boom)(jnp.zeros(2), jnp.ones(2))
    (frame,) = _user_frames(ours.value, "boom")
    (jit_frame,) = _user_frames(jit.value, "boom")
    assert sorted(frame.f_locals) == sorted(jit_frame.f_locals) == ["model", "x", "y"]
    assert frame.f_locals["y"].shape == (2,)
    assert frame.f_globals is boom.__globals__

    with pytest.raises(TypeError) as ours:
        autoflat.step(boom_inside, num_steps=k)(jnp.zeros(2), xs)
    with pytest.raises(TypeError) as jit:
        jax.jit(boom_inside)(jnp.zeros(2), jnp.ones(2))
    for name in ("boom_inside", "project"):
        (frame,) = _user_frames(ours.value, name)
        (jit_frame,) = _user_frames(jit.value, name)
        assert sorted(frame.f_locals) == sorted(jit_frame.f_locals), name
    assert {"offset", "project", "y"} <= set(_user_frames(ours.value, "boom_inside")[0].f_locals)


def test_calling_conventions():
    def update(model, batch, scale=jnp.float32(1.0), *, shift=jnp.float32(0.0)):
        """A docstring."""
        model = model + batch * scale + shift
        return model, batch

    step = autoflat.step(update, donate=False)
    m = jnp.float32(1.0)
    a, _ = step(m, jnp.float32(1.0))
    b, _ = step(model=m, batch=jnp.float32(1.0), shift=jnp.float32(1.0))
    c, _ = step(m, jnp.float32(1.0), jnp.float32(2.0), shift=jnp.float32(1.0))
    assert (float(a), float(b), float(c)) == (2.0, 3.0, 4.0)
    assert step.__doc__ == "A docstring."
    assert step.__name__ == "update"
    with pytest.raises(
        autoflat.AutoflatError, match=r"missing a required argument: 'batch'"
    ) as info:
        step(m)
    assert "update(model, batch" in str(info.value)
    with pytest.raises(autoflat.AutoflatError, match="unexpected keyword"):
        step(m, jnp.float32(1.0), nope=1)


def test_jit_wrapped_functions_and_wrappers_above_the_step():
    def deco(f):
        @functools.wraps(f)
        def wrapper(*a, **k):
            out = f(*a, **k)
            return out[0], out[1] * 10  # the wrapper's work runs: it is above the step

        return wrapper

    @autoflat.step(num_steps=2)
    @jax.jit
    def jitted(model, x):
        model = model + x
        return model, x * 2

    @deco
    @autoflat.step(num_steps=2)
    def wrapped(model, x):
        model = model + x
        return model, x * 2

    m, xs = jitted(jnp.float32(0.0), jnp.array([1.0, 2.0], jnp.float32))
    assert float(m) == 3.0 and xs.tolist() == [2.0, 4.0]
    m, xs = wrapped(jnp.float32(0.0), jnp.array([1.0, 2.0], jnp.float32))
    assert float(m) == 3.0 and xs.tolist() == [20.0, 40.0]


def test_method_decoration():
    class Trainer:
        def __init__(self, lr):
            self.lr = lr

        @autoflat.step(num_steps=2)
        def train(self, model, x):
            model = model + self.lr * x
            return model

    m = Trainer(0.5).train(jnp.float32(0.0), jnp.ones(2, jnp.float32))
    assert float(m) == 1.0
    assert "# self: broadcast (the method's instance; a new value of self.lr recompiles)" in (
        autoflat.show(Trainer.train)
    )


def test_generated_lines_come_back_after_linecache_clearcache():
    """`linecache.clearcache()` drops the generated lines; an error raised through the step
    registers them again before its traceback is shown, so every entry in the generated file
    still shows its line."""
    step = autoflat.step(boom, num_steps=4)
    with pytest.raises(TypeError):
        step(jnp.zeros(2), jnp.ones((4, 2)))  # the program this call runs (roles inferred)
    filename = step.programs[-1].filename
    linecache.clearcache()
    assert linecache.getlines(filename) == []
    with pytest.raises(TypeError) as info:
        step(jnp.zeros(2), jnp.ones((2, 2)))
    assert "".join(linecache.getlines(filename)) == autoflat.show(step)
    generated = [
        f for f in traceback.extract_tb(info.value.__traceback__) if f.filename == filename
    ]
    assert generated and all(f.line for f in generated), generated


def test_generated_lines_are_never_read_through_the_users_module():
    """The generated code runs with the user's globals, whose `__loader__` is the user's
    module's: the file name is one `linecache` never asks a loader about, so a lookup with
    those globals after `linecache.clearcache()` finds nothing rather than the user's lines."""
    step = autoflat.step(scaled)
    filename = step.programs[0].filename
    linecache.clearcache()
    assert linecache.getlines(filename, scaled.__globals__) == []
    assert filename not in linecache.cache


def test_two_steps_from_one_function_keep_their_own_lines():
    import gc

    one = autoflat.step(scaled)
    two = autoflat.step(scaled, num_steps=2)
    a, b = one.programs[0].filename, two.programs[0].filename
    assert a != b
    assert "".join(linecache.getlines(a)) == autoflat.show(one)
    assert "".join(linecache.getlines(b)) == autoflat.show(two)
    autoflat.clear_caches()  # the programs are alive: their lines stay
    assert "".join(linecache.getlines(a)) == autoflat.show(one)
    del one
    gc.collect()
    assert linecache.getlines(a) == []  # freed with the step
    assert "".join(linecache.getlines(b)) == autoflat.show(two)
