"""Offline API: `LLM(model=...).generate(prompts, sampling_params)`."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Sequence

import torch
from tqdm.auto import tqdm

from deepinfer.backends import get_accelerator
from deepinfer.core.engine import EngineConfig, LLMEngine
from deepinfer.core.kv_events import KVEventsConfig
from deepinfer.outputs import RequestOutput
from deepinfer.sampling_params import SamplingParams

ASSETS_DIR = os.path.join(os.path.dirname(__file__), "assets")
TINY_DSV4_DIR = os.path.join(ASSETS_DIR, "tiny-dsv4")
TINY_DSV41_DIR = os.path.join(ASSETS_DIR, "tiny-dsv41")
# The shipped model of lowest held-out perplexity (tests/e2e/test_shipped_v41.py keeps it so): the
# tiny V4.1, the model DeepSeek's engine serves, since its training reached tiny-dsv4's quality.
DEFAULT_MODEL_DIR = TINY_DSV41_DIR
logger = logging.getLogger("deepinfer")


def default_model() -> str:
    """The model used when none is given: DEEPINFER_HF_MODEL_DIR, else the shipped tiny model."""
    from deepinfer import envs

    return envs.get("DEEPINFER_HF_MODEL_DIR") or DEFAULT_MODEL_DIR


def deterministic_sampling_gaps(accel, drafting: bool) -> list[str]:
    """What a seeded request still needs for identical reruns on `accel` (empty: nothing).
    The accelerator's `deterministic_sampling` decides; the confidence-scheduled verify length
    matters only when the engine drafts (its lengths follow measured step times)."""
    from deepinfer import envs

    missing = []
    if not accel.deterministic_sampling:
        missing.append("DEEPINFER_BATCH_INVARIANT=1 (set when the LLM is created)" if accel.batch_invariant_mode
                       else f"a backend that offers it (the {accel.name} backend does not: use nvidia)")
    if drafting and envs.mtp_varlen():
        missing.append("DEEPINFER_ENABLE_MTP_VARLEN=0")
    return missing


def _prompt_entry(prompt, i: int) -> tuple[str | None, list[int] | None, dict | None]:
    """(text, token ids, multi_modal_data) of one `prompts` element: a string, or a dict with "prompt"
    or "prompt_token_ids" and optionally "multi_modal_data" (vLLM's TextPrompt / TokensPrompt)."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError(f"prompts[{i}] is empty")
        return prompt, None, None
    if not isinstance(prompt, dict):
        raise TypeError(f"prompts[{i}] is {type(prompt).__name__}, expected str or dict")
    unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data"})
    if unknown:
        raise ValueError(f"prompts[{i}] has unknown keys {unknown}; a prompt dict takes 'prompt' or "
                         "'prompt_token_ids', and 'multi_modal_data'")
    text, ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
    if (text is None) == (ids is None):
        raise ValueError(f"prompts[{i}] needs one of 'prompt' (text) or 'prompt_token_ids'")
    if text is not None and (not isinstance(text, str) or not text):
        raise ValueError(f"prompts[{i}]['prompt'] must be a non-empty string")
    return text, None if ids is None else list(ids), prompt.get("multi_modal_data")


def _merge_samples(outputs: list[RequestOutput], counts: list[int]) -> list[RequestOutput]:
    """One RequestOutput per prompt: the n completions of a prompt (consecutive outputs) as its
    `outputs`, indexed 0..n-1 (vLLM's shape)."""
    if all(n == 1 for n in counts):
        return outputs
    merged, at = [], 0
    for n in counts:
        group, at = outputs[at:at + n], at + n
        first = group[0]
        completions = [dataclasses.replace(o.outputs[0], index=k) for k, o in enumerate(group)]
        merged.append(dataclasses.replace(first, outputs=completions, finished=all(o.finished for o in group)))
    return merged


class LLM:
    def __init__(self, model: str | os.PathLike | None = None, tokenizer: str | os.PathLike | None = None, *,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 2048, max_model_len: int | None = None,
                 dtype: str = "auto", gpu_memory_utilization: float = 0.9, cache_bytes: int | None = None,
                 num_cache_pages: int | None = None,
                 seed: int = 0, accelerator: str | None = None, expert_parallel_size: int = 1,
                 data_parallel_size: int = 1, context_parallel_size: int = 1, num_redundant_experts: int = 0,
                 eplb_window_size: int = 0, eplb_step_interval: int = 0, kv_events_config: str | dict | None = None,
                 kv_store: str | None = None, kv_host_cache_bytes: int = 0, stream_interval: int = 1):
        """Parallel layouts (deepinfer/parallel): expert_parallel_size shards the routed experts
        over ranks; data_parallel_size gives each rank its own requests and cache;
        context_parallel_size splits each step's tokens (long prefills in balanced chunks) over
        ranks that share requests. One worker process per rank is spawned, or, under torchrun,
        this process is a rank. EPLB: num_redundant_experts extra expert slots hold copies of hot
        experts; every eplb_step_interval steps the experts are re-placed from the load measured
        over the last eplb_window_size steps.

        dtype: the compute dtype, "auto" (float32 on cpu, bfloat16 on nvidia and ascend), "float32"
        or "bfloat16": the inputs of the weight ops (projections, experts, head) are rounded to it
        and the decode state is stored in it; weights always stay in the checkpoint's format
        (bf16, FP8, FP4, widened in registers), and accumulation, norms, softmax, the mHC mixing,
        routing and sampling are float32. gpu_memory_utilization: the share of (memory free once
        the weights are loaded + the weights) the engine may fill; the cache gets what is left after
        an activation headroom (core/memory.py). On cpu the memory is the available RAM.
        cache_bytes / num_cache_pages set the cache size instead.

        kv_events_config: vLLM's KV events configuration (a JSON string or a dict, e.g.
        {"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}):
        the prefix cache's pages are published over ZMQ for KV-aware routers (docs/kv-events.md).

        kv_store: a page store the prefix cache's pages are written back to and read from, shared by
        replicas and restarts: "file:///dir" (local disk, NFS, a 3FS mount) or "mooncake://host:port"
        (a Mooncake Store master). kv_host_cache_bytes: a host-memory tier between the cache pool and
        the store (0: none). docs/kv-store.md.

        stream_interval: a server's streams get the tokens of a multi-step decode call every this many
        steps while the call runs on (1: each token as it is decoded; larger: fewer, bigger deltas for
        less per-token work at high concurrency). No effect on generate, which returns whole outputs."""
        model = os.fspath(model) if model is not None else default_model()
        self.accel = get_accelerator(accelerator)
        self.parallel = None  # deepinfer.parallel.ParallelExecutor when any parallel size exceeds 1
        from deepinfer import envs

        if envs.batch_invariant() and not self.accel.deterministic_sampling:
            raise ValueError(
                f"DEEPINFER_BATCH_INVARIANT=1 but the {self.accel.name} backend has no batch-invariant mode: "
                "batch-invariant inference and deterministic sampling are NVIDIA-only (plus the cpu reference, "
                "for testing); unset DEEPINFER_BATCH_INVARIANT or use DEEPINFER_ACCELERATOR=nvidia")
        self._seed_warned = False
        torch.manual_seed(seed)
        config = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                              max_model_len=max_model_len, cache_bytes=cache_bytes,
                              gpu_memory_utilization=gpu_memory_utilization,
                              num_cache_pages=num_cache_pages, dtype=dtype, seed=seed,
                              kv_events=KVEventsConfig.parse(kv_events_config), kv_store=kv_store,
                              kv_host_cache_bytes=kv_host_cache_bytes, stream_interval=stream_interval)
        from deepinfer.parallel import ParallelConfig, start_parallel

        parallel = ParallelConfig(expert_parallel_size, data_parallel_size, context_parallel_size,
                                  num_redundant_experts, eplb_window_size, eplb_step_interval)
        if parallel.enabled and (kv_store or kv_host_cache_bytes):
            raise ValueError("kv_store / kv_host_cache_bytes are not supported with parallel ranks yet; "
                             "leave them out or run one engine")
        if parallel.enabled and config.kv_events is not None:
            raise ValueError("kv_events_config is published by one engine, or per rank by `deepinfer serve "
                             "--data-parallel-size N`; an offline LLM with parallel ranks does not publish them")
        if parallel.enabled:  # one process per rank; this one drives them (or is one, under torchrun)
            self.engine = None
            self.parallel, self.tokenizer = start_parallel(model, tokenizer, config, parallel, self.accel)
            return
        parallel.validate()
        self.engine = LLMEngine(model, self.accel, config, tokenizer)
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: str | dict | Sequence[str | dict] | None = None,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 prompt_token_ids: Sequence[Sequence[int]] | None = None,
                 use_tqdm: bool = True, multi_modal_data: dict | Sequence[dict | None] | None = None
                 ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order. Invalid input raises
        before any request is queued, so the engine stays ready for the next call.

        Multimodal input (a model with an encoder, e.g. DeepSeek-V4.1's images): a prompt may be a dict
        as vLLM takes it, {"prompt": "... <image> ...", "multi_modal_data": {"image": item or [items]}}
        (or "prompt_token_ids" instead of "prompt"), or `multi_modal_data` gives one such dict per prompt
        (None for a text prompt; a single dict with a single prompt). An image is a PIL.Image, encoded
        bytes or a file path; each goes where the prompt has a placeholder (`<image>`, or the model's own
        spelling), in order."""
        token_lists, texts, mm_items = self._inputs(prompts, prompt_token_ids, multi_modal_data)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(token_lists)
        else:
            params = list(sampling_params)
            if len(params) != len(token_lists):
                raise ValueError(f"sampling_params has {len(params)} entries for {len(token_lists)} prompts; "
                                 "give one SamplingParams or one per prompt")
            for i, p in enumerate(params):
                if not isinstance(p, SamplingParams):
                    raise TypeError(f"sampling_params[{i}] is {type(p).__name__}, expected SamplingParams")
        counts = [p.n for p in params]
        if any(n > 1 for n in counts):  # n completions of a prompt: n requests, each with its own seed
            expand = lambda xs: [x for x, n in zip(xs, counts) for _ in range(n)]  # noqa: E731
            params = [p.for_sample(k) for p, n in zip(params, counts) for k in range(n)]
            token_lists, texts, mm_items = expand(token_lists), expand(texts), expand(mm_items)
        if self.parallel is not None:  # the ranks validate, schedule and run; outputs come back in order
            return _merge_samples(self.parallel.generate(token_lists, params, texts), counts)
        self._check_requests(token_lists, params, mm_items)
        if not self._seed_warned and any(p.seq_seed is not None for p in params):
            self._warn_if_not_deterministic()
        requests = [self.engine.add_request(ids, p, text, mm_items=items)
                    for ids, p, text, items in zip(token_lists, params, texts, mm_items)]
        try:
            self._run(len(requests), use_tqdm)
        except BaseException:
            for req in requests:  # leave nothing queued behind a failed call
                self.engine.abort_request(req.request_id)
            self.engine.pop_finished()
            raise
        self.engine.pop_finished()
        return _merge_samples([req.to_output() for req in requests], counts)

    def memory_report(self):
        """Where memory went (deepinfer.core.memory.MemoryReport): weights by storage kind against
        the checkpoint's bytes, the cache pools and how they were sized, the activation headroom and
        what is free. `print(llm.memory_report())` for the table, `.as_dict()` for the numbers."""
        if self.engine is None:
            raise NotImplementedError("memory_report: a parallel LLM's ranks log their own reports at start")
        return self.engine.memory

    def close(self) -> None:
        """Stop the worker thread, and the worker processes of a parallel LLM (also done at exit)."""
        if self.parallel is not None:
            self.parallel.close()
        if self.engine is not None:
            self.engine.close()

    def _inputs(self, prompts, prompt_token_ids, multi_modal_data):
        """(token ids, prompt texts, multimodal items) per prompt; multimodal prompts are expanded."""
        if prompts is not None and prompt_token_ids is not None:
            raise ValueError("give prompts or prompt_token_ids, not both")
        if prompt_token_ids is not None:
            entries = [(None, list(ids), None) for ids in prompt_token_ids]
        elif prompts is None:
            raise ValueError("generate() needs prompts (strings or dicts) or prompt_token_ids")
        else:
            entries = [_prompt_entry(p, i) for i, p in enumerate([prompts] if isinstance(prompts, (str, dict))
                                                                  else prompts)]
        if multi_modal_data is not None:
            data = [multi_modal_data] if isinstance(multi_modal_data, dict) else list(multi_modal_data)
            if len(data) != len(entries):
                raise ValueError(f"multi_modal_data has {len(data)} entries for {len(entries)} prompts; give one "
                                 "dict (or None) per prompt")
            for i, ((text, ids, own), extra) in enumerate(zip(entries, data)):
                if own is not None and extra is not None:
                    raise ValueError(f"prompt {i} has multi_modal_data in its dict and in the multi_modal_data "
                                     "argument; give it once")
                entries[i] = (text, ids, own if own is not None else extra)
        if any(mm is not None for _, _, mm in entries) and self.parallel is not None:
            raise ValueError("multi_modal_data is not supported with parallel layouts (expert/data/"
                             "context_parallel_size > 1) yet; run the multimodal model in one process")
        if any(ids is None for _, ids, _ in entries) and self.tokenizer is None:
            raise ValueError("this model directory has no tokenizer.json: pass prompt_token_ids, or tokenizer=...")
        token_lists, texts, items = [], [], []
        for i, (text, ids, mm) in enumerate(entries):
            if ids is None:
                ids = self.tokenizer.encode(text, placeholders=self.engine.multimodal_placeholders if mm else None)
            found = []
            if mm is not None:
                ids, found = self.engine.process_multimodal(ids, mm, what=f"prompt {i}")
            token_lists.append(ids)
            texts.append(text)
            items.append(found)
        return token_lists, texts, items

    def _check_requests(self, token_lists, params, mm_items) -> None:
        """Validate every request before queueing any, so a bad one leaves nothing behind."""
        for i, (ids, p, items) in enumerate(zip(token_lists, params, mm_items)):
            self.engine.validate_request(ids, p, what=f"prompt {i}", mm_items=items)

    def _warn_if_not_deterministic(self) -> None:
        """seq_seed alone does not make reruns identical; say once which condition is missing."""
        missing = deterministic_sampling_gaps(self.accel, drafting=self.engine.spec is not None)
        if missing:
            self._seed_warned = True
            logger.warning("seq_seed is set but sampling is not deterministic: a seeded request's tokens can "
                           "still depend on what shares its batch. Deterministic sampling also needs %s.",
                           " and ".join(missing))

    def _run(self, total: int, use_tqdm: bool) -> None:
        bar = tqdm(total=total, desc="generate", unit="req", dynamic_ncols=True) if use_tqdm else None
        prefill = decode = 0
        seconds = 0.0
        start = time.perf_counter()
        while self.engine.has_unfinished():
            done = self.engine.step()
            st = self.engine.last_step
            prefill += st.prefill_tokens
            decode += st.decode_tokens
            seconds = time.perf_counter() - start
            if bar is not None:
                bar.set_postfix_str(f"prefill {prefill / max(seconds, 1e-9):.0f} tok/s, "
                                    f"decode {decode / max(seconds, 1e-9):.0f} tok/s", refresh=False)
                bar.update(len(done))
        if bar is not None:
            bar.close()

    def stats(self) -> dict[str, float]:
        """Engine counters since start-up: prefix cache hits, replayed tokens, evictions, preemptions.
        With parallel ranks: summed over the data-parallel groups."""
        if self.parallel is None:
            return self.engine.stats()
        from deepinfer.parallel.worker import engine_stats

        per_group = [s for s in self.parallel.collective_rpc(engine_stats) if s is not None]
        total = {k: sum(s[k] for s in per_group) for k in per_group[0]}
        if "prefix_cache_query_tokens" in total:
            queried = total["prefix_cache_query_tokens"]
            total["prefix_cache_hit_rate"] = total["prefix_cache_hit_tokens"] / queried if queried else 0.0
        return total
