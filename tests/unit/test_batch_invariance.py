"""DEEPINFER_BATCH_INVARIANT=1 on the cpu reference: a token's result is bit-identical whatever
else shares its step (batch size, its row, padding of index lists, prefill chunking)."""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer.backends.cpu import CpuAccelerator, make
from deepinfer.backends.cpu import invariant as invariant_ops
from deepinfer.backends.cpu import kernels
from deepinfer.backends import reference as fast
from deepinfer.models.deepseek_v4 import fused
from model_runner import build_model, new_cache, run_schedule
import tiny_models_v3
from tiny_models import make_hf_model


@pytest.fixture(params=["kernels", "torch"])
def kernels_env(request, monkeypatch) -> str:
    """The mode runs on the fused C++ kernels (kernels.batch_invariant_ops) or, with
    DEEPINFER_CPU_KERNELS=0, on invariant.py alone: both must hold every guarantee."""
    monkeypatch.setenv("DEEPINFER_CPU_KERNELS", "1" if request.param == "kernels" else "0")
    return request.param


@pytest.fixture
def invariant(monkeypatch, kernels_env) -> CpuAccelerator:
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    acc = make()
    assert (acc.hc_pre is invariant_ops.hc_pre) == (kernels_env == "torch")
    return acc


@pytest.fixture
def default(monkeypatch) -> CpuAccelerator:
    monkeypatch.delenv("DEEPINFER_BATCH_INVARIANT", raising=False)
    return make()


def test_flags_follow_the_env_at_construction(invariant, default, kernels_env):
    assert invariant.batch_invariant and invariant.deterministic_sampling
    assert not default.batch_invariant and not default.deterministic_sampling
    assert CpuAccelerator.batch_invariant is False
    assert default.rms_norm is (fast.rms_norm if kernels_env == "torch" else kernels.rms_norm)
    if kernels_env == "torch":
        assert invariant.linear is invariant_ops.linear
    else:  # the row-wise GEMV kernel at every size: never kernels.linear's hand-over to MKL above 32 rows
        assert invariant.linear.func is kernels.linear and invariant.linear.keywords["max_tokens"] == float("inf")


def test_linear_row_is_the_same_in_any_batch_on_the_kernels(monkeypatch):
    """The mode's linear on the kernels at a narrow and a wide (weight-stationary) matrix: a row
    alone, in a 40-row batch, at any position."""
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    monkeypatch.setenv("DEEPINFER_CPU_KERNELS", "1")
    acc = make()
    g = _gen(8)
    for k, n in ((64, 300), (256, 1100)):  # 1100 x 256 floats > 256 KB: read weight-stationary
        x, w = torch.randn(40, k, generator=g), torch.randn(n, k, generator=g)
        full = acc.linear(x, w)
        assert (full - fast.linear(x, w)).abs().max() <= 1e-5 * fast.linear(x, w).abs().max()
        for row in (0, 15, 16, 33, 39):
            assert torch.equal(acc.linear(x[row:row + 1], w)[0], full[row])
            assert torch.equal(acc.linear(x[row:], w)[0], full[row])
            assert torch.equal(acc.linear(x.roll(5 - row, 0), w)[5], full[row])


