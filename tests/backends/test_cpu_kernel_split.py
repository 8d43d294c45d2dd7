"""How the C kernel cuts a call's work: its (b, g) slices (``csrc/compose.c``:
``dcmha_compose_slices``, ``dcmha_compose_chunks``), which the XLA FFI handlers and the
TensorFlow ops split a call over their thread pools by (``compose_wrap.h``'s
``dcmha_compose_split``), and a causal block's masked keys, which it skips.

Every partition of a call's B G slices, run part by part, must give the whole call's forward
and backward bit for bit: each slice writes only its own rows (the term gradients are per
batch row and group), in the whole call's order. NumPy arrays through ctypes, no Keras; the
framework paths split at the shapes of ``tests/backends/test_cpu_paths.py``'s
``test_split_call_matches_ops``.
"""

import ctypes

import numpy as np
import pytest

from dcmha.backends import cpu_kernel

pytestmark = pytest.mark.backend_independent

#: DCMHA_HAS_WQ | DCMHA_HAS_KW | DCMHA_HAS_KDD (csrc/dcmha_args.h)
ALL_TERMS = 7


@pytest.fixture(scope="module")
def lib():
    lib = cpu_kernel.load()
    if lib is None:
        pytest.skip(f"kernel: {cpu_kernel.unavailable_reason()}")
    ptr, i64 = ctypes.POINTER(cpu_kernel.calls._Args), ctypes.c_int64
    lib.dcmha_compose_slices.argtypes = [ptr, ctypes.c_int, i64, i64]
    lib.dcmha_compose_slices.restype = ctypes.c_int
    lib.dcmha_compose_chunks.argtypes = [ptr, i64]
    lib.dcmha_compose_chunks.restype = i64
    lib.dcmha_fill_args.argtypes = ([ptr, ctypes.POINTER(i64), i64] + [ctypes.c_void_p] * 5
                                    + [i64])
    lib.dcmha_fill_args.restype = None
    return lib


def _floats(a):
    return a.ctypes.data_as(ctypes.c_void_p)


class Call:
    """One compose call on contiguous arrays (compose_wrap.h's layouts): x, g (B, G, M, t,
    s), wq (B, t, G, M, M), kw1, kw2 (B, G, R, M, s), kdd (B, G, M, s), random; run(parts)
    runs it over the slice ranges ``parts`` and returns its results."""

    def __init__(self, lib, seed, B, G, M, t, s, R):
        rng = np.random.default_rng(seed)
        f32 = lambda *shape: rng.normal(size=shape).astype(np.float32)  # noqa: E731
        self.lib, self.dims, self.R = lib, (B, G, M, t, s), R
        self.x, self.g = f32(B, G, M, t, s), f32(B, G, M, t, s)
        self.terms = (f32(B, t, G, M, M), f32(B, G, R, M, s), f32(B, G, R, M, s),
                      f32(B, G, M, s))

    def args(self, flags=ALL_TERMS):
        a = cpu_kernel.calls._Args()
        self.lib.dcmha_fill_args(ctypes.byref(a), (ctypes.c_int64 * 5)(*self.dims), self.R,
                                 _floats(self.x), *map(_floats, self.terms), flags)
        return a

    def run(self, backward, parts=None, flags=ALL_TERMS):
        """out (forward), or (dx, dwq, dkw1, dkw2, dkdd), from the ranges ``parts`` in turn
        (None: the whole call, dcmha_compose_forward / backward)."""
        a = self.args(flags)
        out = np.full_like(self.x, np.nan)
        a.out = out.ctypes.data
        grads = [np.zeros_like(term) for term in self.terms]
        if backward:
            a.g = self.g.ctypes.data
            a.dwq, a.dkw1, a.dkw2, a.dkdd = (d.ctypes.data for d in grads)
        lib = self.lib
        if parts is None:
            whole = lib.dcmha_compose_backward if backward else lib.dcmha_compose_forward
            assert whole(ctypes.byref(a)) == 0
        for begin, end in parts or ():
            assert lib.dcmha_compose_slices(ctypes.byref(a), int(backward), begin, end) == 0
        return (out, *grads) if backward else (out,)


