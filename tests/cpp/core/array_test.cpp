// Import, export and lifetimes of handoff::array: every deleter runs exactly once on every path.
#include <handoff/array.hpp>
#include <handoff/dtype.hpp>
#include <handoff/embedding.hpp>
#include <handoff/error.hpp>
#include <handoff/stats.hpp>

#include <gtest/gtest.h>

#include <array>
#include <atomic>
#include <memory>
#include <numeric>
#include <optional>
#include <span>
#include <thread>
#include <vector>

namespace {

using namespace handoff;

// A producer-side tensor that counts its deleter calls.
struct fake_producer {
  std::vector<float> storage;
  std::vector<std::int64_t> shape;
  std::vector<std::int64_t> strides;
  int deleted = 0;
  DLManagedTensorVersioned versioned{};
  DLManagedTensor legacy{};

  explicit fake_producer(std::vector<std::int64_t> dims) : shape(std::move(dims))
  {
    std::int64_t n = 1;
    for (auto d : shape) { n *= d; }
    storage.resize(static_cast<std::size_t>(n));
    std::iota(storage.begin(), storage.end(), 0.0F);
    const extents contiguous = contiguous_strides(shape);
    strides.assign(contiguous.begin(), contiguous.end());
    DLTensor t{};
    t.data = storage.data();
    t.device = {kDLCPU, 0};
    t.ndim = static_cast<std::int32_t>(shape.size());
    t.dtype = {kDLFloat, 32, 1};
    t.shape = shape.data();
    t.strides = strides.data();
    versioned.version = {1, 1};
    versioned.manager_ctx = this;
    versioned.deleter = [](DLManagedTensorVersioned* self) {
      ++static_cast<fake_producer*>(self->manager_ctx)->deleted;
    };
    versioned.dl_tensor = t;
    legacy.manager_ctx = this;
    legacy.deleter = [](DLManagedTensor* self) { ++static_cast<fake_producer*>(self->manager_ctx)->deleted; };
    legacy.dl_tensor = t;
  }
};

class ArrayTest : public ::testing::Test {
 protected:
  void SetUp() override { live_before_ = stats().live_views; }
  void TearDown() override { EXPECT_EQ(stats().live_views, live_before_) << "a producer leaked"; }

