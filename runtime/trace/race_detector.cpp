#include <handoff/internal/race_detector.hpp>

#include "trace/activity_kinds.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <iterator>

namespace handoff::trace {

using activity::access;
using activity::kind;
using activity::stream_class;

namespace {

void join(std::vector<std::uint32_t>& into, const std::vector<std::uint32_t>& from)
{
  if (into.size() < from.size()) { into.resize(from.size(), 0); }
  for (std::size_t i = 0; i < from.size(); ++i) { into[i] = std::max(into[i], from[i]); }
}

bool blocking(stream_class c) noexcept
{
  return c == stream_class::blocking || c == stream_class::per_thread;
}

constexpr auto access_verbs = handoff::detail::make_enum_table<access>(
  {{access::read, "reads"}, {access::write, "writes"}, {access::read_write, "reads and writes"}});

std::string_view verb(access mode) noexcept
{
  return handoff::detail::look_up(access_verbs, mode, "uses");
}

std::string_view noun(kind k) noexcept
{
  return detail::facts(k).noun;
}

}  // namespace

std::size_t race_detector::key_hash::operator()(const stream_key& k) const noexcept
{
  std::size_t h = std::hash<std::uint64_t>{}(k.handle);
  h ^= std::hash<std::uint64_t>{}(k.thread) + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
  h ^= std::hash<int>{}(k.device) + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
  return h;
}

inline std::uint32_t race_detector::stream_of(const activity::record& r, std::uint64_t thread)
{
  const stream_key key{.device = r.device.device_id,
                       .handle = r.stream,
                       .thread = r.stream_class == stream_class::per_thread ? thread : 0};
  if (r.kind != kind::stream_create && last_stream_ && last_stream_->first == key) { return last_stream_->second; }
  return look_up_stream(key, r);
}

std::uint32_t race_detector::look_up_stream(const stream_key& key, const activity::record& r)
{
  if (r.kind != kind::stream_create) {
    if (const auto found = index_.find(key); found != index_.end()) {
      last_stream_.emplace(key, found->second);
      return found->second;
    }
  }
  // New, or a handle that a created stream takes again after another was destroyed: a stream of its
  // own, since nothing orders it with the old one's work.
  const auto s = static_cast<std::uint32_t>(streams_.size());
  streams_.push_back({.key = key, .stream_class = r.stream_class, .clock = {}, .host_seen = 0, .live = true});
  streams_.back().clock.resize(streams_.size(), 0);
  streams_of(key.device).live.push_back(s);
  index_.insert_or_assign(key, s);
  last_stream_.emplace(key, s);
  return s;
}

inline void race_detector::order_operation(std::uint32_t s)
{
  stream_state& self = streams_[s];
  if (self.host_seen != host_version_) {
    join(self.clock, host_);
    self.host_seen = host_version_;
  }
  if (self.stream_class != stream_class::non_blocking) { join_legacy_rule(s); }
}

void race_detector::join_legacy_rule(std::uint32_t s)
{
  // The legacy default stream waits for every blocking stream of its device, and they for it.
  const stream_class own = streams_[s].stream_class;
  if (own != stream_class::legacy && !blocking(own)) { return; }
  for (const std::uint32_t other : streams_of(streams_[s].key.device).live) {
    const stream_class theirs = streams_[other].stream_class;
    if (other != s && (own == stream_class::legacy ? blocking(theirs) : theirs == stream_class::legacy)) {
      join(streams_[s].clock, streams_[other].clock);
    }
  }
}

inline std::uint32_t race_detector::tick(std::uint32_t s)
{
  order_operation(s);
  auto& clock = streams_[s].clock;
  if (clock.size() <= s) { clock.resize(s + 1, 0); }
  return ++clock[s];
}

void race_detector::join_host_with(int device)
{
  const device_streams& on = streams_of(device);
  join(host_, on.retired);
  for (const std::uint32_t s : on.live) { join(host_, streams_[s].clock); }
  ++host_version_;
}

bool race_detector::ordered(const epoch& earlier, std::uint32_t s) const
{
  if (earlier.stream == s) { return true; }
  const auto& clock = streams_[s].clock;
  return earlier.stream < clock.size() && clock[earlier.stream] >= earlier.clock;
}

template <class F>
void race_detector::for_each_overlap(std::uintptr_t begin, std::uintptr_t end, F&& f)
{
  const std::uintptr_t from = begin > longest_ ? begin - longest_ : 0;
  for (auto it = shadow_.lower_bound({from, 0}); it != shadow_.end() && it->first.first < end; ++it) {
    if (it->first.second > begin) { f(it->first, it->second); }
  }
}

std::size_t race_detector::slot_of(std::uintptr_t begin) noexcept
{
  // Fibonacci hashing: allocations aligned alike still spread over the slots.
  constexpr std::uint64_t golden = 0x9E3779B97F4A7C15ULL;
  static_assert(std::has_single_bit(sole_range_slots));
  constexpr int slot_bits = std::countr_zero(sole_range_slots);
  return static_cast<std::size_t>((static_cast<std::uint64_t>(begin) * golden) >> (64 - slot_bits));
}

inline race_detector::range_state* race_detector::remembered(std::uintptr_t begin, std::uintptr_t end) const noexcept
{
  const sole_range& slot = sole_ranges_[slot_of(begin)];
  return slot.begin == begin && slot.end == end && slot.generation == shadow_generation_ ? slot.range : nullptr;
}

void race_detector::remember(std::uintptr_t begin, std::uintptr_t end, range_state* range) noexcept
{
  sole_ranges_[slot_of(begin)] = {.begin = begin, .end = end, .range = range, .generation = shadow_generation_};
}

inline std::optional<race_detector::conflict> race_detector::conflict_in(const range_state& range, std::uint32_t s,
                                                                         bool writing, const char* hazard) const
{
  if (range.freed && !ordered(*range.freed, s)) {
    return conflict{.hazard = "reuse", .other = &*range.freed, .used_after_free = true};
  }
  if (range.reallocated && !ordered(*range.reallocated, s)) [[unlikely]] {
    return conflict{.hazard = "reuse", .other = &*range.reallocated, .before_reallocation = true};
  }
  if (range.write && !ordered(*range.write, s)) {
    return conflict{.hazard = hazard, .other = &*range.write, .used_after_free = false};
  }
  if (writing) {
    for (const epoch& read : range.reads) {
      if (!ordered(read, s)) { return conflict{.hazard = hazard, .other = &read, .used_after_free = false}; }
    }
  }
  return std::nullopt;
}

inline std::optional<race_detector::conflict> race_detector::check(const activity::buffer_use& use, std::uint32_t s,
                                                                   bool freeing, range_state** exact)
{
  const bool writing = freeing || activity::writes(use.mode);
  const char* const hazard = freeing ? "reuse" : "race";
  const std::uintptr_t end = use.address + use.bytes;
  if (range_state* const sole = remembered(use.address, end)) {
    if (exact != nullptr) { *exact = sole; }
    return conflict_in(*sole, s, writing, hazard);
  }
  std::optional<conflict> found;
  std::size_t overlaps = 0;
  range_state* same = nullptr;
  for_each_overlap(use.address, end, [&](const auto& key, range_state& range) {
    ++overlaps;
    if (key.first == use.address && key.second == end) { same = &range; }
    if (!found) { found = conflict_in(range, s, writing, hazard); }
  });
  if (exact != nullptr) { *exact = same; }
  if (overlaps == 1 && same != nullptr) { remember(use.address, end, same); }
  return found;
}

inline void race_detector::record_access(const activity::buffer_use& use, const epoch& now, range_state* exact)
{
  range_state& range = exact != nullptr ? *exact : range_for(use.address, use.address + use.bytes);
  if (activity::writes(use.mode)) {
    range.write = now;
    range.reads.clear();
    range.freed.reset();
    range.freed_clock.reset();
  }
  if (use.mode != access::write) {
    for (epoch& read : range.reads) {  // a few at most: one per stream that read since the write
      if (read.stream == now.stream) {
        read = now;
        return;
      }
    }
    range.reads.push_back(now);
  }
}

race_detector::range_state& race_detector::range_for(std::uintptr_t begin, std::uintptr_t end)
{
  const auto [at, added] = shadow_.try_emplace({begin, end});
  if (added) {
    longest_ = std::max(longest_, end - begin);
    ranges_changed();  // the new range may overlap a remembered one
  }
  return at->second;
}

void race_detector::forget(std::uintptr_t begin, std::uintptr_t end)
{
  std::vector<std::pair<std::uintptr_t, std::uintptr_t>> gone;
  for_each_overlap(begin, end, [&](const auto& key, const range_state&) { gone.push_back(key); });
  if (gone.empty()) { return; }
  for (const auto& key : gone) { shadow_.erase(key); }
  ranges_changed();  // a remembered range may be gone
  if (shadow_.empty()) { longest_ = 0; }
}

std::optional<found_hazard> race_detector::observe(const activity::record& r, std::uint64_t thread,
                                                   const access_site& site)
{
  switch (r.kind) {
    case kind::stream_create:
      (void)stream_of(r, thread);
      break;
    case kind::stream_destroy: {
      const std::uint32_t s = stream_of(r, thread);
      stream_state& gone = streams_[s];
      gone.live = false;
      index_.erase(gone.key);
      last_stream_.reset();
      device_streams& on = streams_of(gone.key.device);
      std::erase(on.live, s);
      join(on.retired, gone.clock);
      clock_vector{}.swap(gone.clock);
      break;
    }
    case kind::event_record: {
      const std::uint32_t s = stream_of(r, thread);
      (void)tick(s);
      events_.insert_or_assign(r.event, streams_[s].clock);
      break;
    }
    case kind::stream_wait: {
      const std::uint32_t s = stream_of(r, thread);
      order_operation(s);
      if (const auto recorded = events_.find(r.event); recorded != events_.end()) {
        join(streams_[s].clock, recorded->second);
      }  // an event never recorded orders nothing, as in CUDA
      break;
    }
    case kind::host_sync:
    case kind::host_query:
      observe_host_wait(r, thread);
      break;
    case kind::allocate:
      observe_allocation(r, thread, site);
      break;
    case kind::free:
      return observe_free(r, thread, site);
    case kind::launch:
    case kind::copy:
    case kind::set:
      return observe_access(r, thread, site);
  }
  return std::nullopt;
}

void race_detector::observe_host_wait(const activity::record& r, std::uint64_t thread)
{
  switch (r.scope) {
    case activity::sync_scope::stream:
    case activity::sync_scope::copy:
      join(host_, streams_[stream_of(r, thread)].clock);
      ++host_version_;
      break;
    case activity::sync_scope::event:
      if (const auto recorded = events_.find(r.event); recorded != events_.end()) {
        join(host_, recorded->second);
        ++host_version_;
      }
      break;
    case activity::sync_scope::device:
      join_host_with(r.device.device_id);
      break;
  }
}

void race_detector::observe_allocation(const activity::record& r, std::uint64_t thread, const access_site& site)
{
  if (!r.stream_ordered) {
    for (const auto& use : r.buffers) { forget(use.address, use.address + use.bytes); }
    return;
  }
  // An allocation is no work on its stream: the legacy stream's rule does not order other streams
  // by it (the simulator enqueues nothing, and CUDA promises no more).
  const std::uint32_t s = stream_of(r, thread);
  for (const auto& use : r.buffers) {
    // A stream-ordered allocator hands out memory freed on another stream only once that free is
    // ordered before the allocating stream's work (CUDA's pools insert the wait): trusted. Other
    // streams are ordered after the free only once they are after the allocation.
    bool freed = false;
    for_each_overlap(use.address, use.address + use.bytes, [&](const auto&, const range_state& range) {
      if (range.freed_clock) {
        join(streams_[s].clock, *range.freed_clock);
        freed = true;
      }
    });
    forget(use.address, use.address + use.bytes);
    if (freed) {
      auto& clock = streams_[s].clock;
      if (clock.size() <= s) { clock.resize(s + 1, 0); }
      range_for(use.address, use.address + use.bytes).reallocated =
        epoch{.stream = s, .clock = ++clock[s], .mode = access::write, .site = sites_.make(site)};
    }
  }
}

std::optional<found_hazard> race_detector::observe_free(const activity::record& r, std::uint64_t thread,
                                                        const access_site& site)
{
  if (!r.stream_ordered) {  // a free that synchronized the device first: every earlier use is done
    join_host_with(r.device.device_id);
    for (const auto& use : r.buffers) { forget(use.address, use.address + use.bytes); }
    return std::nullopt;
  }
  const std::uint32_t s = stream_of(r, thread);
  const std::uint32_t now = tick(s);
  std::optional<found_hazard> found;
  for (const auto& use : r.buffers) {
    if (const auto met = check(use, s, /*freeing=*/true)) {
      found = describe(*met, site, s, use, /*freeing=*/true);
      break;
    }
  }
  auto clock = std::make_shared<const clock_vector>(streams_[s].clock);
  const site_pool::ref freeing = sites_.make(site);
  for (const auto& use : r.buffers) {
    forget(use.address, use.address + use.bytes);
    range_state& range = range_for(use.address, use.address + use.bytes);
    range.freed = epoch{.stream = s, .clock = now, .mode = access::write, .site = freeing};
    range.freed_clock = clock;
  }
  return found;
}

std::optional<found_hazard> race_detector::observe_access(const activity::record& r, std::uint64_t thread,
                                                          const access_site& site)
{
  const std::uint32_t s = stream_of(r, thread);
  const std::uint32_t now = tick(s);
  const site_pool::ref accessing = sites_.make(site);
  std::optional<found_hazard> found;
  // Each use checked, then recorded: a use recorded before the next is checked is this launch's
  // own, ordered with it (one stream), and the first hazard found is the one reported.
  for (const auto& use : r.buffers) {
    range_state* exact = nullptr;
    if (!found) {
      if (const auto met = check(use, s, /*freeing=*/false, &exact)) {
        found = describe(*met, site, s, use, /*freeing=*/false);  // before the record replaces its other side
      }
    }
    record_access(use, epoch{.stream = s, .clock = now, .mode = use.mode, .site = accessing}, exact);
  }
  return found;
}

// --- messages ------------------------------------------------------------------------------------

std::string race_detector::stream_name(std::uint32_t s) const
{
  const stream_state& state = streams_[s];
  switch (state.stream_class) {
    case stream_class::legacy:
      return fmt::format("the legacy default stream ({:#x})", state.key.handle);
    case stream_class::per_thread:
      return fmt::format("the per-thread default stream of thread {}", state.key.thread);
    case stream_class::non_blocking:
      return fmt::format("non-blocking stream {:#x}", state.key.handle);
    case stream_class::blocking:
      break;
  }
  return fmt::format("stream {:#x}", state.key.handle);
}

std::string race_detector::site_name(const access_site& site, access mode) const
{
  std::string text = site.kind == kind::launch && site.kernel != nullptr ? fmt::format("kernel '{}'", site.kernel)
                                                                         : std::string{noun(site.kind)};
  if (site.kind != kind::free) { text += fmt::format(" ({})", verb(mode)); }
  if (site.where != nullptr) { text += fmt::format(" at {}", site.where); }
  if (site.library != nullptr) { text += fmt::format(" in {}", site.library); }
  return text;
}

std::string race_detector::range_name(std::uintptr_t address, std::size_t bytes, const std::string& label)
{
  const std::string where = fmt::format("[{:#x}, {} B]", address, bytes);
  return label.empty() ? where : fmt::format("{} {}", label, where);
}

std::size_t race_detector::wording_hash::operator()(const wording_key& k) const noexcept
{
  std::size_t h = std::hash<std::string_view>{}(k.label);
  const auto mix = [&h](std::size_t v) { h ^= v + 0x9E3779B97F4A7C15U + (h << 6U) + (h >> 2U); };
  mix(std::hash<const void*>{}(k.where));
  mix(std::hash<const void*>{}(k.other_where));
  mix(k.address);
  mix(k.bytes);
  mix(k.here);
  mix(k.there);
  mix(std::hash<const void*>{}(k.kernel));
  mix(std::hash<const void*>{}(k.other_kernel));
  return h;
}

found_hazard race_detector::describe(const conflict& met, const access_site& mine, std::uint32_t s,
                                     const activity::buffer_use& use, bool freeing)
{
  const epoch& other = *met.other;
  wording_key key{.hazard = met.hazard,
                  .freeing = freeing,
                  .used_after_free = met.used_after_free,
                  .before_reallocation = met.before_reallocation,
                  .here = s,
                  .there = other.stream,
                  .address = use.address,
                  .bytes = use.bytes,
                  .label = label_ ? label_(use.address, use.bytes) : std::string{},
                  .mode = use.mode,
                  .other_mode = other.mode,
                  .kind = mine.kind,
                  .other_kind = other.site->kind,
                  .kernel = mine.kernel,
                  .other_kernel = other.site->kernel,
                  .library = mine.library,
                  .other_library = other.site->library,
                  .where = mine.where,
                  .other_where = other.site->where};
  auto found = worded_.find(key);
  if (found == worded_.end()) {
    constexpr std::size_t most_remembered = 256;
    if (worded_.size() >= most_remembered) { worded_.clear(); }
    wording words = word(key, mine, *other.site);
    found = worded_.emplace(std::move(key), std::move(words)).first;
  }
  return {.name = met.hazard, .other = *other.site, .detail = found->second.detail, .fix = found->second.fix};
}

race_detector::wording race_detector::word(const wording_key& k, const access_site& mine,
                                           const access_site& other) const
{
  wording out;
  const std::string here = stream_name(k.here);
  const std::string there = stream_name(k.there);
  const std::string memory = range_name(k.address, k.bytes, k.label);
  const std::string this_side = site_name(mine, k.mode);
  const std::string other_side = site_name(other, k.other_mode);
  const std::string other_what = other.kind == kind::launch && other.kernel != nullptr
                                   ? fmt::format("'{}'", other.kernel)
                                   : std::string{noun(other.kind)};
  if (k.before_reallocation) {
    out.detail = fmt::format(
      "{} on {} uses {}, which was freed and then handed out again by the {} on {}, with nothing ordering the "
      "use after that allocation: the memory's earlier user may still be using it",
      this_side, here, memory, other_side, there);
    out.fix = fmt::format(
      "make {} wait for an event recorded on {} after the allocation (stream-ordered memory is usable on its "
      "own stream, and on another once ordered after the allocation), or allocate on {}",
      here, there, here);
    return out;
  }
  if (k.used_after_free) {
    out.detail = fmt::format(
      "{} on {} uses {}, which was freed on {} by the {} with nothing ordering the use after "
      "the free: the memory may already belong to another allocation",
      this_side, here, memory, there, other_side);
    out.fix = fmt::format(
      "make {} wait for an event recorded on {} after the free, or allocate the memory again on "
      "{} (a stream-ordered allocation orders the reuse)",
      here, there, here);
    return out;
  }
  if (k.freeing) {
    out.detail = fmt::format("{} frees {} on {} while the {} on {} may still use it: nothing orders the free after it",
                             this_side, memory, here, other_side, there);
    out.fix = fmt::format(
      "keep the memory until {} is done with it: free it after an event recorded on {} after {} "
      "(cudaStreamWaitEvent on {} before the free), or tell the allocator the stream uses it "
      "(tensor.record_stream(stream) in PyTorch)",
      there, there, other_what, here);
    return out;
  }
  out.detail = fmt::format(
    "{} on {} and the {} on {} touch {} with nothing ordering them: {}", this_side, here, other_side, there, memory,
    activity::writes(k.other_mode) ? "it may read or write the memory before the earlier write"
                                   : "it may write the memory while the earlier read still runs");
  const bool legacy_after_non_blocking =
    streams_[k.here].stream_class == stream_class::legacy && !blocking(streams_[k.there].stream_class);
  const bool non_blocking_after_legacy =
    streams_[k.there].stream_class == stream_class::legacy && !blocking(streams_[k.here].stream_class);
  const std::string wait = fmt::format(
    "make {} wait for {}: an event recorded on {} after {}, waited for on {} before this (cudaEventRecord, "
    "cudaStreamWaitEvent; handoff.from_dlpack(x, stream=...) does it for an exchanged array)",
    here, there, there, other_what, here);
  std::string fix =
    legacy_after_non_blocking || non_blocking_after_legacy
      ? fmt::format(
          "{}: launch on the stream the data was ordered onto (pass the library its stream, or make it every "
          "library's current stream with handoff.stream(s, frameworks=True)), or {}",
          legacy_after_non_blocking ? "the legacy default stream does not wait for non-blocking streams"
                                    : "a non-blocking stream does not wait for the legacy default stream",
          wait)
      : fmt::format(
          "{}, or run both on one stream (with handoff.stream(s, frameworks=True): every library's current "
          "stream)",
          wait);
  if (!activity::writes(k.other_mode) && other.kind == kind::copy) {
    fix +=
      "; if a caching allocator handed the copy's source out again, keep it for the copy's stream "
      "(tensor.record_stream(stream) in PyTorch)";
  }
  out.fix = std::move(fix);
  return out;
}

}  // namespace handoff::trace
