"""deepinfer.core.loader: every checkpoint spelling and quantization loads to the model's tensors."""
import functools
import json
import re

import pytest
import torch
from safetensors.torch import save_file

from deepinfer.backends.quant import QuantizedWeight
from deepinfer.core.loader import CheckpointError, load_checkpoint
from deepinfer.models.deepseek_v4 import DeepseekV4Model
from deepinfer.models.deepseek_v4.config import DeepseekV4Config
from deepinfer.models.deepseek_v4.weights import checkpoint_source as hf_to_upstream
from tiny_models import FUSED, as_scale, quant_fp4, to_upstream

transformers = pytest.importorskip("transformers")

TINY = dict(num_hidden_layers=4, compress_ratios=[0, 4, 128, 4], num_hash_layers=2, vocab_size=300, hidden_size=64,
            head_dim=32, qk_rope_head_dim=8, num_attention_heads=4, q_lora_rank=32, o_groups=2, o_lora_rank=16,
            n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, index_n_heads=4, index_head_dim=16,
            index_topk=4, hc_mult=2, sliding_window=16)
# Dims above one 128x128 block and not multiples of it: multiple and partial FP8 blocks
# (q_b_proj is [288, 136], compressor.kv_proj [144, 160], o_a_proj [32, 144], ...).
WIDE = TINY | dict(hidden_size=160, head_dim=72, q_lora_rank=136)


@functools.cache
def model(wide: bool = False):
    """A random tiny DeepseekV4ForCausalLM; buffers that init to zero (tid2eid, biases, sinks,
    position_bias) are randomized too, so a dropped or swapped tensor fails the comparisons."""
    cfg = transformers.DeepseekV4Config(**(WIDE if wide else TINY))
    torch.manual_seed(0)
    m = transformers.DeepseekV4ForCausalLM(cfg).eval()
    with torch.no_grad():
        for t in m.state_dict().values():
            t.copy_(torch.randint(0, cfg.n_routed_experts, t.shape) if t.dtype == torch.int64 else torch.randn(t.shape))
    return m


def state(wide=False) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model(wide).state_dict().items()}


def expected_of(sd):
    """The model's own specs (which tensors stay as stored), checked against the state dict's shapes."""
    wide = sd["model.layers.0.self_attn.q_a_proj.weight"].shape[1] == WIDE["hidden_size"]
    specs = DeepseekV4Model.checkpoint_tensors(DeepseekV4Config.from_dict(model(wide).config.to_dict()))
    assert {k: s.shape for k, s in specs.items()} == {k: tuple(v.shape) for k, v in sd.items()}
    return specs


def load(path, sd):
    """Load as the engine does for DeepSeek-V4: its names resolve upstream spellings, `mtp.*` kept aside."""
    return load_checkpoint(path, expected_of(sd), DeepseekV4Model, keep_prefixes=DeepseekV4Model.extra_prefixes)


def stored_alike(sd, dtype=None):
    """What the loader returns for a plain checkpoint of `sd` (optionally saved in `dtype`): weights
    the model keeps as stored in the file's dtype, the rest float32, integer tables int64."""
    specs = expected_of(sd)
    out = {}
    for k, v in sd.items():
        if v.dtype == torch.int64:
            out[k] = v
        else:
            v = v.to(dtype) if dtype is not None else v
            out[k] = v if specs[k].stored or specs[k].experts else v.float()
    return out


def fold(up: dict, sd: dict) -> dict:
    """Upstream-named tensors back into the HF state dict layout (inverse of `to_upstream`)."""
    out = {}
    for name, t in sd.items():
        if m := FUSED.fullmatch(name):
            layer, kind = m.groups()
            parts = ("w1", "w3") if kind == "gate_up_proj" else ("w2",)
            out[name] = torch.stack([torch.cat([up[f"layers.{layer}.ffn.experts.{j}.{w}.weight"] for w in parts])
                                     for j in range(t.shape[0])])
        else:
            out[name] = up[hf_to_upstream(name)]
    return out


def write(path, tensors, shards=1, config=None):
    """Write tensors round-robin into `shards` files, with an index when there is more than one."""
    path.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    files = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    files = files if shards > 1 else ["model.safetensors"]
    for i, f in enumerate(files):
        save_file({n: tensors[n].contiguous() for n in names[i::shards]}, str(path / f))
    if shards > 1:
        index = {"metadata": {}, "weight_map": {n: files[i % shards] for i, n in enumerate(names)}}
        (path / "model.safetensors.index.json").write_text(json.dumps(index))
    if config is not None:
        (path / "config.json").write_text(json.dumps(config))
    return path


