#include <handoff/dtype.hpp>
#include <handoff/error.hpp>

#include <fmt/format.h>

#include <array>
#include <bit>
#include <charconv>

namespace handoff {
namespace {

struct named_dtype {
  std::string_view name;
  DLDataType dtype;
};

constexpr DLDataType make(DLDataTypeCode code, int bits) noexcept
{
  return DLDataType{static_cast<std::uint8_t>(code), static_cast<std::uint8_t>(bits), 1};
}

constexpr std::array known_dtypes{
  named_dtype{"bool", make(kDLBool, 8)},
  named_dtype{"int8", make(kDLInt, 8)},
  named_dtype{"int16", make(kDLInt, 16)},
  named_dtype{"int32", make(kDLInt, 32)},
  named_dtype{"int64", make(kDLInt, 64)},
  named_dtype{"uint8", make(kDLUInt, 8)},
  named_dtype{"uint16", make(kDLUInt, 16)},
  named_dtype{"uint32", make(kDLUInt, 32)},
  named_dtype{"uint64", make(kDLUInt, 64)},
  named_dtype{"float16", make(kDLFloat, 16)},
  named_dtype{"float32", make(kDLFloat, 32)},
  named_dtype{"float64", make(kDLFloat, 64)},
  named_dtype{"bfloat16", make(kDLBfloat, 16)},
  named_dtype{"complex32", make(kDLComplex, 32)},
  named_dtype{"complex64", make(kDLComplex, 64)},
  named_dtype{"complex128", make(kDLComplex, 128)},
  named_dtype{"float8_e3m4", make(kDLFloat8_e3m4, 8)},
  named_dtype{"float8_e4m3", make(kDLFloat8_e4m3, 8)},
  named_dtype{"float8_e4m3b11fnuz", make(kDLFloat8_e4m3b11fnuz, 8)},
  named_dtype{"float8_e4m3fn", make(kDLFloat8_e4m3fn, 8)},
  named_dtype{"float8_e4m3fnuz", make(kDLFloat8_e4m3fnuz, 8)},
  named_dtype{"float8_e5m2", make(kDLFloat8_e5m2, 8)},
  named_dtype{"float8_e5m2fnuz", make(kDLFloat8_e5m2fnuz, 8)},
  named_dtype{"float8_e8m0fnu", make(kDLFloat8_e8m0fnu, 8)},
  named_dtype{"float6_e2m3fn", make(kDLFloat6_e2m3fn, 6)},
  named_dtype{"float6_e3m2fn", make(kDLFloat6_e3m2fn, 6)},
  named_dtype{"float4_e2m1fn", make(kDLFloat4_e2m1fn, 4)},
};

// Typestr kinds NumPy understands, by their single-character code.
std::optional<DLDataTypeCode> typestr_kind(char kind) noexcept
{
  switch (kind) {
    case 'b':
      return kDLBool;
    case 'i':
      return kDLInt;
    case 'u':
      return kDLUInt;
    case 'f':
      return kDLFloat;
    case 'c':
      return kDLComplex;
    default:
      return std::nullopt;
  }
}

constexpr bool little_endian = std::endian::native == std::endian::little;

// known_dtypes by code and bits, for a lookup instead of a search (imports ask it per array).
constexpr std::size_t max_code = 31;
constexpr std::size_t max_bits = 128;
constexpr auto known_table = [] {
  std::array<std::array<bool, max_bits + 1>, max_code + 1> table{};
  for (const auto& known : known_dtypes) { table.at(known.dtype.code).at(known.dtype.bits) = true; }
  return table;
}();

bool is_known(DLDataType dtype) noexcept
{
  return dtype.lanes == 1 && dtype.code <= max_code && dtype.bits <= max_bits && known_table[dtype.code][dtype.bits];
}

}  // namespace

std::string_view dtype_name(DLDataType dtype)
{
  HANDOFF_EXPECTS(
    dtype.lanes == 1, buffer_error,
    fmt::format("vector dtypes are not supported (code {}, bits {}, lanes {})", dtype.code, dtype.bits, dtype.lanes));
  for (const auto& known : known_dtypes) {
    if (known.dtype == dtype) { return known.name; }
  }
  throw buffer_error(
    fmt::format("unsupported DLPack dtype (code {}, bits {}, lanes {})", dtype.code, dtype.bits, dtype.lanes));
}

std::optional<DLDataType> dtype_from_name(std::string_view name) noexcept
{
  for (const auto& known : known_dtypes) {
    if (known.name == name) { return known.dtype; }
  }
  return std::nullopt;
}

std::size_t itemsize(DLDataType dtype) noexcept
{
  const std::size_t bits = std::size_t{dtype.bits} * dtype.lanes;
  return (bits + 7) / 8;
}

DLDataType dtype_from_typestr(std::string_view text, std::string_view field)
{
  // Shape: one byte-order character, one kind character, a decimal element size. The kind is
  // judged first: NumPy's own typestrs for kinds DLPack cannot carry ('|O', '<M8[s]') are valid
  // but not exchangeable, so they are buffer errors rather than malformed.
  const auto malformed = [&] {
    return value_error(
      fmt::format("{} '{}' is malformed: expected byte order, kind and size, like '<f4'", field, text));
  };
  if (text.size() < 2 || std::string_view{"<>|="}.find(text[0]) == std::string_view::npos) { throw malformed(); }
  const char order = text[0];
  const auto code = typestr_kind(text[1]);
  HANDOFF_EXPECTS(code.has_value(), buffer_error,
                  fmt::format("{} '{}': kind '{}' cannot be exchanged (only b, i, u, f, c)", field, text, text[1]));
  int size = 0;
  const bool sized =
    text.size() >= 3 &&
    std::from_chars(text.data() + 2, text.data() + text.size(), size).ptr == text.data() + text.size() && size > 0;
  if (!sized) { throw malformed(); }
  const bool swapped = size > 1 && ((order == '>' && little_endian) || (order == '<' && !little_endian));
  HANDOFF_EXPECTS(!swapped, buffer_error,
                  fmt::format("{} '{}' is byte-swapped; DLPack exchanges native byte order only", field, text));
  const DLDataType dtype = make(*code, size * 8);
  HANDOFF_EXPECTS(is_known(dtype), buffer_error,
                  fmt::format("{} '{}': no {}-byte element of kind '{}' can be exchanged", field, text, size, text[1]));
  return dtype;
}

std::string typestr(DLDataType dtype)
{
  char kind = 0;
  switch (dtype.code) {
    case kDLBool:
      kind = 'b';
      break;
    case kDLInt:
      kind = 'i';
      break;
    case kDLUInt:
      kind = 'u';
      break;
    case kDLFloat:
      kind = 'f';
      break;
    case kDLComplex:
      kind = 'c';
      break;
    default:
      break;
  }
  const bool numpy_has_it = kind != 0 && is_known(dtype) && !(dtype.code == kDLComplex && dtype.bits == 32);
  HANDOFF_EXPECTS(
    numpy_has_it, buffer_error,
    fmt::format("dtype {} has no array-interface typestr; exchange it through DLPack", dtype_name(dtype)));
  const std::size_t size = itemsize(dtype);
  const char order = size == 1 ? '|' : (little_endian ? '<' : '>');
  return fmt::format("{}{}{}", order, kind, size);
}

DLDataType dtype_from_buffer_format(std::string_view format, std::size_t size)
{
  std::string_view element = format;
  if (!element.empty() && std::string_view{"@=<>!"}.find(element.front()) != std::string_view::npos) {
    const char order = element.front();
    const bool swapped = (order == '>' || order == '!') ? little_endian : (order == '<' && !little_endian);
    HANDOFF_EXPECTS(!swapped || size <= 1, buffer_error,
                    fmt::format("buffer format '{}' is byte-swapped; DLPack exchanges native byte order only", format));
    element.remove_prefix(1);
  }
  std::optional<DLDataTypeCode> code;
  if (element.size() == 1) {
    switch (element.front()) {
      case '?':
        code = kDLBool;
        break;
      case 'b':
      case 'h':
      case 'i':
      case 'l':
      case 'q':
      case 'n':
        code = kDLInt;
        break;
      case 'B':
      case 'H':
      case 'I':
      case 'L':
      case 'Q':
      case 'N':
        code = kDLUInt;
        break;
      case 'e':
      case 'f':
      case 'd':
        code = kDLFloat;
        break;
      default:
        break;
    }
  } else if (element == "Zf" || element == "Zd") {
    code = kDLComplex;
  }
  HANDOFF_EXPECTS(code.has_value() && size > 0 && size <= 16, buffer_error,
                  fmt::format("buffer format '{}' is not a plain numeric element and cannot be exchanged", format));
  const DLDataType dtype = make(*code, static_cast<int>(size * 8));
  HANDOFF_EXPECTS(is_known(dtype), buffer_error,
                  fmt::format("buffer format '{}' with item size {} cannot be exchanged", format, size));
  return dtype;
}

}  // namespace handoff
