// The simulator's reports to a launch trace: what each call did, described under the state's mutex
// and sent after it is released.
#include "device/sim/state.hpp"

#include <algorithm>
#include <string>
#include <utility>

namespace handoff::device {
namespace sim_detail {

activity_note::activity_note(activity::kind kind, std::span<const activity::buffer_use> uses)
    : armed(activity::recording())
{
  if (!armed) { return; }
  record.kind = kind;
  buffers.assign(uses.begin(), uses.end());
}

void activity_note::on_device(int device, sim_flavour flavour) noexcept
{
  record.device = {flavour == sim_flavour::cuda ? kDLCUDA : kDLROCM, device};
}

void activity_note::on_stream(const stream_state& s, std::uintptr_t h, sim_flavour flavour) noexcept
{
  on_device(s.device, flavour);
  switch (s.kind) {
    case stream_kind::legacy:
      record.stream_class = activity::stream_class::legacy;
      record.stream = flavour == sim_flavour::cuda ? 1 : 0;  // 0 and 1 name one stream in CUDA
      return;
    case stream_kind::per_thread:
      record.stream_class = activity::stream_class::per_thread;
      record.stream = h;
      return;
    case stream_kind::created:
      record.stream_class = s.blocking ? activity::stream_class::blocking : activity::stream_class::non_blocking;
      record.stream = h;
      return;
  }
}

void activity_note::send() noexcept
{
  if (!armed) { return; }
  record.buffers = {buffers.data(), buffers.size()};
  activity::report(record);
}

}  // namespace sim_detail

std::string sim_backend::watch_activity(bool /*on*/)
{
  return {};
}

void sim_backend::impl::keep_device_memory(sim_detail::activity_note& note) const
{
  const auto outside = [this](const activity::buffer_use& use) {
    auto it = allocations.upper_bound(use.address);
    if (it == allocations.begin()) { return true; }
    --it;
    return use.address - it->first >= it->second.size || it->second.kind == memory_kind::unregistered;
  };
  note.buffers.erase(std::remove_if(note.buffers.begin(), note.buffers.end(), outside), note.buffers.end());
}

}  // namespace handoff::device
