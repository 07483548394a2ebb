"""DSpark speculative decoding as the engine sees it: which requests draft, how many tokens
each verifies, feeding the drafter's context, and verification.

A drafting step is: drafter block per decoding request (anchor = its newest token) ->
verify lengths -> one target forward over [anchor + drafts] per request (features of the
fed tokens go to the drafter's rings) -> acceptance -> the request advances by the accepted
drafts plus one target token. Rejected positions need no undo (core/cache.py: rings keep
DEEPINFER_MAX_BACKTRACKING_TOKENS of margin; stale rows are never read and get overwritten).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from deepinfer import envs
from deepinfer.backends.base import Accelerator
from deepinfer.core import logits as adjust
from deepinfer.core.model_runner import FeatureTap
from deepinfer.core.speculative.accept import GREEDY_BELOW, DRAFT_SALT, Block, accept, draw, salted, target_logprobs
from deepinfer.core.speculative.planner import VerifyLengthPlanner, cached_step_cost, profile_grid, time_call


@dataclass(slots=True)
class _ProfiledRequest:
    """What `_draft` reads of a request, for timing it at start-up (greedy, token 3 everywhere)."""

    slot: int
    num_computed: int
    params: object = None

    def token(self, position: int) -> int:
        return 3


@dataclass(slots=True)
class Draft:
    tokens: list[int]
    logprobs: torch.Tensor | None  # [L, V] the drafter's distribution of each draft (sampled requests)


class SpecDecoder:
    def __init__(self, model, drafter, accel: Accelerator, max_draft: int, margin: int):
        self.model, self.drafter, self.accel = model, drafter, accel
        self.max_draft, self.margin = max_draft, margin
        self.planner = VerifyLengthPlanner(max_draft, None)
        self.runner = None  # the engine's model runner (core/model_runner.py), given at start()
        # steps: request-steps that could draft (drafted or not); verified / accepted: draft tokens
        self.stats = {"steps": 0, "verified": 0, "accepted": 0}

    @classmethod
    def create(cls, model, extra: dict[str, torch.Tensor], accel: Accelerator,
               max_seqs: int) -> "SpecDecoder | None":
        """None when drafting is off (DEEPINFER_USE_NEXTN_DECODE=0, or unset on a backend whose
        `speculative_decoding` is False) or the checkpoint has no drafter: then nothing here runs and
        the cache keeps no rollback margin."""
        max_draft = envs.nextn_decode(default=5 if accel.speculative_decoding else 0)
        if not max_draft:
            return None
        margin = envs.max_backtracking_tokens()
        drafter = model.make_drafter(extra, max_seqs, margin)
        if drafter is None:
            return None
        return cls(model, drafter, accel, min(max_draft, drafter.dcfg.block_size), margin)

    # ------------------------------------------------------------ start-up
    def start(self, runner, max_step_tokens: int, cache_dir: str | None = None) -> None:
        """Build the verify-length policy; the dynamic one profiles step cost (or reads it).
        `runner` runs the drafting and verify steps (recorded and replayed like decode steps where it
        captures steps). The profile runs eagerly, before any step is captured: the online cost
        correction (observe_step) brings a captured engine's costs down to what it measures."""
        self.runner = runner
        if not envs.mtp_varlen():
            return
        cache = runner.cache
        per_seq = self.max_draft + 1
        # as many sequences as the cache can hold at once from position 0 (a small page pool holds
        # fewer than max_seqs: the profile must not ask for pages that do not exist)
        need = cache.pages_for(per_seq)
        fits = cache.max_seqs if need == 0 else min(cache.max_seqs, cache.num_free_pages // need)
        max_tokens = min(max_step_tokens, max(fits, 1) * per_seq)
        key = {"model": repr(self.model.config), "drafter": repr(self.drafter.dcfg),
               "backend": self.accel.kernel_signature(),
               "threads": torch.get_num_threads(), "tokens": max_tokens, "per_seq": per_seq,
               "dtype": str(cache.dtype), "version": 3}
        with runner.eager():
            cost = cached_step_cost(key, lambda: self._profile(cache, max_tokens, per_seq),
                                    envs.get("DEEPINFER_DECODE_PERF_CACHE_DIR") if cache_dir is None else cache_dir)
        self.planner = VerifyLengthPlanner(self.max_draft, cost)

    def _profile(self, cache, max_tokens: int, per_seq: int):
        """Seconds of a verify forward (logits and features for every token, the drafter's context
        written) for growing batches of sequences with up to `per_seq` tokens each, at a position
        where the window is full, and of drafting for those sequences (the block, the logits and
        the Markov/confidence loop: what a drafting step adds). Returns (tokens, seconds, seqs,
        drafter seconds)."""
        from deepinfer.models.base import StepInput
        from deepinfer.sampling_params import SamplingParams

        greedy = SamplingParams(temperature=0.0)

        tokens_grid, seconds, seqs_grid, drafter_seconds = [], [], [], []
        for tokens in profile_grid(max_tokens):
            seqs = min(-(-tokens // per_seq), cache.num_free_slots)
            lens = [tokens // seqs + (1 if i < tokens % seqs else 0) for i in range(seqs)]
            slots = [cache.allocate_slot() for _ in range(seqs)]
            try:
                start = self.model.replay_window  # a full window (if any), where the cache holds it
                if sum(cache.pages_for(start + n) for n in lens) > cache.num_free_pages:
                    start = 0
                for s, n in zip(slots, lens):
                    cache.grow(s, start + n)
                t = lambda xs: torch.tensor(xs, dtype=torch.int64, device=self.accel.device)  # noqa: E731
                inp = StepInput(t([3] * tokens), t(slots), t([start] * seqs), t(lens))
                rows = t(list(range(tokens)))
                seconds.append(time_call(lambda: self.runner.forward(inp, None, rows, self.tap(inp, rows.device)),
                                         repeats=3))
                tokens_grid.append(tokens)
                if seqs not in seqs_grid:
                    reqs = [_ProfiledRequest(s, start, greedy) for s in slots]
                    drafter_seconds.append(time_call(lambda: self._draft(reqs, per_seq - 1), repeats=3))
                    seqs_grid.append(seqs)
            finally:
                for s in slots:
                    cache.release(s)
        # more work never costs less: a dip is timing noise (e.g. another process on the cores)
        for ys in (seconds, drafter_seconds):
            for i in range(1, len(ys)):
                ys[i] = max(ys[i], ys[i - 1])
        return tokens_grid, seconds, seqs_grid, drafter_seconds

    # ------------------------------------------------------------ per step
    def tap(self, inp, device: torch.device) -> FeatureTap:
        """What every target step hands the drafter while drafting is on: the context features of
        the fed positions its rings keep (the last `ring` of every sequence), planned on the host:
        their count decides the step's shapes, so it is part of the bucket, never read in the step."""
        lens = inp.lens.cpu().numpy()
        starts = inp.starts.cpu().numpy()
        seq = np.repeat(np.arange(len(lens)), lens)
        positions = starts[seq] + np.arange(len(seq)) - (np.cumsum(lens) - lens)[seq]
        rows = np.flatnonzero(positions >= (starts + lens)[seq] - self.drafter.ring)
        rows, slots, positions = (torch.from_numpy(x).to(device) for x in
                                  (rows, inp.slots.cpu().numpy()[seq[rows]], positions[rows]))
        return FeatureTap(self.drafter.dcfg.target_layer_ids, rows, slots, positions, self.drafter.absorb)

    def wants_to_draft(self, running) -> bool:
        """Whether the next step drafts, which makes it synchronous. Fixed length: whenever a request
        runs. Dynamic: when the budget from lagged survivals is positive; a step that will not draft
        keeps zero-overhead scheduling (its anchors may still be placeholders)."""
        if not running:
            return False
        if self.planner.cost is None:
            return True
        return self.planner.budget([r.request_id for r in running], [self.max_draft] * len(running)) > 0

    def propose(self, chunks, token_budget: int, cache, max_model_len: int, allowed: bool = True) -> dict[str, Draft]:
        """Draft for every request whose chunk is its single newest token, within the step's
        token budget, the cache and each request's remaining max_tokens / max_model_len.
        `allowed` False (an overlapped step): count the request-steps, draft nothing."""
        decoding = [c.request for c in chunks if c.completes and c.num_tokens == 1 and not c.request.wants_prompt_logprobs]
        if not allowed:
            self.stats["steps"] += len(decoding)
            return {}
        reqs, caps = [], []
        for req in decoding:
            anchor_pos = req.num_computed
            cap = min(self.max_draft, req.params.max_tokens - len(req.output_token_ids) - 1,
                      max_model_len - anchor_pos - 2, max(token_budget, 0))
            while cap > 0 and not cache.can_grow(req.slot, anchor_pos + 1 + cap):
                cap -= 1
            if cap > 0:
                # pages for every position a draft may take, now: the next request's check must see them gone
                cache.grow(req.slot, anchor_pos + 1 + cap)
                reqs.append(req)
                caps.append(cap)
                token_budget -= cap
        ids = [r.request_id for r in reqs]
        self.stats["steps"] += len(reqs)
        budget = self.planner.budget(ids, caps)
        if not budget:  # nothing worth verifying: a plain decode step, the drafter does not run
            return {}
        drafts, logprobs, survival = self._draft(reqs, min(max(caps), budget))
        lengths = self.planner.lengths(ids, survival, [min(c, survival.shape[1]) for c in caps], budget)
        out = {}
        for i, (req, n) in enumerate(zip(reqs, lengths)):
            if n:
                lp = logprobs[i][:n] if logprobs[i] is not None else None
                out[req.request_id] = Draft(drafts[i][:n], lp)
        return out

    @torch.inference_mode()
    def _draft(self, reqs, depth: int):
        """Run the drafter block and choose `depth` drafts left to right (Markov head).
        Returns (drafts [B][depth], per request [depth, V] log-probs or None, survival [B, depth]).
        Recorded and replayed from the step graphs per (batch, depth, sampled rows)."""
        dev = self.accel.device
        t = lambda xs: torch.tensor(xs, dtype=torch.int64, device=dev)  # noqa: E731
        inputs = [t([r.token(r.num_computed) for r in reqs]), t([r.slot for r in reqs]),
                  t([r.num_computed for r in reqs])]
        sampled = [i for i, r in enumerate(reqs) if r.params.temperature >= GREEDY_BELOW]
        if sampled:  # their rows and sampling settings are step inputs too
            params = [reqs[i].params for i in sampled]
            inputs += [t(sampled), torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev),
                       t([p.top_k for p in params]), torch.tensor([p.top_p for p in params], device=dev),
                       salted(t([reqs[i].seed - (1 << 64) if reqs[i].seed >= 1 << 63 else reqs[i].seed
                                 for i in sampled]), DRAFT_SALT)]
        choose = lambda ins: self._choose(*ins[:3], depth, ins[3:] or None)  # noqa: E731
        out = self.runner.run_captured(("draft", depth), len(reqs), choose, inputs)
        chosen, survival = out[:2]
        per_req: list[torch.Tensor | None] = [None] * len(reqs)
        for j, i in enumerate(sampled):
            per_req[i] = out[2][j]
        return chosen.tolist(), per_req, survival

    def _choose(self, anchors, slots, anchor_pos, depth: int, sampling=None):
        """The drafter's block for anchors [B] at anchor_pos [B], then `depth` drafts chosen left to
        right, each conditioning the Markov head of the next: greedy, or for the rows of
        `sampling` (rows, temperature, top_k, top_p, seeds) drawn from the drafter's distribution.
        -> (drafts [B, depth], survival [B, depth]) (+ the sampled rows' log-probs [S, depth, V])."""
        d = self.drafter
        hidden = d.draft_block(anchors, slots, anchor_pos)
        base = d.logits(hidden[:, :depth].reshape(-1, hidden.shape[-1])).view(len(anchors), depth, -1)
        prev, conf, chosen, logps = anchors, [], [], []
        for k in range(depth):
            e, bias = d.markov(prev)
            logits = base[:, k] + bias
            conf.append(torch.sigmoid(d.confidence_logit(hidden[:, k], e, k)))
            token = logits.argmax(dim=-1)
            if sampling is not None:
                rows, temp, top_k, top_p, seeds = sampling
                lp = target_logprobs(logits[rows], temp, top_k, top_p)
                token[rows] = draw(self.accel, lp, seeds, anchor_pos[rows] + k + 1)
                logps.append(lp)
            chosen.append(token)
            prev = token
        out = torch.stack(chosen, dim=1), torch.cumprod(torch.stack(conf, dim=1), dim=1)
        return out if sampling is None else out + (torch.stack(logps, dim=1),)

    def verify(self, logits: torch.Tensor, plan, sampler, structured) -> list[list[int]]:
        """Tokens each sampling request of `plan` produced: drafted requests through acceptance,
        the others through the ordinary sampler (one row each)."""
        temp, top_k, top_p, seeds, positions = plan.sampling_inputs
        out: list[list[int]] = [[] for _ in plan.sampling]
        sampler.prepare(plan.adjust)
        plain = [i for i, dr in enumerate(plan.drafts) if dr is None]
        if plain:
            rows = logits[[plan.sample_rows[i] for i in plain]]
            reqs = [plan.sampling[i] for i in plain]
            if structured is not None and any(r.grammar is not None for r in reqs):
                structured.apply_bitmask(rows, reqs)
            idx = torch.tensor(plain, device=temp.device)
            tokens = sampler.sample(rows, (temp[idx], top_k[idx], top_p[idx], seeds[idx], positions[idx]),
                                    None if plan.adjust is None else plan.adjust.select(idx))
            for i, tok in zip(plain, tokens.tolist()):
                out[i] = [tok]
        blocks, where = [], []
        for i, (req, dr) in enumerate(zip(plan.sampling, plan.drafts)):
            if dr is None:
                continue
            first = plan.sample_rows[i]
            target = logits[first:first + len(dr.tokens) + 1]
            if req.grammar is not None:  # one bitmask row per draft position (+ the bonus row)
                target = target.clone()  # logprobs report the unmasked distribution
                bitmask = structured.xgr.allocate_token_bitmask(len(dr.tokens) + 1, logits.shape[-1])
                req.grammar.fill_bitmask_rows(dr.tokens, bitmask)
                self.accel.apply_token_bitmask(target, bitmask.to(target.device))
            p = req.params
            if p.adjusts_logits:  # verify against the distribution a plain step would sample from
                target = self._adjusted_target(target, req, dr.tokens, int(positions[i]), sampler)
            blocks.append(Block(target, dr.tokens, dr.logprobs, p.temperature, p.top_k, p.top_p, seeds[i],
                                int(positions[i]) - 1))
            where.append(i)
        for i, tokens, b in zip(where, accept(self.accel, blocks), blocks):
            out[i] = tokens
            row = sampler.counts.rows.get(plan.sampling[i].request_id)
            if row is not None:  # the accepted tokens join the request's penalty counts
                dev = sampler.counts.counts.device
                self.accel.count_tokens(sampler.counts.counts, torch.full((len(tokens),), row, device=dev),
                                        torch.tensor(tokens, dtype=torch.int64, device=dev))
            self.stats["verified"] += len(b.drafts)
            self.stats["accepted"] += len(tokens) - 1
            survival = self.planner.lagged.get(plan.sampling[i].request_id)
            if survival is not None:
                self.planner.observe_acceptance(sum(survival[:len(b.drafts)]), len(tokens) - 1)
        return out

    def _adjusted_target(self, target: torch.Tensor, req, drafts: list[int], position: int, sampler) -> torch.Tensor:
        """SamplingParams' adjustments of a drafted request's target rows: row j as a plain step would
        adjust it after drafts[:j] were accepted (its bans, min_tokens and penalty counts)."""
        n_out = position - req.num_prompt_tokens
        history = req.output_token_ids[:n_out] if req.bad_words_ids else []
        rows = [(req, n_out + j, history + drafts[:j]) for j in range(len(drafts) + 1)]
        adj = adjust.plan(rows, None, sampler.vocab, sampler.eos_token_ids, target.device)
        counts = prompt = None
        if adj.penalty is not None:
            row = sampler.counts.rows[req.request_id]
            counts, prompt = adjust.draft_pools(sampler.counts.counts[row], sampler.counts.prompt[row], drafts,
                                                self.accel)
        return adjust.apply(self.accel, target, adj, counts, prompt)

    def observe_step(self, plan, seconds: float) -> None:
        """A finished synchronous step's wall time, for the planner's online cost correction
        (decode steps only: the profile does not model prefill)."""
        if plan.prefill_tokens or not plan.sampling:
            return
        drafted = any(d is not None for d in plan.drafts)
        self.planner.observe_step(drafted, plan.decode_tokens, len(plan.sampling), seconds)

    def forget(self, request_id: str) -> None:
        self.planner.forget(request_id)
