// The simulated device across processes, as strict as CUDA: what may be shared and opened where,
// interprocess events and their flags, stream memory operations, and a second process that maps
// memory, waits for an event of this one and is refused what CUDA refuses. The other process is this
// test binary again (posix_spawn of /proc/self/exe), running SimIpcChild with its orders in the
// environment.
#include "device/sim/sim_backend.hpp"

#include <handoff/error.hpp>

#include <gtest/gtest.h>

#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

extern char** environ;  // NOLINT(readability-redundant-declaration): posix_spawn's environment

namespace handoff::device {
namespace {

using namespace std::chrono_literals;

std::string hex(const ipc_handle& handle)
{
  static constexpr char digits[] = "0123456789abcdef";
  std::string out;
  for (const auto b : handle.bytes) {
    out += digits[static_cast<unsigned>(b) >> 4U];
    out += digits[static_cast<unsigned>(b) & 0xFU];
  }
  return out;
}

ipc_handle unhex(const std::string& text)
{
  ipc_handle out;
  for (std::size_t i = 0; i < out.bytes.size() && 2 * i + 1 < text.size(); ++i) {
    out.bytes[i] = static_cast<std::byte>(std::stoi(text.substr(2 * i, 2), nullptr, 16));
  }
  return out;
}

// Runs SimIpcChild.Obeys in another process with `orders` in its environment; returns its exit status.
int run_child(const std::vector<std::string>& orders)
{
  std::vector<std::string> environment;
  for (char** e = environ; *e != nullptr; ++e) { environment.emplace_back(*e); }
  environment.insert(environment.end(), orders.begin(), orders.end());
  std::vector<char*> envp;
  envp.reserve(environment.size() + 1);
  for (auto& e : environment) { envp.push_back(e.data()); }
  envp.push_back(nullptr);
  std::string self = "/proc/self/exe";
  std::string filter = "--gtest_filter=SimIpcChild.Obeys";
  std::vector<char*> argv{self.data(), filter.data(), nullptr};
  pid_t child = 0;
  if (posix_spawn(&child, self.c_str(), nullptr, nullptr, argv.data(), envp.data()) != 0) { return -1; }
  int status = 0;
  waitpid(child, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// The threads of this process, other than the calling one, that take `signal` (do not block it), as
// Linux's /proc says.
int other_threads_taking(int signal)
{
  int taking = 0;
  const std::string self = std::to_string(gettid());
  for (const auto& task : std::filesystem::directory_iterator("/proc/self/task")) {
    if (task.path().filename() == self) { continue; }
    std::ifstream status(task.path() / "status");
    for (std::string line; std::getline(status, line);) {
      if (line.rfind("SigBlk:", 0) == 0) {
        const std::uint64_t blocked = std::stoull(line.substr(7), nullptr, 16);
        taking += static_cast<int>(((blocked >> static_cast<unsigned>(signal - 1)) & 1U) == 0);
      }
    }
  }
  return taking;
}

class SimIpcTest : public ::testing::Test {
 protected:
  sim_backend sim{2, sim_flavour::cuda};
  static constexpr std::size_t n = 64;

  float* filled(float value)
  {
    auto* p = static_cast<float*>(sim.allocate(n * sizeof(float), sim.legacy_default_stream()));
    sim.enqueue_fill(sim.legacy_default_stream(), p, n, value);
    sim.synchronize_device();
    return p;
  }
};

TEST_F(SimIpcTest, OpeningInTheProcessThatSharedIsRefused)
{
  float* p = filled(1.0F);
  const ipc_handle handle = sim.ipc_memory_handle(p);
  try {
    (void)sim.open_ipc_memory(handle);
    ADD_FAILURE() << "opened its own handle";
  } catch (const device_error& e) {
    EXPECT_EQ(e.error_name(), "cudaErrorDeviceUninitialized");
  }
  const event_handle event = sim.create_ipc_event();
  EXPECT_THROW((void)sim.open_ipc_event(sim.ipc_event_handle(event)), device_error);
  sim.destroy_event(event);
  sim.free_sync(p);
}

TEST_F(SimIpcTest, OnlyDeviceMemoryAtItsBaseIsShared)
{
  float* p = filled(1.0F);
  EXPECT_THROW((void)sim.ipc_memory_handle(p + 1), device_error);  // not the base: cudaIpcGetMemHandle refuses
  void* pinned = sim.allocate_pinned_host(64);
  EXPECT_THROW((void)sim.ipc_memory_handle(pinned), device_error);
  sim.free_sync(pinned);
  sim.free_sync(p);
}

TEST_F(SimIpcTest, InterprocessEventsNeedTheFlagsCudaRequires)
{
  try {
    (void)sim.create_event_with_flags(/*interprocess=*/true, /*disable_timing=*/false);
    ADD_FAILURE() << "an interprocess event with timing was made";
  } catch (const device_error& e) {
    EXPECT_EQ(e.error_name(), "cudaErrorInvalidValue");
  }
  const event_handle plain = sim.create_event();
  try {
    (void)sim.ipc_event_handle(plain);
    ADD_FAILURE() << "a plain event has no interprocess handle";
  } catch (const device_error& e) {
    EXPECT_EQ(e.error_name(), "cudaErrorInvalidResourceHandle");
  }
  sim.destroy_event(plain);
}

TEST_F(SimIpcTest, AStreamWaitsForAValueTheHostOrAnotherStreamWrites)
{
  alignas(8) static std::uint64_t flag = 0;
  flag = 0;
  void* address = sim.register_host_memory(&flag, sizeof flag);
  const stream_handle waiting = sim.create_stream(true);
  float* p = filled(0.0F);
  sim.stream_wait_value(waiting, address, 2);
  sim.enqueue_fill(waiting, p, n, 3.0F);
  const stream_handle writer = sim.create_stream(true);
  sim.stream_write_value(writer, address, 1);  // not enough
  sim.synchronize_stream(writer);
  EXPECT_FALSE(sim.query_stream(waiting));
  sim.stream_write_value(writer, address, 2);
  sim.synchronize_stream(waiting);
  float first = 0.0F;
  std::memcpy(&first, p, sizeof first);
  EXPECT_EQ(first, 3.0F);
  EXPECT_THROW(sim.stream_write_value(writer, &first, 1), device_error);  // memory the device does not reach
  sim.unregister_host_memory(&flag);
  sim.destroy_stream(waiting);
  sim.destroy_stream(writer);
  sim.free_sync(p);
}

TEST_F(SimIpcTest, TheWatchOfSharedWordsTakesNoSignalOfTheProgram)
{
  alignas(8) static std::uint64_t flag = 0;
  flag = 0;
  void* address = sim.register_host_memory(&flag, sizeof flag);
  const stream_handle waiting = sim.create_stream(true);
  sim.stream_wait_value(waiting, address, 1);  // watched by a thread of the simulator's, started now
  EXPECT_EQ(other_threads_taking(SIGTERM), 0) << "a thread of the simulator's takes the program's SIGTERM";
  const stream_handle writer = sim.create_stream(true);
  sim.stream_write_value(writer, address, 1);
  sim.synchronize_stream(waiting);
  sim.unregister_host_memory(&flag);
  sim.destroy_stream(waiting);
  sim.destroy_stream(writer);
}

TEST_F(SimIpcTest, AnotherProcessMapsTheMemoryAndWaitsForTheEvent)
{
  float* p = filled(0.0F);
  const stream_handle producer = sim.create_stream(true);
  const event_handle event = sim.create_ipc_event();
  sim_hold hold = sim.hold(producer);  // the producer's write waits until the child's stream waits for it
  sim.enqueue_fill(producer, p, n, 6.0F);
  sim.record_event(event, producer);
  int ready[2] = {-1, -1};
  ASSERT_EQ(pipe(ready), 0);
  int status = -1;
  std::thread child{[&] {
    status = run_child({"HANDOFF_SIM_IPC_ROLE=wait", "HANDOFF_SIM_IPC_MEMORY=" + hex(sim.ipc_memory_handle(p)),
                        "HANDOFF_SIM_IPC_EVENT=" + hex(sim.ipc_event_handle(event)),
                        "HANDOFF_SIM_IPC_READY_FD=" + std::to_string(ready[1])});
  }};
  char byte = 0;
  const bool told = read(ready[0], &byte, 1) == 1;  // the child's stream waits, its read queued behind
  hold.release();
  child.join();
  close(ready[0]);
  close(ready[1]);
  EXPECT_TRUE(told);
  EXPECT_EQ(status, 0);
  sim.destroy_event(event);
  sim.destroy_stream(producer);
  const ipc_handle stale = sim.ipc_memory_handle(p);
  sim.free_sync(p);
  EXPECT_EQ(run_child({"HANDOFF_SIM_IPC_ROLE=freed", "HANDOFF_SIM_IPC_MEMORY=" + hex(stale)}), 0);
}

// The other process's side. Exit status 0: every expectation held.
TEST(SimIpcChild, Obeys)
{
  const char* role = std::getenv("HANDOFF_SIM_IPC_ROLE");
  if (role == nullptr) { GTEST_SKIP() << "run by SimIpcTest in another process"; }
  sim_backend sim{2, sim_flavour::cuda};
  const ipc_handle memory = unhex(std::getenv("HANDOFF_SIM_IPC_MEMORY"));
  if (std::string{role} == "freed") {
    try {
      (void)sim.open_ipc_memory(memory);
      ADD_FAILURE() << "opened freed memory";
    } catch (const device_error& e) {
      EXPECT_EQ(e.error_name(), "cudaErrorMapBufferObjectFailed");
    }
    return;
  }
  sim.set_current_device(1);
  try {
    (void)sim.open_ipc_memory(memory);
    ADD_FAILURE() << "opened device 0's memory on device 1";
  } catch (const device_error& e) {
    EXPECT_EQ(e.error_name(), "cudaErrorPeerAccessUnsupported");
  }
  sim.set_current_device(0);
  auto* mapped = static_cast<float*>(sim.open_ipc_memory(memory));
  EXPECT_EQ(sim.open_ipc_memory(memory), mapped);  // CUDA 13: counted, the same address
  const event_handle event = sim.open_ipc_event(unhex(std::getenv("HANDOFF_SIM_IPC_EVENT")));
  const stream_handle consumer = sim.create_stream(true);
  sim.stream_wait_event(consumer, event);
  float seen = 0.0F;
  sim.copy_async(&seen, mapped, sizeof seen, consumer);
  EXPECT_FALSE(sim.query_stream(consumer));  // the producer's write is held in the other process
  const char byte = 1;
  EXPECT_EQ(write(std::atoi(std::getenv("HANDOFF_SIM_IPC_READY_FD")), &byte, 1), 1);
  sim.synchronize_stream(consumer);
  EXPECT_EQ(seen, 6.0F);
  sim.close_ipc_memory(mapped);
  sim.close_ipc_memory(mapped);
  sim.destroy_event(event);
  sim.destroy_stream(consumer);
  EXPECT_TRUE(sim.violations().empty());
}

}  // namespace
}  // namespace handoff::device
