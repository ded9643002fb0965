# Driven by the readme_blocks test: every ```cpp block of README.md compiles as shown against
# the installed package (and the runnable ones run and exit 0).
#
#   cmake -DBUILD_DIR=<dtensor build> -DREADME=<README.md> -DDRIVER_DIR=<tests/install/readme>
#         -DWORK_DIR=<scratch> -DGENERATOR=<generator> -DCXX=<compiler> -P readme_blocks.cmake
#
# Blocks are numbered 1, 2, ... in README order and extracted verbatim to
# WORK_DIR/blocks/block_<k>.cc. A block with `int main(` is a whole program: built and run
# as is. Any other block is a fragment and needs DRIVER_DIR/block_<k>_driver.cc, which supplies what
# the fragment assumes and #includes the extracted text: block_<k>.cc (whole, at file scope),
# or block_<k>_head.inc (its leading #include / using / comment lines, at file scope) and
# block_<k>_body.inc (the rest, inside a function). A driver records the block it was written
# for with `// readme-block-sha256: <sha256 of the block's text>` and whether to run it with
# `// readme-block-run: yes|no`. A fragment without a driver, a driver whose block's text
# changed, or a driver without a block fails the test, naming the block and its first line.
cmake_minimum_required(VERSION 3.25)  # new policies: if(TRUE), quoted args not dereferenced
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR}/blocks)

include(${CMAKE_CURRENT_LIST_DIR}/install_steps.cmake)

# --- Extract the blocks ---------------------------------------------------------------------
file(READ ${README} readme)
set(fence_open "\n```cpp\n")
string(LENGTH "${fence_open}" fence_open_len)
set(pos 0)
set(count 0)
set(errors "")
while(TRUE)
  string(SUBSTRING "${readme}" ${pos} -1 rest)
  string(FIND "${rest}" "${fence_open}" start)
  if(start EQUAL -1)
    break()
  endif()
  math(EXPR body_start "${pos} + ${start} + ${fence_open_len}")
  string(SUBSTRING "${readme}" ${body_start} -1 rest)
  string(FIND "${rest}" "\n```" len)
  if(len EQUAL -1)
    message(FATAL_ERROR "README block ${count}+1 has no closing fence")
  endif()
  math(EXPR len "${len} + 1")  # keep the last line's newline
  string(SUBSTRING "${rest}" 0 ${len} text)
  math(EXPR pos "${body_start} + ${len}")
  math(EXPR count "${count} + 1")
  set(k ${count})

  string(FIND "${text}" "\n" nl)
  string(SUBSTRING "${text}" 0 ${nl} block_${k}_first)
  string(SHA256 block_${k}_hash "${text}")
  string(REGEX MATCH "int main\\(" has_main "${text}")
  if(has_main)
    set(block_${k}_whole TRUE)
  else()
    set(block_${k}_whole FALSE)
  endif()

  # Head: the leading #include, using, comment and blank lines; body: the rest.
  set(off 0)
  while(off LESS len)
    string(SUBSTRING "${text}" ${off} -1 r)
    string(FIND "${r}" "\n" nl)
    string(SUBSTRING "${r}" 0 ${nl} line)
    string(STRIP "${line}" stripped)
    string(REGEX MATCH "^(#include |using namespace |//)" is_head "${stripped}")
    if(NOT is_head AND NOT stripped STREQUAL "")
      break()
    endif()
    math(EXPR off "${off} + ${nl} + 1")
  endwhile()
  string(SUBSTRING "${text}" 0 ${off} head)
  string(SUBSTRING "${text}" ${off} -1 body)
  file(WRITE ${WORK_DIR}/blocks/block_${k}.cc "${text}")
  file(WRITE ${WORK_DIR}/blocks/block_${k}_head.inc "${head}")
  file(WRITE ${WORK_DIR}/blocks/block_${k}_body.inc "${body}")
endwhile()
if(count EQUAL 0)
  message(FATAL_ERROR "no ```cpp block found in ${README}")
endif()

