// The simulated device: CUDA's stream, event and memory semantics on a pool of host threads.
//
// Every piece of stream work (a copy, a host function, a fill, an event record, a wait) is a node
// in a dependency graph. A node depends on the previous node of its stream (in-order queues), on
// the event it waits for, and on the implicit dependencies of the legacy default stream. A node
// runs on the worker pool once its dependencies are done; a delay is an Asio timer, so sleeping
// work never holds a worker. Dependencies always point to nodes enqueued earlier, so the graph
// is acyclic and every node eventually runs.
#if defined(__SANITIZE_THREAD__) && !defined(BOOST_ASIO_DISABLE_FENCED_BLOCK)
// Asio's fenced blocks use std::atomic_thread_fence, which TSan does not model (-Wtsan). Handlers
// reach the workers through the io_context's mutex-protected queue, which TSan does see. (Every
// TU that includes Asio should agree on this; the build may define it for all of them.)
#define BOOST_ASIO_DISABLE_FENCED_BLOCK 1
#endif

#include "device/sim/sim_backend.hpp"

#include "log/logger.hpp"

#include <handoff/error.hpp>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

namespace handoff::device {
namespace {

namespace asio = boost::asio;
using std::chrono::nanoseconds;

constexpr std::align_val_t allocation_alignment{256};
constexpr unsigned worker_threads = 8;  // host functions may block; keep a few spare workers

// ------------------------------------------------------------------------------------------------
// Names: each operation's runtime call, each error's CUDA and HIP names and text.

enum class sim_error {
  invalid_value,
  invalid_device,
  invalid_handle,
  memory_allocation,
  capture_unsupported,
  capture_invalidated,
  capture_implicit,
  capture_isolation,
  capture_unmatched,
  captured_event,
  illegal_state,
};

struct error_info {
  sim_error code;
  std::string_view cuda_name;
  std::string_view hip_name;
  std::string_view text;
};

constexpr std::array error_table{
  error_info{sim_error::invalid_value, "cudaErrorInvalidValue", "hipErrorInvalidValue", "invalid argument"},
  error_info{sim_error::invalid_device, "cudaErrorInvalidDevice", "hipErrorInvalidDevice", "invalid device ordinal"},
  error_info{sim_error::invalid_handle, "cudaErrorInvalidResourceHandle", "hipErrorInvalidHandle",
             "invalid resource handle"},
  error_info{sim_error::memory_allocation, "cudaErrorMemoryAllocation", "hipErrorOutOfMemory", "out of memory"},
  error_info{sim_error::capture_unsupported, "cudaErrorStreamCaptureUnsupported", "hipErrorStreamCaptureUnsupported",
             "operation not permitted when stream is capturing"},
  error_info{sim_error::capture_invalidated, "cudaErrorStreamCaptureInvalidated", "hipErrorStreamCaptureInvalidated",
             "operation failed due to a previous error during capture"},
  error_info{sim_error::capture_implicit, "cudaErrorStreamCaptureImplicit", "hipErrorStreamCaptureImplicit",
             "operation would make the legacy stream depend on a capturing blocking stream"},
  error_info{sim_error::capture_isolation, "cudaErrorStreamCaptureIsolation", "hipErrorStreamCaptureIsolation",
             "dependency created on uncaptured work in another stream"},
  error_info{sim_error::capture_unmatched, "cudaErrorStreamCaptureUnmatched", "hipErrorStreamCaptureUnmatched",
             "capture was not initiated in this stream"},
  error_info{sim_error::captured_event, "cudaErrorCapturedEvent", "hipErrorCapturedEvent",
             "operation not permitted on an event last recorded in a capturing stream"},
  error_info{sim_error::illegal_state, "cudaErrorIllegalState", "hipErrorIllegalState",
             "the operation cannot be performed in the present state"},
};

// Names the calling thread for per-thread state (its current device, its default stream). Unlike
// std::thread::id, never reused after a thread ends: a new thread starts with nothing current and
// its own default stream, as in CUDA, where that state is thread-local.
enum class thread_key : std::uint64_t {};

thread_key this_thread_key() noexcept
{
  static std::atomic<std::uint64_t> next{0};
  thread_local const thread_key key{next.fetch_add(1, std::memory_order_relaxed)};
  return key;
}

struct operation_info {
  std::string_view key;
  std::string_view cuda_call;
  std::string_view hip_call;
};

constexpr std::array operation_table{
  operation_info{"device_count", "cudaGetDeviceCount", "hipGetDeviceCount"},
  operation_info{"current_device", "cudaGetDevice", "hipGetDevice"},
  operation_info{"set_current_device", "cudaSetDevice", "hipSetDevice"},
  operation_info{"push_current_device", "cuCtxPushCurrent", "hipCtxPushCurrent"},
  operation_info{"create_stream", "cudaStreamCreateWithFlags", "hipStreamCreateWithFlags"},
  operation_info{"stream_device", "cudaStreamGetDevice", "hipStreamGetDevice"},
  operation_info{"stream_is_blocking", "cudaStreamGetFlags", "hipStreamGetFlags"},
  operation_info{"stream_capture_status", "cudaStreamIsCapturing", "hipStreamIsCapturing"},
  operation_info{"synchronize_stream", "cudaStreamSynchronize", "hipStreamSynchronize"},
  operation_info{"synchronize_device", "cudaDeviceSynchronize", "hipDeviceSynchronize"},
  operation_info{"create_event", "cudaEventCreateWithFlags", "hipEventCreateWithFlags"},
  operation_info{"record_event", "cudaEventRecord", "hipEventRecord"},
  operation_info{"query_event", "cudaEventQuery", "hipEventQuery"},
  operation_info{"synchronize_event", "cudaEventSynchronize", "hipEventSynchronize"},
  operation_info{"stream_wait_event", "cudaStreamWaitEvent", "hipStreamWaitEvent"},
  operation_info{"attributes", "cuPointerGetAttributes", "hipPointerGetAttributes"},
  operation_info{"allocate", "cudaMallocAsync", "hipMallocAsync"},
  operation_info{"copy_async", "cudaMemcpyAsync", "hipMemcpyAsync"},
  operation_info{"launch_host_func", "cudaLaunchHostFunc", "hipLaunchHostFunc"},
  operation_info{"enqueue_fill", "simEnqueueFill", "simEnqueueFill"},
  operation_info{"enqueue_sleep", "simEnqueueSleep", "simEnqueueSleep"},
  operation_info{"begin_capture", "cudaStreamBeginCapture", "hipStreamBeginCapture"},
  operation_info{"end_capture", "cudaStreamEndCapture", "hipStreamEndCapture"},
  operation_info{"allocate_pinned_host", "cudaMallocHost", "hipHostMalloc"},
  operation_info{"allocate_managed", "cudaMallocManaged", "hipMallocManaged"},
  operation_info{"free_sync", "cudaFree", "hipFree"},
};

// Not injectable: they are noexcept (a failure there can only be logged).
constexpr std::array<std::string_view, 4> quiet_operations{"destroy_stream", "destroy_event", "deallocate",
                                                           "pop_current_device"};
constexpr std::array<std::string_view, 3> quiet_calls_cuda{"cudaStreamDestroy", "cudaEventDestroy", "cudaFreeAsync"};
constexpr std::array<std::string_view, 3> quiet_calls_hip{"hipStreamDestroy", "hipEventDestroy", "hipFreeAsync"};

constexpr auto operation_keys = [] {
  std::array<std::string_view, operation_table.size()> keys{};
  for (std::size_t i = 0; i < operation_table.size(); ++i) { keys[i] = operation_table[i].key; }
  return keys;
}();

std::string_view call_name(std::string_view op, sim_flavour flavour) noexcept
{
  for (const auto& info : operation_table) {
    if (info.key == op) { return flavour == sim_flavour::cuda ? info.cuda_call : info.hip_call; }
  }
  for (std::size_t i = 0; i < quiet_operations.size(); ++i) {
    if (quiet_operations[i] == op) { return flavour == sim_flavour::cuda ? quiet_calls_cuda[i] : quiet_calls_hip[i]; }
  }
  return op;
}

std::string_view error_text(std::string_view name) noexcept
{
  for (const auto& info : error_table) {
    if (info.cuda_name == name || info.hip_name == name) { return info.text; }
  }
  return "injected fault";
}

std::uintptr_t raw(stream_handle h) noexcept
{
  return static_cast<std::uintptr_t>(h);
}
std::uintptr_t raw(event_handle h) noexcept
{
  return static_cast<std::uintptr_t>(h);
}
std::uintptr_t address(const void* p) noexcept
{
  return reinterpret_cast<std::uintptr_t>(p);
}

// ------------------------------------------------------------------------------------------------
// The work graph.

struct node;
using node_ptr = std::shared_ptr<node>;

struct node {
  std::function<void()> body;  // empty for markers (event records, waits)
  nanoseconds delay{0};
  bool trivial{false};                  // no body and no delay: completes where it becomes ready
  std::atomic<std::size_t> pending{1};  // unfinished dependencies, plus one held by submit()
  std::mutex mutex;
  std::condition_variable done_cv;
  bool done{false};                  // guarded by mutex
  std::vector<node_ptr> dependents;  // guarded by mutex; released when done
};

bool is_done(const node_ptr& n)
{
  if (!n) { return true; }
  std::lock_guard lock(n->mutex);
  return n->done;
}

void wait_for(const node_ptr& n)
{
  if (!n) { return; }
  std::unique_lock lock(n->mutex);
  n->done_cv.wait(lock, [&] { return n->done; });
}

/// Runs ready nodes on an io_context served by a few threads.
class worker_pool {
 public:
  worker_pool() : guard_(asio::make_work_guard(io_))
  {
    threads_.reserve(worker_threads);
    for (unsigned i = 0; i < worker_threads; ++i) {
      threads_.emplace_back([this] { io_.run(); });
    }
  }
  worker_pool(const worker_pool&) = delete;
  worker_pool& operator=(const worker_pool&) = delete;
  worker_pool(worker_pool&&) = delete;
  worker_pool& operator=(worker_pool&&) = delete;
  ~worker_pool() { shutdown(); }

