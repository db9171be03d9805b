#include <handoff/error.hpp>
#include <handoff/exchange.hpp>
#include <handoff/runtime.hpp>
#include <handoff/stream_value.hpp>
#include <handoff/trace.hpp>

#include "device/backend_factory.hpp"
#include "log/logger.hpp"
#include "service/service_thread.hpp"
#include "service/trace_socket.hpp"
#include "settings.hpp"

#include <fmt/format.h>

#include <pthread.h>

#include <atomic>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <optional>
#include <string_view>
#include <vector>

namespace handoff {
namespace {

struct started_backend {
  std::string name{"none"};
  std::unique_ptr<device::backend> backend;
  std::unique_ptr<context> device_context;   // after backend: destroyed first, draining deferred releases
  detail::service_thread* service{nullptr};  // the device context's
  absent_backend absent;                     // why there is no device context
  std::string error_name;                    // set when a backend named explicitly failed to start
  std::string error;
  std::string fallback_error_name;  // set when `auto` found no usable CUDA device and fell back to none
};

started_backend start()
{
  std::string requested = detail::setting_choice("HANDOFF_BACKEND");
  if (requested.empty()) { requested = "auto"; }
  started_backend out;
  if (requested == "none") { return out; }
  if (requested == "auto") {
    if (!device::cuda_compiled_in()) {
      out.error = "the CUDA backend was not compiled in";
      out.fallback_error_name = error_names::no_backend;
      return out;
    }
    try {
      out.backend = device::make_backend("cuda");
      out.name = "cuda";
    } catch (const device_error& e) {
      out.error = e.what();  // no usable device: run without a backend
      out.fallback_error_name = e.error_name();
      HANDOFF_LOG_INFO("HANDOFF_BACKEND=auto: no CUDA device ({}); backend is none", e.what());
    }
    return out;
  }
  out.name = requested;
  try {
    out.backend = device::make_backend(requested);
  } catch (const device_error& e) {
    out.error_name = e.error_name();
    out.error = e.what();
  } catch (const error& e) {
    out.error_name = error_names::invalid_backend;
    out.error = e.what();
  }
  if (!out.error.empty()) { HANDOFF_LOG_WARN("HANDOFF_BACKEND={} cannot start: {}", out.name, out.error); }
  return out;
}

// HANDOFF_EXPORT_RELEASE: which consumer streams an export's release waits for (export_release).
export_release export_release_setting()
{
  const std::string value = detail::setting_choice("HANDOFF_EXPORT_RELEASE");
  if (value == "every-stream") { return export_release::every_stream; }
  if (!value.empty() && value != "known-streams") {
    HANDOFF_LOG_WARN("HANDOFF_EXPORT_RELEASE={} is neither 'known-streams' nor 'every-stream'; known-streams applies",
                     value);
  }
  return export_release::known_streams;
}

// The process's embedding (embed_process), fixed once the process's exchange or context is made.
struct process_embedding {
  std::mutex mutex;
  embedding hooks;
  bool fixed{false};

  // The hooks the process's exchange and context are made with: none may change them after.
  embedding fix()
  {
    const std::lock_guard lock{mutex};
    fixed = true;
    return hooks;
  }
};
constinit process_embedding the_embedding;  // usable during static destruction, as the exchange is

started_backend start_with_context()
{
  started_backend s = start();
  if (s.backend) {
    auto service = std::make_unique<detail::service_thread>();
    s.service = service.get();
    s.device_context = std::make_unique<context>(*s.backend, std::move(service), the_embedding.fix());
  } else {
    const std::string requested = detail::setting_choice("HANDOFF_BACKEND");
    s.absent = {.setting = fmt::format("HANDOFF_BACKEND={}", requested.empty() ? "auto" : requested),
                .error_name = s.fallback_error_name,
                .reason = s.error,
                .refuses_unordered = !s.fallback_error_name.empty()};
  }
  return s;
}

std::atomic<bool> backend_started{false};
// A child forked after a device backend started inherits its state but none of its threads (the
// service thread, the simulator's workers, the driver's): it must neither use the backend nor tear
// it down, and CUDA refuses a forked child the device anyway. Set in the child only.
std::atomic<bool> forked_after_start{false};

void after_fork_in_child() noexcept
{
  if (backend_started.load(std::memory_order_relaxed)) { forked_after_start.store(true, std::memory_order_relaxed); }
}

// Out of line, so that started(), on every exchange's path, is a guard check and a return.
[[gnu::noinline]] started_backend* start_once()
{
  static const bool fork_handled = pthread_atfork(nullptr, nullptr, &after_fork_in_child) == 0;
  if (!fork_handled) { HANDOFF_LOG_WARN("pthread_atfork failed: a forked child must not use handoff's device"); }
  auto* s = new started_backend(start_with_context());
  backend_started.store(true, std::memory_order_release);
  return s;
}

// The started runtime, destroyed at exit, but in a forked child: there, its threads do not exist to
// be joined, nor its pending work to be waited for.
struct runtime_holder {
  explicit runtime_holder(started_backend* started) noexcept : runtime(started) {}
  runtime_holder(const runtime_holder&) = delete;
  runtime_holder& operator=(const runtime_holder&) = delete;
  runtime_holder(runtime_holder&&) = delete;
  runtime_holder& operator=(runtime_holder&&) = delete;
  ~runtime_holder()
  {
    if (!forked_after_start.load(std::memory_order_relaxed)) { delete runtime; }
  }

