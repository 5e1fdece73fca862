include(CMakePackageConfigHelpers)

# Two export sets, so that the core component loads without MPI: cpattnCoreTargets.cmake
# (MPI-free layers, cpattn::core) and cpattnMpiTargets.cmake (comm, cp, cpattn::mpi and the
# umbrella cpattn::cpattn), which refers to the core targets.
set(_cpattn_dirs
    ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
    LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
    INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(TARGETS cpattn_common cpattn_layout cpattn_plan cpattn_kernels cpattn_io cpattn_mesh cpattn_pipeline
                cpattn_moe cpattn_sim cpattn_core
        EXPORT cpattnCoreTargets ${_cpattn_dirs})
install(EXPORT cpattnCoreTargets NAMESPACE cpattn::
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/cpattn)
set(_cpattn_mpi_headers)
if(CPATTN_WITH_MPI)
  install(TARGETS cpattn_comm cpattn_cp cpattn_moe_ep cpattn_executor cpattn_mpi cpattn EXPORT cpattnMpiTargets ${_cpattn_dirs})
  install(EXPORT cpattnMpiTargets NAMESPACE cpattn::
          DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/cpattn)
else()
  set(_cpattn_mpi_headers PATTERN comm.hpp EXCLUDE PATTERN cp.hpp EXCLUDE PATTERN moe_ep.hpp EXCLUDE PATTERN executor.hpp EXCLUDE
      PATTERN cpattn.hpp EXCLUDE)
endif()

# train.hpp and train_config.hpp belong to the training example (cpattn_train), which is not installed.
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/cpattn DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
        PATTERN train.hpp EXCLUDE PATTERN train_config.hpp EXCLUDE PATTERN *.in EXCLUDE ${_cpattn_mpi_headers})
install(FILES ${PROJECT_BINARY_DIR}/include/cpattn/version.hpp
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/cpattn)

configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/cpattnConfig.cmake.in
  ${PROJECT_BINARY_DIR}/cpattnConfig.cmake
  INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/cpattn)
write_basic_package_version_file(${PROJECT_BINARY_DIR}/cpattnConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/cpattnConfig.cmake ${PROJECT_BINARY_DIR}/cpattnConfigVersion.cmake
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/cpattn)
if(CPATTN_BUILD_TOOLS)
  install(TARGETS cpattn_cli RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
endif()
