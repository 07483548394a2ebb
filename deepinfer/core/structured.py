"""Structured outputs: grammar compilation (xgrammar) in a thread pool, and per-request
matcher state that yields token bitmasks.

A request with `so_args` waits here, outside the scheduler, until its grammar is compiled;
the batch keeps running. A compile that exceeds DEEPINFER_XGRAMMAR_TIMEOUT, or fails, ends
that request alone with finish_reason "abort" and an error. Per step the engine asks for one
bitmask row per sampled request (`apply_bitmask`) and reports the sampled token (`accept`).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import re
import time
from collections import OrderedDict
from typing import TYPE_CHECKING

import torch

from deepinfer import envs

if TYPE_CHECKING:
    from deepinfer.backends.base import Accelerator
    from deepinfer.core.request import Request
    from deepinfer.core.scheduler import Scheduler
    from deepinfer.core.tokenizer import Tokenizer

_BATCH_FILL_MIN = 8  # from this many grammar-phase rows on, fill them with xgrammar's threaded batch fill
_CHECK_WAIT_S = 0.1  # how long a submit waits for a compile error before deferring it to the request
FREE, FORCING, GRAMMAR, DONE = range(4)  # RequestGrammar phases


def _xgr():
    try:
        import xgrammar
    except ImportError as exc:  # pragma: no cover - xgrammar is a dependency
        raise ImportError("structured outputs (so_args) need xgrammar: pip install xgrammar==0.2.8") from exc
    return xgrammar


def _describe(exc: BaseException) -> str:
    """xgrammar's message without its '[time] path/file.cc:line: ' prefix."""
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(exc).strip())


def spec_key(so_args: dict) -> tuple[str, str]:
    """(schema_type, schema text): the compile cache key. Dict schemas keep their key order,
    which is the property order of the generated JSON."""
    schema = so_args["schema"]
    if so_args["schema_type"] == "json" and not isinstance(schema, str):
        try:
            schema = json.dumps(schema)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"so_args['schema'] cannot be serialized as JSON: {exc}") from None
    return so_args["schema_type"], schema


def build_tokenizer_info(tokenizer: Tokenizer, vocab_size: int, stop_token_ids: list[int]):
    """xgrammar's view of the vocabulary, sized to the MODEL's vocab (ids past the tokenizer's
    are never allowed). Special added tokens (bos, placeholders, ...) are given empty text so the
    grammar never emits them: they would vanish from the detokenized output. Built from the
    `tokenizers` object directly: `from_huggingface` keeps special tokens as literal text."""
    xgr = _xgr()
    tok = tokenizer._tok
    specials = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    encoded = [""] * vocab_size
    for text, idx in tok.get_vocab(with_added_tokens=True).items():
        if idx < vocab_size and idx not in specials:
            encoded[idx] = text
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(tok.to_str())
    return xgr.TokenizerInfo(encoded, meta["vocab_type"], vocab_size=vocab_size,
                             stop_token_ids=list(stop_token_ids), add_prefix_space=meta["add_prefix_space"])


