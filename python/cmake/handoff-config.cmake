# find_package(handoff) from handoff's Python package (handoff.get_cmake_dir()): the headers that
# pybind11 extensions use, as the target handoff::pybind11. Nothing of handoff's is linked: an
# extension calls the `handoff` module through its table of C functions.
include(CMakeFindDependencyMacro)
if(NOT TARGET pybind11::headers)
  find_dependency(pybind11 CONFIG)
endif()
if(NOT TARGET handoff::pybind11)
  add_library(handoff::pybind11 INTERFACE IMPORTED)
  set_target_properties(handoff::pybind11 PROPERTIES
    INTERFACE_INCLUDE_DIRECTORIES "${CMAKE_CURRENT_LIST_DIR}/../../../include"
    INTERFACE_LINK_LIBRARIES pybind11::headers
    INTERFACE_COMPILE_FEATURES cxx_std_17)  # the header needs no more, as nanobind's
endif()
