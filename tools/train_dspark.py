#!/usr/bin/env python
"""Train the DSpark drafter (deepinfer/models/deepseek_v4/dspark.py) shipped with ``deepinfer/assets/tiny-dsv4``.

1. data     -- the shipped model's training split (tools/train_tiny.py's corpus rule: CPython
               stdlib files, held out by sha1(relpath) % 100 < 2), tokenized with the shipped
               tokenizer, packed into sequences of --seq-len.
2. target   -- the shipped model, frozen, run by deepinfer's own forward on the cpu backend:
               per sequence, logits of every position and the drafter's context features
               (attention input of dspark_target_layer_ids, averaged over hc streams).
3. drafter  -- deepinfer/models/deepseek_v4/dspark.py's own graph (the code the engine runs), one stage
               initialised from the target's last layer (a sliding-window V4 block), main_proj
               selecting the last target layer's features, Markov head bias zero, confidence
               head zero. Embedding and LM head are the target's, frozen.
               Per step: --anchors random anchor positions per sequence; each block is
               [token at anchor, noise x (block-1)], attending to the 128 context positions
               before the anchor and non-causally to itself. Markov input: the true previous token.
   Half the steps use the corpus, half the target's own greedy continuations of
               --self-distill training-split prompts (a quarter of --seq-len each).
4. loss     -- 0.1 CE(draft, target argmax) + 0.9 L1(p_draft, p_target)
               + 1.0 BCE(confidence, 1 - 0.5 L1), position weights exp(-k/4).
5. calibrate-- per block position a temperature T_k for the confidence logit, fitted against
               greedy acceptance (draft argmax == target argmax) on blocks anchored in the
               target's own greedy continuations of held-out prompts (what the drafter
               continues while serving), grid search minimising BCE. --calibrate-only
               refits the temperatures of the drafter already in --model.
6. output   -- dspark.safetensors (bf16, upstream mtp.0.* names) + dspark_* keys in
               config.json, and dspark_log.json with the held-out acceptance statistics.

    python tools/train_dspark.py --model deepinfer/assets/tiny-dsv4 --minutes 22
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import pathlib
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from deepinfer.backends.cpu import CpuAccelerator  # noqa: E402
from deepinfer.core.cache import StateCache  # noqa: E402
from deepinfer.core.loader import load_checkpoint  # noqa: E402
from deepinfer.models.base import FeaturesRequest, StepInput  # noqa: E402
from deepinfer.models.deepseek_v4 import DeepseekV4Model  # noqa: E402
from deepinfer.models.deepseek_v4.dspark import DSparkConfig, DSparkDrafter, fuse_experts, stage_names  # noqa: E402
from deepinfer.models.registry import load_config  # noqa: E402

DSPARK_KEYS = dict(dspark_block_size=5, dspark_noise_token_id=2, dspark_target_layer_ids=[3, 4, 5],
                   dspark_markov_rank=32)


def token_streams(model_dir: pathlib.Path):
    from tokenizers import Tokenizer
    from train_tiny import BOS, EOS, collect_corpus

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    _, train, held = collect_corpus()

    def encode(docs):
        ids = []
        for enc in tok.encode_batch([t for _, t in docs], add_special_tokens=False):
            ids += [BOS] + enc.ids + [EOS]
        return torch.tensor(ids, dtype=torch.int64)

    return encode(train), encode(held)


class Target:
    """The frozen shipped model: logits and drafter context features for whole sequences."""

    def __init__(self, model_dir, layers, batch: int, seq_len: int):
        self.cfg, _ = load_config(model_dir)
        weights, _ = load_checkpoint(model_dir, DeepseekV4Model.checkpoint_tensors(self.cfg), DeepseekV4Model)
        self.model = DeepseekV4Model(self.cfg, weights, CpuAccelerator())
        self.layers, self.batch, self.seq_len = tuple(layers), batch, seq_len
        self.cache = StateCache(self.model.cache_spec(margin=0), max_seqs=batch, num_pages=batch * -(-seq_len // 128),
                                max_step_tokens=batch * seq_len, max_model_len=seq_len)
        for s in range(batch):
            self.cache.allocate_slot()
            self.cache.grow(s, seq_len)

    def __call__(self, x: torch.Tensor):
        b, s = x.shape
        t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
        inp = StepInput(x.flatten(), torch.arange(b), t([0] * b), t([s] * b))
        rows = torch.arange(b * s)
        logits, feats = self.model.forward(inp, self.cache, rows, None, FeaturesRequest(self.layers, rows))
        # forward() runs in inference mode; autograd may only see ordinary tensors
        return logits.view(b, s, -1).clone(), feats.view(b, s, len(self.layers), -1).clone()


def init_drafter(target: Target, dcfg: DSparkConfig) -> dict[str, torch.Tensor]:
    """Stage weights copied from the target's last layer (upstream naming), heads neutral."""
    cfg, w = target.cfg, target.model.w
    last = cfg.num_hidden_layers - 1
    p, a = f"model.layers.{last}.", f"model.layers.{last}.self_attn."
    splits = target.model.input_proj_splits[last]
    fused = w[a + "input_proj.weight"]
    cols = lambda name: fused[slice(*splits[name])]  # noqa: E731
    gate_up, down = w[p + "mlp.experts.gate_up_proj"], w[p + "mlp.experts.down_proj"]
    inter = cfg.moe_intermediate_size
    shared_gate, shared_up = w[p + "mlp.shared_experts.gate_up_proj.weight"].chunk(2)
    s = "mtp.0."
    out = {
        s + "attn_norm.weight": w[p + "input_layernorm.weight"], s + "ffn_norm.weight": w[p + "post_attention_layernorm.weight"],
        s + "hc_attn_fn": w[p + "attn_hc.fn"], s + "hc_attn_base": w[p + "attn_hc.base"], s + "hc_attn_scale": w[p + "attn_hc.scale"],
        s + "hc_ffn_fn": w[p + "ffn_hc.fn"], s + "hc_ffn_base": w[p + "ffn_hc.base"], s + "hc_ffn_scale": w[p + "ffn_hc.scale"],
        s + "attn.wq_a.weight": cols("q_a_proj"), s + "attn.q_norm.weight": w[a + "q_a_norm.weight"],
        s + "attn.wq_b.weight": w[a + "q_b_proj.weight"], s + "attn.wkv.weight": cols("kv_proj"),
        s + "attn.kv_norm.weight": w[a + "kv_norm.weight"], s + "attn.wo_a.weight": w[a + "o_a_proj.weight"],
        s + "attn.wo_b.weight": w[a + "o_b_proj.weight"], s + "attn.attn_sink": w[a + "sinks"],
        s + "ffn.gate.weight": w[p + "mlp.gate.weight"], s + "ffn.gate.bias": w[p + "mlp.gate.e_score_correction_bias"],
        s + "ffn.shared_experts.w1.weight": shared_gate, s + "ffn.shared_experts.w3.weight": shared_up,
        s + "ffn.shared_experts.w2.weight": w[p + "mlp.shared_experts.down_proj.weight"],
        s + "norm.weight": w["model.norm.weight"], s + "hc_head_fn": w["model.hc_head.hc_fn"],
        s + "hc_head_base": w["model.hc_head.hc_base"], s + "hc_head_scale": w["model.hc_head.hc_scale"],
    }
    for j in range(cfg.n_routed_experts):
        out[s + f"ffn.experts.{j}.w1.weight"] = gate_up[j, :inter]
        out[s + f"ffn.experts.{j}.w3.weight"] = gate_up[j, inter:]
        out[s + f"ffn.experts.{j}.w2.weight"] = down[j]
    d, n_layers = cfg.hidden_size, len(dcfg.target_layer_ids)
    main = torch.zeros(d, n_layers * d)
    main[:, (n_layers - 1) * d:] = torch.eye(d)  # start from the last target layer's features
    gen = torch.Generator().manual_seed(7)
    out.update({
        s + "main_proj.weight": main, s + "main_norm.weight": torch.ones(d),
        s + "markov_head.embed.weight": torch.randn(cfg.vocab_size, dcfg.markov_rank, generator=gen) * 0.1,
        s + "markov_head.head.weight": torch.zeros(cfg.vocab_size, dcfg.markov_rank),
        s + "confidence_head.proj.weight": torch.zeros(1, d + dcfg.markov_rank),
        s + "confidence_head.temperature": torch.ones(dcfg.block_size),
    })
    expected = stage_names(cfg, dcfg)
    assert set(out) == set(expected), set(out) ^ set(expected)
    return {k: v.detach().clone().float().contiguous() for k, v in out.items()}