class RequestGrammar:
    """One request's constraint: free text until the trigger (if any), the trigger forced once the
    bound token appears, then the grammar until the matcher terminates. Every accepted token is
    recorded so any suffix can be rolled back (speculative decoding)."""

    __slots__ = ("matcher", "trigger", "bound", "phase", "forced", "tokens", "_history")

    def __init__(self, matcher, trigger: list[int] | None = None, bound: int | None = None):
        self.matcher = matcher
        self.trigger = tuple(trigger or ())
        self.bound = bound
        self.phase = FREE if self.trigger else GRAMMAR
        self.forced = 0  # trigger tokens already in place while FORCING
        self.tokens: list[int] = []
        self._history: list[tuple[int, int, bool]] = []  # per token: (phase, forced, matcher advanced)

    @property
    def is_terminated(self) -> bool:
        return self.phase == DONE

    def fill_row(self, bitmask: torch.Tensor, index: int) -> bool:
        """Write the next-token mask into bitmask[index] (CPU int32); False: the row is unconstrained
        and was left untouched."""
        if self.phase == GRAMMAR:
            return bool(self.matcher.fill_next_token_bitmask(bitmask, index))
        if self.phase == FORCING:
            token = self.trigger[self.forced]
            bit = 1 << (token & 31)
            bitmask[index].zero_()
            bitmask[index, token >> 5] = bit - (1 << 32) if bit >= 1 << 31 else bit
            return True
        return False  # FREE: anything goes; DONE: never fill after termination

    def accept(self, token: int) -> bool:
        """Advance by one sampled token; False if the constraint forbids it (state unchanged)."""
        record = (self.phase, self.forced, False)
        if self.phase == FREE:
            self.tokens.append(token)
            n = len(self.trigger)
            if tuple(self.tokens[-n:]) == self.trigger:
                self.phase = GRAMMAR
            elif token == self.bound:
                # force the rest of the trigger, continuing any prefix of it already produced
                k = next((k for k in range(n - 1, 0, -1) if tuple(self.tokens[-k:]) == self.trigger[:k]), 0)
                self.phase, self.forced = FORCING, k
        elif self.phase == FORCING:
            if token != self.trigger[self.forced]:
                return False
            self.tokens.append(token)
            self.forced += 1
            if self.forced == len(self.trigger):
                self.phase = GRAMMAR
        elif self.phase == GRAMMAR:
            if not self.matcher.accept_token(token):
                return False
            self.tokens.append(token)
            record = (GRAMMAR, self.forced, True)
            if self.matcher.is_terminated():
                self.phase = DONE
        else:
            return False
        self._history.append(record)
        return True

    def rollback(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        if num_tokens > len(self._history):
            raise ValueError(f"cannot roll back {num_tokens} tokens, only {len(self._history)} accepted")
        popped = self._history[-num_tokens:]
        del self._history[-num_tokens:]
        del self.tokens[-num_tokens:]
        matcher_steps = sum(advanced for _, _, advanced in popped)
        if matcher_steps:
            self.matcher.rollback(matcher_steps)
        self.phase, self.forced, _ = popped[0]

    def fill_bitmask_rows(self, tokens_to_check: list[int], bitmask: torch.Tensor, start: int = 0) -> int:
        """Speculative decoding: rows start..start+len(tokens_to_check) of `bitmask` get the masks
        for the next token after each prefix of the drafts (row i: after tokens_to_check[:i]).
        Rows past an invalid draft or past termination are left all-allowed (the verifier stops
        at the invalid draft, whose own row excludes it). The state is rolled back afterwards.
        Returns how many drafts the constraint accepts."""
        bitmask[start:start + len(tokens_to_check) + 1].fill_(-1)
        accepted = 0
        for i in range(len(tokens_to_check) + 1):
            if self.phase == DONE:
                break
            self.fill_row(bitmask, start + i)
            if i == len(tokens_to_check) or not self.accept(tokens_to_check[i]):
                break
            accepted += 1
        self.rollback(accepted)
        return accepted


class StructuredOutputs:
    """Compile service for one model: TokenizerInfo, GrammarCompiler (+ cache), a thread pool,
    the requests waiting for their grammar, and the bitmask buffer."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, stop_token_ids: list[int],
                 accel: Accelerator, max_workers: int = 2):
        if tokenizer is None:
            raise ValueError("so_args needs a tokenizer (the model directory has no tokenizer.json): "
                             "pass tokenizer=... to LLM")
        xgr = _xgr()
        self.xgr = xgr
        self.accel = accel
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.tokenizer_info = build_tokenizer_info(tokenizer, vocab_size, stop_token_ids)
        self.cache_enabled = not envs.get("DEEPINFER_XGRAMMAR_DISABLE_CACHE")
        threads = max(1, min(8, (os.cpu_count() or 2) // 2))  # leave cores to the engine's own work
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=threads,
                                            cache_enabled=self.cache_enabled,
                                            cache_limit_bytes=envs.get("DEEPINFER_XGRAMMAR_CACHE_LIMIT_BYTES"))
        self.pool = cf.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="deepinfer-grammar")
        self._jobs: OrderedDict[tuple[str, str], cf.Future] = OrderedDict()  # in flight + recent
        self.pending: list[tuple[Request, cf.Future, float, float]] = []  # (req, job, deadline, timeout)
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self._batch_matcher = xgr.BatchGrammarMatcher(threads)

    # ------------------------------------------------------------ compile
    def _compile(self, schema_type: str, schema: str):
        if schema_type == "json":
            return self.compiler.compile_json_schema(schema, any_whitespace=False, strict_mode=True)
        if schema_type == "regex":
            return self.compiler.compile_regex(schema)
        return self.compiler.compile_grammar(schema)

    def _job(self, so_args: dict) -> tuple[cf.Future, bool]:
        """(the compile job for these so_args, whether it was started just now)"""
        key = spec_key(so_args)
        job = self._jobs.get(key)
        new = job is None or (job.done() and not self.cache_enabled)
        if new:
            job = self.pool.submit(self._compile, *key)
            self._jobs[key] = job
        self._jobs.move_to_end(key)
        while len(self._jobs) > 64:
            oldest_key, oldest = next(iter(self._jobs.items()))
            if not oldest.done():
                break
            del self._jobs[oldest_key]
        return job, new

    def check(self, so_args: dict) -> None:
        """Start compiling and reject at submit what fails fast (syntax errors, unsupported schema
        features, out-of-range token ids). A compile still running after a short wait is judged
        later: if it fails then, only its request ends, with the error."""
        for t in list(so_args.get("trigger_token_ids") or ()) + [so_args.get("bound_token_id") or 0]:
            if t >= self.vocab_size:
                raise ValueError(f"so_args token id {t} is outside the vocabulary [0, {self.vocab_size})")
        job, new = self._job(so_args)
        if new:
            cf.wait([job], timeout=_CHECK_WAIT_S)
        if job.done() and job.exception() is not None:
            self._jobs.pop(spec_key(so_args), None)
            raise ValueError(f"so_args {so_args['schema_type']} grammar is invalid: {_describe(job.exception())}")

    def submit(self, req: Request) -> None:
        timeout = float(envs.get("DEEPINFER_XGRAMMAR_TIMEOUT"))
        self.pending.append((req, self._job(req.params.so_args)[0], time.perf_counter() + timeout, timeout))

    def has_pending(self) -> bool:
        return bool(self.pending)

    def discard(self, req: Request) -> None:
        self.pending = [p for p in self.pending if p[0] is not req]

    def poll(self, scheduler: Scheduler, block: bool = False) -> list[Request]:
        """Hand requests whose grammar is ready to the scheduler (in arrival order); finish those
        whose compile failed or timed out. block: wait for the next compile or deadline first (the
        scheduler has nothing else to do). Returns the requests finished here."""
        if block and self.pending:
            wait = min(d for _, _, d, _ in self.pending) - time.perf_counter()
            cf.wait([j for _, j, _, _ in self.pending], timeout=max(0.0, wait), return_when=cf.FIRST_COMPLETED)
        now = time.perf_counter()
        failed, still = [], []
        for req, job, deadline, timeout in self.pending:
            if job.done():
                if job.exception() is not None:
                    req.finish("abort", error=f"grammar failed to compile: {_describe(job.exception())}")
                    failed.append(req)
                    continue
                so = req.params.so_args
                req.grammar = RequestGrammar(self.xgr.GrammarMatcher(job.result()), so.get("trigger_token_ids"),
                                             so.get("bound_token_id"))
                scheduler.add(req)
            elif now >= deadline:
                req.finish("abort", error=f"grammar compile did not finish within {timeout:g} s "
                                          "(DEEPINFER_XGRAMMAR_TIMEOUT); simplify the schema or raise the timeout")
                failed.append(req)
            else:
                still.append((req, job, deadline, timeout))
        self.pending = still
        return failed

    # ------------------------------------------------------------ per step
    def fill_bitmask(self, requests: list) -> tuple[torch.Tensor, bool] | None:
        """CPU bitmask with row i for requests[i] (all-allowed for unconstrained rows), and whether
        any row constrains; None when no request has a grammar. Matchers in the grammar phase are
        filled in parallel by xgrammar's batch matcher once there are a few of them."""
        constrained = [(i, r.grammar) for i, r in enumerate(requests) if r.grammar is not None]
        if not constrained:
            return None
        if self._bitmask.shape[0] < len(requests):
            self._bitmask = self.xgr.allocate_token_bitmask(len(requests), self.vocab_size)
        bitmask = self._bitmask[:len(requests)]
        bitmask.fill_(-1)
        in_grammar = [(i, g.matcher) for i, g in constrained if g.phase == GRAMMAR]
        batched = len(in_grammar) >= _BATCH_FILL_MIN
        if batched:
            self._batch_matcher.batch_fill_next_token_bitmask([m for _, m in in_grammar], bitmask,
                                                              [i for i, _ in in_grammar])
        need = batched
        for i, grammar in constrained:
            if not (batched and grammar.phase == GRAMMAR):
                need |= grammar.fill_row(bitmask, i)
        return bitmask, need

    def apply_bitmask(self, logits: torch.Tensor, requests: list[Request]) -> None:
        """Mask logits rows (row i samples requests[i]) in place for the constrained requests."""
        filled = self.fill_bitmask(requests)
        if filled is not None and filled[1]:
            self.accel.apply_token_bitmask(logits, filled[0].to(logits.device, non_blocking=True))

    def accept(self, req: Request, token: int) -> None:
        """Advance the request's grammar by its sampled token; finish it when the grammar is complete
        (or, which masking prevents, when the token is rejected)."""
        grammar = req.grammar
        if req.is_finished or grammar is None:
            return
        if not grammar.accept(token):
            req.finish("abort", error=f"token {token} was rejected by the so_args grammar")
        elif grammar.is_terminated:
            req.finish("stop", token)
