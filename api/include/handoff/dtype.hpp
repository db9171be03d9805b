// Element types: DLPack codes, NumPy-style names, array-interface typestrs and buffer formats.
#pragma once

#include <handoff/dlpack.h>

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

/// DLDataType is a C struct in the global namespace, so its equality lives there too (for ADL).
[[nodiscard]] constexpr bool operator==(DLDataType a, DLDataType b) noexcept
{
  return a.code == b.code && a.bits == b.bits && a.lanes == b.lanes;
}

namespace handoff {

/// NumPy-style name of a DLPack dtype ("float32", "bool", "bfloat16", "float8_e4m3fn", ...).
/// @throws buffer_error for vector types (lanes != 1) and codes or widths DLPack does not define.
[[nodiscard]] std::string_view dtype_name(DLDataType dtype);

/// The dtype with that NumPy-style name, or nullopt.
[[nodiscard]] std::optional<DLDataType> dtype_from_name(std::string_view name) noexcept;

/// Bytes one element occupies in memory. Sub-byte types (float4/float6) are exchanged padded to a
/// byte; their packed layout is refused at import.
[[nodiscard]] std::size_t itemsize(DLDataType dtype) noexcept;

/// Parses an array-interface typestr ("<f4", "|b1", "<c8").
/// @throws value_error when it is malformed (naming `field`), buffer_error when it is well formed
///         but not exchangeable (byte-swapped, objects, strings, unknown widths).
[[nodiscard]] DLDataType dtype_from_typestr(std::string_view typestr, std::string_view field = "typestr");

/// The array-interface typestr of a dtype in native byte order.
/// @throws buffer_error for dtypes NumPy has no typestr for (bfloat16, float8...).
[[nodiscard]] std::string typestr(DLDataType dtype);

/// Parses a PEP 3118 buffer format of one element ("f", "<d", "Zf", "?").
/// @throws buffer_error when it is byte-swapped, a struct, or otherwise not one plain element.
[[nodiscard]] DLDataType dtype_from_buffer_format(std::string_view format, std::size_t itemsize);

}  // namespace handoff
