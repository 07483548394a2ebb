// Compressor window reduction: out[w, d] = sum_j softmax_j(gate[w, j, d]) * kv[w, j, d].
// kv, gate float32 [W, L, D] contiguous, D % 8 == 0 (32-byte DataCopy blocks); -inf gates get weight 0.
// Each core takes `windowsPerCore` consecutive windows; a window is done in D chunks of `tileD` channels,
// two passes over its L rows per chunk: the running max, then sum(exp) and sum(exp * kv).
// UNCOMPILED: written against the documented AscendC API; see ../README.md.
#include "kernel_operator.h"

using namespace AscendC;

constexpr int32_t BUFFER_NUM = 2;

class KernelCompressWindows {
public:
    __aicore__ inline KernelCompressWindows() {}

    __aicore__ inline void Init(GM_ADDR kv, GM_ADDR gate, GM_ADDR out, uint32_t windows, uint32_t length,
                                uint32_t dim, uint32_t windowsPerCore, uint32_t tileD)
    {
        this->length = length;
        this->dim = dim;
        this->tileD = tileD;
        uint32_t first = GetBlockIdx() * windowsPerCore;
        this->count = first >= windows ? 0 : (windows - first < windowsPerCore ? windows - first : windowsPerCore);
        kvGm.SetGlobalBuffer((__gm__ float *)kv + (uint64_t)first * length * dim);
        gateGm.SetGlobalBuffer((__gm__ float *)gate + (uint64_t)first * length * dim);
        outGm.SetGlobalBuffer((__gm__ float *)out + (uint64_t)first * dim);
        pipe.InitBuffer(inQueueGate, BUFFER_NUM, tileD * sizeof(float));
        pipe.InitBuffer(inQueueKv, BUFFER_NUM, tileD * sizeof(float));
        pipe.InitBuffer(outQueue, BUFFER_NUM, tileD * sizeof(float));
        pipe.InitBuffer(maxBuf, tileD * sizeof(float));
        pipe.InitBuffer(sumBuf, tileD * sizeof(float));
        pipe.InitBuffer(accBuf, tileD * sizeof(float));
        pipe.InitBuffer(expBuf, tileD * sizeof(float));
    }

    __aicore__ inline void Process()
    {
        for (uint32_t w = 0; w < count; w++) {
            for (uint32_t d0 = 0; d0 < dim; d0 += tileD) {
                uint32_t n = dim - d0 < tileD ? dim - d0 : tileD;
                Chunk(w, d0, n);
            }
        }
    }

private:
    __aicore__ inline uint64_t Offset(uint32_t w, uint32_t j, uint32_t d0) const
    {
        return ((uint64_t)w * length + j) * dim + d0;
    }

    __aicore__ inline void CopyIn(TQue<TPosition::VECIN, BUFFER_NUM> &queue, GlobalTensor<float> &src,
                                  uint64_t offset, uint32_t n)
    {
        LocalTensor<float> local = queue.AllocTensor<float>();
        DataCopy(local, src[offset], n);
        queue.EnQue(local);
    }

    __aicore__ inline void Chunk(uint32_t w, uint32_t d0, uint32_t n)
    {
        LocalTensor<float> maxLocal = maxBuf.Get<float>();
        LocalTensor<float> sumLocal = sumBuf.Get<float>();
        LocalTensor<float> accLocal = accBuf.Get<float>();
        LocalTensor<float> expLocal = expBuf.Get<float>();
        // pass 1: per-channel max over the window's rows
        for (uint32_t j = 0; j < length; j++) {
            CopyIn(inQueueGate, gateGm, Offset(w, j, d0), n);
            LocalTensor<float> g = inQueueGate.DeQue<float>();
            if (j == 0) {
                Adds(maxLocal, g, 0.0f, n);
            } else {
                Max(maxLocal, maxLocal, g, n);
            }
            inQueueGate.FreeTensor(g);
        }
        // pass 2: e = exp(gate - max); sum += e; acc += e * kv
        Duplicate(sumLocal, 0.0f, n);
        Duplicate(accLocal, 0.0f, n);
        for (uint32_t j = 0; j < length; j++) {
            CopyIn(inQueueGate, gateGm, Offset(w, j, d0), n);
            CopyIn(inQueueKv, kvGm, Offset(w, j, d0), n);
            LocalTensor<float> g = inQueueGate.DeQue<float>();
            LocalTensor<float> kv = inQueueKv.DeQue<float>();
            Sub(expLocal, g, maxLocal, n);
            Exp(expLocal, expLocal, n);
            Add(sumLocal, sumLocal, expLocal, n);
            Mul(expLocal, expLocal, kv, n);
            Add(accLocal, accLocal, expLocal, n);
            inQueueGate.FreeTensor(g);
            inQueueKv.FreeTensor(kv);
        }
        LocalTensor<float> o = outQueue.AllocTensor<float>();
        Div(o, accLocal, sumLocal, n);
        outQueue.EnQue(o);
        LocalTensor<float> ready = outQueue.DeQue<float>();
        DataCopy(outGm[(uint64_t)w * dim + d0], ready, n);
        outQueue.FreeTensor(ready);
    }

    TPipe pipe;
    TQue<TPosition::VECIN, BUFFER_NUM> inQueueGate, inQueueKv;
    TQue<TPosition::VECOUT, BUFFER_NUM> outQueue;
    TBuf<TPosition::VECCALC> maxBuf, sumBuf, accBuf, expBuf;
    GlobalTensor<float> kvGm, gateGm, outGm;
    uint32_t length = 0, dim = 0, tileD = 0, count = 0;
};

extern "C" __global__ __aicore__ void compress_windows_kernel(GM_ADDR kv, GM_ADDR gate, GM_ADDR out,
                                                              uint32_t windows, uint32_t length, uint32_t dim,
                                                              uint32_t windowsPerCore, uint32_t tileD)
{
    KernelCompressWindows op;
    op.Init(kv, gate, out, windows, length, dim, windowsPerCore, tileD);
    op.Process();
}
