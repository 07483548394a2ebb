"""Record (or check) tests/goldens/runner_goldens.json: the shipped models' outputs under every way
the engine runs a step (tests/runner_goldens.py lists the modes and requests).

    python tools/record_runner_goldens.py          # write the golden (done on 337051a, before issue 37)
    python tools/record_runner_goldens.py --check  # compare this tree's outputs with it, bit for bit
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import runner_goldens  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="compare with the stored golden instead of writing it")
    args = ap.parse_args()
    got = runner_goldens.run_all()
    if not args.check:
        with open(runner_goldens.GOLDEN, "w") as f:
            json.dump(got, f, indent=1, sort_keys=True)
            f.write("\n")
        print(f"wrote {runner_goldens.GOLDEN}")
        return 0
    with open(runner_goldens.GOLDEN) as f:
        want = json.load(f)
    got = json.loads(json.dumps(got))  # the same key types as the stored file
    bad = [(model, mode) for model in want for mode in want[model] if want[model][mode] != got[model][mode]]
    for model, mode in bad:
        print(f"DIFFERENT: {model} {mode}")
    print("bit-identical" if not bad else f"{len(bad)} mode(s) differ")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
