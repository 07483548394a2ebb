#!/usr/bin/env bash
# Everything that needs an NVIDIA GPU, in one prepared run (device time is scarce): each step is
# time-boxed, logs and JSON go to $OUT, and a failing step does not stop the ones after it.
#
#   OUT=gpu_out bash benchmarks/gpu_session.sh
#   OUT=gpu_out STEPS="build_cuda conformance" bash benchmarks/gpu_session.sh   # a subset
#
# Steps, in order of value: build csrc/cuda in place (so the backend uses it); every kernel against
# the cpu reference at DeepSeek-V4-Flash shapes, timed; the engine end to end (CLI on the shipped
# model); throughput vs transformers on the GPU (test model and shipped model); a profile of decode
# steps (where the time goes); the conformance suite with compiled kernels (TRITON_INTERPRET=0);
# DSpark and prefix-cache end-to-end tests; DeepSeek-V4.1 end to end (the conformance step holds its
# golden configs to DeepSeek's reference; `v41`: the trained tiny-dsv41's greedy continuations
# against the reference's, its drafts lossless, the engine's features on V4.1). The device machine reaches no package index: what its
# image lacks travels as wheels in .gpu_wheels/ (git-ignored) and is installed into /tmp/pydeps first:
# `pip download transformers==5.24.0 pytest-xdist pytest-timeout execnet --no-deps -d .gpu_wheels`
# (transformers if the image's predates DeepseekV4ForCausalLM; xdist and timeout are in the test extra).
set -uo pipefail
OUT="${OUT:-gpu_out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="/tmp/pydeps:$PWD" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
if ls .gpu_wheels/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-deps --no-index --target /tmp/pydeps .gpu_wheels/*.whl 2>&1 | tail -2
fi
nvidia-smi -L
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__, torch.cuda.get_device_name())"

STEPS="${STEPS:-build_cuda kernels cli throughput profile conformance e2e v41}"
step() {  # step NAME SECONDS CMD...: runs CMD under a time limit into $OUT/NAME.log, prints its tail
  local name=$1 limit=$2 start rc
  shift 2
  case " $STEPS " in *" $name "*) ;; *) return 0 ;; esac
  start=$(date +%s)
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  echo "=== $name: rc=$rc in $(($(date +%s) - start)) s (limit $limit)"
  tail -n "${TAIL:-25}" "$OUT/$name.log"
}

step build_cuda 60 bash csrc/cuda/build.sh
step kernels 100 python3 benchmarks/gpu_kernels.py --reps 20 --out "$OUT/gpu_kernels.json"
step cli 30 env DEEPINFER_ACCELERATOR=nvidia python3 -m deepinfer generate --prompt "def fibonacci(n):" --max-tokens 48
step throughput 130 bash -c "python3 benchmarks/throughput.py --new-tokens 64 --json $OUT/throughput_test_model.json &&
  python3 benchmarks/throughput.py --model deepinfer/assets/tiny-dsv4 --new-tokens 64 --json $OUT/throughput_shipped.json"
TAIL=60 step profile 60 python3 benchmarks/gpu_profile.py --out "$OUT/gpu_profile.json"
TAIL=40 step conformance 150 env TRITON_INTERPRET=0 python3 -m pytest tests/conformance tests/e2e/test_determinism.py -q \
  -n 8 -p no:cacheprovider --timeout 140 --maxfail 25 -rf
# DSpark and the prefix cache on the GPU (the e2e tests pick the nvidia backend when CUDA is usable)
TAIL=30 step e2e 170 python3 -m pytest tests/e2e/test_dspark.py tests/e2e/test_prefix_cache.py -q -n 8 \
  -p no:cacheprovider --timeout 160 -rf
# DeepSeek-V4.1 on the GPU (the e2e tests pick the nvidia backend when CUDA is usable)
TAIL=30 step v41 150 python3 -m pytest tests/e2e/test_shipped_v41.py tests/e2e/test_v41_engine.py -q -n 8 \
  -p no:cacheprovider --timeout 140 -rf
