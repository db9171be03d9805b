# Third-party dependencies: spdlog/fmt, Boost.Asio (headers), threads, and the optional CUDA runtime.
include_guard(GLOBAL)

find_package(Threads REQUIRED)
find_package(fmt REQUIRED)
find_package(spdlog REQUIRED)
find_package(Boost 1.74 REQUIRED CONFIG)

set(HANDOFF_HAS_CUDA OFF)
if(NOT HANDOFF_WITH_CUDA STREQUAL "OFF")
  # 12.8: cudaStreamGetDevice (and 12.5's cudaGetDriverEntryPointByVersion, through which the
  # backend finds the driver's functions).
  find_package(CUDAToolkit 12.8 QUIET)
  if(CUDAToolkit_FOUND AND TARGET CUDA::cudart_static)
    set(HANDOFF_HAS_CUDA ON)
    message(STATUS "handoff: CUDA backend ON (toolkit ${CUDAToolkit_VERSION} at ${CUDAToolkit_BIN_DIR}), cudart linked statically")
  elseif(HANDOFF_WITH_CUDA STREQUAL "ON")
    message(FATAL_ERROR "handoff: HANDOFF_WITH_CUDA=ON but no CUDA toolkit 12.8 or later was found")
  else()
    message(STATUS "handoff: CUDA toolkit 12.8 or later not found; building without the CUDA backend")
  endif()
else()
  message(STATUS "handoff: CUDA backend disabled (HANDOFF_WITH_CUDA=OFF)")
endif()
