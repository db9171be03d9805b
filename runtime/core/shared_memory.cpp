#include <handoff/internal/shared_memory.hpp>

#include "log/logger.hpp"

#include <fmt/format.h>

#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <system_error>
#include <utility>
#include <vector>

namespace handoff::detail {
namespace {

std::string path_of(std::string_view name)
{
  return fmt::format("{}/{}", shared_memory_dir(), name);
}

[[noreturn]] void throw_errno(int error, std::string_view what)
{
  throw std::system_error(error, std::generic_category(), std::string{what});
}

// Closes a descriptor on every path.
struct descriptor {
  int fd{-1};
  descriptor(const descriptor&) = delete;
  descriptor& operator=(const descriptor&) = delete;
  descriptor(descriptor&&) = delete;
  descriptor& operator=(descriptor&&) = delete;
  explicit descriptor(int value) noexcept : fd(value) {}
  ~descriptor()
  {
    if (fd >= 0) { ::close(fd); }
  }
};

constexpr std::string_view name_prefix = "handoff-";

}  // namespace

std::string shared_memory_dir()
{
  const char* dir = std::getenv("HANDOFF_IPC_DIR");
  return dir != nullptr && *dir != '\0' ? std::string{dir} : std::string{"/dev/shm"};
}

shared_mapping shared_mapping::create(std::string_view name, std::size_t bytes)
{
  const std::string path = path_of(name);
  constexpr int flags = O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW;
  int made = ::open(path.c_str(), flags, 0600);
  if (made < 0 && errno == EEXIST) {
    // This process never makes a name twice (each carries its pid and a serial it never repeats):
    // the file is a leftover of a killed process that had the same pid.
    ::unlink(path.c_str());
    made = ::open(path.c_str(), flags, 0600);
  }
  const descriptor file{made};
  if (file.fd < 0) { throw_errno(errno, fmt::format("cannot create shared memory {}", path)); }
  const auto fail = [&](std::string_view what) {
    const int error = errno;
    ::unlink(path.c_str());
    throw_errno(error, fmt::format("{} shared memory {} ({} bytes)", what, path, bytes));
  };
  if (::ftruncate(file.fd, static_cast<off_t>(bytes)) != 0) { fail("cannot size"); }
  void* data = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, file.fd, 0);
  if (data == MAP_FAILED) { fail("cannot map"); }
  return {std::string{name}, data, bytes, this_process()};
}

std::optional<shared_mapping> shared_mapping::open(std::string_view name)
{
  const std::string path = path_of(name);
  const descriptor file{::open(path.c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW)};
  if (file.fd < 0) {
    if (errno == ENOENT) { return std::nullopt; }
    throw_errno(errno, fmt::format("cannot open shared memory {}", path));
  }
  struct stat info {};
  if (::fstat(file.fd, &info) != 0) { throw_errno(errno, fmt::format("cannot read the size of {}", path)); }
  if (info.st_uid != ::geteuid()) {
    throw std::system_error(
      EPERM, std::generic_category(),
      fmt::format("shared memory {} belongs to uid {}, not this process's {}", path, info.st_uid, ::geteuid()));
  }
  const auto bytes = static_cast<std::size_t>(info.st_size);
  if (bytes == 0) { return std::nullopt; }  // made but not sized yet: as good as absent
  void* data = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, file.fd, 0);
  if (data == MAP_FAILED) { throw_errno(errno, fmt::format("cannot map shared memory {}", path)); }
  return shared_mapping{std::string{name}, data, bytes, 0};
}

shared_mapping::shared_mapping(shared_mapping&& other) noexcept
    : name_(std::move(other.name_)),
      data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      creator_(std::exchange(other.creator_, 0))
{}

