#include "core/ipc_control.hpp"

#include <handoff/array.hpp>
#include <handoff/dtype.hpp>
#include <handoff/error.hpp>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

namespace handoff::ipc::detail {

namespace {

// This process's own entry of the share, released but not yet counted out by the producer, taken
// back: its hold is still counted, so the share is still this generation and nothing is added. The
// producer frees a released entry by compare-and-swap, so it either counts the hold out or sees the
// entry open again, never both. Another process's released entry is left alone: until it is
// rewritten, its pid names that process, which may end and have the entry freed without its count.
consumer_entry* reclaim_own(share_slot& slot, std::uint32_t generation, int pid, std::uint64_t start_time) noexcept
{
  for (auto& entry : slot.consumers) {
    if (entry.pid.load(std::memory_order_relaxed) != pid ||
        entry.start_time.load(std::memory_order_relaxed) != start_time ||
        entry.generation.load(std::memory_order_relaxed) != generation) {
      continue;
    }
    auto expected = static_cast<std::uint32_t>(entry_state::released);
    if (!entry.state.compare_exchange_strong(expected, static_cast<std::uint32_t>(entry_state::open),
                                             std::memory_order_acq_rel)) {
      continue;
    }
    // Read again once it is ours: between the first reads and the swap, the producer may have freed
    // it and another process claimed and released it for another share.
    if (entry.pid.load(std::memory_order_relaxed) == pid &&
        entry.start_time.load(std::memory_order_relaxed) == start_time &&
        entry.generation.load(std::memory_order_acquire) == generation) {
      return &entry;
    }
    entry.state.store(static_cast<std::uint32_t>(entry_state::released), std::memory_order_release);
  }
  return nullptr;
}

}  // namespace

claim claim_share(share_slot& slot, std::uint32_t generation, int pid, std::uint64_t start_time) noexcept
{
  if (consumer_entry* own = reclaim_own(slot, generation, pid, start_time)) { return {own, false}; }
  consumer_entry* taken = nullptr;
  for (auto& entry : slot.consumers) {
    auto expected = static_cast<std::uint32_t>(entry_state::free);
    if (entry.state.compare_exchange_strong(expected, static_cast<std::uint32_t>(entry_state::claiming),
                                            std::memory_order_acq_rel)) {
      taken = &entry;
      break;
    }
  }
  if (taken == nullptr) { return {nullptr, true}; }
  taken->pid.store(pid, std::memory_order_relaxed);
  taken->start_time.store(start_time, std::memory_order_relaxed);
  taken->generation.store(generation, std::memory_order_release);
  std::uint64_t word = slot.word.load(std::memory_order_acquire);
  while (generation_of(word) == generation && holds_of(word) > 0) {
    if (slot.word.compare_exchange_weak(word, word + 1, std::memory_order_acq_rel)) {
      taken->state.store(static_cast<std::uint32_t>(entry_state::open), std::memory_order_release);
      return {taken, false};
    }
  }
  taken->state.store(static_cast<std::uint32_t>(entry_state::free), std::memory_order_release);
  return {nullptr, false};
}

bool free_released(consumer_entry& entry) noexcept
{
  auto expected = static_cast<std::uint32_t>(entry_state::released);
  return entry.state.compare_exchange_strong(expected, static_cast<std::uint32_t>(entry_state::free),
                                             std::memory_order_acq_rel);
}

void take_ticket(share_slot& slot) noexcept
{
  std::uint32_t tickets = slot.tickets.load(std::memory_order_acquire);
  while (tickets > 0) {
    if (slot.tickets.compare_exchange_weak(tickets, tickets - 1, std::memory_order_acq_rel)) {
      slot.tickets_used.fetch_add(1, std::memory_order_acq_rel);
      return;
    }
  }
}

namespace {

constexpr std::array<char, 8> handle_magic{'h', 'o', 'f', 'f', 'i', 'p', 'c', 'h'};
constexpr std::uint32_t handle_version = 2;
constexpr std::size_t max_ndim = 64;
constexpr std::size_t backend_chars = 16;

std::uint64_t fnv1a(std::span<const std::byte> bytes) noexcept
{
  std::uint64_t hash = 0xcbf29ce484222325ULL;
  for (const auto b : bytes) {
    hash ^= static_cast<std::uint64_t>(b);
    hash *= 0x100000001b3ULL;
  }
  return hash;
}

class writer {
 public:
  template <class T>
  void put(const T& value)
  {
    const auto* p = reinterpret_cast<const std::byte*>(&value);
    out.insert(out.end(), p, p + sizeof(T));
  }
  std::vector<std::byte> out;
};

class reader {
 public:
  explicit reader(std::span<const std::byte> bytes) : in_(bytes) {}
  template <class T>
  T get()
  {
    HANDOFF_EXPECTS(at_ + sizeof(T) <= in_.size(), value_error,
                    fmt::format("not a handoff IPC handle: {} bytes end too soon", in_.size()));
    T value{};
    std::memcpy(&value, in_.data() + at_, sizeof(T));
    at_ += sizeof(T);
    return value;
  }
  [[nodiscard]] std::size_t at() const noexcept { return at_; }