def block_outputs(drafter: DSparkDrafter, params, x, feats, anchors):
    """Draft block for each (sequence, anchor): per slot the draft logits [N, g, V], the
    confidence logits [N, g] (uncalibrated) and the Markov inputs; Markov prev = true tokens."""
    cfg, dcfg = drafter.cfg, drafter.dcfg
    drafter.w = fuse_experts(params, dcfg.num_stages, cfg.n_routed_experts)
    b, s = x.shape
    g, window = dcfg.block_size, drafter.window
    positions = torch.arange(s).repeat(b)
    ctx = drafter.context(feats.flatten(0, 1))
    ctx_cos_sin = drafter._cos_sin(positions)
    ctx_kv = [drafter.context_kv(k, ctx, ctx_cos_sin) for k in range(dcfg.num_stages)]
    seq, pos = anchors[:, 0], anchors[:, 1]
    n = len(seq)
    ids = torch.full((n, g), dcfg.noise_token_id, dtype=torch.int64)
    ids[:, 0] = x[seq, pos]
    block_pos = (pos[:, None] + torch.arange(g)).flatten()
    ctx_pos = pos[:, None] + torch.arange(-window, 0)
    ctx_rows = torch.where(ctx_pos >= 0, seq[:, None] * s + ctx_pos, -1)
    block_rows = b * s + torch.arange(n * g).view(n, g)
    indices = torch.cat([ctx_rows, block_rows], dim=1).repeat_interleave(g, dim=0)

    def attend(k, q, kv):
        pool = torch.cat([ctx_kv[k], kv])
        return drafter.accel.sparse_attention(q, pool, indices, drafter.sink(k), cfg.head_dim ** -0.5)

    h = drafter.stages(ids.flatten(), block_pos, attend)  # [n*g, D]
    prev = x[seq[:, None], pos[:, None] + torch.arange(g)]  # true previous token of each slot
    e, bias = drafter.markov(prev.flatten())
    logits = drafter.logits(h) + bias
    last = f"mtp.{dcfg.num_stages - 1}.confidence_head."
    conf = drafter.accel.linear(torch.cat([h, e], dim=-1), drafter.w[last + "proj.weight"]).squeeze(-1)
    return logits.view(n, g, -1), conf.view(n, g)


