# `cmake --install` puts headers under include/dtensor/..., the static libraries under lib/, a
# package config and one pkg-config file per component, so that consumers can write:
#   find_package(dtensor REQUIRED COMPONENTS core collectives)   # or no COMPONENTS: everything
#   target_link_libraries(app PRIVATE dtensor::core dtensor::collectives)
# or, without CMake, `pkg-config --cflags --libs dtensor-core dtensor-collectives`.
#
# Components: each is an interface target dtensor::<component>, an export file of its own
# (lib/cmake/dtensor/dtensor-<component>-targets.cmake), the packages it needs (found only when
# a consumer asks for it) and lib/pkgconfig/dtensor-<component>.pc.
include(CMakePackageConfigHelpers)
include(GNUInstallDirs)

set(dtensor_cmake_dir ${CMAKE_INSTALL_LIBDIR}/cmake/dtensor)
set(dtensor_components "")
set(DTENSOR_COMPONENT_TABLE "")  # the config's per-component lists, filled by dtensor_component()
set(dtensor_component_targets "")

# dtensor_component(NAME LINK <targets> TARGETS <targets> [NEEDS <components>]
#                   [PACKAGES <find_package names>] [PC_REQUIRES <pkg-config names>]
#                   [PC_LIBS <libraries beyond TARGETS>])
# LINK: what dtensor::NAME links. TARGETS: the libraries this component installs and exports,
# dependents first (that is the order of the .pc file's -l flags). NEEDS: the components whose
# targets these link. PACKAGES: find_dependency() names; PC_REQUIRES / PC_LIBS: the same
# dependencies for pkg-config (absolute library paths or flags).
function(dtensor_component name)
  cmake_parse_arguments(ARG "" "" "LINK;TARGETS;NEEDS;PACKAGES;PC_REQUIRES;PC_LIBS" ${ARGN})
  if(name STREQUAL "dtensor")
    set(target dtensor)  # the umbrella is defined at the top level
  else()
    set(target dtensor_component_${name})
    add_library(${target} INTERFACE)
    add_library(dtensor::${name} ALIAS ${target})
    set_target_properties(${target} PROPERTIES EXPORT_NAME ${name})
    target_link_libraries(${target} INTERFACE ${ARG_LINK})
  endif()
  install(TARGETS ${target} ${ARG_TARGETS} EXPORT dtensor-${name}
    ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
    LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
    RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
  install(EXPORT dtensor-${name} NAMESPACE dtensor:: FILE dtensor-${name}-targets.cmake
    DESTINATION ${dtensor_cmake_dir})
  set(table "${DTENSOR_COMPONENT_TABLE}set(_dtensor_needs_${name} ${ARG_NEEDS})\n")
  string(APPEND table "set(_dtensor_packages_${name} ${ARG_PACKAGES})\n")
  set(DTENSOR_COMPONENT_TABLE "${table}" PARENT_SCOPE)
  set(dtensor_components ${dtensor_components} ${name} PARENT_SCOPE)
  set(dtensor_component_targets ${dtensor_component_targets} ${ARG_TARGETS} PARENT_SCOPE)

  # pkg-config: relocatable (prefix from the .pc file's own place), static libraries in link order.
  set(libs "")
  foreach(t ${ARG_TARGETS})
    get_target_property(type ${t} TYPE)
    if(type STREQUAL "STATIC_LIBRARY")
      string(APPEND libs " -l${t}")
    endif()
  endforeach()
  set(requires "")
  foreach(c ${ARG_NEEDS})
    list(APPEND requires dtensor-${c})
  endforeach()
  list(APPEND requires ${ARG_PC_REQUIRES})
  list(JOIN requires " " requires)
  list(JOIN ARG_PC_LIBS " " extra)
  set(pcname dtensor-${name})
  if(name STREQUAL "dtensor")
    set(pcname dtensor)  # everything: dtensor.pc
  endif()
  set(pc "prefix=\${pcfiledir}/../..\nlibdir=\${prefix}/${CMAKE_INSTALL_LIBDIR}\nincludedir=\${prefix}/include\n\n")
  string(APPEND pc "Name: ${pcname}\nDescription: dtensor component ${name} (C++20: compile with -std=c++20)\n")
  string(APPEND pc "Version: ${PROJECT_VERSION}\nRequires: ${requires}\n")
  string(APPEND pc "Libs: -L\${libdir}${libs} ${extra}\nCflags: -I\${includedir}\n")
  file(WRITE ${PROJECT_BINARY_DIR}/pkgconfig/${pcname}.pc "${pc}")
  install(FILES ${PROJECT_BINARY_DIR}/pkgconfig/${pcname}.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
endfunction()

# CUDA is the cuda component's alone (dtensor/tensor/cuda_hooks.h): the CPU components (tensor
# and everything above it) compile without CUDA's headers and link no CUDA library; the cuda
# and nccl components link the static CUDA runtime and load cuBLAS / NCCL with dlopen, so no
# program needs a CUDA library to start. dtensor_CPU_LINKS_CUDA in the package config says
# whether the CPU components link CUDA (OFF; the consumer tests check it).
set(DTENSOR_CPU_LINKS_CUDA OFF)
set(cuda_packages "")
set(cuda_pc_libs "")
if(DTENSOR_HAVE_CUDA)
  set(cuda_packages CUDAToolkit)
  set(cuda_pc_libs ${CUDA_cudart_static_LIBRARY} -ldl -lrt -lpthread)
endif()
set(openmp_pc_libs ${OpenMP_CXX_FLAGS})  # -fopenmp links libgomp with g++ (OpenBLAS's pool)
foreach(lib ${OpenMP_CXX_LIB_NAMES})
  if(OpenMP_${lib}_LIBRARY MATCHES "gomp")
    set(openmp_pc_libs ${OpenMP_${lib}_LIBRARY})  # the absolute path: the same runtime with clang
  endif()
endforeach()

dtensor_component(tensor LINK dtensor_ops
  TARGETS dtensor_ops dtensor_kernels dtensor_kernels_cpu dtensor_tensor dtensor_openblas
  PACKAGES absl Threads OpenMP
  PC_REQUIRES absl_status absl_statusor absl_strings absl_span absl_inlined_vector absl_synchronization
  PC_LIBS ${DTENSOR_OPENBLAS_LIBRARY} ${openmp_pc_libs} -lpthread)
# The CUDA kernels and device memory (a placeholder library without CUDA). The --undefined
# flag takes the hooks' object from the archive (cuda_hooks.h); CMake consumers get it from the
# target's link options.
set(cuda_hook_flags "")
if(DTENSOR_HAVE_CUDA)
  set(cuda_hook_flags -Wl,--undefined=dtensor_cuda_hooks_v1)
endif()
dtensor_component(cuda LINK dtensor_kernels_cuda TARGETS dtensor_kernels_cuda
  NEEDS tensor PACKAGES ${cuda_packages} PC_LIBS ${cuda_hook_flags} ${cuda_pc_libs})
dtensor_component(collectives LINK dtensor_collectives dtensor_collectives_threads dtensor_collectives_store
  TARGETS dtensor_collectives_threads dtensor_collectives_store dtensor_collectives
  NEEDS tensor PACKAGES absl Threads OpenSSL
  PC_REQUIRES absl_time absl_span absl_strings absl_status absl_statusor libcrypto)
dtensor_component(ucx LINK dtensor_collectives_ucx TARGETS dtensor_collectives_ucx
  NEEDS collectives PC_REQUIRES ucx absl_flat_hash_map)
set(nccl_targets dtensor_collectives_nccl)
set(nccl_pc_libs "")
if(DTENSOR_HAVE_CUDA)
  list(APPEND nccl_targets dtensor_nccl)
  set(nccl_pc_libs ${cuda_pc_libs})  # NCCL itself is loaded with dlopen
endif()
dtensor_component(nccl LINK dtensor_collectives_nccl TARGETS ${nccl_targets}
  NEEDS collectives PACKAGES ${cuda_packages} PC_LIBS ${nccl_pc_libs})
dtensor_component(core LINK dtensor_core TARGETS dtensor_core dtensor_mesh dtensor_placements
  NEEDS collectives tensor PACKAGES absl PC_REQUIRES absl_strings absl_hash absl_flat_hash_map absl_flat_hash_set)
dtensor_component(checkpoint LINK dtensor_checkpoint TARGETS dtensor_checkpoint
  NEEDS core PACKAGES nlohmann_json ZLIB PC_REQUIRES nlohmann_json zlib)
dtensor_component(autograd LINK dtensor_autograd TARGETS dtensor_autograd
  NEEDS core PACKAGES absl PC_REQUIRES absl_flat_hash_map absl_strings)
dtensor_component(nn LINK dtensor_nn TARGETS dtensor_nn dtensor_nn_io
  NEEDS autograd PACKAGES nlohmann_json PC_REQUIRES nlohmann_json)
dtensor_component(parallel LINK dtensor_nn_parallel TARGETS dtensor_nn_parallel
  NEEDS nn PACKAGES nlohmann_json PC_REQUIRES nlohmann_json)
dtensor_component(dtensor TARGETS dtensor_collectives_all
  NEEDS tensor cuda collectives ucx nccl core checkpoint autograd nn parallel)

# Every library belongs to exactly one component: a new one must be added above.
get_property(dtensor_libs GLOBAL PROPERTY DTENSOR_LIBRARIES)
foreach(lib ${dtensor_libs})
  list(FIND dtensor_component_targets ${lib} at)
  if(at EQUAL -1)
    message(FATAL_ERROR "dtensor library ${lib} is in no component: add it in cmake/DtensorInstall.cmake")
  endif()
endforeach()

configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/dtensorConfig.cmake.in
  ${PROJECT_BINARY_DIR}/dtensorConfig.cmake
  INSTALL_DESTINATION ${dtensor_cmake_dir})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/dtensorConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/dtensorConfig.cmake ${PROJECT_BINARY_DIR}/dtensorConfigVersion.cmake
  DESTINATION ${dtensor_cmake_dir})
