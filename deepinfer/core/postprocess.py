"""Post-processing of a step on the host: the sampled tokens into each request's outputs (in place of
the placeholders planning left), top and prompt logprobs, text, and the one stop rule that single
steps and multi-step calls both apply token by token."""

from __future__ import annotations

import time

import torch

from deepinfer.core.request import Request
from deepinfer.core.sampler import top_logprobs


class PostProcessor:
    def __init__(self, eos_token_ids, max_model_len: int):
        self.eos_token_ids, self.max_model_len = eos_token_ids, max_model_len

    def step(self, plan, logits: torch.Tensor, tokens, structured) -> list[Request]:
        """The outputs of a planned step (core/engine.py StepPlan) whose forward gave `logits` and whose
        sampler (or verification) gave `tokens`. -> the requests that finished in it (to retire)."""
        cursor = 0
        for c, (start, n_rows, completes) in zip(plan.chunks, plan.prompt_rows):
            if n_rows:
                self.prompt_logprobs(c.request, start, logits[cursor:cursor + n_rows])
            cursor += n_rows + (1 if completes else 0)
        if not plan.sampling:
            return []
        # per sampling row: the tokens it produced (several when drafts were accepted)
        produced = tokens if isinstance(tokens, list) else [[t] for t in tokens.tolist()]
        logprobs = None
        if any(r.params.top_logprobs for r in plan.sampling):
            k = max(r.params.top_logprobs for r in plan.sampling)
            rows = [plan.sample_rows[i] + j for i, toks in enumerate(produced) for j in range(len(toks))]
            flat = torch.tensor([t for toks in produced for t in toks], dtype=torch.int64)
            logprobs = iter(top_logprobs(logits[rows], flat, k))
        finished = []
        for req, new_tokens in zip(plan.sampling, produced):
            if req.is_finished:  # aborted, or stopped by the previous step: these tokens are discarded
                continue
            # the oldest placeholder belongs to this step: steps are post-processed in order
            req.output_token_ids[len(req.output_token_ids) - req.pending] = new_tokens[0]
            req.pending -= 1
            req.num_computed += len(new_tokens) - 1  # accepted drafts were fed in this step
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = time.perf_counter()
            for i, token in enumerate(new_tokens):
                row_logprobs = next(logprobs) if logprobs is not None else None
                if req.is_finished:  # stopped by an earlier token of this step: the rest is discarded
                    continue
                if i:
                    req.output_token_ids.append(token)
                if req.output_logprobs is not None:
                    req.output_logprobs.append({t: v for j, (t, v) in enumerate(row_logprobs.items())
                                                if j <= req.params.top_logprobs})
                self.check_stop(req, token)
                if req.grammar is not None:  # structured outputs: advance the matcher, stop when it terminates
                    structured.accept(req, token)
            if req.is_finished:
                finished.append(req)
        return finished

    def multi_step(self, req: Request, start: int, new_tokens: list[int]) -> None:
        """A request's tokens from a multi-step call that fed positions start.. : kept up to the one
        that stops it (what followed is dropped, its state released with the request)."""
        req.num_computed = start + len(new_tokens)
        for j, token in enumerate(new_tokens):
            req.output_token_ids.append(token)
            self.check_stop(req, token)
            if req.is_finished:  # positions fed with tokens it keeps: start .. start + j
                req.num_computed = start + j + 1
                return

    def prompt_logprobs(self, req: Request, start: int, logits: torch.Tensor) -> None:
        if req.prompt_logprobs is None:
            req.prompt_logprobs = [None]
        recorded = len(req.prompt_logprobs) - (start + 1)  # rows recorded before a preemption
        if recorded >= logits.shape[0]:
            return
        if recorded > 0:
            start, logits = start + recorded, logits[recorded:]
        # positions a prefix-cache hit restored have no logits: their logprobs are None
        req.prompt_logprobs.extend([None] * (start + 1 - len(req.prompt_logprobs)))
        targets = torch.tensor(req.prompt_token_ids[start + 1:start + 1 + logits.shape[0]], dtype=torch.int64)
        req.prompt_logprobs.extend(top_logprobs(logits, targets, req.params.prompt_logprobs))

    def check_stop(self, req: Request, token: int) -> None:
        """The stop rule, for `token` just added to req's outputs: EOS (unless ignore_eos), a stop
        token, a stop string in the text (not before min_tokens), max_tokens or max_model_len."""
        params = req.params
        is_eos = token in self.eos_token_ids
        if req.detok is not None and not is_eos:
            req.text += req.detok.step(token)
        if is_eos and not params.ignore_eos:
            return req.finish("stop", token)
        if params.stop_token_ids and token in params.stop_token_ids:
            return req.finish("stop", token)
        resolved = len(req.output_token_ids) - req.pending
        for stop in params.stop_strings if resolved >= params.min_tokens else ():  # none before min_tokens
            # only the tail can hold a new match: the last token added at most len(token text) chars
            at = req.text.find(stop, max(0, len(req.text) - len(stop) - 64))
            if at >= 0:
                req.text = req.text[:at + len(stop)] if params.include_stop_str_in_output else req.text[:at]
                return req.finish("stop", stop)
        if resolved >= params.max_tokens or req.num_prompt_tokens + resolved >= self.max_model_len:
            return req.finish("length")
