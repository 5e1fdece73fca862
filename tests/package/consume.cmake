# Script mode: install cpattn (find_package mode) or point at its sources (add_subdirectory
# mode), then configure, build and run the consumer project.
file(REMOVE_RECURSE ${WORK_DIR})
set(consumer_args -DCPATTN_CONSUME=${MODE})
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
foreach(step
    "${CMAKE_COMMAND};-S;${SOURCE_DIR}/tests/package/consumer;-B;${WORK_DIR}/build;-G;${GENERATOR};-DCMAKE_BUILD_TYPE=Release;${consumer_args}"
    "${CMAKE_COMMAND};--build;${WORK_DIR}/build"
    "${WORK_DIR}/build/consumer")
  execute_process(COMMAND ${step} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(rc)
    message(FATAL_ERROR "step failed (${rc}): ${step}\n${out}\n${err}")
  endif()
endforeach()
message(STATUS "consumer (${MODE}) ran: ${out}")
