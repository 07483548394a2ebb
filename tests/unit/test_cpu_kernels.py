"""The cpu backend's fused C++ kernels (backends/cpu/fused_ops.cpp) against the reference ops.

They are what the cpu backend runs by default, so every one is checked against the reference ops
(backends/reference.py; DeepSeek-V4's fused sequences against their composites) on edge
cases (absent indices, fewer valid candidates than k, exact score ties, strided inputs), and a
token's result must not depend on the rest of its batch.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from deepinfer.backends import reference as ref
from deepinfer.backends.cpu import CpuAccelerator, CpuKernelAccelerator, kernels, make
from deepinfer.models.deepseek_v4 import fused as composites
from test_batch_invariance import _differences

REFERENCE = CpuAccelerator()  # the reference ops: DeepSeek-V4's fused sequences run as their composites

REL = 2e-6  # float32, different summation order than torch's


def _close(got, want, rel=REL):
    got, want = (got if isinstance(got, tuple) else (got,)), (want if isinstance(want, tuple) else (want,))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        err = (g - w).abs().max().item() / max(w.abs().max().item(), 1e-30) if w.numel() else 0.0
        assert err <= rel, f"relative error {err:.2e} > {rel:.0e}"


@pytest.fixture(scope="module", autouse=True)
def built():
    assert kernels.load(), "the cpu kernels did not build (see the warning)"


def _gen(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("tokens,n,d", [(1, 4, 64), (37, 4, 64), (5, 2, 48), (0, 4, 64)])
def test_mhc_kernels_match_the_reference(seed, tokens, n, d):
    g = _gen(seed)
    streams = torch.randn(tokens, n, d, generator=g) * 3
    fn, base = torch.randn((2 + n) * n, n * d, generator=g) * 0.1, torch.randn((2 + n) * n, generator=g)
    scale = torch.rand(3, generator=g) * 2
    for iters in (1, 20):
        _close(kernels.hc_pre(streams, fn, base, scale, 1e-6, 1e-6, iters),
               ref.hc_pre(streams, fn, base, scale, 1e-6, 1e-6, iters))
    _, post, comb = ref.hc_pre(streams, fn, base, scale, 1e-6, 1e-6, 20)
    block = torch.randn(tokens, d, generator=g)
    _close(kernels.hc_post(block, streams, post, comb), ref.hc_post(block, streams, post, comb))
    head_fn, head_base = torch.randn(n, n * d, generator=g) * 0.1, torch.randn(n, generator=g)
    _close(kernels.hc_head(streams, head_fn, head_base, scale[:1], 1e-6, 1e-6),
           ref.hc_head(streams, head_fn, head_base, scale[:1], 1e-6, 1e-6))


@pytest.mark.parametrize("seed", range(3))
def test_norm_and_rope_match_the_reference_on_strided_and_3d_inputs(seed):
    g = _gen(seed)
    fused = torch.randn(23, 300, generator=g)
    x = fused[:, 40:104]  # a column slice of a fused projection, as the model passes it
    w = torch.randn(64, generator=g)
    _close(kernels.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6))
    _close(kernels.rms_norm(x, None, 1e-6), ref.rms_norm(x, None, 1e-6))
    q = torch.randn(23, 4, 32, generator=g)
    _close(kernels.rms_norm(q, None, 1e-6), ref.rms_norm(q, None, 1e-6))
    cos, sin = torch.randn(23, 4, generator=g), torch.randn(23, 4, generator=g)
    for inverse in (False, True):
        _close(kernels.rope(q, cos, sin, inverse), ref.rope(q, cos, sin, inverse))
        _close(kernels.rope(x, cos, sin, inverse), ref.rope(x, cos, sin, inverse))


@pytest.mark.parametrize("seed", range(3))
def test_sparse_attention_matches_the_reference_with_absent_rows(seed):
    g = _gen(seed)
    T, H, Dh, pool = 19, 4, 32, 300
    q, kv, sinks = torch.randn(T, H, Dh, generator=g), torch.randn(pool, Dh, generator=g), torch.randn(H, generator=g)
    idx = torch.randint(0, pool, (T, 45), generator=g)
    idx[torch.rand(T, 45, generator=g) < 0.3] = -1
    idx[0] = -1  # a token that sees nothing: the sink takes all the weight, the output is 0
    out = kernels.sparse_attention(q, kv, idx, sinks, 0.2)
    _close(out, ref.sparse_attention(q, kv, idx, sinks, 0.2), rel=1e-5)
    assert out[0].abs().max() == 0


@pytest.mark.parametrize("seed", range(3))
def test_indexer_picks_the_reference_candidates_in_order(seed):
    g = _gen(seed)
    T, H, Di, pool, M = 17, 16, 16, 400, 90
    q, w, keys = torch.randn(T, H, Di, generator=g), torch.randn(T, H, generator=g), torch.randn(pool, Di, generator=g)
    cand = torch.randint(0, pool, (T, M), generator=g)
    cand[torch.rand(T, M, generator=g) < 0.2] = -1
    cand[1, 5:] = -1  # fewer valid candidates than k: the rest is -1
    for k in (8, 24):
        got = kernels.indexer_topk(q, w, keys, cand, k, 0.25)
        assert torch.equal(got, ref.indexer_topk(q, w, keys, cand, k, 0.25))
        assert (got[1, (cand[1] >= 0).sum():] == -1).all()


def test_indexer_breaks_exact_ties_towards_the_earlier_candidate():
    q, w = torch.ones(2, 4, 8), torch.ones(2, 4)
    keys = torch.ones(10, 8)  # every candidate scores the same
    cand = torch.tensor([[7, 3, 9, 1, 5], [2, -1, 8, 0, 6]])
    got = kernels.indexer_topk(q, w, keys, cand, 3, 0.5)
    assert got.tolist() == [[7, 3, 9], [2, 8, 0]]
    assert torch.equal(got, ref.indexer_topk(q, w, keys, cand, 3, 0.5))


@pytest.mark.parametrize("seed", range(3))
def test_moe_experts_match_the_reference(seed):
    g = _gen(seed)
    T, D, E, inter, k = 21, 64, 8, 32, 2
    x = torch.randn(T, D, generator=g) * 2
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=g)
    gate_up, down = torch.randn(E, 2 * inter, D, generator=g) * 0.3, torch.randn(E, D, inter, generator=g) * 0.3
    for limit in (1.0, 10.0):  # 1.0 clamps most gate/up values
        _close(kernels.moe_experts(x, w, ids, gate_up, down, limit), ref.moe_experts(x, w, ids, gate_up, down, limit))


@pytest.mark.parametrize("T,K,N", [(32, 64, 512), (1, 37, 5), (9, 128, 64), (2, 256, 1024), (33, 64, 40)])
def test_gemv_linear_matches_the_reference(T, K, N):
    g = _gen(T)
    x, w = torch.randn(T, K, generator=g), torch.randn(N, K, generator=g)
    _close(torch.ops.deepinfer_cpu.linear(x, w), ref.linear(x, w))
    strided = torch.randn(T, 2 * K, generator=g)[:, ::2]  # copied to contiguous rows first
    _close(torch.ops.deepinfer_cpu.linear(strided, w), ref.linear(strided, w))
    # kernels.linear takes the kernel up to _LINEAR_MAX_TOKENS rows (32 with the register tiles), the
    # reference GEMM beyond
    kernel = T <= kernels._LINEAR_MAX_TOKENS
    assert torch.equal(kernels.linear(x, w), (torch.ops.deepinfer_cpu.linear if kernel else ref.linear)(x, w))


@pytest.mark.parametrize("K,N", [(37, 29), (203, 53), (256, 1003), (7, 13)])
def test_tiled_gemm_rows_give_each_token_its_single_token_bits(K, N):
    """Two tokens or more go through gemm_rows' register tiles (with AVX-512: token pairs x 6 weight
    rows, tiles of 1-4 pairs, an odd last token paired with zeros; with AVX2: 1-3 tokens x 4 rows). Every dot keeps the single-token
    GEMV's summation order, so a token's row has the same bits at any T (1..40), with K not a multiple
    of 8 (the tail) and rows not a multiple of the tile, on 1 and 2 threads; and it is within REL of
    torch (float32 GEMMs in another order). The same for grouped_linear, which runs on gemm_rows."""
    g = _gen(K)
    x, w = torch.randn(40, K, generator=g), torch.randn(N, K, generator=g)
    xg, wg = torch.randn(40, 3, K, generator=g), torch.randn(3 * N, K, generator=g)
    op, grouped = torch.ops.deepinfer_cpu.linear, torch.ops.deepinfer_cpu.grouped_linear
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            alone = torch.cat([op(x[t:t + 1], w) for t in range(40)])
            alone_g = torch.cat([grouped(xg[t:t + 1], wg) for t in range(40)])
            for T in range(1, 41):
                assert torch.equal(op(x[:T], w), alone[:T]), (threads, T)
                assert torch.equal(grouped(xg[:T], wg), alone_g[:T]), (threads, T)
            _close(alone, ref.linear(x, w))
            _close(alone_g, ref.grouped_linear(xg, wg))
    finally:
        torch.set_num_threads(before)


@pytest.mark.slow
@pytest.mark.skipif(not kernels._CAPABILITY.startswith("AVX512"),
                    reason="needs an AVX-512 CPU (on an AVX2 one the rest of this file tests the AVX2 build)")
def test_the_avx2_build_passes_the_kernel_tests():
    """Most laptops have AVX2 + FMA and no AVX-512: torch then dispatches AVX2 and the kernels are built
    with the AVX2 register tiles (3 tokens x 4 rows of 256-bit accumulators). Built here as such a CPU
    gets them (ATEN_CPU_CAPABILITY=avx2), they pass this file's tests: each token's bits equal to its
    GEMV at every batch, every kernel within its tolerance of the reference."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2")  # its own build directory: the flags name the build
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", __file__,
                           "-k", "not avx2_build"], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    check = subprocess.run([sys.executable, "-c", "from deepinfer.backends.cpu import kernels; "
                            "print(kernels.load(), kernels._TILES, ' '.join(kernels._FLAGS))"],
                           env=env, capture_output=True, text=True, timeout=600)
    assert check.stdout.split()[:2] == ["True", "True"] and "-mno-avx512f" in check.stdout, check.stdout + check.stderr


