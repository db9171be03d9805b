// The hand-off across processes (handoff/ipc.hpp): the producer's shares and the watch over their
// consumers, the consumer's opens with their mappings and events cached per process.
#include <handoff/device_guard.hpp>
#include <handoff/error.hpp>
#include <handoff/internal/counters.hpp>
#include <handoff/internal/ordering.hpp>
#include <handoff/internal/shared_memory.hpp>
#include <handoff/internal/trace_scope.hpp>
#include <handoff/ipc.hpp>
#include <handoff/stream_value.hpp>

#include "core/ipc_control.hpp"
#include "core/live_views.hpp"
#include "log/logger.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <chrono>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <tuple>
#include <utility>
#include <vector>

namespace handoff::ipc {
namespace {

using namespace detail;
using handoff::detail::shared_mapping;

// How often the producer looks at its consumers: soon while they come and go, backing off while
// nothing changes; whether a consumer process still runs is asked at most this often.
constexpr std::chrono::microseconds min_poll{200};
constexpr std::chrono::milliseconds max_poll{20};
constexpr std::chrono::milliseconds liveness_poll{50};
// Events of other processes kept open here; the oldest go first.
constexpr std::size_t opened_events_kept = 256;

// HANDOFF_IPC_SYNC=value orders every share with stream memory operations (the fallback where
// interprocess events cannot be made), so that the fallback can be tested anywhere.
bool values_asked_for()
{
  const char* setting = std::getenv("HANDOFF_IPC_SYNC");
  return setting != nullptr && std::string_view{setting} == "value";
}

std::string key_of(int pid, std::uint64_t start, std::span<const std::byte> bytes)
{
  std::string key = fmt::format("{}.{}:", pid, start);
  key.append(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  return key;
}

// An interprocess event of the producer, pooled: recorded once per share, and back in the pool once
// the share is over (no consumer waits on it any more).
struct pooled_ipc_event {
  context* ctx{nullptr};
  int device{0};
  device::event_handle event{};
  device::ipc_handle handle;
};

// What the producer keeps for a live share.
struct local_share {
  std::optional<array> data;                  // the shared array (device memory), kept
  std::optional<pooled_ipc_event> event;      // recorded for this share
  std::unique_ptr<shared_mapping> host_copy;  // host memory: the copy in shared memory
  std::uint64_t ready_value{0};               // ordered by a stream memory operation: the value written
};

// A control block of this process and the records of its slots.
struct producer_block {
  shared_mapping mapping;
  control_block* shared{nullptr};
  std::array<local_share, shares_per_block> locals;
  std::array<bool, shares_per_block> live{};
  std::map<context*, void*> device_address;  // the block as each context's device reaches it
};

// A mapping of another process's memory, shared by the arrays opened on it.
struct open_mapping {
  void* base{nullptr};
  int refs{0};
  context* ctx{nullptr};  // null for host memory
  int device{0};
  std::shared_ptr<shared_mapping> host;  // host memory's file
};

// Another process's control block, mapped here.
struct remote_block {
  std::shared_ptr<shared_mapping> mapping;
  std::map<context*, void*> device_address;
};

// A consumer's entry in a share's slot, claimed by an open: ending it tells the producer this process
// is done with the share.
struct entry_release {
  consumer_entry* entry{nullptr};
  std::shared_ptr<shared_mapping> block;  // the control block the entry lives in

  void operator()() const noexcept
  {
    entry->state.store(static_cast<std::uint32_t>(entry_state::released), std::memory_order_release);
  }
};

// Refuses a handle this process cannot open: another boot's, its own, or a producer that has ended.
void check_openable(const wire_handle& h)
{
  HANDOFF_EXPECTS(h.boot == handoff::detail::boot_id(), value_error,
                  "this handoff IPC handle comes from another node, or from an earlier boot of this one");
  HANDOFF_EXPECTS(h.pid != handoff::detail::this_process(), buffer_error,
                  "this handoff IPC handle was made by this very process: use the array itself (a process cannot "
                  "open its own handles, as CUDA refuses cudaIpcOpenMemHandle there)");
  HANDOFF_EXPECTS(handoff::detail::process_alive(h.pid, h.start_time), buffer_error,
                  fmt::format("the process that shared this array (pid {}) has ended: its memory is gone", h.pid));
}

// A device's UUID as nvidia-smi prints it.
std::string uuid_text(const device::device_uuid& id)
{
  std::string hex;
  for (std::size_t i = 0; i < id.size(); ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) { hex += '-'; }
    hex += fmt::format("{:02x}", std::to_integer<unsigned>(id[i]));
  }
  return "GPU-" + hex;
}

// The context that opens the device memory `h` shares: this process's, running the producer's
// backend. `h`'s device becomes this process's ordinal of it: the two processes may number the node's
// devices otherwise (CUDA_VISIBLE_DEVICES), so the handle names it by its UUID.
context& opening_context(exchange& on, wire_handle& h)
{
  context& ctx = on.require_device("opening device memory another process shared");
  device::backend& b = ctx.backend();
  HANDOFF_EXPECTS(
    b.name() == h.backend && b.device_type() == h.device.device_type, value_error,
    fmt::format("this handle shares memory of the {} backend; this process runs {}", h.backend, b.name()));
  const int devices = b.device_count();
  std::vector<std::string> seen;
  for (int d = 0; d < devices; ++d) {
    const device::device_uuid id = b.uuid(d);
    if (id == h.device_uuid) {
      h.device.device_id = d;
      return ctx;
    }
    seen.push_back(uuid_text(id));
  }
  throw value_error(fmt::format(
    "this handle shares memory of {} (device {} of process {}), a device this process does not see: it sees {} "
    "(do the two processes' CUDA_VISIBLE_DEVICES or HIP_VISIBLE_DEVICES differ?)",
    uuid_text(h.device_uuid), h.device.device_id, h.pid, fmt::join(seen, ", ")));
}

// The shared array's layout, its data still to be mapped.
array_layout layout_of(const wire_handle& h, bool host)
{
  array_layout layout;
  layout.device = host ? DLDevice{kDLCPU, 0} : h.device;
  layout.dtype = h.dtype;
  layout.shape = h.shape;
  layout.strides = h.strides;
  layout.readonly = (h.flags & read_only) != 0U;
  return layout;
}

class endpoint {
 public:
  /// This process's endpoint. A forked child makes its own: what it inherited (its parent's shares,
  /// opened arrays and files) stays its parent's, and the child's releases of it do nothing.
  static endpoint& get()
  {
    // Leaked: releases run on other threads during static destruction; shutdown() removes the files.
    static std::atomic<endpoint*> instance{nullptr};
    endpoint* current = instance.load(std::memory_order_acquire);
    while (current == nullptr || current->inherited()) {
      auto* made = new endpoint;  // NOLINT(cppcoreguidelines-owning-memory)
      if (instance.compare_exchange_strong(current, made, std::memory_order_acq_rel)) {
        // Once: a forked child inherits the handler, which stops the child's own endpoint there.
        if (current == nullptr) {
          std::atexit([] { shutdown(); });
        }
        return *made;
      }
      delete made;  // NOLINT(cppcoreguidelines-owning-memory): another thread's is in place
    }
    return *current;
  }
  /// True in a forked child of the process that made this endpoint.
  [[nodiscard]] bool inherited() const noexcept { return pid_ != handoff::detail::this_process(); }

