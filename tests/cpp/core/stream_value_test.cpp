// Every cell of the contract's stream table.
#include <handoff/error.hpp>
#include <handoff/stream_value.hpp>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <optional>
#include <string_view>

namespace {

using handoff::classify_stream;
using handoff::stream_order;
using handoff::stream_request;

constexpr std::optional<std::int64_t> none = std::nullopt;

class StreamValueTest : public ::testing::TestWithParam<DLDeviceType> {};

INSTANTIATE_TEST_SUITE_P(Cuda, StreamValueTest, ::testing::Values(kDLCUDA, kDLCUDAHost, kDLCUDAManaged));

TEST_P(StreamValueTest, CudaTable)
{
  const DLDeviceType d = GetParam();
  EXPECT_EQ(classify_stream(d, none), (stream_request{stream_order::legacy_default, 0}));
  EXPECT_EQ(classify_stream(d, -1), (stream_request{stream_order::none, 0}));
  EXPECT_THROW((void)classify_stream(d, 0), handoff::value_error);
  EXPECT_EQ(classify_stream(d, 1), (stream_request{stream_order::legacy_default, 0}));
  EXPECT_EQ(classify_stream(d, 2), (stream_request{stream_order::per_thread_default, 0}));
  EXPECT_EQ(classify_stream(d, 3), (stream_request{stream_order::handle, 3}));
  EXPECT_EQ(classify_stream(d, 0x7f0012345600), (stream_request{stream_order::handle, 0x7f0012345600}));
  EXPECT_THROW((void)classify_stream(d, -2), handoff::value_error);
  EXPECT_THROW((void)classify_stream(d, INT64_MIN), handoff::value_error);
}

class RocmStreamValueTest : public ::testing::TestWithParam<DLDeviceType> {};

INSTANTIATE_TEST_SUITE_P(Rocm, RocmStreamValueTest, ::testing::Values(kDLROCM, kDLROCMHost));

TEST_P(RocmStreamValueTest, RocmTable)
{
  const DLDeviceType d = GetParam();
  EXPECT_EQ(classify_stream(d, none), (stream_request{stream_order::default_stream, 0}));
  EXPECT_EQ(classify_stream(d, -1), (stream_request{stream_order::none, 0}));
  EXPECT_EQ(classify_stream(d, 0), (stream_request{stream_order::default_stream, 0}));
  EXPECT_THROW((void)classify_stream(d, 1), handoff::value_error);
  EXPECT_THROW((void)classify_stream(d, 2), handoff::value_error);
  EXPECT_EQ(classify_stream(d, 3), (stream_request{stream_order::handle, 3}));
  EXPECT_THROW((void)classify_stream(d, -5), handoff::value_error);
}

class OtherStreamValueTest : public ::testing::TestWithParam<DLDeviceType> {};

INSTANTIATE_TEST_SUITE_P(Other, OtherStreamValueTest,
                         ::testing::Values(kDLCPU, kDLOpenCL, kDLVulkan, kDLMetal, kDLVPI, kDLExtDev, kDLOneAPI,
                                           kDLWebGPU, kDLHexagon, kDLMAIA, kDLTrn));

TEST_P(OtherStreamValueTest, OnlyNoneIsValid)
{
  const DLDeviceType d = GetParam();
  EXPECT_EQ(classify_stream(d, none), (stream_request{stream_order::none, 0}));
  for (const std::int64_t value : {-1, 0, 1, 2, 3, 1000, -7}) {
    EXPECT_THROW((void)classify_stream(d, value), handoff::value_error) << value;
  }
}

TEST(StreamValueMessageTest, NamesTheValueAndDevice)
{
  try {
    (void)classify_stream(kDLCUDA, 0);
    FAIL() << "expected value_error";
  } catch (const handoff::value_error& e) {
    EXPECT_NE(std::string{e.what()}.find("stream=0"), std::string::npos) << e.what();
    EXPECT_NE(std::string{e.what()}.find("CUDA"), std::string::npos) << e.what();
  }
}

}  // namespace

TEST(StreamValueOfTest, OnlyCudasLegacyHandleIsRespelled)
{
  using handoff::stream_value_of;
  static_assert(stream_value_of(kDLCUDA, 0) == 1);  // cudaStreamLegacy
  static_assert(stream_value_of(kDLCUDAManaged, 0) == 1);
  static_assert(stream_value_of(kDLROCM, 0) == 0);  // ROCm's default stream is 0 in DLPack
  static_assert(stream_value_of(kDLCUDA, 0x1234) == 0x1234);
  EXPECT_EQ(handoff::device_text({kDLCUDA, 1}), "CUDA device 1 ((2, 1))");
}

