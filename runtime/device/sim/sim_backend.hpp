// The simulated device backend; its declaration is public (handoff/sim.hpp) so tests and the Python
// bindings can reach the simulation extras. Asio stays inside work_queue.cpp.
#pragma once

#include <handoff/sim.hpp>
