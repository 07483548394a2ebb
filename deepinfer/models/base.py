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

import copy
import dataclasses
import functools
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol

import numpy as np
import torch

if TYPE_CHECKING:
    from deepinfer.backends.base import Accelerator


class ConfigError(ValueError):
    """config.json cannot describe a model deepinfer can run."""


# ---------------------------------------------------------------- the decode state a model declares
@dataclass(frozen=True, slots=True)
class PoolSpec:
    """One pool of per-sequence state (core/cache.py lays them out). `kind` and `layer` are the model's own
    labels (e.g. a layer type); the cache does not read them."""

    name: str
    width: int
    ring: int = 0  # rows per sequence slot
    scratch: bool = False  # one row per token of the step, after the slot rows
    stride: int = 0  # paged: one row per `stride` positions (0: not paged)
    kind: str = ""
    layer: int = -1
    dtype: torch.dtype | None = None  # None: the cache's dtype (an integer pool, e.g. token history, sets its own)

    def element_size(self, default: int) -> int:
        return default if self.dtype is None else torch.empty(0, dtype=self.dtype).element_size()


@dataclass(frozen=True, slots=True)
class CacheSpec:
    pools: tuple[PoolSpec, ...]

    @property
    def paged(self) -> bool:
        return any(p.stride for p in self.pools)

    def bytes_per_page(self, page_tokens: int, element_size: int) -> int:
        return sum(page_tokens // p.stride * p.width * p.element_size(element_size) for p in self.pools if p.stride)

    def bytes_per_slot(self, element_size: int) -> int:
        return sum(p.ring * p.width * p.element_size(element_size) for p in self.pools)

    def bytes_scratch(self, step_tokens: int, element_size: int) -> int:
        return sum(p.width for p in self.pools if p.scratch) * step_tokens * element_size


@dataclass(slots=True)
class Pool:
    spec: PoolSpec
    data: torch.Tensor  # [slot rows | scratch rows | page rows, width]
    scratch_base: int  # first scratch row (= max_seqs * ring)
    page_base: int  # first page row
    page_rows: int  # rows per page (page_tokens // stride), 0 if not paged


class DecodeCache(Protocol):
    """What a model reads of the engine's decode-state cache (core/cache.py StateCache), which
    allocates the pools its CacheSpec declares."""

    spec: CacheSpec
    pools: dict[str, Pool]
    block_table: np.ndarray  # [ring_slots, max pages per sequence] page of each sequence's page p
    max_seqs: int
    ring_slots: int  # sequence slots with ring rows: max_seqs and the trash slot
    trash_slot: int
    trash_page: int
    page_tokens: int
    max_step_tokens: int
    dtype: torch.dtype
    device: torch.device

    def page_rows(self, pool: Pool, slots: np.ndarray, rows: np.ndarray) -> np.ndarray: ...


# ---------------------------------------------------------------- a step
@dataclass(slots=True)
class StepInput:
    """What the scheduler hands the model for one step."""

    ids: torch.Tensor  # [T] token ids, sequences back to back
    slots: torch.Tensor  # [B] cache slot of each sequence
    starts: torch.Tensor  # [B] position of each sequence's first new token
    lens: torch.Tensor  # [B] new tokens per sequence (>= 1)
    # after a prefix-cache hit (core/prefix_replay.py); None = zeros
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


def size_bucket(n: int, minimum: int = 0, linear_from: int = 64) -> int:
    """A size that varies from step to step (a model's longest context, its candidate entries)
    rounded up for its planner, so decode steps fall into few shape buckets: at least `minimum`
    (0 stays 0 without one), a power of two up to `linear_from`, then multiples of `linear_from`."""
    n = max(n, minimum)
    if n <= 0:
        return 0
    return 1 << (n - 1).bit_length() if n <= linear_from else -(-n // linear_from) * linear_from



# ---------------------------------------------------------------- the tensors of a step's metadata
class StepData:
    """Base of the records (dataclasses whose fields are all init fields) a family's step metadata
    holds its index tensors in: `step_inputs` and `with_step_tensors` walk their fields as they walk
    a dict's entries."""

    __slots__ = ()

    def values(self) -> list:
        return [getattr(self, name) for name in _field_names(type(self))]

    def mapped(self, f):
        """A copy with f(array) for each array field (each item of a tuple field; None stays None)."""
        return type(self)(*[v if v is None else tuple(map(f, v)) if isinstance(v, tuple) else f(v)
                            for v in self.values()])


@functools.cache
def _field_names(cls) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def step_inputs(meta) -> tuple[list[torch.Tensor], tuple]:
    """What of a step's metadata changes from step to step: every tensor it holds, in a fixed order
    (its attributes' tensors and those in StepData records, dicts, lists and tuples among them), and the Python
    numbers and strings held the same way (sizes the planning reads: they are part of the step's
    bucket). Other objects (e.g. the model's view of the cache) are fixed for the engine's life and
    not walked."""
    tensors: list[torch.Tensor] = []
    scalars: list = []

    def walk(v):
        if isinstance(v, torch.Tensor):
            tensors.append(v)
        elif isinstance(v, (int, float, str, bool)) or v is None:
            scalars.append(v)
        elif isinstance(v, dict):
            for k, x in v.items():
                scalars.append(k if isinstance(k, (int, str, tuple)) else None)
                walk(x)
        elif isinstance(v, (list, tuple)):
            scalars.append(len(v))
            for x in v:
                walk(x)
        elif isinstance(v, StepData):
            scalars.append(type(v).__name__)
            for x in v.values():
                walk(x)

    for value in _attributes(meta):
        walk(value)
    return tensors, tuple(scalars)


def with_step_tensors(meta, tensors: list[torch.Tensor]):
    """A shallow copy of `meta` holding `tensors` (in step_tensors' order) instead of its own."""
    it = iter(tensors)

    def swap(v):
        if isinstance(v, torch.Tensor):
            return next(it)
        if isinstance(v, dict):
            return {k: swap(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return type(v)(swap(x) for x in v)
        if isinstance(v, StepData):
            return type(v)(*[swap(x) for x in v.values()])
        return v

    new = {name: swap(getattr(meta, name)) for name in _attribute_names(meta)}
    if dataclasses.is_dataclass(meta):
        return dataclasses.replace(meta, **new)
    out = copy.copy(meta)  # a new metadata object: its attributes, with the tensors swapped
    vars(out).update(new)
    return out


def _attribute_names(obj) -> list[str]:
    if hasattr(obj, "__dict__"):
        return list(vars(obj))
    return [n for cls in type(obj).__mro__ for n in getattr(cls, "__slots__", ())]


def _attributes(obj):
    if hasattr(obj, "__dict__"):
        return vars(obj).values()
    return [getattr(obj, n) for n in _attribute_names(obj)]



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
Destination = tuple[str, "tuple[int, int | None] | None"]


def expert_slice_source(stack: str, part: tuple[int, int | None], pattern: str,
                        parts: dict[str, tuple[str, int | None]]) -> tuple[re.Match, str] | None:
    """The inverse of a Destination into a fused expert stack (for error messages): `pattern` matches the
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
    # rings): replayed from the cached prefix's tail (core/prefix_replay.py). 0: paged state is the whole
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
    def checkpoint_name(name: str) -> Destination | None:
        """Where a checkpoint tensor named otherwise (upstream names, per-expert tensors) goes; None:
        no counterpart. Names `checkpoint_tensors` lists map to themselves without asking."""
        return None

    @staticmethod
    def checkpoint_source(name: str, part: tuple[int, int | None] | None = None) -> str | None:
        """The inverse of `checkpoint_name`, for error messages: the checkpoint name that fills model
        tensor `name` (`part`: which slice of a fused expert stack); None: the name itself."""
        return None

    # Checkpoint tensors kept aside, unconverted names (e.g. `mtp.` drafter stages), for `make_drafter`.
    extra_prefixes: tuple[str, ...] = ()

    @classmethod
    def ignored_prefixes(cls, config) -> tuple[str, ...]:
        """Checkpoint tensors the model never reads, by name prefix (e.g. DeepSeek-V3's
        multi-token-prediction layer, whose index depends on the config): skipped unread."""
        return ()

    @abstractmethod
    def cache_spec(self, margin: int) -> CacheSpec:
        """The per-sequence state this model keeps between steps. `margin`: extra ring rows so a
        rejected speculative token never overwrites state that is still read."""

    @abstractmethod
    def prepare(self, inp: StepInput, cache: DecodeCache, steps: int | None = None):
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
    def forward(self, inp: StepInput, cache: DecodeCache, logit_rows: torch.Tensor, meta=None,
                features: FeaturesRequest | None = None):
        """Run one step, update `cache`, return logits [len(logit_rows), V] of the given flat token
        rows; with `features`, (logits, features [len(features.rows), len(features.layers), D])."""

    def make_drafter(self, extra: dict[str, torch.Tensor], max_seqs: int, margin: int) -> Drafter | None:
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

    # An encoder worker (`deepinfer serve --disaggregation-mode encode`, kv/encode_worker.py) holds the
    # family's encoder alone; a prefill worker ships it each item's encoder input (`pack_multimodal`).
    @classmethod
    def encoder_tensors(cls, config) -> dict[str, TensorSpec]:
        """The checkpoint tensors of the multimodal encoder alone; ValueError for a model without one."""
        raise ValueError(f"{cls.__name__} takes text only: it has no multimodal encoder to serve")

    @classmethod
    def make_encoder(cls, config, weights: dict[str, torch.Tensor], accel: Accelerator) -> MultimodalEncoder:
        """The encoder of `encoder_tensors`' weights, on `accel`."""
        raise ValueError(f"{cls.__name__} takes text only: it has no multimodal encoder to serve")

    def pack_multimodal(self, item: MultimodalItem) -> tuple[dict, bytes]:
        """An item this model laid out, as its encoder input for an encoder worker: (a JSON-able
        header, the bytes) that the family's `MultimodalEncoder.unpack` takes back."""
        raise NotImplementedError(f"{type(self).__name__} has no multimodal encoder")


class MultimodalEncoder(Protocol):
    """A family's multimodal encoder on its own, as an encoder worker runs it."""

    hidden_size: int  # the width of its embeddings (the language model's hidden size)

    def unpack(self, header: dict, payload: bytes) -> object:
        """The encoder input `CausalLM.pack_multimodal` shipped; ValueError when the bytes do not
        match their header (sizes, digest)."""

    def encode(self, inputs: list) -> list[torch.Tensor]:
        """Each input's span embeddings [span length, hidden_size], in one encoder pass."""


@dataclass(frozen=True, slots=True)
class FeaturesRequest:
    """Hidden features a step returns besides its logits (a speculative drafter's context): the
    input of model layers `layers`, at flat token rows `rows` of the step."""

    layers: tuple[int, ...]
    rows: torch.Tensor


class DraftSettings(Protocol):
    block_size: int  # draft positions one block proposes
    target_layer_ids: tuple[int, ...]  # the target layers whose input is the drafter's context


class Drafter(Protocol):
    """A speculative drafter as the speculative decoder (core/speculative) drives it: it keeps its own context
    rings, fed from every target step's features, and drafts a block per sequence."""

    dcfg: DraftSettings
    ring: int  # context rows kept per sequence slot: the window plus the rollback margin

    def absorb(self, features: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor) -> None:
        """Write the context of fed positions (features [R, len(target_layer_ids), D]) into the rings."""

    def draft_block(self, anchors: torch.Tensor, slots: torch.Tensor, anchor_pos: torch.Tensor) -> torch.Tensor:
        """One block per sequence: anchors / slots / anchor_pos [B] -> hidden [B, block_size, D]."""

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The vocabulary logits [N, V] of hidden rows h [N, D]."""

    def markov(self, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(low-rank embedding [B, r] of the previous token, its logit bias [B, V])."""

    def confidence_logit(self, h: torch.Tensor, e: torch.Tensor, slot: int | torch.Tensor) -> torch.Tensor:
        """The logit that the draft at block slot(s) `slot` is accepted, given hidden h and Markov embedding e."""

    def slot_pools(self) -> list[Pool]:
        """The drafter's per-sequence state as ring pools (slot s: rows [s * ring, (s + 1) * ring)):
        what prefill/decode disaggregation moves with a request besides the cache's pools."""


class ViewCache:
    """A model's view of the engine's state cache (`make(cache, config)`), built once per cache and
    reused while the engine hands the same cache to every step."""

    __slots__ = ("_make", "_config", "_cache", "_view")

    def __init__(self, make: Callable, config):
        self._make, self._config, self._cache, self._view = make, config, None, None

    def get(self, cache: DecodeCache):
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