namespace {

using handoff::named_stream;

TEST(NamedStreamTest, EachFormIsSpelledInTheNumberingOfTheDataDevice)
{
  using handoff::dlpack_stream_value;
  const named_stream default_stream{};
  EXPECT_EQ(dlpack_stream_value(default_stream, kDLCUDA), 1);
  EXPECT_EQ(dlpack_stream_value(default_stream, kDLROCM), 0);
  EXPECT_EQ(dlpack_stream_value(named_stream::dlpack(2), kDLCUDAManaged), 2);
  EXPECT_EQ(dlpack_stream_value(named_stream::native(0, nullptr), kDLCUDA), 1);  // cudaStreamLegacy
  EXPECT_EQ(dlpack_stream_value(named_stream::native(0x1234, nullptr), kDLCUDAManaged), 0x1234);
  // Producers of pinned host memory get None (PyTorch's pinned tensors take only None or -1).
  EXPECT_EQ(dlpack_stream_value(named_stream::native(0, nullptr), kDLROCMHost), none);
  EXPECT_EQ(dlpack_stream_value(named_stream::native(0x1234, nullptr), kDLCUDAHost), none);
  EXPECT_EQ(dlpack_stream_value(default_stream, kDLCUDAHost), none);
  EXPECT_EQ(dlpack_stream_value(named_stream::dlpack(2), kDLCUDAHost), none);
  EXPECT_EQ(dlpack_stream_value(named_stream::dlpack(-1), kDLCUDAHost), -1);
  EXPECT_EQ(dlpack_stream_value(named_stream::dlpack(-1), kDLROCMHost), -1);
  // Producers of data without streams take only None.
  EXPECT_EQ(dlpack_stream_value(default_stream, kDLCPU), none);
  EXPECT_EQ(dlpack_stream_value(named_stream::dlpack(5), kDLCPU), none);
  EXPECT_EQ(dlpack_stream_value(named_stream::native(0x1234, nullptr), kDLCPU), none);
}

// A handle DLPack's int64 stream values cannot name is refused where it is named: read as one, the
// largest would be -1, which asks for no ordering.
TEST(NamedStreamTest, AHandleNoStreamValueNamesIsRefused)
{
  constexpr auto most = static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max());
  EXPECT_EQ(request_for(named_stream::native(most, nullptr), kDLCUDA), (stream_request{stream_order::handle, most}));
  for (const std::uint64_t handle : {most + 1, std::numeric_limits<std::uint64_t>::max()}) {
    try {
      (void)named_stream::native(handle, nullptr);
      ADD_FAILURE() << "handle " << handle << " was taken";
    } catch (const handoff::value_error& e) {
      EXPECT_NE(std::string_view{e.what()}.find(fmt::format("{:#x} is above INT64_MAX", handle)),
                std::string_view::npos)
        << e.what();
    }
  }
}

TEST(NamedStreamTest, RequestsFollowTheStreamTable)
{
  using handoff::request_for;
  EXPECT_EQ(request_for({}, kDLCUDA), (stream_request{stream_order::legacy_default, 0}));
  EXPECT_EQ(request_for({}, kDLROCM), (stream_request{stream_order::default_stream, 0}));
  EXPECT_EQ(request_for({}, kDLCPU), (stream_request{stream_order::none, 0}));
  EXPECT_EQ(request_for(named_stream::dlpack(-1), kDLCUDA), (stream_request{stream_order::none, 0}));
  EXPECT_EQ(request_for(named_stream::dlpack(0), kDLROCM), (stream_request{stream_order::default_stream, 0}));
  EXPECT_THROW((void)request_for(named_stream::dlpack(0), kDLCUDA), handoff::value_error);
  EXPECT_THROW((void)request_for(named_stream::dlpack(3), kDLCPU), handoff::value_error);
  EXPECT_EQ(request_for(named_stream::native(0, nullptr), kDLCUDA), (stream_request{stream_order::legacy_default, 0}));
  EXPECT_EQ(request_for(named_stream::native(2, nullptr), kDLCUDA),
            (stream_request{stream_order::per_thread_default, 0}));
  EXPECT_EQ(request_for(named_stream::native(0x1234, nullptr), kDLROCM),
            (stream_request{stream_order::handle, 0x1234}));
  EXPECT_THROW((void)request_for(named_stream::native(0x1234, nullptr), kDLCPU), handoff::value_error);
}

}  // namespace
