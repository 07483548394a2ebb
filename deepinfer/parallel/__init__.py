"""Multi-process inference on torch.distributed: MoE expert parallelism (+ EPLB) and attention
data parallelism. `LLM(..., expert_parallel_size=, data_parallel_size=)` starts it."""

from __future__ import annotations

import os

from deepinfer.parallel.config import LayoutError, ParallelConfig
from deepinfer.parallel.executor import ParallelExecutor, WorkerError

__all__ = ["LayoutError", "ParallelConfig", "ParallelExecutor", "WorkerError", "start_parallel"]


def start_parallel(model: str, tokenizer, engine_config, parallel: ParallelConfig, accel):
    """Check the layout against the model (before any process starts), start the ranks, and load
    the tokenizer the driver needs for text prompts. Returns (executor, tokenizer or None)."""
    from deepinfer.core.tokenizer import Tokenizer
    from deepinfer.models.registry import load_config
    from deepinfer.parallel.worker import WorkerArgs

    engine_config.validate()
    cfg, _ = load_config(model)
    parallel.validate(getattr(cfg, "n_routed_experts", None))
    executor = ParallelExecutor(WorkerArgs(model, os.fspath(tokenizer) if tokenizer is not None else None,
                                           engine_config, parallel, accel.name))
    has_tokenizer = tokenizer is not None or os.path.isfile(os.path.join(model, "tokenizer.json"))
    return executor, Tokenizer(tokenizer or model, bos_token_id=cfg.bos_token_id) if has_tokenizer else None