def assert_same(got: dict, want: dict, quantized=()):
    """Equal tensors of equal dtype; the names in `quantized` must be QuantizedWeights that
    dequantize to the expected values (nothing was widened at load)."""
    assert got.keys() == want.keys()
    for k in want:
        if k in quantized:
            assert isinstance(got[k], QuantizedWeight) and torch.equal(got[k].dequantize(), want[k]), k
        else:
            assert isinstance(got[k], torch.Tensor) and got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


# ------------------------------------------------------------------------------- quantizers

def quant_fp8(w, block, fmt):
    """2-D w -> (e4m3 weight, per-block scale in `fmt`, dequantized reference, scale per element)."""
    (n, k), (b0, b1) = w.shape, block
    amax = torch.stack([torch.stack([w[i:i + b0, j:j + b1].abs().amax() for j in range(0, k, b1)])
                        for i in range(0, n, b0)])
    s = amax / 448
    if fmt != "f32":
        s = torch.exp2(torch.ceil(torch.log2(s)))
    full = s[torch.arange(n) // b0][:, torch.arange(k) // b1]
    q = (w / full).to(torch.float8_e4m3fn)
    return q, as_scale(s, fmt), q.float() * full, full


def quantizable(name, t):
    return name.endswith(".weight") and t.dim() == 2 and "embed" not in name and "head" not in name


# ------------------------------------------------------------------------------- formats

def test_hf_state_dict_names(tmp_path):
    sd = state()
    weights, extra = load(write(tmp_path, sd), sd)
    assert_same(weights, sd)
    assert extra == {}


def test_save_pretrained_sharded(tmp_path):
    # transformers 5.x writes the conversion mapping backwards: `model.layers.0.attn.wq_a.weight`,
    # `model.layers.0.attn.norm.weight` (kv_norm), per-expert w1/w2/w3, `head.weight`.
    model().save_pretrained(tmp_path, max_shard_size="40KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    sd = state()
    weights, _ = load(tmp_path, sd)
    assert_same(weights, sd)


def test_upstream_names_match_transformers(tmp_path):
    sd = state()
    write(tmp_path, to_upstream(sd))
    weights, _ = load(tmp_path, sd)
    assert_same(weights, sd)
    # Independent check of the name table: transformers' own loader reads the same files.
    model().config.save_pretrained(tmp_path)
    hf, info = transformers.DeepseekV4ForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert_same(weights, hf.state_dict())


def test_upstream_bf16_int32_sharded_with_mtp(tmp_path):
    sd = state()
    up = {k: v.to(torch.int32) if k.endswith("tid2eid") else v.bfloat16() for k, v in to_upstream(sd).items()}
    w = torch.randn(32, 64)
    q, s, ref_fp8, _ = quant_fp8(w, (128, 128), "e8m0")
    packed, s4, ref_fp4, _ = quant_fp4(torch.randn(32, 64))
    mtp = {"mtp.0.main_proj.weight": torch.randn(64, 128).bfloat16(), "mtp.0.attn.wq_a.weight": q,
           "mtp.0.attn.wq_a.scale": s, "mtp.0.ffn.experts.0.w1.weight": packed.view(torch.int8),
           "mtp.0.ffn.experts.0.w1.scale": s4, "mtp.0.hc_head_scale": torch.randn(1)}
    weights, extra = load(write(tmp_path, up | mtp, shards=3), sd)
    assert_same(weights, stored_alike(sd, torch.bfloat16))  # bf16 weights stay bf16, norms etc. float32
    assert_same(extra, {"mtp.0.main_proj.weight": mtp["mtp.0.main_proj.weight"],
                        "mtp.0.attn.wq_a.weight": ref_fp8, "mtp.0.ffn.experts.0.w1.weight": ref_fp4,
                        "mtp.0.hc_head_scale": mtp["mtp.0.hc_head_scale"]},
                quantized={"mtp.0.attn.wq_a.weight", "mtp.0.ffn.experts.0.w1.weight"})


@pytest.mark.parametrize("naming,fmt,block", [("hf", "f32", None), ("hf", "e8m0", None), ("upstream", "e8m0", None),
                                              ("upstream", "bytes", None), ("upstream", "f32", (32, 32))])
def test_fp8_block_scales(tmp_path, naming, fmt, block):
    """Dense 2-D weights in e4m3 with per-block scales (float32 or ue8m0); HF naming also quantizes
    the fused experts, with gate/up halves quantized separately as an upstream conversion gives.
    A block size other than 128x128 comes from config.json's quantization_config."""
    sd, b = state(wide=True), block or (128, 128)
    src = sd if naming == "hf" else to_upstream(sd)
    out, ref, bound = {}, {}, {}
    for name, t in src.items():
        if quantizable(name, t):
            q, s, r, full = quant_fp8(t, b, fmt)
            out |= {name: q, (name + "_scale_inv" if naming == "hf" else name.removesuffix(".weight") + ".scale"): s}
            ref[name], bound[name] = r, full
        elif naming == "hf" and FUSED.fullmatch(name):
            halves = [[quant_fp8(h, b, fmt) for h in e.chunk(2 if name.endswith("gate_up_proj") else 1)] for e in t]
            q, s, r, full = (torch.stack([torch.cat([h[i] for h in e]) for e in halves]) for i in range(4))
            out |= {name: q, name + "_scale_inv": s}
            ref[name], bound[name] = r, full
        else:
            out[name] = t
    config = {"quantization_config": {"quant_method": "fp8", "weight_block_size": list(block)}} if block else None
    weights, _ = load(write(tmp_path, out, config=config), sd)

    for name, r in ref.items():
        err = (r - src[name]).abs()
        # e4m3 keeps 3 mantissa bits: rounding error <= 2^-4 |w| for normals, and <= half the
        # subnormal step (2^-10 * scale) below 2^-6 * scale. Measured on these randn weights: 2.6%
        # relative Frobenius error for either scale format or block size; 5.9% max per element.
        assert (err <= (src[name].abs() * 2**-4 + bound[name] * 2**-10) * (1 + 1e-6)).all(), name
    want = fold(src | ref, sd) if naming == "upstream" else sd | ref
    quantized = {k for k in want if k in ref or hf_to_upstream(k) in ref or FUSED.fullmatch(k)}
    assert_same(weights, want, quantized)
    for k in quantized:  # kept quantized, in the checkpoint's block size (a gate/up half off the edge: refined)
        assert weights[k].format == "fp8_e4m3" and weights[k].block[1] == b[1], k


@pytest.mark.parametrize("naming,fmt,packed_dtype", [("upstream", "e8m0", torch.int8), ("hf", "f32", torch.uint8),
                                                     ("hf", "bytes", getattr(torch, "float4_e2m1fn_x2", torch.int8))])
def test_fp4_experts(tmp_path, naming, fmt, packed_dtype):
    """Routed experts as packed e2m1, two per byte, with one scale per 32 inputs."""
    sd = state()
    src = to_upstream(sd) if naming == "upstream" else sd
    out, ref, scale = dict(src), {}, {}
    for name in [n for n in src if ".experts." in n]:
        packed, s, ref[name], scale[name] = quant_fp4(src[name], fmt)
        scale_name = name.removesuffix(".weight") + ".scale" if naming == "upstream" else name + "_scale_inv"
        out |= {name: packed.view(packed_dtype), scale_name: s}
    weights, _ = load(write(tmp_path, out), sd)
    experts = {k for k in sd if FUSED.fullmatch(k)}
    assert_same(weights, fold(src | ref, sd) if naming == "upstream" else sd | ref, quantized=experts)
    assert all(weights[k].format == "fp4_e2m1" and weights[k].data.dtype == torch.uint8 for k in experts)
    for name, r in ref.items():
        # e2m1 steps are 0.5 up to 2, then 1 up to 4, then 2 up to 6 (in units of the scale): the
        # rounding error is <= max(s/4, |w|/4). Measured: 11.5% relative Frobenius error.
        assert ((r - src[name]).abs() <= torch.maximum(scale[name] / 4, src[name].abs() / 4)).all(), name


def test_save_upstream_reads_back(tmp_path):
    """tiny_models.save_upstream, DeepSeek's own layout (what llama.cpp's converter reads): upstream
    config keys and names, FP4 experts. It loads as the model it wrote, experts rounded to FP4."""
    import copy

    from deepinfer.models.deepseek_v4 import DeepseekV4Config
    from deepinfer.models.registry import load_config
    from tiny_models import save_upstream

    m = copy.deepcopy(model())  # save_upstream rounds the experts in place
    save_upstream(m, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["compress_ratios"] == TINY["compress_ratios"] and written["num_hash_layers"] == 2
    assert not {"layer_types", "mlp_layer_types", "rope_parameters", "compress_rates"} & written.keys()
    sd, down = m.state_dict(), "model.layers.3.mlp.experts.down_proj"
    assert not torch.equal(sd[down], model().state_dict()[down])  # rounded: what the FP4 checkpoint holds
    weights, _ = load(tmp_path, sd)
    assert_same(weights, sd, quantized={k for k in sd if FUSED.fullmatch(k)})  # the experts stay FP4
    ours, theirs = load_config(tmp_path)[0], DeepseekV4Config.from_dict(m.config.to_dict())
    for field in ("layer_types", "mlp_layer_types", "compress_rates", "rope_main", "rope_compress", "head_dim"):
        assert getattr(ours, field) == getattr(theirs, field), field


# ------------------------------------------------------------------------------- errors

QA = "model.layers.0.self_attn.q_a_proj.weight"
TID = "model.layers.0.mlp.gate.tid2eid"
SINK = "model.layers.1.self_attn.sinks"
W3 = "layers.3.ffn.experts.5.w3.weight"


def _fp8_no_scale(d):
    d[QA] = d[QA].to(torch.float8_e4m3fn)


def _bad_scale(d):
    d[QA], d[QA + "_scale_inv"] = d[QA].to(torch.float8_e4m3fn), torch.ones(3, 3)


def _scale_dtype(d):
    d[QA], d[QA + "_scale_inv"] = d[QA].to(torch.float8_e4m3fn), torch.ones(1, 1, dtype=torch.float16)


def _e5m2(d):
    d[QA], d[QA + "_scale_inv"] = d[QA].to(torch.float8_e5m2), torch.ones(1, 1)


def _fp4_no_scale(d):
    d[W3] = quant_fp4(d[W3])[0].view(torch.int8)


def _fp4_scale_shape(d):
    packed, s, _, _ = quant_fp4(d[W3])
    d[W3], d[W3.removesuffix(".weight") + ".scale"] = packed.view(torch.int8), s[:, :1]


def _expert_unlike(d):
    d[W3] = d[W3].bfloat16()  # the other experts of the stack are float32


BROKEN = {  # case: (upstream naming?, mutation, tensor name the error must mention)
    "missing": (False, lambda d: d.pop(SINK), SINK),
    "missing_upstream_expert": (True, lambda d: d.pop(W3), W3),
    "unexpected": (False, lambda d: d.update({"model.layers.0.self_attn.rope.weight": torch.ones(2)}),
                   "model.layers.0.self_attn.rope.weight"),
    "unexpected_upstream": (True, lambda d: d.update({"layers.1.attn.indexer.wk.weight": torch.ones(2)}),
                            "layers.1.attn.indexer.wk.weight"),
    "expert_out_of_range": (True, lambda d: d.update({"layers.3.ffn.experts.8.w1.weight": torch.ones(32, 64)}),
                            "layers.3.ffn.experts.8.w1.weight"),
    "shape": (False, lambda d: d.update({"model.norm.weight": torch.ones(65)}), "model.norm.weight"),
    "shape_upstream_expert": (True, lambda d: d.update({W3: torch.ones(32, 63)}), W3),
    "float_tid2eid": (False, lambda d: d.update({TID: d[TID].float()}), TID),
    "int_weight": (False, lambda d: d.update({QA: d[QA].long()}), QA),
    "fp8_without_scale": (False, _fp8_no_scale, QA),
    "scale_shape": (False, _bad_scale, QA),
    "scale_dtype": (False, _scale_dtype, QA),
    "e5m2_weight": (False, _e5m2, QA),
    "fp4_without_scale": (True, _fp4_no_scale, W3),
    "fp4_scale_shape": (True, _fp4_scale_shape, W3),
    "expert_stored_unlike": (True, _expert_unlike, W3),
    "orphan_scale_hf": (False, lambda d: d.update({"model.layers.0.self_attn.x.weight_scale_inv": torch.ones(1)}),
                        "model.layers.0.self_attn.x.weight_scale_inv"),
    "orphan_scale_upstream": (True, lambda d: d.update({"layers.0.attn.wx.scale": torch.ones(1)}),
                              "layers.0.attn.wx.scale"),
    "duplicate": (False, lambda d: d.update({"layers.0.attn.wq_a.weight": d[QA].clone()}), QA),
}


@pytest.mark.parametrize("case", BROKEN)
def test_broken_checkpoint_names_the_tensor(tmp_path, case):
    upstream, mutate, name = BROKEN[case]
    sd = state()
    tensors = to_upstream(sd) if upstream else dict(sd)
    mutate(tensors)
    with pytest.raises(CheckpointError, match=re.escape(name)):
        load(write(tmp_path, tensors), sd)


def test_index_naming_a_missing_file(tmp_path):
    sd = state()
    write(tmp_path, sd, shards=2)
    (tmp_path / "model-00001-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00001-of-00002.safetensors"):
        load(tmp_path, sd)


def test_no_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nope", {})
    with pytest.raises(CheckpointError, match=re.escape("model.safetensors")):
        load_checkpoint(tmp_path, {})
