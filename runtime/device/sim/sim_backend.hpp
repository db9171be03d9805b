// The simulated device backend; declared in the build's internal headers (handoff/internal/sim.hpp)
// so that the tests and the Python bindings reach its extras. Asio stays inside work_queue.cpp.
#pragma once

#include <handoff/internal/sim.hpp>
