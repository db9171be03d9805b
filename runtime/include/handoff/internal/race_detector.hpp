// Internal: the happens-before race detector over device activity. A vector clock per stream, joined
// as CUDA orders work (in-stream order, event records and waits, the legacy default stream's implicit
// synchronization with blocking streams, per-thread default streams, host synchronizations,
// stream-ordered allocations and frees), and the last accesses of each range of memory.
#pragma once

#include <handoff/activity.hpp>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace handoff::trace {

/// A stream as the detector tells them apart: each thread has its own per-thread default stream.
struct stream_key {
  int device{0};
  std::uint64_t handle{0};
  std::uint64_t thread{0};  ///< the thread of a per-thread default stream; 0 for the others

  friend bool operator==(const stream_key&, const stream_key&) = default;
};

/// One side of a hazard: an operation as the trace recorded it.
struct access_site {
  std::uint64_t seq{0};  ///< the trace event's sequence number
  activity::kind kind{activity::kind::launch};
  const char* kernel{nullptr};
  stream_key stream;
  activity::stream_class stream_class{activity::stream_class::blocking};
  const char* where{nullptr};    ///< the user's line (interned), when known
  const char* library{nullptr};  ///< the library whose code did it (interned), when known
  std::int64_t time_ns{0};
};

/// A hazard found in one record: the earlier side it conflicts with, both named, and the fix.
struct found_hazard {
  const char* name{nullptr};  ///< "race" or "reuse"
  std::shared_ptr<const access_site> other;
  std::string detail;
  std::string fix;
};

/// Checks each record against what ordered the earlier ones. Not thread-safe: its owner serializes
/// the records, in the order the host issued them.
class race_detector {
 public:
  /// Names a range of memory in messages (an exchanged array's "buffer:7"); empty: its address.
  using labeler = std::function<std::string(std::uintptr_t address, std::size_t bytes)>;

  race_detector() = default;
  explicit race_detector(labeler label) : label_(std::move(label)) {}

  /// Applies `r`, which `site` names (its seq, user line and library), issued by host thread
  /// `thread`; the first hazard it makes, if any.
  std::optional<found_hazard> observe(const activity::record& r, std::uint64_t thread,
                                      const std::shared_ptr<const access_site>& site);

  /// How many ranges of memory it keeps accesses of (bounded by the live allocations touched).
  [[nodiscard]] std::size_t tracked_ranges() const noexcept { return shadow_.size(); }

 private:
  using clock_vector = std::vector<std::uint32_t>;  // by stream index

  struct epoch {
    std::uint32_t stream{0};
    std::uint32_t clock{0};
    activity::access mode{activity::access::read};
    std::shared_ptr<const access_site> site;
  };

  struct stream_state {
    stream_key key;
    activity::stream_class stream_class{activity::stream_class::blocking};
    clock_vector clock;
    std::uint64_t host_seen{0};  // the host clock's version it last joined
    bool live{true};
  };

  struct range_state {
    std::optional<epoch> write;
    std::vector<epoch> reads;  // the latest read of each stream that read since the write
    std::optional<epoch> freed;
    std::shared_ptr<const clock_vector> freed_clock;  // the freeing stream's clock at the free
  };

  struct key_hash {
    std::size_t operator()(const stream_key& k) const noexcept;
  };

  // Everything a hazard's words depend on: a race in a loop is found again each iteration between
  // the same two sides, and naming both and the fix costs far more than finding it.
  struct wording_key {
    const char* hazard{nullptr};
    bool freeing{false};
    bool used_after_free{false};
    std::uint32_t here{0};  // stream indices: a stream's name never changes
    std::uint32_t there{0};
    std::uintptr_t address{0};
    std::size_t bytes{0};
    std::string label;
    activity::access mode{activity::access::read};
    activity::access other_mode{activity::access::read};
    activity::kind kind{activity::kind::launch};
    activity::kind other_kind{activity::kind::launch};
    const char* kernel{nullptr};  // interned, as the libraries are
    const char* other_kernel{nullptr};
    const char* library{nullptr};
    const char* other_library{nullptr};
    const char* where{nullptr};  // interned, as the kernels are
    const char* other_where{nullptr};

    friend bool operator==(const wording_key&, const wording_key&) = default;
  };
  struct wording_hash {
    std::size_t operator()(const wording_key& k) const noexcept;
  };
  struct wording {
    std::string detail;
    std::string fix;
  };

  std::uint32_t stream_of(const activity::record& r, std::uint64_t thread);
  /// What orders a new operation on `s`: the host's synchronizations and the legacy stream's rule.
  void order_operation(std::uint32_t s);
  /// A new operation on `s`: its epoch.
  std::uint32_t tick(std::uint32_t s);
  void join_host_with(int device);
  // observe()'s steps by kind of activity: a host wait joins the host's clock with what it waited
  // for; an allocation forgets what the memory held; a stream-ordered free is checked as a write and
  // remembered for reuse; a launch, copy or set is checked and recorded.
  void observe_host_wait(const activity::record& r, std::uint64_t thread);
  void observe_allocation(const activity::record& r, std::uint64_t thread);
  std::optional<found_hazard> observe_free(const activity::record& r, std::uint64_t thread,
                                           const std::shared_ptr<const access_site>& site);
  std::optional<found_hazard> observe_access(const activity::record& r, std::uint64_t thread,
                                             const std::shared_ptr<const access_site>& site);
  [[nodiscard]] bool ordered(const epoch& earlier, std::uint32_t s) const;
  /// The first hazard `use` on `s` meets; `exact`, when given, learns the range recorded for exactly
  /// `use`'s memory, if there is one (so that recording the use needs no second search).
  std::optional<found_hazard> check(const activity::buffer_use& use, std::uint32_t s, bool freeing,
                                    range_state** exact = nullptr);
  /// Records `use` at `now`, in `exact` when check() found its range.
  void record_access(const activity::buffer_use& use, const epoch& now, range_state* exact = nullptr);
  void forget(std::uintptr_t begin, std::uintptr_t end);
  template <class F>
  void for_each_overlap(std::uintptr_t begin, std::uintptr_t end, F&& f);

  [[nodiscard]] std::string stream_name(std::uint32_t s) const;
  [[nodiscard]] std::string site_name(const access_site& site, activity::access mode) const;
  [[nodiscard]] static std::string range_name(std::uintptr_t address, std::size_t bytes, const std::string& label);
  /// The hazard found, worded once per distinct pair of sides (remembered in `worded_`).
  found_hazard describe(const char* hazard, const epoch& other, std::uint32_t s, const activity::buffer_use& use,
                        bool freeing, bool used_after_free);
  [[nodiscard]] wording word(const wording_key& k, const access_site& mine, const access_site& other) const;

  labeler label_;
  const access_site* current_{nullptr};  // the site being observed, for messages
  std::vector<stream_state> streams_;
  std::unordered_map<stream_key, std::uint32_t, key_hash> index_;
  std::unordered_map<std::uint64_t, clock_vector> events_;
  clock_vector host_;
  std::uint64_t host_version_{1};
  std::map<std::pair<std::uintptr_t, std::uintptr_t>, range_state> shadow_;  // by [begin, end)
  std::uintptr_t longest_{0};  // the longest range in shadow_: bounds the search for overlaps
  std::unordered_map<wording_key, wording, wording_hash> worded_;  // bounded: emptied when full
};

}  // namespace handoff::trace