# --- Match the drivers to the blocks ----------------------------------------------------------
file(GLOB drivers ${DRIVER_DIR}/*.cc)
foreach(driver IN LISTS drivers)
  get_filename_component(name ${driver} NAME)
  string(REGEX MATCH "^block_([0-9]+)_driver\\.cc$" ok "${name}")
  if(NOT ok)
    string(APPEND errors "driver ${driver}: name is not block_<k>_driver.cc\n")
    continue()
  endif()
  set(k ${CMAKE_MATCH_1})
  file(READ ${driver} dtext)
  string(REGEX MATCH "// readme-block-sha256: ([0-9a-f]+)" ok "${dtext}")
  set(want ${CMAKE_MATCH_1})
  string(REGEX MATCH "// readme-block-run: (yes|no)" ok2 "${dtext}")
  set(block_${k}_run ${CMAKE_MATCH_1})
  if(NOT ok OR NOT ok2)
    string(APPEND errors "driver ${driver}: lacks `// readme-block-sha256: <hash>` or `// readme-block-run: yes|no`\n")
  elseif(k GREATER count OR k LESS 1)
    string(APPEND errors "driver ${driver}: README.md has no block ${k} (it has ${count} ```cpp blocks)\n")
  elseif(NOT want STREQUAL block_${k}_hash)
    string(APPEND errors "README block ${k} (first line: \"${block_${k}_first}\") changed since "
      "its driver ${driver} was written (sha256 ${want}, now ${block_${k}_hash}): check the "
      "driver still fits the block, then update its readme-block-sha256\n")
  else()
    set(block_${k}_driver ${driver})
  endif()
endforeach()
foreach(k RANGE 1 ${count})
  if(NOT block_${k}_whole AND NOT DEFINED block_${k}_run)
    string(APPEND errors "README block ${k} (first line: \"${block_${k}_first}\") is a fragment "
      "(no main) without a driver: add ${DRIVER_DIR}/block_${k}_driver.cc\n")
  endif()
endforeach()
if(NOT errors STREQUAL "")
  message(FATAL_ERROR "README blocks and drivers do not match:\n${errors}")
endif()

# --- Install, then build every block against the installed package ---------------------------
install_dtensor(${BUILD_DIR} ${WORK_DIR}/prefix)
string(CONCAT cml "cmake_minimum_required(VERSION 3.25)\nproject(readme_blocks LANGUAGES CXX)\n"
  "set(CMAKE_CXX_STANDARD 20)\nset(CMAKE_CXX_STANDARD_REQUIRED ON)\n"
  "find_package(dtensor REQUIRED)\n")
foreach(k RANGE 1 ${count})
  if(DEFINED block_${k}_driver)
    set(src ${block_${k}_driver})
  else()
    set(src ${WORK_DIR}/blocks/block_${k}.cc)
  endif()
  string(APPEND cml "add_executable(block_${k} ${src})\n"
    "target_include_directories(block_${k} PRIVATE ${WORK_DIR}/blocks)\n"
    "target_link_libraries(block_${k} PRIVATE dtensor::dtensor)\n")
endforeach()
file(WRITE ${WORK_DIR}/project/CMakeLists.txt "${cml}")
run_step(${CMAKE_COMMAND} -S ${WORK_DIR}/project -B ${WORK_DIR}/build -G ${GENERATOR}
  -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix -DCMAKE_CXX_COMPILER=${CXX} -DCMAKE_BUILD_TYPE=Release)

foreach(k RANGE 1 ${count})
  if(block_${k}_whole)
    set(kind "whole program")
  else()
    set(kind "fragment, driver ${block_${k}_driver}")
  endif()
  execute_process(COMMAND ${CMAKE_COMMAND} --build ${WORK_DIR}/build --target block_${k}
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "README block ${k} (first line: \"${block_${k}_first}\"; ${kind}) does "
      "not compile against the installed package:\n${out}\n${err}")
  endif()
  if(block_${k}_whole OR block_${k}_run STREQUAL "yes")
    file(MAKE_DIRECTORY ${WORK_DIR}/run_${k})
    execute_process(COMMAND ${WORK_DIR}/build/block_${k} TIMEOUT 120 WORKING_DIRECTORY ${WORK_DIR}/run_${k}
      RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
    if(NOT rc EQUAL 0)
      message(FATAL_ERROR "README block ${k} (first line: \"${block_${k}_first}\"; ${kind}) "
        "built but its run failed (${rc}):\n${out}\n${err}")
    endif()
    message(STATUS "block ${k} (${kind}): built and ran\n${out}")
  else()
    message(STATUS "block ${k} (${kind}): built (not run)")
  endif()
endforeach()
message(STATUS "all ${count} README ```cpp blocks build against the installed package")
