#!/usr/bin/env python
"""Train the tiny DeepSeek-V4 model shipped in ``deepinfer/assets/tiny-dsv4``.

One script, end to end and deterministic:

1. corpus   -- every ``*.py`` of the running interpreter's standard library
               (``sysconfig.get_paths()["stdlib"]``), minus ``site-packages``,
               ``idlelib`` and test suites (any ``test``/``tests`` directory).
               Files are sorted by relative path; a file is held out when
               ``int(sha1(relpath)[:8], 16) % 100 < 2`` (~2 %).
2. tokenizer -- byte-level BPE (``tokenizers``) trained on the training split
               only, vocab 8192, specials ``<|bos|>``=0 ``<|eos|>``=1
               ``<|pad|>``=2. ``tokenizer(text)`` prepends ``<|bos|>``.
               Each file is a document: bos + tokens + eos.
3. model    -- ``DeepseekV4ForCausalLM`` from a small ``DeepseekV4Config`` that
               keeps every V4 feature (sliding / CSA(4) / HCA(128) layers, hash
               MoE then sqrtsoftplus top-k MoE, shared expert, mHC, sinks,
               grouped low-rank output, Lightning Indexer, YaRN compress rope).
               ``tid2eid`` of hash layers is a seeded random table (distinct
               experts per token), frozen.
4. training -- AdamW + warmup/cosine, grad clip 1.0, packed sequences of 512
               (a final phase at 1024), fp32 on CPU, one thread. The top-k
               routers' ``e_score_correction_bias`` is updated with DeepSeek's
               auxiliary-loss-free balancing rule (bias += u * sign(mean load -
               load)) after every step.
5. output   -- bf16 safetensors via ``save_pretrained``, tokenizer files,
               generation_config.json, train_log.json; the saved directory is
               reloaded and its held-out loss re-measured.

Reproduce the shipped model:
    python tools/train_tiny.py --out deepinfer/assets/tiny-dsv4 --steps <N>
(the README in the asset directory records the exact command and numbers).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import pathlib
import platform
import sys
import sysconfig
import time

import torch

SPECIALS = ["<|bos|>", "<|eos|>", "<|pad|>"]
BOS, EOS, PAD = 0, 1, 2


# --------------------------------------------------------------------------- corpus
def collect_corpus(heldout_pct: int = 2):
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    train, held = [], []
    for p in sorted(root.rglob("*.py"), key=lambda q: q.relative_to(root).as_posix()):
        rel = p.relative_to(root)
        parts = rel.parts
        if parts[0] in ("site-packages", "dist-packages", "idlelib"):
            continue
        if any(x in ("test", "tests") for x in parts[:-1]):
            continue
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not text.strip():
            continue
        relp = rel.as_posix()
        h = int(hashlib.sha1(relp.encode()).hexdigest()[:8], 16)
        (held if h % 100 < heldout_pct else train).append((relp, text))
    return root, train, held


# ------------------------------------------------------------------------ tokenizer
def train_tokenizer(texts, vocab_size: int, out_dir: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    assert [tok.token_to_id(s) for s in SPECIALS] == [BOS, EOS, PAD]
    tok.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B", special_tokens=[("<|bos|>", BOS)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )
    fast.save_pretrained(out_dir)
    return tok


def encode_docs(tok, texts):
    ids = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.append(BOS)
        ids.extend(enc.ids)
        ids.append(EOS)
    return torch.tensor(ids, dtype=torch.int32)


# ---------------------------------------------------------------------------- model
def make_config(vocab_size: int):
    from transformers import DeepseekV4Config

    layer_types = [
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "sliding_attention",
    ]
    return DeepseekV4Config(
        vocab_size=vocab_size,
        hidden_size=256,
        num_hidden_layers=len(layer_types),
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=64,
        qk_rope_head_dim=16,
        q_lora_rank=128,
        o_groups=2,
        o_lora_rank=64,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=256,
        scoring_func="sqrtsoftplus",
        routed_scaling_factor=1.5,
        layer_types=layer_types,
        mlp_layer_types=["hash_moe", "hash_moe"] + ["moe"] * (len(layer_types) - 2),
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
        sliding_window=128,
        index_n_heads=4,
        index_head_dim=32,
        index_topk=16,
        hc_mult=4,
        hc_sinkhorn_iters=20,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        compress_rope_theta=160000.0,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 512,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        num_nextn_predict_layers=0,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=PAD,
        tie_word_embeddings=False,
        initializer_range=0.02,
        use_cache=True,
    )


def set_hash_tables(model, seed: int):
    """Seeded random tid2eid: each token gets top_k distinct experts (per hash layer)."""
    g = torch.Generator().manual_seed(seed)
    for name, mod in model.named_modules():
        if hasattr(mod, "tid2eid"):
            v, k = mod.tid2eid.shape
            n_exp = mod.num_experts
            table = torch.rand(v, n_exp, generator=g).argsort(dim=-1)[:, :k]
            mod.tid2eid.copy_(table.to(mod.tid2eid.dtype))


class BiasBalancer:
    """DeepSeek auxiliary-loss-free load balancing on e_score_correction_bias."""

    def __init__(self, model, rate: float):
        self.rate = rate
        self.routers = [m for m in model.modules() if hasattr(m, "e_score_correction_bias")]
        self.counts = [torch.zeros(r.num_experts) for r in self.routers]
        self.enabled = True
        for i, r in enumerate(self.routers):
            r.register_forward_hook(self._hook(i))

    def _hook(self, i):
        def fn(mod, inp, out):
            if self.enabled:
                idx = out[2].detach().reshape(-1)
                self.counts[i] += torch.bincount(idx, minlength=mod.num_experts).float()

        return fn

    @torch.no_grad()
    def step(self):
        imb = []
        for r, c in zip(self.routers, self.counts):
            if c.sum() > 0:
                r.e_score_correction_bias.add_(self.rate * torch.sign(c.mean() - c))
                imb.append((c.max() / c.mean()).item())
            c.zero_()
        return max(imb) if imb else 1.0


# ----------------------------------------------------------------------------- eval
@torch.no_grad()
def hf_logits(model, x: torch.Tensor) -> torch.Tensor:
    return model(input_ids=x, use_cache=False).logits


def heldout_nll(model, stream: torch.Tensor, seq_len: int, batch: int = 4, logits_of=hf_logits):
    """Sum of NLL (nats) and count over next-token targets of non-overlapping chunks;
    `logits_of(model, ids [B, L])` runs the model (transformers' by default)."""
    model.eval()
    n_chunks = max(1, (len(stream) - 1) // seq_len)
    chunks = [stream[i * seq_len : (i + 1) * seq_len].long() for i in range(n_chunks)]
    tot, cnt = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(chunks), batch):
            group = chunks[i : i + batch]
            L = min(len(c) for c in group)
            x = torch.stack([c[:L] for c in group])
            lp = torch.log_softmax(logits_of(model, x).float()[:, :-1], dim=-1)
            nll = -lp.gather(-1, x[:, 1:, None]).squeeze(-1)
            tot += nll.sum().item()
            cnt += nll.numel()
    model.train()
    return tot, cnt


def eval_targets(stream: torch.Tensor, seq_len: int):
    n_chunks = max(1, (len(stream) - 1) // seq_len)
    return torch.cat([stream[i * seq_len + 1 : (i + 1) * seq_len] for i in range(n_chunks)]).long()


def unigram_ppl(train_stream, targets, vocab):
    counts = torch.bincount(train_stream[1:].long(), minlength=vocab).double() + 1.0  # add-one
    logp = torch.log(counts / counts.sum())
    return math.exp(-logp[targets].mean().item())


# ---------------------------------------------------------------------------- train
def lr_at(step, total, peak, warmup, floor):
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return floor + 0.5 * (peak - floor) * (1 + math.cos(math.pi * min(1.0, t)))


def run_options(ap: argparse.ArgumentParser) -> None:
    """The options every tiny trainer takes besides its model's and schedule's."""
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--eval-seq-len", type=int, default=512)


def start_run(args: argparse.Namespace) -> tuple[pathlib.Path, float]:
    """200 steps unless --steps or --minutes say otherwise, the thread count and the seed set, the
    output folder made: (that folder, the start time)."""
    if args.steps is None and args.minutes is None:
        args.steps = 200
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    return out, time.time()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="deepinfer/assets/tiny-dsv4")
    ap.add_argument("--steps", type=int, default=None, help="total optimizer steps (overrides --minutes)")
    ap.add_argument("--minutes", type=float, default=None, help="estimate --steps from a timed probe")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--long-seq-len", type=int, default=1024, help="sequence length of the final phase")
    ap.add_argument("--long-frac", type=float, default=0.1, help="fraction of steps at --long-seq-len")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--bias-rate", type=float, default=1e-3)
    run_options(ap)
    args = ap.parse_args()
    out, t_start = start_run(args)

    from transformers import DeepseekV4ForCausalLM

    # corpus + tokenizer
    root, train_docs, held_docs = collect_corpus()
    print(f"corpus: {root} train {len(train_docs)} files, held-out {len(held_docs)} files", flush=True)
    tok = train_tokenizer([t for _, t in train_docs], args.vocab, str(out))
    train_stream = encode_docs(tok, [t for _, t in train_docs])
    held_stream = encode_docs(tok, [t for _, t in held_docs])
    print(
        f"tokenizer: vocab {tok.get_vocab_size()}; train {len(train_stream)} tokens, held-out {len(held_stream)} tokens"
        f" ({time.time() - t_start:.0f}s)",
        flush=True,
    )
    targets = eval_targets(held_stream, args.eval_seq_len)
    uni_ppl = unigram_ppl(train_stream, targets, args.vocab)
    print(f"unigram (add-one) held-out ppl: {uni_ppl:.2f}", flush=True)

    # model
    config = make_config(args.vocab)
    torch.manual_seed(args.seed)
    model = DeepseekV4ForCausalLM(config).float()
    with torch.no_grad():
        set_hash_tables(model, args.seed + 1)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M params", flush=True)
    balancer = BiasBalancer(model, args.bias_rate)

    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (decay if p.ndim >= 2 and "embed" not in n else no_decay).append(p)
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.wd}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )

    # data order: chunks of seq_len+0 tokens from the packed stream, a seeded permutation per epoch
    data_gen = torch.Generator().manual_seed(args.seed + 2)

    def batches(seq_len, batch):
        n = len(train_stream) // seq_len
        epoch = 0
        while True:
            perm = torch.randperm(n, generator=data_gen)
            for i in range(0, n - batch + 1, batch):
                idx = perm[i : i + batch]
                yield torch.stack([train_stream[j * seq_len : (j + 1) * seq_len] for j in idx.tolist()]).long(), epoch
            epoch += 1

    def train_step(x, lr):
        for gparam in opt.param_groups:
            gparam["lr"] = lr
        loss = model(input_ids=x, labels=x, use_cache=False).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        imb = balancer.step()
        return loss.item(), gn.item(), imb

    short_iter = batches(args.seq_len, args.batch)
    long_batch = max(1, args.batch * args.seq_len // args.long_seq_len)
    long_iter = batches(args.long_seq_len, long_batch)

    total = args.steps
    log = []
    step = 0
    tokens_seen = 0
    t_train = time.time()
    probe_done = total is not None
    if total is None:
        total = 10**9  # placeholder until the probe has run
    n_long = 0
    while step < total:
        if not probe_done and step == 10:
            # timed probe: 10 short steps measured, long steps cost ~ the same tokens so ~same time
            # (eager attention scores the full [L, L] matrix; measured ~1.35x per step at 1024 x 4)
            per_step = (time.time() - t_probe) / 8
            budget = args.minutes * 60 - (time.time() - t_start) - 240  # keep 4 min for eval + save
            total = max(20, int(budget / (per_step * (1 + 0.35 * args.long_frac))))
            probe_done = True
            print(f"probe: {per_step:.2f}s/step -> total steps {total}", flush=True)
        if step == 2:
            t_probe = time.time()
        n_long = int(total * args.long_frac) if args.long_seq_len > args.seq_len else 0
        long_phase = step >= total - n_long
        x, epoch = next(long_iter if long_phase else short_iter)
        lr = lr_at(step, total, args.lr, args.warmup, args.lr * args.min_lr_frac)
        loss, gn, imb = train_step(x, lr)
        tokens_seen += x.numel()
        step += 1
        if not math.isfinite(loss):
            raise SystemExit(f"non-finite loss at step {step}")
        if step % args.log_every == 0 or step == 1 or step == total:
            el = time.time() - t_train
            rec = dict(step=step, loss=round(loss, 4), lr=lr, grad_norm=round(gn, 3), max_load_ratio=round(imb, 3),
                       seq_len=x.shape[1], tokens=tokens_seen, epoch=epoch, elapsed_s=round(el, 1))
            log.append(rec)
            print(json.dumps(rec), flush=True)
            with open(out / "train_log.json", "w") as f:
                json.dump({"log": log}, f)
    train_time = time.time() - t_train
    balancer.enabled = False

    # evaluation (fp32 master weights)
    tot, cnt = heldout_nll(model, held_stream, args.eval_seq_len)
    loss_fp32 = tot / cnt
    print(f"held-out fp32: loss {loss_fp32:.4f} ppl {math.exp(loss_fp32):.2f} over {cnt} tokens", flush=True)

    # save bf16
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.generation_config.bos_token_id = BOS
    model.generation_config.eos_token_id = EOS
    model.generation_config.pad_token_id = PAD
    model.generation_config.do_sample = False
    model.save_pretrained(str(out), safe_serialization=True)

    # reload check
    re = DeepseekV4ForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    for a, b in zip(re.modules(), model.modules()):
        if hasattr(a, "tid2eid"):
            assert torch.equal(a.tid2eid, b.tid2eid), "tid2eid did not round-trip"
    tot_r, cnt_r = heldout_nll(re, held_stream, args.eval_seq_len)
    loss_bf16 = tot_r / cnt_r
    print(f"held-out reloaded bf16 weights: loss {loss_bf16:.4f} ppl {math.exp(loss_bf16):.2f}", flush=True)
    biases = [r.e_score_correction_bias.tolist() for r in balancer.routers]

    size = os.path.getsize(out / "model.safetensors")
    summary = dict(
        command="python " + " ".join([sys.argv[0]] + [a for a in sys.argv[1:]]),
        steps=total,
        long_phase_steps=n_long,
        tokens_seen=tokens_seen,
        train_tokens=int(len(train_stream)),
        heldout_tokens_scored=cnt,
        train_files=len(train_docs),
        heldout_files=[p for p, _ in held_docs],
        final_train_loss=log[-1]["loss"],
        heldout_loss_fp32=loss_fp32,
        heldout_ppl_fp32=math.exp(loss_fp32),
        heldout_loss_bf16_reload=loss_bf16,
        heldout_ppl_bf16_reload=math.exp(loss_bf16),
        unigram_ppl=uni_ppl,
        params=n_params,
        safetensors_bytes=size,
        train_wall_s=round(train_time, 1),
        total_wall_s=round(time.time() - t_start, 1),
        e_score_correction_bias=biases,
        env=dict(python=platform.python_version(), torch=torch.__version__,
                 transformers=__import__("transformers").__version__,
                 tokenizers=__import__("tokenizers").__version__, stdlib=str(root), threads=args.threads),
        args=vars(args),
    )
    with open(out / "train_log.json", "w") as f:
        json.dump({"summary": summary, "log": log}, f, indent=1)
    print(json.dumps({k: v for k, v in summary.items() if k not in ("heldout_files", "e_score_correction_bias")}),
          flush=True)


if __name__ == "__main__":
    main()
