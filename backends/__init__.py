"""Fast paths of DCMHA attention, one package each, each beside its plain reference.

Each package registers itself with ``dcmha.registry`` through an ``IMPLEMENTATION``
object named by the entry-point group ``dcmha.implementations`` (pyproject.toml),
exactly as an out-of-tree package would. Importing a package imports no framework.
"""

from __future__ import annotations

import importlib
import importlib.util

#: What the blocked CPU-kernel paths ("jax_cpu", "tf_cpu") cannot do: the probabilities
#: are never materialised, the blocks are unrolled at trace time from static sizes and a
#: static query offset, and the kernel takes one mask for all heads and no dropout.
CPU_KERNEL_LACKS = frozenset({"attention_scores", "intermediates", "dropout", "head_masks",
                              "traced_offset", "symbolic_shapes"})


#: What the decoding-step paths ("jax_decode", "torch_decode", "tf_decode") cannot do: they
#: run one query (T = 1) without the spec's intermediates or dropout, on concrete shapes.
DECODE_LACKS = frozenset({"intermediates", "dropout", "symbolic_shapes"})


def decode_implementation(name: str, backend: str, module: str, *, devices, priority: int,
                          description: str, graph_only: bool = False):
    """The registration of a decoding-step path: ``module`` runs one-query calls of
    ``backend`` on ``devices``; ``"auto"`` takes it for one-query calls on CPU (traced
    into a graph, with ``graph_only``), and other calls go to the plain core ("ops")."""
    from dcmha.registry import Implementation

    return Implementation(
        name=name, backend=backend, module=module, devices=frozenset(devices),
        auto_devices=frozenset({"cpu"}), lacks=DECODE_LACKS, one_query_only=True,
        graph_only=graph_only, priority=priority, description=description)


def installed(module: str) -> bool:
    """Whether ``module`` can be imported (without importing it)."""
    return importlib.util.find_spec(module) is not None


def lazy_attributes(package: str, module: str, names):
    """A module ``__getattr__`` that loads ``names`` from ``package.module`` on first use
    (so importing the package does not import the framework the module needs)."""
    names = frozenset(names)

    def __getattr__(name):
        if name in names:
            return getattr(importlib.import_module(f"{package}.{module}"), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__


def cpu_kernel_package(package: str, name: str, backend: str, module: str, *, priority: int,
                       min_length_product: int, description: str):
    """(IMPLEMENTATION, is_available, __getattr__) of a blocked CPU-kernel package
    ("jax_cpu", "tf_cpu"): registered on ``backend``'s CPU with ``CPU_KERNEL_LACKS``, taken
    by ``"auto"`` from T * S >= ``min_length_product``; ``module`` (its kernel API) loads on
    first use."""
    from dcmha.registry import Implementation

    impl = Implementation(
        name=name, backend=backend, module=f"{package}.core",
        devices=frozenset({"cpu"}), auto_devices=frozenset({"cpu"}), lacks=CPU_KERNEL_LACKS,
        priority=priority, min_length_product=min_length_product, description=description)

    def is_available() -> bool:
        """True when the framework is installed (whether the kernel builds: ``load()`` of the
        kernel module)."""
        return installed(backend)

    return impl, is_available, lazy_attributes(
        package, module, ("dcmha_attention", "dcmha_attention_reference"))