  started_backend* runtime;
};

started_backend& started()
{
  static const runtime_holder instance{start_once()};
  return *instance.runtime;
}

// A device backend started by the parent of a forked child is not the child's to use.
bool inherited_from_a_parent(const started_backend& s) noexcept
{
  return s.backend && forked_after_start.load(std::memory_order_relaxed);
}

// What started; throws when the backend HANDOFF_BACKEND names could not start, or belongs to the
// parent of this forked process.
started_backend& usable()
{
  auto& s = started();
  if (!s.error_name.empty()) {
    throw device_error(s.name, s.error_name, fmt::format("HANDOFF_BACKEND={} cannot start: {}", s.name, s.error));
  }
  if (inherited_from_a_parent(s)) [[unlikely]] {
    throw device_error(s.name, error_names::forked_child,
                       fmt::format("this process was forked after its parent started the {} backend; a forked child "
                                   "cannot use the device (CUDA refuses it too): start the process with the 'spawn' "
                                   "or 'forkserver' method, or use the device only after fork",
                                   s.name));
  }
  return s;
}

}  // namespace

const char* version() noexcept
{
  return HANDOFF_VERSION;
}

namespace {

// The process exchange's device context: the runtime's, started by the first exchange that needs it.
class runtime_context final : public context_source {
 public:
  context* device_context() override { return usable().device_context.get(); }
  const absent_backend& absent() override { return usable().absent; }
};

}  // namespace

exchange& process_exchange() noexcept
{
  // Leaked: releases run by other threads may export and import during static destruction. An
  // allocation failure this early ends the process either way.
  static auto* const instance = [] {
    // NOLINTNEXTLINE(cppcoreguidelines-owning-memory,bugprone-unhandled-exception-at-new)
    auto* made = new exchange{*new runtime_context, the_embedding.fix().run_deleter};
    made->set_export_release(export_release_setting());
    return made;
  }();
  return *instance;
}

bool embed_process(const embedding& hooks) noexcept
{
  const std::lock_guard lock{the_embedding.mutex};
  if (the_embedding.fixed) { return false; }
  the_embedding.hooks = hooks;
  return true;
}

context* started_context() noexcept
{
  if (!backend_started.load(std::memory_order_acquire)) { return nullptr; }
  const auto& s = started();
  return inherited_from_a_parent(s) ? nullptr : s.device_context.get();
}

namespace {

// The live trace: its socket and the thread that serves it, its own, so that clients (any process of
// the user may connect) never delay the deferred releases that the runtime's service thread runs.
// Leaked: exchanges may be recorded during static destruction.
struct trace_serving {
  std::mutex mutex;
  std::unique_ptr<detail::service_thread> thread;
  std::unique_ptr<detail::trace_socket> socket;  // after thread: closed on that thread first
  std::uint64_t listener{0};

  static trace_serving& get()
  {
    static auto* instance = new trace_serving;  // NOLINT(cppcoreguidelines-owning-memory): see above
    return *instance;
  }
};

}  // namespace

std::string serve_trace()
{
  trace_serving& serving = trace_serving::get();
  std::lock_guard lock{serving.mutex};
  if (serving.socket) { return serving.socket->path().string(); }
  auto thread = std::make_unique<detail::service_thread>();
  serving.socket = std::make_unique<detail::trace_socket>(thread->io());
  serving.thread = std::move(thread);
  detail::trace_socket* socket = serving.socket.get();
  serving.listener = trace::add_listener([socket](const trace::event& e) {
    if (socket->has_clients()) { socket->publish(trace::to_json(e)); }
  });
  return serving.socket->path().string();
}

void stop_serving_trace() noexcept
{
  trace_serving& serving = trace_serving::get();
  std::lock_guard lock{serving.mutex};
  if (!serving.socket) { return; }
  trace::remove_listener(serving.listener);
  serving.socket.reset();
  serving.thread.reset();
}

std::vector<std::string> trace_socket_paths(int pid)
{
  std::vector<std::string> paths;
  for (const auto& path : detail::trace_socket_candidates(pid)) { paths.push_back(path.string()); }
  return paths;
}

runtime_description describe_runtime() noexcept
{
  runtime_description d;
  try {
    const auto& s = started();
    d.backend = s.name;
    d.version = HANDOFF_VERSION;
    d.dlpack_version = fmt::format("{}.{}", DLPACK_MAJOR_VERSION, DLPACK_MINOR_VERSION);
    d.cuda_compiled = device::cuda_compiled_in();
    if (const auto cuda = device::cuda_requirement()) {
      d.cuda_runtime = cuda->runtime_version;
      d.cuda_driver_minimum = cuda->minimum_driver_branch;
    }
    d.backend_error = s.error;
    if (inherited_from_a_parent(s)) {
      d.backend_error = "this process was forked after its parent started the backend; it cannot use the device";
    } else if (s.backend) {
      d.device_count = s.backend->device_count();
    }
  } catch (const std::exception& e) {
    d.backend_error = e.what();
  }
  return d;
}

}  // namespace handoff
