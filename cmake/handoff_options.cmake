# Build options and the warning/sanitizer settings every handoff target shares.
include_guard(GLOBAL)

option(HANDOFF_BUILD_TESTS "Build the GoogleTest suite" ${PROJECT_IS_TOP_LEVEL})
option(HANDOFF_BUILD_PYTHON "Build the pybind11 extension" OFF)
option(HANDOFF_BUILD_BENCH "Build the Google Benchmark programs" OFF)
option(HANDOFF_BUILD_FUZZERS "Build the libFuzzer harnesses of tests/fuzz (clang; instruments the library)" OFF)
set(HANDOFF_WITH_CUDA "AUTO" CACHE STRING "Compile the CUDA backend: AUTO (when the toolkit is found), ON, OFF")
set_property(CACHE HANDOFF_WITH_CUDA PROPERTY STRINGS AUTO ON OFF)
set(HANDOFF_SANITIZE "" CACHE STRING "Comma-separated -fsanitize= list, e.g. address,undefined or thread")
option(HANDOFF_WARNINGS_AS_ERRORS "Treat warnings as errors" OFF)

if(NOT CMAKE_BUILD_TYPE AND NOT CMAKE_CONFIGURATION_TYPES)
  set(CMAKE_BUILD_TYPE RelWithDebInfo CACHE STRING "Build type" FORCE)
endif()

set(CMAKE_CXX_STANDARD 20)
set(CMAKE_CXX_STANDARD_REQUIRED ON)
set(CMAKE_CXX_EXTENSIONS OFF)
set(CMAKE_POSITION_INDEPENDENT_CODE ON)
set(CMAKE_EXPORT_COMPILE_COMMANDS ON)

# The warnings and sanitizers of handoff's own targets (never of third-party code), which each links
# privately; not installed.
add_library(handoff_build_flags INTERFACE)
target_compile_options(handoff_build_flags INTERFACE
  -Wall -Wextra -Wpedantic -Wconversion -Wsign-conversion -Wshadow -Wnon-virtual-dtor
  -Wold-style-cast -Woverloaded-virtual -Wnull-dereference
  $<$<BOOL:${HANDOFF_WARNINGS_AS_ERRORS}>:-Werror>)

if(HANDOFF_SANITIZE)
  if(HANDOFF_SANITIZE MATCHES "thread")
    # Asio's fenced blocks use std::atomic_thread_fence, which TSan does not model.
    target_compile_definitions(handoff_build_flags INTERFACE BOOST_ASIO_DISABLE_FENCED_BLOCK)
  endif()
  target_compile_options(handoff_build_flags INTERFACE -fsanitize=${HANDOFF_SANITIZE} -fno-omit-frame-pointer
                                                       -fno-sanitize-recover=all)
  target_link_options(handoff_build_flags INTERFACE -fsanitize=${HANDOFF_SANITIZE})
endif()
