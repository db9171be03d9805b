// Internal: the happens-before race detector over device activity. A vector clock per stream, joined
// as CUDA orders work (in-stream order, event records and waits, the legacy default stream's implicit
// synchronization with blocking streams, per-thread default streams, host synchronizations,
// stream-ordered allocations and frees), and the last accesses of each range of memory.
#pragma once

#include <handoff/activity.hpp>
#include <handoff/detail/immovable.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <deque>
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
  access_site other;
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
  std::optional<found_hazard> observe(const activity::record& r, std::uint64_t thread, const access_site& site);

  /// How many ranges of memory it keeps accesses of (bounded by the live allocations touched).
  [[nodiscard]] std::size_t tracked_ranges() const noexcept { return shadow_.size(); }

 private:
  using clock_vector = std::vector<std::uint32_t>;  // by stream index

  // The sites that the kept accesses name, each shared by the accesses it made and given back with
  // the last: counted without atomics, as the detector's owner serializes its every use.
  class site_pool : handoff::detail::immovable {
    struct node {
      access_site site;
      std::uint32_t users{0};
      node* next_free{nullptr};
      site_pool* pool{nullptr};
    };

   public:
    class ref {
     public:
      ref() = default;
      ref(const ref& other) noexcept : node_(other.node_)
      {
        if (node_ != nullptr) { ++node_->users; }
      }
      ref(ref&& other) noexcept : node_(std::exchange(other.node_, nullptr)) {}
      ref& operator=(const ref& other) noexcept
      {
        ref copy{other};
        std::swap(node_, copy.node_);
        return *this;
      }
      ref& operator=(ref&& other) noexcept
      {
        std::swap(node_, other.node_);  // `other` gives back what this named
        return *this;
      }
      ~ref()
      {
        if (node_ != nullptr && --node_->users == 0) { node_->pool->give_back(node_); }
      }
      const access_site& operator*() const noexcept { return node_->site; }
      const access_site* operator->() const noexcept { return &node_->site; }

     private:
      friend class site_pool;
      explicit ref(node* n) noexcept : node_(n) { ++node_->users; }
      node* node_{nullptr};
    };

    ref make(const access_site& site)
    {
      node* n = free_;
      if (n != nullptr) {
        free_ = n->next_free;
      } else {
        n = &nodes_.emplace_back();
        n->pool = this;
      }
      n->site = site;
      return ref{n};
    }

   private:
    void give_back(node* n) noexcept
    {
      n->next_free = free_;
      free_ = n;
    }
    std::deque<node> nodes_;  // never shrinks: bounded by the most sites kept at once
    node* free_{nullptr};
  };

  struct epoch {
    std::uint32_t stream{0};
    std::uint32_t clock{0};
    activity::access mode{activity::access::read};
    site_pool::ref site;
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
    // Memory freed and handed out again by a stream-ordered allocation: usable on the allocating
    // stream, and on another once ordered after the allocation (the pool orders only its own stream
    // after the free).
    std::optional<epoch> reallocated;
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
    bool before_reallocation{false};
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
  /// stream_of() past its last answer: the index, or a new stream.
  std::uint32_t look_up_stream(const stream_key& key, const activity::record& r);
  /// What orders a new operation on `s`: the host's synchronizations and the legacy stream's rule.
  void order_operation(std::uint32_t s);
  /// The legacy default stream's implicit synchronization with the blocking streams of its device.
  void join_legacy_rule(std::uint32_t s);
  /// A new operation on `s`: its epoch.
  std::uint32_t tick(std::uint32_t s);
  void join_host_with(int device);
  // observe()'s steps by kind of activity: a host wait joins the host's clock with what it waited
  // for; an allocation forgets what the memory held (and remembers a reallocation); a stream-ordered free is checked as
  // a write and remembered for reuse; a launch, copy or set is checked and recorded.
  void observe_host_wait(const activity::record& r, std::uint64_t thread);
  void observe_allocation(const activity::record& r, std::uint64_t thread, const access_site& site);
  std::optional<found_hazard> observe_free(const activity::record& r, std::uint64_t thread, const access_site& site);
  std::optional<found_hazard> observe_access(const activity::record& r, std::uint64_t thread, const access_site& site);
  [[nodiscard]] bool ordered(const epoch& earlier, std::uint32_t s) const;
  // An earlier access a new one is not ordered after; `other` lives until the range is next recorded.
  struct conflict {
    const char* hazard{nullptr};  // "race" or "reuse"
    const epoch* other{nullptr};
    bool used_after_free{false};
    bool before_reallocation{false};  // `other` is the allocation that handed freed memory out again
  };
  /// The first conflict `use` on `s` meets; `exact`, when given, learns the range recorded for
  /// exactly `use`'s memory, if there is one (so that recording the use needs no second search).
  std::optional<conflict> check(const activity::buffer_use& use, std::uint32_t s, bool freeing,
                                range_state** exact = nullptr);
  /// The conflict an access on `s` (`writing` or not) meets in `range`, named `hazard` unless it is a
  /// use after the range's free.
  std::optional<conflict> conflict_in(const range_state& range, std::uint32_t s, bool writing,
                                      const char* hazard) const;
  /// Records `use` at `now`, in `exact` when check() found its range.
  void record_access(const activity::buffer_use& use, const epoch& now, range_state* exact = nullptr);
  /// The range recorded for [begin, end), added if there is none.
  range_state& range_for(std::uintptr_t begin, std::uintptr_t end);
  void forget(std::uintptr_t begin, std::uintptr_t end);
  template <class F>
  void for_each_overlap(std::uintptr_t begin, std::uintptr_t end, F&& f);

  // The ranges found alone on their memory by recent lookups: the same buffers come back launch
  // after launch, and are found again without a search until a range is added or forgotten.
  struct sole_range {
    std::uintptr_t begin{0};
    std::uintptr_t end{0};
    range_state* range{nullptr};  // recorded for exactly [begin, end), and nothing else overlaps it
    std::uint64_t generation{0};  // shadow_'s when it was found: stale once shadow_ changed
  };
  static constexpr std::size_t sole_range_slots = 32;
  [[nodiscard]] static std::size_t slot_of(std::uintptr_t begin) noexcept;
  [[nodiscard]] range_state* remembered(std::uintptr_t begin, std::uintptr_t end) const noexcept;
  void remember(std::uintptr_t begin, std::uintptr_t end, range_state* range) noexcept;
  /// Forgets every remembered range: shadow_ gained or lost one.
  void ranges_changed() noexcept { ++shadow_generation_; }

  [[nodiscard]] std::string stream_name(std::uint32_t s) const;
  [[nodiscard]] std::string site_name(const access_site& site, activity::access mode) const;
  [[nodiscard]] static std::string range_name(std::uintptr_t address, std::size_t bytes, const std::string& label);
  /// The hazard `met` by `mine`'s `use` on `s`, worded once per distinct pair of sides (remembered in
  /// `worded_`).
  found_hazard describe(const conflict& met, const access_site& mine, std::uint32_t s, const activity::buffer_use& use,
                        bool freeing);
  [[nodiscard]] wording word(const wording_key& k, const access_site& mine, const access_site& other) const;

  // A device's streams: those alive, and what the destroyed ones had done (a device's
  // synchronization orders their work too). A destroyed stream's own clock is let go of: nothing
  // runs on it again, and a program that makes a stream per step would keep a clock for each.
  struct device_streams {
    std::vector<std::uint32_t> live;
    clock_vector retired;
  };
  device_streams& streams_of(int device) { return devices_[device]; }

  labeler label_;
  std::vector<stream_state> streams_;
  std::unordered_map<int, device_streams> devices_;
  std::unordered_map<stream_key, std::uint32_t, key_hash> index_;
  std::optional<std::pair<stream_key, std::uint32_t>> last_stream_;  // index_'s last answer: launches repeat a stream
  std::unordered_map<std::uint64_t, clock_vector> events_;
  clock_vector host_;
  std::uint64_t host_version_{1};
  site_pool sites_;  // before the ranges: it outlives their accesses
  std::map<std::pair<std::uintptr_t, std::uintptr_t>, range_state> shadow_;  // by [begin, end)
  std::uintptr_t longest_{0};  // the longest range in shadow_: bounds the search for overlaps
  std::array<sole_range, sole_range_slots> sole_ranges_{};
  std::uint64_t shadow_generation_{1};                             // counts shadow_'s changes
  std::unordered_map<wording_key, wording, wording_hash> worded_;  // bounded: emptied when full
};

}  // namespace handoff::trace
