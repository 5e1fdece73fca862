include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

install(TARGETS cpattn EXPORT cpattnTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
# train.hpp belongs to the training example (cpattn_train), which is not installed.
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/cpattn DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
        PATTERN train.hpp EXCLUDE)
install(EXPORT cpattnTargets NAMESPACE cpattn::
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/cpattn)
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
