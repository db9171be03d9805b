#include "device/backend_factory.hpp"

#include "device/sim/sim_backend.hpp"
#include "log/logger.hpp"
#include "settings.hpp"

#include <handoff/error.hpp>

#include <fmt/format.h>

#include <charconv>
#include <string>

#if defined(HANDOFF_HAS_CUDA)
#include "device/cuda/cuda_backend.hpp"
#endif

namespace handoff::device {

int sim_device_count_from_env()
{
  const std::string value = detail::setting("HANDOFF_SIM_DEVICES");
  if (value.empty()) { return 2; }
  int count = 0;
  const auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), count);
  HANDOFF_EXPECTS(
    ec == std::errc{} && end == value.data() + value.size() && count >= 1 && count <= sim_backend::max_devices,
    value_error,
    fmt::format("HANDOFF_SIM_DEVICES must be an integer from 1 to {}, got '{}'", sim_backend::max_devices, value));
  return count;
}

bool cuda_compiled_in() noexcept
{
#if defined(HANDOFF_HAS_CUDA)
  return true;
#else
  return false;
#endif
}

std::optional<cuda_runtime_requirement> cuda_requirement()
{
#if defined(HANDOFF_HAS_CUDA)
  return cuda_runtime_requirement{cuda::runtime_version(), cuda::minimum_driver_branch()};
#else
  return std::nullopt;
#endif
}

std::unique_ptr<backend> make_cuda_backend()
{
#if defined(HANDOFF_HAS_CUDA)
  return cuda::make_backend();
#else
  throw device_error("cuda", "cudaErrorNotSupported",
                     "the CUDA backend is not compiled in: handoff was built without the CUDA "
                     "toolkit (configure with HANDOFF_WITH_CUDA=ON where the toolkit is installed)");
#endif
}

std::unique_ptr<backend> make_backend(std::string_view name)
{
  if (name == "cuda") { return make_cuda_backend(); }
  if (name == "sim") { return std::make_unique<sim_backend>(sim_device_count_from_env(), sim_flavour::cuda); }
  if (name == "sim-rocm") { return std::make_unique<sim_backend>(sim_device_count_from_env(), sim_flavour::rocm); }
  throw value_error(fmt::format("unknown device backend '{}'; expected one of: cuda, sim, sim-rocm", name));
}

}  // namespace handoff::device
