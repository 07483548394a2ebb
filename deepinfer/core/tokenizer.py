"""Tokenizer from a model directory (tokenizer.json through the `tokenizers` library)
and incremental detokenization."""

from __future__ import annotations

import json
import os
import re

from tokenizers import Tokenizer as _HFTokenizer


class TokenizerError(ValueError):
    pass


class Tokenizer:
    def __init__(self, path: str | os.PathLike, bos_token_id: int | None = None):
        path = os.fspath(path)
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise TokenizerError(f"no tokenizer.json at {path!r}; pass tokenizer=<dir with tokenizer.json>")
        self._tok = _HFTokenizer.from_file(file)
        config = {}
        config_file = os.path.join(os.path.dirname(file), "tokenizer_config.json")
        if os.path.isfile(config_file):
            with open(config_file) as f:
                config = json.load(f)
        self.bos_token_id = bos_token_id
        self.add_bos = bool(config.get("add_bos_token", bos_token_id is not None))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True,
               placeholders: dict[str, int] | None = None) -> list[int]:
        """Token ids of `text`; add_special_tokens=False for text that already holds its special
        tokens (a chat prompt that starts with the BOS string): no BOS is added then.
        `placeholders` (text -> token id): each occurrence becomes that one token whatever the
        tokenizer would make of it (a model's multimodal placeholders); the text between them is
        tokenized piece by piece, as a tokenizer splits at its own special tokens."""
        if placeholders:
            pattern = "|".join(re.escape(p) for p in sorted(placeholders, key=len, reverse=True))
            pieces = re.split(f"({pattern})", text)  # text, placeholder, text, ...
            ids = self.encode(pieces[0], add_special_tokens)
            for i in range(1, len(pieces), 2):
                ids.append(placeholders[pieces[i]])
                if pieces[i + 1]:
                    ids += self._tok.encode(pieces[i + 1], add_special_tokens=False).ids
            return ids
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if not add_special_tokens:
            return ids
        if self.add_bos and self.bos_token_id is not None and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def bad_words_ids(self, words: list[str]) -> list[list[int]]:
        """SamplingParams.bad_words as token sequences, as vLLM makes them: each word as written and
        with a leading space (how it is spelled after another word), without special tokens."""
        out: list[list[int]] = []
        for word in words:
            for spelling in (word, " " + word.lstrip(" ")):
                ids = self._tok.encode(spelling, add_special_tokens=False).ids
                if ids and ids not in out:
                    out.append(ids)
        return out


class IncrementalDetokenizer:
    """Text grows token by token without re-decoding everything: decode a short window
    of recent tokens and emit what it adds, holding back incomplete UTF-8 ("\ufffd")."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_ids[-6:])  # context so merges at the boundary decode correctly
        self.prefix = 0
        self.read = len(self.ids)

    def step(self, token_id: int) -> str:
        self.ids.append(token_id)
        before = self.tokenizer.decode(self.ids[self.prefix:self.read], self.skip_special_tokens)
        after = self.tokenizer.decode(self.ids[self.prefix:], self.skip_special_tokens)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before):]
        return ""

    def flush(self) -> str:
        """Whatever is held back (an incomplete character at the end of generation)."""
        before = self.tokenizer.decode(self.ids[self.prefix:self.read], self.skip_special_tokens)
        after = self.tokenizer.decode(self.ids[self.prefix:], self.skip_special_tokens)
        self.prefix = self.read = len(self.ids)
        return after[len(before):]
