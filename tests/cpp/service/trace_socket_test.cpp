// The live trace socket: where it is made and with which modes, what a client receives, and a slow
// client that is dropped from rather than waited for.
#include "service/trace_socket.hpp"
#include "service/service_thread.hpp"

#include <gtest/gtest.h>

#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <future>
#include <optional>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

namespace {

using namespace handoff::detail;
namespace fs = std::filesystem;

// A connected client socket that reads lines with a timeout.
class line_client {
 public:
  explicit line_client(const fs::path& path) : fd_(::socket(AF_UNIX, SOCK_STREAM, 0))
  {
    sockaddr_un address{};
    address.sun_family = AF_UNIX;
    std::strncpy(address.sun_path, path.c_str(), sizeof(address.sun_path) - 1);
    timeval timeout{.tv_sec = 10, .tv_usec = 0};
    ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
    connected_ = ::connect(fd_, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0;
  }
  line_client(const line_client&) = delete;
  line_client& operator=(const line_client&) = delete;
  line_client(line_client&&) = delete;
  line_client& operator=(line_client&&) = delete;
  ~line_client() { ::close(fd_); }

  [[nodiscard]] bool connected() const { return connected_; }
  /// The next line without its newline; nullopt on timeout or end of stream.
  std::optional<std::string> line()
  {
    while (true) {
      if (const auto end = buffer_.find('\n'); end != std::string::npos) {
        std::string out = buffer_.substr(0, end);
        buffer_.erase(0, end + 1);
        return out;
      }
      char chunk[4096];
      const ssize_t n = ::recv(fd_, chunk, sizeof(chunk), 0);
      if (n <= 0) { return std::nullopt; }
      buffer_.append(chunk, static_cast<std::size_t>(n));
    }
  }
  void send(const std::string& bytes) { (void)::send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL); }

 private:
  int fd_;
  bool connected_{false};
  std::string buffer_;
};

// Reads `client`'s lines up to {"last":true} (published after the drops): whether a
// {"dropped":N} came among them.
bool told_of_drops(line_client& client)
{
  bool told = false;
  while (const auto line = client.line()) {
    if (line->rfind(R"({"dropped":)", 0) == 0) { told = true; }
    if (*line == R"({"last":true})") { break; }
  }
  return told;
}

class TraceSocketTest : public ::testing::Test {
 protected:
  void SetUp() override
  {
    root_ = fs::temp_directory_path() / ("handoff-trace-socket-test-" + std::to_string(::getpid()));
    fs::remove_all(root_);
    fs::create_directories(root_);
    if (const char* previous = std::getenv("XDG_RUNTIME_DIR")) { previous_ = previous; }
    ::setenv("XDG_RUNTIME_DIR", root_.c_str(), 1);  // NOLINT(concurrency-mt-unsafe): before any thread reads it
  }
  void TearDown() override
  {
    if (previous_) {
      ::setenv("XDG_RUNTIME_DIR", previous_->c_str(), 1);  // NOLINT(concurrency-mt-unsafe)
    } else {
      ::unsetenv("XDG_RUNTIME_DIR");  // NOLINT(concurrency-mt-unsafe)
    }
    fs::remove_all(root_);
  }

