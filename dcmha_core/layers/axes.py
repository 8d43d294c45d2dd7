"""``attention_axes``: how inputs of any rank reach DCMHA's (B, L, D) attention core."""

from __future__ import annotations

import numpy as np

from keras import ops

from dcmha.call import shape_of as _shape
from dcmha.layers._checks import _check_fits, _product, _same_sizes


class _AxesLayout:
    """How inputs reach the (B, L, D) attention core when ``attention_axes`` asks for it.

    The axes of the inputs outside ``attention_axes`` (but the batch axis)
    join the batch axis (B' = B x their sizes) and the attention axes are
    flattened into one length, in the order given, so attention over them is
    attention over their flattened product, as in MultiHeadAttention. Outputs
    and scores are unflattened the same way; scores take MultiHeadAttention's
    layout (B, <other axes>, N, <query attention axes>, <key attention axes>).
    Rank-3 inputs attending over axis 1 pass unchanged (``identity``).
    """

    def __init__(self, rank, batch_axes, axes):
        self.rank, self.batch_axes, self.axes = rank, batch_axes, axes
        self.identity = rank == 3
        self.perm = (0,) + batch_axes + axes

    @classmethod
    def create(cls, rank, attention_axes):
        axes = (tuple(range(1, rank - 1)) if attention_axes is None
                else tuple(a + rank if a < 0 else a for a in attention_axes))
        if len(set(axes)) != len(axes) or any(not 1 <= a <= rank - 2 for a in axes):
            raise ValueError("`attention_axes` must name distinct axes of the inputs other than "
                             f"the batch axis and the last axis: for inputs of rank {rank}, "
                             f"axes in [1, {rank - 2}] or [{1 - rank}, -2]. "
                             f"Received: attention_axes={attention_axes!r}")
        return cls(rank, tuple(a for a in range(1, rank - 1) if a not in axes), axes)

    def check_batch_axes(self, query_shape, value_shape):
        if not _same_sizes([query_shape[a] for a in self.batch_axes],
                           [value_shape[a] for a in self.batch_axes]):
            raise ValueError("`query` and `value` must have the same sizes on the axes outside "
                             f"`attention_axes` {self.axes}. Received: query.shape="
                             f"{tuple(query_shape)}, value.shape={tuple(value_shape)}")

    def split(self, shape):
        """(B and the other axes' sizes, the attention axes' sizes) of an input's shape."""
        return ([shape[0]] + [shape[a] for a in self.batch_axes], [shape[a] for a in self.axes])

    def flatten(self, x, features=True):
        """(B, ..., [D]) -> (B', L, [D]); ``features=False`` for a (B, ...) Keras mask."""
        if self.identity:
            return x
        x = ops.transpose(x, self.perm + ((self.rank - 1,) if features else ()))
        shape = ops.shape(x)
        n = len(self.perm)
        return ops.reshape(x, (-1, _product(shape[n - len(self.axes):n])) + tuple(shape[n:]))

    def unflatten_output(self, y, query):
        """(B', T, *out) -> (B, <query axes but the last>, *out)."""
        if self.identity:
            return y
        batch, attn = self.split(ops.shape(query))
        out = tuple(y.shape[2:])
        y = ops.reshape(y, tuple(batch) + tuple(attn) + out)
        back = tuple(int(i) for i in np.argsort(self.perm))
        return ops.transpose(y, back + tuple(range(self.rank - 1, self.rank - 1 + len(out))))

    def scores_shape(self, query_shape, key_shape, num_heads):
        batch, q_attn = self.split(query_shape)
        return tuple(batch) + (num_heads,) + tuple(q_attn) + tuple(self.split(key_shape)[1])

    def unflatten_scores(self, scores, query, key):
        """(B', N, T, S) -> MultiHeadAttention's scores layout."""
        if self.identity:
            return scores
        return ops.reshape(scores, self.scores_shape(ops.shape(query), ops.shape(key),
                                                     scores.shape[1]))

    def flatten_mask(self, mask, query, key, num_heads):
        """An attention mask in the scores layout (smaller ranks expanded at the head
        axis, as MultiHeadAttention does) -> (B', 1 or N, T, S)."""
        target = self.scores_shape(_shape(query), _shape(key), num_heads)
        head = -2 * len(self.axes) - 1
        m = mask
        while len(m.shape) < len(target):
            m = ops.expand_dims(m, head)
        heads = 1 if m.shape[head] == 1 else num_heads
        target_h = target[:head] + (heads,) + target[head + 1:]
        _check_fits(_shape(m), target_h if heads == 1 else target,
                    "`attention_mask` must broadcast to the attention scores' shape "
                    f"(B, <other axes>, N, <query attention axes>, <key attention axes>) = "
                    f"{target}. Received: attention_mask.shape={tuple(mask.shape)}")
        dyn = self.scores_shape(ops.shape(query), ops.shape(key), heads)
        m = ops.broadcast_to(m, dyn)
        n = len(self.axes)
        return ops.reshape(m, (-1, heads, _product(dyn[-2 * n:-n]), _product(dyn[-n:])))