  /// Waits for every submitted node, then stops and joins the workers. Idempotent.
  void shutdown() noexcept
  {
    {
      std::unique_lock lock(count_mutex_);
      idle_cv_.wait(lock, [&] { return outstanding_ == 0; });
    }
    guard_.reset();
    for (auto& t : threads_) {
      if (t.joinable()) { t.join(); }
    }
  }

  /// A node that runs `body` after `delay`, once every node in `deps` is done.
  node_ptr submit(std::function<void()> body, nanoseconds delay, const std::vector<node_ptr>& deps)
  {
    auto n = std::make_shared<node>();
    n->trivial = !body && delay <= nanoseconds::zero();
    n->body = std::move(body);
    n->delay = delay;
    {
      std::lock_guard lock(count_mutex_);
      ++outstanding_;
    }
    for (const auto& dep : deps) {
      if (!dep) { continue; }
      std::lock_guard lock(dep->mutex);
      if (!dep->done) {
        dep->dependents.push_back(n);
        n->pending.fetch_add(1, std::memory_order_relaxed);
      }
    }
    if (n->pending.fetch_sub(1, std::memory_order_acq_rel) == 1) { start(n); }
    return n;
  }

 private:
  void start(const node_ptr& n)
  {
    if (n->trivial) {
      complete(n);
    } else if (n->delay > nanoseconds::zero()) {
      auto timer = std::make_shared<asio::steady_timer>(io_, n->delay);
      timer->async_wait([this, n, timer](const boost::system::error_code&) { run(n); });
    } else {
      asio::post(io_, [this, n] { run(n); });
    }
  }

