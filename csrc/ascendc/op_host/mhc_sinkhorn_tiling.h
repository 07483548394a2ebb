// Host-side tiling for mhc_sinkhorn: tokens are processed in tiles of tileT (n*n floats each), the token
// count padded to whole tiles; tiles are spread over the vector cores.
#pragma once

#include <algorithm>
#include <cstdint>

namespace deepinfer_ascend {

constexpr uint32_t kSinkhornCores = 40;
constexpr uint32_t kSinkhornTileT = 64;  // 64 tokens x 16 floats = 4 KB per buffer at n = 4

struct MhcSinkhornTiling {
    uint32_t blockDim;
    uint32_t paddedTokens;  // a multiple of tileT
    uint32_t n;
    uint32_t tilesPerCore;
    uint32_t tileT;         // tileT * n * n is a multiple of 8 floats (32-byte DataCopy blocks)
};

inline MhcSinkhornTiling mhc_sinkhorn_tiling(uint32_t tokens, uint32_t n)
{
    MhcSinkhornTiling t{};
    t.n = n;
    t.tileT = kSinkhornTileT;  // a multiple of 8, so tileT * n * n is too
    uint32_t tiles = std::max<uint32_t>(1, (tokens + t.tileT - 1) / t.tileT);
    t.paddedTokens = tiles * t.tileT;
    t.blockDim = std::min(tiles, kSinkhornCores);
    t.tilesPerCore = (tiles + t.blockDim - 1) / t.blockDim;
    return t;
}

}  // namespace deepinfer_ascend