# ---------------------------------------------------------------- op level
def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _op_cases(acc, seed: int = 0):
    """(name, fn(rows) -> outputs of those rows). Each op sees 9 tokens; `rows` picks a sub-batch."""
    g = _gen(seed)
    rn = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    T, D, N, H = 9, 64, 4, 4
    x, w = rn(T, 256), rn(512, 256)
    xg, wg = rn(T, 2, 48), rn(2 * 24, 48)
    streams, fn, base, scale = rn(T, N, D), rn((2 + N) * N, N * D) * 0.1, rn((2 + N) * N), rn(3)
    hfn, hbase = rn(N, N * D) * 0.1, rn(N)
    gate, up = rn(T, 24) * 4, rn(T, 24)
    gw, gbias = rn(8, D), rn(8)
    gw16, gbias16, no_sink = rn(16, D) * 0.3, rn(16) * 0.1, torch.full((H,), float("-inf"))
    h = rn(T, D)
    ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(T)])
    mw, gate_up, down = torch.rand(T, 2, generator=g), rn(8, 64, D) * 0.2, rn(8, D, 32) * 0.2
    pool, kv_dim = 300, 32
    kv, q, sinks = rn(pool, kv_dim), rn(T, H, kv_dim), rn(H)
    valid = torch.randint(1, 150, (T,), generator=g)
    idx = torch.randint(0, pool, (T, 150), generator=g)
    idx = torch.where(torch.arange(150) < valid[:, None], idx, -1)
    iq, iw, ikeys = rn(T, 16, 16), rn(T, 16), rn(pool, 16)
    # CSA compressor: 9 windows of rate 4 over staged [kv | gate] rows, the first ones partly absent
    ring, wbias, wnorm, wcos, wsin = rn(pool, 4 * 16), rn(4, 32), rn(16), rn(T, 4), rn(T, 4)
    wrows = torch.randint(0, pool, (T, 8), generator=g)
    wrows[:3, :2] = -1
    return {
        "linear": lambda r: acc.linear(x[r], w),
        "grouped_linear": lambda r: acc.grouped_linear(xg[r], wg),
        "rms_norm": lambda r: acc.rms_norm(x[r], w[0], 1e-6),
        "swiglu": lambda r: acc.swiglu(gate[r], up[r], 3.0),
        "hc_pre": lambda r: acc.hc_pre(streams[r], fn, base, scale, 1e-6, 1e-6, 20),
        "hc_head": lambda r: acc.hc_head(streams[r], hfn, hbase, scale[:1], 1e-6, 1e-6),
        "route_topk": lambda r: acc.route_topk(h[r], gw, gbias, 2, 1.5),
        "route_hash": lambda r: acc.route_hash(h[r], gw, ids[r], 1.5),
        "route_grouped_topk": lambda r: acc.route_grouped_topk(h[r], gw16, gbias16, 4, 4, 2, True, 2.5),
        "moe_experts": lambda r: acc.moe_experts(h[r], mw[r], ids[r], gate_up, down, 10.0),
        "swiglu_mlp": lambda r: acc.swiglu_mlp(h[r], gate_up[0], down[0], 10.0),
        # index lists are cut to the sub-batch's widest row, as the model pads them
        "sparse_attention": lambda r: acc.sparse_attention(q[r], kv, idx[r][:, :int(valid[r].max())], sinks, 0.2),
        "sparse_attention_no_sink": lambda r: acc.sparse_attention(q[r], kv, idx[r][:, :int(valid[r].max())],
                                                                   no_sink, 0.2),
        "indexer_topk": lambda r: acc.indexer_topk(iq[r], iw[r], ikeys, idx[r][:, :int(valid[r].max())], 24, 0.25),
        "compress_entries": lambda r: fused.compress_entries(acc, ring, wrows[r], wbias, True, wnorm, 1e-6, wcos[r],
                                                             wsin[r]),
        "hc_pre_norm": lambda r: fused.hc_pre_norm(acc, streams[r], fn, base, scale, 1e-6, 1e-6, 20, w[0, :D]),
        "hc_post_pre_norm": lambda r: fused.hc_post_pre_norm(
            acc, h[r], streams[r], *acc.hc_pre(streams[r], fn, base, scale, 1e-6, 1e-6, 20)[1:], fn, base, scale, 1e-6,
            1e-6, 20, w[0, :D]),
        "rms_norm_rope": lambda r: fused.rms_norm_rope(acc, q[r], None, 1e-6, wcos[r], wsin[r]),
    }


def _as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


