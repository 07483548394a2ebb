"""SamplingParams' logit ops on the cpu backend against transformers' logits processors (the
checks: tests/logits_checks.py; nvidia's and ascend's run in tests/conformance and tests/ascend)."""

import pytest

from deepinfer.backends import get_accelerator
from logits_checks import cases, check_case, check_op_conformance


@pytest.fixture(scope="module")
def cpu():
    return get_accelerator("cpu")


@pytest.mark.parametrize("case", range(len(cases())), ids=[c[0] for c in cases()])
def test_against_transformers(cpu, case):
    name, temperature, ours, theirs = cases()[case]
    check_case(cpu, name, temperature, ours, theirs, seed=100 + case)


def test_ops_against_reference(cpu):
    check_op_conformance(cpu)
