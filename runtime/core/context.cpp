#include <handoff/context.hpp>
#include <handoff/device_guard.hpp>
#include <handoff/embedding.hpp>
#include <handoff/error.hpp>
#include <handoff/internal/counters.hpp>
#include <handoff/internal/transfer.hpp>

#include "core/live_views.hpp"
#include "log/logger.hpp"

#include <fmt/format.h>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <list>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_set>
#include <vector>

namespace handoff {
namespace {

// How soon the executor enqueues again a release whose stream captures (to look whether the capture
// has ended) or could not be asked.
constexpr std::chrono::milliseconds retry_interval{1};
// How often the exit drain looks at the streams it waits for.
constexpr std::chrono::milliseconds exit_poll{5};
// How often the executor looks at the events of pending releases: soon while they complete, backing
// off to the longest interval while the streams are busy.
constexpr std::chrono::microseconds min_release_poll{20};
constexpr std::chrono::milliseconds max_release_poll{1};
// A stream that cannot be asked about (a failed query, a device that cannot be made current) is
// asked again: the failure may pass. Only one that keeps failing this long, at least this often (a
// sticky device error), has its releases abandoned.
constexpr std::chrono::milliseconds failure_grace{100};
constexpr int min_failures_to_abandon = 3;

std::atomic<release_section> installed_release_section{nullptr};

// Consecutive failures to ask about or wait for a stream (a failed query, record or synchronization,
// a device that cannot be made current), since the first of them.
struct failure_streak {
  int failures{0};
  std::chrono::steady_clock::time_point since{};

  // Counts a failure; true once the stream has failed long and often enough to be given up on.
  [[nodiscard]] bool keeps_failing() noexcept
  {
    const auto now = std::chrono::steady_clock::now();
    if (failures++ == 0) { since = now; }
    return failures >= min_failures_to_abandon && now - since >= failure_grace;
  }
  void reset() noexcept { failures = 0; }
};

// What the exception being handled says.
std::string what_failed()
{
  try {
    throw;
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "an exception of unknown type";
  }
}

}  // namespace

void set_release_section(release_section section) noexcept
{
  installed_release_section.store(section, std::memory_order_release);
}

// The context's state and the machinery of its deferred releases, out of the installed header.
struct context::impl {
  impl(device::backend& backend, event_pool& events, std::unique_ptr<executor> deferred);
  impl(const impl&) = delete;
  impl& operator=(const impl&) = delete;
  impl(impl&&) = delete;
  impl& operator=(impl&&) = delete;
  ~impl();

  [[nodiscard]] device::stream_handle thread_independent(int device, device::stream_handle stream) noexcept;
  void release_after(int device, device::stream_handle stream, std::function<void()> release,
                     std::optional<device::stream_handle> producer) noexcept;
  void drain();
  bool drain_for(std::chrono::nanoseconds limit);
  bool drain_at_exit(std::chrono::nanoseconds limit) noexcept;

  using stream_key = std::pair<int, device::stream_handle>;  // (device, stream)
  struct thread_exit_orders;
  struct pending_release;
  struct release_group;
  struct shared_state;
  // Deferred releases not yet run: all of them, and (while the exit waits) those asked for before.
  struct release_tally {
    std::size_t pending{0};
    std::map<stream_key, std::size_t> by_stream;  // by the stream they wait for
    std::size_t bound_to_graphs{0};               // of them, those waiting for a captured graph to go
    // Nothing drain() waits for is pending: the rest wait for graphs the program holds.
    [[nodiscard]] bool drained() const noexcept { return pending <= bound_to_graphs; }
  };
  void enqueue_unless_capturing(pending_release* pending) noexcept;
  void enqueue_release(pending_release* pending, bool device_is_current) noexcept;
  void wait_then_release(pending_release* pending) noexcept;
  void poll_later(std::chrono::nanoseconds interval) noexcept;
  void poll_releases(std::chrono::nanoseconds interval) noexcept;
  void enqueue_later(pending_release* pending) noexcept;
  bool release_with_graph(pending_release* pending) noexcept;
  void hold_back(device::stream_handle producer, device::stream_handle consumer, device::event_handle reached) noexcept;
  template <typename Change>
  void tally(const pending_release& pending, Change change);  // throws what `change` throws
  void finished_one(const pending_release& pending) noexcept;
  void run_releases(std::vector<pending_release*>& releases) noexcept;
  void order_legacy_after_this_thread(int device) noexcept;
  void wait_for_stream(int device, device::stream_handle stream);  // blocks the calling thread
  void refuse_to_wait_for_itself(const char* what) const;

