"""The shipped models give the outputs recorded before the model runner refactor (issue 37; golden
written on 337051a by tools/record_runner_goldens.py): greedy and seeded sampling, logprobs, stop
tokens and strings, with step graphs and without, multi-step decode, zero-overhead scheduling and
DSpark drafting forced on. Token ids, text and finish reasons must match exactly; logprobs to 1e-5
(the tool's --check compares them bit for bit on the machine that recorded them)."""

from __future__ import annotations

import json
import math

import pytest

import runner_goldens


def _close(want, got) -> bool:
    """Equal, floats to 1e-5 (another CPU's vector units may round the last bits differently)."""
    if isinstance(want, float) and isinstance(got, float):
        return math.isclose(want, got, rel_tol=1e-5, abs_tol=1e-5)
    if isinstance(want, dict) and isinstance(got, dict):
        return want.keys() == got.keys() and all(_close(want[k], got[k]) for k in want)
    if isinstance(want, list) and isinstance(got, list):
        return len(want) == len(got) and all(_close(a, b) for a, b in zip(want, got))
    return want == got


@pytest.mark.slow
@pytest.mark.parametrize("model", sorted(runner_goldens.MODELS))
@pytest.mark.parametrize("mode", list(runner_goldens.MODES))
def test_outputs_match_the_golden(model, mode):
    with open(runner_goldens.GOLDEN) as f:
        want = json.load(f)[model][mode]
    got = json.loads(json.dumps(runner_goldens.run_mode(model, mode)))
    for batch in want:
        for i, (w, g) in enumerate(zip(want[batch], got[batch], strict=True)):
            assert _close(w, g), f"{model} {mode} {batch} request {i}: expected {w}, got {g}"
