# Third-party dependencies: spdlog/fmt, Boost.Asio (headers), threads, and the optional CUDA runtime.
include_guard(GLOBAL)

find_package(Threads REQUIRED)
find_package(fmt REQUIRED)
find_package(spdlog REQUIRED)
find_package(Boost 1.74 REQUIRED CONFIG)

# spdlog and fmt: the system's shared libraries for the C++ package; compiled in from their headers
# for the Python extension, as a wheel may load nothing from the system but the C and C++ runtimes.
# HANDOFF_LOGGING is what handoff's targets link.
if(SKBUILD)
  set(handoff_logging_default ON)
else()
  set(handoff_logging_default OFF)
endif()
option(HANDOFF_COMPILED_IN_LOGGING "Compile spdlog and fmt into handoff from their headers (the wheel does)"
       ${handoff_logging_default})
if(HANDOFF_COMPILED_IN_LOGGING)
  add_library(handoff_logging INTERFACE)
  get_target_property(handoff_spdlog_includes spdlog::spdlog_header_only INTERFACE_INCLUDE_DIRECTORIES)
  target_include_directories(handoff_logging SYSTEM INTERFACE ${handoff_spdlog_includes})
  target_compile_definitions(handoff_logging INTERFACE SPDLOG_FMT_EXTERNAL)
  target_link_libraries(handoff_logging INTERFACE fmt::fmt-header-only Threads::Threads)
  set(HANDOFF_LOGGING $<BUILD_INTERFACE:handoff_logging>)
else()
  set(HANDOFF_LOGGING spdlog::spdlog fmt::fmt)
endif()

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
