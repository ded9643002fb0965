# `cmake --install` puts headers under include/dtensor/..., the static libraries under lib/ and
# a package config so that consumers can write:
#   find_package(dtensor REQUIRED)
#   target_link_libraries(app PRIVATE dtensor::dtensor)
include(CMakePackageConfigHelpers)
include(GNUInstallDirs)

get_property(dtensor_libs GLOBAL PROPERTY DTENSOR_LIBRARIES)
set(dtensor_export_targets dtensor dtensor_collectives_all dtensor_openblas ${dtensor_libs})
if(DTENSOR_HAVE_CUDA)
  list(APPEND dtensor_export_targets dtensor_nccl)
endif()
install(TARGETS ${dtensor_export_targets}
  EXPORT dtensorTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(EXPORT dtensorTargets
  NAMESPACE dtensor::
  DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/dtensor)

configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/dtensorConfig.cmake.in
  ${PROJECT_BINARY_DIR}/dtensorConfig.cmake
  INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/dtensor)
write_basic_package_version_file(${PROJECT_BINARY_DIR}/dtensorConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/dtensorConfig.cmake ${PROJECT_BINARY_DIR}/dtensorConfigVersion.cmake
  DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/dtensor)
