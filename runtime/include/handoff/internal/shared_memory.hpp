// Internal: memory that processes of one node share (POSIX shared memory files), and what a process
// knows of another (alive or gone, started when, on which boot), for the hand-off across processes.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace handoff::detail {

/// Where shared memory files live: HANDOFF_IPC_DIR (a folder processes in separate containers
/// both mount) or /dev/shm.
[[nodiscard]] std::string shared_memory_dir();

/// A file of shared memory mapped into this process. The process that created it removes its name
/// when the mapping goes (or at once with unlink()); a mapping outlives the name, so memory another
/// process mapped stays readable there. Move-only.
class shared_mapping {
 public:
  /// A new file `name` (no slash) of `bytes` zeroed bytes, readable by this user only.
  /// @throws std::system_error when it cannot be made (the folder is missing, full, or the name taken).
  [[nodiscard]] static shared_mapping create(std::string_view name, std::size_t bytes);
  /// Maps the file another process made; nullopt when there is none by that name (removed, or the
  /// process that made it is gone). @throws std::system_error for other failures.
  [[nodiscard]] static std::optional<shared_mapping> open(std::string_view name);

  shared_mapping() noexcept = default;  ///< maps nothing
  shared_mapping(shared_mapping&& other) noexcept;
  shared_mapping& operator=(shared_mapping&& other) noexcept;
  shared_mapping(const shared_mapping&) = delete;
  shared_mapping& operator=(const shared_mapping&) = delete;
  ~shared_mapping();

  [[nodiscard]] void* data() const noexcept { return data_; }
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  [[nodiscard]] const std::string& name() const noexcept { return name_; }
  /// Removes the name now (created files only, in the process that created them: a forked child
  /// leaves its parent's); the mapping stays.
  void unlink() noexcept;

 private:
  shared_mapping(std::string name, void* data, std::size_t size, int creator) noexcept
      : name_(std::move(name)), data_(data), size_(size), creator_(creator)
  {}
  void reset() noexcept;

  std::string name_;
  void* data_{nullptr};
  std::size_t size_{0};
  int creator_{0};  // the pid that created the file, whose name is removed with it; 0: opened
};

/// A serial this process never gave before, for the names of its shared memory files.
[[nodiscard]] std::uint64_t next_shared_serial() noexcept;

/// The name of a shared memory file of `kind` ("ipc", "host", "sim", ...) made by this process:
/// "handoff-<kind>.<pid>.<serial>", so that leftovers of a process that was killed are recognized.
[[nodiscard]] std::string shared_memory_name(std::string_view kind, std::uint64_t serial);
/// The same name, of a file process `pid` made.
[[nodiscard]] std::string shared_memory_name(std::string_view kind, int pid, std::uint64_t serial);

/// Removes the shared memory files of processes that are gone (a process killed with SIGKILL
/// cannot remove its own). Cheap after the first call in a process; never throws.
void remove_leftovers() noexcept;

/// When process `pid` started (clock ticks since boot, /proc/<pid>/stat), which tells it from a later
/// process given the same pid; nullopt when there is no such process.
[[nodiscard]] std::optional<std::uint64_t> process_start_time(int pid) noexcept;
/// True while process `pid`, started at `start_time`, runs (a zombie counts as gone).
[[nodiscard]] bool process_alive(int pid, std::uint64_t start_time) noexcept;
/// This process's id and start time.
[[nodiscard]] int this_process() noexcept;
[[nodiscard]] std::uint64_t this_process_start_time() noexcept;

/// This boot of this node: /proc/sys/kernel/random/boot_id as 16 bytes (zeros if unreadable).
[[nodiscard]] const std::array<std::byte, 16>& boot_id() noexcept;

/// 16 random bytes (getrandom), to tell a genuine handle from a forged or stale one.
[[nodiscard]] std::array<std::byte, 16> random_token();

}  // namespace handoff::detail