 private:
  std::int64_t live_before_ = 0;
};

TEST_F(ArrayTest, ImportKeepsProducerUntilLastViewIsGone)
{
  fake_producer p{{2, 3}};
  {
    array view = import_dlpack(&p.versioned);
    EXPECT_EQ(view.data(), p.storage.data());
    EXPECT_EQ(view.size(), 6);
    EXPECT_EQ(view.nbytes(), 24);
    EXPECT_FALSE(view.readonly());
    array copy = view;
    {
      array moved = std::move(view);
    }
    EXPECT_EQ(p.deleted, 0);
  }
  EXPECT_EQ(p.deleted, 1);
}

int runner_calls = 0;
bool runner_runs_deleters = true;

TEST_F(ArrayTest, ADeleterRunnerGivenToTheImportRunsItsDeleter)
{
  const deleter_runner counting = [](void (*invoke)(void*) noexcept, void* tensor) noexcept {
    ++runner_calls;
    if (runner_runs_deleters) { invoke(tensor); }
  };
  fake_producer p{{4}};
  {
    array view = import_dlpack(&p.versioned, counting);
  }
  {
    array view = import_dlpack(&p.legacy, counting);
  }
  EXPECT_EQ(runner_calls, 2);
  EXPECT_EQ(p.deleted, 2);
  runner_runs_deleters = false;  // an embedding runtime may keep a deleter unrun (at interpreter exit)
  {
    array view = import_dlpack(&p.versioned, counting);
  }
  EXPECT_EQ(runner_calls, 3);
  EXPECT_EQ(p.deleted, 2);
  {
    array view = import_dlpack(&p.versioned);  // no runner: the deleter runs as it is
  }
  EXPECT_EQ(runner_calls, 3);
  EXPECT_EQ(p.deleted, 3);
}

TEST_F(ArrayTest, ExportedTensorPinsTheProducer)
{
  fake_producer p{{4}};
  DLManagedTensorVersioned* out = nullptr;
  {
    array view = import_dlpack(&p.versioned);
    out = export_versioned(view);
  }
  EXPECT_EQ(p.deleted, 0);
  ASSERT_NE(out->dl_tensor.strides, nullptr);
  EXPECT_EQ(out->dl_tensor.strides[0], 1);
  EXPECT_EQ(out->version.major, 1U);
  out->deleter(out);
  EXPECT_EQ(p.deleted, 1);
}

TEST_F(ArrayTest, ZeroDimensionalExportHasNonNullStrides)
{
  fake_producer p{{}};
  array view = import_dlpack(&p.versioned);
  EXPECT_EQ(view.ndim(), 0);
  EXPECT_EQ(view.size(), 1);
  DLManagedTensorVersioned* out = export_versioned(view);
  EXPECT_NE(out->dl_tensor.strides, nullptr);
  EXPECT_NE(out->dl_tensor.shape, nullptr);
  out->deleter(out);
}

TEST_F(ArrayTest, NullStridesMeanRowMajor)
{
  fake_producer p{{2, 3, 4}};
  p.versioned.dl_tensor.strides = nullptr;
  array view = import_dlpack(&p.versioned);
  EXPECT_EQ(std::vector<std::int64_t>(view.strides().begin(), view.strides().end()),
            (std::vector<std::int64_t>{12, 4, 1}));
}

TEST_F(ArrayTest, ByteOffsetIsFoldedIntoData)
{
  fake_producer p{{3}};
  p.versioned.dl_tensor.shape[0] = 2;
  p.versioned.dl_tensor.byte_offset = 4;
  array view = import_dlpack(&p.versioned);
  EXPECT_EQ(view.data(), p.storage.data() + 1);
}

TEST_F(ArrayTest, ReadOnlyFlagIsKeptAndRefusedToLegacyConsumers)
{
  fake_producer p{{3}};
  p.versioned.flags = DLPACK_FLAG_BITMASK_READ_ONLY;
  array view = import_dlpack(&p.versioned);
  EXPECT_TRUE(view.readonly());
  EXPECT_THROW((void)export_legacy(view), buffer_error);
  DLManagedTensorVersioned* out = export_versioned(view);
  EXPECT_EQ(out->flags & DLPACK_FLAG_BITMASK_READ_ONLY, DLPACK_FLAG_BITMASK_READ_ONLY);
  out->deleter(out);
}

TEST_F(ArrayTest, FailedImportsRunTheDeleterExactlyOnce)
{
  {
    fake_producer p{{3}};
    p.versioned.version = {2, 0};
    EXPECT_THROW((void)import_dlpack(&p.versioned), buffer_error);
    EXPECT_EQ(p.deleted, 1);
  }
  {
    fake_producer p{{3}};
    p.versioned.dl_tensor.dtype = {kDLFloat, 32, 4};
    EXPECT_THROW((void)import_dlpack(&p.versioned), buffer_error);
    EXPECT_EQ(p.deleted, 1);
  }
  {
    fake_producer p{{3}};
    p.versioned.dl_tensor.shape[0] = -3;
    EXPECT_THROW((void)import_dlpack(&p.versioned), value_error);
    EXPECT_EQ(p.deleted, 1);
  }
  {
    fake_producer p{{3}};
    p.versioned.dl_tensor.ndim = -1;
    EXPECT_THROW((void)import_dlpack(&p.versioned), value_error);
    EXPECT_EQ(p.deleted, 1);
  }
  {
    fake_producer p{{3}};
    p.versioned.dl_tensor.data = nullptr;
    EXPECT_THROW((void)import_dlpack(&p.versioned), value_error);
    EXPECT_EQ(p.deleted, 1);
  }
  {
    fake_producer p{{3}};
    p.legacy.dl_tensor.dtype = *dtype_from_name("float4_e2m1fn");
    EXPECT_THROW((void)import_dlpack(&p.legacy), buffer_error);
    EXPECT_EQ(p.deleted, 1);
  }
  {
    fake_producer p{{3}};
    p.versioned.dl_tensor.dtype = *dtype_from_name("float4_e2m1fn");  // packed: refused
    EXPECT_THROW((void)import_dlpack(&p.versioned), buffer_error);
    EXPECT_EQ(p.deleted, 1);
  }
}

TEST_F(ArrayTest, OverflowingShapeIsRefused)
{
  fake_producer p{{2, 2}};
  p.versioned.dl_tensor.shape[0] = INT64_MAX / 2;
  p.versioned.dl_tensor.shape[1] = 4;
  EXPECT_THROW((void)import_dlpack(&p.versioned), value_error);
  EXPECT_EQ(p.deleted, 1);
}

TEST_F(ArrayTest, OverflowingShapeWithNullStridesIsRefused)
{
  // Found by tests/fuzz/dlpack_fuzz: the row-major strides of this shape overflowed (undefined
  // behaviour) before the shape was refused.
  fake_producer p{{2, 2}};
  p.versioned.dl_tensor.shape[0] = INT64_MAX;
  p.versioned.dl_tensor.shape[1] = INT64_MAX;
  p.versioned.dl_tensor.strides = nullptr;
  EXPECT_THROW((void)import_dlpack(&p.versioned), value_error);
  EXPECT_EQ(p.deleted, 1);
  EXPECT_EQ(contiguous_strides(std::vector<std::int64_t>{std::int64_t{1} << 62, 4, 2})[2], 1);
}

TEST_F(ArrayTest, StridesWhoseByteOffsetsOverflowAreRefused)
{
  // Found by tests/fuzz/interface_fuzz: the last element's byte offset, 2 * 2^61 * 4, overflowed
  // int64 in every consumer that computes addresses (copy_to_host among them).
  fake_producer p{{3, 2}};
  p.versioned.dl_tensor.strides[0] = std::int64_t{1} << 61;
  EXPECT_THROW((void)import_dlpack(&p.versioned), value_error);
  EXPECT_EQ(p.deleted, 1);
  fake_producer empty{{0, 2}};
  empty.versioned.dl_tensor.strides[0] = INT64_MAX;  // no element: no offset to compute
  EXPECT_EQ(import_dlpack(&empty.versioned).size(), 0);
}

// validate_layout accepts the common layout in one pass and leaves every refusal to its checks in
// their order: each layout here is refused with the first check's message, as before that pass.
TEST(ValidateLayout, EachRefusalNamesTheFirstCheckThatFails)
{
  const auto refusal = [](const std::vector<std::int64_t>& shape, const std::vector<std::int64_t>& strides, void* data,
                          DLDataType dtype = {kDLFloat, 32, 1}) -> std::string {
    array_layout layout;
    layout.data = data;
    layout.dtype = dtype;
    layout.shape = shape;
    layout.strides = strides;
    try {
      validate_layout(layout);
    } catch (const error& e) {
      return e.what();
    }
    return "accepted";
  };
  float storage[4] = {};
  constexpr std::int64_t big = std::int64_t{1} << 62;
  EXPECT_EQ(refusal({2, 2}, {2, 1}, storage), "accepted");
  EXPECT_EQ(refusal({}, {}, storage), "accepted");                  // 0-d: one element
  EXPECT_EQ(refusal({0, 2}, {INT64_MAX, 1}, nullptr), "accepted");  // empty: no data, no offsets
  EXPECT_EQ(refusal({2, 2}, {-2, 1}, storage + 2), "accepted");     // negative strides
  EXPECT_NE(refusal({2, 2}, {1}, storage).find("strides has 1 entries but shape has 2"), std::string::npos);
  EXPECT_NE(refusal({2}, {1}, storage, {kDLFloat, 32, 2}).find("unsupported dtype"), std::string::npos);
  EXPECT_NE(refusal({2, -1}, {1, 1}, storage).find("shape[1] is negative"), std::string::npos);
  // The element count overflows before the empty axis is reached: refused, as the checks go in order.
  EXPECT_NE(refusal({big, 4, 0}, {1, 1, 1}, storage).find("element count does not fit"), std::string::npos);
  EXPECT_NE(refusal({big / 2}, {1}, storage).find("size in bytes does not fit"), std::string::npos);
  EXPECT_NE(refusal({2}, {1}, nullptr).find("data is a null pointer"), std::string::npos);
  EXPECT_NE(refusal({2, 2}, {INT64_MIN / 2, 1}, storage).find("strides (-4611686018427387904, 1"), std::string::npos);
  EXPECT_NE(refusal({3}, {big}, storage).find("overflow"), std::string::npos);
}

TEST_F(ArrayTest, ByteOffsetIsAddedAsAnAddress)
{
  // Found by tests/fuzz/dlpack_fuzz: a byte_offset that wraps the address space was pointer
  // arithmetic with undefined behaviour (caught by the UBSan run of this test).
  fake_producer p{{1}};
  p.versioned.dl_tensor.byte_offset = UINT64_MAX - 3;  // four bytes before the data
  const array view = import_dlpack(&p.versioned);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(view.data()), reinterpret_cast<std::uintptr_t>(p.storage.data()) - 4);
}