  // Waits until `done` holds, for at most 10 s.
  template <typename Predicate>
  static bool eventually(Predicate done)
  {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (!done()) {
      if (std::chrono::steady_clock::now() > deadline) { return false; }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return true;
  }

  fs::path root_;
  std::optional<std::string> previous_;
  service_thread service_;
};

TEST_F(TraceSocketTest, ThePathFollowsTheRuntimeDirectoryAndThePid)
{
  EXPECT_EQ(trace_socket_path(42), root_ / "handoff" / "trace-42.sock");
  ::setenv("XDG_RUNTIME_DIR", "", 1);  // NOLINT(concurrency-mt-unsafe)
  EXPECT_EQ(trace_socket_directory().filename(), "handoff-" + std::to_string(::geteuid()));
}

TEST_F(TraceSocketTest, OnlyItsUserCanEnterTheDirectoryAndOpenTheSocket)
{
  std::optional<trace_socket> socket{std::in_place, service_.io()};
  const fs::path path = socket->path();
  EXPECT_EQ(path, trace_socket_path(::getpid()));
  struct stat info {};
  ASSERT_EQ(::stat(path.parent_path().c_str(), &info), 0);
  EXPECT_EQ(info.st_mode & 0777, 0700U);
  ASSERT_EQ(::stat(path.c_str(), &info), 0);
  EXPECT_TRUE(S_ISSOCK(info.st_mode));
  EXPECT_EQ(info.st_mode & 0777, 0600U);
  socket.reset();
  EXPECT_FALSE(fs::exists(path)) << "the socket is removed when serving stops";
}

TEST_F(TraceSocketTest, ADirectoryOpenToOthersIsMadePrivateAndASymbolicLinkIsRefused)
{
  fs::create_directory(root_ / "handoff");
  fs::permissions(root_ / "handoff", fs::perms::all);
  {
    const trace_socket socket{service_.io()};
    EXPECT_EQ(fs::status(root_ / "handoff").permissions(), fs::perms::owner_all);
  }
  fs::remove_all(root_ / "handoff");
  fs::create_directory(root_ / "elsewhere");
  fs::create_directory_symlink(root_ / "elsewhere", root_ / "handoff");
  try {
    const trace_socket socket{service_.io()};
    FAIL() << "a symbolic link was trusted";
  } catch (const std::system_error& e) {
    EXPECT_NE(std::string{e.what()}.find("not a directory"), std::string::npos) << e.what();
  }
}

TEST_F(TraceSocketTest, AClientGetsTheHelloThenEveryPublishedLineInOrder)
{
  trace_socket socket{service_.io()};
  socket.publish(R"({"before":"any client"})");  // nobody listens: nothing is kept
  line_client client{socket.path()};
  ASSERT_TRUE(client.connected());
  const auto hello = client.line();
  ASSERT_TRUE(hello.has_value());
  EXPECT_NE(hello->find(R"("hello":"handoff")"), std::string::npos) << *hello;
  EXPECT_NE(hello->find(R"("pid":)" + std::to_string(::getpid())), std::string::npos) << *hello;
  for (int i = 0; i < 100; ++i) { socket.publish(R"({"n":)" + std::to_string(i) + "}"); }
  for (int i = 0; i < 100; ++i) { EXPECT_EQ(client.line(), R"({"n":)" + std::to_string(i) + "}"); }
  EXPECT_EQ(socket.dropped(), 0U);
}

TEST_F(TraceSocketTest, ASlowClientIsDroppedFromNotWaitedForAndToldHowMuch)
{
  trace_socket socket{service_.io(), /*queue_bytes=*/4096};
  line_client slow{socket.path()};
  ASSERT_TRUE(slow.connected());
  ASSERT_TRUE(slow.line().has_value());  // the hello: the client is admitted
  const std::string payload(200, 'x');
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < 20000; ++i) { socket.publish(R"({"p":")" + payload + R"("})"); }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5)) << "publish never waits for a client";
  ASSERT_TRUE(eventually([&] { return socket.dropped() > 0; }));
  service_.drain();
  socket.publish(R"({"last":true})");
  EXPECT_TRUE(told_of_drops(slow)) << "the client is told how many lines it missed";
}

TEST_F(TraceSocketTest, ClientsPastTheMostServedAreRefusedAndTheOthersStayServed)
{
  trace_socket socket{service_.io(), trace_socket::default_queue_bytes, /*max_clients=*/2};
  line_client first{socket.path()};
  line_client second{socket.path()};
  ASSERT_TRUE(first.line().has_value());
  ASSERT_TRUE(second.line().has_value());
  line_client third{socket.path()};
  const auto refusal = third.line();
  ASSERT_TRUE(refusal.has_value());
  EXPECT_NE(refusal->find("refused: 2 clients are attached already"), std::string::npos) << *refusal;
  EXPECT_EQ(third.line(), std::nullopt) << "then closed";
  EXPECT_EQ(socket.refused(), 1U);
  EXPECT_EQ(socket.clients(), 2U);
  socket.publish(R"({"n":1})");
  EXPECT_EQ(first.line(), R"({"n":1})");
  EXPECT_EQ(second.line(), R"({"n":1})");
}