  void run(const node_ptr& n) noexcept
  {
    if (n->body) {
      auto body = std::move(n->body);
      try {
        body();
      } catch (const std::exception& e) {
        HANDOFF_LOG_ERROR("sim: stream work threw: {}", e.what());
      } catch (...) {
        HANDOFF_LOG_ERROR("sim: stream work threw a non-standard exception");
      }
    }
    complete(n);
  }

  // Iterative so that a long chain of markers does not recurse.
  void complete(const node_ptr& first) noexcept
  {
    std::vector<node_ptr> ready{first};
    while (!ready.empty()) {
      node_ptr n = std::move(ready.back());
      ready.pop_back();
      std::vector<node_ptr> dependents;
      {
        std::lock_guard lock(n->mutex);
        n->done = true;
        dependents.swap(n->dependents);
        n->done_cv.notify_all();
      }
      for (auto& d : dependents) {
        if (d->pending.fetch_sub(1, std::memory_order_acq_rel) == 1) {
          if (d->trivial) {
            ready.push_back(std::move(d));
          } else {
            start(d);
          }
        }
      }
      std::lock_guard lock(count_mutex_);
      if (--outstanding_ == 0) { idle_cv_.notify_all(); }
    }
  }

  asio::io_context io_;
  asio::executor_work_guard<asio::io_context::executor_type> guard_;
  std::vector<std::thread> threads_;
  std::mutex count_mutex_;
  std::condition_variable idle_cv_;
  std::size_t outstanding_{0};  // guarded by count_mutex_
};

// ------------------------------------------------------------------------------------------------
// Device state.

struct capture_info {
  const void* origin{nullptr};  // the stream that began the capture
  bool invalidated{false};
  std::size_t operations{0};
};

enum class stream_kind { created, legacy, per_thread };

struct stream_state {
  int device{0};
  stream_kind kind{stream_kind::created};
  bool blocking{true};
  node_ptr tail;                          // the last work enqueued
  std::shared_ptr<capture_info> capture;  // non-null while capturing
};

struct event_state {
  int device{0};
  node_ptr fence;                         // the most recent record; null: never recorded
  std::shared_ptr<capture_info> capture;  // non-null when last recorded in a capture
};

struct allocation {
  std::size_t size{0};
  memory_kind kind{memory_kind::device};
  int device{0};
  bool free_pending{false};
};

struct device_state {
  std::unique_ptr<stream_state> legacy;
  std::map<thread_key, std::unique_ptr<stream_state>> per_thread;
  std::vector<node_ptr> retired;  // tails of destroyed streams whose work may still run
};

struct fault {
  int remaining{0};
  std::string error_name;
};

}  // namespace

// ------------------------------------------------------------------------------------------------

struct sim_backend::impl {
  impl(int count, sim_flavour f)
      : flavour(f),
        device_count(count),
        devices(static_cast<std::size_t>(count)),
        has_context(static_cast<std::size_t>(count), false)
  {
    for (int d = 0; d < count; ++d) {
      auto legacy = std::make_unique<stream_state>();
      legacy->device = d;
      legacy->kind = stream_kind::legacy;
      legacy->blocking = true;
      devices[static_cast<std::size_t>(d)].legacy = std::move(legacy);
    }
  }
  impl(const impl&) = delete;
  impl& operator=(const impl&) = delete;
  impl(impl&&) = delete;
  impl& operator=(impl&&) = delete;

  ~impl()
  {
    pool.shutdown();  // pending frees need the table, so drain before anything is destroyed
    for (auto& [base, info] : allocations) { ::operator delete(reinterpret_cast<void*>(base), allocation_alignment); }
  }

  // --- errors ------------------------------------------------------------------------------------

  [[nodiscard]] std::string_view backend_name() const noexcept
  {
    return flavour == sim_flavour::cuda ? "sim" : "sim-rocm";
  }

  [[nodiscard]] device_error make_error(std::string_view op, std::string_view args, std::string_view error_name,
                                        std::string_view text) const
  {
    return device_error(std::string(backend_name()), std::string(error_name),
                        fmt::format("{}({}) failed: {}: {}", call_name(op, flavour), args, error_name, text));
  }

  [[noreturn]] void fail(std::string_view op, std::string_view args, sim_error code, std::string_view detail = {}) const
  {
    for (const auto& info : error_table) {
      if (info.code == code) {
        const auto name = flavour == sim_flavour::cuda ? info.cuda_name : info.hip_name;
        if (detail.empty()) { throw make_error(op, args, name, info.text); }
        throw make_error(op, args, name, fmt::format("{} ({})", info.text, detail));
      }
    }
    throw make_error(op, args, "simErrorUnknown", "unknown error");
  }

  void check_fault(std::string_view op, std::string_view args)
  {
    std::string name;
    {
      std::lock_guard lock(fault_mutex);
      if (faults.empty()) { return; }
      auto it = faults.find(std::string(op));
      if (it == faults.end()) { return; }
      name = it->second.error_name;
      if (--it->second.remaining <= 0) { faults.erase(it); }
    }
    throw make_error(op, args, name, fmt::format("{} (injected fault)", error_text(name)));
  }

  // --- lookups (mutex held) ----------------------------------------------------------------------

  [[nodiscard]] int current_locked() const
  {
    auto it = current.find(this_thread_key());
    return it == current.end() ? 0 : it->second;
  }

