"""Tiny V4 checkpoint and the single-process reference outputs the parallel layouts must match."""

from __future__ import annotations

import pytest

from parallel_helpers import run_llm
from tiny_models import make_hf_model


@pytest.fixture(scope="session")
def moe_model_dir(tmp_path_factory):
    """8 experts, top-2, two hash-routed layers and all three attention kinds."""
    hf, _ = make_hf_model("mixed_hc4_yarn", seed=11)
    path = tmp_path_factory.mktemp("tiny_v4_parallel")
    hf.save_pretrained(path, safe_serialization=True)
    return str(path)

@pytest.fixture(scope="session")
def reference_outputs(moe_model_dir):
    return run_llm(moe_model_dir)
