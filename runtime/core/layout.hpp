// Private: what the layout code shares with the DLPack import.
#pragma once

#include <cstdint>
#include <span>

namespace handoff::detail {

/// Row-major strides of `shape`, written to `strides` (shape.size() entries). The product wraps
/// instead of overflowing (undefined) for a shape whose element count does not fit in int64:
/// validate_layout refuses such a shape, and these strides are computed before it runs.
void fill_contiguous_strides(std::span<const std::int64_t> shape, std::int64_t* strides) noexcept;

}  // namespace handoff::detail