@pytest.mark.parametrize("T,D,inter", [(21, 64, 32), (1, 64, 32), (5, 48, 19)])
def test_shared_expert_matches_the_reference(T, D, inter):
    g = _gen(T)
    x = torch.randn(T, D, generator=g) * 2
    gate_up, down = torch.randn(2 * inter, D, generator=g) * 0.3, torch.randn(D, inter, generator=g) * 0.3
    for limit in (1.0, 10.0):
        _close(kernels.swiglu_mlp(x, gate_up, down, limit), ref.swiglu_mlp(x, gate_up, down, limit))
    alone = kernels.swiglu_mlp(x[-1:], gate_up, down, 10.0)
    assert torch.equal(alone[0], kernels.swiglu_mlp(x, gate_up, down, 10.0)[-1])  # row-wise
    with pytest.raises(RuntimeError, match="gate_up must be"):
        torch.ops.deepinfer_cpu.swiglu_mlp(x, gate_up[:, 1:], down, 10.0)


def test_experts_too_big_for_cache_match_the_reference_and_stay_row_wise():
    """gate_up of 512x256 floats (512 KB, the shipped model's) is read weight-stationary, once for
    all rows of an expert, instead of token by token: same results, same bits for a row alone."""
    g = _gen(11)
    T, D, E, inter, k = 7, 256, 3, 256, 2
    x = torch.randn(T, D, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=g)
    gate_up, down = torch.randn(E, 2 * inter, D, generator=g) * 0.1, torch.randn(E, D, inter, generator=g) * 0.1
    got = torch.ops.deepinfer_cpu.moe_experts(x, w, ids, gate_up, down, 7.0)
    _close(got, ref.moe_experts(x, w, ids, gate_up, down, 7.0))
    assert torch.equal(torch.ops.deepinfer_cpu.moe_experts(x[3:4], w[3:4], ids[3:4], gate_up, down, 7.0)[0], got[3])
    shared = torch.ops.deepinfer_cpu.swiglu_mlp(x, gate_up[0], down[0], 7.0)
    _close(shared, ref.swiglu_mlp(x, gate_up[0], down[0], 7.0))
    assert torch.equal(torch.ops.deepinfer_cpu.swiglu_mlp(x[5:6], gate_up[0], down[0], 7.0)[0], shared[5])


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("overlap,rate,dim,rope", [(True, 4, 32, 8), (False, 8, 32, 8), (True, 3, 13, 2), (False, 1, 16, 8)])
def test_compress_entries_match_the_reference(seed, overlap, rate, dim, rope):
    """CSA (overlapping windows: the previous window's first half of the channels) and HCA, with
    absent tokens (a sequence's first CSA window has no previous one), odd widths, and a strided
    ring (the compressor ring of a bigger pool)."""
    g = _gen(seed)
    C, S, W = (2 * dim, 2 * rate, 6) if overlap else (dim, rate, 6)
    ring = torch.randn(40, 2 * C + 3, generator=g)[:, :2 * C]
    rows = torch.randint(0, 40, (W, S), generator=g)
    if overlap:
        rows[0, :rate] = -1
    else:  # a window always has its own tokens; the last one alone
        rows[1, :-1] = -1
    bias, norm = torch.randn(rate, C, generator=g), torch.randn(dim, generator=g)
    cos, sin = torch.randn(W, rope, generator=g), torch.randn(W, rope, generator=g)
    args = (ring, rows, bias, overlap, norm, 1e-6, cos, sin)
    _close(kernels.compress_entries(*args), composites.compress_entries(REFERENCE, *args))
    assert torch.equal(kernels.compress_entries(ring, rows[:0], bias, overlap, norm, 1e-6, cos[:0], sin[:0]),
                       torch.empty(0, dim))


