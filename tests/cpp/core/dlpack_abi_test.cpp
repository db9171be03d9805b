// Our DLPack structures must be layout-identical to upstream's (Debian's libdlpack-dev header).
#include <handoff/dlpack.h>

#include <gtest/gtest.h>

#include <cstddef>

#if __has_include(<dlpack/dlpack.h>)
#define HANDOFF_HAVE_UPSTREAM_DLPACK 1
namespace upstream {
#include <dlpack/dlpack.h>
}  // namespace upstream
#endif

namespace {

#define EXPECT_SAME_FIELD(type, field) \
  EXPECT_EQ(offsetof(type, field), offsetof(upstream::type, field)) << #type "::" #field

TEST(DlpackAbiTest, LegacyStructuresMatchUpstream)
{
#ifndef HANDOFF_HAVE_UPSTREAM_DLPACK
  GTEST_SKIP() << "dlpack/dlpack.h (libdlpack-dev) is not installed";
#else
  EXPECT_EQ(sizeof(DLDevice), sizeof(upstream::DLDevice));
  EXPECT_SAME_FIELD(DLDevice, device_type);
  EXPECT_SAME_FIELD(DLDevice, device_id);

  EXPECT_EQ(sizeof(DLDataType), sizeof(upstream::DLDataType));
  EXPECT_SAME_FIELD(DLDataType, code);
  EXPECT_SAME_FIELD(DLDataType, bits);
  EXPECT_SAME_FIELD(DLDataType, lanes);

  EXPECT_EQ(sizeof(DLTensor), sizeof(upstream::DLTensor));
  EXPECT_SAME_FIELD(DLTensor, data);
  EXPECT_SAME_FIELD(DLTensor, device);
  EXPECT_SAME_FIELD(DLTensor, ndim);
  EXPECT_SAME_FIELD(DLTensor, dtype);
  EXPECT_SAME_FIELD(DLTensor, shape);
  EXPECT_SAME_FIELD(DLTensor, strides);
  EXPECT_SAME_FIELD(DLTensor, byte_offset);

  EXPECT_EQ(sizeof(DLManagedTensor), sizeof(upstream::DLManagedTensor));
  EXPECT_SAME_FIELD(DLManagedTensor, dl_tensor);
  EXPECT_SAME_FIELD(DLManagedTensor, manager_ctx);
  EXPECT_SAME_FIELD(DLManagedTensor, deleter);
#endif
}

TEST(DlpackAbiTest, EnumeratorsMatchUpstream)
{
#ifndef HANDOFF_HAVE_UPSTREAM_DLPACK
  GTEST_SKIP() << "dlpack/dlpack.h (libdlpack-dev) is not installed";
#else
  EXPECT_EQ(sizeof(DLDeviceType), sizeof(upstream::DLDeviceType));
  EXPECT_EQ(kDLCPU, static_cast<int>(upstream::kDLCPU));
  EXPECT_EQ(kDLCUDA, static_cast<int>(upstream::kDLCUDA));
  EXPECT_EQ(kDLCUDAHost, static_cast<int>(upstream::kDLCUDAHost));
  EXPECT_EQ(kDLOpenCL, static_cast<int>(upstream::kDLOpenCL));
  EXPECT_EQ(kDLVulkan, static_cast<int>(upstream::kDLVulkan));
  EXPECT_EQ(kDLMetal, static_cast<int>(upstream::kDLMetal));
  EXPECT_EQ(kDLVPI, static_cast<int>(upstream::kDLVPI));
  EXPECT_EQ(kDLROCM, static_cast<int>(upstream::kDLROCM));
  EXPECT_EQ(kDLROCMHost, static_cast<int>(upstream::kDLROCMHost));
  EXPECT_EQ(kDLExtDev, static_cast<int>(upstream::kDLExtDev));
  EXPECT_EQ(kDLCUDAManaged, static_cast<int>(upstream::kDLCUDAManaged));
  EXPECT_EQ(kDLInt, static_cast<int>(upstream::kDLInt));
  EXPECT_EQ(kDLUInt, static_cast<int>(upstream::kDLUInt));
  EXPECT_EQ(kDLFloat, static_cast<int>(upstream::kDLFloat));
  EXPECT_EQ(kDLOpaqueHandle, static_cast<int>(upstream::kDLOpaqueHandle));
  EXPECT_EQ(kDLBfloat, static_cast<int>(upstream::kDLBfloat));
  EXPECT_EQ(kDLComplex, static_cast<int>(upstream::kDLComplex));
#endif
}

// The versioned structure is newer than Debian's header: check it against DLPack 1.1's layout.
TEST(DlpackAbiTest, VersionedLayoutIsDlpack11)
{
  EXPECT_EQ(offsetof(DLManagedTensorVersioned, version), 0U);
  EXPECT_EQ(offsetof(DLManagedTensorVersioned, manager_ctx), 8U);
  EXPECT_EQ(offsetof(DLManagedTensorVersioned, deleter), 16U);
  EXPECT_EQ(offsetof(DLManagedTensorVersioned, flags), 24U);
  EXPECT_EQ(offsetof(DLManagedTensorVersioned, dl_tensor), 32U);
  EXPECT_EQ(sizeof(DLManagedTensorVersioned), 32U + sizeof(DLTensor));
  EXPECT_EQ(kDLBool, 6);
  EXPECT_EQ(kDLFloat8_e3m4, 7);
  EXPECT_EQ(kDLFloat8_e8m0fnu, 14);
  EXPECT_EQ(kDLFloat6_e2m3fn, 15);
  EXPECT_EQ(kDLFloat4_e2m1fn, 17);
  EXPECT_EQ(kDLOneAPI, 14);
  EXPECT_EQ(kDLMAIA, 17);
  EXPECT_EQ(DLPACK_FLAG_BITMASK_READ_ONLY, 1UL);
  EXPECT_EQ(DLPACK_FLAG_BITMASK_IS_COPIED, 2UL);
  EXPECT_EQ(DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED, 4UL);
}

// The C exchange API is newer than Debian's header too: check it against DLPack 1.2's layout
// (the version header, then the five functions in order).
TEST(DlpackAbiTest, ExchangeApiLayoutIsDlpack12)
{
  EXPECT_EQ(offsetof(DLPackExchangeAPIHeader, version), 0U);
  EXPECT_EQ(offsetof(DLPackExchangeAPIHeader, prev_api), 8U);
  EXPECT_EQ(sizeof(DLPackExchangeAPIHeader), 8U + sizeof(void*));
  EXPECT_EQ(offsetof(DLPackExchangeAPI, header), 0U);
  const std::size_t first = sizeof(DLPackExchangeAPIHeader);
  EXPECT_EQ(offsetof(DLPackExchangeAPI, managed_tensor_allocator), first);
  EXPECT_EQ(offsetof(DLPackExchangeAPI, managed_tensor_from_py_object_no_sync), first + sizeof(void*));
  EXPECT_EQ(offsetof(DLPackExchangeAPI, managed_tensor_to_py_object_no_sync), first + 2 * sizeof(void*));
  EXPECT_EQ(offsetof(DLPackExchangeAPI, dltensor_from_py_object_no_sync), first + 3 * sizeof(void*));
  EXPECT_EQ(offsetof(DLPackExchangeAPI, current_work_stream), first + 4 * sizeof(void*));
  EXPECT_EQ(sizeof(DLPackExchangeAPI), first + 5 * sizeof(void*));
}

}  // namespace