#: Partitions of B G = 15 slices (B = 3, G = 5): whole, batch rows with partial ones on
#: either side, one slice at a time, out of order, and ranges past the ends (clipped).
PARTITIONS = [
    [(0, 15)],
    [(0, 7), (7, 15)],
    [(0, 2), (2, 5), (5, 13), (13, 15)],
    [(i, i + 1) for i in range(15)],
    [(9, 15), (0, 4), (4, 9)],
    [(-4, 6), (6, 99)],
]


@pytest.mark.parametrize("M,R,s", [(2, 2, 37), (4, 1, 16), (3, 2, 21)])
@pytest.mark.parametrize("backward", [False, True])
def test_any_partition_of_the_slices_is_the_whole_call(lib, M, R, s, backward):
    """Vectorised (M in 2, 4) and generic (M = 3) kernels, with and without a key tail past
    the vector width; every term present."""
    call = Call(lib, 10 * M + s, B=3, G=5, M=M, t=4, s=s, R=R)
    want = call.run(backward)
    assert not any(np.isnan(w).any() for w in want)
    for parts in PARTITIONS:
        got = call.run(backward, parts)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w, err_msg=f"parts {parts}")


def test_chunk_counts(lib):
    def chunks(B, G, M, t, s, threads):
        a = cpu_kernel.calls._Args(B=B, G=G, M=M, t=t, s=s)
        return lib.dcmha_compose_chunks(ctypes.byref(a), threads)
    big = (3, 5, 2, 40, 40)                      # the split test's blocks: 48000 floats of x
    assert chunks(*big, 1) == 1                  # one thread: whole
    assert chunks(*big, 0) == 1                  # no pool
    assert chunks(*big, 2) == 2
    assert chunks(*big, 64) == 2                 # each chunk keeps its share of the floats
    assert chunks(3, 5, 8, 64, 64, 64) == 15     # at most one chunk per slice
    assert chunks(1, 1, 8, 64, 64, 4) == 1       # one slice
    assert chunks(2, 1, 2, 4, 16, 2) == 1        # too small to split


@pytest.mark.parametrize("M,s", [(8, 16), (8, 21), (3, 16)])
@pytest.mark.parametrize("causal_off", [-3, 0, 5, 40])
def test_a_causal_block_skips_its_masked_keys_exactly(lib, M, s, causal_off):
    """With ``cpu_kernel.causal_flags(off)`` (row i sees keys j <= i + off) the visible
    entries are the whole call's bit for bit; the masked ones are written (0 where the
    vectorised rows skip them); and the term gradients are the whole call's where, as in a
    DCMHA core, g is 0 at the masked keys (the compose before the softmax) or x is (after
    it). Vectorised (M = 8) and generic (M = 3) kernels, with and without a key tail."""
    t = 12
    call = Call(lib, 7 * M + s, B=2, G=2, M=M, t=t, s=s, R=2)
    vis = np.arange(s)[None, :] <= np.arange(t)[:, None] + causal_off        # (t, s)
    flags = ALL_TERMS | cpu_kernel.causal_flags(causal_off)
    full, = call.run(False)
    out, = call.run(False, flags=flags)
    assert not np.isnan(out).any()
    np.testing.assert_array_equal(np.where(vis, out, 0), np.where(vis, full, 0))
    assert np.all((out == 0) | (out == full))
    for zeroed in ("g", "x"):                       # before the softmax, after it
        call = Call(lib, 7 * M + s, B=2, G=2, M=M, t=t, s=s, R=2)
        setattr(call, zeroed, np.where(vis, getattr(call, zeroed), 0).astype(np.float32))
        want = call.run(True)
        got = call.run(True, flags=flags)
        assert not any(np.isnan(a).any() for a in got)
        np.testing.assert_array_equal(np.where(vis, got[0], 0), np.where(vis, want[0], 0))
        for g, w in zip(got[1:], want[1:]):
            np.testing.assert_array_equal(g, w)