@pytest.mark.parametrize("seed", range(2))
def test_fused_sequences_are_their_kernels_in_sequence(seed):
    """hc_pre_norm, hc_post_pre_norm and rms_norm_rope: bit for bit the kernels they chain, and
    within tolerance of the reference composites."""
    g = _gen(seed)
    streams, fn, base, scale = (torch.randn(7, 4, 48, generator=g), torch.randn(24, 192, generator=g) * 0.1,
                                torch.randn(24, generator=g), torch.rand(3, generator=g))
    norm, block = torch.randn(48, generator=g), torch.randn(7, 48, generator=g)
    hc = (fn, base, scale, 1e-6, 1e-6, 20)
    collapsed, post, comb = kernels.hc_pre(streams, *hc)
    fused = kernels.hc_pre_norm(streams, *hc, norm)
    assert all(torch.equal(a, b) for a, b in zip(fused, (kernels.rms_norm(collapsed, norm, 1e-6), post, comb)))
    _close(fused, composites.hc_pre_norm(REFERENCE, streams, *hc, norm))
    nxt = kernels.hc_post(block, streams, post, comb)
    chained = (nxt, *kernels.hc_pre_norm(nxt, *hc, norm))
    fused = kernels.hc_post_pre_norm(block, streams, post, comb, *hc, norm)
    assert all(torch.equal(a, b) for a, b in zip(fused, chained))
    _close(fused, composites.hc_post_pre_norm(REFERENCE, block, streams, post, comb, *hc, norm))
    q, cos, sin = torch.randn(7, 3, 32, generator=g), torch.randn(7, 4, generator=g), torch.randn(7, 4, generator=g)
    for weight in (None, torch.randn(32, generator=g)):
        fused = kernels.rms_norm_rope(q, weight, 1e-6, cos, sin)
        assert torch.equal(fused, kernels.rope(kernels.rms_norm(q, weight, 1e-6), cos, sin))
        _close(fused, composites.rms_norm_rope(REFERENCE, q, weight, 1e-6, cos, sin))


