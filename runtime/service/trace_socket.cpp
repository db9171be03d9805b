#include "service/trace_socket.hpp"

#include "log/logger.hpp"

#include <boost/asio/local/stream_protocol.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/write.hpp>

#include <fmt/format.h>

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <deque>
#include <fstream>
#include <functional>
#include <future>
#include <iterator>
#include <optional>
#include <set>
#include <sstream>
#include <string_view>
#include <system_error>
#include <thread>
#include <vector>

namespace handoff::detail {

namespace {

using boost::asio::local::stream_protocol;

[[noreturn]] void fail(int error, const std::string& what)
{
  throw std::system_error(error, std::generic_category(), what);
}

// Makes `dir` a directory only this user can enter, or refuses one it cannot trust.
void make_private_directory(const std::filesystem::path& dir)
{
  if (::mkdir(dir.c_str(), 0700) == 0) { return; }
  if (errno != EEXIST) { fail(errno, fmt::format("cannot make the trace directory {}", dir.string())); }
  struct stat info {};
  if (::lstat(dir.c_str(), &info) != 0) { fail(errno, fmt::format("cannot inspect {}", dir.string())); }
  if (!S_ISDIR(info.st_mode)) {
    fail(ENOTDIR, fmt::format("{} is not a directory (a symbolic link or a file); refusing to serve the trace there",
                              dir.string()));
  }
  if (info.st_uid != ::geteuid()) {
    fail(EPERM, fmt::format("{} belongs to uid {}, not to this process's uid {}; refusing to serve the trace there",
                            dir.string(), info.st_uid, ::geteuid()));
  }
  if ((info.st_mode & 077) != 0 && ::chmod(dir.c_str(), 0700) != 0) {
    fail(errno, fmt::format("cannot make {} private (mode 0700)", dir.string()));
  }
}

}  // namespace

namespace {

// What decides where a process serves its trace: its effective uid and its environment.
struct socket_owner {
  uid_t uid{};
  std::string runtime_dir;  // $XDG_RUNTIME_DIR, empty when unset
  std::string tmp_dir;      // $TMPDIR, empty when unset
};

socket_owner this_process()
{
  // NOLINTBEGIN(concurrency-mt-unsafe): read at start
  const char* runtime = std::getenv("XDG_RUNTIME_DIR");
  const char* tmp = std::getenv("TMPDIR");
  // NOLINTEND(concurrency-mt-unsafe)
  return {.uid = ::geteuid(), .runtime_dir = runtime != nullptr ? runtime : "", .tmp_dir = tmp != nullptr ? tmp : ""};
}

std::string read_file(const std::filesystem::path& path)
{
  std::ifstream in{path, std::ios::binary};
  return {std::istreambuf_iterator<char>{in}, std::istreambuf_iterator<char>{}};
}

// Process `pid`'s effective uid (/proc/PID/status), nullopt when there is no such process to read.
std::optional<uid_t> process_uid(const std::filesystem::path& proc)
{
  std::istringstream status{read_file(proc / "status")};
  for (std::string line; std::getline(status, line);) {
    if (!line.starts_with("Uid:")) { continue; }
    std::istringstream ids{line.substr(4)};
    unsigned long real = 0;
    unsigned long effective = 0;
    if (ids >> real >> effective) { return static_cast<uid_t>(effective); }
  }
  return std::nullopt;
}

// What process `pid` may have served its trace by, most likely first. Its environment as it started
// (/proc/PID/environ) where this process may read it (its own user's, or as root); another user's
// that cannot be read is taken as that user's session would set it (systemd's XDG_RUNTIME_DIR,
// /run/user/UID; this process's TMPDIR, or none). A process of this user may also have set its
// environment as this process's is now.
std::vector<socket_owner> possible_owners(int pid)
{
  const socket_owner self = this_process();
  if (pid == ::getpid()) { return {self}; }
  const std::filesystem::path proc = fmt::format("/proc/{}", pid);
  const std::optional<uid_t> uid = process_uid(proc);
  if (!uid) { return {self}; }  // no such process (the caller says so), or no /proc
  std::vector<socket_owner> owners;
  if (const std::string environment = read_file(proc / "environ"); !environment.empty()) {
    socket_owner owner{.uid = *uid, .runtime_dir = {}, .tmp_dir = {}};
    for (std::string_view rest = environment; !rest.empty();) {
      const std::string_view entry = rest.substr(0, rest.find('\0'));
      rest.remove_prefix(std::min(entry.size() + 1, rest.size()));
      if (entry.starts_with("XDG_RUNTIME_DIR=")) { owner.runtime_dir = entry.substr(entry.find('=') + 1); }
      if (entry.starts_with("TMPDIR=")) { owner.tmp_dir = entry.substr(entry.find('=') + 1); }
    }
    owners.push_back(std::move(owner));
  } else if (*uid != self.uid) {
    owners.push_back({.uid = *uid, .runtime_dir = fmt::format("/run/user/{}", *uid), .tmp_dir = self.tmp_dir});
    owners.push_back({.uid = *uid, .runtime_dir = {}, .tmp_dir = {}});
  }
  if (*uid == self.uid) { owners.push_back(self); }
  return owners;
}

std::filesystem::path temporary_socket_directory(const socket_owner& owner)
{
  return std::filesystem::path{owner.tmp_dir.empty() ? "/tmp" : owner.tmp_dir} / fmt::format("handoff-{}", owner.uid);
}

std::filesystem::path socket_directory(const socket_owner& owner)
{
  std::error_code ignored;
  if (!owner.runtime_dir.empty() && std::filesystem::is_directory(owner.runtime_dir, ignored)) {
    return std::filesystem::path{owner.runtime_dir} / "handoff";
  }
  return temporary_socket_directory(owner);
}

std::string socket_name(int pid)
{
  return fmt::format("trace-{}.sock", pid);
}

}  // namespace

std::filesystem::path trace_socket_directory()
{
  return socket_directory(this_process());
}

std::filesystem::path trace_socket_path(int pid)
{
  return trace_socket_directory() / socket_name(pid);
}

std::vector<std::filesystem::path> trace_socket_candidates(int pid)
{
  std::vector<std::filesystem::path> paths;
  for (const socket_owner& owner : possible_owners(pid)) {
    for (std::filesystem::path path : {socket_directory(owner), temporary_socket_directory(owner)}) {
      path /= socket_name(pid);
      if (std::find(paths.begin(), paths.end(), path) == paths.end()) { paths.push_back(std::move(path)); }
    }
  }
  return paths;
}

struct trace_socket::server : std::enable_shared_from_this<server> {
  struct client {
    explicit client(stream_protocol::socket s) : socket(std::move(s)) {}
    stream_protocol::socket socket;
    std::deque<std::string> queue;  // lines with their newline; the front one is being written
    std::size_t queued_bytes{0};
    std::uint64_t dropped{0};  // since the last {"dropped":N}
    std::array<char, 4096> input{};
  };

