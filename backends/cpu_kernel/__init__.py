"""A compiled C kernel for the compose of one score block (CPU, float32), and its cache.

The CPU cores (``torch_native``, ``jax_cpu``, ``tf_cpu``) spend most of a call in the two
composes: done with framework ops they are a handful of arithmetic operations per score
entry spread over a dozen elementwise passes (and, for the query side, a batched 8x8 GEMM
per query). The kernel fuses a block's compose, and its backward, into one pass over the
block (``csrc/compose.c`` says how).

Modules
-------
* ``build``: the recipes, the compilers, building, loading and checking a library
  (``build_library``, ``check_library``, ``load``) and the in-process state (``_reset``);
* ``cache``: the trusted cache directory (ownership rules, records, atomic installs);
* ``calls``: ctypes' argument block ``_Args`` and the call wrappers (``compose_forward``,
  ``compose_backward``, ``decode_probs``, ``dynamic_weights``, ``dynamic_finish``).

This package re-exports their names. A test that replaces a name patches the submodule that
reads it (``build._OPT``, ``build._compiler_identity``, ``calls._Args``): those three are
deliberately not re-exported here, so patching them on this package raises AttributeError
instead of changing nothing.

Sources
-------
C and C++ files in ``csrc/`` beside this package (package data), each compilable on its own:
``dcmha_args.h`` (the argument block ``Args``, shared with ctypes' ``calls._Args``),
``compose.c`` (the kernel), ``compose_wrap.h`` (what the C++ wrappers share), ``xla_ffi.cc``
(XLA FFI handlers), ``tf_op.cc`` (TensorFlow ops) and ``ort_op.cc`` (onnxruntime custom ops).
Four libraries are built from them, each described by a ``Recipe``:

* ``compose_recipe()``, loaded by ``load()``: the kernel alone, called through ``ctypes`` by
  ``dcmha_torch`` (calls release the GIL, so its block threads run them in parallel);
* ``ffi_recipe(include_dir, jaxlib_version)``: the kernel with XLA FFI handlers, registered
  by ``jax_cpu`` as ``jax.ffi`` targets; each call splits its (b, g) slices over XLA's
  intra-op threads (``compose_wrap.h``'s ``dcmha_compose_split``);
* ``tf_recipe(compile_flags, link_flags, tf_version)``: the kernel as TensorFlow ops, loaded
  by ``tf_cpu`` with ``tf.load_op_library``; split over TensorFlow's CPU worker threads;
* ``ort_recipe(ort_version)``: the kernel as onnxruntime custom ops (``ort_op.cc``), which
  ``dcmha.export.ort_ops`` registers in onnxruntime sessions.

Building
--------
``build_library(recipe)`` compiles on first use with the system compilers: ``$CC`` (else
``cc``, ``gcc``, ``clang``) for the kernel (``-O3 -march=native -ffp-contract=fast``,
``build._OPT``), ``$CXX`` (else ``c++``, ``g++``, ``clang++``) for the wrappers. A ``$CC`` /
``$CXX`` with arguments (``"ccache gcc"``, ``"gcc -m32"``) is split like a shell command line
and used whole; one that names no program is refused with the reason (never replaced by
another compiler).
Libraries live in a cache directory verified before every load (``cache`` says where and
how). A loaded library must export the recipe's symbols, and its view of ``Args`` (size,
and each field's offset and size, as compiled by the C compiler and, in the wrappers, by the
C++ compiler) must equal ctypes'; otherwise it is refused with the reason.

Fallback
--------
Without a usable library (no compiler, a failed build, a refused library) the cores fall
back (torch: its PyTorch ops; jax and tensorflow: ``implementation="auto"`` takes the other
paths), ``unavailable_reason()`` says why, and one ``KernelWarning`` per process and reason
is emitted. ``DCMHA_CPU_KERNEL=0`` switches the kernels off silently. Kernel and fallback
agree within float32 rounding (the tests run both).

Tests reset every in-process state with ``_reset()`` (the loaded kernel, the warnings
given, the private directory, compiler identities, ``LIBRARIES``: the verified path of each
library obtained) after pointing ``DCMHA_CACHE_DIR`` at a fresh directory, and may set
``build._OPT = ("-O0",)`` to build the kernel in a second (``tests/kernel_cache_cases.py``).
"""

from .build import (CSRC, LIBRARIES, KernelWarning, Plan, Recipe, _C_LAYOUT, _CXX_LAYOUT,
                    _PRIVATE, _STATE, _layout_mismatch, _reset, build_library, check_library,
                    compose_recipe, disabled, fallback, ffi_recipe, load, ort_recipe, plan,
                    tf_recipe, unavailable_reason)
from .cache import _install, _lookup, _trusted_dir, cache_dir
from .calls import (CACHED_TERMS, DYNAMIC_ROWS, _FIELDS, block_causal_off, cached_flags,
                    causal_flags, compose_backward, compose_forward, decode_probs, decode_terms, dynamic_finish, dynamic_sizes,
                    dynamic_weights, key_row)

__all__ = ["load", "unavailable_reason", "compose_forward", "compose_backward",
           "decode_probs", "dynamic_weights", "dynamic_finish", "dynamic_sizes", "DYNAMIC_ROWS",
           "cached_flags", "causal_flags", "block_causal_off", "CACHED_TERMS", "disabled",
           "KernelWarning", "Recipe", "Plan", "compose_recipe", "ffi_recipe", "tf_recipe",
           "ort_recipe", "plan", "build_library", "check_library", "fallback", "cache_dir",
           "CSRC"]
