# Script mode: install cpattn (find_package mode) or point at its sources (add_subdirectory
# mode), then configure, build and run the consumer project for PART (core or full; the full
# consumer is an MPI program, run through MPIEXEC -np 1).
file(REMOVE_RECURSE ${WORK_DIR})
set(consumer_args -DCPATTN_CONSUME=${MODE} -DCPATTN_PART=${PART})
if(MODE STREQUAL "find_package")
  execute_process(COMMAND ${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${WORK_DIR}/prefix
                  RESULT_VARIABLE rc OUTPUT_QUIET)
  if(rc)
    message(FATAL_ERROR "install failed: ${rc}")
  endif()
  list(APPEND consumer_args -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix)
else()
  list(APPEND consumer_args -DCPATTN_SOURCE_DIR=${SOURCE_DIR})
endif()
# add_subdirectory compiles the whole library inside the consumer's build: unoptimized (no
# build type), since what is tested is that it builds, links and runs, and -O3 took 2.6x the
# time for the kernels. The installed package (find_package) is the ci build's, optimized.
set(build_type Release)
if(MODE STREQUAL "add_subdirectory")
  set(build_type "")
endif()
set(run "${WORK_DIR}/build/consumer")
if(PART STREQUAL "full")
  set(run "${MPIEXEC};-np;1;${run}")
endif()
foreach(step
    "${CMAKE_COMMAND};-S;${SOURCE_DIR}/tests/package/consumer;-B;${WORK_DIR}/build;-G;${GENERATOR};-DCMAKE_BUILD_TYPE=${build_type};${consumer_args}"
    "${CMAKE_COMMAND};--build;${WORK_DIR}/build"
    "${run}")
  execute_process(COMMAND ${step} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(rc)
    message(FATAL_ERROR "step failed (${rc}): ${step}\n${out}\n${err}")
  endif()
endforeach()
message(STATUS "consumer (${MODE}, ${PART}) ran: ${out}")
