"""The block loop of ``dcmha_torch``: which keys each block of queries sees, the
per-thread workspace buffers, the score GEMM, and the threads that run the blocks.

A block holds ``block_q`` queries and the key columns [s0, s1) a causal mask or sliding
window leaves visible to them (``_blocks``); what else it must mask is a bias added to its
scores (``_visibility``). Its temporaries live in per-thread buffers reused across blocks
and calls (``_Workspace``: fresh ones cost a page fault per 4 KiB), and the blocks run on
``torch.get_num_threads()`` threads with single-threaded ops (``_run_blocks``) rather than
every op being split across threads.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import math
import os
import threading

import torch

from dcmha.spec import terms as spec_terms

from .. import torch_common

# The masked-score fill: exp() of it is exactly 0, and no inf - inf appears.
_NEG = spec_terms.MASKED_SCORE
# Most threads the block loop uses (see ``_run_blocks``).
_MAX_WORKERS = int(os.environ.get("DCMHA_TORCH_WORKERS", "64"))


@dataclasses.dataclass(frozen=True)
class _Problem(torch_common.Problem):
    """Sizes and switches of one call (everything besides the arrays), and the block size."""

    block_q: int


def _visibility(pb: _Problem, mask, t0, t1, s0, s1, device):
    """What a block must mask: (fills, empty).

    fills: [(a, bias)] with bias (B|1, t, 1, n) float32, -1e30 where key a + j
    is hidden from the query and 0 elsewhere (added to the scores: faster than
    a masked fill); empty: None, or (B|1, t) bool, True for the queries that
    see no key at all.
    """
    off = pb.offset
    if mask is None and pb.window is None:
        if not pb.causal:
            return [], None
        a = max(s0, t0 + off + 1)        # keys before a are visible to every query here
        if a >= s1:
            return [], None
        t = torch.arange(t0 + off, t1 + off, device=device)[:, None]
        s = torch.arange(a, s1, device=device)[None, :]
        # s0 == 0 here and query t sees key 0 (offset >= 0): no empty row.
        return [(a, _bias(s > t)[None, :, None, :])], None
    t = torch.arange(t0 + off, t1 + off, device=device)[:, None]
    s = torch.arange(s0, s1, device=device)[None, :]
    vis = spec_terms.visible(t, s, causal=pb.causal, window=pb.window)
    vis = None if vis is True else vis[:, None, :]                    # (t, 1, s)
    if mask is not None:
        m = mask
        if m.shape[1] != 1:
            m = m[:, t0:t1]
        if m.shape[2] != 1:
            m = m[:, :, s0:s1]
        m = m.transpose(0, 1)                                         # (t|1, B|1, s|1)
        vis = m if vis is None else vis & m
    vis = vis.expand(t1 - t0, vis.shape[1], s1 - s0)
    if bool(vis.all()):
        return [], None
    seen = vis.any(-1)
    empty = None if bool(seen.all()) else ~seen.transpose(0, 1)
    return [(s0, _bias(~vis).transpose(0, 1)[:, :, None, :])], empty


def _bias(hidden):
    """-1e30 where ``hidden``, else 0 (float32)."""
    return torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device).masked_fill_(
        hidden, _NEG)


def _blocks(pb: _Problem, mask, device):
    """(t0, t1, s0, s1, fills, empty) per query block; s1 <= s0 when it sees no key."""
    for t0 in range(0, pb.T, pb.block_q):
        t1 = min(pb.T, t0 + pb.block_q)
        s0, s1 = spec_terms.key_range(t0, t1, pb.S, causal=pb.causal, window=pb.window,
                                      offset=pb.offset)
        if s1 <= s0 or pb.B == 0:
            yield t0, t1, s0, s0, None, None          # nothing to compute
            continue
        fills, empty = _visibility(pb, mask, t0, t1, s0, s1, device)
        yield t0, t1, s0, s1, fills, empty


class _Workspace:
    """Reusable float32 buffers for the block loop, kept per thread and device.

    Every block needs the same few temporaries; allocating them afresh costs a
    page fault per 4 KiB on CPU (tens of thousands per call) and cold caches.
    ``take`` returns a contiguous view of a cached flat buffer (grown on
    demand); a name is reused only once its previous view is dead.

    The buffers are normal tensors whatever the grad mode of the call that
    allocates them: one allocated under ``torch.inference_mode`` would be an
    inference tensor, which a later call outside inference mode (on whichever
    thread runs its blocks) could not update in place.
    """

    _local = threading.local()
    # float32 elements kept per thread (64 MiB; the default 4 MiB blocks need
    # about 40 MiB); beyond that, buffers are allocated per use.
    _MAX_CACHED = 16 * 2 ** 20

    def __init__(self, device):
        self.device = device
        cache = getattr(self._local, "cache", None)
        if cache is None:
            cache = self._local.cache = {}
        self.cache = cache

    def take(self, name, *shape):
        n = math.prod(shape)
        key = (self.device, name)
        buf = self.cache.get(key)
        if buf is None or buf.numel() < n:
            old = 0 if buf is None else buf.numel()
            with torch.inference_mode(False):     # a normal tensor (see the class doc)
                buf = torch.empty(max(n, 1), dtype=torch.float32, device=self.device)
            kept = sum(b.numel() for b in self.cache.values()) - old
            if kept + n <= self._MAX_CACHED:
                self.cache[key] = buf
            elif old:
                del self.cache[key]
        return buf[:n].view(shape)

    def free(self, held, *names):
        """The first of ``names`` whose buffer does not hold the tensor ``held``."""
        ptr = held.untyped_storage().data_ptr()
        for name in names:
            buf = self.cache.get((self.device, name))
            if buf is None or buf.untyped_storage().data_ptr() != ptr:
                return name
        raise AssertionError("no free workspace buffer")   # pragma: no cover


def _rows(x):
    """The storage of a block view x (B, t, N, s): ("rm", x) or ("hm", (B, N, t, s) view)."""
    if x.is_contiguous():
        return "rm", x
    xt = x.transpose(1, 2)
    if xt.is_contiguous():
        return "hm", xt
    return "rm", x.contiguous()      # pragma: no cover - every block view is one of the two


def _per_head(x):
    """[(b, (N, t, s) matrices of batch b of the block view x)], one GEMM call each."""
    return [(b, x[b].transpose(0, 1)) for b in range(x.shape[0])]


def _heads(y, b, l0, l1):
    """Rows l0:l1 of batch b of a (B, L, N, e) tensor as (N, l, e) strided matrices."""
    return y[b, l0:l1].transpose(0, 1)


#: Largest block (t * s) whose per-head products run as one batched GEMM over all (B, N)
#: matrices, from head-major copies of the block's rows of q, k, v: one strided GEMM call
#: per batch element costs more than its arithmetic there (2 x 64 with T = 64, B 16:
#: PyTorch splits each strided call into one small GEMM per head, 1,000 a step).
BATCHED_MAX_BLOCK = 64 * 64


def _batched(t, s):
    """Whether a t x s block takes the batched GEMMs (``BATCHED_MAX_BLOCK``)."""
    return t * s <= BATCHED_MAX_BLOCK


def _bn_rows(y, l0, l1):
    """Rows l0:l1 of a (B, L, N, e) tensor as contiguous (B N, l, e) matrices (a copy)."""
    B, _, N, e = y.shape
    return y[:, l0:l1].transpose(1, 2).reshape(B * N, l1 - l0, e)


def _bn(x):
    """A block view x (B, t, N, s) as (B N, t, s) matrices (a view when head-major)."""
    B, t, N, s = x.shape
    return x.transpose(1, 2).reshape(B * N, t, s)


def _put_rows(y, l0, l1, m, *, accumulate=False):
    """y[:, l0:l1] (B, l, N, e) = m, or += m, for m (B N, l, e) from ``_bn`` products."""
    B, _, N, e = y.shape
    src = m.view(B, N, l1 - l0, e).transpose(1, 2)
    if accumulate:
        y[:, l0:l1] += src
    else:
        y[:, l0:l1] = src


def _scores(q3, k3, scale, ws, name, t0, t1, s0, s1, rows=None):
    """scale * q k^T of a block as a (B, t, N, s) view of a head-major (B, N, t, s) buffer.

    ``rows``: the block's ``_bn_rows`` of q and k where the caller has them already (a
    batched block's backward uses them again)."""
    B, N = q3.shape[0], q3.shape[2]
    t, s = t1 - t0, s1 - s0
    x = ws.take(name, B, N, t, s)
    if _batched(t, s):
        q_bn, k_bn = rows or (_bn_rows(q3, t0, t1), _bn_rows(k3, s0, s1))
        x.view(B * N, t, s).baddbmm_(q_bn, k_bn.transpose(1, 2), beta=0, alpha=scale)
        return x.transpose(1, 2)
    for b in range(B):
        x[b].baddbmm_(_heads(q3, b, t0, t1), _heads(k3, b, s0, s1).transpose(1, 2),
                      beta=0, alpha=scale)
    return x.transpose(1, 2)


