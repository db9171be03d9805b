#include <handoff/dtype.hpp>
#include <handoff/error.hpp>

#include <gtest/gtest.h>

namespace {

using namespace handoff;

TEST(DtypeTest, NamesRoundTrip)
{
  for (const char* name : {"bool",
                           "int8",
                           "int16",
                           "int32",
                           "int64",
                           "uint8",
                           "uint16",
                           "uint32",
                           "uint64",
                           "float16",
                           "float32",
                           "float64",
                           "bfloat16",
                           "complex32",
                           "complex64",
                           "complex128",
                           "float8_e3m4",
                           "float8_e4m3",
                           "float8_e4m3b11fnuz",
                           "float8_e4m3fn",
                           "float8_e4m3fnuz",
                           "float8_e5m2",
                           "float8_e5m2fnuz",
                           "float8_e8m0fnu",
                           "float6_e2m3fn",
                           "float6_e3m2fn",
                           "float4_e2m1fn"}) {
    const auto dtype = dtype_from_name(name);
    ASSERT_TRUE(dtype.has_value()) << name;
    EXPECT_EQ(dtype_name(*dtype), name);
  }
  EXPECT_FALSE(dtype_from_name("float128").has_value());
}

TEST(DtypeTest, RejectsVectorAndUnknownTypes)
{
  EXPECT_THROW((void)dtype_name(DLDataType{kDLFloat, 32, 4}), buffer_error);
  EXPECT_THROW((void)dtype_name(DLDataType{kDLFloat, 24, 1}), buffer_error);
  EXPECT_THROW((void)dtype_name(DLDataType{kDLOpaqueHandle, 64, 1}), buffer_error);
  EXPECT_THROW((void)dtype_name(DLDataType{99, 8, 1}), buffer_error);
}

TEST(DtypeTest, ItemsizePadsSubByteTypes)
{
  EXPECT_EQ(itemsize(*dtype_from_name("float64")), 8U);
  EXPECT_EQ(itemsize(*dtype_from_name("bool")), 1U);
  EXPECT_EQ(itemsize(*dtype_from_name("float4_e2m1fn")), 1U);
  EXPECT_EQ(itemsize(*dtype_from_name("complex128")), 16U);
}

TEST(DtypeTest, Typestr)
{
  EXPECT_EQ(dtype_from_typestr("<f4"), *dtype_from_name("float32"));
  EXPECT_EQ(dtype_from_typestr("|b1"), *dtype_from_name("bool"));
  EXPECT_EQ(dtype_from_typestr("|u1"), *dtype_from_name("uint8"));
  EXPECT_EQ(dtype_from_typestr("<c16"), *dtype_from_name("complex128"));
  EXPECT_EQ(dtype_from_typestr(">i1"), *dtype_from_name("int8"));  // one byte has no byte order
  EXPECT_THROW((void)dtype_from_typestr(">f4"), buffer_error);
  EXPECT_THROW((void)dtype_from_typestr("|O8"), buffer_error);
  EXPECT_THROW((void)dtype_from_typestr("|O"), buffer_error);  // NumPy's own, valid but not exchangeable
  EXPECT_THROW((void)dtype_from_typestr("<M8[s]"), buffer_error);
  EXPECT_THROW((void)dtype_from_typestr("<f0"), value_error);
  EXPECT_THROW((void)dtype_from_typestr("<f3"), buffer_error);
  EXPECT_THROW((void)dtype_from_typestr("f4"), value_error);
  EXPECT_THROW((void)dtype_from_typestr("<f"), value_error);
  EXPECT_THROW((void)dtype_from_typestr("<fx"), value_error);
  EXPECT_EQ(typestr(*dtype_from_name("float32")), "<f4");
  EXPECT_EQ(typestr(*dtype_from_name("bool")), "|b1");
  EXPECT_THROW((void)typestr(*dtype_from_name("bfloat16")), buffer_error);
  EXPECT_THROW((void)typestr(*dtype_from_name("complex32")), buffer_error);
}

TEST(DtypeTest, BufferFormats)
{
  EXPECT_EQ(dtype_from_buffer_format("f", 4), *dtype_from_name("float32"));
  EXPECT_EQ(dtype_from_buffer_format("<d", 8), *dtype_from_name("float64"));
  EXPECT_EQ(dtype_from_buffer_format("?", 1), *dtype_from_name("bool"));
  EXPECT_EQ(dtype_from_buffer_format("Zf", 8), *dtype_from_name("complex64"));
  EXPECT_EQ(dtype_from_buffer_format("l", 8), *dtype_from_name("int64"));
  EXPECT_EQ(dtype_from_buffer_format("B", 1), *dtype_from_name("uint8"));
  EXPECT_THROW((void)dtype_from_buffer_format(">f", 4), buffer_error);
  EXPECT_THROW((void)dtype_from_buffer_format("T{f:x:}", 4), buffer_error);
  EXPECT_THROW((void)dtype_from_buffer_format("O", 8), buffer_error);
}

}  // namespace
