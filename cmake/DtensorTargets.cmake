# Helpers that give every dtensor target the same build rules.

# Warnings as errors for our own code (C++ and the host side of CUDA).
function(dtensor_set_warnings target)
  set(cxx_flags -Wall -Wextra)
  if(DTENSOR_WERROR)
    list(APPEND cxx_flags -Werror)
  endif()
  target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:${cxx_flags}>)
  if(DTENSOR_HAVE_CUDA)
    set(cuda_flags -Xcompiler=-Wall,-Wextra --expt-relaxed-constexpr)
    if(DTENSOR_WERROR)
      list(APPEND cuda_flags -Werror=all-warnings)
    endif()
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:${cuda_flags}>)
  endif()
endfunction()

# dtensor_add_library(NAME SOURCES ... [HEADERS ...] [DEPS ...] [PRIVATE_DEPS ...])
# One static library per folder. Headers are installed under include/dtensor/<path from the
# source root>, so `#include "dtensor/tensor/tensor.h"` works in-tree and installed alike.
function(dtensor_add_library name)
  cmake_parse_arguments(ARG "" "" "SOURCES;HEADERS;DEPS;PRIVATE_DEPS" ${ARGN})
  add_library(${name} STATIC ${ARG_SOURCES})
  add_library(dtensor::${name} ALIAS ${name})
  target_include_directories(${name} PUBLIC
    $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}>
    $<INSTALL_INTERFACE:include/dtensor>)
  target_link_libraries(${name} PUBLIC ${ARG_DEPS} PRIVATE ${ARG_PRIVATE_DEPS})
  dtensor_set_warnings(${name})
  set_property(GLOBAL APPEND PROPERTY DTENSOR_LIBRARIES ${name})
  foreach(h ${ARG_HEADERS})
    file(RELATIVE_PATH rel ${PROJECT_SOURCE_DIR} ${CMAKE_CURRENT_SOURCE_DIR}/${h})
    get_filename_component(dir ${rel} DIRECTORY)
    install(FILES ${h} DESTINATION include/dtensor/${dir})
  endforeach()
endfunction()
