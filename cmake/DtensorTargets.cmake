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

# The include form: every library header is included as "dtensor/<folder>/<file>.h", as
# Abseil's are "absl/...", in this tree and installed alike, while the design's folders stay at
# the top level (mesh/, nn/, ... beside dtensor/core, dtensor/tensor, ...). The build makes a
# forwarding tree, <build>/include/dtensor/<folder> -> the source folder (a symbolic link per
# folder), and the libraries see only that tree, so an include of another form does not build.
# The install copies the headers to include/dtensor/<folder>/.
set(DTENSOR_INCLUDE_TREE ${PROJECT_BINARY_DIR}/include)
file(MAKE_DIRECTORY ${DTENSOR_INCLUDE_TREE}/dtensor)
foreach(folder mesh placements collectives autograd nn dtensor/core dtensor/checkpoint dtensor/tensor dtensor/kernels
               dtensor/ops)
  string(REGEX REPLACE "^dtensor/" "" name ${folder})
  if(NOT IS_SYMLINK ${DTENSOR_INCLUDE_TREE}/dtensor/${name})
    file(CREATE_LINK ${PROJECT_SOURCE_DIR}/${folder} ${DTENSOR_INCLUDE_TREE}/dtensor/${name} SYMBOLIC)
  endif()
endforeach()

# dtensor_add_library(NAME SOURCES ... [HEADERS ...] [DEPS ...] [PRIVATE_DEPS ...])
# One static library per folder; its headers install to include/dtensor/<folder>/.
function(dtensor_add_library name)
  cmake_parse_arguments(ARG "" "" "SOURCES;HEADERS;DEPS;PRIVATE_DEPS" ${ARGN})
  add_library(${name} STATIC ${ARG_SOURCES})
  add_library(dtensor::${name} ALIAS ${name})
  target_include_directories(${name} PUBLIC
    $<BUILD_INTERFACE:${DTENSOR_INCLUDE_TREE}>
    $<INSTALL_INTERFACE:include>)
  target_link_libraries(${name} PUBLIC ${ARG_DEPS} PRIVATE ${ARG_PRIVATE_DEPS})
  # The headers are C++20 (defaulted operator==, designated initializers): a consumer that
  # links a target compiles as C++20 at least, whatever its own CMAKE_CXX_STANDARD.
  target_compile_features(${name} PUBLIC cxx_std_20)
  dtensor_set_warnings(${name})
  set_property(GLOBAL APPEND PROPERTY DTENSOR_LIBRARIES ${name})
  foreach(h ${ARG_HEADERS})
    file(RELATIVE_PATH rel ${PROJECT_SOURCE_DIR} ${CMAKE_CURRENT_SOURCE_DIR}/${h})
    get_filename_component(dir ${rel} DIRECTORY)
    string(REGEX REPLACE "^dtensor/" "" dir ${dir})
    install(FILES ${h} DESTINATION include/dtensor/${dir})
  endforeach()
endfunction()

# Sanitizers (DTENSOR_SANITIZE = "" | "address,undefined" | "thread"; clang or g++): every
# target of this tree, compile and link alike, so no object goes uninstrumented. UBSan findings
# abort (-fno-sanitize-recover), so a test that hits undefined behaviour fails. CI builds the
# first with clang 14 (scripts/test.sh); suppressions live in scripts/sanitizers/.
set(DTENSOR_SANITIZE "" CACHE STRING "Sanitizers for every target: empty, address,undefined or thread")
if(DTENSOR_SANITIZE)
  if(NOT DTENSOR_SANITIZE MATCHES "^(address|undefined|thread)(,(address|undefined|thread))*$")
    message(FATAL_ERROR "DTENSOR_SANITIZE='${DTENSOR_SANITIZE}': expected address,undefined or thread")
  endif()
  if(DTENSOR_SANITIZE MATCHES "thread" AND DTENSOR_SANITIZE MATCHES "address")
    message(FATAL_ERROR "DTENSOR_SANITIZE='${DTENSOR_SANITIZE}': thread and address cannot be combined")
  endif()
  set(dtensor_sanitize_flags -fsanitize=${DTENSOR_SANITIZE} -fno-omit-frame-pointer)
  if(DTENSOR_SANITIZE MATCHES "undefined")
    list(APPEND dtensor_sanitize_flags -fno-sanitize-recover=undefined)
  endif()
  if(CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
    # Their checks inside `#pragma omp simd` loops keep clang from vectorizing them (as does -O1,
    # which scripts/test.sh gives the sanitized builds), which it reports as a warning
    # (-Wpass-failed); the loops stay correct, only slower.
    list(APPEND dtensor_sanitize_flags -Wno-pass-failed)
  endif()
  add_compile_options("$<$<COMPILE_LANGUAGE:CXX>:${dtensor_sanitize_flags}>")
  add_link_options(${dtensor_sanitize_flags})
  message(STATUS "dtensor: sanitizers ${DTENSOR_SANITIZE}")
endif()
