"""A toy out-of-tree DCMHA implementation: the smallest package that adds an attention path.

It registers the implementation "toy" through the entry-point group
``dcmha.implementations`` (see ``pyproject.toml``); ``dcmha_toy.core.attention`` runs the
call on dcmha's plain ``keras.ops`` core. Once installed, ``DCMHA(implementation="toy")``
runs it and ``python -m dcmha.conformance --backend impl-toy`` checks it against the
fixtures. This module imports no framework: the registry reads it to list implementations.
"""

from dcmha.registry import Implementation

IMPLEMENTATION = Implementation(
    name="toy", backend="numpy", module="dcmha_toy.core", devices=frozenset({"cpu"}),
    description="a toy out-of-tree path: dcmha's plain keras.ops core")