  device::backend& backend_;
  event_pool& events_;
  std::mutex pending_mutex_;
  std::condition_variable none_pending_;
  release_tally all_;                         // every deferred release not yet run
  std::optional<release_tally> before_exit_;  // those asked for before drain_at_exit began
  std::uint64_t next_sequence_{0};            // the order releases are asked for in
  std::uint64_t exit_cutoff_{0};              // the sequence of the first release asked for after that
  std::mutex watch_mutex_;
  std::list<release_group> watched_;  // recorded; the executor polls their events
  bool polling_{false};               // a poll is scheduled (guarded by watch_mutex_)
  // What a host function still queued on a stream reaches: it outlives the context, so that a
  // release abandoned at exit touches nothing when its host function runs after all.
  std::shared_ptr<shared_state> shared_;
  std::unique_ptr<executor> deferred_;
};

// What queued host functions and executor jobs reach of their context. `owner` becomes null when
// the context goes with releases still pending: they are abandoned, and touch nothing if their
// host function runs after all.
struct context::impl::shared_state {
  explicit shared_state(impl* live) noexcept : owner(live) {}
  std::mutex mutex;
  impl* owner;
  // Every release not yet run (or deliberately kept), so that what the context abandons stays
  // reachable: it is left to the ending process on purpose, not lost.
  std::unordered_set<pending_release*> outstanding;
};

namespace {

// Releases abandoned by contexts that are gone: kept until the process ends (never freed, so
// never reported as lost by a leak checker).
template <class Releases>
void keep_until_exit(const Releases& abandoned) noexcept
{
  static std::mutex mutex;
  try {
    static auto* kept = new std::vector<const void*>;  // NOLINT(cppcoreguidelines-owning-memory)
    std::lock_guard lock{mutex};
    kept->insert(kept->end(), abandoned.begin(), abandoned.end());
  } catch (...) {}  // out of memory: they stay unfreed all the same, only unlisted
}

}  // namespace

// Releases asked for on one stream between two polls share one event, re-recorded for each: a stream
// holds one event per poll its work outlasts, however many releases ask meanwhile, and one that never
// idles still releases its producers in steps, a poll apart.
struct context::impl::release_group {
  stream_key where;
  pooled_event reached;
  std::vector<pending_release*> releases;
  bool sealed{false};           // a poll looked at the event: a release joining it now would not be seen
  failure_streak failed_polls;  // that could not ask about the event
};

// A release waiting for a consumer stream: for the event of its group, which the executor polls.
struct context::impl::pending_release {
  std::shared_ptr<shared_state> shared;
  stream_key where;
  std::uint64_t sequence;  // in the order releases are asked for
  std::function<void()> release_producer;
  std::optional<device::stream_handle> producer;  // made to wait for the same work, once recorded
  bool graph_gone{false};                         // the graph its stream captured into when it was asked for is gone
  failure_streak failed_waits;                    // when no event can be recorded: of the waits for the stream

  // On the executor (or, failing that, where the stream reached it), while the context lives.
  void run(impl& owner) noexcept
  {
    release_producer();
    release_producer = nullptr;  // and what it holds (the consumer stream's owner), before drain() returns
    owner.finished_one(*this);
  }

  // The context, unless the release was abandoned. Call with shared->mutex held.
  [[nodiscard]] impl* live_owner() const noexcept { return shared->owner; }

