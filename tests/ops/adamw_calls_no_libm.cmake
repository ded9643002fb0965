# The CPU AdamW step loop (dtensor/kernels/cpu/adamw.cc) must vectorise: it calls no math
# library function, since one call per element stops the compiler vectorising the loop.
# std::fmax in SqrtF did (an fmaxf call per element): the GPT-2 124M step took 1014 ms instead
# of 139 ms (clip_step_bench). The only libm call allowed is std::pow, once per step for the
# bias corrections.
#   cmake -DNM=nm -DOBJECTS="a.o|b.o|..." -P adamw_calls_no_libm.cmake
string(REPLACE "|" ";" objects "${OBJECTS}")
set(object "")
foreach(o IN LISTS objects)
  if(o MATCHES "/adamw\\.cc\\.o(bj)?$")
    set(object "${o}")
  endif()
endforeach()
if(object STREQUAL "")
  message(FATAL_ERROR "no adamw.cc object among: ${OBJECTS}")
endif()
execute_process(COMMAND "${NM}" -u "${object}" OUTPUT_VARIABLE undefined RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "${NM} -u ${object} failed (${rc})")
endif()
set(found "")
foreach(fn IN ITEMS sqrtf sqrt fmaxf fmax fminf fmin expf exp logf log powf fabsf)
  if(undefined MATCHES "(^|\n)[ \tU]*${fn}(@[^\n]*)?(\n|$)")
    list(APPEND found "${fn}")
  endif()
endforeach()
if(found)
  message(FATAL_ERROR "${object} calls ${found}: the AdamW loop would not vectorise")
endif()
message(STATUS "${object}: no math library call but pow")
