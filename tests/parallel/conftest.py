"""Tiny V4 and V3 checkpoints and the single-process reference outputs the parallel layouts must match."""

from __future__ import annotations

import pytest

from parallel_helpers import run_llm
import tiny_models_v3
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


@pytest.fixture(scope="session")
def v3_model_dir(tmp_path_factory):
    """DeepSeek-V3: 16 experts top-4 in 4 groups (2 kept), one dense layer first, hub layout."""
    hf, _ = tiny_models_v3.make_hf_model("v3_yarn_groups", seed=11)
    path = tmp_path_factory.mktemp("tiny_v3_parallel")
    tiny_models_v3.save_hf_layout(hf, path)
    return str(path)


@pytest.fixture(scope="session", params=["v4", "v3"])
def family_case(request):
    """(model dir, its single-process outputs) of each family's tiny MoE model in turn."""
    path = request.getfixturevalue("moe_model_dir" if request.param == "v4" else "v3_model_dir")
    return path, request.getfixturevalue("reference_outputs") if request.param == "v4" else run_llm(path)