  shared share(exchange& on, const array& x, const named_stream& ready, share_options options);
  array open(exchange& on, std::span<const std::byte> bytes, const named_stream& consumer);
  void stop() noexcept;
  void poll_now() noexcept { poll(/*scheduled=*/false); }
  bool set_back_signal(bool on) noexcept { return back_signal_.exchange(on); }

 private:
  struct slot_ref {
    std::uint32_t block{0};
    std::uint32_t index{0};
    std::uint32_t generation{0};
  };

  // Where a share of device memory is: its context, its device, and the stream its data is ready on.
  struct device_source {
    context* ctx{nullptr};
    int device{0};
    bound_stream ready_on;
  };

  /// Copies host data into a new shared memory segment, which the handle names.
  void copy_into_shared_memory(const array& x, share_options options, wire_handle& h, local_share& record);
  /// Describes device memory in the handle (its IPC memory handle, offset and allocation).
  static device_source describe_device_memory(exchange& on, const array& x, const named_stream& ready, wire_handle& h);
  /// Orders the share after its data's stream: an interprocess event recorded there, or, where none
  /// can be made, a value written there to the slot's flag (mutex held).
  void signal_ready(const device_source& source, producer_block& block, share_slot& slot, wire_handle& h,
                    local_share& record);
  slot_ref take_slot(std::uint32_t holds, std::uint32_t tickets);  // mutex held
  void release_hold(slot_ref where) noexcept;
  void count_out(slot_ref where, std::uint32_t holds, std::vector<local_share>& freed) noexcept;  // mutex held
  /// Looks at the consumers of the live shares; `scheduled`: the service thread's poll, which schedules the next.
  void poll(bool scheduled) noexcept;
  void start_polling() noexcept;                             // mutex held
  pooled_ipc_event acquire_event(context& ctx, int device);  // mutex held
  void* device_address(context& ctx, std::map<context*, void*>& known, const shared_mapping& mapping);
  remote_block& remote(const wire_handle& h);  // mutex held
  /// Lets go of the control blocks of producers that have ended, once nothing opened from them is
  /// held here; asked at most every liveness_poll (mutex held).
  void forget_ended_producers() noexcept;
  // An opened mapping of another process's memory: its key in mappings_, and its address here.
  struct mapped {
    std::string key;
    void* base{nullptr};
  };
  /// The mapping of the host segment (or device memory) `h` shares, opened once per process and
  /// counted once more (mutex held).
  mapped map_host_segment(const wire_handle& h);
  mapped map_device_memory(context& ctx, const wire_handle& h);
  /// Makes `consumer` wait for the producer's signal that the data `h` shares is ready (mutex held).
  void wait_for_producer(context& ctx, remote_block& block, share_slot& slot, const wire_handle& h,
                         device::stream_handle consumer);
  // A share this process has open, by its producer (pid, start time) and its slot and generation.
  using share_key = std::tuple<int, std::uint64_t, std::uint32_t, std::uint32_t, std::uint32_t>;
  // What ends one open of a share: the share's entry is released with the last of this process's.
  struct open_release {
    endpoint* self{nullptr};
    share_key key;
    void operator()() const noexcept { self->release_open(key); }
  };
  /// Counts an open of the share `h` names: the first of this process's claims an entry in its slot,
  /// which the others share (mutex held).
  open_release count_open(const wire_handle& h, remote_block& block);
  void release_open(const share_key& key) noexcept;
  /// The array over the mapped host segment or device memory; each unlocks `lock` once mapped.
  array open_host(const wire_handle& h, array_layout layout, std::unique_lock<std::mutex>& lock,
                  const open_release& done);
  array open_device(context& ctx, remote_block& block, const wire_handle& h, array_layout layout,
                    const named_stream& consumer, std::unique_lock<std::mutex>& lock, const open_release& done);
  void close_mapping(const std::string& key) noexcept;
  device::event_handle opened_event(context& ctx, const wire_handle& h);  // mutex held

