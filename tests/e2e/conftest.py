"""Tiny random models saved as real model directories (config.json, safetensors, tokenizer.json):
DeepSeek-V4 (`tiny_model_dir`), DeepSeek-V3 in the hub's layout (`tiny_v3_model_dir`), and
`family_model_dir`, either of them, for the tests that hold for every family."""

from __future__ import annotations

import pytest

import tiny_models_v3
from tiny_models import make_hf_model


def _write_tokenizer(path, vocab_size: int) -> None:
    """A byte-level BPE trained on a little text, padded to the model's vocab, with bos/eos."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|bos|>", "<|eos|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = ["def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
            "the quick brown fox jumps over the lazy dog. " * 3, "import os\nimport sys\nprint('hello world')\n"]
    tok.train_from_iterator(text * 20, trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text('{"add_bos_token": true, "bos_token": "<|bos|>", '
                                                '"eos_token": "<|eos|>"}')


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """(model dir, hf model) for the 'mixed_hc4_yarn' config: all three layer types."""
    hf, _ = make_hf_model("mixed_hc4_yarn", seed=11)
    path = tmp_path_factory.mktemp("tiny_v4")
    hf.save_pretrained(path, safe_serialization=True)
    _write_tokenizer(path, hf.config.vocab_size)
    return path, hf


@pytest.fixture(scope="session")
def tiny_v3_model_dir(tmp_path_factory):
    """(model dir, hf model) for the V3 'v3_yarn_groups' config (q LoRA, V3's YaRN, group-limited
    routing), written as deepseek-ai/DeepSeek-V3 is on the hub (per-expert tensors in two shards,
    the hub's config.json keys), float32."""
    hf, _ = tiny_models_v3.make_hf_model("v3_yarn_groups", seed=11)
    path = tmp_path_factory.mktemp("tiny_v3")
    tiny_models_v3.save_hf_layout(hf, path)
    _write_tokenizer(path, hf.config.vocab_size)
    return path, hf


FAMILY_DIRS = {"v4": "tiny_model_dir", "v3": "tiny_v3_model_dir"}


@pytest.fixture(scope="session", params=sorted(FAMILY_DIRS))
def family_model_dir(request):
    """(model dir, hf model) of each family's tiny model in turn: tests that hold for any family."""
    return request.getfixturevalue(FAMILY_DIRS[request.param])
