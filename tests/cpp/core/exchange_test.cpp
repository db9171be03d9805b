// handoff::exchange's whole operations, each on the fixture's own context over every backend family,
// as a C++ application calls them: what each orders (with a negative control), keeps, copies and
// counts.
#include <handoff/array.hpp>
#include <handoff/context.hpp>
#include <handoff/embedding.hpp>
#include <handoff/error.hpp>
#include <handoff/exchange.hpp>
#include <handoff/stats.hpp>

#include "support/backend_fixture.hpp"

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace {

using namespace handoff;
using handoff::testing::BackendContextTest;

// exchange::import completes a view in place; these tests want the imported view back.
array imported(exchange& on, array view, const import_request& request, const producer_answer& answer)
{
  on.import(view, request, answer);
  return view;
}

class ExchangeTest : public BackendContextTest {
 protected:
  void SetUp() override
  {
    BackendContextTest::SetUp();
    if (IsSkipped()) { return; }
    exchange_.emplace(ctx());
  }

  exchange& ex() { return *exchange_; }

  named_stream named(device::stream_handle s) { return named_stream::native(static_cast<std::uint64_t>(s), nullptr); }
  // The DLPack stream value of `s` for data of the backend's device type.
  std::int64_t value_of(device::stream_handle s)
  {
    return stream_value_of(b().device_type(), static_cast<std::uint64_t>(s));
  }

  using counts_by_operation = std::map<std::string, std::size_t, std::less<>>;

  // The simulated device's calls, by operation, of `times` calls of `exchange` in steady state: on a
  // thread whose device is current (as a library's that has worked on it), after a first call that
  // makes the pool's event.
  template <class Exchange>
  counts_by_operation steady_calls(std::size_t times, Exchange&& exchange)
  {
    b().set_current_device(0);
    exchange();
    sim().count_calls(true);
    for (std::size_t i = 0; i < times; ++i) { exchange(); }
    sim().count_calls(false);
    return sim().call_counts();
  }

  // What `times` ordered exchanges of a view ask the device: the memory's owner (one lookup for the
  // wait and the binding), the thread's context (as the device guard and the event pool see it),
  // whether either stream captures into a graph, the producer stream's device, the record and the wait.
  static counts_by_operation ordered_exchange_calls(std::size_t times)
  {
    return {{"attributes", times},    {"current_device", 2 * times},
            {"record_event", times},  {"stream_capture_status", 2 * times},
            {"stream_device", times}, {"stream_wait_event", times}};
  }

  // A view of n floats on device 0 set to 1 by work on `producer` (pending while the test holds
  // it), recorded as ready there; `released` counts its producer's release.
  array written_on(device::stream_handle producer, std::atomic<int>* released = nullptr)
  {
    float* data = allocate_on(0);
    array view = device_view(data, 0, [released] {
      if (released != nullptr) { ++*released; }
    });
    fill(producer, data, 1.0F);
    mark_ready(view, producer);
    return view;
  }

  float first(const array& view, device::stream_handle on)
  {
    return read(static_cast<const float*>(view.data()), on).front();
  }

  // What `on` reads first of `view` once the producer's hold `held` ends; the read must wait for it.
  float first_after(handoff::testing::test_hold& held, const array& view, device::stream_handle on)
  {
    return read_after(held, static_cast<const float*>(view.data()), on).front();
  }

  static producer_answer honest(DLDevice claimed)
  {
    return {.name = "producer", .claimed = claimed, .honoured_arguments = true, .ordered_for_consumer = true};
  }
  static import_request onto(named_stream consumer)
  {
    return {.consumer = std::move(consumer), .device = std::nullopt, .copy = std::nullopt};
  }

  std::optional<exchange> exchange_;
};

// A producer's table as a test scripts it.
struct scripted_table final : table_producer {
  bool conjugated{false};
  bool answers{true};
  std::optional<std::int64_t> work_stream;
  int asked_conjugation{0};

  bool lazily_conjugated() override
  {
    ++asked_conjugation;
    return conjugated;
  }
  bool current_work_stream(DLDevice /*device*/, std::optional<std::int64_t>& stream) noexcept override
  {
    stream = work_stream;
    return answers;
  }
};

// --- imports -------------------------------------------------------------------------------------

TEST_P(ExchangeTest, AnImportKeepsItsProducerUntilTheConsumersWorkIsDoneAndIsCounted)
{
  const auto consumer = stream_on(0);
  std::atomic<int> released{0};
  const std::uint64_t imports = stats().imports;
  {
    const auto consumer_works = hold(consumer);  // the consumer's work on the data, until the hold ends
    {
      const array view = imported(ex(), device_view(allocate_on(0), 0, [&] { ++released; }), onto(named(consumer)),
                                  honest({b().device_type(), 0}));
      ASSERT_TRUE(view.owner().ready_on().has_value());
      EXPECT_EQ(view.owner().ready_on()->stream, consumer);
    }
    EXPECT_EQ(stats().imports - imports, 1U) << "a C++ caller's import is counted";
    EXPECT_EQ(released.load(), 0) << "released while the consumer's stream still reads the data";
  }
  ASSERT_TRUE(ctx().drain_for(std::chrono::seconds{10}));
  EXPECT_EQ(released.load(), 1);
}

TEST_P(ExchangeTest, NegativeControlAnUnorderedImportReleasesItsProducerAtOnce)
{
  const auto consumer = stream_on(0);
  std::atomic<int> released{0};
  {
    const auto consumer_works = hold(consumer);
    {
      const array view = imported(ex(), device_view(allocate_on(0), 0, [&] { ++released; }),
                                  onto(named_stream::dlpack(-1)), honest({b().device_type(), 0}));
      EXPECT_FALSE(view.owner().ready_on().has_value());
    }
    EXPECT_EQ(released.load(), 1);
  }
  b().synchronize_device();
}

TEST_P(ExchangeTest, AnImportOfDataOnAnotherDeviceThanClaimedIsRefused)
{
  const array view = device_view(allocate_on(0), 0);
  EXPECT_THROW((void)imported(ex(), view, onto({}), honest({b().device_type(), 1})), value_error);
  EXPECT_THROW((void)imported(ex(), view, onto({}), honest({kDLCPU, 0})), value_error);
  // A producer that hid its device is not checked: its data is bound where it is.
  const array hidden =
    imported(ex(), view, onto({}),
             {.name = "producer", .claimed = {}, .honoured_arguments = false, .ordered_for_consumer = false});
  EXPECT_EQ(hidden.owner().ready_on()->stream, b().legacy_default_stream());
}

TEST_P(ExchangeTest, AnImportCopiesOnlyWhatTheProducerDidNot)
{
  const auto producer = stream_on(0);
  auto producer_works = hold(producer);
  const array view = written_on(producer);
  import_request copy = onto(named(producer));
  copy.copy = true;
  const array copied = imported(
    ex(), view, copy,
    {.name = "producer", .claimed = view.device(), .honoured_arguments = false, .ordered_for_consumer = false});
  EXPECT_NE(copied.data(), view.data());
  EXPECT_EQ(first_after(producer_works, copied, producer), 1.0F);
  const array honoured = imported(ex(), view, copy, honest(view.device()));
  EXPECT_EQ(honoured.data(), view.data()) << "the producer copied already";
}

TEST_P(ExchangeTest, ATableImportOrdersTheConsumerAfterTheProducersWorkStream)
{
  const auto producer = stream_on(0);
  const auto consumer = stream_on(0);
  auto producer_works = hold(producer);
  const array view = written_on(producer);
  scripted_table table;
  table.work_stream = value_of(producer);
  const auto made = ex().import_from_table(export_versioned(view), named(consumer), table);
  ASSERT_TRUE(made.has_value());
  EXPECT_EQ(made->owner().ready_on()->stream, consumer);
  EXPECT_EQ(first_after(producer_works, *made, consumer), 1.0F);
  EXPECT_EQ(table.asked_conjugation, 0) << "only complex data can be lazily conjugated";
}

TEST_P(ExchangeTest, AnOrderedTableImportAsksWhetherTheConsumerCapturesOnce)
{
  HANDOFF_REQUIRE_SIM("counts the runtime calls of each import");
  const auto producer = stream_on(0);
  const auto consumer = stream_on(0);
  const array source = written_on(producer);
  scripted_table table;
  table.work_stream = value_of(producer);
  std::vector<array> kept;  // no release meanwhile: it would take an event of the pool
  const auto import = [&] {
    auto made = ex().import_from_table(export_versioned(source), named(consumer), table);
    ASSERT_TRUE(made.has_value());
    kept.push_back(std::move(*made));
  };
  // The wait asks whether either stream captures; binding the view to the consumer (kept for a
  // graph's life where it captures) takes the consumer's answer from it, not from the device again.
  EXPECT_EQ(steady_calls(1, import), ordered_exchange_calls(1));
  kept.clear();
  EXPECT_TRUE(ctx().drain_for(std::chrono::seconds{10}));
}

TEST_P(ExchangeTest, NegativeControlATableThatNamesTheDefaultStreamLeavesTheProducersStreamUnordered)
{
  const auto producer = stream_on(0);  // non-blocking: the default stream does not wait for it
  const auto consumer = stream_on(0);
  {
    const auto producer_works = hold(producer);
    const array view = written_on(producer);
    scripted_table table;  // says the work is on the default stream
    const auto made = ex().import_from_table(export_versioned(view), named(consumer), table);
    ASSERT_TRUE(made.has_value());
    EXPECT_EQ(first(*made, consumer), 0.0F);
  }
  b().synchronize_device();
}

TEST_P(ExchangeTest, ATableImportDefersToDunderDlpackForALazilyConjugatedTensorOrAProducerWithoutAnAnswer)
{
  std::atomic<int> released{0};
  {
    array_layout layout = device_view(allocate_on(0), 0).layout();
    layout.dtype = {kDLComplex, 64, 1};
    layout.shape = std::vector<std::int64_t>{static_cast<std::int64_t>(n / 2)};
    const array complex{std::move(layout), shared_producer{[&] { ++released; }}};
    scripted_table conjugated;
    conjugated.conjugated = true;
    EXPECT_FALSE(ex().import_from_table(export_versioned(complex), {}, conjugated).has_value());
    EXPECT_EQ(conjugated.asked_conjugation, 1);
    scripted_table silent;
    silent.answers = false;
    EXPECT_FALSE(ex().import_from_table(export_versioned(complex), {}, silent).has_value());
  }
  EXPECT_EQ(released.load(), 1) << "each tensor's deleter ran once";
}

// An exchange runs the deleters of what it imports with the embedding's hooks it was made with (an
// exchange over a context: that context's); the fixture's, made without, runs them as they are.
std::atomic<int> deleters_in_hooks{0};

TEST_P(ExchangeTest, AnExchangeRunsItsImportsDeletersWithItsEmbeddingsDeleterRunner)
{
  const embedding counting{.run_deleter = [](void (*invoke)(void*) noexcept, void* tensor) noexcept {
    ++deleters_in_hooks;
    invoke(tensor);
  }};
  deleters_in_hooks = 0;
  context embedded{b(), make_service_thread(), counting};
  exchange hooked{embedded};
  struct foreign_tensor {
    std::array<std::int64_t, 1> shape{4};
    int deleted{0};
    DLManagedTensorVersioned managed{};
  } foreign;
  float* data = allocate_on(0);
  const auto import_foreign = [&](exchange& through) {
    foreign.managed = {};
    foreign.managed.version = {DLPACK_MAJOR_VERSION, DLPACK_MINOR_VERSION};
    foreign.managed.manager_ctx = &foreign;
    foreign.managed.deleter = [](DLManagedTensorVersioned* self) {
      ++static_cast<foreign_tensor*>(self->manager_ctx)->deleted;
    };
    foreign.managed.dl_tensor = {.data = data,
                                 .device = {b().device_type(), 0},
                                 .ndim = 1,
                                 .dtype = {kDLFloat, 32, 1},
                                 .shape = foreign.shape.data(),
                                 .strides = nullptr,
                                 .byte_offset = 0};
    scripted_table table;
    EXPECT_TRUE(through.import_from_table(&foreign.managed, named(stream_on(0)), table).has_value());
    through.device_context()->drain();  // the release waits for the consumer stream's work
  };

  import_foreign(hooked);
  EXPECT_EQ(foreign.deleted, 1);
  EXPECT_EQ(deleters_in_hooks.load(), 1) << "the producer's deleter ran outside the exchange's deleter runner";

  import_foreign(ex());
  EXPECT_EQ(foreign.deleted, 2);
  EXPECT_EQ(deleters_in_hooks.load(), 1) << "an exchange made without hooks ran another's";
}

TEST_P(ExchangeTest, AnInterfaceImportWaitsForTheInterfacesStream)
{
  const auto producer = stream_on(0);
  const auto consumer = stream_on(0);
  auto producer_works = hold(producer);
  const array view = written_on(producer);
  const auto imported = [&](std::optional<std::int64_t> stream) {
    cuda_interface interface {
      .layout = view.layout(), .stream = stream
    };
    interface.layout.device = {};
    return ex().import_interface(std::move(interface), view.owner(), onto(named(consumer)));
  };
  // The interface numbers streams as CUDA does on every platform: a handle is itself.
  EXPECT_EQ(first_after(producer_works, imported(static_cast<std::int64_t>(producer)), consumer), 1.0F);
  b().synchronize_device();
  {
    const auto rewriting = hold(producer);
    fill(producer, static_cast<float*>(view.data()), 2.0F);
    // Negative control: an interface without a stream promises the data is ready already.
    EXPECT_EQ(first(imported(std::nullopt), consumer), 1.0F);
  }
  b().synchronize_device();
}

TEST_P(ExchangeTest, AHostImportCopiesWhenAskedAndIsCounted)
{
  const array host = allocate_host_array({kDLFloat, 32, 1}, std::array<std::int64_t, 1>{4});
  const std::uint64_t imports = stats().imports;
  import_request copy = onto({});
  copy.copy = true;
  EXPECT_NE(ex().import_host(host, copy).data(), host.data());
  EXPECT_EQ(ex().import_host(host, onto({})).data(), host.data());
  EXPECT_EQ(stats().imports - imports, 2U);
}

TEST_P(ExchangeTest, ASharedViewKeepsOneRootProducerAndIsOrderedForItsConsumer)
{
  const auto producer = stream_on(0);
  const auto consumer = stream_on(0);
  std::atomic<int> released{0};
  {
    auto producer_works = hold(producer);
    std::optional<array> view{written_on(producer, &released)};
    const array shared = ex().share(*view, named(consumer));
    EXPECT_EQ(shared.owner().id(), view->owner().id()) << "the same buffer in the ownership graph";
    EXPECT_EQ(shared.owner().ready_on()->stream, consumer);
    EXPECT_EQ(first_after(producer_works, shared, consumer), 1.0F);
    view.reset();
    EXPECT_EQ(released.load(), 0) << "the shared view keeps the root producer";
  }
  // The release waits for the consumer's stream: it must run before `released` goes out of scope.
  ASSERT_TRUE(ctx().drain_for(std::chrono::seconds{10}));
  EXPECT_EQ(released.load(), 1);
}

TEST_P(ExchangeTest, AdoptedDataIsReadyOnItsWorkStreamAndReleasedAfterIt)
{
  const auto work = stream_on(0);
  std::atomic<int> released{0};
  {
    const auto working = hold(work);
    {
      const array adopted = ex().adopt(device_view(allocate_on(0), 0, [&] { ++released; }), named(work));
      EXPECT_EQ(adopted.owner().ready_on()->stream, work);
    }
    EXPECT_EQ(released.load(), 0);
  }
  ASSERT_TRUE(ctx().drain_for(std::chrono::seconds{10}));
  EXPECT_EQ(released.load(), 1);
}

// Every import passes one door, whatever its protocol and whether or not it is ordered: the bytes
// a view reaches are checked against their allocation, and data of the other device family is refused.
TEST_P(ExchangeTest, EveryImportIsCheckedAgainstItsAllocationAndItsDeviceFamily)
{
  std::atomic<int> released{0};
  const auto described = [&](std::int64_t elements, DLDeviceType type) {
    array_layout layout = device_view(allocate_on(0), 0).layout();
    layout.shape = std::vector<std::int64_t>{elements};
    layout.device.device_type = type;
    return array{std::move(layout), shared_producer{[&] { ++released; }}};
  };
  const auto past_the_end = [&] { return described(static_cast<std::int64_t>(n) * 4096, b().device_type()); };
  const auto other_family = [&] { return described(1, b().device_type() == kDLCUDA ? kDLROCM : kDLCUDA); };
  const named_stream unordered = named_stream::dlpack(-1);
  for (const named_stream& consumer : {named_stream{}, unordered}) {
    EXPECT_THROW((void)imported(ex(), past_the_end(), onto(consumer), honest(past_the_end().device())), value_error);
    EXPECT_THROW((void)imported(ex(), other_family(), onto(consumer), honest(other_family().device())), device_error);
    scripted_table table;
    EXPECT_THROW((void)ex().import_from_table(export_versioned(past_the_end()), consumer, table), value_error);
    EXPECT_THROW((void)ex().import_from_table(export_versioned(other_family()), consumer, table), device_error);
    cuda_interface interface {
      .layout = past_the_end().layout(), .stream = std::nullopt
    };
    EXPECT_THROW((void)ex().import_interface(std::move(interface), shared_producer{[] {}}, onto(consumer)),
                 value_error);
  }
  EXPECT_THROW((void)ex().adopt(past_the_end(), {}), value_error);
  EXPECT_THROW((void)ex().adopt(other_family(), {}), device_error);
  EXPECT_NO_THROW((void)imported(ex(), described(static_cast<std::int64_t>(n), b().device_type()), onto(unordered),
                                 honest({b().device_type(), 0})))
    << "the allocation's own extent";
  ASSERT_TRUE(ctx().drain_for(std::chrono::seconds{10}));
  EXPECT_EQ(released.load(), 17) << "each refused import's producer was released once";
}

// --- a library's own memory ----------------------------------------------------------------------

TEST_P(ExchangeTest, AViewIsCheckedAgainstItsDeviceAndRecordsItsReadyStream)
{
  const auto producer = stream_on(0);
  array_layout layout = device_view(allocate_on(0), 0).layout();
  const array view = ex().view(layout, shared_producer{[] {}}, named(producer));
  EXPECT_EQ(view.owner().ready_on()->stream, producer);
  EXPECT_FALSE(ex().view(layout, shared_producer{[] {}}).owner().ready_on().has_value()) << "unknown by default";
  layout.device.device_id = 1;  // the memory belongs to device 0
  EXPECT_THROW((void)ex().view(layout, shared_producer{[] {}}), value_error);
}

// Memory a library describes itself has no producer's tensor vouching for its device and dtype: the
// view checks them, and each refused view's owner is released once.
TEST_P(ExchangeTest, AViewOfADeviceOrDtypeDLPackDoesNotDefineIsRefused)
{
  std::array<float, 4> data{};
  array_layout host;
  host.data = data.data();
  host.device = {kDLCPU, 0};
  host.dtype = {kDLFloat, 32, 1};
  host.shape = std::vector<std::int64_t>{4};
  host.strides = std::vector<std::int64_t>{1};
  std::atomic<int> released{0};
  const auto refused = [&](array_layout layout) {
    try {
      (void)ex().view(std::move(layout), shared_producer{[&released] { ++released; }});
    } catch (const value_error& e) {
      return std::string{"value_error: "} + e.what();
    } catch (const buffer_error& e) {
      return std::string{"buffer_error: "} + e.what();
    }
    return std::string{"taken"};
  };
  array_layout layout = host;
  layout.device = {static_cast<DLDeviceType>(99), 0};
  EXPECT_EQ(refused(layout), "value_error: device (99, 0) is not a DLPack device: DLPack defines no such device type");
  for (const DLDeviceType type : {kDLCPU, b().device_type()}) {
    layout = host;
    layout.device = {type, -7};
    EXPECT_EQ(refused(layout), "value_error: device (" + std::to_string(static_cast<int>(type)) +
                                 ", -7) is not a DLPack device: its id is negative");
  }
  layout = host;
  layout.device = {kDLCPU, 3};
  EXPECT_EQ(refused(layout), "value_error: device (1, 3) is not a DLPack device: the CPU is device 0");
  layout = host;
  layout.dtype = {kDLFloat, 24, 1};
  EXPECT_EQ(refused(layout), "buffer_error: unsupported DLPack dtype (code 2, bits 24, lanes 1)");
  layout.dtype = {kDLInt, 12, 1};
  EXPECT_EQ(refused(layout), "buffer_error: unsupported DLPack dtype (code 0, bits 12, lanes 1)");
  EXPECT_EQ(released.load(), 6) << "each refused view's owner, once";
  EXPECT_NO_THROW((void)ex().view(host, shared_producer{[] {}}));
}

TEST_P(ExchangeTest, AnAllocationIsReadyOnItsStreamOnTheDeviceAskedFor)
{
  const auto stream = stream_on(0);
  std::array<std::int64_t, 2> shape{4, 8};
  DLTensor prototype{.data = nullptr,
                     .device = {b().device_type(), 0},
                     .ndim = 2,
                     .dtype = {kDLFloat, 32, 1},
                     .shape = shape.data(),
                     .strides = nullptr,
                     .byte_offset = 0};
  const array made = ex().allocate(prototype, named(stream));
  EXPECT_EQ(made.device().device_type, b().device_type());
  EXPECT_EQ(made.owner().ready_on()->stream, stream);
  EXPECT_EQ(b().attributes(made.data()).kind, device::memory_kind::device);
  prototype.device = {kDLCPU, 0};
  EXPECT_EQ(ex().allocate(prototype, {}).device().device_type, kDLCPU);
  prototype.device = {b().device_type() == kDLCUDA ? kDLROCM : kDLCUDA, 0};
  EXPECT_THROW((void)ex().allocate(prototype, {}), buffer_error);
  prototype.ndim = -1;
  EXPECT_THROW((void)ex().allocate(prototype, {}), value_error);
}

// --- exports -------------------------------------------------------------------------------------

TEST_P(ExchangeTest, AnExportOrdersTheConsumerAfterTheProducerStampsTheVersionAndIsCounted)
{
  const auto producer = stream_on(0);
  const auto consumer = stream_on(0);
  auto producer_works = hold(producer);
  const array view = written_on(producer);
  const std::uint64_t exports = stats().exports;
  export_request request;
  request.stream = named_stream::dlpack(value_of(consumer));
  request.max_version = DLPackVersion{1, 0};
  const exported_tensor made = ex().export_dlpack(view, request);
  ASSERT_NE(made.versioned, nullptr);
  EXPECT_EQ(made.versioned->version.minor, 0U) << "the consumer's older minor";
  EXPECT_EQ(first_after(producer_works, view, consumer), 1.0F);
  made.versioned->deleter(made.versioned);
  request.max_version = std::nullopt;
  const exported_tensor legacy = ex().export_dlpack(view, request);
  ASSERT_NE(legacy.legacy, nullptr);
  legacy.legacy->deleter(legacy.legacy);
  EXPECT_EQ(stats().exports - exports, 2U);
}

TEST_P(ExchangeTest, NegativeControlAnExportForStreamMinusOneLeavesTheConsumerUnordered)
{
  const auto producer = stream_on(0);
  const auto consumer = stream_on(0);
  {
    const auto producer_works = hold(producer);
    const array view = written_on(producer);
    export_request request;
    request.stream = named_stream::dlpack(-1);
    request.max_version = DLPackVersion{1, 0};
    const exported_tensor made = ex().export_dlpack(view, request);
    EXPECT_EQ(first(view, consumer), 0.0F);
    made.versioned->deleter(made.versioned);
  }
  b().synchronize_device();
}

// stream=None names the device's default stream (CUDA's legacy one, ROCm's null one), not "no
// stream": an export asked for no stream, legacy or versioned, orders that stream after the
// producer's work. The export for stream -1 above is its negative control.
TEST_P(ExchangeTest, AnExportForNoStreamOrdersTheDefaultStreamAfterTheProducer)
{
  const auto producer = stream_on(0);
  for (const std::optional<DLPackVersion> version :
       {std::optional<DLPackVersion>{}, std::optional{DLPackVersion{1, 1}}}) {
    auto producer_works = hold(producer);
    const array view = written_on(producer);
    export_request request;  // stream None
    request.max_version = version;
    const exported_tensor made = ex().export_dlpack(view, request);
    EXPECT_EQ(first_after(producer_works, view, b().legacy_default_stream()), 1.0F)
      << (version ? "versioned" : "legacy") << " export: the default stream read before the producer wrote";
    if (made.versioned != nullptr) { made.versioned->deleter(made.versioned); }
    if (made.legacy != nullptr) { made.legacy->deleter(made.legacy); }
  }
}

// Eight float32 of host memory, as the exchange allocates them.
array host_floats(exchange& on)
{
  std::array<std::int64_t, 1> shape{8};
  const DLTensor prototype{.data = nullptr,
                           .device = {kDLCPU, 0},
                           .ndim = 1,
                           .dtype = {kDLFloat, 32, 1},
                           .shape = shape.data(),
                           .strides = nullptr,
                           .byte_offset = 0};
  return on.allocate(prototype, {});
}

// Host data has no streams: its exports take stream None alone, and every stream the consumer names
// is refused, before a tensor is made, as a DLPack value or as a library's stream object.
TEST_P(ExchangeTest, AHostExportTakesNoStreamButNone)
{
  const array host = host_floats(ex());
  const std::uint64_t exports = stats().exports;
  for (const std::int64_t value : {-1, 0, 1, 2, 3}) {
    export_request request;
    request.stream = named_stream::dlpack(value);
    EXPECT_THROW((void)ex().export_dlpack(host, request), value_error) << "stream=" << value;
  }
  export_request request;
  request.stream = named(stream_on(0));
  EXPECT_THROW((void)ex().export_dlpack(host, request), value_error) << "a stream object";
  EXPECT_EQ(stats().exports, exports) << "a refused export made no tensor";
  const exported_tensor made = ex().export_dlpack(host, {});
  ASSERT_NE(made.legacy, nullptr);
  EXPECT_EQ(made.legacy->dl_tensor.data, host.data());
  made.legacy->deleter(made.legacy);
}

// The C exchange API's hand-over and loan refuse what export_dlpack refuses of host data.
TEST_P(ExchangeTest, AHostHandOverOrLoanTakesNoStreamButNone)
{
  const array host = host_floats(ex());
  const std::uint64_t exports = stats().exports;
  std::vector<named_stream> streams{named(stream_on(0))};
  for (const std::int64_t value : {-1, 0, 1, 2, 3}) { streams.push_back(named_stream::dlpack(value)); }
  for (const named_stream& stream : streams) {
    EXPECT_THROW((void)ex().hand_over(host, stream), value_error) << "stream=" << stream.value;
    EXPECT_THROW(ex().lend(host, stream), value_error) << "stream=" << stream.value;
  }
  EXPECT_EQ(stats().exports, exports) << "a refused hand-over made no tensor";
  DLManagedTensorVersioned* tensor = ex().hand_over(host, {});
  EXPECT_EQ(tensor->dl_tensor.data, host.data());
  tensor->deleter(tensor);
  EXPECT_NO_THROW(ex().lend(host, {}));
  EXPECT_EQ(stats().exports, exports + 2);
}

// Pinned memory whose producer says so but whose capsule describes host memory (PyTorch's pinned
// tensors): the consumer stream is checked in the pinned device's numbering, as it is for a capsule
// that says pinned memory, though host data binds to no stream.
TEST_P(ExchangeTest, AConsumerStreamForPinnedMemoryACapsuleCallsHostMemoryIsCheckedAsThePinnedDevices)
{
  const DLDeviceType pinned = b().device_type() == kDLROCM ? kDLROCMHost : kDLCUDAHost;
  const producer_answer answer{.name = "Pinned",
                               .claimed = DLDevice{pinned, 0},
                               .honoured_arguments = true,
                               .ordered_for_consumer = false,
                               .ordered_for_default_stream = true};
  const auto on_stream = [](std::int64_t value) {
    return import_request{.consumer = named_stream::dlpack(value), .device = {}, .copy = {}};
  };
  // Values the pinned device's numbering refuses (the stream table): 0 on CUDA, 1 and 2 on ROCm.
  const std::vector<std::int64_t> refused =
    pinned == kDLCUDAHost ? std::vector<std::int64_t>{0, -2} : std::vector<std::int64_t>{1, 2, -2};
  for (const std::int64_t value : refused) {
    array view = host_floats(ex());
    EXPECT_THROW(ex().import(view, on_stream(value), answer), value_error) << "stream=" << value;
  }
  for (const std::int64_t value : {-1, 3}) {
    array view = host_floats(ex());
    EXPECT_NO_THROW(ex().import(view, on_stream(value), answer)) << "stream=" << value;
    EXPECT_EQ(view.device().device_type, kDLCPU);
  }
  array view = host_floats(ex());
  EXPECT_NO_THROW(ex().import(view, {}, answer)) << "no stream";
}

TEST_P(ExchangeTest, AnExportsReleaseWaitsForABareConsumerHandleOnlyWhereThisExchangesPolicySaysSo)
{
  const auto consumer = stream_on(0);
  // Released at once (the consumer's held work notwithstanding) or only once that work is done.
  const auto released_at_once = [&](exchange& on) {
    std::atomic<int> released{0};
    int at_once = 0;
    {
      const auto consumer_works = hold(consumer);
      std::optional<array> view{written_on(stream_on(0), &released)};
      export_request request;
      request.stream = named_stream::dlpack(value_of(consumer));  // a bare handle: nothing keeps the stream alive
      request.max_version = DLPackVersion{1, 0};
      const exported_tensor made = on.export_dlpack(*view, request);
      view.reset();
      made.versioned->deleter(made.versioned);
      at_once = released.load();
    }
    EXPECT_TRUE(ctx().drain_for(std::chrono::seconds{10}));
    EXPECT_EQ(released.load(), 1);
    return at_once == 1;
  };
  exchange vouching{ctx()};
  EXPECT_EQ(vouching.set_export_release(export_release::every_stream), export_release::known_streams);
  EXPECT_EQ(vouching.export_release_policy(), export_release::every_stream);
  EXPECT_FALSE(released_at_once(vouching)) << "the application vouched for its streams: the release waits";
  // Negative control: another exchange keeps the default, and a bare handle is never touched.
  EXPECT_EQ(ex().export_release_policy(), export_release::known_streams);
  EXPECT_TRUE(released_at_once(ex())) << "a bare handle may be destroyed by the release: it is not waited for";
}

TEST_P(ExchangeTest, AnExportCopyIsFlaggedAndAStreamTheDeviceDoesNotTakeIsRefused)
{
  const auto producer = stream_on(0);
  const array view = written_on(producer);
  export_request request;
  request.max_version = DLPackVersion{1, 1};
  request.copy = true;
  const exported_tensor made = ex().export_dlpack(view, request);
  EXPECT_NE(made.versioned->dl_tensor.data, view.data());
  EXPECT_NE(made.versioned->flags & DLPACK_FLAG_BITMASK_IS_COPIED, 0U);
  made.versioned->deleter(made.versioned);
  request.copy = std::nullopt;
  request.stream = named_stream::dlpack(b().device_type() == kDLCUDA ? 0 : 1);  // invalid for either family
  EXPECT_THROW((void)ex().export_dlpack(view, request), value_error);
}

TEST_P(ExchangeTest, AHandOverKeepsTheProducerUntilTheConsumersWorkByTheDeletionIsDone)
{
  const auto producer = stream_on(0);
  const auto consumer = stream_on(0);
  std::atomic<int> released{0};
  {
    auto producer_works = hold(producer);
    std::optional<array> view{written_on(producer, &released)};
    DLManagedTensorVersioned* tensor = ex().hand_over(*view, named(consumer));
    EXPECT_EQ(first_after(producer_works, *view, consumer), 1.0F);
    const auto consumer_works = hold(consumer);  // the consumer's work by the deletion, until the hold ends
    tensor->deleter(tensor);
    view.reset();
    EXPECT_EQ(released.load(), 0);
  }
  ASSERT_TRUE(ctx().drain_for(std::chrono::seconds{10}));
  EXPECT_EQ(released.load(), 1);
}

TEST_P(ExchangeTest, AnOrderedHandOverAsksTheDeviceOnceForWhatItCannotKnow)
{
  HANDOFF_REQUIRE_SIM("counts the runtime calls of each hand-over");
  const auto producer = stream_on(0);
  const auto consumer = stream_on(0);
  const array view = written_on(producer);  // alive throughout: no release is counted
  const auto counted = steady_calls(3, [&] {
    DLManagedTensorVersioned* tensor = ex().hand_over(view, named(consumer));
    tensor->deleter(tensor);
  });
  EXPECT_EQ(counted, ordered_exchange_calls(3)) << "one admission for the wait and the release";
  b().synchronize_device();
}

TEST_P(ExchangeTest, AnOrderedShareAsksTheDeviceWhatAHandOverAsks)
{
  HANDOFF_REQUIRE_SIM("counts the runtime calls of each share");
  const auto producer = stream_on(0);
  const auto consumer = stream_on(0);
  const array source = written_on(producer);
  std::vector<array> shared;  // alive until the count is read: no release is counted
  const auto counted = steady_calls(3, [&] { shared.push_back(ex().share(source, named(consumer))); });
  // A share of handoff's own array looked the owner up twice and asked the capture a third time.
  EXPECT_EQ(counted, ordered_exchange_calls(3)) << "one admission, and the capture state the wait found";
  shared.clear();
  b().synchronize_device();
}

TEST_P(ExchangeTest, ALentViewOrdersItsBorrowerAndIsCounted)
{
  const auto producer = stream_on(0);
  const auto consumer = stream_on(0);
  auto producer_works = hold(producer);
  const array view = written_on(producer);
  const std::uint64_t exports = stats().exports;
  ex().lend(view, named(consumer));
  EXPECT_EQ(first_after(producer_works, view, consumer), 1.0F);
  EXPECT_EQ(stats().exports - exports, 1U);
}

TEST_P(ExchangeTest, TheInterfaceStreamNamesTheStreamTheDataIsReadyOn)
{
  const auto producer = stream_on(0);
  const array view = written_on(producer);
  EXPECT_EQ(ex().interface_stream(view), value_of(producer));
  EXPECT_EQ(ex().interface_stream(device_view(allocate_on(0), 0)), std::nullopt);
  b().synchronize_device();
}

INSTANTIATE_TEST_SUITE_P(Backends, ExchangeTest, handoff::testing::every_family(),
                         handoff::testing::backend_choice_name);

// --- without a device context --------------------------------------------------------------------

array cuda_described()
{
  static float data[4]{};
  array_layout layout;
  layout.data = data;
  layout.device = {kDLCUDA, 0};
  layout.dtype = {kDLFloat, 32, 1};
  layout.shape = std::vector<std::int64_t>{4};
  layout.strides = std::vector<std::int64_t>{1};
  return array{std::move(layout), shared_producer{[] {}}};
}

TEST(AbsentBackendTest, CudaDataThatNeedsOrderingIsRefusedWhereNothingCanOrderIt)
{
  exchange refusing{absent_backend{.setting = "HANDOFF_BACKEND=auto",
                                   .error_name = "cudaErrorInsufficientDriver",
                                   .reason = "no driver",
                                   .refuses_unordered = true}};
  const producer_answer answer{
    .name = "producer", .claimed = {}, .honoured_arguments = true, .ordered_for_consumer = false};
  try {
    (void)imported(refusing, cuda_described(), {.consumer = {}, .device = {}, .copy = {}}, answer);
    FAIL() << "imported unordered";
  } catch (const device_error& e) {
    EXPECT_EQ(e.error_name(), "cudaErrorInsufficientDriver");
    EXPECT_NE(std::string{e.what()}.find("HANDOFF_BACKEND=auto"), std::string::npos) << e.what();
  }
  // stream=-1: the consumer orders its work itself.
  EXPECT_NO_THROW((void)imported(refusing, cuda_described(),
                                 {.consumer = named_stream::dlpack(-1), .device = {}, .copy = {}}, answer));
  // Negative control: an application that asked for no backend exchanges device data as it comes.
  exchange unordered{
    absent_backend{.setting = "HANDOFF_BACKEND=none", .error_name = {}, .reason = {}, .refuses_unordered = false}};
  EXPECT_NO_THROW((void)imported(unordered, cuda_described(), {.consumer = {}, .device = {}, .copy = {}}, answer));
  try {
    (void)unordered.require_device("copying device memory");
    FAIL() << "a device context appeared";
  } catch (const device_error& e) {
    EXPECT_EQ(e.error_name(), "handoffErrorNoBackend");
    EXPECT_NE(std::string{e.what()}.find("HANDOFF_BACKEND=none"), std::string::npos) << e.what();
  }
}

// A context source that counts how often it is asked.
struct counting_source final : context_source {
  absent_backend none;
  int asked{0};
  context* device_context() override
  {
    ++asked;
    return nullptr;
  }
  const absent_backend& absent() override { return none; }
};

// A context source whose backend cannot be used (it failed to start, or the process is a forked child).
struct failing_source final : context_source {
  absent_backend none;
  context* device_context() override
  {
    throw device_error("cuda", "cudaErrorInitializationError", "the backend failed to start");
  }
  const absent_backend& absent() override { return none; }
};

TEST(ContextSourceTest, AHandOverForStreamMinusOneNeedsNoUsableBackendAndAnOrderedOneSaysWhyItHasNone)
{
  failing_source source;
  exchange failing{source};
  // The consumer orders its work itself: nothing to order, as an export for stream=-1.
  DLManagedTensorVersioned* tensor = failing.hand_over(cuda_described(), named_stream::dlpack(-1));
  tensor->deleter(tensor);
  failing.lend(cuda_described(), named_stream::dlpack(-1));
  try {
    (void)failing.hand_over(cuda_described(), named_stream::dlpack(2));
    FAIL() << "handed over unordered";
  } catch (const device_error& e) {
    EXPECT_EQ(e.error_name(), "cudaErrorInitializationError");
  }
  // With no backend at all (an application that asked for none), an ordered hand-over is refused too.
  exchange unordered{
    absent_backend{.setting = "HANDOFF_BACKEND=none", .error_name = {}, .reason = {}, .refuses_unordered = false}};
  EXPECT_THROW((void)unordered.hand_over(cuda_described(), named_stream::dlpack(2)), device_error);
}

TEST(ContextSourceTest, AShareForStreamMinusOneNeedsNoUsableBackendAndAnOrderedOneSaysWhyItHasNone)
{
  failing_source source;
  exchange failing{source};
  const array shared = failing.share(cuda_described(), named_stream::dlpack(-1));  // as a hand-over for -1
  EXPECT_EQ(shared.data(), cuda_described().data());
  try {
    (void)failing.share(cuda_described(), named_stream::dlpack(2));
    FAIL() << "shared unordered";
  } catch (const device_error& e) {
    EXPECT_EQ(e.error_name(), "cudaErrorInitializationError");
  }
}

TEST(ContextSourceTest, HostExchangesNeverAskForTheDeviceContext)
{
  counting_source source;
  exchange lazy{source};
  const array host = allocate_host_array({kDLFloat, 32, 1}, std::array<std::int64_t, 1>{4});
  (void)lazy.import_host(host, {.consumer = {}, .device = {}, .copy = {}});
  (void)lazy.share(host, {});
  export_request request;
  request.max_version = DLPackVersion{1, 1};
  DLManagedTensorVersioned* tensor = lazy.export_dlpack(host, request).versioned;
  tensor->deleter(tensor);
  EXPECT_EQ(source.asked, 0);
  (void)imported(lazy, cuda_described(), {.consumer = {}, .device = {}, .copy = {}},
                 {.name = "producer", .claimed = {}, .honoured_arguments = true, .ordered_for_consumer = false});
  EXPECT_GT(source.asked, 0) << "device data asks for it";
}

}  // namespace