def test_bad_indices_raise_instead_of_reading_out_of_bounds():
    q, kv = torch.randn(2, 4, 32), torch.randn(10, 32)
    with pytest.raises(RuntimeError, match="out of range"):
        kernels.sparse_attention(q, kv, torch.tensor([[0, 10], [1, 2]]), torch.zeros(4), 0.2)
    with pytest.raises(RuntimeError, match="out of range"):
        kernels.indexer_topk(torch.randn(2, 4, 8), torch.randn(2, 4), torch.randn(5, 8),
                             torch.tensor([[0, 5], [1, 2]]), 1, 0.5)
    with pytest.raises(RuntimeError, match="out of range"):
        kernels.compress_entries(torch.randn(5, 16), torch.tensor([[0, 5]]), torch.randn(2, 8), False, torch.randn(8),
                                 1e-6, torch.randn(1, 2), torch.randn(1, 2))


def test_inputs_the_kernels_do_not_take_go_to_the_reference():
    g = _gen(0)
    q, kv = torch.randn(3, 4, 32, generator=g), torch.randn(50, 32, generator=g).bfloat16()
    idx, sinks = torch.randint(0, 50, (3, 7), generator=g), torch.randn(4, generator=g)
    assert torch.equal(kernels.sparse_attention(q, kv, idx, sinks, 0.2), ref.sparse_attention(q, kv, idx, sinks, 0.2))