  // Frees a release that has run. Call with shared->mutex held when `locked`.
  static void retire(pending_release* pending, bool locked = false) noexcept
  {
    if (locked) {
      pending->shared->outstanding.erase(pending);
    } else {
      std::lock_guard lock{pending->shared->mutex};
      pending->shared->outstanding.erase(pending);
    }
    delete pending;
  }
};

context::impl::impl(device::backend& backend, event_pool& events, std::unique_ptr<executor> deferred)
    : backend_(backend), events_(events), shared_(std::make_shared<shared_state>(this)), deferred_(std::move(deferred))
{}

context::impl::~impl()
{
  bool asked_since_exit = false;  // or the exit never waited
  {
    std::lock_guard lock{pending_mutex_};
    asked_since_exit = !before_exit_ || next_sequence_ > exit_cutoff_;
  }
  if (asked_since_exit) { (void)drain_at_exit(exit_drain_limit); }
  std::lock_guard lock{shared_->mutex};
  shared_->owner = nullptr;
  // What the exit's wait did not count (asked for while it waited, by a release it ran or a thread
  // still exchanging) is left to the ending process too, and said so.
  const auto unreported = std::count_if(shared_->outstanding.begin(), shared_->outstanding.end(),
                                        [this](const pending_release* p) { return p->sequence >= exit_cutoff_; });
  if (unreported > 0) {
    HANDOFF_LOG_INFO(
      "shutting down: {} stream-ordered release(s) asked for after the exit's wait began did not run; their "
      "producers are left to the ending process",
      unreported);
  }
  keep_until_exit(shared_->outstanding);
  shared_->outstanding.clear();
}

// Applies `change` to the tallies `pending` is counted in. Call with pending_mutex_ held.
template <typename Change>
void context::impl::tally(const pending_release& pending, Change change)
{
  change(all_);
  if (before_exit_ && pending.sequence < exit_cutoff_) { change(*before_exit_); }
  if (all_.drained() || (before_exit_ && before_exit_->drained())) { none_pending_.notify_all(); }
}

void context::impl::finished_one(const pending_release& pending) noexcept
{
  std::lock_guard lock{pending_mutex_};
  tally(pending, [where = pending.where](release_tally& t) {
    if (const auto it = t.by_stream.find(where); it != t.by_stream.end() && --it->second == 0) {
      t.by_stream.erase(it);
    }
    --t.pending;
  });
  detail::pending_releases_changed(-1);
}

void context::impl::refuse_to_wait_for_itself(const char* what) const
{
  if (deferred_->runs_on_this_thread()) {
    throw error(
      fmt::format("{} was called on handoff's service thread, which runs the deferred releases (from a "
                  "finalizer a release ran): it would wait for itself; wait elsewhere",
                  what));
  }
}

void context::impl::drain()
{
  refuse_to_wait_for_itself("drain()");
  std::unique_lock lock{pending_mutex_};
  none_pending_.wait(lock, [this] { return all_.drained(); });
}

bool context::impl::drain_for(std::chrono::nanoseconds limit)
{
  refuse_to_wait_for_itself("drain_for()");
  std::unique_lock lock{pending_mutex_};
  return none_pending_.wait_for(lock, limit, [this] { return all_.drained(); });
}

bool context::impl::drain_at_exit(std::chrono::nanoseconds limit) noexcept
{
  const auto deadline = std::chrono::steady_clock::now() + limit;
  // One probe event per stream with releases pending: polled, so that no stream blocks the exit
  // for longer than the limit, and a stream whose device failed (a sticky error) is known soon.
  struct probe {
    stream_key where;
    std::optional<pooled_event> event;  // recorded, and not yet reached
    bool settled{false};                // reached, or capturing: its releases are on the executor
    failure_streak failures;
    std::string failure;  // why the stream will never reach its releases (it kept failing)
  };
  std::vector<probe> probes;
  try {
    // The wait is for what is pending now: threads still exchanging keep asking for more.
    std::lock_guard lock{pending_mutex_};
    before_exit_ = all_;
    exit_cutoff_ = next_sequence_;
    for (const auto& [where, count] : before_exit_->by_stream) {
      probes.push_back({.where = where, .event = {}, .settled = false, .failures = {}, .failure = {}});
    }
  } catch (...) {  // out of memory: nothing to wait with
    return false;
  }
  const auto look = [this](probe& p) noexcept {
    if (p.settled || !p.failure.empty()) { return; }
    try {
      device_guard on{backend_, p.where.first};
      if (!p.event) {
        // A capturing stream gets no probe (it would go into the graph): its releases wait for the
        // capture to end on the executor.
        if (backend_.stream_capture_status(p.where.second) != device::capture_status::none) {
          p.settled = true;
          return;
        }
        p.event.emplace(events_.record(p.where.first, p.where.second));
      } else if (backend_.query_event(p.event->get())) {
        p.event.reset();
        p.settled = true;
      }
      p.failures.reset();
    } catch (const std::exception& e) {
      p.event.reset();  // recorded again at the next look, if the failure passes
      if (p.failures.keeps_failing()) { p.failure = e.what(); }
    }
  };
  const relaxed_capture_mode relaxed{backend_};  // the probes' queries must not break a capture
  for (auto& p : probes) { look(p); }

  std::unique_lock lock{pending_mutex_};
  release_tally& waited = *before_exit_;
  const auto unreachable = [&] {
    std::size_t count = 0;
    for (const auto& p : probes) {
      if (p.failure.empty()) { continue; }
      if (const auto it = waited.by_stream.find(p.where); it != waited.by_stream.end()) { count += it->second; }
    }
    return count;
  };
  // Releases bound to graphs wait for graphs the program still holds: not for the exit.
  while (waited.pending > unreachable() + waited.bound_to_graphs && std::chrono::steady_clock::now() < deadline) {
    none_pending_.wait_for(lock, exit_poll);
    lock.unlock();
    for (auto& p : probes) { look(p); }
    lock.lock();
  }
  for (const auto& p : probes) {
    const auto it = waited.by_stream.find(p.where);
    if (p.failure.empty() || it == waited.by_stream.end()) { continue; }
    HANDOFF_LOG_WARN(
      "shutting down: {} stream-ordered release(s) waiting for stream {:#x} of device {} abandoned: the stream "
      "can never get there ({}); their producers are left to the ending process",
      it->second, raw(p.where.second), p.where.first, p.failure);
  }
  const std::size_t left = waited.pending;
  const std::size_t with_graphs = waited.bound_to_graphs;
  const std::size_t timed_out = left - unreachable() - with_graphs;
  const std::size_t asked_meanwhile = all_.pending - left;
  lock.unlock();
  probes.clear();  // the probe events go back to the pool
  if (with_graphs > 0) {
    HANDOFF_LOG_INFO(
      "shutting down: {} release(s) wait for CUDA graphs still alive that captured work on their data; their "
      "producers are left to the ending process",
      with_graphs);
  }
  if (timed_out > 0) {
    HANDOFF_LOG_WARN(
      "shutting down: {} stream-ordered release(s) did not run within {} ms: their streams' work was not done "
      "by then; their producers are left to the ending process",
      timed_out, std::chrono::duration_cast<std::chrono::milliseconds>(limit).count());
  }
  if (asked_meanwhile > 0) {
    HANDOFF_LOG_DEBUG(
      "shutting down: {} stream-ordered release(s) asked for while the exit waited (threads still exchanging) "
      "were not waited for",
      asked_meanwhile);
  }
  return left == 0;
}

// The per-thread default streams the calling thread named to contexts, by device: when the thread
// ends, each context's legacy default stream of that device waits for that stream's work.
struct context::impl::thread_exit_orders {
  thread_exit_orders() = default;
  thread_exit_orders(const thread_exit_orders&) = delete;
  thread_exit_orders& operator=(const thread_exit_orders&) = delete;
  thread_exit_orders(thread_exit_orders&&) = delete;
  thread_exit_orders& operator=(thread_exit_orders&&) = delete;
  ~thread_exit_orders()
  {
    // A forked child's one thread is a copy of the parent's that forked: the contexts it named
    // streams to are the parent's, whose threads (and a mutex one of them may have held) the child
    // has not, nor may it use their device.
    if (getpid() != named_in) { return; }
    for (const auto& [shared, device] : streams) {
      std::unique_lock lock{shared->mutex};
      impl* owner = shared->owner;
      lock.unlock();  // not held across backend calls: a graph's release callback takes it from inside one
      if (owner != nullptr) { owner->order_legacy_after_this_thread(device); }
    }
  }

