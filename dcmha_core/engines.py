"""What distributed engines need from a Keras model, for the engines that Keras's own
``fit`` does not drive (PyTorch).

``torch_module(model)`` wraps a built Keras model (Keras torch backend) as a plain
``torch.nn.Module`` whose parameters are the model's trainable weights and whose forward
is ``model.stateless_call``: what ``torch.distributed.fsdp.fully_shard`` (FSDP2) needs.
A Keras model is a ``torch.nn.Module`` itself, and ``DistributedDataParallel`` wraps it
directly; ``fully_shard`` on it shards the parameters but the Keras layers keep reading
their own variables, so nothing trains. Through the wrapper the layers read the
parameters FSDP gathers for each forward, and the gradients reach FSDP's shards.

Example (each of ``torchrun --nproc-per-node 2`` processes)::

    torch.distributed.init_process_group("gloo")
    module = dcmha.engines.torch_module(model)          # model built
    torch.distributed.fsdp.fully_shard(module)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    loss = loss_fn(y, module(x)); loss.backward(); optimizer.step()
    module.write_back()                                 # every process; then save model
"""

from __future__ import annotations

__all__ = ["torch_module"]

_CLASS = None


def _module_class():
    """The ``torch.nn.Module`` subclass, defined on first use (imports torch)."""
    global _CLASS
    if _CLASS is not None:
        return _CLASS
    import torch

    class KerasStatelessModule(torch.nn.Module):
        """A Keras model's trainable weights as parameters, its forward as
        ``stateless_call`` (see ``dcmha.engines``)."""

        def __init__(self, model):
            super().__init__()
            # Not a submodule: its variables must not be parameters of this module.
            object.__setattr__(self, "keras_model", model)
            self.weights_ = torch.nn.ParameterList(
                [torch.nn.Parameter(v.value.detach().clone()) for v in
                 model.trainable_variables])
            self._non_trainable = [v.value.detach() for v in model.non_trainable_variables]

        def forward(self, *args, training=True, **kwargs):
            """The model's outputs for ``args`` from the current parameters.

            The layers read a fresh view of each parameter: FSDP gathers the weights into
            the same tensors at every forward without bumping their version counters, so a
            cache keyed by a tensor's identity and version (the fused decoding projection
            of ``dcmha.backends.torch_native.decode``) would otherwise serve the weights of
            before an optimizer step."""
            whole = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in self.weights_]
            trainable = [w.view_as(w) for w in whole]
            out, non_trainable = self.keras_model.stateless_call(
                trainable, self._non_trainable, *args, training=training, **kwargs)
            self._non_trainable = [v.detach() for v in non_trainable]
            return out

        @torch.no_grad()
        def write_back(self):
            """Assign the parameters (whole: sharded ones are gathered, a collective that
            every process must call) and the non-trainable state to the Keras model."""
            for v, p in zip(self.keras_model.trainable_variables, self.weights_):
                v.assign(p.full_tensor() if hasattr(p, "full_tensor") else p)
            for v, value in zip(self.keras_model.non_trainable_variables, self._non_trainable):
                v.assign(value)

    _CLASS = KerasStatelessModule
    return _CLASS


def torch_module(model):
    """A ``torch.nn.Module`` for the built Keras ``model`` (Keras torch backend):
    parameters = copies of ``model.trainable_variables``; ``module(*args, training=True,
    **kwargs)`` = ``model.stateless_call`` with them; ``module.write_back()`` assigns them
    to the model's variables. Wrap it with ``fully_shard`` (FSDP2) or any engine that
    shards ``torch.nn.Module`` parameters."""
    import keras

    from dcmha import framework

    if not framework.TORCH_MODULES:
        raise ValueError("`torch_module` needs the Keras torch backend. Received: the "
                         f"active Keras backend is {keras.backend.backend()!r}")
    if not isinstance(model, keras.Model) or not model.built:
        raise ValueError("`model` must be a built keras.Model. Received: "
                         f"{type(model).__name__}"
                         + (" (not built)" if isinstance(model, keras.Model) else ""))
    return _module_class()(model)
