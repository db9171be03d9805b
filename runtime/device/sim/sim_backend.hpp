// The simulated device backend; its declaration is public (handoff/sim.hpp) so tests and the Python
// bindings can reach the simulation extras. Asio stays inside sim_backend.cpp.
#pragma once

#include <handoff/sim.hpp>