def sample_anchors(gen, b, s, per_seq, g, window):
    lo = 1
    pos = torch.randint(lo, s - g - 1, (b, per_seq), generator=gen)
    seq = torch.arange(b)[:, None].expand_as(pos)
    return torch.stack([seq.flatten(), pos.flatten()], dim=1)


def targets_for(target_logits, anchors, g):
    seq, pos = anchors[:, 0], anchors[:, 1]
    idx = pos[:, None] + torch.arange(g)  # slot k predicts position pos+k+1: target logits at pos+k
    return target_logits[seq[:, None], idx]  # [n, g, V]


def losses(logits, conf, tgt_logits):
    p_d = logits.float().softmax(-1)
    p_t = tgt_logits.float().softmax(-1)
    l1 = (p_d - p_t).abs().sum(-1)  # [n, g]
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tgt_logits.argmax(-1).flatten(),
                                           reduction="none").view_as(l1)
    bce = torch.nn.functional.binary_cross_entropy_with_logits(conf, (1 - 0.5 * l1).detach(), reduction="none")
    g = l1.shape[1]
    wpos = torch.exp(-torch.arange(g, dtype=torch.float32) / 4)
    wpos = wpos / wpos.sum()
    total = ((0.1 * ce + 0.9 * l1 + 1.0 * bce) * wpos).sum(1).mean()
    return total, l1, ce


def batches(stream, seq_len, batch, gen):
    n = len(stream) // seq_len
    while True:
        for i in torch.randperm(n, generator=gen).split(batch):
            if len(i) == batch:
                yield torch.stack([stream[j * seq_len:(j + 1) * seq_len] for j in i.tolist()])


def evaluate(drafter, params, target, held, seq_len, batch, per_seq, gen, n_batches):
    """Held-out: per slot greedy acceptance (teacher forced), mean L1, confidence logits."""
    acc, l1s, confs = [], [], []
    it = batches(held, seq_len, batch, gen)
    with torch.no_grad():
        for _ in range(n_batches):
            x = next(it)
            tl, feats = target(x)
            anchors = sample_anchors(gen, *x.shape, per_seq, drafter.dcfg.block_size, drafter.window)
            logits, conf = block_outputs(drafter, params, x, feats, anchors)
            tgt = targets_for(tl, anchors, drafter.dcfg.block_size)
            acc.append((logits.argmax(-1) == tgt.argmax(-1)).float())
            l1s.append((logits.softmax(-1) - tgt.softmax(-1)).abs().sum(-1))
            confs.append(conf)
    return torch.cat(acc), torch.cat(l1s), torch.cat(confs)