_POOL = None               # (pid, ThreadPoolExecutor): a forked child makes its own
_POOL_LOCK = threading.Lock()


def _workers(device, n_blocks):
    """How many threads run the blocks (see ``_run_blocks``): 1 off CPU."""
    if n_blocks <= 1 or device.type != "cpu":
        return 1
    return max(1, min(torch.get_num_threads(), n_blocks, _MAX_WORKERS))


def _pool(size):
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL[0] != os.getpid() or _POOL[1]._max_workers < size:
            _POOL = (os.getpid(), concurrent.futures.ThreadPoolExecutor(
                size, thread_name_prefix="dcmha-torch"))
        return _POOL[1]


def _run_blocks(blocks, work, workers):
    """Run ``work(block, slot)`` for every block on ``workers`` threads.

    Block-level parallelism instead of intra-op parallelism: each thread runs
    single-threaded ops and takes the next block from a shared queue (largest
    first). An intra-op parallel op waits for its slowest thread at each of
    the hundreds of mostly memory-bound ops of a call. Measured on the shared
    2-core development machine (one DCMHA layer, B=2, T=1024, D=512, N=8):
    training step 1.7x and forward 1.8x faster than intra-op threads while the
    machine was otherwise quiet; about the same (forward 1.17x) while other
    jobs kept both cores busy.
    ``slot`` (0 .. workers-1) names the thread, for per-thread accumulators.
    The calling thread is one of the workers; the caller's intra-op thread
    count is restored afterwards (other threads of the process see 1 while the
    blocks run).
    """
    if workers <= 1:
        for blk in blocks:
            work(blk, 0)
        return
    pool = _pool(workers - 1)
    queue = collections.deque(sorted(blocks, key=lambda b: -(b[1] - b[0]) * (b[3] - b[2])))
    previous = torch.get_num_threads()
    inference = torch.is_inference_mode_enabled()   # grad and inference modes are per thread
    failed = []

    def run(slot):
        torch.set_num_threads(1)
        with torch.inference_mode() if inference else torch.no_grad():
            while not failed:
                try:
                    blk = queue.popleft()
                except IndexError:
                    return
                try:
                    work(blk, slot)
                except BaseException:
                    failed.append(True)     # the others stop at their next block
                    raise

    futures = [pool.submit(run, slot) for slot in range(1, workers)]
    try:
        run(0)
    finally:
        concurrent.futures.wait(futures)
        torch.set_num_threads(previous)
    for f in futures:
        f.result()

