// Prints the runtime handoff would use, and how it reads DLPack's stream values for a CUDA array.
#include <handoff/runtime.hpp>
#include <handoff/stream_value.hpp>

#include <cstdio>
#include <initializer_list>

int main()
{
  const handoff::runtime_description runtime = handoff::describe_runtime();
  std::printf("handoff %s (DLPack %s): backend %s, %d device(s)\n", runtime.version.c_str(),
              runtime.dlpack_version.c_str(), runtime.backend.c_str(), runtime.device_count);
  if (!runtime.cuda_runtime.empty()) {
    std::printf("  CUDA runtime %s (needs an NVIDIA driver %d or later)\n", runtime.cuda_runtime.c_str(),
                runtime.cuda_driver_minimum);
  }
  if (!runtime.backend_error.empty()) { std::printf("  %s\n", runtime.backend_error.c_str()); }
  for (const long long value : {-1LL, 1LL, 2LL, 0x7f0000001000LL}) {
    const auto request = handoff::classify_stream(kDLCUDA, value);
    std::printf("  stream=%lld on a CUDA array -> order %d\n", value, static_cast<int>(request.order));
  }
  return 0;
}