def calibrate(acc: torch.Tensor, conf: torch.Tensor) -> list[float]:
    grid = torch.exp(torch.linspace(math.log(0.1), math.log(10), 200))
    temps = []
    for k in range(acc.shape[1]):
        losses_k = [torch.nn.functional.binary_cross_entropy_with_logits(conf[:, k] / t, acc[:, k]).item() for t in grid]
        temps.append(float(grid[int(torch.tensor(losses_k).argmin())]))
    return temps


def greedy_continuations(model_dir: pathlib.Path, stream: torch.Tensor, count: int, prompt_len: int,
                         new_tokens: int) -> torch.Tensor:
    """[count, prompt_len + new_tokens]: prompts spread over `stream`, each followed by the target's
    own greedy continuation, which is what the drafter sees while serving greedy requests."""
    import os

    from deepinfer import LLM, SamplingParams

    os.environ["DEEPINFER_USE_NEXTN_DECODE"] = "0"
    llm = LLM(str(model_dir), max_num_seqs=min(count, 64))
    step = (len(stream) - prompt_len) // count
    prompts = [stream[i * step:i * step + prompt_len].tolist() for i in range(count)]
    outs = llm.generate(prompt_token_ids=prompts, use_tqdm=False,
                        sampling_params=SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True))
    llm.engine.close()
    return torch.tensor([p + o.outputs[0].token_ids for p, o in zip(prompts, outs)])


