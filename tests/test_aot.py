"""flux_jax.aot: programs compiled ahead of time, in the background, and the loop's compile watch."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flux_jax import aot


def _context():
    return jax.set_mesh(jax.make_mesh((1,), ("data",), devices=jax.devices()[:1]))


def test_watch_records_compiles_on_its_own_thread_only():
    f = jax.jit(lambda x: jnp.sin(x) * 3.0)
    with aot.CompileWatch() as watch:
        watch.where = "step 7"
        f(np.zeros(5, np.float32))  # a new shape: one compile, on this thread
        f(np.ones(5, np.float32))  # cached: none
        other = threading.Thread(target=lambda: f(np.zeros(6, np.float32)))
        other.start()
        other.join()
        with watch.expected():
            f(np.zeros(7, np.float32))
        with watch.during("validation"):
            f(np.zeros(9, np.float32))
    f(np.zeros(8, np.float32))  # after the watch: not seen
    seen = [(c.where, c.name) for c in watch.compiles]
    assert seen == [("step 7", "jit(<lambda>)"), ("validation", "jit(<lambda>)")]
    text = watch.summary()
    assert text.startswith("step 7: 1 compile(s), ") and "; validation: 1 compile(s)" in text


def test_background_compile_gives_the_program_and_compiles_nothing_more():
    spec = jax.ShapeDtypeStruct((4,), np.float32)
    pending = aot.BackgroundCompile("doubling", jax.jit(lambda x: 2 * x), (spec,), _context)
    compiled = pending.get()
    assert pending.done() and pending.seconds is not None
    with aot.CompileWatch() as watch:
        np.testing.assert_array_equal(compiled(np.arange(4, dtype=np.float32)), [0, 2, 4, 6])
    assert watch.compiles == []
    # A compiled program takes only the shapes it was compiled for: an error, never a recompile.
    with pytest.raises(TypeError):
        compiled(np.arange(5, dtype=np.float32))


def test_background_compile_error_reaches_the_caller():
    def bad(x):
        raise ValueError("no such field")

    pending = aot.BackgroundCompile("bad", jax.jit(bad), (jax.ShapeDtypeStruct((2,), np.float32),), _context)
    pending.wait()
    with pytest.raises(ValueError, match="no such field"):
        pending.raise_if_failed()
    with pytest.raises(ValueError, match="no such field"):
        pending.get()
