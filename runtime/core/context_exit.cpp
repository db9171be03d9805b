#include "core/context_impl.hpp"

#include <handoff/activity.hpp>
#include <handoff/device_guard.hpp>
#include <handoff/error.hpp>

#include "log/logger.hpp"

#include <fmt/format.h>

#include <algorithm>

namespace handoff {
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

// One per stream the exit waits for: an event polled, so that no stream blocks the exit for longer
// than its limit, and a stream whose device failed (a sticky error) is known soon.
struct context::impl::exit_probe {
  stream_key where;
  std::optional<pooled_event> event;  // recorded, and not yet reached
  bool settled{false};                // reached, or capturing: its releases are on the executor
  detail::failure_streak failures;
  std::string failure;  // why the stream will never reach its releases (it kept failing)
};

context::impl::~impl()
{
  if (count_.asked_since_exit_began()) { (void)drain_at_exit(exit_drain_limit); }
  leave_outstanding_to_the_process();
}

// What the exit's wait did not count (asked for while it waited, by a release it ran or a thread
// still exchanging) is left to the ending process too, and said so; a host function still queued
// finds no owner.
void context::impl::leave_outstanding_to_the_process() noexcept
{
  const std::uint64_t first_unreported = count_.first_after_exit_began();
  std::lock_guard lock{shared_->mutex};
  shared_->owner = nullptr;
  const auto unreported =
    std::count_if(shared_->outstanding.begin(), shared_->outstanding.end(),
                  [first_unreported](const pending_release* p) { return p->sequence >= first_unreported; });
  if (unreported > 0) {
    HANDOFF_LOG_INFO(
      "shutting down: {} stream-ordered release(s) asked for after the exit's wait began did not run; their "
      "producers are left to the ending process",
      unreported);
  }
  keep_until_exit(shared_->outstanding);
  shared_->outstanding.clear();
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
  count_.wait_drained();
}

bool context::impl::drain_for(std::chrono::nanoseconds limit)
{
  refuse_to_wait_for_itself("drain_for()");
  return count_.wait_drained_for(limit);
}

// Records the probe's event, or asks whether the stream reached it.
void context::impl::look_at(exit_probe& probe) noexcept
{
  if (probe.settled || !probe.failure.empty()) { return; }
  const activity::bookkeeping own;  // the program waited for none of this
  try {
    device_guard on{backend_, probe.where.first};
    if (!probe.event) {
      // A capturing stream gets no probe (it would go into the graph): its releases wait for the
      // capture to end on the executor.
      if (backend_.stream_capture_status(probe.where.second) != device::capture_status::none) {
        probe.settled = true;
        return;
      }
      probe.event.emplace(events_.record(probe.where.first, probe.where.second));
    } else if (backend_.query_event(probe.event->get())) {
      probe.event.reset();
      probe.settled = true;
    }
    probe.failures.reset();
  } catch (const std::exception& e) {
    probe.event.reset();  // recorded again at the next look, if the failure passes
    if (probe.failures.keeps_failing()) { probe.failure = e.what(); }
  }
}

bool context::impl::drain_at_exit(std::chrono::nanoseconds limit) noexcept
{
  const auto deadline = std::chrono::steady_clock::now() + limit;
  // 1. What is pending now, by stream: threads still exchanging keep asking for more.
  std::vector<exit_probe> probes;
  try {
    for (const stream_key& where : count_.begin_exit()) {
      probes.push_back({.where = where, .event = {}, .settled = false, .failures = {}, .failure = {}});
    }
  } catch (...) {  // out of memory: nothing to wait with
    return false;
  }
  // 2. Wait, looking at the streams, until those releases ran, their streams will never get there,
  // or the limit passed. Releases bound to graphs wait for graphs the program still holds.
  const relaxed_capture_mode relaxed{backend_};  // the probes' queries must not break a capture
  const auto look_at_all = [&]() noexcept {
    for (auto& probe : probes) { look_at(probe); }
  };
  look_at_all();
  // The probes are in the order of their streams (begin_exit()'s): found by a binary search.
  const auto failure_of = [&](const stream_key& where) -> const std::string* {  // null: not given up on
    const auto probe = std::lower_bound(probes.begin(), probes.end(), where,
                                        [](const exit_probe& p, const stream_key& key) { return p.where < key; });
    return probe == probes.end() || probe->where != where || probe->failure.empty() ? nullptr : &probe->failure;
  };
  const auto outcome = count_.wait_exit(deadline, detail::exit_poll, look_at_all,
                                        [&](const stream_key& where) { return failure_of(where) != nullptr; });
  // 3. Say what is left to the ending process, and why.
  for (const auto& [where, abandoned] : outcome.unreachable_by_stream) {
    HANDOFF_LOG_WARN(
      "shutting down: {} stream-ordered release(s) waiting for stream {:#x} of device {} abandoned: the stream "
      "can never get there ({}); their producers are left to the ending process",
      abandoned, raw(where.second), where.first, *failure_of(where));
  }
  probes.clear();  // the probe events go back to the pool
  if (outcome.bound_to_graphs > 0) {
    HANDOFF_LOG_INFO(
      "shutting down: {} release(s) wait for CUDA graphs still alive that captured work on their data; their "
      "producers are left to the ending process",
      outcome.bound_to_graphs);
  }
  if (const std::size_t timed_out = outcome.left - outcome.unreachable - outcome.bound_to_graphs; timed_out > 0) {
    HANDOFF_LOG_WARN(
      "shutting down: {} stream-ordered release(s) did not run within {} ms: their streams' work was not done "
      "by then; their producers are left to the ending process",
      timed_out, std::chrono::duration_cast<std::chrono::milliseconds>(limit).count());
  }
  if (outcome.asked_meanwhile > 0) {
    HANDOFF_LOG_DEBUG(
      "shutting down: {} stream-ordered release(s) asked for while the exit waited (threads still exchanging) "
      "were not waited for",
      outcome.asked_meanwhile);
  }
  return outcome.left == 0;
}

}  // namespace handoff