  server(boost::asio::io_context& context, std::size_t limit, std::size_t most_clients)
      : io(context),
        acceptor(context),
        retry(context),
        flush_deadline(context),
        queue_bytes(limit),
        max_clients(most_clients),
        path(trace_socket_path(::getpid()))
  {}

  // How long accepting rests after it failed for want of a resource (no file descriptor left): a
  // client then waits in the backlog, where accepting again at once would spin a core.
  static constexpr std::chrono::milliseconds first_rest{50};
  static constexpr std::chrono::milliseconds longest_rest{2000};
  // How long a closing server goes on writing what its clients have not read yet (the end of the
  // process's trace): a client that reads, reads it all; one that does not, delays the exit this long.
  static constexpr std::chrono::milliseconds longest_flush{2000};

  void open()
  {
    make_private_directory(path.parent_path());
    if (path.string().size() >= sizeof(sockaddr_un::sun_path)) {
      fail(ENAMETOOLONG, fmt::format("the trace socket path {} is too long for a Unix socket", path.string()));
    }
    ::unlink(path.c_str());  // a stale socket of an earlier process with this pid
    boost::system::error_code error;
    acceptor.open(stream_protocol{}, error);
    if (!error) { acceptor.bind(stream_protocol::endpoint{path.string()}, error); }
    if (!error && ::chmod(path.c_str(), 0600) != 0) { error.assign(errno, boost::system::generic_category()); }
    if (!error) { acceptor.listen(boost::asio::socket_base::max_listen_connections, error); }
    if (error) {
      ::unlink(path.c_str());
      fail(error.value(), fmt::format("cannot serve the trace on {}", path.string()));
    }
    HANDOFF_LOG_INFO("serving the trace on {}", path.string());
  }

  void accept()
  {
    acceptor.async_accept(
      [self = shared_from_this()](const boost::system::error_code& error, stream_protocol::socket socket) {
        if (error == boost::asio::error::operation_aborted || !self->acceptor.is_open()) { return; }
        if (!error) {
          self->rest = {};
          self->admit(std::move(socket));
        } else if (out_of_resources(error)) {
          self->accept_later(error);
          return;
        }
        self->accept();
      });
  }

  static bool out_of_resources(const boost::system::error_code& error) noexcept
  {
    const int code = error.value();
    return error.category() == boost::system::system_category() &&
           (code == EMFILE || code == ENFILE || code == ENOBUFS || code == ENOMEM);
  }