def _differences(acc, seed: int = 0) -> dict[str, int]:
    """Per op: how many (row, sub-batch) pairs differ from that row computed alone."""
    bad = {}
    for name, run in _op_cases(acc, seed).items():
        count = 0
        for row in range(9):
            alone = _as_tuple(run(torch.tensor([row])))
            for rows in (torch.arange(9), torch.arange(row, 9), torch.arange(row + 1).flip(0)):
                pos = int((rows == row).nonzero())
                got = _as_tuple(run(rows))
                if name == "indexer_topk":  # order within a row is unspecified
                    same = torch.equal(alone[0][0].sort().values, got[0][pos][:alone[0].shape[1]].sort().values)
                else:
                    same = all(torch.equal(a[0], b[pos]) for a, b in zip(alone, got))
                count += not same
        bad[name] = count
    return bad


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    """MKL splits work differently with more threads; the engine uses 1 thread for small models."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def test_ops_are_row_invariant_in_the_mode(invariant, threads):
    for seed in range(3 if threads == 1 else 1):  # 2 threads on a shared 2-core box oversubscribe: slow
        bad = _differences(invariant, seed)
        assert not any(bad.values()), f"seed {seed}: rows that differ from the same row alone: {bad}"


def test_linear_row_is_the_same_in_any_block_and_position(invariant, threads):
    """Rows pad to blocks of 16: a row alone, in a 40-row batch (3 blocks) at any position."""
    g = _gen(7)
    x, w = torch.randn(40, 256, generator=g), torch.randn(300, 256, generator=g)
    full = invariant.linear(x, w)
    for row in (0, 15, 16, 33, 39):
        assert torch.equal(invariant.linear(x[row], w), full[row])
        assert torch.equal(invariant.linear(x[row:], w)[0], full[row])
        assert torch.equal(invariant.linear(x.roll(5 - row, 0), w)[5], full[row])


def test_invariant_ops_agree_with_the_reference(invariant, default):
    fast_cases, inv_cases = _op_cases(default, 5), _op_cases(invariant, 5)
    rows = torch.arange(9)
    for name, run in inv_cases.items():
        ours, ref = _as_tuple(run(rows)), _as_tuple(fast_cases[name](rows))
        for a, b in zip(ours, ref):
            if name == "indexer_topk":
                assert torch.equal(a.sort(dim=-1).values, b.sort(dim=-1).values), name
            elif not a.is_floating_point():
                assert torch.equal(a.sort(dim=-1).values, b.sort(dim=-1).values), name
            else:
                err = (a - b).abs().max() / b.abs().max().clamp(min=1e-30)
                assert err < 1e-5, f"{name}: relative error {err:.2e}"


def test_padding_width_does_not_change_attention(invariant):
    g = _gen(3)
    q, kv, sinks = torch.randn(5, 4, 32, generator=g), torch.randn(200, 32, generator=g), torch.randn(4, generator=g)
    idx = torch.randint(0, 200, (5, 70), generator=g)
    idx[1, 40:] = -1
    idx[2, :10] = -1  # window rows before position 0
    idx[4] = -1  # nothing to attend to: zeros
    ref = invariant.sparse_attention(q, kv, idx, sinks, 0.2)
    assert torch.equal(ref[4], torch.zeros(4, 32))
    for extra in (1, 58, 64, 300):
        padded = torch.cat([idx, torch.full((5, extra), -1)], dim=1)
        assert torch.equal(invariant.sparse_attention(q, kv, padded, sinks, 0.2), ref), extra
        assert torch.equal(invariant.indexer_topk(q[:, :, :16], q[:, :, 0], kv[:, :16], padded, 8, 0.25),
                           invariant.indexer_topk(q[:, :, :16], q[:, :, 0], kv[:, :16], idx, 8, 0.25)), extra


# ---------------------------------------------------------------- model level
TARGET_LEN = 150  # V4: past the 32-token window, several CSA entries (top-8 of them), two 64-token HCA windows
# V3: past a page of the latent cache (128 positions)


@pytest.fixture(scope="module", params=["v4", "v3"])
def hf_model(request):
    """Each family's tiny model: V4 (all three attention kinds) and V3 (q LoRA, YaRN, grouped routing)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # as the engine runs small models (and fast when other processes share the cores)
    yield make_hf_model("mixed_hc4_yarn", seed=3) if request.param == "v4" else \
        tiny_models_v3.make_hf_model("v3_yarn_groups", seed=3)
    torch.set_num_threads(before)


