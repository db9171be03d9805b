// Private: the live trace, served on a Unix socket from a service thread to `handoff-trace attach`.
#pragma once

#include <boost/asio/io_context.hpp>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

namespace handoff::detail {

/// Where a process serves its trace: `$XDG_RUNTIME_DIR/handoff` when that names a directory, else
/// `<$TMPDIR or /tmp>/handoff-<euid>`; the socket is `trace-<pid>.sock` there.
[[nodiscard]] std::filesystem::path trace_socket_directory();
[[nodiscard]] std::filesystem::path trace_socket_path(int pid);
/// Where a client looks for process `pid`'s socket, most likely first: where that process serves it
/// by its effective uid and its environment as it started (which its own user and root may read),
/// or, for another user's that cannot be read, by that user's usual one ($XDG_RUNTIME_DIR
/// /run/user/UID, $TMPDIR this process's, or /tmp); for a process of this user, also by this
/// process's environment now. Each directory is tried, then the one under $TMPDIR (or /tmp).
[[nodiscard]] std::vector<std::filesystem::path> trace_socket_candidates(int pid);

/// A Unix socket that sends every published line to each client, newline-delimited JSON: first
/// `{"hello":"handoff","version":...,"pid":...}`, then the lines as published. Serves from the
/// thread running `io` (one thread: every handler runs there, so the clients need no lock).
///
/// Only the process's user gets in: the directory is made mode 0700 (refused when it exists and
/// belongs to another user or is a symbolic link), the socket mode 0600, and a client whose peer
/// credentials name another uid is sent `{"error":"refused: ..."}` and closed. A slow client never
/// blocks: past `queue_bytes` of pending lines its new lines are dropped and counted, and it is
/// sent `{"dropped":N}` before the next line that fits; lines the io thread has not taken yet are
/// bounded the same way. At most `max_clients` are served at once (a client past them is sent
/// `{"error":"refused: ..."}`), so memory stays under about (max_clients + 1) * queue_bytes. What a
/// client sends is read and discarded.
class trace_socket {
 public:
  static constexpr std::size_t default_queue_bytes = std::size_t{1} << 20;
  static constexpr std::size_t default_max_clients = 16;

  /// Makes the directory and the socket and starts accepting. @throws std::system_error naming the
  /// path and the reason.
  explicit trace_socket(boost::asio::io_context& io, std::size_t queue_bytes = default_queue_bytes,
                        std::size_t max_clients = default_max_clients);
  trace_socket(const trace_socket&) = delete;
  trace_socket& operator=(const trace_socket&) = delete;
  trace_socket(trace_socket&&) = delete;
  trace_socket& operator=(trace_socket&&) = delete;
  /// Closes the clients and the socket, and removes the socket file. Call from a thread other than
  /// the io thread while it runs (it waits for the io thread to close them), or after it stopped.
  ~trace_socket();

  [[nodiscard]] const std::filesystem::path& path() const noexcept;

  /// Sends `line` (a JSON object, no newline) to every client. Any thread; one relaxed load when no
  /// client is connected.
  void publish(std::string line);
  [[nodiscard]] bool has_clients() const noexcept;

  /// Counters, for tests and diagnostics. Any thread.
  [[nodiscard]] std::size_t clients() const noexcept;
  [[nodiscard]] std::uint64_t refused() const noexcept;
  [[nodiscard]] std::uint64_t dropped() const noexcept;

 private:
  struct server;
  std::shared_ptr<server> server_;  // shared with the handlers in flight
};

}  // namespace handoff::detail
