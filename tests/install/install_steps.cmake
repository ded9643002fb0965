# Steps shared by the install-labelled test scripts (run_consumer.cmake, readme_blocks.cmake):
#   include(install_steps.cmake)
#   run_step(<command> <args>...)              # runs it; fails the test with its output
#   install_dtensor(<build dir> <prefix>)       # cmake --install into a scratch prefix

function(run_step)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  message(STATUS "${out}")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "step failed (${rc}): ${ARGN}\n${out}\n${err}")
  endif()
endfunction()

function(install_dtensor build_dir prefix)
  run_step(${CMAKE_COMMAND} --install ${build_dir} --prefix ${prefix})
  if(NOT EXISTS ${prefix}/include/dtensor/tensor/tensor.h)
    message(FATAL_ERROR "headers not installed under include/dtensor/")
  endif()
endfunction()