  const int pid_{handoff::detail::this_process()};
  std::mutex mutex_;
  bool stopped_{false};
  // producer
  std::deque<producer_block> blocks_;
  std::vector<std::pair<std::uint32_t, std::uint32_t>> free_slots_;
  // Released slots whose share's value (stream memory operations) is not yet written: freed once it is.
  struct unsignalled_slot {
    std::uint32_t block{0};
    std::uint32_t index{0};
    std::uint64_t value{0};
  };
  std::vector<unsignalled_slot> unsignalled_slots_;
  std::size_t live_shares_{0};
  std::map<std::pair<context*, int>, std::vector<pooled_ipc_event>> idle_events_;
  bool values_only_{values_asked_for()};
  std::uint64_t next_ready_{0};
  std::unique_ptr<executor> poller_;
  bool polling_{false};
  std::chrono::steady_clock::time_point last_liveness_{};
  // consumer
  std::map<std::pair<int, std::uint64_t>, std::map<std::uint32_t, remote_block>> remotes_;
  std::chrono::steady_clock::time_point last_remote_liveness_{};
  std::map<std::string, open_mapping> mappings_;
  // This process's entry in each share it has open, and how many of its opens share it.
  struct held_entry {
    entry_release release;
    std::size_t opens{0};
  };
  std::map<share_key, held_entry> held_entries_;
  std::map<std::string, std::pair<context*, device::event_handle>> opened_events_;
  std::deque<std::string> opened_order_;
  std::atomic<bool> back_signal_{true};  // off: the negative control of tests (ipc::set_back_signal)
};

// --- producer ---------------------------------------------------------------------------------------

endpoint::slot_ref endpoint::take_slot(std::uint32_t holds, std::uint32_t tickets)
{
  if (free_slots_.empty()) {
    const auto index = static_cast<std::uint32_t>(blocks_.size());
    shared_mapping mapping = [&] {
      try {
        return shared_mapping::create(handoff::detail::shared_memory_name(block_kind, index), sizeof(control_block));
      } catch (const std::system_error& e) {
        throw buffer_error(
          fmt::format("cannot share between processes: {} (set HANDOFF_IPC_DIR to a folder the "
                      "processes share, such as a common /dev/shm)",
                      e.what()));
      }
    }();
    auto* shared = new (mapping.data()) control_block{};
    shared->header = {.magic = block_magic,
                      .token = handoff::detail::random_token(),
                      .pid = handoff::detail::this_process(),
                      .start_time = handoff::detail::this_process_start_time()};
    blocks_.push_back(
      producer_block{.mapping = std::move(mapping), .shared = shared, .locals = {}, .live = {}, .device_address = {}});
    for (std::uint32_t i = shares_per_block; i-- > 0;) { free_slots_.emplace_back(index, i); }
  }
  const auto [block, index] = free_slots_.back();
  free_slots_.pop_back();
  auto& slot = blocks_[block].shared->slots[index];
  const std::uint32_t generation = generation_of(slot.word.load(std::memory_order_acquire));
  slot.tickets.store(tickets, std::memory_order_relaxed);
  slot.tickets_used.store(0, std::memory_order_relaxed);
  slot.word.store(pack_word(generation, holds), std::memory_order_release);
  blocks_[block].live[index] = true;
  ++live_shares_;
  return {block, index, generation};
}

pooled_ipc_event endpoint::acquire_event(context& ctx, int device)
{
  auto& idle = idle_events_[{&ctx, device}];
  if (!idle.empty()) {
    pooled_ipc_event e = idle.back();
    idle.pop_back();
    count(counter::events_reused);
    return e;
  }
  device::backend& b = ctx.backend();
  pooled_ipc_event e{.ctx = &ctx, .device = device, .event = b.create_ipc_event(), .handle = {}};
  try {
    e.handle = b.ipc_event_handle(e.event);
  } catch (...) {
    b.destroy_event(e.event);
    throw;
  }
  count(counter::events_created);
  return e;
}

void* endpoint::device_address(context& ctx, std::map<context*, void*>& known, const shared_mapping& mapping)
{
  if (const auto it = known.find(&ctx); it != known.end()) { return it->second; }
  void* address = ctx.backend().register_host_memory(mapping.data(), mapping.size());
  known.emplace(&ctx, address);
  return address;
}

shared endpoint::share(exchange& on, const array& x, const named_stream& ready, share_options options)
{
  // An export to whichever processes open the share: they wait for it there (the trace's "ipc").
  trace::exchange_scope scope{trace::event_kind::export_data, "ipc"};
  if (scope.active()) {
    scope.event().consumer = "ipc";
    scope.set_view(x);
  }
  handoff::detail::remove_leftovers();
  // The shares whose consumers are done give their events back first: a steady stream of shares
  // then reuses a few events, however far the service thread's polls have backed off.
  poll(/*scheduled=*/false);
  wire_handle h;
  h.boot = handoff::detail::boot_id();
  h.pid = handoff::detail::this_process();
  h.start_time = handoff::detail::this_process_start_time();
  h.dtype = x.dtype();
  h.shape.assign(x.shape().begin(), x.shape().end());
  h.strides.assign(x.strides().begin(), x.strides().end());
  h.flags = (x.readonly() ? read_only : 0U) | (options.in_flight ? in_flight : 0U);
  h.device = x.device();
  const DLDeviceType type = x.device().device_type;
  local_share record;
  std::optional<device_source> source;
  if (type == kDLCPU) {
    copy_into_shared_memory(x, options, h, record);
  } else if (has_streams(type) && !is_host_accessible(type) && type != kDLCUDAManaged) {
    source = describe_device_memory(on, x, ready, h);
    scope.forget_ordering();  // the ready stream's wait for the array's is the share's own preparation
    scope.set_producer_stream(source->ready_on);
    record.data = x;
  } else {
    throw buffer_error(
      fmt::format("{} memory cannot be shared between processes: share device memory (or host "
                  "memory, which is copied into shared memory)",
                  device_type_name(type)));
  }

  std::unique_lock lock{mutex_};
  HANDOFF_EXPECTS(!stopped_, error, "handoff.ipc: the process is shutting down");
  const slot_ref where = take_slot(1, options.in_flight ? 1 : 0);
  auto& block = blocks_[where.block];
  h.block = where.block;
  h.slot = where.index;
  h.generation = where.generation;
  h.block_token = block.shared->header.token;
  try {
    if (source) { signal_ready(*source, block, block.shared->slots[where.index], h, record); }
  } catch (...) {
    std::vector<local_share> freed;
    if (record.event) { idle_events_[{record.event->ctx, record.event->device}].push_back(*record.event); }
    record.event.reset();
    count_out(where, 1, freed);
    lock.unlock();
    throw;
  }
  block.locals[where.index] = std::move(record);
  start_polling();
  lock.unlock();
  count(counter::ipc_shares);
  shared out{encode(h), nullptr};
  if (!options.in_flight) {
    out.hold = std::shared_ptr<const void>(this, [where](const void* self) {
      const_cast<endpoint*>(static_cast<const endpoint*>(self))->release_hold(where);
    });
  }
  return out;
}

void endpoint::copy_into_shared_memory(const array& x, share_options options, wire_handle& h, local_share& record)
{
  HANDOFF_EXPECTS(options.copy != false, buffer_error,
                  "copy=False: host memory that is not in shared memory is copied once into shared memory to be "
                  "shared between processes");
  const auto bytes = static_cast<std::size_t>(x.nbytes());
  h.flags |= host_memory;
  h.backend = "none";
  std::lock_guard lock{mutex_};
  h.host_segment = handoff::detail::next_shared_serial();
  try {
    record.host_copy = std::make_unique<shared_mapping>(shared_mapping::create(
      handoff::detail::shared_memory_name(host_kind, h.host_segment), std::max<std::size_t>(bytes, 1)));
  } catch (const std::system_error& e) {
    throw buffer_error(fmt::format("cannot copy host memory into shared memory: {}", e.what()));
  }
  if (bytes > 0) {
    if (x.is_c_contiguous()) {
      std::memcpy(record.host_copy->data(), x.data(), bytes);
    } else {
      const array compact = copy_to_host(x);
      std::memcpy(record.host_copy->data(), compact.data(), bytes);
    }
  }
  const auto strides = contiguous_strides(x.shape());
  h.strides.assign(strides.begin(), strides.end());
  h.allocation_size = bytes;
}

endpoint::device_source endpoint::describe_device_memory(exchange& on, const array& x, const named_stream& ready,
                                                         wire_handle& h)
{
  context& ctx = on.require_device("sharing device memory with another process");
  require_stream_ordered(ctx, x);
  const int device = owning_device(ctx, x);
  device::backend& b = ctx.backend();
  const device_guard on_device{b, device};
  HANDOFF_EXPECTS(x.data() != nullptr, buffer_error,
                  "an empty device array with no memory (a null data pointer) has no allocation to share between "
                  "processes: make the empty array on the consumer's side");
  const device::pointer_attributes attributes = b.attributes(x.data());
  HANDOFF_EXPECTS(attributes.kind == device::memory_kind::device, buffer_error,
                  "only device memory can be shared between processes (CUDA IPC maps cudaMalloc's memory)");
  try {
    h.memory = b.ipc_memory_handle(const_cast<void*>(attributes.base));
  } catch (const device_error& e) {
    throw buffer_error(fmt::format("this device memory cannot be shared between processes: {}", e.what()));
  }
  h.offset = static_cast<std::uint64_t>(static_cast<const std::byte*>(x.data()) -
                                        static_cast<const std::byte*>(attributes.base));
  h.allocation_size = attributes.size;
  h.backend = std::string{b.name()};
  h.device = {x.device().device_type, device};
  h.device_uuid = b.uuid(device);
  // The stream the data is known to be ready on (an array's); `ready` names it where none is known,
  // and where it names another, that stream waits for the known one: a share is ready after both.
  std::optional<bound_stream> known = x.owner().ready_on();
  if (known && known->ctx != &ctx) { known.reset(); }
  if (known && ready.is_default()) { return {.ctx = &ctx, .device = device, .ready_on = *known}; }
  bound_stream ready_on = binding_on(ctx, x.device(), ready);
  if (known) { ready_on.wait_for(*known); }
  return {.ctx = &ctx, .device = device, .ready_on = ready_on};
}

void endpoint::signal_ready(const device_source& source, producer_block& block, share_slot& slot, wire_handle& h,
                            local_share& record)
{
  device::backend& b = source.ctx->backend();
  const device_guard on_device{b, source.device};
  if (!values_only_) {
    try {
      record.event = acquire_event(*source.ctx, source.device);
    } catch (const device_error& e) {
      if (e.error_name() != "cudaErrorNotSupported" && e.error_name() != "hipErrorNotSupported") { throw; }
      HANDOFF_LOG_INFO(
        "handoff.ipc: interprocess events cannot be made here ({}); shares are ordered by stream "
        "memory operations instead",
        e.what());
      values_only_ = true;
    }
  }
  if (record.event) {
    b.record_event(record.event->event, source.ready_on.stream);
    h.event = record.event->handle;
    return;
  }
  h.flags |= value_ordered;
  h.ready_value = ++next_ready_;
  record.ready_value = h.ready_value;
  auto* flag = static_cast<std::byte*>(device_address(*source.ctx, block.device_address, block.mapping)) +
               (reinterpret_cast<std::byte*>(&slot.ready) - static_cast<std::byte*>(block.mapping.data()));
  b.stream_write_value(source.ready_on.stream, flag, h.ready_value);
}

void endpoint::release_hold(slot_ref where) noexcept
{
  if (inherited()) { return; }  // the parent's hold, which a forked child's copy of the handle does not own
  std::vector<local_share> freed;
  {
    std::lock_guard lock{mutex_};
    count_out(where, 1, freed);
  }
  freed.clear();  // the arrays go outside the lock: their release may call back into handoff
}

void endpoint::count_out(slot_ref where, std::uint32_t holds, std::vector<local_share>& freed) noexcept
{
  auto& block = blocks_[where.block];
  auto& slot = block.shared->slots[where.index];
  const std::uint64_t before = slot.word.fetch_sub(holds, std::memory_order_acq_rel);
  if (holds_of(before) != holds || !block.live[where.index]) { return; }
  // Nobody holds the share: no consumer can count itself in any more (the holds are zero), so the
  // slot is made ready for another share, under a new generation that refuses this one's handles.
  for (auto& entry : slot.consumers) { entry.state.store(static_cast<std::uint32_t>(entry_state::free)); }
  slot.tickets.store(0);
  slot.tickets_used.store(0);
  slot.word.store(pack_word(generation_of(before) + 1, 0), std::memory_order_release);
  auto& record = block.locals[where.index];
  if (record.event) { idle_events_[{record.event->ctx, record.event->device}].push_back(*record.event); }
  record.event.reset();
  if (record.host_copy) { record.host_copy->unlink(); }  // the consumers' mappings stay
  const std::uint64_t ready_value = record.ready_value;
  freed.push_back(std::move(record));
  record = local_share{};
  block.live[where.index] = false;
  --live_shares_;
  if (ready_value > slot.ready.load(std::memory_order_acquire)) {
    // Its value is still to be written on the producer's stream: a later share of the slot would
    // have its own, higher value written over by it, and its consumers would wait forever.
    unsignalled_slots_.push_back({.block = where.block, .index = where.index, .value = ready_value});
    start_polling();
    return;
  }
  free_slots_.emplace_back(where.block, where.index);
}

void endpoint::start_polling() noexcept
{
  if (polling_ || stopped_) { return; }
  try {
    if (!poller_) { poller_ = make_service_thread(); }
    polling_ = true;
    poller_->post_after(min_poll, [this] { poll(/*scheduled=*/true); });
  } catch (...) {
    polling_ = false;
    HANDOFF_LOG_ERROR("handoff.ipc: cannot watch the consumers of this process's shares; they are kept");
  }
}

void endpoint::poll(bool scheduled) noexcept
{
  static thread_local auto interval = std::chrono::nanoseconds{min_poll};
  std::vector<local_share> freed;
  bool changed = false;
  {
    std::lock_guard lock{mutex_};
    const auto now = std::chrono::steady_clock::now();
    const bool ask_liveness = now - last_liveness_ >= liveness_poll;
    if (ask_liveness) { last_liveness_ = now; }
    std::int64_t pending = 0;
    for (std::uint32_t b = 0; b < blocks_.size(); ++b) {
      auto& block = blocks_[b];
      for (std::uint32_t i = 0; i < shares_per_block; ++i) {
        if (!block.live[i]) { continue; }
        auto& slot = block.shared->slots[i];
        const std::uint32_t generation = generation_of(slot.word.load(std::memory_order_acquire));
        std::uint32_t done = slot.tickets_used.exchange(0, std::memory_order_acq_rel);
        for (auto& entry : slot.consumers) {
          auto state = static_cast<entry_state>(entry.state.load(std::memory_order_acquire));
          if (state == entry_state::free) { continue; }
          if (state == entry_state::released) {
            if (free_released(entry)) {
              ++done;
              continue;
            }
            state = entry_state::open;  // taken back by its consumer
          }
          if (ask_liveness && !handoff::detail::process_alive(entry.pid.load(), entry.start_time.load())) {
            HANDOFF_LOG_WARN("handoff.ipc: consumer process {} ended holding a share; its hold is released",
                             entry.pid.load());
            entry.state.store(static_cast<std::uint32_t>(entry_state::free), std::memory_order_release);
            if (state == entry_state::open && entry.generation.load() == generation) { ++done; }
            continue;
          }
          if (state == entry_state::open) { ++pending; }
        }
        if (done > 0) {
          changed = true;
          count_out({b, i, generation}, done, freed);
        }
      }
    }
    std::erase_if(unsignalled_slots_, [this](const unsignalled_slot& s) {
      if (blocks_[s.block].shared->slots[s.index].ready.load(std::memory_order_acquire) < s.value) { return false; }
      free_slots_.emplace_back(s.block, s.index);
      return true;
    });
    handoff::detail::set_ipc_pending_remote_releases(pending);
    if (!scheduled) {
      // Asked for (a test): the service thread's polls go on as they were.
    } else if ((live_shares_ == 0 && unsignalled_slots_.empty()) || stopped_) {
      polling_ = false;
    } else {
      interval =
        changed ? std::chrono::nanoseconds{min_poll} : std::min<std::chrono::nanoseconds>(interval * 2, max_poll);
      try {
        poller_->post_after(interval, [this] { poll(/*scheduled=*/true); });
      } catch (...) {
        polling_ = false;
      }
    }
  }
  freed.clear();
}

// --- consumer ---------------------------------------------------------------------------------------

remote_block& endpoint::remote(const wire_handle& h)
{
  auto& blocks = remotes_[{h.pid, h.start_time}];
  if (const auto it = blocks.find(h.block); it != blocks.end()) { return it->second; }
  std::optional<shared_mapping> mapping;
  try {
    mapping = shared_mapping::open(handoff::detail::shared_memory_name(block_kind, h.pid, h.block));
  } catch (const std::system_error& e) {
    throw buffer_error(fmt::format("cannot reach the shares of process {}: {}", h.pid, e.what()));
  }
  HANDOFF_EXPECTS(mapping.has_value(), buffer_error,
                  fmt::format("the process that shared this array (pid {}) has ended, or shares in a folder this "
                              "process does not see (HANDOFF_IPC_DIR)",
                              h.pid));
  const auto* shared = static_cast<const control_block*>(mapping->data());
  HANDOFF_EXPECTS(mapping->size() == sizeof(control_block) && shared->header.magic == block_magic &&
                    shared->header.token == h.block_token && shared->header.pid == h.pid,
                  value_error, "a forged or stale handoff IPC handle: it does not match its producer's shares");
  return blocks.emplace(h.block, remote_block{std::make_shared<shared_mapping>(std::move(*mapping)), {}}).first->second;
}

void endpoint::forget_ended_producers() noexcept
{
  const auto now = std::chrono::steady_clock::now();
  if (now - last_remote_liveness_ < liveness_poll) { return; }
  last_remote_liveness_ = now;
  for (auto producer = remotes_.begin(); producer != remotes_.end();) {
    auto& [who, blocks] = *producer;
    if (handoff::detail::process_alive(who.first, who.second)) {
      ++producer;
      continue;
    }
    // Its blocks are let go of once nothing opened from them is held here: each open holds its block,
    // whose registration a consumer stream's wait for a share's value may still read.
    std::erase_if(blocks, [](const auto& entry) {
      const remote_block& block = entry.second;
      if (block.mapping.use_count() > 1) { return false; }
      for (const auto& [ctx, address] : block.device_address) {
        ctx->backend().unregister_host_memory(block.mapping->data());
      }
      return true;
    });
    producer = blocks.empty() ? remotes_.erase(producer) : std::next(producer);
  }
}

device::event_handle endpoint::opened_event(context& ctx, const wire_handle& h)
{
  const std::string key = key_of(h.pid, h.start_time, h.event.bytes);
  if (const auto it = opened_events_.find(key); it != opened_events_.end()) { return it->second.second; }
  const device::event_handle event = ctx.backend().open_ipc_event(h.event);
  opened_events_.emplace(key, std::make_pair(&ctx, event));
  opened_order_.push_back(key);
  while (opened_order_.size() > opened_events_kept) {  // waits already enqueued keep what they captured
    const auto oldest = opened_events_.find(opened_order_.front());
    opened_order_.pop_front();
    if (oldest != opened_events_.end()) {
      oldest->second.first->backend().destroy_event(oldest->second.second);
      opened_events_.erase(oldest);
    }
  }
  return event;
}

void endpoint::close_mapping(const std::string& key) noexcept
{
  std::lock_guard lock{mutex_};
  const auto it = mappings_.find(key);
  if (it == mappings_.end() || --it->second.refs > 0) { return; }
  if (it->second.ctx != nullptr) {
    try {
      const device_guard on{it->second.ctx->backend(), it->second.device};
      it->second.ctx->backend().close_ipc_memory(it->second.base);
    } catch (const std::exception& e) {
      HANDOFF_LOG_ERROR("handoff.ipc: cannot close a mapping of another process's memory: {}", e.what());
    }
  }
  mappings_.erase(it);
  handoff::detail::ipc_mappings_changed(-1);
}

array endpoint::open(exchange& on, std::span<const std::byte> bytes, const named_stream& consumer)
{
  trace::exchange_scope scope{trace::event_kind::import_data, "ipc"};
  if (scope.active()) {
    scope.event().producer = "ipc";
    scope.event().consumer = "handoff";
  }
  wire_handle h = decode(bytes);
  check_openable(h);
  const bool host = (h.flags & host_memory) != 0U;
  context* ctx = host ? nullptr : &opening_context(on, h);
  array_layout layout = layout_of(h, host);

  std::unique_lock lock{mutex_};
  forget_ended_producers();
  remote_block& block = remote(h);
  const open_release done = count_open(h, block);
  try {
    array view = host ? open_host(h, std::move(layout), lock, done)
                      : open_device(*ctx, block, h, std::move(layout), consumer, lock, done);
    scope.set_view(view);
    return view;
  } catch (...) {
    if (lock.owns_lock()) { lock.unlock(); }
    done();  // the producer counts the hold out
    throw;
  }
}

endpoint::open_release endpoint::count_open(const wire_handle& h, remote_block& block)
{
  share_slot& slot = static_cast<control_block*>(block.mapping->data())->slots[h.slot];
  const share_key key{h.pid, h.start_time, h.block, h.slot, h.generation};
  auto held = held_entries_.find(key);
  if (held == held_entries_.end()) {
    const claim claimed =
      claim_share(slot, h.generation, handoff::detail::this_process(), handoff::detail::this_process_start_time());
    HANDOFF_EXPECTS(!claimed.full, buffer_error,
                    fmt::format("this share is open in {} processes already, the most it can be at once (a "
                                "process's place is free again once the producer has seen its release)",
                                consumers_per_share));
    HANDOFF_EXPECTS(claimed.entry != nullptr, buffer_error,
                    fmt::format("the process that shared this array (pid {}) has released the share: its memory may "
                                "be freed or reused (keep the handle, or the array, alive there until it is opened)",
                                h.pid));
    held = held_entries_.emplace(key, held_entry{.release = {claimed.entry, block.mapping}, .opens = 0}).first;
  }
  if ((h.flags & in_flight) != 0U) { take_ticket(slot); }  // each open of an in-flight handle uses its ticket
  ++held->second.opens;
  return {this, key};
}

void endpoint::release_open(const share_key& key) noexcept
{
  std::lock_guard lock{mutex_};
  const auto held = held_entries_.find(key);
  if (held == held_entries_.end() || --held->second.opens > 0) { return; }
  held->second.release();
  held_entries_.erase(held);
}

array endpoint::open_host(const wire_handle& h, array_layout layout, std::unique_lock<std::mutex>& lock,
                          const open_release& done)
{
  const mapped segment = map_host_segment(h);
  layout.data = static_cast<std::byte*>(segment.base) + h.offset;  // 0: a host share copies the array alone
  lock.unlock();
  count(counter::ipc_opens);
  count(counter::imports);
  return array{std::move(layout), shared_producer{[this, key = segment.key, done]() noexcept {
                 if (inherited()) { return; }  // the parent's entry and mapping
                 close_mapping(key);
                 done();
               }}};
}

array endpoint::open_device(context& ctx, remote_block& block, const wire_handle& h, array_layout layout,
                            const named_stream& consumer, std::unique_lock<std::mutex>& lock, const open_release& done)
{
  const int device = h.device.device_id;
  const device_guard on_device{ctx.backend(), device};
  // The consumer's stream, checked before anything is mapped; none where it orders its work itself
  // (stream=-1, as for from_dlpack): nothing is waited for, and the share is released with the array.
  std::optional<bound_stream> waits;
  if (request_for(consumer, h.device.device_type).order != stream_order::none) {
    waits = binding_on(ctx, h.device, consumer);
  }
  const mapped memory = map_device_memory(ctx, h);
  layout.data = static_cast<std::byte*>(memory.base) + h.offset;
  try {
    share_slot& slot = static_cast<control_block*>(block.mapping->data())->slots[h.slot];
    if (waits) { wait_for_producer(ctx, block, slot, h, waits->stream); }
    if (trace::exchange_scope* scope = trace::traced()) {
      if (waits) {
        scope->note_wait_for_process(*waits);
      } else {
        scope->note_unordered();  // stream=-1: the consumer orders its work itself
      }
    }
  } catch (...) {
    lock.unlock();
    close_mapping(memory.key);
    throw;
  }
  lock.unlock();
  count(counter::ipc_opens);
  count(counter::imports);
  if (!waits || back_signal_.load(std::memory_order_relaxed)) {
    // Released once the work enqueued on the consumer's stream by then is done: the mapping is
    // closed first (CUDA: the producer must not free memory another process still maps).
    array view{std::move(layout), shared_producer{[this, key = memory.key, done]() noexcept {
                 if (inherited()) { return; }  // the parent's entry and mapping
                 close_mapping(key);
                 done();
               }}};
    if (waits) { bind_import(view, *waits); }
    return view;
  }
  // The negative control: the producer is told at once; only the mapping waits for the stream.
  array view{std::move(layout), shared_producer{[this, key = memory.key, done, waits = *waits]() noexcept {
               done();
               waits.release_after([this, key]() noexcept { close_mapping(key); });
             }}};
  view.owner().set_ready_on(*waits);
  return view;
}

endpoint::mapped endpoint::map_host_segment(const wire_handle& h)
{
  std::string key = key_of(h.pid, h.start_time, std::as_bytes(std::span{&h.host_segment, 1}));
  auto it = mappings_.find(key);
  if (it == mappings_.end()) {
    std::optional<shared_mapping> mapping;
    try {
      mapping = shared_mapping::open(handoff::detail::shared_memory_name(host_kind, h.pid, h.host_segment));
    } catch (const std::system_error& e) {
      throw buffer_error(fmt::format("cannot map the shared host memory: {}", e.what()));
    }
    HANDOFF_EXPECTS(mapping && mapping->size() >= h.allocation_size, buffer_error,
                    "the shared host memory is gone: its producer released it");
    auto file = std::make_shared<shared_mapping>(std::move(*mapping));
    it = mappings_.emplace(key, open_mapping{file->data(), 0, nullptr, 0, file}).first;
    handoff::detail::ipc_mappings_changed(+1);
  }
  ++it->second.refs;
  return {std::move(key), it->second.base};
}

endpoint::mapped endpoint::map_device_memory(context& ctx, const wire_handle& h)
{
  std::string key = key_of(h.pid, h.start_time, h.memory.bytes);
  auto it = mappings_.find(key);
  if (it == mappings_.end()) {
    void* base = nullptr;
    try {
      base = ctx.backend().open_ipc_memory(h.memory);
    } catch (const device_error& e) {
      throw buffer_error(
        fmt::format("cannot map the memory process {} shared (freed, or its process ended?): {}", h.pid, e.what()));
    }
    it = mappings_.emplace(key, open_mapping{base, 0, &ctx, h.device.device_id, nullptr}).first;
    handoff::detail::ipc_mappings_changed(+1);
  }
  ++it->second.refs;
  return {std::move(key), it->second.base};
}

void endpoint::wait_for_producer(context& ctx, remote_block& block, share_slot& slot, const wire_handle& h,
                                 device::stream_handle consumer)
{
  device::backend& b = ctx.backend();
  if ((h.flags & value_ordered) != 0U) {
    auto* flag = static_cast<std::byte*>(device_address(ctx, block.device_address, *block.mapping)) +
                 (reinterpret_cast<std::byte*>(&slot.ready) - static_cast<std::byte*>(block.mapping->data()));
    b.stream_wait_value(consumer, flag, h.ready_value);
  } else {
    b.stream_wait_event(consumer, opened_event(ctx, h));
  }
  count(counter::waits_inserted);
}

void endpoint::stop() noexcept
{
  std::unique_ptr<executor> poller;
  {
    std::lock_guard lock{mutex_};
    if (stopped_) { return; }
    stopped_ = true;
    for (auto& block : blocks_) {
      block.mapping.unlink();
      for (auto& record : block.locals) {
        if (record.host_copy) { record.host_copy->unlink(); }
      }
    }
    poller = std::move(poller_);
  }
  poller.reset();  // joins: a poll in progress ends, and schedules no other
}

}  // namespace

shared share(exchange& on, const array& x, const named_stream& ready, share_options options)
{
  return endpoint::get().share(on, x, ready, options);
}

array open(exchange& on, std::span<const std::byte> handle, const named_stream& consumer)
{
  return endpoint::get().open(on, handle, consumer);
}

handle_description describe(std::span<const std::byte> handle)
{
  const wire_handle h = decode(handle);
  handle_description d;
  d.producer_pid = h.pid;
  d.device = (h.flags & host_memory) != 0U ? DLDevice{kDLCPU, 0} : h.device;
  d.dtype = h.dtype;
  d.shape = h.shape;
  std::int64_t count = 1;
  for (const auto extent : h.shape) { count *= extent; }
  d.nbytes = count * static_cast<std::int64_t>((h.dtype.bits * h.dtype.lanes + 7) / 8);
  d.backend = h.backend;
  d.host_memory = (h.flags & host_memory) != 0U;
  d.in_flight = (h.flags & in_flight) != 0U;
  return d;
}

void poll_consumers() noexcept
{
  endpoint::get().poll_now();
}

void shutdown() noexcept
{
  endpoint::get().stop();
}

bool set_back_signal(bool on) noexcept
{
  return endpoint::get().set_back_signal(on);
}

}  // namespace handoff::ipc