TEST_F(ArrayTest, EmptyArraysMayHaveNullData)
{
  fake_producer p{{0, 5}};
  p.versioned.dl_tensor.data = nullptr;
  array view = import_dlpack(&p.versioned);
  EXPECT_EQ(view.size(), 0);
  EXPECT_TRUE(view.is_c_contiguous());
}

TEST_F(ArrayTest, CopyToHostHandlesNegativeAndZeroStrides)
{
  fake_producer p{{2, 3}};  // 0 1 2 / 3 4 5
  std::array<std::int64_t, 2> reversed{-3, -1};
  p.versioned.dl_tensor.strides = reversed.data();
  p.versioned.dl_tensor.data = p.storage.data() + 5;
  array view = import_dlpack(&p.versioned);
  EXPECT_FALSE(view.is_c_contiguous());
  array copy = copy_to_host(view);
  const auto* values = static_cast<const float*>(copy.data());
  EXPECT_EQ(std::vector<float>(values, values + 6), (std::vector<float>{5, 4, 3, 2, 1, 0}));

  fake_producer q{{3}};
  std::array<std::int64_t, 2> shape{2, 3};
  std::array<std::int64_t, 2> broadcast{0, 1};
  q.versioned.dl_tensor.ndim = 2;
  q.versioned.dl_tensor.shape = shape.data();
  q.versioned.dl_tensor.strides = broadcast.data();
  array row = import_dlpack(&q.versioned);
  array rows = copy_to_host(row);
  const auto* r = static_cast<const float*>(rows.data());
  EXPECT_EQ(std::vector<float>(r, r + 6), (std::vector<float>{0, 1, 2, 0, 1, 2}));
}

