"""The same LLM(...) call under torchrun: each process is a rank, every rank returns every output."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_torchrun_dp2_ep2_matches_one_process(moe_model_dir, reference_outputs, tmp_path):
    here = os.path.dirname(__file__)
    # TMPDIR: torchrun makes a log folder under the temp dir (torchelastic_*) and leaves it there; in
    # tmp_path it goes with pytest's other folders instead of piling up in /tmp run after run
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(here)), here,
                                                         os.environ.get("PYTHONPATH", "")]),
               TMPDIR=str(tmp_path))
    layout = json.dumps(dict(expert_parallel_size=2, data_parallel_size=2))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(here, "torchrun_generate.py"), moe_model_dir, str(tmp_path), layout]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for ref, (tokens, logprobs) in zip(reference_outputs, got):
            assert tokens == ref.outputs[0].token_ids
            for a, b in zip(ref.outputs[0].logprobs, logprobs):
                assert max(abs(a[t] - b[str(t)]) for t in a) < 1e-4