shared_mapping& shared_mapping::operator=(shared_mapping&& other) noexcept
{
  if (this != &other) {
    reset();
    name_ = std::move(other.name_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    creator_ = std::exchange(other.creator_, 0);
  }
  return *this;
}

shared_mapping::~shared_mapping()
{
  reset();
}

void shared_mapping::unlink() noexcept
{
  if (creator_ == 0) { return; }
  if (std::exchange(creator_, 0) != this_process()) { return; }  // a forked child's copy
  try {
    ::unlink(path_of(name_).c_str());
  } catch (...) {}
}

void shared_mapping::reset() noexcept
{
  unlink();
  if (data_ != nullptr) { ::munmap(data_, size_); }
  data_ = nullptr;
  size_ = 0;
}

std::uint64_t next_shared_serial() noexcept
{
  static std::atomic<std::uint64_t> next{0};
  return ++next;
}

std::string shared_memory_name(std::string_view kind, std::uint64_t serial)
{
  return shared_memory_name(kind, this_process(), serial);
}

std::string shared_memory_name(std::string_view kind, int pid, std::uint64_t serial)
{
  return fmt::format("{}{}.{}.{}", name_prefix, kind, pid, serial);
}

void remove_leftovers() noexcept
try {
  static std::mutex mutex;
  static int swept_for = 0;  // the pid that swept: a forked child sweeps again
  std::lock_guard lock{mutex};
  if (swept_for == this_process()) { return; }
  swept_for = this_process();
  const std::string dir = shared_memory_dir();
  DIR* listing = ::opendir(dir.c_str());
  if (listing == nullptr) { return; }
  std::vector<std::string> gone;
  while (const dirent* entry = ::readdir(listing)) {
    const std::string_view name{entry->d_name};
    if (!name.starts_with(name_prefix)) { continue; }
    // handoff-<kind>.<pid>.<serial>
    const auto first = name.find('.');
    const auto second = first == std::string_view::npos ? first : name.find('.', first + 1);
    if (second == std::string_view::npos) { continue; }
    int pid = 0;
    const auto digits = name.substr(first + 1, second - first - 1);
    if (std::from_chars(digits.data(), digits.data() + digits.size(), pid).ec != std::errc{} || pid <= 0) { continue; }
    struct stat info {};
    const std::string path = fmt::format("{}/{}", dir, name);
    if (::lstat(path.c_str(), &info) != 0 || info.st_uid != ::geteuid()) { continue; }
    if (!process_start_time(pid)) { gone.push_back(path); }
  }
  ::closedir(listing);
  for (const auto& path : gone) {
    if (::unlink(path.c_str()) == 0) { HANDOFF_LOG_DEBUG("removed {}, left by a process that is gone", path); }
  }
} catch (...) {}

std::optional<std::uint64_t> process_start_time(int pid) noexcept
try {
  const descriptor file{::open(fmt::format("/proc/{}/stat", pid).c_str(), O_RDONLY | O_CLOEXEC)};
  if (file.fd < 0) { return std::nullopt; }
  std::array<char, 1024> buffer{};
  const ssize_t got = ::read(file.fd, buffer.data(), buffer.size() - 1);
  if (got <= 0) { return std::nullopt; }
  const std::string_view text{buffer.data(), static_cast<std::size_t>(got)};
  // The command name may hold spaces and parentheses: fields are counted after its last ')'.
  const auto close = text.rfind(')');
  if (close == std::string_view::npos || close + 2 >= text.size()) { return std::nullopt; }
  const char state = text[close + 2];
  if (state == 'Z' || state == 'X') { return std::nullopt; }  // exited, not yet reaped
  std::size_t at = close + 2;
  for (int field = 3; field < 22; ++field) {  // starttime is field 22
    at = text.find(' ', at);
    if (at == std::string_view::npos) { return std::nullopt; }
    ++at;
  }
  std::uint64_t start = 0;
  const auto end = text.find(' ', at);
  if (std::from_chars(text.data() + at, text.data() + (end == std::string_view::npos ? text.size() : end), start).ec !=
      std::errc{}) {
    return std::nullopt;
  }
  return start;
} catch (...) {
  return std::nullopt;
}

bool process_alive(int pid, std::uint64_t start_time) noexcept
{
  const auto started = process_start_time(pid);
  return started && *started == start_time;
}

int this_process() noexcept
{
  return static_cast<int>(::getpid());
}

std::uint64_t this_process_start_time() noexcept
{
  static std::atomic<int> cached_pid{0};
  static std::atomic<std::uint64_t> cached{0};
  const int pid = this_process();
  if (cached_pid.load(std::memory_order_acquire) != pid) {
    cached.store(process_start_time(pid).value_or(0), std::memory_order_relaxed);
    cached_pid.store(pid, std::memory_order_release);
  }
  return cached.load(std::memory_order_relaxed);
}

const std::array<std::byte, 16>& boot_id() noexcept
{
  static const std::array<std::byte, 16> id = [] {
    std::array<std::byte, 16> out{};
    std::FILE* file = std::fopen("/proc/sys/kernel/random/boot_id", "re");
    if (file == nullptr) { return out; }
    char text[64] = {};
    const bool read = std::fgets(text, sizeof text, file) != nullptr;
    std::fclose(file);
    if (!read) { return out; }
    std::size_t n = 0;
    for (const char* c = text; *c != '\0' && n < 32; ++c) {
      int digit = -1;
      if (*c >= '0' && *c <= '9') { digit = *c - '0'; }
      if (*c >= 'a' && *c <= 'f') { digit = *c - 'a' + 10; }
      if (digit < 0) { continue; }
      out[n / 2] |= static_cast<std::byte>(n % 2 == 0 ? digit << 4 : digit);
      ++n;
    }
    return out;
  }();
  return id;
}

std::array<std::byte, 16> random_token()
{
  std::array<std::byte, 16> token{};
  std::size_t filled = 0;
  while (filled < token.size()) {
    const ssize_t got = ::getrandom(token.data() + filled, token.size() - filled, 0);
    if (got < 0) {
      if (errno == EINTR) { continue; }
      throw_errno(errno, "getrandom");
    }
    filled += static_cast<std::size_t>(got);
  }
  return token;
}

}  // namespace handoff::detail
