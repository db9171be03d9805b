// What a backend without the calls across processes answers: cudaErrorNotSupported, as CUDA does
// where a device or platform has no IPC.
#include <handoff/device.hpp>
#include <handoff/error.hpp>

#include "log/logger.hpp"

#include <fmt/format.h>

#include <string>

namespace handoff::device {
namespace {

[[noreturn]] void not_supported(const backend& b, const char* call)
{
  throw device_error(std::string{b.name()}, "cudaErrorNotSupported",
                     fmt::format("{} failed: cudaErrorNotSupported: the {} backend does not share memory or events "
                                 "between processes",
                                 call, b.name()));
}

}  // namespace

ipc_handle backend::ipc_memory_handle(void* /*base*/)
{
  not_supported(*this, "cudaIpcGetMemHandle");
}

device_uuid backend::uuid(int /*device*/)
{
  not_supported(*this, "cudaGetDeviceProperties(uuid)");
}

void* backend::open_ipc_memory(const ipc_handle& /*handle*/)
{
  not_supported(*this, "cudaIpcOpenMemHandle");
}

void backend::close_ipc_memory(void* ptr) noexcept
{
  HANDOFF_LOG_ERROR("{}: cudaIpcCloseMemHandle({}) on a backend that opens none", name(), fmt::ptr(ptr));
}

event_handle backend::create_ipc_event()
{
  not_supported(*this, "cudaEventCreateWithFlags(cudaEventInterprocess)");
}

ipc_handle backend::ipc_event_handle(event_handle /*event*/)
{
  not_supported(*this, "cudaIpcGetEventHandle");
}

event_handle backend::open_ipc_event(const ipc_handle& /*handle*/)
{
  not_supported(*this, "cudaIpcOpenEventHandle");
}

void* backend::register_host_memory(void* /*ptr*/, std::size_t /*bytes*/)
{
  not_supported(*this, "cudaHostRegister");
}

void backend::unregister_host_memory(void* ptr) noexcept
{
  HANDOFF_LOG_ERROR("{}: cudaHostUnregister({}) on a backend that registers none", name(), fmt::ptr(ptr));
}

void backend::stream_write_value(stream_handle /*stream*/, void* /*address*/, std::uint64_t /*value*/)
{
  not_supported(*this, "cuStreamWriteValue64");
}

void backend::stream_wait_value(stream_handle /*stream*/, void* /*address*/, std::uint64_t /*value*/)
{
  not_supported(*this, "cuStreamWaitValue64");
}

}  // namespace handoff::device