 private:
  std::span<const std::byte> in_;
  std::size_t at_{0};
};

// The array a handle describes: a dtype DLPack defines, and every element inside the allocation it
// shares. Its checksum is no signature, so a forged handle gets this far: without this check it would
// open a view past the mapping, a crash (or another allocation's data) at the first read.
void check_array(const wire_handle& h)
{
  const auto forged = [](std::string_view what) {
    return value_error(fmt::format("a corrupted or forged handoff IPC handle: {}", what));
  };
  try {
    static_cast<void>(dtype_name(h.dtype));
  } catch (const buffer_error& e) {
    throw forged(e.what());
  }
  if (!std::ranges::all_of(h.shape, [](std::int64_t extent) { return extent >= 0; })) {
    throw forged(fmt::format("its shape ({}) has a negative extent", fmt::join(h.shape, ", ")));
  }
  array_layout layout;
  layout.dtype = h.dtype;
  layout.shape = h.shape;
  layout.strides = h.strides;
  const std::optional<byte_range> range = byte_range_of(layout);
  constexpr auto most = static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max());
  std::int64_t first = 0;
  std::int64_t end = 0;
  const bool inside = range && (range->low == range->high ||  // no elements: nothing is read
                                (h.offset <= most && h.allocation_size <= most &&
                                 !__builtin_add_overflow(static_cast<std::int64_t>(h.offset), range->low, &first) &&
                                 !__builtin_add_overflow(static_cast<std::int64_t>(h.offset), range->high, &end) &&
                                 first >= 0 && end <= static_cast<std::int64_t>(h.allocation_size)));
  if (!inside) {
    throw forged(fmt::format(
      "its array (shape ({}), strides ({}), {}-byte elements, at byte {}) does not lie inside "
      "the {} bytes it shares",
      fmt::join(h.shape, ", "), fmt::join(h.strides, ", "), itemsize(h.dtype), h.offset, h.allocation_size));
  }
}

}  // namespace

std::vector<std::byte> encode(const wire_handle& h)
{
  writer w;
  w.put(handle_magic);
  w.put(handle_version);
  w.put(h.flags);
  w.put(h.boot);
  w.put(h.pid);
  w.put(h.start_time);
  w.put(h.block);
  w.put(h.slot);
  w.put(h.generation);
  w.put(h.block_token);
  std::array<char, backend_chars> backend{};
  std::copy_n(h.backend.begin(), std::min(h.backend.size(), backend_chars - 1), backend.begin());
  w.put(backend);
  w.put(static_cast<std::int32_t>(h.device.device_type));
  w.put(h.device.device_id);
  w.put(h.device_uuid);
  w.put(h.dtype);
  w.put(static_cast<std::uint32_t>(h.shape.size()));
  for (const auto extent : h.shape) { w.put(extent); }
  for (const auto stride : h.strides) { w.put(stride); }
  w.put(h.offset);
  w.put(h.allocation_size);
  if ((h.flags & host_memory) != 0U) {
    w.put(h.host_segment);
  } else {
    w.put(h.memory);
    if ((h.flags & value_ordered) != 0U) {
      w.put(h.ready_value);
    } else {
      w.put(h.event);
    }
  }
  w.put(fnv1a(w.out));
  return std::move(w.out);
}

wire_handle decode(std::span<const std::byte> bytes)
{
  reader r{bytes};
  const bool is_handle = r.get<std::array<char, 8>>() == handle_magic;
  HANDOFF_EXPECTS(is_handle, value_error,
                  "not a handoff IPC handle: its bytes do not begin as handoff.ipc.share writes them");
  const auto version = r.get<std::uint32_t>();
  HANDOFF_EXPECTS(
    version == handle_version, value_error,
    fmt::format("a handoff IPC handle of version {}; this handoff reads version {}", version, handle_version));
  wire_handle h;
  h.flags = r.get<std::uint32_t>();
  h.boot = r.get<std::array<std::byte, 16>>();
  h.pid = r.get<std::int32_t>();
  h.start_time = r.get<std::uint64_t>();
  h.block = r.get<std::uint32_t>();
  h.slot = r.get<std::uint32_t>();
  h.generation = r.get<std::uint32_t>();
  h.block_token = r.get<std::array<std::byte, 16>>();
  const auto backend = r.get<std::array<char, backend_chars>>();
  h.backend.assign(backend.data(), strnlen(backend.data(), backend_chars));
  h.device.device_type = static_cast<DLDeviceType>(r.get<std::int32_t>());
  h.device.device_id = r.get<std::int32_t>();
  h.device_uuid = r.get<device::device_uuid>();
  h.dtype = r.get<DLDataType>();
  const auto ndim = r.get<std::uint32_t>();
  HANDOFF_EXPECTS(ndim <= max_ndim, value_error,
                  fmt::format("a corrupted handoff IPC handle: {} dimensions (at most {})", ndim, max_ndim));
  for (std::uint32_t i = 0; i < ndim; ++i) { h.shape.push_back(r.get<std::int64_t>()); }
  for (std::uint32_t i = 0; i < ndim; ++i) { h.strides.push_back(r.get<std::int64_t>()); }
  h.offset = r.get<std::uint64_t>();
  h.allocation_size = r.get<std::uint64_t>();
  if ((h.flags & host_memory) != 0U) {
    h.host_segment = r.get<std::uint64_t>();
  } else {
    h.memory = r.get<device::ipc_handle>();
    if ((h.flags & value_ordered) != 0U) {
      h.ready_value = r.get<std::uint64_t>();
    } else {
      h.event = r.get<device::ipc_handle>();
    }
  }
  const std::size_t checked = r.at();
  const auto sum = r.get<std::uint64_t>();
  HANDOFF_EXPECTS(sum == fnv1a(bytes.first(checked)) && r.at() == bytes.size(), value_error,
                  "a corrupted or forged handoff IPC handle: its checksum does not match its bytes");
  HANDOFF_EXPECTS(h.slot < shares_per_block && h.pid > 0, value_error,
                  "a corrupted or forged handoff IPC handle: it names no share");
  check_array(h);
  return h;
}

}  // namespace handoff::ipc::detail
