"""Weight-only int8 matmul on XLA CPU: a C++ kernel behind the XLA FFI, and its jnp reference.

    w = pack(qvalue)                         # int8 [L, K, N] -> [L, N/16, K, 16]
    y = qmatmul(x, w, scale, layer)          # x f32 [..., K] -> [..., N]
    y = qmatmul_reference(x, w, scale, layer)

`y = x @ (w[layer] * scale[layer])`, the scale per output channel (`[L, 1, N]`) or per block of
K / G inputs (`[L, G, N]`). Why a kernel: XLA CPU dequantizes an int8 kernel to f32 in a fusion
of its own (int8 read, f32 written and read back: ~9 bytes a weight), and copies each layer's
slice out of the stacked `[L, ...]` params before the matmul reads it; decoding reads every
weight every step, so those bytes are the step (docs/quantization.md). The kernel reads the
int8 weights in place, once per 6 rows of x, from the whole stack at `layer` (no slice copy),
packed in column blocks of 16 so each block is one contiguous stream (`kernels/qmatmul_cpu.cc`).
Each output is one f32 sum over k in order, the same whatever the number of rows.

The source is compiled on first use with the machine's C++ compiler (`-O3 -march=native`,
the XLA FFI headers jaxlib ships) into `folder` (`$SPECJAX_CACHE/kernels`), keyed by a hash of
the source, the flags, the compiler and the CPU, and registered with XLA once per process.
`SPECJAX_CPU_KERNELS=0` switches it off; without a compiler, or when the build fails, the
callers keep XLA's path (`available()` says why).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import jax
import jax.numpy as jnp

#: columns per packed block
BLOCK = 16
#: the FFI target's name
TARGET = "specjax_qmatmul_int8"
SOURCE = Path(__file__).with_name("qmatmul_cpu.cc")
#: the environment variable that switches the kernel off ("0", "false", "no", "off")
ENV_SWITCH = "SPECJAX_CPU_KERNELS"
FLAGS = ("-O3", "-std=c++17", "-fPIC", "-shared", "-march=native", "-fno-math-errno")

_lock = threading.Lock()
_state: dict[str, str | None] = {}


# ---------------------------------------------------------------------------------------------
# Layout
# ---------------------------------------------------------------------------------------------


def packable(shape: tuple[int, ...]) -> bool:
    """Whether a kernel `[..., K, N]` packs: N a whole number of blocks."""
    return len(shape) >= 2 and shape[-1] % BLOCK == 0 and shape[-1] > 0 and shape[-2] > 0


def pack(values: jax.Array) -> jax.Array:
    """int kernel `[L, K, N]` -> int8 `[L, N/16, K, 16]` (column blocks, each row after row)."""
    layers, k, n = values.shape
    blocks = values.astype(jnp.int8).reshape(layers, k, n // BLOCK, BLOCK)
    return blocks.transpose(0, 2, 1, 3)


def unpack(packed: jax.Array) -> jax.Array:
    """`pack`'s inverse: `[L, N/16, K, 16]` -> `[L, K, N]`."""
    layers, nblocks, k, _ = packed.shape
    return packed.transpose(0, 2, 1, 3).reshape(layers, k, nblocks * BLOCK)