  // set_current_device and push_current_device: the device becomes current (after the previous
  // one is remembered, for a push) and has a context from then on.
  void make_current(std::string_view op, int device, bool push)
  {
    const auto args = fmt::format("{}", device);
    check_fault(op, args);
    if (device < 0 || device >= device_count) { fail(op, args, sim_error::invalid_device); }
    std::lock_guard lock(mutex);
    const auto self = this_thread_key();
    if (push) { pushed[self].push_back(current_locked()); }
    current[self] = device;
    has_context[static_cast<std::size_t>(device)] = true;
  }

  // The current device for a call that works on it: as in CUDA, that call gives the device a
  // context (lazily, on first use) if it has none.
  int using_current_locked()
  {
    const int device = current_locked();
    has_context[static_cast<std::size_t>(device)] = true;
    return device;
  }

  stream_state& per_thread_stream(thread_key owner, int device)
  {
    auto& slot = devices[static_cast<std::size_t>(device)].per_thread[owner];
    if (!slot) {
      slot = std::make_unique<stream_state>();
      slot->device = device;
      slot->kind = stream_kind::per_thread;
      slot->blocking = true;
    }
    return *slot;
  }

  stream_state* find_stream(std::uintptr_t h)
  {
    // Default streams are the current device's.
    if (flavour == sim_flavour::cuda) {
      if (h == 0 || h == 1) { return devices[static_cast<std::size_t>(using_current_locked())].legacy.get(); }
      if (h == 2) { return &per_thread_stream(this_thread_key(), using_current_locked()); }
    } else {
      if (h == 0) { return devices[static_cast<std::size_t>(using_current_locked())].legacy.get(); }
      if (h == 1 || h == 2) { return nullptr; }
      if (auto it = rocm_proxy_owner.find(h); it != rocm_proxy_owner.end()) {
        return &per_thread_stream(it->second, using_current_locked());
      }
    }
    auto it = streams.find(h);
    return it == streams.end() ? nullptr : it->second.get();
  }

  stream_state& stream(std::string_view op, std::string_view args, stream_handle h)
  {
    auto* s = find_stream(raw(h));
    if (s == nullptr) { fail(op, args, sim_error::invalid_handle, fmt::format("no stream {:#x}", raw(h))); }
    return *s;
  }

  event_state& event(std::string_view op, std::string_view args, event_handle h)
  {
    auto it = events.find(raw(h));
    if (it == events.end()) { fail(op, args, sim_error::invalid_handle, fmt::format("no event {:#x}", raw(h))); }
    return *it->second;
  }

  template <class F>
  void for_each_stream(int device, F&& f)
  {
    auto& dev = devices[static_cast<std::size_t>(device)];
    f(*dev.legacy);
    for (auto& [tid, s] : dev.per_thread) { f(*s); }
    for (auto& [h, s] : streams) {
      if (s->device == device) { f(*s); }
    }
  }

  /// CUDA's rule: while a blocking stream captures, touching its device's legacy stream is an
  /// error that invalidates the capture (the legacy stream would depend on captured work).
  void check_legacy_use(std::string_view op, std::string_view args, const stream_state& s)
  {
    if (s.kind != stream_kind::legacy) { return; }
    bool conflict = false;
    for_each_stream(s.device, [&](stream_state& other) {
      if (other.kind != stream_kind::legacy && other.blocking && other.capture) {
        other.capture->invalidated = true;
        conflict = true;
      }
    });
    if (conflict) { fail(op, args, sim_error::capture_implicit); }
  }

  /// Appends work to `s` with CUDA's implicit legacy-stream dependencies.
  node_ptr enqueue_locked(stream_state& s, std::function<void()> body, nanoseconds delay, node_ptr extra)
  {
    std::vector<node_ptr> deps;
    deps.push_back(s.tail);
    if (extra) { deps.push_back(std::move(extra)); }
    if (s.kind == stream_kind::legacy) {
      for_each_stream(s.device, [&](stream_state& other) {
        if (&other != &s && other.blocking && !is_done(other.tail)) { deps.push_back(other.tail); }
      });
    } else if (s.blocking) {
      deps.push_back(devices[static_cast<std::size_t>(s.device)].legacy->tail);
    }
    s.tail = pool.submit(std::move(body), delay, deps);
    return s.tail;
  }

  /// The public entry point for stream work: checks, then captures or enqueues.
  void enqueue(std::string_view op, std::string_view args, stream_handle h, std::function<void()> body,
               nanoseconds delay)
  {
    check_fault(op, args);
    std::lock_guard lock(mutex);
    auto& s = stream(op, args, h);
    check_legacy_use(op, args, s);
    if (s.capture) {
      ++s.capture->operations;  // recorded into the graph, not run
      return;
    }
    enqueue_locked(s, std::move(body), delay, nullptr);
  }

  std::vector<node_ptr> device_tails_locked(int device)
  {
    std::vector<node_ptr> tails;
    for_each_stream(device, [&](stream_state& s) {
      if (s.tail) { tails.push_back(s.tail); }
    });
    auto& retired = devices[static_cast<std::size_t>(device)].retired;
    std::erase_if(retired, [](const node_ptr& n) { return is_done(n); });
    tails.insert(tails.end(), retired.begin(), retired.end());
    return tails;
  }

  void* allocate_locked(std::string_view op, std::string_view args, std::size_t bytes, memory_kind kind)
  {
    if (bytes == 0) { return nullptr; }
    void* p = ::operator new(bytes, allocation_alignment, std::nothrow);
    if (p == nullptr) { fail(op, args, sim_error::memory_allocation); }
    const int device = using_current_locked();
    allocations.emplace(address(p), allocation{bytes, kind, device, false});
    HANDOFF_LOG_DEBUG("{}: {} bytes at {} on device {}", backend_name(), bytes, p, device);
    return p;
  }

  void release_allocation(std::uintptr_t base) noexcept
  {
    std::lock_guard lock(mutex);
    if (allocations.erase(base) != 0) { ::operator delete(reinterpret_cast<void*>(base), allocation_alignment); }
  }

