import os

# The nvidia backend's Triton kernels run on CPU tensors through the Triton interpreter; the
# variable must be set before triton is first imported. On a GPU machine, TRITON_INTERPRET=0
# runs the same tests on the device.
os.environ.setdefault("TRITON_INTERPRET", "1")
