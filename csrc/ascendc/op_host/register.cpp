// The torch.ops.deepinfer_ascend schemas (deepinfer/backends/ascend/ascendc.py documents the contracts;
// tests/ascend/test_ascendc_glue.py registers these same strings with a CPU reference to test the glue).
#include <torch/library.h>

TORCH_LIBRARY(deepinfer_ascend, m)
{
    m.def("compress_windows(Tensor kv, Tensor gate) -> Tensor");
    m.def("mhc_sinkhorn(Tensor logits, int n, float eps, int iters) -> Tensor");
}