TEST_F(ArrayTest, LiveViewsCountsProducers)
{
  const auto before = stats().live_views;
  fake_producer p{{3}};
  {
    array view = import_dlpack(&p.versioned);
    const std::vector<array> copies(3, view);  // copies share the producer
    EXPECT_EQ(stats().live_views, before + 1);
  }
  EXPECT_EQ(stats().live_views, before);
}

}  // namespace

namespace {

// Each release drops the last reference of the producer before it, as a view owned by the view before
// it does: destroyed recursively, 200,000 deep, that overflows the stack.
TEST_F(ArrayTest, ALongChainOfProducersIsReleasedIteratively)
{
  std::atomic<int> released{0};
  shared_producer chain{[&released]() noexcept { ++released; }};
  for (int i = 0; i < 200'000; ++i) {
    chain = shared_producer{[inner = std::move(chain), &released]() noexcept { ++released; }};
  }
  chain = shared_producer{};
  EXPECT_EQ(released.load(), 200'001);
}

TEST_F(ArrayTest, DerivedProducersShareTheirRootAndKeepItAlive)
{
  std::atomic<int> released{0};
  std::optional<shared_producer> root{shared_producer{[&released]() noexcept { ++released; }}};
  shared_producer derived = root->derived();
  for (int i = 0; i < 1000; ++i) { derived = derived.derived(); }  // each derives from the root, not the last
  EXPECT_EQ(derived.id(), root->id()) << "one buffer in the ownership graph";
  EXPECT_EQ(root->use_count(), 2) << "a chain of derived producers keeps one reference to the root";
  EXPECT_FALSE(derived.ready_on().has_value()) << "bindings of its own, none yet";
  root.reset();
  EXPECT_EQ(released.load(), 0);
  derived = shared_producer{};
  EXPECT_EQ(released.load(), 1);
}

// A thread keeps the blocks of the producer states it frees for its next ones: states made on one
// thread and freed on another, and states freed while a thread exits (after its blocks went back),
// are each released once and leave nothing live.
TEST_F(ArrayTest, ProducersFreedOnOtherAndExitingThreadsAreEachReleasedOnce)
{
  constexpr int per_thread = 100;
  const auto live_before = stats().live_views;
  std::atomic<int> released{0};
  const auto make = [&released] { return shared_producer{[&released]() noexcept { ++released; }}; };
  std::vector<shared_producer> made_here;
  made_here.reserve(per_thread);
  for (int i = 0; i < per_thread; ++i) { made_here.push_back(make()); }
  std::thread other{[&] {
    struct released_at_exit {
      std::optional<shared_producer> kept;
      released_at_exit() = default;
      released_at_exit(const released_at_exit&) = delete;
      released_at_exit& operator=(const released_at_exit&) = delete;
      released_at_exit(released_at_exit&&) = delete;
      released_at_exit& operator=(released_at_exit&&) = delete;
      ~released_at_exit() { kept.reset(); }
    };
    // Made before the thread's first free, so destroyed after its blocks are given back.
    thread_local released_at_exit at_exit;
    made_here.clear();  // freed on this thread, into its blocks
    for (int i = 0; i < per_thread; ++i) { (void)make(); }
    at_exit.kept = make();
  }};
  other.join();
  EXPECT_EQ(released.load(), 2 * per_thread + 1);
  EXPECT_EQ(stats().live_views, live_before);
}

// Exports of the usual ranks take kept blocks too, those of more dimensions the allocator's: tensors
// of every rank, each deleted on another thread than the one that made it, describe their data
// until deleted and release their producer once.
TEST_F(ArrayTest, ExportsOfEveryRankDeletedOnAnotherThreadReleaseTheirProducerOnce)
{
  std::vector<std::unique_ptr<fake_producer>> producers;
  std::vector<DLManagedTensorVersioned*> versioned;
  std::vector<DLManagedTensor*> legacy;
  for (std::int64_t rank = 0; rank <= 6; ++rank) {
    producers.push_back(std::make_unique<fake_producer>(std::vector<std::int64_t>(static_cast<std::size_t>(rank), 2)));
    const array view = import_dlpack(&producers.back()->versioned);
    versioned.push_back(export_versioned(view));
    legacy.push_back(export_legacy(view));
  }
  std::thread other{[&] {
    for (std::size_t i = 0; i < versioned.size(); ++i) {
      EXPECT_EQ(versioned[i]->dl_tensor.ndim, static_cast<std::int32_t>(i));
      EXPECT_EQ(producers[i]->deleted, 0) << "rank " << i << ": released while exported";
      versioned[i]->deleter(versioned[i]);
      EXPECT_EQ(producers[i]->deleted, 0) << "rank " << i << ": the legacy export still holds it";
      legacy[i]->deleter(legacy[i]);
      EXPECT_EQ(producers[i]->deleted, 1) << "rank " << i;
    }
  }};
  other.join();
}

// Shapes and strides are copied a value at a time for the usual ranks and in bulk beyond them: each
// axis keeps its own extent and stride through an import and both exports, at every rank, and an
// extents object refilled with fewer values after holding more keeps exactly the new ones.
TEST_F(ArrayTest, EachAxisKeepsItsExtentAndStrideThroughImportAndExportAtEveryRank)
{
  for (std::size_t rank = 0; rank <= 9; ++rank) {
    fake_producer producer{{}};
    std::vector<std::int64_t> shape(rank);
    std::vector<std::int64_t> strides(rank);
    for (std::size_t axis = 0; axis < rank; ++axis) {
      shape[axis] = static_cast<std::int64_t>(axis) + 1;
      strides[axis] = -static_cast<std::int64_t>(axis) - 10;  // distinct from every extent and from each other
    }
    producer.shape = shape;
    producer.strides = strides;
    producer.versioned.dl_tensor.ndim = static_cast<std::int32_t>(rank);
    producer.versioned.dl_tensor.shape = producer.shape.data();
    producer.versioned.dl_tensor.strides = producer.strides.data();
    producer.storage.resize(2000);
    producer.versioned.dl_tensor.data = producer.storage.data() + 1000;  // negative strides walk back from here
    const array view = import_dlpack(&producer.versioned);
    EXPECT_EQ(std::vector<std::int64_t>(view.shape().begin(), view.shape().end()), shape) << "rank " << rank;
    EXPECT_EQ(std::vector<std::int64_t>(view.strides().begin(), view.strides().end()), strides) << "rank " << rank;

    DLManagedTensorVersioned* versioned = export_versioned(view);
    DLManagedTensor* legacy = export_legacy(view);
    for (const DLTensor* t : {&versioned->dl_tensor, &legacy->dl_tensor}) {
      ASSERT_EQ(t->ndim, static_cast<std::int32_t>(rank));
      EXPECT_EQ(std::vector<std::int64_t>(t->shape, t->shape + rank), shape) << "rank " << rank;
      EXPECT_EQ(std::vector<std::int64_t>(t->strides, t->strides + rank), strides) << "rank " << rank;
    }
    versioned->deleter(versioned);
    legacy->deleter(legacy);

    extents refilled{std::vector<std::int64_t>(12, 7)};
    refilled = std::span<const std::int64_t>{shape};
    EXPECT_EQ(std::vector<std::int64_t>(refilled.begin(), refilled.end()), shape) << "rank " << rank;
  }
}

}  // namespace