def test_the_backend_runs_the_kernels_unless_disabled(monkeypatch):
    monkeypatch.delenv("DEEPINFER_BATCH_INVARIANT", raising=False)
    monkeypatch.delenv("DEEPINFER_CPU_KERNELS", raising=False)
    on = make()
    assert all(getattr(on, op) is getattr(kernels, op) for op in kernels.OPS)
    monkeypatch.setenv("DEEPINFER_CPU_KERNELS", "0")
    off = make()
    assert all(getattr(off, op) is getattr(ref, op) for op in kernels.OPS)
    # profiles cached on disk (DSpark's step costs) are keyed by the kernels that were timed
    assert kernels.build_digest() in on.kernel_signature() and on.kernel_signature() != off.kernel_signature()


def test_fused_kernels_are_row_invariant(monkeypatch):
    """Each kernel works token by token: a row's result is bit-identical in any batch (of these
    9-token sizes; linear too where the register tiles are built: it hands rows to MKL only above 32)."""
    monkeypatch.delenv("DEEPINFER_BATCH_INVARIANT", raising=False)
    bad = _differences(make())
    fused = set(kernels.OPS) & set(bad) - (set() if kernels._TILES else {"linear"})
    assert fused and all(bad[op] == 0 for op in fused), {op: bad[op] for op in fused}


def test_a_failed_build_warns_and_keeps_the_reference(monkeypatch, tmp_path):
    from torch.utils import cpp_extension

    def no_compiler(**_):
        raise RuntimeError("Error building extension: c++: command not found")

    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    with pytest.warns(RuntimeWarning, match="command not found.*DEEPINFER_CPU_KERNELS=0"):
        assert kernels._try_load(str(tmp_path)) is False