  sim_flavour flavour;
  int device_count;

  std::mutex mutex;  // guards everything below except the faults and the pool
  std::vector<device_state> devices;
  std::unordered_map<std::uintptr_t, std::unique_ptr<stream_state>> streams;
  std::unordered_map<std::uintptr_t, std::unique_ptr<event_state>> events;
  std::map<std::uintptr_t, allocation> allocations;  // by base address
  std::unordered_map<thread_key, int> current;
  std::unordered_map<thread_key, std::vector<int>> pushed;  // each thread's devices before its pushes
  std::vector<bool> has_context;  // per device: used, so CUDA would have made its primary context
  // sim-rocm names each thread's default stream by the address of a token (values 1 and 2 are not
  // stream handles there).
  std::unordered_map<thread_key, std::unique_ptr<std::byte>> rocm_tokens;
  std::unordered_map<std::uintptr_t, thread_key> rocm_proxy_owner;

  std::mutex fault_mutex;
  std::unordered_map<std::string, fault> faults;

  std::atomic<nanoseconds::rep> copy_duration{0};  // how long each copy_async occupies its stream

  worker_pool pool;  // last: destroyed (drained) first
};

// ------------------------------------------------------------------------------------------------

sim_backend::sim_backend(int device_count, sim_flavour flavour)
{
  HANDOFF_EXPECTS(device_count >= 1 && device_count <= max_devices, value_error,
                  fmt::format("a simulated backend has 1 to {} devices, not {}", max_devices, device_count));
  impl_ = std::make_unique<impl>(device_count, flavour);
  HANDOFF_LOG_DEBUG("{}: {} simulated devices", impl_->backend_name(), device_count);
}

sim_backend::~sim_backend() = default;

std::string_view sim_backend::name() const noexcept
{
  return impl_->backend_name();
}

DLDeviceType sim_backend::device_type() const noexcept
{
  return impl_->flavour == sim_flavour::cuda ? kDLCUDA : kDLROCM;
}

int sim_backend::device_count()
{
  impl_->check_fault("device_count", "");
  return impl_->device_count;
}

int sim_backend::current_device()
{
  impl_->check_fault("current_device", "");
  std::lock_guard lock(impl_->mutex);
  return impl_->current_locked();
}

void sim_backend::set_current_device(int device)
{
  impl_->make_current("set_current_device", device, /*push=*/false);
}

void sim_backend::push_current_device(int device)
{
  impl_->make_current("push_current_device", device, /*push=*/true);
}

void sim_backend::pop_current_device() noexcept
{
  std::lock_guard lock(impl_->mutex);
  const auto self = this_thread_key();
  auto it = impl_->pushed.find(self);
  if (it == impl_->pushed.end() || it->second.empty()) {
    HANDOFF_LOG_ERROR("{}: pop_current_device without a push on this thread", impl_->backend_name());
    return;
  }
  impl_->current[self] = it->second.back();
  it->second.pop_back();
  if (it->second.empty()) { impl_->pushed.erase(it); }
}

stream_handle sim_backend::legacy_default_stream() const noexcept
{
  return stream_handle{impl_->flavour == sim_flavour::cuda ? 1U : 0U};
}

stream_handle sim_backend::per_thread_default_stream() const noexcept
{
  if (impl_->flavour == sim_flavour::cuda) { return stream_handle{2}; }
  std::lock_guard lock(impl_->mutex);
  const auto tid = this_thread_key();
  auto& token = impl_->rocm_tokens[tid];
  if (!token) {
    token = std::make_unique<std::byte>();
    impl_->rocm_proxy_owner.emplace(address(token.get()), tid);
  }
  return stream_handle{address(token.get())};
}

stream_handle sim_backend::create_stream(bool non_blocking)
{
  const auto args = fmt::format("flags={}", non_blocking ? "NonBlocking" : "Default");
  impl_->check_fault("create_stream", args);
  std::lock_guard lock(impl_->mutex);
  auto s = std::make_unique<stream_state>();
  s->device = impl_->using_current_locked();
  s->blocking = !non_blocking;
  const auto handle = address(s.get());
  HANDOFF_LOG_DEBUG("{}: stream {:#x} created on device {} ({})", name(), handle, s->device,
                    non_blocking ? "non-blocking" : "blocking");
  impl_->streams.emplace(handle, std::move(s));
  return stream_handle{handle};
}

void sim_backend::destroy_stream(stream_handle stream) noexcept
{
  try {
    std::lock_guard lock(impl_->mutex);
    auto it = impl_->streams.find(raw(stream));
    if (it == impl_->streams.end()) {
      HANDOFF_LOG_ERROR("{}({:#x}) failed: not a created stream", call_name("destroy_stream", impl_->flavour),
                        raw(stream));
      return;
    }
    auto& dev = impl_->devices[static_cast<std::size_t>(it->second->device)];
    // Like CUDA, work already enqueued still runs; synchronize_device still waits for it.
    if (!is_done(it->second->tail)) { dev.retired.push_back(it->second->tail); }
    std::erase_if(dev.retired, [](const node_ptr& n) { return is_done(n); });
    impl_->streams.erase(it);
    HANDOFF_LOG_DEBUG("{}: stream {:#x} destroyed", name(), raw(stream));
  } catch (...) {
    HANDOFF_LOG_ERROR("{}: destroy_stream failed", name());
  }
}

int sim_backend::stream_device(stream_handle stream)
{
  const auto args = fmt::format("{:#x}", raw(stream));
  impl_->check_fault("stream_device", args);
  std::lock_guard lock(impl_->mutex);
  return impl_->stream("stream_device", args, stream).device;
}

bool sim_backend::stream_is_blocking(stream_handle stream)
{
  const auto args = fmt::format("{:#x}", raw(stream));
  impl_->check_fault("stream_is_blocking", args);
  std::lock_guard lock(impl_->mutex);
  return impl_->stream("stream_is_blocking", args, stream).blocking;
}

capture_status sim_backend::stream_capture_status(stream_handle stream)
{
  constexpr std::string_view op = "stream_capture_status";
  const auto args = fmt::format("{:#x}", raw(stream));
  impl_->check_fault(op, args);
  std::lock_guard lock(impl_->mutex);
  auto& s = impl_->stream(op, args, stream);
  if (s.kind == stream_kind::legacy) {
    bool conflict = false;
    impl_->for_each_stream(s.device, [&](const stream_state& other) {
      conflict = conflict || (other.kind != stream_kind::legacy && other.blocking && other.capture);
    });
    if (conflict) { impl_->fail(op, args, sim_error::capture_implicit); }
    return capture_status::none;
  }
  if (!s.capture) { return capture_status::none; }
  return s.capture->invalidated ? capture_status::invalidated : capture_status::active;
}

void sim_backend::synchronize_stream(stream_handle stream)
{
  constexpr std::string_view op = "synchronize_stream";
  const auto args = fmt::format("{:#x}", raw(stream));
  impl_->check_fault(op, args);
  node_ptr target;
  {
    std::lock_guard lock(impl_->mutex);
    auto& s = impl_->stream(op, args, stream);
    if (s.capture) {
      s.capture->invalidated = true;
      impl_->fail(op, args, sim_error::capture_unsupported);
    }
    impl_->check_legacy_use(op, args, s);
    // Synchronizing the legacy stream also waits for its device's blocking streams, as any
    // legacy-stream operation does.
    target = s.kind == stream_kind::legacy ? impl_->enqueue_locked(s, {}, {}, nullptr) : s.tail;
  }
  wait_for(target);
}

void sim_backend::synchronize_device()
{
  constexpr std::string_view op = "synchronize_device";
  impl_->check_fault(op, "");
  std::vector<node_ptr> tails;
  {
    std::lock_guard lock(impl_->mutex);
    const int device = impl_->using_current_locked();
    bool capturing = false;
    impl_->for_each_stream(device, [&](stream_state& s) {
      if (s.capture) {
        s.capture->invalidated = true;
        capturing = true;
      }
    });
    if (capturing) { impl_->fail(op, "", sim_error::capture_unsupported); }
    tails = impl_->device_tails_locked(device);
  }
  for (const auto& t : tails) { wait_for(t); }
}

event_handle sim_backend::create_event()
{
  impl_->check_fault("create_event", "flags=DisableTiming");
  std::lock_guard lock(impl_->mutex);
  auto e = std::make_unique<event_state>();
  e->device = impl_->using_current_locked();
  const auto handle = address(e.get());
  impl_->events.emplace(handle, std::move(e));
  return event_handle{handle};
}

void sim_backend::destroy_event(event_handle event) noexcept
{
  try {
    std::lock_guard lock(impl_->mutex);
    if (impl_->events.erase(raw(event)) == 0) {
      HANDOFF_LOG_ERROR("{}({:#x}) failed: not an event", call_name("destroy_event", impl_->flavour), raw(event));
    }
  } catch (...) {
    HANDOFF_LOG_ERROR("{}: destroy_event failed", name());
  }
}

void sim_backend::record_event(event_handle event, stream_handle stream)
{
  constexpr std::string_view op = "record_event";
  const auto args = fmt::format("{:#x}, {:#x}", raw(event), raw(stream));
  impl_->check_fault(op, args);
  std::lock_guard lock(impl_->mutex);
  auto& e = impl_->event(op, args, event);
  auto& s = impl_->stream(op, args, stream);
  if (e.device != s.device) {
    impl_->fail(op, args, sim_error::invalid_handle,
                fmt::format("the event belongs to device {}, the stream to device {}", e.device, s.device));
  }
  impl_->check_legacy_use(op, args, s);
  if (s.capture) {
    ++s.capture->operations;
    e.capture = s.capture;
    e.fence = nullptr;
    return;
  }
  e.capture = nullptr;
  e.fence = impl_->enqueue_locked(s, {}, {}, nullptr);
}

bool sim_backend::query_event(event_handle event)
{
  constexpr std::string_view op = "query_event";
  const auto args = fmt::format("{:#x}", raw(event));
  impl_->check_fault(op, args);
  std::lock_guard lock(impl_->mutex);
  auto& e = impl_->event(op, args, event);
  if (e.capture) { impl_->fail(op, args, sim_error::captured_event); }
  return is_done(e.fence);
}

void sim_backend::synchronize_event(event_handle event)
{
  constexpr std::string_view op = "synchronize_event";
  const auto args = fmt::format("{:#x}", raw(event));
  impl_->check_fault(op, args);
  node_ptr fence;
  {
    std::lock_guard lock(impl_->mutex);
    auto& e = impl_->event(op, args, event);
    if (e.capture) { impl_->fail(op, args, sim_error::captured_event); }
    fence = e.fence;
  }
  wait_for(fence);
}

void sim_backend::stream_wait_event(stream_handle stream, event_handle event)
{
  constexpr std::string_view op = "stream_wait_event";
  const auto args = fmt::format("{:#x}, {:#x}, 0", raw(stream), raw(event));
  impl_->check_fault(op, args);
  std::lock_guard lock(impl_->mutex);
  auto& s = impl_->stream(op, args, stream);
  auto& e = impl_->event(op, args, event);
  impl_->check_legacy_use(op, args, s);
  if (e.capture) {
    // Waiting on captured work forks the capture into this stream (CUDA's cross-stream capture).
    if (s.capture && s.capture != e.capture) { impl_->fail(op, args, sim_error::capture_isolation); }
    if (s.kind == stream_kind::legacy) { impl_->fail(op, args, sim_error::capture_implicit); }
    s.capture = e.capture;
    ++s.capture->operations;
    return;
  }
  if (s.capture) {
    ++s.capture->operations;  // an external dependency of the graph; nothing runs now
    return;
  }
  // The fence is copied now: a later re-record of the event does not change this wait.
  impl_->enqueue_locked(s, {}, {}, e.fence);
}

pointer_attributes sim_backend::attributes(const void* ptr)
{
  const auto args = fmt::format("{}", fmt::ptr(ptr));
  impl_->check_fault("attributes", args);
  std::lock_guard lock(impl_->mutex);
  const auto addr = address(ptr);
  auto it = impl_->allocations.upper_bound(addr);
  if (it == impl_->allocations.begin()) { return {}; }
  --it;
  if (addr - it->first >= it->second.size) { return {}; }
  pointer_attributes result;
  result.kind = it->second.kind;
  result.device = it->second.device;
  result.base = reinterpret_cast<const void*>(it->first);
  result.size = it->second.size;
  result.device_pointer = const_cast<void*>(ptr);  // one address space, as with CUDA's UVA
  return result;
}

void* sim_backend::allocate(std::size_t bytes, stream_handle stream)
{
  constexpr std::string_view op = "allocate";
  const auto args = fmt::format("{}, {:#x}", bytes, raw(stream));
  impl_->check_fault(op, args);
  std::lock_guard lock(impl_->mutex);
  auto& s = impl_->stream(op, args, stream);
  impl_->check_legacy_use(op, args, s);
  return impl_->allocate_locked(op, args, bytes, memory_kind::device);
}

void sim_backend::deallocate(void* ptr, stream_handle stream) noexcept
{
  if (ptr == nullptr) { return; }
  try {
    std::lock_guard lock(impl_->mutex);
    const auto call = call_name("deallocate", impl_->flavour);
    auto it = impl_->allocations.find(address(ptr));
    if (it == impl_->allocations.end() || it->second.free_pending) {
      HANDOFF_LOG_ERROR("{}({}, {:#x}) failed: not a live allocation", call, ptr, raw(stream));
      return;
    }
    auto* s = impl_->find_stream(raw(stream));
    if (s == nullptr) {
      // Kept in the table (freed with the backend) rather than freed under running work.
      HANDOFF_LOG_ERROR("{}({}, {:#x}) failed: invalid stream; the memory is kept", call, ptr, raw(stream));
      return;
    }
    it->second.free_pending = true;
    const auto base = it->first;
    impl_->enqueue_locked(
      *s, [state = impl_.get(), base] { state->release_allocation(base); }, {}, nullptr);
  } catch (...) {
    HANDOFF_LOG_ERROR("{}: deallocate failed", name());
  }
}

void sim_backend::copy_async(void* dst, const void* src, std::size_t bytes, stream_handle stream)
{
  constexpr std::string_view op = "copy_async";
  const auto args = fmt::format("{}, {}, {}, cudaMemcpyDefault, {:#x}", dst, src, bytes, raw(stream));
  if (bytes != 0 && (dst == nullptr || src == nullptr)) {
    impl_->check_fault(op, args);
    impl_->fail(op, args, sim_error::invalid_value);
  }
  const nanoseconds duration{impl_->copy_duration.load(std::memory_order_relaxed)};
  if (duration == nanoseconds::zero() || bytes == 0) {
    impl_->enqueue(op, args, stream,
                   [dst, src, bytes] {
                     if (bytes != 0) { std::memmove(dst, src, bytes); }
                   },
                   {});
    return;
  }
  // A copy that takes time reads its source when it starts and its bytes land when it ends.
  auto staged = std::make_shared<std::vector<std::byte>>();
  const auto* from = static_cast<const std::byte*>(src);
  impl_->enqueue(op, args, stream, [staged, from, bytes] { staged->assign(from, from + bytes); }, {});
  impl_->enqueue(
    op, args, stream, [staged, dst, bytes] { std::memcpy(dst, staged->data(), bytes); }, duration);
}

void sim_backend::set_copy_duration(nanoseconds duration)
{
  HANDOFF_EXPECTS(duration >= nanoseconds::zero(), value_error, "a copy cannot take a negative time");
  impl_->copy_duration.store(duration.count(), std::memory_order_relaxed);
}

void sim_backend::launch_host_func(stream_handle stream, void (*fn)(void*), void* user_data)
{
  constexpr std::string_view op = "launch_host_func";
  const auto args = fmt::format("{:#x}, {}, {}", raw(stream), reinterpret_cast<void*>(fn), user_data);
  if (fn == nullptr) {
    impl_->check_fault(op, args);
    impl_->fail(op, args, sim_error::invalid_value);
  }
  impl_->enqueue(op, args, stream, [fn, user_data] { fn(user_data); }, {});
}

// --- simulation extras ---------------------------------------------------------------------------

sim_flavour sim_backend::flavour() const noexcept
{
  return impl_->flavour;
}

std::span<const std::string_view> sim_backend::fault_operations() noexcept
{
  return operation_keys;
}

void sim_backend::inject_fault(std::string operation, int count, std::string error_name)
{
  const bool known = std::find(operation_keys.begin(), operation_keys.end(), operation) != operation_keys.end();
  HANDOFF_EXPECTS(known, value_error,
                  fmt::format("inject_fault: unknown operation '{}'; expected one of: {}", operation,
                              fmt::join(operation_keys, ", ")));
  HANDOFF_EXPECTS(count >= 0, value_error, fmt::format("inject_fault: count must be >= 0, got {}", count));
  HANDOFF_EXPECTS(!error_name.empty(), value_error, "inject_fault: error_name must not be empty");
  std::lock_guard lock(impl_->fault_mutex);
  if (count == 0) {
    impl_->faults.erase(operation);
  } else {
    impl_->faults.insert_or_assign(std::move(operation), fault{count, std::move(error_name)});
  }
}

void sim_backend::clear_faults() noexcept
{
  std::lock_guard lock(impl_->fault_mutex);
  impl_->faults.clear();
}

void sim_backend::enqueue_fill_bytes(stream_handle stream, void* dst, std::size_t bytes,
                                     std::span<const std::byte> pattern, nanoseconds delay)
{
  constexpr std::string_view op = "enqueue_fill";
  const auto args = fmt::format("{:#x}, {}, {}, pattern of {} bytes, delay {}ns", raw(stream), dst, bytes,
                                pattern.size(), delay.count());
  if (pattern.empty() || bytes % pattern.size() != 0 || (bytes != 0 && dst == nullptr) || delay < nanoseconds::zero()) {
    impl_->check_fault(op, args);
    impl_->fail(op, args, sim_error::invalid_value,
                "bytes must be a multiple of a non-empty pattern, dst non-null, delay >= 0");
  }
  std::vector<std::byte> copy(pattern.begin(), pattern.end());
  impl_->enqueue(
    op, args, stream,
    [dst, bytes, p = std::move(copy)] {
      auto* out = static_cast<std::byte*>(dst);
      for (std::size_t at = 0; at < bytes; at += p.size()) { std::memcpy(out + at, p.data(), p.size()); }
    },
    delay);
}

void sim_backend::enqueue_sleep(stream_handle stream, nanoseconds duration)
{
  constexpr std::string_view op = "enqueue_sleep";
  const auto args = fmt::format("{:#x}, {}ns", raw(stream), duration.count());
  if (duration < nanoseconds::zero()) {
    impl_->check_fault(op, args);
    impl_->fail(op, args, sim_error::invalid_value, "negative duration");
  }
  impl_->enqueue(op, args, stream, {}, duration);
}

void sim_backend::begin_capture(stream_handle stream)
{
  constexpr std::string_view op = "begin_capture";
  const auto args = fmt::format("{:#x}, cudaStreamCaptureModeGlobal", raw(stream));
  impl_->check_fault(op, args);
  std::lock_guard lock(impl_->mutex);
  auto& s = impl_->stream(op, args, stream);
  if (s.kind == stream_kind::legacy) {
    impl_->fail(op, args, sim_error::capture_unsupported, "the legacy stream cannot be captured");
  }
  if (s.capture) { impl_->fail(op, args, sim_error::illegal_state, "the stream is already capturing"); }
  s.capture = std::make_shared<capture_info>();
  s.capture->origin = &s;
}

std::size_t sim_backend::end_capture(stream_handle stream)
{
  constexpr std::string_view op = "end_capture";
  const auto args = fmt::format("{:#x}", raw(stream));
  impl_->check_fault(op, args);
  std::lock_guard lock(impl_->mutex);
  auto& s = impl_->stream(op, args, stream);
  if (!s.capture) { impl_->fail(op, args, sim_error::illegal_state, "the stream is not capturing"); }
  if (s.capture->origin != &s) {
    s.capture->invalidated = true;
    impl_->fail(op, args, sim_error::capture_unmatched);
  }
  const auto capture = s.capture;
  impl_->for_each_stream(s.device, [&](stream_state& other) {
    if (other.capture == capture) { other.capture.reset(); }
  });
  // Streams of other devices may have joined through events.
  for (int d = 0; d < impl_->device_count; ++d) {
    impl_->for_each_stream(d, [&](stream_state& other) {
      if (other.capture == capture) { other.capture.reset(); }
    });
  }
  if (capture->invalidated) { impl_->fail(op, args, sim_error::capture_invalidated); }
  return capture->operations;
}

void* sim_backend::allocate_pinned_host(std::size_t bytes)
{
  const auto args = fmt::format("{}", bytes);
  impl_->check_fault("allocate_pinned_host", args);
  std::lock_guard lock(impl_->mutex);
  return impl_->allocate_locked("allocate_pinned_host", args, bytes, memory_kind::pinned_host);
}

void* sim_backend::allocate_managed(std::size_t bytes)
{
  const auto args = fmt::format("{}, cudaMemAttachGlobal", bytes);
  impl_->check_fault("allocate_managed", args);
  std::lock_guard lock(impl_->mutex);
  return impl_->allocate_locked("allocate_managed", args, bytes, memory_kind::managed);
}

void sim_backend::free_sync(void* ptr)
{
  constexpr std::string_view op = "free_sync";
  const auto args = fmt::format("{}", ptr);
  impl_->check_fault(op, args);
  if (ptr == nullptr) { return; }
  std::vector<node_ptr> tails;
  {
    std::lock_guard lock(impl_->mutex);
    auto it = impl_->allocations.find(address(ptr));
    if (it == impl_->allocations.end() || it->second.free_pending) {
      impl_->fail(op, args, sim_error::invalid_value, "not a live allocation");
    }
    it->second.free_pending = true;
    tails = impl_->device_tails_locked(it->second.device);
  }
  for (const auto& t : tails) { wait_for(t); }
  impl_->release_allocation(address(ptr));
}

std::vector<int> sim_backend::devices_with_context()
{
  std::lock_guard lock(impl_->mutex);
  std::vector<int> used;
  for (int d = 0; d < impl_->device_count; ++d) {
    if (impl_->has_context[static_cast<std::size_t>(d)]) { used.push_back(d); }
  }
  return used;
}

std::size_t sim_backend::live_allocations()
{
  std::lock_guard lock(impl_->mutex);
  return impl_->allocations.size();
}

sim_backend* as_sim(backend& b) noexcept
{
  return dynamic_cast<sim_backend*>(&b);
}

}  // namespace handoff::device