  std::vector<std::pair<std::shared_ptr<shared_state>, int>> streams;
  pid_t named_in{getpid()};  // the process whose thread named them
};

device::stream_handle context::impl::thread_independent(int device, device::stream_handle stream) noexcept
{
  if (stream != backend_.per_thread_default_stream()) { return stream; }
  try {
    thread_local thread_exit_orders orders;
    const auto named = std::find_if(orders.streams.begin(), orders.streams.end(), [&](const auto& entry) {
      return entry.first == shared_ && entry.second == device;
    });
    if (named == orders.streams.end()) { orders.streams.emplace_back(shared_, device); }
  } catch (...) {
    HANDOFF_LOG_WARN(
      "out of memory: the legacy default stream of device {} will not wait for this thread's "
      "per-thread default stream when the thread ends",
      device);
  }
  return backend_.legacy_default_stream();
}

void context::impl::order_legacy_after_this_thread(int device) noexcept
{
  try {
    device_guard on_device{backend_, device};
    const auto legacy = backend_.legacy_default_stream();
    // A wait on the legacy stream while a blocking stream of its device captures would invalidate
    // that capture; the ending thread's work is then ordered by the implicit rule alone.
    if (backend_.stream_capture_status(legacy) != device::capture_status::none) {
      HANDOFF_LOG_WARN(
        "a thread ended while device {} captures: its per-thread default stream's work is not "
        "explicitly ordered before the legacy default stream's",
        device);
      return;
    }
    const pooled_event ended = events_.record(device, backend_.per_thread_default_stream());
    backend_.stream_wait_event(legacy, ended.get());
    count(counter::waits_inserted);
  } catch (const std::exception& e) {
    HANDOFF_LOG_DEBUG(
      "a thread's end: its per-thread default stream of device {} could not be ordered before the "
      "legacy default stream ({})",
      device, e.what());
  }
}

void context::impl::release_after(int device, device::stream_handle stream, std::function<void()> release,
                                  std::optional<device::stream_handle> producer) noexcept
{
  pending_release* pending = nullptr;
  stream = thread_independent(device, stream);  // it may be waited for on another thread
  if (stream != backend_.legacy_default_stream()) {
    // A consumer may work on another device than the data's (peer access): the event that
    // watches its stream must be of the stream's device.
    try {
      device = backend_.stream_device(stream);
    } catch (...) {}  // enqueue_release finds out what is wrong with the stream
  }
  bool counted = false;
  try {
    pending = new pending_release{.shared = shared_,
                                  .where = {device, stream},
                                  .sequence = 0,  // given with the count, below
                                  .release_producer = std::move(release),
                                  .producer = producer,
                                  .graph_gone = false,
                                  .failed_waits = {}};
    {
      std::lock_guard lock{pending_mutex_};
      pending->sequence = next_sequence_++;
      tally(*pending, [where = pending->where](release_tally& t) {
        ++t.by_stream[where];
        ++t.pending;
      });
      counted = true;
      detail::pending_releases_changed(+1);
    }
    std::lock_guard lock{shared_->mutex};
    shared_->outstanding.insert(pending);
  } catch (...) {
    if (counted) { finished_one(*pending); }
    if (pending != nullptr) { release = std::move(pending->release_producer); }
    delete pending;  // could not even allocate: wait here, never release early
    try {
      wait_for_stream(device, stream);
    } catch (...) {
      HANDOFF_LOG_ERROR("deferred release: out of memory, and stream {:#x} cannot be waited for; its producer is kept",
                        raw(stream));
      return;
    }
    release();
    return;
  }
  enqueue_unless_capturing(pending);
}

void context::impl::enqueue_unless_capturing(pending_release* pending) noexcept
{
  const auto [device, stream] = pending->where;
  bool capturing = false;
  try {
    device_guard on_owner{backend_, device};  // made current once, for the query and the record
    // The legacy stream reports a capture of a blocking stream, which a record on it would break.
    capturing = backend_.stream_capture_status(stream) != device::capture_status::none;
    if (!capturing) {
      enqueue_release(pending, /*device_is_current=*/true);
      return;
    }
    // The captured work reads the data at every launch of the graph: the release waits for the graph
    // to be gone, then for the stream's own work as any release does.
    // (The legacy stream is only part of another stream's capture, and must not be touched.)
    if (!pending->graph_gone && stream != backend_.legacy_default_stream() && release_with_graph(pending)) { return; }
  } catch (...) {}  // enqueue_release finds out what is wrong with the stream
  if (capturing) {
    enqueue_later(pending);
  } else {
    enqueue_release(pending, /*device_is_current=*/false);
  }
}

void context::impl::enqueue_release(pending_release* pending, bool device_is_current) noexcept
{
  const auto [device, stream] = pending->where;  // copied below: clang 14 cannot capture bindings
  try {
    std::optional<device_guard> on_owner;
    if (!device_is_current) { on_owner.emplace(backend_, device); }
    std::lock_guard lock{watch_mutex_};
    release_group* open = nullptr;
    for (auto it = watched_.rbegin(); it != watched_.rend(); ++it) {  // the stream's newest group
      if (it->where != pending->where) { continue; }
      if (!it->sealed) { open = &*it; }
      break;
    }
    if (open != nullptr) {
      // Re-recorded: the event now also covers the work this release waits for. The earlier
      // releases of the group wait a little longer, never less.
      open->releases.push_back(pending);
      try {
        backend_.record_event(open->reached.get(), stream);
      } catch (...) {
        open->releases.pop_back();
        throw;
      }
    } else {
      release_group group{.where = pending->where,
                          .reached = events_.record(device, stream),
                          .releases = {pending},
                          .sealed = false,
                          .failed_polls = {}};
      watched_.push_back(std::move(group));
      open = &watched_.back();
      if (!polling_) {
        polling_ = true;
        poll_later(min_release_poll);
      }
    }
    count(counter::deferred_releases);
    // Still under watch_mutex_: the group's event is not given back (and re-recorded elsewhere)
    // before the producer's wait has captured this record.
    if (pending->producer) { hold_back(*pending->producer, stream, open->reached.get()); }
    return;
  } catch (const std::exception& e) {
    // Said once per release: a failure that passes has it recorded at a later attempt.
    if (pending->failed_waits.failures == 0) {
      HANDOFF_LOG_WARN("deferred release: cannot record an event on stream {:#x} ({}); waiting for the stream instead",
                       raw(stream), e.what());
      if (pending->producer) {
        HANDOFF_LOG_WARN(
          "deferred release: so producer stream {:#x} cannot wait for it; its later work is not ordered "
          "after the consumer's",
          raw(*pending->producer));
      }
    }
  }
  try {
    deferred_->post([this, pending]() noexcept { wait_then_release(pending); });
  } catch (...) {
    wait_then_release(pending);  // cannot defer at all: wait here
  }
}

// The fallback of a release whose event could not be recorded: waits for the whole stream. A wait
// that fails is tried again, the whole enqueue with it; only a stream that keeps failing (a sticky
// device error) has its release abandoned: nothing then says when the consumer is done, and the
// producer is kept, never released early.
void context::impl::wait_then_release(pending_release* pending) noexcept
{
  const auto [device, stream] = pending->where;
  try {
    const relaxed_capture_mode relaxed{backend_};
    wait_for_stream(device, stream);
  } catch (...) {
    const std::string why = what_failed();
    if (!pending->failed_waits.keeps_failing()) {
      HANDOFF_LOG_DEBUG("deferred release: waiting for stream {:#x} of device {} failed ({}); asking again",
                        raw(stream), device, why);
      enqueue_later(pending);
      return;
    }
    HANDOFF_LOG_ERROR(
      "deferred release: stream {:#x} of device {} cannot be waited for ({}, {} times); its producer is kept, not "
      "released while the consumer may still read it",
      raw(stream), device, why, pending->failed_waits.failures);
    finished_one(*pending);
    return;
  }
  std::vector<pending_release*> one{pending};
  run_releases(one);
}

void context::impl::wait_for_stream(int device, device::stream_handle stream)
{
  const device_guard on_owner{backend_, device};
  struct waiting {
    device::backend* backend;
    device::stream_handle stream;
  } wait{&backend_, stream};
  // A synchronization of the legacy default stream waits only for the work enqueued on it; the
  // blocking streams' work it stands for is waited for with the whole device's.
  block_host(
    [](void* raw) {
      const auto& w = *static_cast<waiting*>(raw);
      if (w.stream == w.backend->legacy_default_stream()) {
        w.backend->synchronize_device();
      } else {
        w.backend->synchronize_stream(w.stream);
      }
    },
    &wait);
}

void context::impl::hold_back(device::stream_handle producer, device::stream_handle consumer,
                              device::event_handle reached) noexcept
{
  try {
    // Asked first: a wait would go into a capturing producer's graph, and a wait on the legacy
    // default stream while a blocking stream of its device captures would invalidate that capture,
    // where asking only fails (cudaErrorStreamCaptureImplicit).
    if (backend_.stream_capture_status(producer) != device::capture_status::none) {
      HANDOFF_LOG_WARN(
        "deferred release: producer stream {:#x} is capturing into a graph; its later work is not "
        "ordered after the consumer's on stream {:#x}",
        raw(producer), raw(consumer));
      return;
    }
    backend_.stream_wait_event(producer, reached);
    count(counter::waits_inserted);
    HANDOFF_LOG_TRACE("producer stream {:#x} waits for consumer stream {:#x}", raw(producer), raw(consumer));
  } catch (const std::exception& e) {
    HANDOFF_LOG_WARN(
      "deferred release: producer stream {:#x} cannot wait for consumer stream {:#x} ({}); its later "
      "work is not ordered after the consumer's",
      raw(producer), raw(consumer), e.what());
  }
}

void context::impl::poll_later(std::chrono::nanoseconds interval) noexcept
{
  const auto poll = [this, shared = shared_, interval]() noexcept {
    {
      std::lock_guard lock{shared->mutex};
      if (shared->owner == nullptr) { return; }  // the context is going: what is watched is abandoned
    }
    poll_releases(interval);
  };
  try {
    deferred_->post_after(interval, poll);
  } catch (...) {
    poll();  // cannot defer (out of memory): look now
  }
}

void context::impl::poll_releases(std::chrono::nanoseconds interval) noexcept
{
  std::list<release_group> watched;
  {
    std::lock_guard lock{watch_mutex_};
    watched.splice(watched.end(), watched_);  // out of reach: no release joins a group being looked at
  }
  for (auto& group : watched) { group.sealed = true; }
  // Grouped by device, so that each device is made current once per look.
  watched.sort([](const release_group& a, const release_group& b) { return a.where.first < b.where.first; });
  std::vector<pending_release*> reached;
  std::list<release_group> waiting;
  const relaxed_capture_mode relaxed{backend_};  // a capture on another thread must not fail the queries
  std::optional<device_guard> on_device;
  int current = -1;  // the device on_device made current
  while (!watched.empty()) {
    auto group = watched.begin();
    const auto [device, stream] = group->where;
    try {
      if (current != device) {
        current = -1;
        on_device.reset();
        on_device.emplace(backend_, device);
        current = device;
      }
      if (!backend_.query_event(group->reached.get())) {
        group->failed_polls.reset();
        waiting.splice(waiting.end(), watched, group);
        continue;
      }
      reached.insert(reached.end(), group->releases.begin(), group->releases.end());
    } catch (...) {
      const std::string why = what_failed();
      if (!group->failed_polls.keeps_failing()) {
        HANDOFF_LOG_DEBUG("deferred release: stream {:#x} of device {} could not be asked ({}); asking again",
                          raw(stream), device, why);
        waiting.splice(waiting.end(), watched, group);
        continue;
      }
      // Nothing says when the consumer is done (a sticky device error): the producers are kept,
      // never released early.
      HANDOFF_LOG_ERROR(
        "deferred release: stream {:#x} of device {} cannot be waited for ({}, for {} polls); {} producer(s) kept",
        raw(stream), device, why, group->failed_polls.failures, group->releases.size());
      for (const auto* pending : group->releases) { finished_one(*pending); }
      group->reached.discard();  // an event that cannot be asked about is not pooled again
    }
    watched.erase(group);  // its event goes back to the pool first: a release may import again
  }
  on_device.reset();
  if (!reached.empty()) { run_releases(reached); }
  std::lock_guard lock{watch_mutex_};
  watched_.splice(watched_.begin(), waiting);  // older than what was added meanwhile
  if (watched_.empty()) {
    polling_ = false;
    return;
  }
  // Look again soon while releases complete; back off while the streams are busy.
  poll_later(reached.empty() ? std::min(interval * 2, std::chrono::nanoseconds{max_release_poll}) : min_release_poll);
}

void context::impl::run_releases(std::vector<pending_release*>& releases) noexcept
{
  struct batch {
    impl* owner;
    std::vector<pending_release*>* releases;
  } state{this, &releases};
  const auto body = [](void* raw) noexcept {
    auto* b = static_cast<batch*>(raw);
    // Each release runs with its stream's device current, as where it was asked for: what it frees
    // or finalizes (a peer library's finalizer) works on that device, and binds no context of another.
    std::optional<device_guard> on_device;
    int current = -1;  // the device on_device made current
    for (auto* pending : *b->releases) {
      if (const int device = pending->where.first; device != current) {
        on_device.reset();
        current = device;
        try {
          on_device.emplace(b->owner->backend_, device);
        } catch (...) {}  // released all the same: what it frees says for itself what fails
      }
      pending->run(*b->owner);
      pending_release::retire(pending);
    }
  };
  if (const release_section section = installed_release_section.load(std::memory_order_acquire)) {
    section(body, &state);
  } else {
    body(&state);
  }
}

bool context::impl::release_with_graph(pending_release* pending) noexcept
{
  // On a backend thread, which must not call the backend: the executor takes it from there.
  const auto graph_gone = [](void* raw) noexcept {
    auto* p = static_cast<pending_release*>(raw);
    const std::lock_guard lock{p->shared->mutex};  // the context stays while the release is handed over
    impl* owner = p->live_owner();
    if (owner == nullptr) { return; }  // abandoned at exit
    p->graph_gone = true;
    {
      const std::lock_guard pending_lock{owner->pending_mutex_};
      owner->tally(*p, [](release_tally& t) { --t.bound_to_graphs; });
    }
    try {
      owner->deferred_->post([owner, p]() noexcept { owner->enqueue_unless_capturing(p); });
    } catch (...) {
      HANDOFF_LOG_ERROR("deferred release: out of memory after its graph was destroyed; its producer is kept");
      owner->finished_one(*p);
    }
  };
  try {
    {
      const std::lock_guard lock{pending_mutex_};
      tally(*pending, [](release_tally& t) { ++t.bound_to_graphs; });  // before: the graph may go at once
    }
    backend_.release_with_capture(pending->where.second, graph_gone, pending);
    HANDOFF_LOG_DEBUG("deferred release: stream {:#x} is capturing; the release waits for the graph to be destroyed",
                      raw(pending->where.second));
    return true;
  } catch (...) {
    const std::lock_guard lock{pending_mutex_};
    tally(*pending, [](release_tally& t) { --t.bound_to_graphs; });
    return false;  // no graph of its own to wait for (the legacy stream in another's capture)
  }
}

void context::impl::enqueue_later(pending_release* pending) noexcept
{
  // Its stream captures (an event recorded now would become a node of the graph, and could not be
  // queried), or failed to be asked: enqueued again a little later, without holding the executor.
  const auto look_again = [shared = shared_, pending]() noexcept {
    std::unique_lock lock{shared->mutex};
    impl* owner = pending->live_owner();
    if (owner == nullptr) { return; }  // abandoned at exit
    lock.unlock();
    owner->enqueue_unless_capturing(pending);
  };
  try {
    deferred_->post_after(retry_interval, look_again);
  } catch (...) {
    HANDOFF_LOG_ERROR("deferred release: out of memory to ask stream {:#x} again later; its producer is kept",
                      raw(pending->where.second));
    finished_one(*pending);
  }
}

// --- the public face ---------------------------------------------------------------------------------

context::context(device::backend& backend, std::unique_ptr<executor> deferred)
    : backend_(backend), events_(backend), impl_(std::make_unique<impl>(backend, events_, std::move(deferred)))
{}

context::~context() = default;

device::stream_handle context::thread_independent(int device, device::stream_handle stream) noexcept
{
  return impl_->thread_independent(device, stream);
}

void context::release_after(int device, device::stream_handle stream, std::function<void()> release,
                            std::optional<device::stream_handle> producer) noexcept
{
  impl_->release_after(device, stream, std::move(release), producer);
}

void context::drain()
{
  impl_->drain();
}

bool context::drain_for(std::chrono::nanoseconds limit)
{
  return impl_->drain_for(limit);
}

bool context::drain_at_exit(std::chrono::nanoseconds limit) noexcept
{
  return impl_->drain_at_exit(limit);
}

}  // namespace handoff
