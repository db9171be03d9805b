#include "device/backend_factory.hpp"

#include "device/sim/sim_backend.hpp"
#include "log/logger.hpp"
#include "settings.hpp"

#include <handoff/error.hpp>

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <string>
#include <string_view>
#include <utility>

#if defined(HANDOFF_HAS_CUDA)
#include "device/cuda/cuda_backend.hpp"
#endif

namespace handoff::device {

sim_devices sim_devices_from_env()
{
  const auto integer = [](std::string_view text, int& out) {
    const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), out);
    return ec == std::errc{} && end == text.data() + text.size();
  };
  sim_devices devices;
  const std::string count = detail::setting("HANDOFF_SIM_DEVICES");
  if (!count.empty()) {
    HANDOFF_EXPECTS(
      integer(count, devices.count) && devices.count >= 1 && devices.count <= sim_backend::max_devices, value_error,
      fmt::format("HANDOFF_SIM_DEVICES must be an integer from 1 to {}, got '{}'", sim_backend::max_devices, count));
  }
  const std::string visible = detail::setting("HANDOFF_SIM_VISIBLE_DEVICES");
  if (visible.empty()) { return devices; }
  const auto refuse = [&](std::string_view why) {
    return value_error(
      fmt::format("HANDOFF_SIM_VISIBLE_DEVICES must list distinct devices of the simulated node "
                  "(0 to {}), as CUDA_VISIBLE_DEVICES does, got '{}': {}",
                  sim_backend::max_devices - 1, visible, why));
  };
  for (std::size_t at = 0; at <= visible.size();) {
    const std::size_t comma = std::min(visible.find(',', at), visible.size());
    int device = 0;
    if (!integer(std::string_view{visible}.substr(at, comma - at), device) || device < 0 ||
        device >= sim_backend::max_devices) {
      throw refuse(fmt::format("'{}' is not one", visible.substr(at, comma - at)));
    }
    if (std::ranges::find(devices.visible, device) != devices.visible.end()) {
      throw refuse(fmt::format("{} is listed twice", device));
    }
    devices.visible.push_back(device);
    at = comma + 1;
  }
  if (!count.empty()) {
    HANDOFF_EXPECTS(std::cmp_equal(devices.visible.size(), devices.count), value_error,
                    fmt::format("HANDOFF_SIM_DEVICES is {} and HANDOFF_SIM_VISIBLE_DEVICES lists {} devices: set one, "
                                "or both alike",
                                devices.count, devices.visible.size()));
  }
  devices.count = static_cast<int>(devices.visible.size());
  return devices;
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
  if (name == "sim" || name == "sim-rocm") {
    sim_devices devices = sim_devices_from_env();
    return std::make_unique<sim_backend>(devices.count, name == "sim" ? sim_flavour::cuda : sim_flavour::rocm,
                                         std::move(devices.visible));
  }
  throw value_error(fmt::format("unknown device backend '{}'; expected one of: cuda, sim, sim-rocm", name));
}

}  // namespace handoff::device