TEST_F(TraceSocketTest, LinesTheServingThreadHasNotTakenYetAreBoundedToo)
{
  service_thread own;
  trace_socket socket{own.io(), /*queue_bytes=*/4096};
  line_client client{socket.path()};
  ASSERT_TRUE(client.line().has_value());
  std::promise<void> unblock;
  own.post([done = unblock.get_future().share()] { done.wait(); });  // the serving thread is busy
  const std::string payload(200, 'x');
  for (int i = 0; i < 1000; ++i) { socket.publish(R"({"p":")" + payload + R"("})"); }
  EXPECT_GT(socket.dropped(), 900U) << "what waits for the serving thread is bounded as a client's queue is";
  unblock.set_value();
  own.drain();
  socket.publish(R"({"last":true})");
  EXPECT_TRUE(told_of_drops(client)) << "the client is told how many lines it missed";
}

TEST_F(TraceSocketTest, GarbageAndAClientThatVanishesLeaveTheOthersServed)
{
  trace_socket socket{service_.io()};
  {
    line_client rude{socket.path()};
    ASSERT_TRUE(rude.connected());
    rude.send(std::string(1 << 20, '\xff'));  // one huge line of garbage
    ASSERT_TRUE(eventually([&] { return socket.clients() == 1; }));
    for (int i = 0; i < 1000; ++i) { socket.publish(R"({"n":1})"); }
  }  // gone mid-stream
  line_client polite{socket.path()};
  ASSERT_TRUE(polite.line().has_value());
  ASSERT_TRUE(eventually([&] { return socket.clients() == 1; }));
  socket.publish(R"({"still":"serving"})");
  EXPECT_EQ(polite.line(), R"({"still":"serving"})");
}

}  // namespace

namespace {

// With no file descriptor left, accepting fails (EMFILE) while a client waits in the backlog:
// accepting again at once spins a core; the socket rests, and serves the client once it can.
TEST_F(TraceSocketTest, AcceptingRestsWhileTheProcessHasNoFileDescriptorLeft)
{
#ifdef HANDOFF_TEST_SANITIZED
  GTEST_SKIP() << "a sanitizer's runtime needs file descriptors of its own (it reports false errors without)";
#endif
  const trace_socket socket{service_.io()};
  const int client = ::socket(AF_UNIX, SOCK_STREAM, 0);  // made while descriptors are left
  ASSERT_GE(client, 0);
  rlimit before{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &before), 0);
  rlimit tight = before;
  tight.rlim_cur = static_cast<rlim_t>(client) + 16;
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &tight), 0);
  std::vector<int> taken;  // every descriptor left below the limit
  for (int fd = ::dup(client); fd >= 0; fd = ::dup(client)) { taken.push_back(fd); }
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  std::strncpy(address.sun_path, socket.path().c_str(), sizeof(address.sun_path) - 1);
  ASSERT_EQ(::connect(client, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);  // now in the backlog
  rusage start{};
  ::getrusage(RUSAGE_SELF, &start);
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  rusage end{};
  ::getrusage(RUSAGE_SELF, &end);
  for (const int fd : taken) { ::close(fd); }
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &before), 0);
  const auto seconds = [](const timeval& t) {
    return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_usec) / 1e6;
  };
  const double busy = seconds(end.ru_utime) + seconds(end.ru_stime) - seconds(start.ru_utime) - seconds(start.ru_stime);
  EXPECT_LT(busy, 0.2) << "accepting spun while out of file descriptors";
  EXPECT_TRUE(eventually([&] { return socket.clients() == 1; })) << "the waiting client was never served";
  ::close(client);
}

}  // namespace
