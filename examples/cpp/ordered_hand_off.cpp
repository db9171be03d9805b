// A producer hands a device array to a consumer that works on another stream, through
// handoff::exchange: the consumer's stream waits for the producer's work without blocking the host.
// Runs on the simulated device (or on a GPU: ./ordered_hand_off cuda). Exits non-zero when the
// ordered read is wrong, or when the unordered read (the negative control) is not stale.
#include <handoff/backends.hpp>
#include <handoff/context.hpp>
#include <handoff/exchange.hpp>

#include <cstdint>
#include <cstdio>
#include <exception>
#include <future>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace {

using handoff::device::backend;
using handoff::device::stream_handle;

// Holds a stream's work until the program opens it (at the latest, when the gate is destroyed):
// the producer's "kernel" runs for as long as the program wants, whatever the machine's speed.
class gate {
 public:
  gate() = default;
  gate(const gate&) = delete;
  gate& operator=(const gate&) = delete;
  gate(gate&&) = delete;
  gate& operator=(gate&&) = delete;
  ~gate() { open(); }

  static void hold(void* self) { static_cast<gate*>(self)->opened_.get_future().wait(); }
  void open()
  {
    if (!is_open_) { opened_.set_value(); }
    is_open_ = true;
  }

 private:
  std::promise<void> opened_;
  bool is_open_{false};
};

// What a consumer working on its own stream reads of the array a producer is still writing, when it
// asks for it ordered (`__dlpack__(stream=<its stream>)`) or not (`stream=-1`).
int consumer_reads(handoff::context& context, handoff::exchange& exchange, backend& device, bool ordered)
{
  const stream_handle producer = device.create_stream(/*non_blocking=*/true);
  const stream_handle consumer = device.create_stream(/*non_blocking=*/true);
  const std::int64_t consumer_value =
    ordered ? handoff::stream_value_of(device.device_type(), handoff::device::raw(consumer)) : -1;

  // The producer allocates, and its stream writes 1 once the gate opens.
  auto* data = static_cast<std::int32_t*>(device.allocate(sizeof(std::int32_t), producer));
  static constexpr std::int32_t zero = 0;
  static constexpr std::int32_t one = 1;
  device.copy_async(data, &zero, sizeof zero, producer);
  device.synchronize_stream(producer);
  gate kernel;
  device.launch_host_func(producer, &gate::hold, &kernel);
  device.copy_async(data, &one, sizeof one, producer);

  std::int32_t read = -1;
  {
    // Its array: ready on the producer's stream, freed (in that stream's order) when released.
    handoff::array_layout layout;
    layout.data = data;
    layout.device = {device.device_type(), 0};
    layout.dtype = {kDLInt, 32, 1};
    layout.shape = std::vector<std::int64_t>{1};
    layout.strides = std::vector<std::int64_t>{1};
    const handoff::array array =
      exchange.view(layout, handoff::shared_producer{[&device, data, producer] { device.deallocate(data, producer); }},
                    handoff::named_stream::native(handoff::device::raw(producer), {}));

    // The consumer asks for it on its stream, and reads it there.
    const handoff::exported_tensor tensor =
      exchange.export_dlpack(array, {.stream = handoff::named_stream::dlpack(consumer_value)});
    device.copy_async(&read, tensor.legacy->dl_tensor.data, sizeof read, consumer);
    if (ordered) {
      // Ordered: the consumer's copy waits for the producer, and the host thread did not.
      std::printf("  consumer stream idle before the producer finished: %s\n",
                  device.query_stream(consumer) ? "yes (wrong)" : "no");
    } else {
      device.synchronize_stream(consumer);  // unordered: the copy ran while the producer was held
    }
    kernel.open();
    device.synchronize_stream(consumer);
    device.synchronize_stream(producer);
    tensor.legacy->deleter(tensor.legacy);
  }                 // the last reference: the producer is released once the consumer's work is done...
  context.drain();  // ...which the program waits for before it destroys the streams
  device.destroy_stream(consumer);
  device.destroy_stream(producer);
  return read;
}

}  // namespace

int main(int argc, char** argv)
{
  try {
    const std::string_view backend_name = argc > 1 ? argv[1] : "sim";
    const std::unique_ptr<backend> device = handoff::device::make_backend(backend_name);
    handoff::context context{*device, handoff::make_service_thread()};
    handoff::exchange exchange{context};

    std::printf("ordered hand-off on %s:\n", std::string(backend_name).c_str());
    const int ordered = consumer_reads(context, exchange, *device, /*ordered=*/true);
    std::printf("  the consumer read %d (expected 1)\n", ordered);
    std::printf("negative control, stream=-1 (the consumer asked for no ordering):\n");
    const int unordered = consumer_reads(context, exchange, *device, /*ordered=*/false);
    std::printf("  the consumer read %d (stale, as expected without ordering: 0)\n", unordered);
    return ordered == 1 && unordered == 0 ? 0 : 1;
  } catch (const std::exception& error) {
    std::fprintf(stderr, "ordered_hand_off: %s\n", error.what());
    return 2;
  }
}