def dequantize(packed: jax.Array, scale: jax.Array) -> jax.Array:
    """f32 `[L, K, N]`: the unpacked values times their scale (`[L, G, N]`, G dividing K)."""
    values = unpack(packed).astype(jnp.float32)
    layers, k, n = values.shape
    groups = scale.shape[1]
    grouped = values.reshape(layers, groups, k // groups, n) * scale[:, :, None, :]
    return grouped.reshape(layers, k, n)


# ---------------------------------------------------------------------------------------------
# The product
# ---------------------------------------------------------------------------------------------


def qmatmul_reference(x: jax.Array, packed: jax.Array, scale: jax.Array,
                      layer: jax.Array | int) -> jax.Array:
    """x f32 `[..., K]` @ the dequantized kernel `layer` -> f32 `[..., N]` (jnp, f32 products)."""
    one = [jax.lax.dynamic_index_in_dim(a, layer, keepdims=True) for a in (packed, scale)]
    return jnp.matmul(x, dequantize(*one)[0], precision=jax.lax.Precision.HIGHEST)


def qmatmul(x: jax.Array, packed: jax.Array, scale: jax.Array, layer: jax.Array | int) -> jax.Array:
    """x f32 `[..., K]`, packed int8 `[L, N/16, K, 16]`, scale f32 `[L, G, N]`, layer int32 `[]`
    -> f32 `[..., N]` by the CPU kernel (call `available()` first: this one assumes it).
    Differentiable in x and scale (the backward pass is the reference's)."""
    layers, nblocks, k, _ = packed.shape
    if x.shape[-1] != k or scale.ndim != 3 or scale.shape[::2] != (layers, nblocks * BLOCK):
        raise ValueError(f"qmatmul: x {x.shape}, packed {packed.shape} and scale {scale.shape} "
                         "do not fit")
    return _qmatmul(x.astype(jnp.float32), packed, scale.astype(jnp.float32),
                    jnp.asarray(layer, jnp.int32))


@jax.custom_batching.custom_vmap
def _call(x, packed, scale, layer):
    out = jax.ShapeDtypeStruct((*x.shape[:-1], packed.shape[1] * BLOCK), jnp.float32)
    return jax.ffi.ffi_call(TARGET, out)(x, packed, scale, layer)


@_call.def_vmap
def _call_vmap(axis_size, in_batched, x, packed, scale, layer):
    """Rows batched alone are more rows of one call (the kernel reads any leading shape of x);
    a batched kernel, scale or layer maps the call over the batch."""
    if not any(in_batched[1:]):
        return _call(x, packed, scale, layer), in_batched[0]
    args = [a if batched else jnp.broadcast_to(a, (axis_size, *a.shape))
            for a, batched in zip((x, packed, scale, layer), in_batched)]
    return jax.lax.map(lambda one: _call(*one), tuple(args)), True


@jax.custom_vjp
def _qmatmul(x, packed, scale, layer):
    return _call(x, packed, scale, layer)


def _qmatmul_fwd(x, packed, scale, layer):
    return _qmatmul(x, packed, scale, layer), (x, packed, scale, layer)


def _qmatmul_bwd(residuals, grad):
    x, packed, scale, layer = residuals
    _, pullback = jax.vjp(lambda a, s: qmatmul_reference(a, packed, s, layer), x, scale)
    grad_x, grad_scale = pullback(grad)
    return grad_x, None, grad_scale, None


_qmatmul.defvjp(_qmatmul_fwd, _qmatmul_bwd)


# ---------------------------------------------------------------------------------------------
# Building and registering
# ---------------------------------------------------------------------------------------------


def switched_off(environ=os.environ) -> bool:
    return environ.get(ENV_SWITCH, "").strip().lower() in ("0", "false", "no", "off")


def compiler() -> str | None:
    """The C++ compiler: `$CXX`, else the first of c++ / g++ / clang++ on the PATH."""
    named = os.environ.get("CXX")
    if named:
        return shutil.which(named)
    return next((p for p in map(shutil.which, ("c++", "g++", "clang++")) if p), None)


def _cpu_identity() -> str:
    """What -march=native compiles for: the CPU's model and feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [line for line in text.splitlines() if line.startswith(("model name", "flags", "Features"))]
    return "\n".join(dict.fromkeys(keep))


def library_name(cxx: str) -> str:
    """The cached library's file name: a hash of source, flags, compiler, CPU and headers."""
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False).stdout
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(FLAGS).encode(), version.encode(),
                 _cpu_identity().encode(), jax.ffi.include_dir().encode()):
        digest.update(part)
        digest.update(b"\0")
    return f"qmatmul_cpu-{digest.hexdigest()[:16]}.so"


def build(folder: Path) -> Path:
    """The compiled library in `folder` (compiled now if not there yet; written atomically, so
    processes building at once each end with a whole file). RuntimeError naming the reason."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set $CXX, or install g++)")
    target = folder / library_name(cxx)
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(prefix=target.name, suffix=".tmp", dir=folder)
    os.close(fd)
    cmd = [cxx, *FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", temp]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        Path(temp).unlink(missing_ok=True)
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RuntimeError(f"compiling {SOURCE.name} failed: {last}")
    os.replace(temp, target)
    return target


def available(folder: Path) -> str | None:
    """None when the kernel is registered with XLA (built into `folder` if needed, once per
    process), else the reason it is not (switched off, no compiler, a failed build)."""
    with _lock:
        if "reason" not in _state:
            _state["reason"] = _register(folder)
        return _state["reason"]


def _register(folder: Path) -> str | None:
    if switched_off():
        return f"{ENV_SWITCH}=0"
    try:
        library = ctypes.cdll.LoadLibrary(str(build(folder)))
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(library.SpecjaxQMatmulInt8),
                                    platform="cpu")
    except (OSError, RuntimeError, AttributeError) as err:
        return str(err)
    return None
