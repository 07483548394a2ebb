"""Triton kernels shared by the nvidia and ascend backends (ascend re-tiles two of them for its unified
buffer: backends/ascend/triton_ops.py). Each follows its op's contract in backends/base.py; they run
unchanged under the Triton interpreter (TRITON_INTERPRET=1), which is how CI executes them."""
