// mHC Sinkhorn (the comb part of hc_pre): per token, logits [n, n] (already scaled and biased) ->
// comb = softmax over each row + eps; one column normalisation; then (iters - 1) x (row, column)
// normalisations, each dividing by sum + eps. float32 [T, n*n], T padded by the host to a multiple of
// `tileT` tokens with tileT * n * n % 8 == 0 (32-byte DataCopy blocks).
// n is 4 in DeepSeek-V4 (16 values a token): the row/column sums are scalar loops over the tile in the
// unified buffer; the exponentials are one vector Exp over the whole tile.
// UNCOMPILED: written against the documented AscendC API; see ../README.md.
#include "kernel_operator.h"

using namespace AscendC;

constexpr int32_t BUFFER_NUM = 2;

class KernelMhcSinkhorn {
public:
    __aicore__ inline KernelMhcSinkhorn() {}

    __aicore__ inline void Init(GM_ADDR logits, GM_ADDR comb, uint32_t tokens, uint32_t n, float eps,
                                uint32_t iters, uint32_t tilesPerCore, uint32_t tileT)
    {
        this->n = n;
        this->eps = eps;
        this->iters = iters;
        this->tileT = tileT;
        this->tileLen = tileT * n * n;
        uint32_t tiles = tokens / tileT;  // the host pads T to whole tiles
        uint32_t first = GetBlockIdx() * tilesPerCore;
        this->count = first >= tiles ? 0 : (tiles - first < tilesPerCore ? tiles - first : tilesPerCore);
        inGm.SetGlobalBuffer((__gm__ float *)logits + (uint64_t)first * tileLen);
        outGm.SetGlobalBuffer((__gm__ float *)comb + (uint64_t)first * tileLen);
        pipe.InitBuffer(inQueue, BUFFER_NUM, tileLen * sizeof(float));
        pipe.InitBuffer(outQueue, BUFFER_NUM, tileLen * sizeof(float));
        pipe.InitBuffer(workBuf, tileLen * sizeof(float));
    }

    __aicore__ inline void Process()
    {
        for (uint32_t i = 0; i < count; i++) {
            LocalTensor<float> in = inQueue.AllocTensor<float>();
            DataCopy(in, inGm[(uint64_t)i * tileLen], tileLen);
            inQueue.EnQue(in);
            Compute();
            LocalTensor<float> out = outQueue.DeQue<float>();
            DataCopy(outGm[(uint64_t)i * tileLen], out, tileLen);
            outQueue.FreeTensor(out);
        }
    }

private:
    __aicore__ inline void VectorToScalar()
    {
        event_t id = static_cast<event_t>(GetTPipePtr()->FetchEventID(HardEvent::V_S));
        SetFlag<HardEvent::V_S>(id);
        WaitFlag<HardEvent::V_S>(id);
    }

    __aicore__ inline void ScalarToVector()
    {
        event_t id = static_cast<event_t>(GetTPipePtr()->FetchEventID(HardEvent::S_V));
        SetFlag<HardEvent::S_V>(id);
        WaitFlag<HardEvent::S_V>(id);
    }

    // divide every row (byRow) or column of each token's n x n block by its sum + eps
    __aicore__ inline void Normalise(LocalTensor<float> &x, bool byRow)
    {
        for (uint32_t t = 0; t < tileT; t++) {
            uint32_t base = t * n * n;
            for (uint32_t a = 0; a < n; a++) {
                float sum = 0.0f;
                for (uint32_t b = 0; b < n; b++) {
                    sum += x.GetValue(base + (byRow ? a * n + b : b * n + a));
                }
                float inv = 1.0f / (sum + eps);
                for (uint32_t b = 0; b < n; b++) {
                    uint32_t k = base + (byRow ? a * n + b : b * n + a);
                    x.SetValue(k, x.GetValue(k) * inv);
                }
            }
        }
    }

    __aicore__ inline void Compute()
    {
        LocalTensor<float> in = inQueue.DeQue<float>();
        LocalTensor<float> work = workBuf.Get<float>();
        Adds(work, in, 0.0f, tileLen);  // vector copy: scalar code only touches `work`
        inQueue.FreeTensor(in);
        VectorToScalar();
        for (uint32_t r = 0; r < tileT * n; r++) {  // subtract each row's max (stable softmax)
            float m = work.GetValue(r * n);
            for (uint32_t c = 1; c < n; c++) {
                float v = work.GetValue(r * n + c);
                m = v > m ? v : m;
            }
            for (uint32_t c = 0; c < n; c++) {
                work.SetValue(r * n + c, work.GetValue(r * n + c) - m);
            }
        }
        ScalarToVector();
        Exp(work, work, tileLen);
        VectorToScalar();
        for (uint32_t r = 0; r < tileT * n; r++) {  // softmax over the row, then + eps
            float sum = 0.0f;
            for (uint32_t c = 0; c < n; c++) {
                sum += work.GetValue(r * n + c);
            }
            for (uint32_t c = 0; c < n; c++) {
                work.SetValue(r * n + c, work.GetValue(r * n + c) / sum + eps);
            }
        }
        Normalise(work, false);
        for (uint32_t it = 1; it < iters; it++) {
            Normalise(work, true);
            Normalise(work, false);
        }
        ScalarToVector();
        LocalTensor<float> out = outQueue.AllocTensor<float>();
        Adds(out, work, 0.0f, tileLen);
        outQueue.EnQue(out);
    }

    TPipe pipe;
    TQue<TPosition::VECIN, BUFFER_NUM> inQueue;
    TQue<TPosition::VECOUT, BUFFER_NUM> outQueue;
    TBuf<TPosition::VECCALC> workBuf;
    GlobalTensor<float> inGm, outGm;
    uint32_t n = 0, iters = 0, tileT = 0, tileLen = 0, count = 0;
    float eps = 0.0f;
};

extern "C" __global__ __aicore__ void mhc_sinkhorn_kernel(GM_ADDR logits, GM_ADDR comb, uint32_t tokens, uint32_t n,
                                                          float eps, uint32_t iters, uint32_t tilesPerCore,
                                                          uint32_t tileT)
{
    KernelMhcSinkhorn op;
    op.Init(logits, comb, tokens, n, eps, iters, tilesPerCore, tileT);
    op.Process();
}
