"""What the two PyTorch kernels (``torch_native`` and ``triton``) share.

* ``check_call``: the call contract (``backends.kernel_call.describe``, i.e.
  ``dcmha.call.describe``) plus what only PyTorch knows: tensor types, dtypes,
  devices, one rank R for every dynamic projection.
* ``Problem``: the sizes and switches of a checked call, which each kernel
  extends with its tiling.
* ``attention_reference``: the plain PyTorch reference both kernels are tested
  against (materialises (B, N, T, S); differentiable by autograd).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Optional

import torch

from dcmha.spec import terms as spec_terms

from . import kernel_call

__all__ = ["FLOAT_DTYPES", "Problem", "check_call", "attention_reference", "compose_reference",
           "full_mask"]

#: The input dtypes of the torch-native kernel (Triton has no float64 dots).
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _names(dtypes) -> str:
    names = [str(d).replace("torch.", "") for d in dtypes]
    return ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0]


def check_call(q, k, v, *, dtypes=FLOAT_DTYPES, **arguments):
    """Check a kernel call (``kernel_call.describe`` with ``arguments``) and its tensors.

    q, k, v: torch tensors of one dtype among ``dtypes``, on one device; ``mask``:
    a bool tensor on that device; the compose terms: float tensors on that device,
    with one rank R across both stages (the kernels take one R). Returns the
    ``dcmha.call.AttentionCall``; raises ValueError / TypeError naming the argument.
    """
    call = kernel_call.describe(q, k, v, **arguments)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"`{name}` must be a torch.Tensor. Received: {type(x).__name__}")
        if x.dtype not in dtypes:
            raise TypeError(f"`{name}` must be {_names(dtypes)}. Received: {name}.dtype={x.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError("`q`, `k` and `v` must share one dtype. Received: "
                        f"{q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError("`q`, `k` and `v` must be on one device. Received: "
                         f"{q.device}, {k.device}, {v.device}")
    mask = call.attention_mask
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
            raise TypeError("`mask` must be None or a bool tensor (True = attend). Received: "
                            f"mask.dtype={getattr(mask, 'dtype', type(mask).__name__)}")
        if mask.device != q.device:
            raise ValueError(f"`mask` must be on q's device {q.device}. Received: {mask.device}")
    for stage, terms in call.stages.items():
        for name, x in terms.items():
            if not isinstance(x, torch.Tensor) or not x.is_floating_point():
                raise TypeError(f"`{stage}['{name}']` must be a float torch.Tensor. "
                                f"Received: {getattr(x, 'dtype', type(x).__name__)}")
            if x.device != q.device:
                raise ValueError(f"`{stage}['{name}']` must be on q's device {q.device}. "
                                 f"Received: {x.device}")
    if len(call.ranks) > 1:
        raise ValueError("Every dynamic projection (`pre` and `post`) must have one rank R. "
                         f"Received: ranks {list(call.ranks)}")
    return call


@dataclasses.dataclass(frozen=True)
class Problem:
    """Sizes and switches of one checked call (everything besides the arrays)."""

    B: int
    T: int
    S: int
    N: int
    N_kv: int
    G: int
    M: int
    R: int
    d: int
    d_v: int
    causal: bool
    window: Optional[int]
    offset: int
    scale: float

    @staticmethod
    def fields(call, scale) -> dict:
        """The fields of ``Problem`` for a checked call (``scale`` None: 1 / sqrt(d))."""
        return dict(B=call.B, T=call.T, S=call.S, N=call.N, N_kv=call.N_kv, G=call.G, M=call.M,
                    R=call.ranks[0] if call.ranks else 1, d=call.d, d_v=call.d_v,
                    causal=call.use_causal_mask, window=call.sliding_window,
                    offset=call.static_offset,
                    scale=float(1.0 / math.sqrt(call.d) if scale is None else scale))


# ---------------------------------------------------------------------------
# The plain reference (materialises (B, N, T, S); for tests and reading)
# ---------------------------------------------------------------------------

def compose_reference(a, num_groups, stage: Mapping):
    """Compose of a (B, N, T, S) float32 tensor, as spec/reference.py's ``compose``."""
    B, N, T, S = a.shape
    G = num_groups
    x = a.reshape(B, G, N // G, T, S)
    out = x
    f = {n: None if stage.get(n) is None else stage[n].to(torch.float32)
         for n in spec_terms.TERM_NAMES}
    if f["static"] is not None:
        out = out + torch.einsum("bgmts,gmn->bgnts", x, f["static"])
    if f["qw1"] is not None:
        hidden = torch.einsum("bgmts,btgrm->bgrts", x, f["qw1"])
        out = out + torch.einsum("bgrts,btgrn->bgnts", hidden, f["qw2"])
    if f["kw1"] is not None:
        hidden = torch.einsum("bgmts,bsgrm->bgrts", x, f["kw1"])
        out = out + torch.einsum("bgrts,bsgrn->bgnts", hidden, f["kw2"])
    if f["qdd"] is not None:
        out = out + x * f["qdd"].permute(0, 2, 3, 1)[..., :, None]
    if f["kdd"] is not None:
        out = out + x * f["kdd"].permute(0, 2, 3, 1)[..., None, :]
    return out.reshape(B, N, T, S)


def full_mask(B, T, S, *, mask=None, causal=False, sliding_window=None, query_offset=0,
              device=None):
    """The boolean (B, T, S) mask, True = attend (spec/reference.py's ``make_mask``)."""
    t = query_offset + torch.arange(T, device=device)[:, None]
    s = torch.arange(S, device=device)[None, :]
    out = torch.ones(B, T, S, dtype=torch.bool, device=device)
    if mask is not None:
        out = out & mask.to(device)
    rule = spec_terms.visible(t, s, causal=causal, window=sliding_window)
    return out if rule is True else out & rule


def attention_reference(q, k, v, *, num_groups, pre=None, post=None, mask=None, causal=False,
                        sliding_window=None, scale=None, query_offset=0,
                        return_attention_scores=False, dtypes=FLOAT_DTYPES):
    """The kernels' attention in plain PyTorch ops (float32), differentiable by autograd.

    The kernels' arguments (``dtypes``: the input dtypes allowed); returns o
    (B, T, N, d_v) in q's dtype, or (o, scores (B, N, T, S)) with
    ``return_attention_scores``. Fully masked rows give zeros.
    """
    call = check_call(q, k, v, dtypes=dtypes, num_groups=num_groups, pre=pre, post=post,
                      mask=mask, causal=causal, sliding_window=sliding_window,
                      query_offset=query_offset)
    pb = Problem(**Problem.fields(call, scale))
    rep = pb.N // pb.N_kv
    kh = k.to(torch.float32).repeat_interleave(rep, dim=2)
    vh = v.to(torch.float32).repeat_interleave(rep, dim=2)
    a = torch.einsum("btnh,bsnh->bnts", q.to(torch.float32), kh) * pb.scale
    if pre is not None:
        a = compose_reference(a, num_groups, pre)
    allowed = full_mask(pb.B, pb.T, pb.S, mask=mask, causal=causal,
                        sliding_window=sliding_window, query_offset=pb.offset,
                        device=q.device)[:, None]
    if pb.S == 0:
        amax = a.new_zeros(a.shape[:-1] + (1,))
    else:
        amax = torch.where(allowed, a, -math.inf).amax(-1, keepdim=True)
        amax = torch.where(torch.isfinite(amax), amax, torch.zeros_like(amax)).detach()
    e = torch.where(allowed, torch.exp(torch.where(allowed, a, amax) - amax), 0.0)
    denom = e.sum(-1, keepdim=True)
    p = e / torch.where(denom == 0.0, torch.ones_like(denom), denom)
    if post is not None:
        p = compose_reference(p, num_groups, post)
    p = torch.where(allowed, p, 0.0)
    o = torch.einsum("bnts,bsnh->btnh", p, vh).to(q.dtype)
    return (o, p.to(q.dtype)) if return_attention_scores else o
