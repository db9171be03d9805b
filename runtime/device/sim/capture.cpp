// Stream capture: work enqueued on a capturing stream becomes a node of a graph instead of running;
// launching the graph submits a fresh copy of its nodes, in their captured order, each time.
#include "device/sim/state.hpp"

#include <fmt/format.h>

namespace handoff::device {

using namespace sim_detail;

namespace {}  // namespace

std::size_t sim_graph::size() const noexcept
{
  return graph_ ? graph_->ops.size() : 0;
}

void sim_backend::begin_capture(stream_handle stream)
{
  const call_with c{"begin_capture", "{:#x}, cudaStreamCaptureModeGlobal", raw(stream)};
  impl_->open(c);
  std::lock_guard lock(impl_->mutex);
  auto& s = impl_->stream(c, stream);
  if (s.kind == stream_kind::legacy) {
    impl_->fail(c, sim_error::capture_unsupported, "the legacy stream cannot be captured");
  }
  if (s.capture) { impl_->fail(c, sim_error::illegal_state, "the stream is already capturing"); }
  s.capture = std::make_shared<capture_info>();
  s.capture->id = ++impl_->next_capture_id;
  s.capture->origin = &s;
  s.capture_tail.reset();
  impl_->open_captures.emplace(s.capture->id, impl::open_capture{s.capture, this_thread_key()});
}

sim_graph sim_backend::end_capture(stream_handle stream)
{
  const call_with c{"end_capture", "{:#x}", raw(stream)};
  impl_->open(c);
  std::lock_guard lock(impl_->mutex);
  auto& s = impl_->stream(c, stream);
  if (!s.capture) { impl_->fail(c, sim_error::illegal_state, "the stream is not capturing"); }
  if (s.capture->origin != &s) {
    s.capture->invalidated = true;
    impl_->fail(c, sim_error::capture_unmatched);
  }
  const auto capture = s.capture;
  impl_->open_captures.erase(capture->id);
  // Streams of any device may have joined through events.
  for (int d = 0; d < impl_->device_count; ++d) {
    impl_->for_each_stream(d, [&](stream_state& other) {
      if (other.capture == capture) {
        other.capture.reset();
        other.capture_tail.reset();
      }
    });
  }
  if (capture->invalidated) { impl_->fail(c, sim_error::capture_invalidated); }
  sim_graph graph;
  graph.graph_ = std::make_shared<const captured_graph>(std::move(capture->graph));
  return graph;
}

void sim_backend::release_with_capture(stream_handle stream, void (*release)(void* data) noexcept, void* data)
{
  const call_with c{"release_with_capture", "{:#x}", raw(stream)};
  impl_->open(c);
  std::lock_guard lock(impl_->mutex);
  auto& s = impl_->stream(c, stream);
  // As asking the legacy stream during a blocking stream's capture: it fails, and breaks nothing.
  if (s.kind == stream_kind::legacy) { impl_->fail(c, sim_error::capture_implicit); }
  if (!s.capture) { impl_->fail(c, sim_error::illegal_state, "the stream is not capturing"); }
  s.capture->graph.retained.emplace_back(data, release);
}

void sim_backend::launch_graph(const sim_graph& graph, stream_handle stream)
{
  const call_with c{"launch_graph", "graph of {}, {:#x}", graph.size(), raw(stream)};
  impl_->open(c);
  if (!graph.graph_) { impl_->fail(c, sim_error::invalid_value, "an empty sim_graph (not from end_capture)"); }
  // Reported as one launch on its stream: the legacy stream's rule orders other streams by it.
  activity_note note{activity::kind::launch, {}};
  note.record.name = call_name("launch_graph", impl_->flavour).data();
  {
    std::lock_guard lock(impl_->mutex);
    auto& s = impl_->stream(c, stream);
    impl_->check_legacy_use(c, s);
    if (s.capture) { impl_->fail(c, sim_error::capture_unsupported, "launching a graph into a capture"); }
    for (const auto& op : graph.graph_->ops) { impl_->check_alive(c, op.device); }
    // Every node of this launch comes after the stream's earlier work, and the stream's later work
    // after every node.
    const node_ptr start = impl_->pool.submit(impl_->submission(s.device, {}), impl_->next_deps_locked(s));
    std::vector<node_ptr> nodes;
    nodes.reserve(graph.graph_->ops.size());
    for (const auto& op : graph.graph_->ops) {
      std::vector<node_ptr> deps{start};
      for (const auto dep : op.deps) { deps.push_back(nodes[dep]); }
      nodes.push_back(impl_->pool.submit(impl_->submission(op.device, op.what), deps));
    }
    nodes.push_back(start);  // an empty graph still ends after the stream's earlier work
    // The launch holds the graph, and what it retains, until it has run.
    auto end = impl_->pool.submit(
      impl_->submission(
        s.device, {.body = [held = graph.graph_]() mutable { held.reset(); }, .delay = {}, .host_function = false}),
      nodes);
    impl_->append_locked(s, std::move(end));  // one operation of the stream, as cudaGraphLaunch is
    note.on_stream(s, raw(stream), impl_->flavour);
  }
  note.send();
}

}  // namespace handoff::device
