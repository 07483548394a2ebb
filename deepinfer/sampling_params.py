"""SamplingParams: how one request is decoded. Every field is validated at construction,
with an error that names the field and says what would be accepted."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any

GREEDY_TEMPERATURE = 1e-5  # below this, sampling is argmax
_UINT64 = 1 << 64
SO_SCHEMA_TYPES = ("json", "regex", "ebnf")
SO_KEYS = ("schema_type", "schema", "trigger_token_ids", "bound_token_id")


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

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return self._stop

    def resolved_seed(self) -> int:
        """seq_seed, or a fresh random uint64 when the caller gave none."""
        return self.seq_seed if self.seq_seed is not None else random.getrandbits(64)
