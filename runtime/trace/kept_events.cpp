#include "trace/kept_events.hpp"

#include <sys/mman.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>

namespace handoff::trace::detail {
namespace {

constexpr std::size_t chunk_bytes = std::size_t{256} << 10U;
constexpr std::size_t page_bytes = 4096;

constexpr std::size_t round_up(std::size_t bytes, std::size_t to) noexcept
{
  return (bytes + to - 1) / to * to;
}

// Copies `from` to `at`, and advances `at` past the copy.
template <class T>
void copy_into(std::byte*& at, std::span<const T> from) noexcept
{
  if (from.empty()) { return; }
  std::memcpy(at, from.data(), from.size_bytes());
  at += from.size_bytes();
}

void copy_into(std::byte*& at, std::string_view from) noexcept
{
  copy_into(at, std::span<const char>{from.data(), from.size()});
}

// Mappings given back lately, kept (up to 1 MiB) for the next request of their size: a bounded
// session drops a block of events, and a chunk of payloads, about as often as it maps one, and a
// mapping made and unmapped each time costs two system calls and a page fault per page. Where there
// is no room, the mappings kept longest ago are unmapped: the newest are the likeliest to be asked
// for again, and a size asked for once (a deque's block map, outgrown) must not hold a place forever.
class recent_mappings {
 public:
  void* take(std::size_t bytes) noexcept
  {
    const std::lock_guard lock{mutex_};
    for (mapping& m : kept_) {
      if (m.pages != nullptr && m.bytes == bytes) {
        kept_bytes_ -= bytes;
        return std::exchange(m.pages, nullptr);
      }
    }
    return nullptr;
  }

  void keep(void* pages, std::size_t bytes) noexcept
  {
    std::array<mapping, slots> evicted{};
    std::size_t gone = 0;
    bool kept = false;
    if (bytes <= max_kept_bytes / 4) {  // one large mapping must not push out the chunks in use
      const std::lock_guard lock{mutex_};
      for (;;) {
        mapping* free_slot = nullptr;
        mapping* oldest = nullptr;
        for (mapping& m : kept_) {
          if (m.pages == nullptr) {
            free_slot = &m;
          } else if (oldest == nullptr || m.kept_at < oldest->kept_at) {
            oldest = &m;
          }
        }
        if (free_slot != nullptr && kept_bytes_ + bytes <= max_kept_bytes) {
          *free_slot = {pages, bytes, ++clock_};
          kept_bytes_ += bytes;
          kept = true;
          break;
        }
        if (oldest == nullptr) { break; }  // nothing kept, and still no room: not kept
        kept_bytes_ -= oldest->bytes;
        evicted.at(gone++) = std::exchange(*oldest, {});
      }
    }
    for (std::size_t i = 0; i < gone; ++i) { munmap(evicted.at(i).pages, evicted.at(i).bytes); }
    if (!kept) { munmap(pages, bytes); }
  }

 private:
  struct mapping {
    void* pages{nullptr};
    std::size_t bytes{0};
    std::uint64_t kept_at{0};
  };
  static constexpr std::size_t slots = 8;
  static constexpr std::size_t max_kept_bytes = std::size_t{1} << 20U;

  std::mutex mutex_;
  std::array<mapping, slots> kept_{};
  std::size_t kept_bytes_{0};
  std::uint64_t clock_{0};
};

// Leaked: mappings are given back until the process exits. Null where it could not be made.
recent_mappings* recent() noexcept
{
  static recent_mappings* const kept = []() noexcept -> recent_mappings* {
    try {
      return new recent_mappings;  // NOLINT(cppcoreguidelines-owning-memory): leaked, see above
    } catch (const std::bad_alloc&) {
      return nullptr;
    }
  }();
  return kept;
}

}  // namespace

void* map_pages(std::size_t bytes)
{
  recent_mappings* const recent_ones = recent();
  if (void* kept = recent_ones != nullptr ? recent_ones->take(bytes) : nullptr) { return kept; }
  void* mapped = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mapped == MAP_FAILED) { throw std::bad_alloc{}; }
  return mapped;
}

void unmap_pages(void* pages, std::size_t bytes) noexcept
{
  if (recent_mappings* const recent_ones = recent()) {
    recent_ones->keep(pages, bytes);
  } else {
    munmap(pages, bytes);
  }
}

struct payload_arena::chunk {
  chunk* older;
  chunk* newer;
  std::size_t size;   // mapped bytes, this header included
  std::size_t used;   // bytes handed out, this header included
  std::size_t users;  // kept events with room here
};

namespace {
constexpr std::size_t header_bytes = round_up(sizeof(payload_arena::chunk), 16);
}  // namespace

payload_arena::~payload_arena()
{
  while (newest_ != nullptr) { unmap(newest_); }
}

std::pair<std::byte*, payload_arena::chunk*> payload_arena::allocate(std::size_t bytes)
{
  if (newest_ == nullptr || newest_->used + bytes > newest_->size) {
    const std::size_t size = std::max(chunk_bytes, round_up(header_bytes + bytes, page_bytes));
    auto* made = new (map_pages(size)) chunk{newest_, nullptr, size, header_bytes, 0};
    ++mapped_;
    chunk* previous = std::exchange(newest_, made);
    if (previous != nullptr) {
      previous->newer = made;
      if (previous->users == 0) { unmap(previous); }
    }
  }
  std::byte* at = reinterpret_cast<std::byte*>(newest_) + newest_->used;
  newest_->used += bytes;
  ++newest_->users;
  return {at, newest_};
}

