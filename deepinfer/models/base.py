"""The model interface: what the engine knows of a model, and nothing more.

A family (models/<family>/) provides a config class and a model class. The engine reads the
config's common fields (`vocab_size`, `hidden_size`, `max_position_embeddings`, `bos_token_id`,
`eos_token_ids`), loads the tensors the model class names, builds the model, allocates the pools
its cache spec lists, and runs steps through `prepare` / `forward`. Layer types, checkpoint names,
attention variants and index planning stay inside the family.

Multimodal input (images) is the family's too: `process_multimodal` turns a request's data into prompt
positions (`MultimodalItem` spans) and encoder inputs, `encode_multimodal` runs the encoder, and a
step's `StepInput.embeds` carries the encoded rows into the positions they fill. The engine only
schedules by positions and keys the prefix cache by each item's digest.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

if TYPE_CHECKING:
    from deepinfer.backends.base import Accelerator
    from deepinfer.core.cache import CacheSpec, StateCache


class ConfigError(ValueError):
    """config.json cannot describe a model deepinfer can run."""


@dataclass(slots=True)
class StepInput:
    """What the scheduler hands the model for one step."""

    ids: torch.Tensor  # [T] token ids, sequences back to back
    slots: torch.Tensor  # [B] cache slot of each sequence
    starts: torch.Tensor  # [B] position of each sequence's first new token
    lens: torch.Tensor  # [B] new tokens per sequence (>= 1)
    # after a prefix-cache hit (core/replay.py); None = zeros
    window_floor: torch.Tensor | None = None  # [B] tokens from here on read no window key below it
    num_restored: torch.Tensor | None = None  # [B] paged state of positions below it is cached: not rewritten
    # multimodal input: (first flat row of `ids`, rows [n, hidden] float32 on the device) that replace the
    # token embeddings of those rows (an image's span positions); None = text only
    embeds: list[tuple[int, torch.Tensor]] | None = None


def to_device(t: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """One of a step's planned arrays as a tensor on `device`: on the host the array's memory is
    shared, not copied; elsewhere it is copied without waiting (the step reads it after the copy,
    in stream order)."""
    t = torch.from_numpy(np.ascontiguousarray(t)) if isinstance(t, np.ndarray) else t
    return t if device.type == "cpu" else t.to(device, non_blocking=True)


@dataclass(slots=True, eq=False)
class MultimodalItem:
    """One multimodal input of a prompt (an image) as its family laid it out: the prompt positions its
    span fills and what the family's encoder needs. The engine schedules by positions and keys the
    prefix cache by `digest`; it never looks inside `data`."""

    offset: int  # first prompt position of the span
    length: int  # positions the span takes
    digest: bytes  # equal digests give equal embeddings (the prefix cache's key for these positions)
    data: object = field(repr=False)  # the encoder's input (the family's own type)
    # [length, hidden] once encoded (on the device): kept for the request's life, so chunked prefill,
    # preemption and replay do not run the encoder again
    embeds: torch.Tensor | None = field(default=None, repr=False)

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(slots=True)
class MultimodalPrompt:
    """A prompt after `process_multimodal`: token ids with every placeholder expanded into its item's
    span, and the items in prompt order (spans do not overlap)."""

    prompt_token_ids: list[int]
    items: list[MultimodalItem]


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """A checkpoint tensor as the model holds it: shape, dtype, and which op reads it.

    `stored`: a weight a weight op reads (linear, grouped_linear, swiglu_mlp, moe_experts, the
    routers, embedding): kept in the checkpoint's format (bf16 stays bf16, FP8 / FP4 stay a
    backends.quant.QuantizedWeight) and widened by the ops in registers. Otherwise the loader
    converts it to `dtype` (norm weights, biases, mixing matrices: a negligible share of the bytes)."""

    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32
    experts: bool = False  # an [E, N, K] stack of routed experts (WeightRole.EXPERTS); implies stored
    stored: bool = False
    # kept as stored and memory-mapped from the file (no copy, no dequantization, `dtype` is the
    # stored dtype): a large table of which a step reads a few rows (DeepSeek-V4.1's Engram)
    mapped: bool = False


# A checkpoint name's destination: (model name, None) for a whole tensor, (model name, (expert,
# half)) for a slice of a fused expert stack, half 0/1 for the gate/up rows of a gate_up stack and
# None for a down stack.
Slot = tuple[str, "tuple[int, int | None] | None"]


def expert_slice_source(stack: str, part: tuple[int, int | None], pattern: str,
                        parts: dict[str, tuple[str, int | None]]) -> tuple[re.Match, str] | None:
    """The inverse of a Slot into a fused expert stack (for error messages): `pattern` matches the
    stack's model name, its last group the stack's kind; `parts` maps each per-expert tensor's
    checkpoint part name to (stack kind, half). Returns (the match, the part name that fills
    `part`'s half), or None when `stack` is no fused stack."""
    m = re.fullmatch(pattern, stack)
    if m is None:
        return None
    kind = m.group(m.lastindex)
    return m, next(w for w, (fused, half) in parts.items() if fused == kind and half == part[1])


@dataclass(slots=True)
class ParallelContext:
    """Parallel ranks a model runs with, handed to it at construction (deepinfer/parallel builds
    them). None fields: one process.

    expert_parallel: registers each MoE layer's expert stacks (`add_layer(gate_up, down, top_k)`)
      and returns the callable that runs that layer's routed experts across the ranks.
    context_parallel: `split(lens)` of each step: which token rows this rank computes and how to
      gather rows of every token from every rank."""

    expert_parallel: object | None = None
    context_parallel: object | None = None


class CausalLM(ABC):
    """A model as the engine drives it. Built as `Model(config, weights, accel, parallel)` from
    `Model.checkpoint_tensors(config)`'s tensors, each prepared on the accelerator by its role."""

    config: object
    accel: "Accelerator"
    # Positions of per-sequence state that a prefix-cache hit does not restore (sliding-window
    # rings): replayed from the cached prefix's tail (core/replay.py). 0: paged state is the whole
    # decode state, so a hit is exact and nothing is replayed.
    replay_window: int = 0
    # Whether `prepare(steps=k)` plans k greedy decode steps at once (multi-step decoding, see
    # `prepare`); a model without it decodes one step per call.
    multi_step_decode: bool = True

    @classmethod
    @abstractmethod
    def checkpoint_tensors(cls, config) -> dict[str, TensorSpec]:
        """Every tensor the model reads, by the model's own names."""

    @staticmethod
    def checkpoint_name(name: str) -> Slot | None:
        """Where a checkpoint tensor named otherwise (upstream names, per-expert tensors) goes; None:
        no counterpart. Names `checkpoint_tensors` lists map to themselves without asking."""
        return None

    # Checkpoint tensors kept aside, unconverted names (e.g. `mtp.` drafter stages), for `make_drafter`.
    extra_prefixes: tuple[str, ...] = ()

    @classmethod
    def ignored_prefixes(cls, config) -> tuple[str, ...]:
        """Checkpoint tensors the model never reads, by name prefix (e.g. DeepSeek-V3's
        multi-token-prediction layer, whose index depends on the config): skipped unread."""
        return ()

    @abstractmethod
    def cache_spec(self, margin: int) -> "CacheSpec":
        """The per-sequence state this model keeps between steps. `margin`: extra ring rows so a
        rejected speculative token never overwrites state that is still read."""

    @abstractmethod
    def prepare(self, inp: StepInput, cache: "StateCache", steps: int | None = None):
        """The step's metadata (index tensors), planned on the host; it has `ids`, the step's token
        ids on the device, which the engine may patch with the previous step's samples. The engine
        records a step once per shape bucket and replays it with a later step's metadata
        (core/graphs.py): `forward` must read the step only through the tensors this object holds
        (in its attributes, or dicts, lists and tuples of them) and the numbers it holds the same
        way, never through host arrays. Decode steps (one token per sequence) should have shapes
        that depend on the batch size only, so one recording serves them all.
        `steps` (decode steps only): plan this step and the next steps-1 greedy decode steps at once
        (sequence b feeds position starts[b] + s in step s): every tensor gets a leading dimension
        of `steps`, row s being step s's (`ids`: row 0 given, the others the engine fills with the
        previous step's samples)."""

    @abstractmethod
    def forward(self, inp: StepInput, cache: "StateCache", logit_rows: torch.Tensor, meta=None,
                feature_layers: tuple[int, ...] = (), feature_rows: torch.Tensor | None = None):
        """Run one step, update `cache`, return logits [len(logit_rows), V] of the given flat token
        rows; with `feature_layers`, (logits, features [len(feature_rows), len(feature_layers), D])."""

    def make_drafter(self, extra: dict[str, torch.Tensor], max_seqs: int, margin: int):
        """The speculative drafter the checkpoint carries (`extra`), or None."""
        return None

    # Multimodal input. A text-only model keeps these defaults: a request with multimodal data is
    # refused with the message `process_multimodal` raises.
    @property
    def multimodal_placeholders(self) -> dict[str, int]:
        """Placeholder text -> token id: where a prompt puts a multimodal item (e.g. an image). The
        engine tokenizes each occurrence as that one id, whatever the tokenizer makes of the text."""
        return {}

    def process_multimodal(self, prompt_token_ids: list[int], data: dict) -> MultimodalPrompt:
        """Lay out a request's multimodal `data` ({modality: item or list of items}, e.g. {"image": [...]})
        in its tokenized prompt: each placeholder token becomes its item's span. Raises ValueError
        naming the problem (a modality the model does not take, placeholders and items that do not
        pair up, an item that cannot be decoded or does not fit)."""
        raise ValueError(f"multi_modal_data was given, but this model ({type(self).__name__}) takes text only: "
                         "it has no encoder for images or other modalities; send the prompt without it")

    def encode_multimodal(self, items: list[MultimodalItem]) -> list[torch.Tensor]:
        """The span embeddings [item.length, hidden] (float32, on the device) of items this model
        laid out, in one encoder pass."""
        raise NotImplementedError(f"{type(self).__name__} has no multimodal encoder")


class ViewCache:
    """A model's view of the engine's state cache (`make(cache, config)`), built once per cache and
    reused while the engine hands the same cache to every step."""

    __slots__ = ("_make", "_config", "_cache", "_view")

    def __init__(self, make: Callable, config):
        self._make, self._config, self._cache, self._view = make, config, None, None

    def get(self, cache: "StateCache"):
        if self._cache is not cache:
            self._cache, self._view = cache, self._make(cache, self._config)
        return self._view


@dataclass(frozen=True, slots=True)
class Family:
    """One model family behind the registry."""

    name: str
    architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    load: Callable[[], tuple[type, type]] = field(repr=False)  # () -> (config class, model class), imported lazily
    upstream_keys: tuple[str, ...] = ()  # keys that mark the family's own config format (no architecture)