def evaluate_generated(drafter, params, target, seqs: torch.Tensor, prompt_len: int, per_seq: int, gen):
    """Teacher-forced blocks anchored inside the greedy continuations: per-slot acceptance and
    confidence logits."""
    acc, confs = [], []
    g = drafter.dcfg.block_size
    with torch.no_grad():
        for x in seqs.split(target.batch):
            if len(x) < target.batch:
                break
            tl, feats = target(x)
            pos = torch.randint(prompt_len, x.shape[1] - g - 1, (len(x), per_seq), generator=gen)
            anchors = torch.stack([torch.arange(len(x))[:, None].expand_as(pos).flatten(), pos.flatten()], dim=1)
            logits, conf = block_outputs(drafter, params, x, feats, anchors)
            acc.append((logits.argmax(-1) == targets_for(tl, anchors, g).argmax(-1)).float())
            confs.append(conf)
    return torch.cat(acc), torch.cat(confs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ROOT / "deepinfer" / "assets" / "tiny-dsv4"))
    ap.add_argument("--minutes", type=float, default=22.0, help="wall-clock training budget")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--anchors", type=int, default=48, help="anchor positions per sequence per step")
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--self-distill", type=int, default=256,
                    help="target greedy continuations of training prompts mixed into training (0 = corpus only)")
    ap.add_argument("--calibrate-only", action="store_true",
                    help="keep the drafter in --model, only refit the confidence temperatures")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model_dir = pathlib.Path(args.model)
    cfg, _ = load_config(model_dir)
    cfg.dspark = dict(DSPARK_KEYS)
    dcfg = DSparkConfig(DSPARK_KEYS["dspark_block_size"], DSPARK_KEYS["dspark_noise_token_id"],
                        tuple(DSPARK_KEYS["dspark_target_layer_ids"]), DSPARK_KEYS["dspark_markov_rank"], 1)
    t_start = time.time()
    train, held = token_streams(model_dir)
    print(f"train {len(train)} tokens, held-out {len(held)} tokens ({time.time() - t_start:.0f}s)", flush=True)
    target = Target(model_dir, dcfg.target_layer_ids, args.batch, args.seq_len)
    if args.calibrate_only:
        from safetensors.torch import load_file

        params = {k: torch.nn.Parameter(v.float()) for k, v in load_file(str(model_dir / "dspark.safetensors")).items()}
    else:
        params = {k: torch.nn.Parameter(v) for k, v in init_drafter(target, dcfg).items()}
    trainable = [v for k, v in params.items() if not k.endswith("temperature")]
    drafter = DSparkDrafter(cfg, dcfg, {k: v.detach() for k, v in params.items()}, target.model.w,
                            target.model.accel)
    opt = torch.optim.AdamW(trainable, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator().manual_seed(args.seed)
    it = batches(train, args.seq_len, args.batch, gen)
    if args.self_distill and not args.calibrate_only:
        # half the steps train on the target's own greedy continuations of training-split prompts:
        # while serving, the drafter continues the target's text, not the corpus
        quarter = args.seq_len // 4
        sd = greedy_continuations(model_dir, train, args.self_distill, quarter, args.seq_len - quarter)
        print(f"self-distillation: {len(sd)} greedy continuations ({time.time() - t_start:.0f}s)", flush=True)
        own = batches(sd.flatten(), args.seq_len, args.batch, gen)
        corpus = it
        it = (next(own) if i % 2 else next(corpus) for i in itertools.count())
    log, step, budget = [], 0, args.minutes * 60
    t0 = time.time()
    est_steps = None
    while not args.calibrate_only and time.time() - t0 < budget:
        x = next(it)
        with torch.no_grad():
            tl, feats = target(x)
        anchors = sample_anchors(gen, *x.shape, args.anchors, dcfg.block_size, drafter.window)
        logits, conf = block_outputs(drafter, params, x, feats, anchors)
        loss, l1, ce = losses(logits, conf, targets_for(tl, anchors, dcfg.block_size))
        # warmup 30 steps, then cosine to 10% over the estimated step count of the time budget
        elapsed = time.time() - t0
        if step == 20:
            est_steps = int(budget / (elapsed / 20))
        frac = min(1.0, step / est_steps) if est_steps else 0.0
        lr = args.lr * min(1.0, (step + 1) / 30) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for gparam in opt.param_groups:
            gparam["lr"] = lr
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        if step % 10 == 0:
            rec = dict(step=step, loss=round(loss.item(), 4), l1=[round(v, 3) for v in l1.mean(0).tolist()],
                       ce=round(ce.mean().item(), 3), lr=round(lr, 6), grad_norm=round(gn.item(), 3),
                       seconds=round(time.time() - t0, 1))
            log.append(rec)
            print(json.dumps(rec), flush=True)
        step += 1

    eval_gen = torch.Generator().manual_seed(1234)
    acc, l1, conf = evaluate(drafter, params, target, held, args.seq_len, args.batch, 32, eval_gen, 12)
    # calibrate on the target's own greedy continuations of held-out prompts: while serving, the
    # drafter continues the target's text, which is more predictable than held-out code
    half = args.seq_len // 2
    generated = greedy_continuations(model_dir, held, 4 * args.batch, half, args.seq_len - half)
    gen_acc, gen_conf = evaluate_generated(drafter, params, target, generated, half, 24, eval_gen)
    temps = calibrate(gen_acc, gen_conf)
    params["mtp.0.confidence_head.temperature"].data = torch.tensor(temps)
    cal = torch.sigmoid(gen_conf / torch.tensor(temps))
    # a draft counts only when every draft before it was accepted (greedy verification)
    chained = lambda a: round(torch.cumprod(a, dim=1).sum(1).mean().item(), 3)  # noqa: E731
    summary = dict(
        steps=step, minutes=round((time.time() - t0) / 60, 1), seq_len=args.seq_len, batch=args.batch,
        anchors_per_seq=args.anchors, lr=args.lr, dspark=DSPARK_KEYS, num_stages=1,
        heldout_blocks=int(acc.shape[0]),
        heldout_greedy_accept_per_slot=[round(v, 3) for v in acc.mean(0).tolist()],
        heldout_expected_accepted_len_of_5=chained(acc),
        heldout_l1_per_slot=[round(v, 3) for v in l1.mean(0).tolist()],
        generated_blocks=int(gen_acc.shape[0]),
        generated_greedy_accept_per_slot=[round(v, 3) for v in gen_acc.mean(0).tolist()],
        generated_expected_accepted_len_of_5=chained(gen_acc),
        calibration_temperature=[round(t, 3) for t in temps],
        calibrated_confidence_mean_per_slot=[round(v, 3) for v in cal.mean(0).tolist()],
        parameters=sum(v.numel() for v in params.values()),
    )
    if args.calibrate_only:  # keep the training run's record
        previous = json.loads((model_dir / "dspark_log.json").read_text())
        summary = {**previous["summary"], **{k: v for k, v in summary.items() if k not in
                                             ("steps", "minutes", "lr", "anchors_per_seq")}}
        log = previous["log"]
    print(json.dumps(summary), flush=True)
    from safetensors.torch import save_file

    save_file({k: v.detach().to(torch.bfloat16).contiguous() for k, v in params.items()},
              str(model_dir / "dspark.safetensors"), metadata={"format": "pt"})
    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text())
    config.update(DSPARK_KEYS)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (model_dir / "dspark_log.json").write_text(json.dumps({"summary": summary, "log": log}, indent=1) + "\n")


if __name__ == "__main__":
    main()
