// The shared state of the hand-off across processes: a producer's control blocks (one slot per
// share, one entry per consumer that opened it), read and written by both sides with atomics, and
// the handle's wire format.
#pragma once

#include <handoff/dlpack.h>
#include <handoff/device.hpp>
#include <handoff/internal/shared_memory.hpp>

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace handoff::ipc::detail {

inline constexpr std::size_t consumers_per_share = 8;
inline constexpr std::size_t shares_per_block = 512;

/// What a consumer entry says, in the order it moves through.
enum class entry_state : std::uint32_t {
  free = 0,
  claiming = 1,  ///< taken, its hold not yet counted (or refused)
  open = 2,      ///< counted in the share's holds
  released = 3,  ///< the consumer is done: its stream's work on the data finished, its mapping closed
};

struct consumer_entry {
  std::atomic<std::uint32_t> state;
  std::atomic<std::int32_t> pid;
  std::atomic<std::uint64_t> start_time;
  std::atomic<std::uint32_t> generation;  // the share it belongs to
};

/// One share. `word` packs the share's generation (high half) and its holds (low half: the
/// producer's own, in-flight handles, and consumers' open entries); a consumer counts itself in only
/// while the holds are not zero, and only the producer counts holds out.
struct share_slot {
  std::atomic<std::uint64_t> word;
  std::atomic<std::uint32_t> tickets;       // in-flight handles not yet opened
  std::atomic<std::uint32_t> tickets_used;  // taken by consumers; the producer counts their holds out
  std::atomic<std::uint64_t> ready;         // stream memory operations: the producer's stream writes the share's number
  std::array<consumer_entry, consumers_per_share> consumers;
};

struct block_header {
  std::uint64_t magic;
  std::array<std::byte, 16> token;
  std::int32_t pid;
  std::uint64_t start_time;
};

struct control_block {
  block_header header;
  std::array<share_slot, shares_per_block> slots;
};

[[nodiscard]] constexpr std::uint64_t pack_word(std::uint32_t generation, std::uint32_t holds) noexcept
{
  return (std::uint64_t{generation} << 32U) | holds;
}
[[nodiscard]] constexpr std::uint32_t generation_of(std::uint64_t word) noexcept
{
  return static_cast<std::uint32_t>(word >> 32U);
}
[[nodiscard]] constexpr std::uint32_t holds_of(std::uint64_t word) noexcept
{
  return static_cast<std::uint32_t>(word & 0xFFFFFFFFU);
}

/// A consumer's claim on a share: an entry counted in its holds. nullopt (the entry given back) when
/// the share is no longer the one named (released, its slot reused). No entry free: consumer_entry
/// null with `full` set.
struct claim {
  consumer_entry* entry{nullptr};
  bool full{false};
};
[[nodiscard]] claim claim_share(share_slot& slot, std::uint32_t generation, int pid, std::uint64_t start_time) noexcept;

/// The producer's side of a released entry: frees it, and says whether its hold is to be counted out.
/// False where its consumer took it back first (claim_share), its hold kept.
[[nodiscard]] bool free_released(consumer_entry& entry) noexcept;

/// Takes one in-flight ticket of the share, if any is left: its hold is counted out by the producer.
void take_ticket(share_slot& slot) noexcept;

/// The handle's flags.
enum handle_flags : std::uint32_t {
  host_memory = 1U << 0U,    ///< a host memory copy in a shared memory file
  value_ordered = 1U << 1U,  ///< ordered by a stream memory operation, not an event
  in_flight = 1U << 2U,      ///< carries a ticket (a multiprocessing message)
  read_only = 1U << 3U,
};

/// What a handle carries.
struct wire_handle {
  std::uint32_t flags{0};
  std::array<std::byte, 16> boot{};
  std::int32_t pid{0};
  std::uint64_t start_time{0};
  std::uint32_t block{0};  // the producer's control block
  std::uint32_t slot{0};
  std::uint32_t generation{0};
  std::array<std::byte, 16> block_token{};
  std::string backend;                // at most 15 characters
  DLDevice device{kDLCPU, 0};         // the producer's ordinal
  device::device_uuid device_uuid{};  // what names the device in every process (device memory)
  DLDataType dtype{};
  std::vector<std::int64_t> shape;
  std::vector<std::int64_t> strides;  // elements
  std::uint64_t offset{0};            // of the first element, from the allocation's base
  std::uint64_t allocation_size{0};
  device::ipc_handle memory;      // device memory's handle
  device::ipc_handle event;       // the share's event (event-ordered)
  std::uint64_t ready_value{0};   // the number the producer's stream writes (value-ordered)
  std::uint64_t host_segment{0};  // the serial of the host memory copy's file
};

[[nodiscard]] std::vector<std::byte> encode(const wire_handle& handle);
/// @throws value_error naming what is wrong: not a handle, another version, corrupted or forged.
[[nodiscard]] wire_handle decode(std::span<const std::byte> bytes);

/// The names of the shared memory files: control blocks and host memory copies.
inline constexpr const char* block_kind = "ipc";
inline constexpr const char* host_kind = "host";
inline constexpr std::uint64_t block_magic = 0x686F666669706331;  // "hoffipc1"

}  // namespace handoff::ipc::detail
