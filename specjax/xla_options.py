"""The XLA compile options of specjax's programs, and `program`: the `jax.jit` that applies them.

Every jitted program of the decoding loop (`specjax.loop`, `specjax.refill`) and of the cost
profilers (`specjax.auto_costs`, `specjax.measure.profile`: the costs they measure are those of
the programs that run) is a `Program`. On the CPU backend it is compiled with
`CPU_OPTIONS`:

- `xla_cpu_enable_concurrency_optimized_scheduler=False`: XLA CPU's default HLO schedule
  (jaxlib 0.10.2) orders a program for concurrency; in a step nested one `while_loop` deeper
  than a static step (`num_draft="auto"` keeps a picked shape stepping in its own loop) it left the pool threads idle between kernels: auto forced onto a chain of
  4 ran 5-8 % slower a step than the static chain at B = 1 (median forced / static of 3
  processes 1.057). With the option off: 0.971, static steps no slower, compile times the
  same (`benchmarks/auto_overhead.py`; docs/measure_and_tune.md quotes the runs).
- `xla_cpu_scheduler_type=CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED`: with the first option alone,
  auto forced onto a chain of 1 at B = 8 (the shape it picks there) still ran 10-20 % slower
  a step than static D = 1; with this one too, 0.97-1.05, static steps no slower.
- `xla_cpu_use_fusion_emitters=False`: XLA CPU's default compiles every fusion of a program as
  its own small module (`FusionCompiler::Compile`, ~10 ms each even for a scalar add, 44 in the
  AR decode program, 137 in n-gram auto's at B = 1); with the option off XLA emits them into the
  program's one LLVM module instead. Compile times fell 14-40 % (AR 1.34 -> 0.94 s, n-gram
  chain of 4 2.24 -> 1.50 s, n-gram auto 3.42 -> 2.50 s at B = 1 and 6.86 -> 4.92 s at B = 8)
  and the tokens/s stayed the same: the weight-heavy work runs in specjax's C++ kernels, not
  in XLA's fusions (`benchmarks/compile_time.py`, docs/measure_and_tune.md).

Other backends get no options (these are XLA CPU's). The backend is read at a program's first
call, not at import: `jax.distributed.initialize` must come before any use of a backend. A
setting the user made in `XLA_FLAGS` is kept (an option named there is not overridden). An
option this jaxlib's XLA does not have (XLA's options come and go between releases) is left
out with a warning, once a process (`supported_options`), so no program fails for it.
"""
from __future__ import annotations

import functools
import os
import threading
import warnings
from collections.abc import Callable
from typing import Any

import jax

#: compile options of every Program on the CPU backend (see the module docstring)
CPU_OPTIONS: dict[str, Any] = {
    "xla_cpu_enable_concurrency_optimized_scheduler": False,
    "xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED",
    "xla_cpu_use_fusion_emitters": False,
}


def compile_options(backend: str, xla_flags: str = "") -> dict[str, Any]:
    """The options a Program compiles with on `backend` ("cpu", "gpu", "tpu"), less those the
    user set in `xla_flags` (the `XLA_FLAGS` string)."""
    if backend != "cpu":
        return {}
    named = {flag.split("=")[0].lstrip("-") for flag in xla_flags.split()}
    return {name: value for name, value in CPU_OPTIONS.items() if name not in named}


def current_options() -> dict[str, Any]:
    """`compile_options` of this process (the default backend and its `XLA_FLAGS`) that this
    jaxlib's XLA has (`supported_options`)."""
    options = compile_options(jax.default_backend(), os.environ.get("XLA_FLAGS", ""))
    return supported_options(tuple(sorted(options.items())))


@functools.cache
def supported_options(options: tuple[tuple[str, Any], ...]) -> dict[str, Any]:
    """The (name, value) `options` this XLA knows, as a dict: each is tried once on a trivial
    program; one XLA has no such option for is left out with a warning. Any other compile
    error (a value the option does not take) is raised: it names the option."""
    kept = {}
    for name, value in options:
        try:
            jax.jit(lambda x: x + 1, compiler_options={name: value}).lower(0).compile()
        except jax.errors.JaxRuntimeError as error:
            if "No such compile option" not in str(error):
                raise
            warnings.warn(f"XLA compile option {name} is not in this jaxlib "
                          f"({jax.lib.__version__}); specjax's programs compile without it",
                          stacklevel=3)
            continue
        kept[name] = value
    return kept


class Program:
    """`jax.jit(fn, **jit_kwargs)` compiled with `compile_options` of the default backend,
    decided at the first call (or `lower`); otherwise it behaves as the jitted function."""

    def __init__(self, fn: Callable, **jit_kwargs):
        functools.update_wrapper(self, fn)
        self._fn, self._jit_kwargs = fn, jit_kwargs
        self._jitted = None
        self._lock = threading.Lock()

    def jitted(self):
        """The `jax.jit` object with the options (made on the first use)."""
        if self._jitted is None:
            with self._lock:
                if self._jitted is None:
                    self._jitted = jax.jit(self._fn, compiler_options=current_options() or None,
                                           **self._jit_kwargs)
        return self._jitted

    @functools.cached_property
    def nested(self):
        """The plain `jax.jit`, for calls inside another trace (`jax.jit`, `eval_shape`, ...):
        JAX takes compile options on top-level programs only; an enclosing program compiles
        with its own."""
        return jax.jit(self._fn, **self._jit_kwargs)

    def __call__(self, *args, **kwargs):
        if any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves((args, kwargs))):
            return self.nested(*args, **kwargs)
        try:
            return self.jitted()(*args, **kwargs)
        except ValueError as error:  # staged inside another trace with no traced argument
            if "compiler_options" not in str(error):
                raise
            return self.nested(*args, **kwargs)

    def lower(self, *args, **kwargs):
        return self.jitted().lower(*args, **kwargs)

    def trace(self, *args, **kwargs):
        return self.jitted().trace(*args, **kwargs)

    def eval_shape(self, *args, **kwargs):
        return self.jitted().eval_shape(*args, **kwargs)

    def _cache_size(self) -> int:
        """Programs compiled so far (the jitted function's in-memory cache; 0 before the first
        use)."""
        return 0 if self._jitted is None else self._jitted._cache_size()


def program(fn: Callable | None = None, **jit_kwargs):
    """`jax.jit` with specjax's compile options: `program(fn, static_argnames=...)`, or as a
    decorator `@program(static_argnames=...)` / `@program`."""
    if fn is None:
        return functools.partial(program, **jit_kwargs)
    return Program(fn, **jit_kwargs)
