# Finds what dtensor builds on. Every package comes from Debian (scripts/setup.sh), except the
# CUDA Toolkit, which these machines ship under /usr/local/cuda.

find_package(absl REQUIRED)
find_package(Threads REQUIRED)
find_package(OpenMP REQUIRED COMPONENTS CXX)
find_package(nlohmann_json REQUIRED)  # header-only JSON (safetensors headers); Debian nlohmann-json3-dev
find_package(ZLIB REQUIRED)           # crc32 of checkpoint blocks; Debian zlib1g-dev

# OpenBLAS, OpenMP build (libopenblas-openmp-dev): it shares libgomp's thread pool with our own
# OpenMP kernels, so there is one pool for everything (two spinning pools on 2 cores cost
# PyTorch 1.3-1.5x of its step time here).
find_path(DTENSOR_CBLAS_INCLUDE_DIR cblas.h
  HINTS /usr/include/x86_64-linux-gnu/openblas-openmp /usr/include/openblas
  NO_DEFAULT_PATH)
find_path(DTENSOR_CBLAS_INCLUDE_DIR cblas.h)
find_library(DTENSOR_OPENBLAS_LIBRARY openblas
  HINTS /usr/lib/x86_64-linux-gnu/openblas-openmp /usr/lib/aarch64-linux-gnu/openblas-openmp
  NO_DEFAULT_PATH)
find_library(DTENSOR_OPENBLAS_LIBRARY openblas)
if(NOT DTENSOR_CBLAS_INCLUDE_DIR OR NOT DTENSOR_OPENBLAS_LIBRARY)
  message(FATAL_ERROR "OpenBLAS not found: run scripts/setup.sh (installs libopenblas-openmp-dev)")
endif()
if(NOT TARGET dtensor_openblas)
  add_library(dtensor_openblas INTERFACE)
  target_include_directories(dtensor_openblas SYSTEM INTERFACE ${DTENSOR_CBLAS_INCLUDE_DIR})
  target_link_libraries(dtensor_openblas INTERFACE ${DTENSOR_OPENBLAS_LIBRARY})
endif()
message(STATUS "dtensor: OpenBLAS ${DTENSOR_OPENBLAS_LIBRARY}")

# ---- CUDA (DTENSOR_CUDA = AUTO | ON | OFF) ----
set(DTENSOR_HAVE_CUDA OFF)
if(NOT DTENSOR_CUDA STREQUAL "OFF")
  if(NOT CMAKE_CUDA_COMPILER AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    if(NOT CMAKE_CUDA_HOST_COMPILER AND CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
      set(CMAKE_CUDA_HOST_COMPILER ${CMAKE_CXX_COMPILER})
    elseif(NOT CMAKE_CUDA_HOST_COMPILER)
      find_program(DTENSOR_GXX g++)  # nvcc 13 supports g++ as host compiler, not clang 14
      if(DTENSOR_GXX)
        set(CMAKE_CUDA_HOST_COMPILER ${DTENSOR_GXX})
      endif()
    endif()
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES 80 90)  # A100 and H100/H200
    endif()
    enable_language(CUDA)
    set(CMAKE_CUDA_STANDARD 17)  # CMake 3.25 cannot ask nvcc for C++20; device code is C++17
    set(CMAKE_CUDA_STANDARD_REQUIRED ON)
    find_package(CUDAToolkit REQUIRED)
    find_library(DTENSOR_NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR} /usr/lib/x86_64-linux-gnu)
    find_path(DTENSOR_NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS} /usr/include)
    if(DTENSOR_NCCL_LIBRARY AND DTENSOR_NCCL_INCLUDE_DIR)
      set(DTENSOR_HAVE_CUDA ON)
    elseif(DTENSOR_CUDA STREQUAL "ON")
      message(FATAL_ERROR "DTENSOR_CUDA=ON but NCCL was not found next to the CUDA Toolkit")
    endif()
  elseif(DTENSOR_CUDA STREQUAL "ON")
    message(FATAL_ERROR "DTENSOR_CUDA=ON but no CUDA compiler was found")
  endif()
endif()
if(DTENSOR_HAVE_CUDA)
  message(STATUS "dtensor: CUDA ${CUDAToolkit_VERSION} for sm ${CMAKE_CUDA_ARCHITECTURES}, NCCL ${DTENSOR_NCCL_LIBRARY}")
  if(NOT TARGET dtensor_nccl)
    # NCCL's headers only: the library is loaded with dlopen (collectives/nccl/nccl_api.h).
    add_library(dtensor_nccl INTERFACE)
    target_include_directories(dtensor_nccl SYSTEM INTERFACE ${DTENSOR_NCCL_INCLUDE_DIR})
  endif()
else()
  message(STATUS "dtensor: building CPU-only (no CUDA Toolkit found or DTENSOR_CUDA=OFF)")
endif()

# ---- cuDNN (optional, DTENSOR_CUDNN = AUTO | OFF): fused attention (dtensor/kernels/cuda/cudnn_sdpa.h) ----
# Its headers only, version 9 or newer: the library is loaded with dlopen on first use, and
# attention runs dtensor's own kernels where it is absent (cudnn_api.h).
set(DTENSOR_CUDNN "AUTO" CACHE STRING "Use cuDNN's fused attention where found: AUTO or OFF")
set_property(CACHE DTENSOR_CUDNN PROPERTY STRINGS AUTO OFF)
set(DTENSOR_HAVE_CUDNN OFF)
if(DTENSOR_HAVE_CUDA AND NOT DTENSOR_CUDNN STREQUAL "OFF")
  find_path(DTENSOR_CUDNN_INCLUDE_DIR cudnn_graph.h
    HINTS ${CUDAToolkit_INCLUDE_DIRS} /usr/include /usr/include/x86_64-linux-gnu)
  if(DTENSOR_CUDNN_INCLUDE_DIR AND EXISTS ${DTENSOR_CUDNN_INCLUDE_DIR}/cudnn_version.h)
    file(STRINGS ${DTENSOR_CUDNN_INCLUDE_DIR}/cudnn_version.h dtensor_cudnn_major REGEX "^#define CUDNN_MAJOR [0-9]+")
    string(REGEX REPLACE "^#define CUDNN_MAJOR ([0-9]+).*" "\\1" dtensor_cudnn_major "${dtensor_cudnn_major}")
    if(dtensor_cudnn_major GREATER_EQUAL 9)
      set(DTENSOR_HAVE_CUDNN ON)
      message(STATUS "dtensor: cuDNN ${dtensor_cudnn_major} headers in ${DTENSOR_CUDNN_INCLUDE_DIR} (fused attention)")
    endif()
  endif()
  if(NOT DTENSOR_HAVE_CUDNN)
    message(STATUS "dtensor: no cuDNN 9 headers found: attention runs dtensor's own CUDA kernels")
  endif()
endif()
