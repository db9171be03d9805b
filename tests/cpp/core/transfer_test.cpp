// The array API's `device` and `copy` rules, and the DLPack version an export stamps: pure
// decisions, no backend involved.
#include <handoff/array.hpp>
#include <handoff/error.hpp>
#include <handoff/internal/transfer.hpp>

#include <gtest/gtest.h>

#include <optional>
#include <vector>

namespace {

handoff::array host_described(DLDevice device)
{
  static float data[4]{};
  handoff::array_layout layout;
  layout.data = data;
  layout.device = device;
  layout.dtype = {kDLFloat, 32, 1};
  layout.shape = std::vector<std::int64_t>{4};
  layout.strides = std::vector<std::int64_t>{1};
  return handoff::array{std::move(layout), handoff::shared_producer{[] {}}};
}

}  // namespace

TEST(ExportVersionTest, StampsTheConsumersMinorWhenOlderAndTheLegacyCapsuleBelowMajorOne)
{
  using handoff::export_version;
  EXPECT_EQ(export_version(std::nullopt), std::nullopt);
  EXPECT_EQ(export_version(DLPackVersion{0, 9}), std::nullopt);
  const auto older = export_version(DLPackVersion{1, 0});
  ASSERT_TRUE(older.has_value());
  EXPECT_EQ(older->major, 1U);
  EXPECT_EQ(older->minor, 0U);
  const auto newer = export_version(DLPackVersion{1, 99});
  ASSERT_TRUE(newer.has_value());
  EXPECT_EQ(newer->minor, static_cast<std::uint32_t>(DLPACK_MINOR_VERSION));
  const auto next_major = export_version(DLPackVersion{2, 0});
  ASSERT_TRUE(next_major.has_value());
  EXPECT_EQ(next_major->major, static_cast<std::uint32_t>(DLPACK_MAJOR_VERSION));
  EXPECT_EQ(next_major->minor, static_cast<std::uint32_t>(DLPACK_MINOR_VERSION));
}

// A negative device id names no device: it is refused, not read as another CPU to copy to.
TEST(PlanTransferTest, ADeviceWithANegativeIdIsRefusedInBothDirections)
{
  const auto host = host_described({kDLCPU, 0});
  constexpr DLDevice negative{kDLCPU, -1};
  for (const std::optional<bool> copy : {std::optional<bool>{}, std::optional<bool>{true}}) {
    EXPECT_THROW((void)handoff::plan_export(host, negative, copy), handoff::value_error);
    EXPECT_THROW((void)handoff::plan_import(host, negative, copy, false), handoff::value_error);
  }
  try {
    (void)handoff::plan_export(host, negative, std::nullopt);
  } catch (const handoff::value_error& e) {
    EXPECT_STREQ(e.what(), "cannot export to CPU device -1 ((1, -1)): a device id is never negative");
  }
  EXPECT_EQ(handoff::plan_export(host, DLDevice{kDLCPU, 0}, std::nullopt), handoff::transfer::none);
}

TEST(PlanTransferTest, ExportsFollowTheArrayApisCopyRules)
{
  using handoff::plan_export;
  using handoff::transfer;
  const auto device = host_described({kDLCUDA, 0});
  const auto managed = host_described({kDLCUDAManaged, 0});
  constexpr DLDevice cpu{kDLCPU, 0};
  EXPECT_EQ(plan_export(device, std::nullopt, std::nullopt), transfer::none);
  EXPECT_EQ(plan_export(device, DLDevice{kDLCUDA, 0}, std::nullopt), transfer::none);
  EXPECT_EQ(plan_export(device, std::nullopt, true), transfer::same_device);
  EXPECT_EQ(plan_export(device, cpu, std::nullopt), transfer::to_host);
  EXPECT_EQ(plan_export(managed, cpu, std::nullopt), transfer::host_view);
  EXPECT_EQ(plan_export(managed, cpu, true), transfer::to_host);
  EXPECT_THROW((void)plan_export(device, cpu, false), handoff::buffer_error);
  EXPECT_THROW((void)plan_export(device, DLDevice{kDLCUDA, 1}, std::nullopt), handoff::buffer_error);
}

TEST(PlanTransferTest, ImportsCopyOnlyWhatTheProducerDidNot)
{
  using handoff::plan_import;
  using handoff::transfer;
  const auto device = host_described({kDLCUDA, 0});
  constexpr DLDevice cpu{kDLCPU, 0};
  EXPECT_EQ(plan_import(device, std::nullopt, std::nullopt, false), transfer::none);
  EXPECT_EQ(plan_import(device, std::nullopt, true, false), transfer::same_device);
  EXPECT_EQ(plan_import(device, std::nullopt, true, true), transfer::none);
  EXPECT_EQ(plan_import(device, cpu, std::nullopt, false), transfer::to_host);
  EXPECT_THROW((void)plan_import(device, cpu, false, false), handoff::buffer_error);
  EXPECT_THROW((void)plan_import(device, DLDevice{kDLCUDA, 1}, std::nullopt, false), handoff::buffer_error);
  // Host-accessible memory a producer could not move is reused, as an export reuses it.
  const auto pinned = host_described({kDLCUDAHost, 0});
  EXPECT_EQ(plan_import(pinned, cpu, std::nullopt, false), transfer::host_view);
  EXPECT_EQ(plan_import(pinned, cpu, false, false), transfer::host_view);
  EXPECT_EQ(plan_import(pinned, cpu, true, false), transfer::to_host);
}
