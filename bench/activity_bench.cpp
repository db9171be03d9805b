// Host cost of one device activity reported to a launch trace (what the simulator and the CUPTI
// callbacks call per launch, copy or stream operation): a kernel launch touching two buffers, into a
// bounded session as `handoff-trace run --launches` keeps one, against no trace running. The streams
// alternate, each waiting for the other through an event, so that the race detector orders and checks
// (and finds no race) as in a correct program.
#include <handoff/activity.hpp>
#include <handoff/trace.hpp>

#include <benchmark/benchmark.h>

#include <array>
#include <cstdint>

namespace {

constexpr std::uint64_t first_stream = 0x5100;
constexpr std::uint64_t second_stream = 0x5200;
constexpr std::uint64_t handed_over = 0xE100;
constexpr std::size_t kept_events = 30'000;  // handoff-trace run's default

handoff::activity::record on(handoff::activity::kind kind, std::uint64_t stream)
{
  handoff::activity::record r;
  r.kind = kind;
  r.stream = stream;
  r.stream_class = handoff::activity::stream_class::non_blocking;
  r.library = "bench";
  return r;
}

// One step: a launch on `from`, an event recorded there and waited for on `to`.
void step(const std::array<handoff::activity::buffer_use, 2>& uses, std::uint64_t from, std::uint64_t to)
{
  auto launch = on(handoff::activity::kind::launch, from);
  launch.name = "layer";
  launch.buffers = uses;
  handoff::activity::report(launch);
  auto record = on(handoff::activity::kind::event_record, from);
  record.event = handed_over;
  handoff::activity::report(record);
  auto wait = on(handoff::activity::kind::stream_wait, to);
  wait.event = handed_over;
  handoff::activity::report(wait);
}

void activities(benchmark::State& state)
{
  const bool traced = state.range(0) != 0;
  const std::uint64_t session = traced ? handoff::trace::begin_session(kept_events, /*activity=*/true) : 0;
  const std::array<handoff::activity::buffer_use, 2> uses{{
    {.address = 0x7000'0000, .bytes = 4096, .mode = handoff::activity::access::read},
    {.address = 0x7000'1000, .bytes = 4096, .mode = handoff::activity::access::write},
  }};
  bool flip = false;
  for (auto _ : state) {
    step(uses, flip ? second_stream : first_stream, flip ? first_stream : second_stream);
    flip = !flip;
  }
  state.SetItemsProcessed(state.iterations() * 3);  // activities
  if (traced) { benchmark::DoNotOptimize(handoff::trace::end_session(session).size()); }
}
BENCHMARK(activities)->ArgName("traced")->Arg(0)->Arg(1);

}  // namespace
