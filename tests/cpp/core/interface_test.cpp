// Validation of the array-interface dicts: each malformed field named, each error of its type.
#include <handoff/error.hpp>
#include <handoff/interface.hpp>

#include <gtest/gtest.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace {

using namespace handoff;

class InterfaceTest : public ::testing::Test {
 protected:
  // A valid (2, 3) float32 dict over storage_.
  interface_dict dict()
  {
    interface_dict d;
    d.version = 3;
    d.shape = extents{2, 3};
    d.typestr = "<f4";
    d.data = interface_pointer{static_cast<std::int64_t>(reinterpret_cast<std::uintptr_t>(storage_.data())), false};
    return d;
  }

  interface_buffer buffer() { return {storage_.data(), static_cast<std::int64_t>(sizeof storage_), false}; }

  std::array<float, 8> storage_{};
};

// Expects `call` to throw `Error` with a message containing every piece of `parts`.
template <typename Error, typename Call>
void expect_error(Call&& call, std::initializer_list<const char*> parts)
{
  try {
    (void)call();
    FAIL() << "no exception";
  } catch (const Error& e) {
    for (const char* part : parts) { EXPECT_NE(std::string{e.what()}.find(part), std::string::npos) << e.what(); }
  }
}

TEST_F(InterfaceTest, ValidDictGivesTheLayout)
{
  const array_layout layout = validate_array_interface(dict());
  EXPECT_EQ(layout.data, storage_.data());
  EXPECT_EQ(layout.shape, (extents{2, 3}));
  EXPECT_EQ(layout.strides, (extents{3, 1}));
  EXPECT_FALSE(layout.readonly);

  interface_dict strided = dict();
  strided.strides = extents{4, 8};
  EXPECT_EQ(validate_array_interface(strided).strides, (extents{1, 2}));
}

TEST_F(InterfaceTest, MissingKeysAreNamed)
{
  for (const char* key : {"shape", "typestr", "data"}) {
    interface_dict d = dict();
    if (std::string{key} == "shape") { d.shape.reset(); }
    if (std::string{key} == "typestr") { d.typestr.reset(); }
    if (std::string{key} == "data") { d.data.reset(); }
    expect_error<value_error>([&] { return validate_array_interface(d); }, {"__array_interface__ has no", key});
    d.version = 3;
    expect_error<value_error>([&] { return validate_cuda_array_interface(d); }, {"__cuda_array_interface__", key});
  }
  interface_dict d = dict();
  d.version.reset();
  EXPECT_NO_THROW((void)validate_array_interface(d));  // optional for __array_interface__ only
  expect_error<value_error>([&] { return validate_cuda_array_interface(d); }, {"'version'"});
}

TEST_F(InterfaceTest, MalformedValuesAreValueErrorsNamingTheField)
{
  const auto with = [&](auto change) {
    interface_dict d = dict();
    change(d);
    return d;
  };
  const std::pair<interface_dict, const char*> cases[] = {
    {with([](interface_dict& d) { d.version = 2; }), "'version' 2"},
    {with([](interface_dict& d) {
       d.shape = extents{2, -3};
     }),
     "'shape'[1] is negative"},
    {with([](interface_dict& d) { d.strides = extents{4}; }), "'strides' has 1 entries"},
    {with([](interface_dict& d) { d.typestr = "f4"; }), "'typestr' 'f4' is malformed"},
    {with([](interface_dict& d) { d.data->address = -8; }), "'data'[0] is a negative pointer"},
    {with([](interface_dict& d) { d.data->address = 0; }), "data is a null pointer"},
    {with([](interface_dict& d) {
       d.shape = extents{std::int64_t{1} << 62, 4};
     }),
     "overflows"},
  };
  for (const auto& [d, message] : cases) {
    // an init-capture: clang 14 cannot capture structured bindings
    expect_error<value_error>([&d = d] { return validate_array_interface(d); }, {"__array_interface__", message});
  }
  interface_dict cuda = dict();
  cuda.version = 4;
  expect_error<value_error>([&] { return validate_cuda_array_interface(cuda); }, {"'version' 4"});
  cuda.version = 3;
  cuda.stream = 0;
  expect_error<value_error>([&] { return validate_cuda_array_interface(cuda); }, {"'stream' 0"});
  cuda.stream = -2;  // no stream: -1 (no ordering) is the only negative value
  expect_error<value_error>([&] { return validate_cuda_array_interface(cuda); },
                            {"__cuda_array_interface__", "'stream' -2"});
}

