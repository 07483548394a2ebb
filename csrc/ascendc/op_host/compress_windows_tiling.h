// Host-side tiling for compress_windows: how windows are spread over the vector cores and how wide a
// channel chunk is. Passed to the kernel as scalar launch arguments.
#pragma once

#include <algorithm>
#include <cstdint>

namespace deepinfer_ascend {

// Vector cores the launch spreads over (Atlas A2 has 40-48 AIV cores; a larger grid just runs in waves).
constexpr uint32_t kVectorCores = 40;
// Channels per chunk: 2 x gate + 2 x kv + 2 x out queues + 4 scratch buffers of tileD floats = 40 KB at
// 1024, far inside the 192 KB unified buffer.
constexpr uint32_t kCompressTileD = 1024;

struct CompressWindowsTiling {
    uint32_t blockDim;
    uint32_t windows;
    uint32_t length;
    uint32_t dim;
    uint32_t windowsPerCore;
    uint32_t tileD;  // a multiple of 8 floats (32-byte DataCopy blocks)
};

inline CompressWindowsTiling compress_windows_tiling(uint32_t windows, uint32_t length, uint32_t dim)
{
    CompressWindowsTiling t{};
    t.windows = windows;
    t.length = length;
    t.dim = dim;
    t.blockDim = std::max<uint32_t>(1, std::min(windows, kVectorCores));
    t.windowsPerCore = (windows + t.blockDim - 1) / t.blockDim;
    t.tileD = std::min(dim, kCompressTileD);
    return t;
}

}  // namespace deepinfer_ascend