def _prompts(seed: int, vocab: int = 512) -> list[torch.Tensor]:
    g = _gen(seed)
    lengths = [TARGET_LEN] + [int(n) for n in torch.randint(20, 220, (7,), generator=g)]
    return [torch.randint(2, vocab, (n,), generator=g) for n in lengths]


def _mixed_schedule(lengths: list[int], seed: int) -> list[list[tuple[int, int]]]:
    """Sequences join at different steps and advance by prefill chunks or single decode tokens,
    in a shuffled order, so the target (sequence 0) meets other sequences at every phase."""
    rng = random.Random(seed)
    fed = [0] * len(lengths)
    join = [0] + [rng.randint(0, 6) for _ in lengths[1:]]
    steps, step_no = [], 0
    while fed[0] < lengths[0]:
        step = []
        for s, n in enumerate(lengths):
            if step_no >= join[s] and fed[s] < n:
                take = min(n - fed[s], rng.choice([1, 1, 2, rng.randint(3, 48)]))
                step.append((s, take))
                fed[s] += take
        rng.shuffle(step)
        steps.append(step)
        step_no += 1
    return steps


def _target_logits(model, prompts, steps) -> torch.Tensor:
    return run_schedule(model, new_cache(model), prompts, steps)[0]


def _schedules(prompts) -> dict[str, list]:
    lengths = [len(p) for p in prompts]
    return {
        "alone, one step": [[(0, TARGET_LEN)]],
        "alone, chunked 37/64/1/1/47": [[(0, n)] for n in (37, 64, 1, 1, 47)],
        "alone, prefill 100 then decode": [[(0, 100)]] + [[(0, 1)]] * 50,
        "batch of 8, mixed phases": _mixed_schedule(lengths, 0),
        "batch of 8, other mix": _mixed_schedule(lengths, 1),
    }


def test_logits_are_bit_identical_across_batches_and_chunking(hf_model, kernels_env, monkeypatch):
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    model = build_model(*hf_model)
    assert model.accel.batch_invariant
    prompts = _prompts(0)
    results = {name: _target_logits(model, prompts, steps) for name, steps in _schedules(prompts).items()}
    ref = results.pop("alone, one step")
    for name, logits in results.items():
        diff = (logits - ref).abs().max().item()
        assert torch.equal(logits, ref), f"{name}: max |diff| {diff:.3e} vs the sequence run alone in one step"


def test_without_the_mode_results_depend_on_the_batch(hf_model, monkeypatch):
    """Shows the mode is needed: the fast ops give a row a batch-dependent result (MKL picks its GEMM
    kernel by row count: in the ops the kernels do not replace, swiglu here, and in linear above 32
    rows), so the model's logits of a sequence change when others join its batch, by rounding only."""
    monkeypatch.delenv("DEEPINFER_BATCH_INVARIANT", raising=False)
    model = build_model(*hf_model)
    assert not model.accel.batch_invariant
    op_diffs = {name: n for name, n in _differences(model.accel).items() if n}
    prompts = _prompts(0)
    schedules = _schedules(prompts)
    ref = _target_logits(model, prompts, schedules["alone, one step"])
    batched = _target_logits(model, prompts, schedules["batch of 8, mixed phases"])
    print(f"ops whose rows depend on the batch without the mode: {op_diffs}; "
          f"model logits max |diff| {(batched - ref).abs().max().item():.2e}")
    assert op_diffs
    assert not torch.equal(ref, batched)
    torch.testing.assert_close(batched, ref, rtol=1e-4, atol=1e-4)  # different, but only by rounding
