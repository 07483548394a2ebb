"""Reading a `config.json`'s keys, shared by every family's config parser: typed, checked reads whose
errors name the file and the key, the fixed keys a family does not vary, and the stop tokens."""

from __future__ import annotations

from typing import NoReturn

from deepinfer.models.base import ConfigError


class ConfigReader:
    """Typed reads of one config dict. `label` prefixes the key in messages (V4.1 keeps its keys in
    'text_config'); `positive` is the default for whether a number must be > 0 rather than >= 0."""

    def __init__(self, data: dict, source: str, label: str = "", positive: bool = False):
        self.data, self.source, self.label, self.positive = data, source, label, positive

    def fail(self, msg: str) -> NoReturn:
        raise ConfigError(f"{self.source}: {msg}")

    def need(self, key: str, kind=int, default=None, positive: bool | None = None):
        """data[key] (or `default`) as `kind`: an int read as a float is widened; a bool is never an int;
        a number below zero (or at zero, with `positive`) is refused."""
        positive = self.positive if positive is None else positive
        value = self.data.get(key, default)
        if value is None:
            self.fail(f"missing required {self.label}key {key!r}")
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
            self.fail(f"{self.label}{key!r} must be {kind.__name__}, got {value!r}")
        if kind in (int, float) and (value <= 0 if positive else value < 0):
            self.fail(f"{self.label}{key!r} must be {'> 0' if positive else '>= 0'}, got {value!r}")
        return value

    def int_list(self, key: str, default=None) -> list[int]:
        value = self.data.get(key, default)
        if value is None:
            self.fail(f"missing required {self.label}key {key!r}")
        if not isinstance(value, list) or any(not isinstance(v, int) or isinstance(v, bool) for v in value):
            self.fail(f"{self.label}{key!r} must be a list of ints, got {value!r}")
        return list(value)

    def check_fixed(self, fixed: dict, model: str) -> None:
        """Keys the family does not vary: absent, or the one value `model` uses."""
        for key, want in fixed.items():
            if key in self.data and self.data[key] != want:
                self.fail(f"{self.label}{key!r} = {self.data[key]!r} is not supported ({model} uses {want!r})")

    def eos_token_ids(self) -> list[int]:
        """eos_token_id as a list: one id, a list of ids, or null (none); 1 when the key is absent."""
        eos = self.data.get("eos_token_id", 1)
        return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def check_token_ids(eos_token_ids: list, vocab_size: int, source: str) -> None:
    """Every stop token is a token id of the vocabulary."""
    for eos in eos_token_ids:
        if not isinstance(eos, int) or not 0 <= eos < vocab_size:
            raise ConfigError(f"{source}: eos_token_id {eos!r} is not a token id in [0, vocab_size={vocab_size})")


def failer(source: str):
    """fail(msg): raise a ConfigError that names `source` (a validate method's one way out)."""
    def fail(msg: str) -> NoReturn:
        raise ConfigError(f"{source}: {msg}")
    return fail