  void accept_later(const boost::system::error_code& error)
  {
    if (rest.count() == 0) {
      HANDOFF_LOG_WARN("trace socket: cannot accept a client ({}); trying again, backing off up to {} s",
                       error.message(), longest_rest.count() / 1000);
      rest = first_rest;
    } else {
      rest = std::min(rest * 2, longest_rest);
    }
    retry.expires_after(rest);
    // Weakly held: the timer is the server's own, and must not be what keeps it alive.
    retry.async_wait([weak = weak_from_this()](const boost::system::error_code& waited) {
      const auto self = weak.lock();
      if (!self || waited == boost::asio::error::operation_aborted || !self->acceptor.is_open()) { return; }
      self->accept();
    });
  }

  void admit(stream_protocol::socket socket)
  {
    auto c = std::make_shared<client>(std::move(socket));
    ucred peer{};
    socklen_t size = sizeof(peer);
    if (::getsockopt(c->socket.native_handle(), SOL_SOCKET, SO_PEERCRED, &peer, &size) != 0 ||
        peer.uid != ::geteuid()) {
      refused_count.fetch_add(1, std::memory_order_relaxed);
      HANDOFF_LOG_WARN("refused a trace client of uid {} (this process runs as uid {})", peer.uid, ::geteuid());
      say_and_close(
        c, fmt::format(R"({{"error":"refused: peer uid {} is not the server's uid {}"}})", peer.uid, ::geteuid()));
      return;
    }
    if (clients.size() >= max_clients) {
      // Said once: a burst of clients must not flood the program's stderr (refused() counts them all).
      if (!refused_for_room) {
        refused_for_room = true;
        HANDOFF_LOG_WARN(
          "refused a trace client: {} are attached already, the most served at once; later refusals "
          "are not logged",
          max_clients);
      }
      refused_count.fetch_add(1, std::memory_order_relaxed);
      say_and_close(c, fmt::format(R"({{"error":"refused: {} clients are attached already, the most served at once"}})",
                                   max_clients));
      return;
    }
    clients.insert(c);
    client_count.store(clients.size(), std::memory_order_relaxed);
    enqueue(c, fmt::format(R"({{"hello":"handoff","version":"{}","pid":{}}})", HANDOFF_VERSION, ::getpid()));
    drain_input(c);
  }

  // Sends a refused client its one line, then closes it.
  static void say_and_close(const std::shared_ptr<client>& c, std::string message)
  {
    auto line = std::make_shared<std::string>(std::move(message) + "\n");
    boost::asio::async_write(c->socket, boost::asio::buffer(*line),
                             [c, line](const boost::system::error_code&, std::size_t) {
                               boost::system::error_code ignored;
                               c->socket.close(ignored);
                             });
  }

  // Reads what the client sends, to notice when it goes; the bytes themselves are ignored.
  void drain_input(const std::shared_ptr<client>& c)
  {
    c->socket.async_read_some(boost::asio::buffer(c->input),
                              [self = shared_from_this(), c](const boost::system::error_code& error, std::size_t) {
                                if (error) {
                                  self->drop(c);
                                  return;
                                }
                                self->drain_input(c);
                              });
  }

  void enqueue(const std::shared_ptr<client>& c, std::string line)
  {
    if (c->queued_bytes + line.size() + 1 > queue_bytes) {
      ++c->dropped;
      dropped_count.fetch_add(1, std::memory_order_relaxed);
      return;
    }
    const bool idle = c->queue.empty();
    if (c->dropped != 0) {  // the gap is announced where it is
      c->queue.push_back(fmt::format(R"({{"dropped":{}}})"
                                     "\n",
                                     std::exchange(c->dropped, 0)));
      c->queued_bytes += c->queue.back().size();
    }
    line += '\n';
    c->queued_bytes += line.size();
    c->queue.push_back(std::move(line));
    if (idle) { write_front(c); }
  }

  void write_front(const std::shared_ptr<client>& c)
  {
    boost::asio::async_write(c->socket, boost::asio::buffer(c->queue.front()),
                             [self = shared_from_this(), c](const boost::system::error_code& error, std::size_t) {
                               if (error) {
                                 self->drop(c);
                                 return;
                               }
                               c->queued_bytes -= c->queue.front().size();
                               c->queue.pop_front();
                               if (!c->queue.empty()) {
                                 self->write_front(c);
                               } else if (self->closed) {
                                 self->drop(c);  // all written
                               }
                             });
  }

  void drop(const std::shared_ptr<client>& c)
  {
    if (clients.erase(c) == 0) { return; }
    if (!closed) { client_count.store(clients.size(), std::memory_order_relaxed); }
    boost::system::error_code ignored;
    c->socket.close(ignored);
    c->queue.clear();
    if (closed && clients.empty()) { finish(); }
  }

  void broadcast(const std::string& line)
  {
    backlog_bytes.fetch_sub(line.size(), std::memory_order_relaxed);
    const std::uint64_t lost = backlog_dropped.exchange(0, std::memory_order_relaxed);
    for (const auto& c : clients) {
      c->dropped += lost;
      enqueue(c, line);
    }
  }

  // Stops serving: no client is taken and no line published any more, and `done` runs once every
  // client has been written what it was sent (and told what it lost), or at longest_flush.
  void close(std::function<void()> done)
  {
    boost::system::error_code ignored;
    acceptor.close(ignored);
    retry.cancel();
    ::unlink(path.c_str());
    client_count.store(0, std::memory_order_relaxed);
    closed = std::move(done);
    for (const auto& c : std::vector(clients.begin(), clients.end())) {
      if (c->dropped != 0) {
        const bool idle = c->queue.empty();
        c->queue.push_back(fmt::format(R"({{"dropped":{}}})"
                                       "\n",
                                       std::exchange(c->dropped, 0)));
        if (idle) { write_front(c); }
      } else if (c->queue.empty()) {
        drop(c);
      }
    }
    if (clients.empty()) {
      finish();
      return;
    }
    flush_deadline.expires_after(longest_flush);
    flush_deadline.async_wait([self = shared_from_this()](const boost::system::error_code& waited) {
      if (waited) { return; }
      for (const auto& c : std::vector(self->clients.begin(), self->clients.end())) { self->drop(c); }
    });
  }

  void finish()
  {
    flush_deadline.cancel();
    if (auto done = std::exchange(closed, nullptr)) { done(); }
  }

  boost::asio::io_context& io;
  stream_protocol::acceptor acceptor;
  boost::asio::steady_timer retry;           // accepting again after a rest (the io thread's)
  boost::asio::steady_timer flush_deadline;  // a closing server's last writes (the io thread's)
  std::function<void()> closed;              // set while closing: what runs once every client is done
  std::chrono::milliseconds rest{0};
  std::size_t queue_bytes;
  std::size_t max_clients;
  bool refused_for_room{false};  // the io thread's
  std::filesystem::path path;
  std::set<std::shared_ptr<client>> clients;  // the io thread's
  std::atomic<std::size_t> client_count{0};
  std::atomic<std::uint64_t> refused_count{0};
  std::atomic<std::uint64_t> dropped_count{0};
  // Lines published and not yet taken by the io thread, bounded as a client's queue is: a server
  // that falls behind drops lines rather than grow (each client is told how many).
  std::atomic<std::size_t> backlog_bytes{0};
  std::atomic<std::uint64_t> backlog_dropped{0};
};

trace_socket::trace_socket(boost::asio::io_context& io, std::size_t queue_bytes, std::size_t max_clients)
    : server_(std::make_shared<server>(io, queue_bytes, max_clients))
{
  server_->open();
  boost::asio::post(io, [s = server_] { s->accept(); });
}

trace_socket::~trace_socket()
{
  if (server_->io.stopped()) {
    server_->close([] {});
    for (const auto& c : std::vector(server_->clients.begin(), server_->clients.end())) { server_->drop(c); }
    return;
  }
  auto closed = std::make_shared<std::promise<void>>();
  auto done = closed->get_future();
  boost::asio::post(server_->io, [s = server_, closed] { s->close([closed] { closed->set_value(); }); });
  // Bounded: a service thread that no longer runs (the process is exiting) must not hang the exit.
  if (done.wait_for(std::chrono::seconds(5)) != std::future_status::ready) { ::unlink(server_->path.c_str()); }
}

const std::filesystem::path& trace_socket::path() const noexcept
{
  return server_->path;
}

void trace_socket::publish(std::string line)
{
  if (!has_clients()) { return; }
  if (server_->backlog_bytes.fetch_add(line.size(), std::memory_order_relaxed) + line.size() > server_->queue_bytes) {
    server_->backlog_bytes.fetch_sub(line.size(), std::memory_order_relaxed);
    server_->backlog_dropped.fetch_add(1, std::memory_order_relaxed);
    server_->dropped_count.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  boost::asio::post(server_->io, [s = server_, line = std::move(line)] { s->broadcast(line); });
}

bool trace_socket::has_clients() const noexcept
{
  return server_->client_count.load(std::memory_order_relaxed) != 0;
}

std::size_t trace_socket::clients() const noexcept
{
  return server_->client_count.load(std::memory_order_relaxed);
}

std::uint64_t trace_socket::refused() const noexcept
{
  return server_->refused_count.load(std::memory_order_relaxed);
}

std::uint64_t trace_socket::dropped() const noexcept
{
  return server_->dropped_count.load(std::memory_order_relaxed);
}

}  // namespace handoff::detail
