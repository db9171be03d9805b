// The ownership graph: tracked views, the buffers they hold and the streams those are bound to.
#include <handoff/ownership.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <thread>
#include <vector>

namespace {

using namespace handoff;

array host_view(std::vector<float>& data, bool* released = nullptr)
{
  array_layout layout;
  layout.data = data.data();
  layout.shape = std::vector<std::int64_t>{2, static_cast<std::int64_t>(data.size() / 2)};
  layout.strides = std::vector<std::int64_t>{static_cast<std::int64_t>(data.size() / 2), 1};
  return array{std::move(layout), shared_producer{[released] {
                 if (released != nullptr) { *released = true; }
               }}};
}

const buffer_node* find_buffer(const ownership_graph& graph, std::uint64_t id)
{
  const auto at = std::find_if(graph.buffers.begin(), graph.buffers.end(), [&](const auto& b) { return b.id == id; });
  return at == graph.buffers.end() ? nullptr : &*at;
}

std::vector<const view_node*> views_of(const ownership_graph& graph, std::uint64_t buffer)
{
  std::vector<const view_node*> out;
  for (const auto& v : graph.views) {
    if (v.buffer == buffer) { out.push_back(&v); }
  }
  return out;
}

class OwnershipTest : public ::testing::Test {};

TEST_F(OwnershipTest, ATrackedViewShowsItsBufferWithTheLayoutAndLibrary)
{
  std::vector<float> data(6);
  const array view = host_view(data);
  const tracked_view node{view, "handoff.Array", "numpy"};

  const ownership_graph graph = ownership_snapshot();
  const buffer_node* buffer = find_buffer(graph, view.owner().id());
  ASSERT_NE(buffer, nullptr);
  EXPECT_STREQ(buffer->library, "numpy");
  ASSERT_TRUE(buffer->device.has_value());
  EXPECT_EQ(buffer->device->device_type, kDLCPU);
  EXPECT_EQ(buffer->shape, (std::vector<std::int64_t>{2, 3}));
  EXPECT_EQ(buffer->nbytes, 24);
  EXPECT_EQ(buffer->holders, 1);
  const auto views = views_of(graph, buffer->id);
  ASSERT_EQ(views.size(), 1U);
  EXPECT_EQ(views[0]->id, node.id());
  EXPECT_STREQ(views[0]->holder, "handoff.Array");
}

TEST_F(OwnershipTest, AViewLeavesTheGraphWhenDestroyedAndIdsAreNeverReused)
{
  std::vector<float> data(4);
  const array view = host_view(data);
  std::uint64_t first = 0;
  {
    const tracked_view node{view, "handoff.Array"};
    first = node.id();
    const auto ids = tracked_view_ids();
    EXPECT_NE(std::find(ids.begin(), ids.end(), first), ids.end());
  }
  const auto ids = tracked_view_ids();
  EXPECT_EQ(std::find(ids.begin(), ids.end(), first), ids.end());
  EXPECT_EQ(find_buffer(ownership_snapshot(), view.owner().id()), nullptr) << "a buffer no tracked view holds";
  const tracked_view again{view, "handoff.Array"};
  EXPECT_NE(again.id(), first);
  EXPECT_EQ(again.id(), again.id());
}

TEST_F(OwnershipTest, AnExportedTensorIsAViewOfItsProducerUntilItsDeleterRuns)
{
  std::vector<float> data(4);
  bool released = false;
  std::optional<array> view{host_view(data, &released)};
  const std::uint64_t buffer = view->owner().id();
  DLManagedTensorVersioned* exported = export_versioned(*view);
  view.reset();  // the export alone holds the producer now

  auto graph = ownership_snapshot();
  const buffer_node* node = find_buffer(graph, buffer);
  ASSERT_NE(node, nullptr);
  EXPECT_EQ(node->shape, (std::vector<std::int64_t>{2, 2}));
  const auto views = views_of(graph, buffer);
  ASSERT_EQ(views.size(), 1U);
  EXPECT_STREQ(views[0]->holder, "dlpack");

  exported->deleter(exported);
  EXPECT_TRUE(released);
  EXPECT_EQ(find_buffer(ownership_snapshot(), buffer), nullptr);
}

TEST_F(OwnershipTest, ABuffersBindingsAreItsReadyOnAndReleasedAfterStreams)
{
  std::vector<float> data(4);
  const array view = host_view(data);
  const tracked_view node{view, "handoff.Array"};
  view.owner().set_ready_on({.ctx = nullptr, .device = 1, .stream = device::stream_handle{0x10}, .stream_owner = {}});
  const buffer_node* buffer = nullptr;
  const auto graph = ownership_snapshot();
  buffer = find_buffer(graph, view.owner().id());
  ASSERT_NE(buffer, nullptr);
  ASSERT_EQ(buffer->ready_on.size(), 1U);
  EXPECT_EQ(buffer->ready_on.front().handle, 0x10U);
  EXPECT_EQ(buffer->ready_on.front().device.device_id, 1);
  EXPECT_TRUE(buffer->released_after.empty()) << "release_after needs a context; none was bound";
}

TEST_F(OwnershipTest, ViewsComeAndGoOnManyThreadsWhileSnapshotsAreTaken)
{
  std::vector<float> data(8);
  const array shared = host_view(data);
  std::atomic<bool> stop{false};
  std::vector<std::thread> workers;
  workers.reserve(4);
  for (int t = 0; t < 4; ++t) {
    workers.emplace_back([&] {
      while (!stop.load()) {
        const array copy = shared;  // NOLINT(performance-unnecessary-copy-initialization): a second holder
        const tracked_view node{copy, "handoff.Array"};
        (void)node.id();
      }
    });
  }
  for (int i = 0; i < 200; ++i) {
    const auto graph = ownership_snapshot();
    for (const auto& v : graph.views) { ASSERT_NE(v.holder, nullptr); }
  }
  stop = true;
  for (auto& w : workers) { w.join(); }
  EXPECT_EQ(shared.owner().use_count(), 1);
}

}  // namespace