TEST_F(InterfaceTest, EmptyArraysMayHaveANullPointer)
{
  interface_dict d = dict();
  d.shape = extents{0, 3};
  d.data->address = 0;
  EXPECT_EQ(validate_cuda_array_interface(d).layout.data, nullptr);
}

TEST_F(InterfaceTest, UnexchangeableDataIsABufferError)
{
  interface_dict d = dict();
  d.typestr = ">f4";
  expect_error<buffer_error>([&] { return validate_array_interface(d); }, {"byte-swapped"});
  d = dict();
  d.strides = extents{12, 2};
  expect_error<buffer_error>([&] { return validate_array_interface(d); }, {"'strides'[1] = 2 is not a multiple"});
}

TEST_F(InterfaceTest, MaskIsNotImplemented)
{
  interface_dict d = dict();
  d.masked = true;
  expect_error<not_implemented_error>([&] { return validate_array_interface(d); }, {"mask"});
  expect_error<not_implemented_error>([&] { return validate_cuda_array_interface(d); }, {"mask"});
}

TEST_F(InterfaceTest, CudaStreamIsKept)
{
  interface_dict d = dict();
  EXPECT_EQ(validate_cuda_array_interface(d).stream, std::nullopt);
  d.stream = 2;
  EXPECT_EQ(validate_cuda_array_interface(d).stream, 2);
  d.version = 0;
  EXPECT_NO_THROW((void)validate_cuda_array_interface(d));
}

TEST_F(InterfaceTest, SizeOneAxisMayHaveAnyStride)
{
  interface_dict d = dict();
  d.shape = extents{2, 1, 3};
  d.strides = extents{12, 7, 4};
  EXPECT_EQ(validate_array_interface(d).strides, (extents{3, 3, 1}));
  EXPECT_EQ(validate_cuda_array_interface(d).layout.strides, (extents{3, 3, 1}));
  EXPECT_EQ(element_strides(std::array<std::int64_t, 2>{1, 4}, std::array<std::int64_t, 2>{-3, 8}, 8, "s"),
            (extents{4, 1}));
}

TEST_F(InterfaceTest, BufferDataStaysInsideTheBuffer)
{
  interface_dict d = dict();
  d.data.reset();
  d.shape = extents{2};
  d.offset = 24;
  const array_layout layout = validate_array_interface(d, buffer());
  EXPECT_EQ(layout.data, storage_.data() + 6);

  const auto refused = [&](extents shape, std::optional<extents> strides, std::int64_t offset, const char* message) {
    interface_dict bad = dict();
    bad.data.reset();
    bad.shape = std::move(shape);
    bad.strides = std::move(strides);
    bad.offset = offset;
    expect_error<value_error>([&] { return validate_array_interface(bad, buffer()); }, {message});
  };
  refused({3}, std::nullopt, 24, "reach outside the 32-byte buffer");
  refused({9}, std::nullopt, 0, "reach outside");
  refused({2}, extents{-4}, 0, "reach outside");
  refused({2, 2}, extents{8, std::int64_t{1} << 61}, 0, "reach outside");
  refused({1}, std::nullopt, -4, "'offset' -4");
  refused({0}, std::nullopt, 36, "'offset' 36");

  d.shape = extents{2};
  d.strides = extents{-4};
  d.offset = 4;
  EXPECT_EQ(validate_array_interface(d, buffer()).data, storage_.data() + 1);  // reaches back to byte 0
  interface_buffer readonly = buffer();
  readonly.readonly = true;
  EXPECT_TRUE(validate_array_interface(d, readonly).readonly);
}

}  // namespace