def test_a_build_killed_midway_does_not_hang_the_next_one(tmp_path):
    """torch's loader leaves its `lock` file behind when the process holding it dies; a later load of
    that directory used to wait on it forever (a CI run hung its whole limit so). A build directory
    with such a file, as a killed first compile leaves it, still builds and loads, in a process
    given a deadline so that this test fails instead of hanging."""
    source = tmp_path / "tiny.cpp"
    source.write_text('extern "C" int deepinfer_tiny() { return 7; }\n')
    build = tmp_path / "build"
    build.mkdir()
    (build / "lock").touch()  # the dead builder's baton
    script = ("import ctypes, os, sys\n"
              "from deepinfer.backends.cpu.extension_build import load_extension\n"
              f"load_extension({str(build)!r}, name='tiny', sources=[{str(source)!r}], is_python_module=False)\n"
              f"print(ctypes.CDLL(os.path.join({str(build)!r}, 'tiny.so')).deepinfer_tiny())\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "7"
    assert not (build / "lock").exists()


@pytest.mark.parametrize("seed", range(3))
def test_projection_and_router_kernels_match_the_reference(seed):
    g = _gen(seed)
    T, D, E = 29, 64, 16
    x = torch.randn(T, D, generator=g)
    xg, wg = torch.randn(T, 2, 48, generator=g), torch.randn(2 * 24, 48, generator=g)
    _close(kernels.grouped_linear(xg, wg), ref.grouped_linear(xg, wg))
    gate, bias = torch.randn(E, D, generator=g) * 0.3, torch.randn(E, generator=g) * 0.1
    for k in (1, 4):
        w, ids = kernels.route_topk(x, gate, bias, k, 1.5)
        rw, rids = ref.route_topk(x, gate, bias, k, 1.5)  # topk(sorted=False): compare as sets
        rids, order = rids.sort(dim=-1)
        got_ids, got_order = ids.sort(dim=-1)
        assert torch.equal(got_ids, rids)
        _close(w.gather(1, got_order), rw.gather(1, order))
    hash_ids = torch.stack([torch.randperm(E, generator=g)[:3] for _ in range(T)])
    _close(kernels.route_hash(x * 30, gate, hash_ids, 2.0), ref.route_hash(x * 30, gate, hash_ids, 2.0))  # softplus > 20


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("H,Dh,K", [(3, 40, 13), (6, 32, 9), (4, 64, 70), (1, 8, 3)])
def test_sparse_attention_off_the_blocked_shapes(seed, H, Dh, K):
    """Heads not a multiple of 4, head dims not a multiple of 32, key counts not a multiple of 8:
    the kernel's partial blocks and remainders."""
    g = _gen(seed)
    T, pool = 7, 120
    q, kv, sinks = torch.randn(T, H, Dh, generator=g), torch.randn(pool, Dh, generator=g), torch.randn(H, generator=g)
    idx = torch.randint(0, pool, (T, K), generator=g)
    idx[torch.rand(T, K, generator=g) < 0.3] = -1
    _close(kernels.sparse_attention(q, kv, idx, sinks, 0.2), ref.sparse_attention(q, kv, idx, sinks, 0.2), rel=1e-5)


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("H,Di,M,k", [(12, 8, 21, 8), (20, 16, 64, 8), (16, 12, 5, 8), (16, 16, 33, 1)])
def test_indexer_off_the_blocked_shapes(seed, H, Di, M, k):
    """Head counts padded to 16 lanes, candidate counts not a multiple of 8, k >= valid."""
    g = _gen(seed)
    T, pool = 9, 200
    q, w, keys = torch.randn(T, H, Di, generator=g), torch.randn(T, H, generator=g), torch.randn(pool, Di, generator=g)
    cand = torch.randint(0, pool, (T, M), generator=g)
    cand[torch.rand(T, M, generator=g) < 0.2] = -1
    assert torch.equal(kernels.indexer_topk(q, w, keys, cand, k, 0.25), ref.indexer_topk(q, w, keys, cand, k, 0.25))


@pytest.mark.parametrize("T,D,inter,E,k", [(1, 64, 32, 8, 2), (9, 36, 20, 5, 3), (4, 13, 7, 3, 1)])
def test_moe_experts_off_the_blocked_shapes(T, D, inter, E, k):
    """Row counts and lengths that leave remainders after the blocks of 8 rows and 8 lanes, and
    several slots of a token on the same expert."""
    g = _gen(T)
    x = torch.randn(T, D, generator=g) * 2
    ids = torch.randint(0, E, (T, k), generator=g)
    w = torch.rand(T, k, generator=g)
    gate_up, down = torch.randn(E, 2 * inter, D, generator=g) * 0.3, torch.randn(E, D, inter, generator=g) * 0.3
    _close(kernels.moe_experts(x, w, ids, gate_up, down, 3.0), ref.moe_experts(x, w, ids, gate_up, down, 3.0))
    for t in range(T):  # a token alone gives the same bits as in the batch
        assert torch.equal(kernels.moe_experts(x[t:t + 1], w[t:t + 1], ids[t:t + 1], gate_up, down, 3.0),
                           kernels.moe_experts(x, w, ids, gate_up, down, 3.0)[t:t + 1])


@pytest.mark.parametrize("seed", range(4))
def test_argmax_kernel_is_torch_argmax_with_ties_nan_and_inf(seed):
    """Greedy sampling: the first of equal maxima, a NaN counting as the largest (its first one),
    a row of -inf giving 0, on row lengths across the kernel's chunks and lanes."""
    g = _gen(seed)
    for vocab in (1, 15, 16, 17, 8191, 8192, 8193, 40000, 129280):
        x = torch.randint(-4, 4, (6, vocab), generator=g).float()  # many exact ties
        x[1] = float("-inf")
        x[2, vocab // 2:] = float("nan")
        x[3, -1] = float("inf")
        x[4] = torch.randn(vocab, generator=g)
        got = kernels.argmax(x)
        assert torch.equal(got, ref.argmax(x)), (vocab, got, ref.argmax(x))
    make_accel = make()
    x = torch.randn(3, 1000, generator=g)
    t, z = torch.zeros(3), torch.zeros(3, dtype=torch.int64)
    assert torch.equal(make_accel.sample(x, t, z, torch.ones(3), z, z), x.argmax(-1))  # greedy rows take it


# DeepSeek-V4.1's ops with a cpu kernel -> which of their arguments are per token
_V41_KERNELS = {"hc_mixes": (0,), "hc_collapse": (0, 1), "sparse_attention_bf16": (0, 2)}


@pytest.mark.parametrize("t", (1, 5, 33))
@pytest.mark.parametrize("op", _V41_KERNELS)
def test_v41_kernels_match_the_reference(op, t):
    """DeepSeek-V4.1's lagged mHC split (hc_pre's mixes without its collapse, and the collapse alone)
    and its blocked bf16-probability attention on the kernels, within op_checks.V41_OPS' tolerances,
    and a token alone gives the bits it has in the batch (the batch-invariant mode takes these
    kernels at every size)."""
    from op_checks import check_v41_op, v41_op_inputs

    acc = CpuKernelAccelerator()
    check_v41_op(acc, op, t)
    args = v41_op_inputs(op, t)
    whole = getattr(acc, op)(*args)
    whole = whole if isinstance(whole, tuple) else (whole,)
    for i in range(t):
        alone = getattr(acc, op)(*(a[i:i + 1] if j in _V41_KERNELS[op] else a for j, a in enumerate(args)))
        for w, a in zip(whole, alone if isinstance(alone, tuple) else (alone,)):
            assert torch.equal(w[i:i + 1], a), (op, i)


@pytest.mark.parametrize("T", (1, 2, 5, 16, 33))
def test_greedy_head_kernel_is_the_argmax_of_the_linear_kernel(T):
    """linear_argmax (the replay's fusion of an LM head and its greedy pick) gives the tokens of
    argmax(linear(x, w)), bit for bit: head sizes across its 2048-row blocks and the argmax's lanes,
    odd widths, exact ties within and across blocks (the first wins), NaN and -inf rows."""
    g = _gen(T)
    for vocab, width in ((129280, 64), (4097, 33), (2048, 16), (17, 8), (1, 5)):
        x = torch.randn(T, width, generator=g)
        w = torch.randn(vocab, width, generator=g)
        if vocab > 2048:
            w[vocab - 1] = w[5] = w[2049] = 50 * x[0]  # equal rows: token 0's maximum three times
        want = ref.argmax(torch.ops.deepinfer_cpu.linear(x, w))
        got = torch.ops.deepinfer_cpu.linear_argmax(x, w)
        assert torch.equal(got, want), (vocab, width, got, want)
        if vocab > 2048:
            assert got[0] == 5
    x = torch.randn(3, 16, generator=g)
    x[1] = float("nan")
    w = torch.randn(5000, 16, generator=g)
    w[:, 0] = float("-inf")
    x[2, 0] = 0.0  # -inf * 0 = NaN in every logit of row 2; row 0: -inf * x0 everywhere
    assert torch.equal(torch.ops.deepinfer_cpu.linear_argmax(x, w), ref.argmax(torch.ops.deepinfer_cpu.linear(x, w)))


def test_bf16_round_is_torchs_conversion_pair_bit_for_bit():
    """bf16_round (the replay's fusion of x.to(bfloat16).to(float32)) gives the pair's bits: ties to
    even, subnormals, the largest finite values rounding to inf, signed zeros, inf, a NaN anywhere in
    the tensor (the pair picks the NaN), and inputs it does not take itself (float64, non-contiguous)."""
    g = _gen(0)
    x = torch.randn(4097, generator=g) * torch.exp2(torch.randint(-140, 128, (4097,), generator=g).float())
    bits = x.view(torch.int32)
    bits[:8] = torch.tensor([0x3F808000, 0x3F818000, 0x7F7FFFFF, 0x00000001, -0x80000000, 0x7F800000,
                             0x00FFFFFF, 0x3F80FFFF], dtype=torch.int32)  # ties, max finite, subnormal, -0, inf
    pair = lambda t: t.to(torch.bfloat16).to(torch.float32)  # noqa: E731
    for t in (x, x.view(17, 241)[:, :13], x.double(), torch.zeros(0), x[:1].reshape(())):
        got = torch.ops.deepinfer_cpu.bf16_round(t)
        assert got.dtype == torch.float32 and got.shape == t.shape
        assert torch.equal(got.view(torch.int32), pair(t).view(torch.int32))
    y = x.clone()
    y[1000] = float("nan")
    assert torch.equal(torch.ops.deepinfer_cpu.bf16_round(y).view(torch.int32), pair(y).view(torch.int32))


def test_copy_rows_kernel_matches_the_reference_for_any_dtype():
    g = _gen(0)
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        pool = torch.randn(40, 24, generator=g).to(dtype)
        src, dst = torch.tensor([30, 31, 5, 39]), torch.tensor([0, 7, 8, 2])
        want = pool.clone()
        ref.copy_rows(want, src, dst)
        got = pool.clone()
        kernels.copy_rows(got, src, dst)
        assert torch.equal(got, want)
    with pytest.raises(RuntimeError, match="outside the pool"):
        kernels.copy_rows(torch.zeros(4, 2), torch.tensor([4]), torch.tensor([0]))
@pytest.mark.parametrize("t", (1, 7, 33))
@pytest.mark.parametrize("kernels_on, invariant", [("1", "0"), ("1", "1"), ("0", "1")],
                         ids=["kernels", "invariant-kernels", "invariant"])
def test_deepseek_v3_inputs_match_the_reference(t, kernels_on, invariant, monkeypatch):
    """What DeepSeek-V3 gives the cpu backend's op classes: attention with no sink (-inf) over a
    latent-shaped pool, SwiGLU without a clamp (limit inf), and its router."""
    from op_checks import (GROUPED_ROUTINGS, check_attention_without_sink, check_route_grouped_topk,
                           check_unclamped_experts)

    monkeypatch.setenv("DEEPINFER_CPU_KERNELS", kernels_on)
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", invariant)
    acc = make()
    check_attention_without_sink(acc, t, 1e-5)
    check_unclamped_experts(acc, t, 1e-5)
    for routing in GROUPED_ROUTINGS:
        check_route_grouped_topk(acc, t, routing, 1e-5)


@pytest.mark.parametrize("t", (1, 7, 33))
def test_grouped_router_kernel_matches_the_reference(t):
    """The C++ route_grouped_topk itself (not the reference the wrapper falls back to above its size
    limit): the same experts per token and their weights, for every routing shape."""
    from op_checks import GROUPED_ROUTINGS

    for e, g, kg, k, norm, scaling in GROUPED_ROUTINGS:
        gen = _gen(t * 1000 + e)
        x, gate, bias = torch.randn(t, 64, generator=gen), torch.randn(e, 64, generator=gen) * 0.3, \
            torch.randn(e, generator=gen) * 0.1
        w, ids = torch.ops.deepinfer_cpu.route_grouped_topk(x, gate, bias, k, g, kg, norm, scaling)
        rw, rids = ref.route_grouped_topk(x, gate, bias, k, g, kg, norm, scaling)
        order, rorder = ids.argsort(-1), rids.argsort(-1)
        assert torch.equal(ids.gather(1, order), rids.gather(1, rorder)), (e, g, kg, k)
        _close(w.gather(1, order), rw.gather(1, rorder))


def _split_cases(g):
    """Decode-sized calls of the kernels that split one call over the intra-op threads (fused_ops.cpp:
    a GEMV's output rows in 8-row-aligned chunks, MoE by hit expert, attention by head block), with
    shapes that do split on two threads and leave a tail of rows (not a multiple of 8)."""
    x = torch.randn(1, 512, generator=g)
    w = torch.randn(1003, 512, generator=g)
    gate_up, down = torch.randn(600, 512, generator=g) * 0.1, torch.randn(512, 300, generator=g) * 0.1
    E, D, inter = 8, 256, 256
    xe = torch.randn(1, D, generator=g)
    egu, edn = torch.randn(E, 2 * inter, D, generator=g) * 0.1, torch.randn(E, D, inter, generator=g) * 0.1
    xg, wg = torch.randn(1, 8, 128, generator=g), torch.randn(8 * 120, 128, generator=g)
    q, kv = torch.randn(1, 8, 64, generator=g), torch.randn(400, 64, generator=g)
    idx = torch.randperm(400, generator=g)[:300][None]
    idx[0, ::7] = -1  # absent rows
    sinks = torch.randn(8, generator=g)
    return {
        "linear": ((x, w), ref.linear),
        "linear 3 rows": ((torch.randn(3, 512, generator=g), w), ref.linear),
        "swiglu_mlp": ((x, gate_up, down, 7.0), ref.swiglu_mlp),
        "moe_experts 2 experts": ((xe, torch.rand(1, 2, generator=g), torch.tensor([[5, 2]]), egu, edn, 7.0),
                                  ref.moe_experts),
        "moe_experts 1 expert": ((xe, torch.rand(1, 1, generator=g), torch.tensor([[3]]), egu, edn, 7.0),
                                 ref.moe_experts),
        "grouped_linear": ((xg, wg), ref.grouped_linear),
        "sparse_attention": ((q, kv, idx, sinks, 0.125), ref.sparse_attention),
    }


def test_a_decode_call_split_over_threads_gives_one_threads_bits():
    """A batch-1 call of the GEMV-shaped kernels runs on both cores: every output row is still computed
    by one thread in the same order, so the result equals the one-thread result bit for bit (the step
    replay and batch invariance rely on it) and the reference within REL."""
    before = torch.get_num_threads()
    try:
        for name, (args, reference) in _split_cases(_gen(5)).items():
            op = getattr(torch.ops.deepinfer_cpu, name.split()[0])
            torch.set_num_threads(1)
            one = op(*args)
            torch.set_num_threads(2)
            two = op(*args)
            assert torch.equal(one, two), name
            _close(two, reference(*args))
    finally:
        torch.set_num_threads(before)
