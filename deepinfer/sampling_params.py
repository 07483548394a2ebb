"""SamplingParams: how one request is decoded. Every field is validated at construction,
with an error that names the field and says what would be accepted."""

from __future__ import annotations

import dataclasses
import json
import random
from dataclasses import dataclass, field
from typing import Any

GREEDY_TEMPERATURE = 1e-5  # below this, sampling is argmax
_UINT64 = 1 << 64
SO_SCHEMA_TYPES = ("json", "regex", "ebnf")
SO_KEYS = ("schema_type", "schema", "trigger_token_ids", "bound_token_id")
MAX_N = 128  # completions per prompt (OpenAI's limit for `n`)
MAX_LOGIT_BIAS = 100.0  # |bias| per token (OpenAI's range)
PENALTY_RANGE = 2.0  # presence_penalty / frequency_penalty in [-2, 2] (OpenAI's and vLLM's range)
MAX_REPETITION_PENALTY = 2.0  # repetition_penalty in (0, 2] (vLLM's range)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def validate_so_args(so_args: Any) -> None:
    """Structural checks of `so_args`; the grammar itself is compiled (and rejected if invalid)
    by the structured-output service."""
    if not isinstance(so_args, dict):
        raise ValueError(f"so_args must be a dict like {{'schema_type': 'json', 'schema': ...}}, got "
                         f"{type(so_args).__name__}")
    unknown = sorted(set(so_args) - set(SO_KEYS))
    if unknown:
        raise ValueError(f"so_args has unknown keys {unknown}; allowed keys are {list(SO_KEYS)}")
    schema_type = so_args.get("schema_type")
    if schema_type not in SO_SCHEMA_TYPES:
        raise ValueError(f"so_args['schema_type'] must be one of {list(SO_SCHEMA_TYPES)}, got {schema_type!r}")
    schema = so_args.get("schema")
    if schema is None:
        raise ValueError("so_args['schema'] is required (a JSON schema, a regex or an EBNF grammar)")
    if schema_type == "json":
        if isinstance(schema, str):
            try:
                json.loads(schema)
            except json.JSONDecodeError as exc:
                raise ValueError(f"so_args['schema'] is not valid JSON: {exc}") from None
        elif not isinstance(schema, dict):
            raise ValueError("so_args['schema'] for schema_type 'json' must be a JSON string or a dict")
    elif not isinstance(schema, str) or not schema:
        raise ValueError(f"so_args['schema'] for schema_type {schema_type!r} must be a non-empty string")
    trigger = so_args.get("trigger_token_ids")
    if trigger is not None:
        if not isinstance(trigger, (list, tuple)) or not trigger or not all(_is_int(t) and t >= 0 for t in trigger):
            raise ValueError("so_args['trigger_token_ids'] must be a non-empty list of token ids (ints >= 0)")
    bound = so_args.get("bound_token_id")
    if bound is not None:
        if not _is_int(bound) or bound < 0:
            raise ValueError("so_args['bound_token_id'] must be a token id (int >= 0)")
        if trigger is None:
            raise ValueError("so_args['bound_token_id'] needs 'trigger_token_ids': the bound forces the trigger")


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    ignore_eos: bool = False
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    top_logprobs: int = 0
    prompt_logprobs: int | None = None  # positions up to a prefix-cache hit get None (not computed)
    seq_seed: int | None = None
    so_args: dict | None = None
    # vLLM's names and meanings (core/logits.py applies them on the device)
    n: int = 1  # completions of the prompt; with seq_seed, completion i samples with seq_seed + i
    min_p: float = 0.0  # drop tokens whose probability (after temperature) is below min_p x the top one's
    repetition_penalty: float = 1.0  # > 1 discourages tokens of the prompt and output (CTRL's rule)
    presence_penalty: float = 0.0  # logit -= presence_penalty for each token the output holds
    frequency_penalty: float = 0.0  # logit -= frequency_penalty x how often the output holds the token
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    min_tokens: int = 0  # EOS and stop_token_ids cannot end the output before this many tokens
    bad_words: list[str] | None = None  # words never generated (each as its token sequence)
    allowed_token_ids: list[int] | None = None  # only these tokens may be generated
    include_stop_str_in_output: bool = False  # keep the stop string that ended the text
    skip_special_tokens: bool = True  # leave special tokens out of the text
    _stop: tuple[str, ...] = field(default=(), init=False, repr=False)

    def __post_init__(self) -> None:
        if not _is_number(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a number >= 0 (below {GREEDY_TEMPERATURE} is greedy), "
                             f"got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 disables it), got {self.top_p!r}")
        if not _is_int(self.top_k) or (self.top_k < 1 and self.top_k not in (0, -1)):
            raise ValueError(f"top_k must be a positive int, or -1 (or 0) to disable it, got {self.top_k!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        if stop is not None and (not isinstance(stop, (list, tuple)) or
                                 not all(isinstance(s, str) and s for s in stop)):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        self._stop = tuple(stop or ())
        if self.stop_token_ids is not None and (not isinstance(self.stop_token_ids, (list, tuple)) or
                                                not all(_is_int(t) and t >= 0 for t in self.stop_token_ids)):
            raise ValueError(f"stop_token_ids must be a list of token ids (ints >= 0), got {self.stop_token_ids!r}")
        if not _is_int(self.top_logprobs) or self.top_logprobs < 0:
            raise ValueError(f"top_logprobs must be an int >= 0, got {self.top_logprobs!r}")
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs) or self.prompt_logprobs < 0):
            raise ValueError(f"prompt_logprobs must be None or an int >= 0, got {self.prompt_logprobs!r}")
        if self.seq_seed is not None and (not _is_int(self.seq_seed) or not 0 <= self.seq_seed < _UINT64):
            raise ValueError(f"seq_seed must be an int in [0, 2**64), got {self.seq_seed!r}")
        if self.so_args is not None:
            validate_so_args(self.so_args)
        self._validate_vllm_fields()

    def _validate_vllm_fields(self) -> None:
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be an int in [1, {MAX_N}] (completions per prompt), got {self.n!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1] (0 disables it), got {self.min_p!r}")
        if not _is_number(self.repetition_penalty) or not 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY}] (1 disables it), "
                             f"got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -PENALTY_RANGE <= value <= PENALTY_RANGE:
                raise ValueError(f"{name} must be in [-{PENALTY_RANGE}, {PENALTY_RANGE}] (0 disables it), got {value!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a dict {{token id: bias}}, got {type(self.logit_bias).__name__}")
            bias = {}
            for token, value in self.logit_bias.items():
                if isinstance(token, str) and token.strip().isdigit():  # JSON object keys are strings
                    token = int(token)
                if not _is_int(token) or token < 0:
                    raise ValueError(f"logit_bias keys must be token ids (ints >= 0), got {token!r}")
                if not _is_number(value) or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                    raise ValueError(f"logit_bias[{token}] must be a number in [-{MAX_LOGIT_BIAS:g}, "
                                     f"{MAX_LOGIT_BIAS:g}], got {value!r}")
                bias[token] = float(value)
            self.logit_bias = bias
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an int >= 0, got {self.min_tokens!r}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens}): "
                             "lower min_tokens or raise max_tokens")
        if self.bad_words is not None and (not isinstance(self.bad_words, (list, tuple)) or
                                           not all(isinstance(w, str) and w for w in self.bad_words)):
            raise ValueError(f"bad_words must be a list of non-empty strings, got {self.bad_words!r}")
        if self.allowed_token_ids is not None and (
                not isinstance(self.allowed_token_ids, (list, tuple)) or not self.allowed_token_ids or
                not all(_is_int(t) and t >= 0 for t in self.allowed_token_ids)):
            raise ValueError(f"allowed_token_ids must be a non-empty list of token ids (ints >= 0), "
                             f"got {self.allowed_token_ids!r}")
        for name in ("include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")

    def token_ids_to_check(self) -> dict[str, list[int]]:
        """The fields that name token ids, for the engine's vocabulary check."""
        return {"logit_bias": sorted(self.logit_bias or ()), "allowed_token_ids": list(self.allowed_token_ids or ())}

    @property
    def has_penalties(self) -> bool:
        """Whether sampling needs the request's token counts (repetition, presence, frequency)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Whether any field changes the logits before sampling (core/logits.py); a request without
        them samples exactly as before, at no cost."""
        return (self.has_penalties or self.min_p > 0 or bool(self.logit_bias) or self.min_tokens > 0
                or bool(self.bad_words) or self.allowed_token_ids is not None)

    def for_sample(self, index: int) -> "SamplingParams":
        """Completion `index` of n: the same parameters as one completion, its own seed."""
        seed = None if self.seq_seed is None else (self.seq_seed + index) % _UINT64
        return dataclasses.replace(self, n=1, seq_seed=seed)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return self._stop

    def resolved_seed(self) -> int:
        """seq_seed, or a fresh random uint64 when the caller gave none."""
        return self.seq_seed if self.seq_seed is not None else random.getrandbits(64)