void payload_arena::prefetch_next(std::size_t bytes) const noexcept
{
  if (newest_ != nullptr) { prefetch_for_write(reinterpret_cast<std::byte*>(newest_) + newest_->used, bytes); }
}

void payload_arena::release(chunk* in) noexcept
{
  if (in == nullptr || --in->users != 0) { return; }
  if (in == newest_) {
    in->used = header_bytes;  // filled again from the start
  } else {
    unmap(in);
  }
}

void payload_arena::unmap(chunk* c) noexcept
{
  if (c->newer != nullptr) { c->newer->older = c->older; }
  if (c->older != nullptr) { c->older->newer = c->newer; }
  if (c == newest_) { newest_ = c->older; }
  --mapped_;
  unmap_pages(c, c->size);
}

namespace {

std::uint32_t length_of(std::size_t count)
{
  if (count > std::numeric_limits<std::uint32_t>::max()) { throw std::length_error{"a trace event part over 4 GiB"}; }
  return static_cast<std::uint32_t>(count);
}

template <class T>
std::span<const T> read_span(const std::byte*& at, std::uint32_t count) noexcept
{
  const std::span<const T> read{reinterpret_cast<const T*>(at), count};
  at += read.size_bytes();
  return read;
}

std::string_view read_text(const std::byte*& at, std::uint32_t length) noexcept
{
  const std::span<const char> read = read_span<char>(at, length);
  return {read.data(), read.size()};
}

}  // namespace

#if defined(__GLIBCXX__) && UINTPTR_MAX == UINT64_MAX
// A field added to `event` changes its size: kept_event keeps it too (and expanded() restores it),
// and this number follows.
static_assert(sizeof(event) == 496, "trace::event changed: kept_event must keep every field of it");
#endif

kept_event::kept_event(const event& e, payload_arena& arena)
    : hazard_{e.hazard},
      kind_{e.kind},
      action_{e.action},
      has_other_{e.other.has_value()},
      device_{e.device},
      dtype_{e.dtype},
      protocol_{e.protocol},
      time_ns_{e.time_ns},
      thread_{e.thread},
      nbytes_{e.nbytes},
      producer_{e.producer},
      consumer_{e.consumer},
      producer_stream_{e.producer_stream},
      consumer_stream_{e.consumer_stream},
      buffer_{e.buffer},
      view_{e.view},
      interposed_{e.interposed},
      stream_argument_{e.stream_argument},
      op_{e.op},
      stream_{e.stream},
      kernel_{e.kernel},
      blocked_ns_{e.blocked_ns},
      library_{e.library},
      where_{e.where},
      seq_{e.seq}
{
  if (e.other) {
    other_kind_ = e.other->kind;
    other_seq_ = e.other->seq;
    other_kernel_ = e.other->kernel;
    other_stream_ = e.other->stream;
    other_library_ = e.other->library;
    other_time_ns_ = e.other->time_ns;
    other_where_ = e.other->where;
  }
  lengths_ = {.shape = length_of(e.shape.size()),
              .buffers = length_of(e.buffers.size()),
              .detail = length_of(e.detail.size()),
              .fix = length_of(e.fix.size())};
  const std::size_t numbers = e.shape.size() * sizeof(std::int64_t) + e.buffers.size() * sizeof(buffer_ref);
  const std::size_t texts = e.detail.size() + e.fix.size();
  if (const std::size_t bytes = round_up(numbers + texts, 8); bytes != 0) {
    std::byte* at = nullptr;
    std::tie(at, chunk_) = arena.allocate(bytes);
    payload_ = at;
    // The 8-aligned arrays first, then the texts, in the order `lengths` lists them.
    handoff::detail::copy_short(e.shape.data(), e.shape.size(), reinterpret_cast<std::int64_t*>(at));
    at += e.shape.size() * sizeof(std::int64_t);
    copy_into(at, std::span<const buffer_ref>{e.buffers});
    copy_into(at, e.detail);
    copy_into(at, e.fix);
  }
}

event kept_event::expanded() const
{
  event out;
  out.kind = kind_;
  out.protocol = protocol_;
  out.time_ns = time_ns_;
  out.thread = thread_;
  out.device = device_;
  out.dtype = dtype_;
  out.nbytes = nbytes_;
  out.producer = producer_;
  out.consumer = consumer_;
  out.producer_stream = producer_stream_;
  out.consumer_stream = consumer_stream_;
  out.action = action_;
  out.hazard = hazard_;
  out.buffer = buffer_;
  out.view = view_;
  out.interposed = interposed_;
  out.stream_argument = stream_argument_;
  out.op = op_;
  out.stream = stream_;
  out.kernel = kernel_;
  out.blocked_ns = blocked_ns_;
  out.library = library_;
  out.where = where_;
  out.seq = seq_;
  const std::byte* at = payload_;
  const auto shape = read_span<std::int64_t>(at, lengths_.shape);
  out.shape.assign(shape.begin(), shape.end());
  const auto buffers = read_span<buffer_ref>(at, lengths_.buffers);
  out.buffers.assign(buffers.begin(), buffers.end());
  out.detail = read_text(at, lengths_.detail);
  out.fix = read_text(at, lengths_.fix);
  if (has_other_) {
    out.other = activity_side{.seq = other_seq_,
                              .kind = other_kind_,
                              .kernel = other_kernel_,
                              .stream = other_stream_,
                              .where = other_where_,
                              .library = other_library_,
                              .time_ns = other_time_ns_};
  }
  return out;
}

void kept_event::release(payload_arena& arena) noexcept
{
  arena.release(std::exchange(chunk_, nullptr));
}

}  // namespace handoff::trace::detail
