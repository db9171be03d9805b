// The simulated device across processes (see ipc.hpp): shareable device memory, interprocess events,
// host memory registration and stream memory operations, with CUDA's refusals.
#include "device/sim/ipc.hpp"

#include "device/sim/sim_backend.hpp"
#include "device/sim/state.hpp"
#include "log/logger.hpp"

#include <handoff/error.hpp>
#include <handoff/internal/runtime_thread.hpp>

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <new>
#include <string_view>
#include <system_error>
#include <utility>

namespace handoff::device {

using namespace sim_detail;

namespace {

constexpr std::uint64_t memory_magic = 0x68736D2D6D656D31;  // "hsm-mem1"
constexpr std::uint64_t event_magic = 0x68736D2D65767431;   // "hsm-evt1"

// What a handle of the simulator holds (in ipc_handle's bytes).
struct handle_fields {
  std::uint64_t magic;
  std::uint8_t flavour;
  std::int32_t device;  // the node's device, as CUDA's handles name the GPU, not an ordinal
  std::int32_t pid;
  std::uint64_t serial;
  std::uint64_t size;
  std::array<std::byte, 16> token;
};
static_assert(sizeof(handle_fields) <= sizeof(ipc_handle{}.bytes));

ipc_handle pack(const handle_fields& fields)
{
  ipc_handle handle;
  std::memcpy(handle.bytes.data(), &fields, sizeof fields);
  return handle;
}

handle_fields unpack(const ipc_handle& handle)
{
  handle_fields fields{};
  std::memcpy(&fields, handle.bytes.data(), sizeof fields);
  return fields;
}

// The watch's latches are gates no thread holds (a wait for one is no hold deadlock).
constexpr gate_holder no_holder = 0;

// How often the watch looks at other processes: soon after a change, backing off while nothing moves.
constexpr std::chrono::microseconds min_watch_poll{20};
constexpr std::chrono::milliseconds max_watch_poll{2};

// The 64-bit word at `address`, shared with other processes (lock-free atomics are address-free).
std::atomic<std::uint64_t>& word_at(void* address)
{
  return *static_cast<std::atomic<std::uint64_t>*>(address);
}

}  // namespace

namespace sim_detail {

ipc_watch::ipc_watch(worker_pool& pool) : pool_(pool), thread_(handoff::detail::start_runtime_thread([this] { run(); }))
{}

ipc_watch::~ipc_watch()
{
  stop();
}

node_ptr ipc_watch::when(std::function<bool()> ready)
{
  node_ptr latch = pool_.submit_gate(no_holder, {});
  std::lock_guard lock{mutex_};
  if (stopping_) {
    pool_.open_gate(latch);
    return latch;
  }
  watched_.push_back({latch, std::move(ready)});
  wake_.notify_one();
  return latch;
}

void ipc_watch::stop() noexcept
{
  {
    std::lock_guard lock{mutex_};
    if (stopping_) { return; }
    stopping_ = true;
    wake_.notify_one();
  }
  if (thread_.joinable()) { thread_.join(); }
  for (auto& w : watched_) { pool_.open_gate(w.latch); }
  watched_.clear();
}

void ipc_watch::run()
{
  auto interval = std::chrono::nanoseconds{min_watch_poll};
  std::unique_lock lock{mutex_};
  while (!stopping_) {
    if (watched_.empty()) {
      wake_.wait(lock, [this] { return stopping_ || !watched_.empty(); });
      interval = min_watch_poll;
      continue;
    }
    std::vector<watched> looking;
    looking.swap(watched_);
    lock.unlock();
    std::vector<watched> waiting;
    bool opened = false;
    for (auto& w : looking) {
      bool ready = true;  // a condition that cannot be asked lets the work go rather than hold it for ever
      try {
        ready = w.ready();
      } catch (...) {}
      if (ready) {
        pool_.open_gate(w.latch);
        opened = true;
      } else {
        waiting.push_back(std::move(w));
      }
    }
    lock.lock();
    watched_.insert(watched_.begin(), std::make_move_iterator(waiting.begin()), std::make_move_iterator(waiting.end()));
    interval = opened ? std::chrono::nanoseconds{min_watch_poll}
                      : std::min<std::chrono::nanoseconds>(interval * 2, max_watch_poll);
    wake_.wait_for(lock, interval, [this] { return stopping_; });
  }
}

}  // namespace sim_detail

// --- the backend's state ---------------------------------------------------------------------------

void sim_backend::impl::free_memory(std::uintptr_t base, const allocation& info) noexcept
{
  if (info.registered) { return; }  // the application's host memory
  if (info.segment) { return; }     // the file's mapping goes with the table's entry
  ::operator delete(reinterpret_cast<void*>(base), allocation_alignment);
}

void* sim_backend::impl::allocate_shareable_locked(const call& c, std::size_t bytes, int device)
{
  const std::uint64_t serial = detail::next_shared_serial();
  std::shared_ptr<detail::shared_mapping> segment;
  try {
    segment = std::make_shared<detail::shared_mapping>(
      detail::shared_mapping::create(detail::shared_memory_name("sim", serial), data_offset + bytes));
  } catch (const std::system_error& e) {
    fail(c, sim_error::memory_allocation, e.what());
  }
  auto* header = new (segment->data())
    shared_allocation_header{.magic = memory_magic, .token = detail::random_token(), .size = bytes, .device = device};
  (void)header;
  auto* data = static_cast<std::byte*>(segment->data()) + data_offset;
  allocation info;
  info.size = bytes;
  info.kind = memory_kind::device;
  info.device = device;
  info.segment = std::move(segment);
  allocations.emplace(reinterpret_cast<std::uintptr_t>(data), std::move(info));
  HANDOFF_LOG_DEBUG("{}: {} bytes at {} on device {} (shareable)", backend_name(), bytes, fmt::ptr(data), device);
  return data;
}

ipc_watch& sim_backend::impl::watch()
{
  if (!ipc_watcher) { ipc_watcher = std::make_unique<ipc_watch>(pool); }
  return *ipc_watcher;
}

void sim_backend::impl::signal_record(event_state& e, const node_ptr& reached)
{
  auto& shared = *e.ipc;
  const std::uint64_t number = shared.state->recorded.fetch_add(1, std::memory_order_acq_rel) + 1;
  shared.local_record = number;
  // Off the stream: the stream does not wait for the earlier records, only the shared state does.
  // The body keeps the shared state mapped, should the event be destroyed first.
  shared.last_signal = pool.submit(
    work{.body = [keep = e.ipc, number] { keep->state->completed.store(number, std::memory_order_release); },
         .delay = {},
         .halted = &devices[static_cast<std::size_t>(e.device)].halted,
         .serial = nullptr},
    {reached, shared.last_signal});
}

bool sim_backend::impl::recorded_elsewhere(const call& c, const event_state& e)
{
  if (!e.ipc) { return false; }
  if (!e.ipc->exporter && e.ipc->state->destroyed.load(std::memory_order_acquire) != 0) {
    record_violation(fmt::format("{}({}) used an interprocess event after the process that made it destroyed it",
                                 call_name(c.op, flavour), c.args()));
  }
  const std::uint64_t latest = e.ipc->state->recorded.load(std::memory_order_acquire);
  return latest != 0 && latest != e.ipc->local_record;
}

bool sim_backend::impl::shared_record_reached(const shared_event& shared, std::uint64_t record) noexcept
{
  if (shared.state->completed.load(std::memory_order_acquire) >= record) { return true; }
  // A record whose process ended will never be reached: the work waiting for it goes on (CUDA tears
  // the context of an ended process down), and the log says so.
  if (!detail::process_alive(shared.state->pid, shared.state->start_time)) {
    HANDOFF_LOG_WARN(
      "sim: process {} ended before its stream reached record {} of an interprocess event; "
      "the work waiting for it goes on",
      shared.state->pid, record);
    return true;
  }
  return false;
}

// --- memory --------------------------------------------------------------------------------------------

ipc_handle sim_backend::ipc_memory_handle(void* base)
{
  const call_with c{"ipc_memory_handle", "{}", base};
  impl_->open(c);
  std::lock_guard lock(impl_->mutex);
  const auto it = impl_->allocations.find(reinterpret_cast<std::uintptr_t>(base));
  if (it == impl_->allocations.end() || it->second.free_pending) {
    impl_->fail(c, sim_error::invalid_value, "not the base address of a live allocation");
  }
  impl_->check_alive(c, it->second.device);
  if (!it->second.segment || it->second.ipc_opens > 0) {
    impl_->fail(c, sim_error::invalid_value,
                it->second.ipc_opens > 0 ? "memory mapped from another process cannot be shared again"
                                         : "only device memory can be shared between processes");
  }
  const auto* header = static_cast<const shared_allocation_header*>(it->second.segment->data());
  handle_fields fields{};
  fields.magic = memory_magic;
  fields.flavour = static_cast<std::uint8_t>(impl_->flavour);
  fields.device = impl_->node_device(it->second.device);
  fields.pid = detail::this_process();
  const auto& name = it->second.segment->name();
  fields.serial = std::stoull(name.substr(name.rfind('.') + 1));
  fields.size = it->second.size;
  fields.token = header->token;
  return pack(fields);
}

device_uuid sim_backend::uuid(int device)
{
  const call_with c{"uuid", "{}", device};
  impl_->open(c);
  if (device < 0 || device >= impl_->device_count) { impl_->fail(c, sim_error::invalid_device, "no such device"); }
  constexpr std::string_view prefix = "handoff-sim";
  device_uuid id{};
  std::ranges::transform(prefix, id.begin(), [](char ch) { return static_cast<std::byte>(ch); });
  const auto n = static_cast<std::uint32_t>(impl_->node_device(device));
  for (std::size_t i = 0; i < 4; ++i) { id[id.size() - 1 - i] = static_cast<std::byte>(n >> (8U * i)); }
  return id;
}

void* sim_backend::open_ipc_memory(const ipc_handle& handle)
{
  const handle_fields h = unpack(handle);
  const call_with c{"open_ipc_memory", "handle of pid {} serial {}", h.pid, h.serial};
  impl_->open(c);
  if (h.magic != memory_magic || h.flavour != static_cast<std::uint8_t>(impl_->flavour)) {
    impl_->fail(c, sim_error::invalid_handle, "not a memory handle of this simulated device");
  }
  if (h.pid == detail::this_process()) {
    impl_->fail(c, sim_error::device_uninitialized, "a memory handle cannot be opened in the process that made it");
  }
  std::lock_guard lock(impl_->mutex);
  const int device = impl_->using_current(c);
  if (h.device < 0 || h.device >= max_devices) { impl_->fail(c, sim_error::invalid_handle, "no such device"); }
  if (impl_->node_device(device) != h.device) {
    impl_->fail(c, sim_error::peer_access_unsupported,
                fmt::format("the memory is on the node's device {}, the current device is its device {}", h.device,
                            impl_->node_device(device)));
  }
  const auto key = std::make_pair(h.pid, h.serial);
  if (const auto known = impl_->imported.find(key); known != impl_->imported.end()) {
    auto& info = impl_->allocations.at(known->second);
    ++info.ipc_opens;  // CUDA: the same context opening it again counts, and gets the same address
    return reinterpret_cast<void*>(known->second);
  }
  std::optional<detail::shared_mapping> mapping;
  try {
    mapping = detail::shared_mapping::open(detail::shared_memory_name("sim", h.pid, h.serial));
  } catch (const std::system_error& e) {
    impl_->fail(c, sim_error::map_failed, e.what());
  }
  if (!mapping) {
    impl_->fail(c, sim_error::map_failed, "the memory was freed, or the process that shared it has ended");
  }
  const auto* header = static_cast<const shared_allocation_header*>(mapping->data());
  if (mapping->size() < data_offset || header->magic != memory_magic || header->token != h.token ||
      header->size != h.size || mapping->size() != data_offset + h.size) {
    impl_->fail(c, sim_error::invalid_handle, "the handle does not match the memory of that name (stale or forged)");
  }
  auto* data = static_cast<std::byte*>(mapping->data()) + data_offset;
  allocation info;
  info.size = h.size;
  info.kind = memory_kind::device;
  info.device = device;
  info.segment = std::make_shared<detail::shared_mapping>(std::move(*mapping));
  info.ipc_opens = 1;
  const auto base = reinterpret_cast<std::uintptr_t>(data);
  impl_->allocations.emplace(base, std::move(info));
  impl_->imported.emplace(key, base);
  return data;
}

void sim_backend::close_ipc_memory(void* ptr) noexcept
{
  try {
    const call_with c{"close_ipc_memory", "{}", ptr};
    if (!impl_->open_quiet(c)) { return; }
    std::lock_guard lock(impl_->mutex);
    const auto base = reinterpret_cast<std::uintptr_t>(ptr);
    const auto it = impl_->allocations.find(base);
    if (it == impl_->allocations.end() || it->second.ipc_opens == 0) {
      impl_->record_violation(fmt::format("{}({}): not memory opened with {}", call_name(c.op, impl_->flavour),
                                          c.args(), call_name("open_ipc_memory", impl_->flavour)));
      return;
    }
    if (--it->second.ipc_opens > 0) { return; }
    std::erase_if(impl_->imported, [base](const auto& entry) { return entry.second == base; });
    impl_->allocations.erase(it);  // unmaps: work still reading it would fault, as on a GPU
  } catch (...) {
    HANDOFF_LOG_ERROR("{}: close_ipc_memory failed", name());
  }
}

// --- events ----------------------------------------------------------------------------------------------

event_handle sim_backend::create_ipc_event()
{
  return create_event_with_flags(/*interprocess=*/true, /*disable_timing=*/true);
}

event_handle sim_backend::create_event_with_flags(bool interprocess, bool disable_timing)
{
  const call_with c{interprocess ? "create_ipc_event" : "create_event", "flags={}{}",
                    disable_timing ? "DisableTiming" : "Default", interprocess ? "|Interprocess" : ""};
  impl_->open(c);
  if (interprocess && !disable_timing) {
    impl_->fail(c, sim_error::invalid_value, "an interprocess event must also disable timing");
  }
  std::lock_guard lock(impl_->mutex);
  auto e = std::make_unique<event_state>();
  e->device = impl_->using_current(c);
  if (interprocess) {
    auto shared = std::make_shared<shared_event>();
    shared->serial = detail::next_shared_serial();
    try {
      shared->mapping = detail::shared_mapping::create(detail::shared_memory_name("simevent", shared->serial),
                                                       sizeof(shared_event_state));
    } catch (const std::system_error& error) {
      impl_->fail(c, sim_error::memory_allocation, error.what());
    }
    shared->state = new (shared->mapping.data()) shared_event_state{.magic = event_magic,
                                                                    .token = detail::random_token(),
                                                                    .device = e->device,
                                                                    .pid = detail::this_process(),
                                                                    .start_time = detail::this_process_start_time(),
                                                                    .recorded = {0},
                                                                    .completed = {0},
                                                                    .destroyed = {0}};
    shared->exporter = true;
    e->ipc = std::move(shared);
  }
  const auto handle = impl_->issue_handle();
  impl_->events.emplace(handle, std::move(e));
  return event_handle{handle};
}

ipc_handle sim_backend::ipc_event_handle(event_handle event)
{
  const call_with c{"ipc_event_handle", "{:#x}", raw(event)};
  impl_->open(c);
  std::lock_guard lock(impl_->mutex);
  auto& e = impl_->event(c, event);
  if (!e.ipc || !e.ipc->exporter) {
    impl_->fail(c, sim_error::invalid_handle,
                "the event was not created with cudaEventInterprocess and cudaEventDisableTiming");
  }
  handle_fields fields{};
  fields.magic = event_magic;
  fields.flavour = static_cast<std::uint8_t>(impl_->flavour);
  fields.device = impl_->node_device(e.device);
  fields.pid = detail::this_process();
  fields.serial = e.ipc->serial;
  fields.token = e.ipc->state->token;
  return pack(fields);
}

event_handle sim_backend::open_ipc_event(const ipc_handle& handle)
{
  const handle_fields h = unpack(handle);
  const call_with c{"open_ipc_event", "handle of pid {} serial {}", h.pid, h.serial};
  impl_->open(c);
  if (h.magic != event_magic || h.flavour != static_cast<std::uint8_t>(impl_->flavour)) {
    impl_->fail(c, sim_error::invalid_value, "not an event handle of this simulated device");
  }
  if (h.pid == detail::this_process()) {
    impl_->fail(c, sim_error::device_uninitialized, "an event handle cannot be opened in the process that made it");
  }
  std::optional<detail::shared_mapping> mapping;
  try {
    mapping = detail::shared_mapping::open(detail::shared_memory_name("simevent", h.pid, h.serial));
  } catch (const std::system_error& e) {
    impl_->fail(c, sim_error::map_failed, e.what());
  }
  if (!mapping) { impl_->fail(c, sim_error::map_failed, "the event was destroyed, or its process has ended"); }
  auto* state = static_cast<shared_event_state*>(mapping->data());
  if (mapping->size() < sizeof(shared_event_state) || state->magic != event_magic || state->token != h.token) {
    impl_->fail(c, sim_error::invalid_value, "the handle does not match the event of that name (stale or forged)");
  }
  std::lock_guard lock(impl_->mutex);
  auto e = std::make_unique<event_state>();
  e->device = impl_->using_current(c);  // CUDA: opened in the current context
  auto shared = std::make_shared<shared_event>();
  shared->mapping = std::move(*mapping);
  shared->state = state;
  shared->serial = h.serial;
  e->ipc = std::move(shared);
  const auto made = impl_->issue_handle();
  impl_->events.emplace(made, std::move(e));
  return event_handle{made};
}

// --- host memory and stream memory operations -----------------------------------------------------

void* sim_backend::register_host_memory(void* ptr, std::size_t bytes)
{
  const call_with c{"register_host_memory", "{}, {}, cudaHostRegisterPortable|cudaHostRegisterMapped", ptr, bytes};
  impl_->open(c);
  if (ptr == nullptr || bytes == 0) { impl_->fail(c, sim_error::invalid_value); }
  std::lock_guard lock(impl_->mutex);
  const auto base = reinterpret_cast<std::uintptr_t>(ptr);
  auto next = impl_->allocations.lower_bound(base);
  const bool overlaps_next = next != impl_->allocations.end() && next->first < base + bytes;
  bool overlaps_previous = false;
  if (next != impl_->allocations.begin()) {
    const auto previous = std::prev(next);
    overlaps_previous = previous->first + previous->second.size > base;
  }
  if (overlaps_next || overlaps_previous) {
    impl_->fail(c, sim_error::invalid_value, "the range overlaps memory the device already knows");
  }
  allocation info;
  info.size = bytes;
  info.kind = memory_kind::pinned_host;
  info.device = impl_->using_current(c);
  info.registered = true;
  impl_->allocations.emplace(base, std::move(info));
  return ptr;  // one address space, as with CUDA's UVA
}

void sim_backend::unregister_host_memory(void* ptr) noexcept
{
  try {
    const call_with c{"unregister_host_memory", "{}", ptr};
    if (!impl_->open_quiet(c)) { return; }
    std::lock_guard lock(impl_->mutex);
    const auto it = impl_->allocations.find(reinterpret_cast<std::uintptr_t>(ptr));
    if (it == impl_->allocations.end() || !it->second.registered) {
      HANDOFF_LOG_ERROR("{}({}) failed: not registered host memory", call_name(c.op, impl_->flavour), c.args());
      return;
    }
    impl_->allocations.erase(it);
  } catch (...) {
    HANDOFF_LOG_ERROR("{}: unregister_host_memory failed", name());
  }
}

void sim_backend::impl::require_device_word(const call& c, const void* address) const
{
  const auto at = reinterpret_cast<std::uintptr_t>(address);
  auto it = allocations.upper_bound(at);
  const bool reached = at % alignof(std::uint64_t) == 0 && it != allocations.begin() &&
                       (--it)->second.kind != memory_kind::unregistered && !it->second.free_pending &&
                       at + sizeof(std::uint64_t) <= it->first + it->second.size;
  if (!reached) { fail(c, sim_error::invalid_value, "the address is not 8-byte aligned memory the device reaches"); }
}

void sim_backend::stream_write_value(stream_handle stream, void* address, std::uint64_t value)
{
  const call_with c{"stream_write_value", "{:#x}, {}, {}, 0", raw(stream), address, value};
  impl_->open(c);
  {
    std::lock_guard lock(impl_->mutex);
    impl_->require_device_word(c, address);
  }
  impl_->enqueue(c, stream,
                 {.body = [address, value] { word_at(address).store(value, std::memory_order_release); },
                  .delay = {},
                  .host_function = false});
}

void sim_backend::stream_wait_value(stream_handle stream, void* address, std::uint64_t value)
{
  const call_with c{"stream_wait_value", "{:#x}, {}, {}, CU_STREAM_WAIT_VALUE_GEQ", raw(stream), address, value};
  impl_->open(c);
  std::lock_guard lock(impl_->mutex);
  impl_->require_device_word(c, address);
  auto& s = impl_->stream(c, stream);
  impl_->check_legacy_use(c, s);
  if (s.capture) {
    (void)impl_->capture_locked(s, {});
    return;
  }
  if (word_at(address).load(std::memory_order_acquire) >= value) {
    impl_->enqueue_locked(s, {});
    return;
  }
  const node_ptr reached =
    impl_->watch().when([address, value] { return word_at(address).load(std::memory_order_acquire) >= value; });
  impl_->enqueue_locked(s, {}, reached);
}

}  // namespace handoff::device
