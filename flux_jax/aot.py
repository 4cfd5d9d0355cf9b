"""The train loop's programs compiled ahead of time, and a watch on the compiles the loop itself causes.

train_and_evaluate compiles the train step before its first step (``compile_now``) and starts the eval
step's compile in a background thread right after (``BackgroundCompile``): XLA releases the GIL while it
compiles, so that compile overlaps the first training steps instead of stalling the first validation
pass. Every process compiles the same programs from the same config, shapes and shardings. A compiled
program takes exactly the shapes, dtypes and shardings it was compiled for: a batch of another shape
is an error, never a silent recompile.

``CompileWatch`` records the XLA compiles started on the thread that runs the loop, so a compile
inside the loop (an eager ``jnp`` op, a batch of a new shape) shows in the log and in the run's result.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax import monitoring

from flux_jax import latents, setup, sharding, steps

log = logging.getLogger("flux_jax.train")

# What jax records once per XLA executable it builds (or loads from the persistent compilation cache).
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def abstract_like(tree: Any) -> Any:
    """Arrays -> ShapeDtypeStructs with their shardings: what a program is compiled for, holding no
    buffer (a donated or deleted array cannot be lowered later; its description can)."""

    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def compile_now(name: str, jitted, args: tuple, context: Callable[[], Any]) -> tuple[Any, float]:
    """``jitted`` lowered at ``args`` (arrays or ShapeDtypeStructs) and compiled inside ``context()``
    (the mesh and logical-axis rules the program is traced under): (the compiled program, seconds)."""
    t0 = time.perf_counter()
    with context():
        compiled = jitted.lower(*args).compile()
    seconds = time.perf_counter() - t0
    log.info("Compiled the %s in %.1f s.", name, seconds)
    return compiled, seconds


def compile_steps(
    run: setup.Run,
    state_shardings: dict,
    fp8_on: bool,
    train_spec: tuple,
    val_spec: dict | None,
    eval_rng_spec,
    context: Callable[[], Any],
) -> tuple[Any, BackgroundCompile | None]:
    """(the train step compiled now for ``train_spec`` = (state, batch), the eval step compiling in
    the background for ``val_spec``, its global batch; None when the run does not validate)."""
    config, mesh = run.config, run.mesh
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    batch_sh = sharding.batch_sharding(mesh)
    net = run.model_for(fp8_on)
    fp8_name = "FP8 " if fp8_on else ""
    train = jax.jit(
        steps.make_train_step(config, net, run.tx, run.num_micro, fp8_on),
        in_shardings=(state_shardings, batch_sh),
        out_shardings=(state_shardings, replicated),
        donate_argnums=0,
    )
    train, _ = compile_now(f"{fp8_name}train step", train, train_spec, context)
    if val_spec is None:
        return train, None
    params, fp8_meta = state_shardings["params"], state_shardings["fp8_meta"]
    evaluate = jax.jit(
        steps.make_eval_step(config, net, run.num_micro, fp8_on),
        in_shardings=(params, fp8_meta, batch_sh, replicated, replicated, (replicated, replicated)),
        out_shardings=replicated,
    )
    totals = (jax.ShapeDtypeStruct((latents.NUM_VAL_TIMESTEPS,), np.float32),) * 2
    index = jax.ShapeDtypeStruct((), np.int32)
    state = train_spec[0]
    eval_args = (state["params"], state["fp8_meta"], val_spec, eval_rng_spec, index, totals)
    return train, BackgroundCompile(f"{fp8_name}eval step", evaluate, eval_args, context)


class BackgroundCompile:
    """``compile_now`` in a thread of its own; ``get()`` waits for it and re-raises what it raised.

    The thread is not a daemon: a run that ends before the compile does waits for it at exit (XLA
    cannot be interrupted), so no compile is cut off while the interpreter shuts down.
    """

    def __init__(self, name: str, jitted, args: tuple, context: Callable[[], Any]):
        self.name = name
        self._result: Any = None
        self._error: BaseException | None = None
        self.seconds: float | None = None
        self._thread = threading.Thread(
            target=self._run, args=(jitted, args, context), name=f"compile {name}", daemon=False
        )
        self._thread.start()

    def _run(self, jitted, args, context) -> None:
        try:
            name = f"{self.name} (in the background)"
            self._result, self.seconds = compile_now(name, jitted, args, context)
        except BaseException as err:  # noqa: BLE001 (handed to the caller of get())
            self._error = err

    def done(self) -> bool:
        return not self._thread.is_alive()

    def raise_if_failed(self) -> None:
        """Raises the compile's error as soon as it has failed, without waiting for a running one."""
        if self.done() and self._error is not None:
            raise self._error

    def wait(self) -> None:
        """Waits for the compile to finish, whatever its outcome."""
        self._thread.join()

    def get(self) -> Any:
        """The compiled program, waiting for the compile to finish (logged when that takes a while)."""
        if not self.done():
            t0 = time.perf_counter()
            self._thread.join()
            log.info("Waited %.1f s for the %s's compile to finish.", time.perf_counter() - t0, self.name)
        if self._error is not None:
            raise self._error
        return self._result


@dataclasses.dataclass(frozen=True)
class Compile:
    """One XLA compile seen by a CompileWatch: the program's name, seconds, and where the caller was."""

    name: str
    seconds: float
    where: str


class CompileWatch:
    """Context manager: records each XLA compile started on the thread that entered it.

    ``where`` is what the caller sets to say where it is ("step 12"; ``during`` for a phase such as a
    checkpoint save); ``expected()`` wraps compiles the caller means to make (``compile_now`` logs
    them) so they are not recorded.
    """

    def __init__(self):
        self.compiles: list[Compile] = []
        self.where = "start-up"
        self._thread: int | None = None
        self._quiet = False

    def _listen(self, event: str, seconds: float, **kwargs) -> None:
        if event == _COMPILE_EVENT and threading.get_ident() == self._thread and not self._quiet:
            self.compiles.append(Compile(str(kwargs.get("fun_name", "?")), seconds, self.where))

    @contextlib.contextmanager
    def during(self, where: str):
        outer, self.where = self.where, where
        try:
            yield
        finally:
            self.where = outer

    @contextlib.contextmanager
    def expected(self):
        quiet, self._quiet = self._quiet, True
        try:
            yield
        finally:
            self._quiet = quiet

    def __enter__(self) -> CompileWatch:
        self._thread = threading.get_ident()
        monitoring.register_event_duration_secs_listener(self._listen)
        return self

    def __exit__(self, *exc) -> None:
        monitoring.unregister_event_duration_listener(self._listen)

    def summary(self) -> str:
        """The compiles seen, grouped by where they happened, e.g.
        "validation after step 100: 2 compiles, 1.3 s (jit(step), jit(add))"."""
        groups: dict[str, list[Compile]] = {}
        for c in self.compiles:
            groups.setdefault(c.where, []).append(c)
        return "; ".join(
            f"{where}: {len(cs)} compile(s), {sum(c.seconds for c in cs):.1f} s "
            f"({', '.join(sorted({c.name for c in cs}))})"
            for where, cs in groups.items()
        )
