# Installs the library, its headers and a package configuration so `find_package(handoff)` works.
include_guard(GLOBAL)
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

if(SKBUILD)
  return()  # a Python wheel ships the extension only
endif()

install(TARGETS handoff EXPORT handoff-targets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(DIRECTORY api/include/handoff DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(EXPORT handoff-targets NAMESPACE handoff:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/handoff)

configure_package_config_file(cmake/handoff-config.cmake.in
  ${CMAKE_CURRENT_BINARY_DIR}/handoff-config.cmake
  INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/handoff)
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/handoff-config-version.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/handoff-config.cmake
              ${CMAKE_CURRENT_BINARY_DIR}/handoff-config-version.cmake
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/handoff)
