# What `cmake --install` puts into a prefix, and the Debian package `cpack -G DEB` makes of it
# (docs/install.md says what each package contains):
#   bin/cohort                                  the launcher and tool (the in-tree build, static)
#   <libdir>/libcohort.so.<version>             every layer a program calls (communicators, store,
#                                               collectives, GPU, C++ data-parallel training,
#                                               parameter server), one shared library
#   <libdir>/libcohort_torch.so.<version>       cohort::torch::DistributedDataParallel, DistributedSGD
#                                               (when libtorch was found)
#   include/cohort/                             the public headers only (src/ stays private)
#   <libdir>/cmake/cohort/                      find_package(cohort): cohort::cohort, cohort::torch
#   <libdir>/pkgconfig/cohort.pc                pkg-config --cflags --libs cohort
#   lib/python3/dist-packages/                  cohort_torch, cohort_ps (Debian's place for them)
#   libexec/cohort/fashion_mnist                the main job's training program
#   share/man/man1/cohort.1, share/doc/cohort/  the manual page and the docs
# The shared libraries are linked from the layers' own objects (no second compile). In this tree
# every program keeps linking the static layers; nothing links both.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(COHORT_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/cohort)
set(COHORT_EXAMPLES_DIR ${CMAKE_INSTALL_LIBEXECDIR}/cohort)

# ---- libcohort.so: every layer but the launcher's (which only the tool uses) ----
set(cohort_library_objects "")
foreach(layer IN LISTS COHORT_PRESENT_LAYERS)
  if(NOT layer STREQUAL "cohort_launch")
    list(APPEND cohort_library_objects $<TARGET_OBJECTS:${layer}>)
  endif()
endforeach()
# lib<name>.so.<version>, exported as cohort::<export name>; 0.x: the ABI may change with each minor.
function(cohort_installed_library target name export_name)
  set_target_properties(${target} PROPERTIES
    OUTPUT_NAME ${name}
    EXPORT_NAME ${export_name}
    VERSION ${PROJECT_VERSION}
    SOVERSION ${PROJECT_VERSION_MAJOR}.${PROJECT_VERSION_MINOR}
    LIBRARY_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/lib)
endfunction()

add_library(cohort_shared SHARED ${cohort_library_objects})
cohort_installed_library(cohort_shared cohort cohort)
# The layers' own dependencies (none of them appears in a public header).
target_link_libraries(cohort_shared PRIVATE fmt::fmt OpenSSL::Crypto Threads::Threads ${CMAKE_DL_LIBS})
target_include_directories(cohort_shared INTERFACE
  $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}/include>
  $<BUILD_INTERFACE:${CMAKE_BINARY_DIR}/generated>
  $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>)
target_compile_features(cohort_shared INTERFACE cxx_std_20)
add_dependencies(cohort_shared cohort_build_info)

install(TARGETS cohort_shared EXPORT cohortTargets
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT runtime NAMELINK_COMPONENT dev)
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/cohort DESTINATION ${CMAKE_INSTALL_INCLUDEDIR} COMPONENT dev)
install(FILES ${CMAKE_BINARY_DIR}/generated/cohort/version.h DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/cohort
  COMPONENT dev)
install(EXPORT cohortTargets NAMESPACE cohort:: DESTINATION ${COHORT_CMAKE_DIR} COMPONENT dev)

# ---- libcohort_torch.so: the libtorch integration, on libcohort.so ----
set(COHORT_INSTALLS_TORCH OFF)
if(TARGET cohort_libtorch)
  set(COHORT_INSTALLS_TORCH ON)
  add_library(cohort_torch_shared SHARED $<TARGET_OBJECTS:cohort_libtorch>)
  cohort_installed_library(cohort_torch_shared cohort_torch torch)
  target_link_libraries(cohort_torch_shared PUBLIC cohort_shared torch PRIVATE fmt::fmt)
  target_include_directories(cohort_torch_shared INTERFACE
    $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}/integrations/torch/include>
    $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>)
  install(TARGETS cohort_torch_shared EXPORT cohortTorchTargets
    LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT runtime NAMELINK_COMPONENT dev)
  install(DIRECTORY ${PROJECT_SOURCE_DIR}/integrations/torch/include/cohort DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
    COMPONENT dev)
  install(EXPORT cohortTorchTargets NAMESPACE cohort:: DESTINATION ${COHORT_CMAKE_DIR} COMPONENT dev)
endif()
if(TARGET fashion_mnist)
  install(TARGETS fashion_mnist RUNTIME DESTINATION ${COHORT_EXAMPLES_DIR} COMPONENT runtime)
endif()

# ---- find_package(cohort) and pkg-config ----
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/cohortConfig.cmake.in
  ${CMAKE_BINARY_DIR}/cohortConfig.cmake INSTALL_DESTINATION ${COHORT_CMAKE_DIR})
write_basic_package_version_file(${CMAKE_BINARY_DIR}/cohortConfigVersion.cmake COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_BINARY_DIR}/cohortConfig.cmake ${CMAKE_BINARY_DIR}/cohortConfigVersion.cmake
  DESTINATION ${COHORT_CMAKE_DIR} COMPONENT dev)
# The .pc file finds its prefix from its own place (any --prefix works): <libdir>/pkgconfig is as
# many folders below the prefix as <libdir> has parts, plus one.
string(REGEX REPLACE "[^/]+" ".." cohort_pc_up "${CMAKE_INSTALL_LIBDIR}/pkgconfig")
configure_file(${PROJECT_SOURCE_DIR}/cmake/cohort.pc.in ${CMAKE_BINARY_DIR}/cohort.pc @ONLY)
install(FILES ${CMAKE_BINARY_DIR}/cohort.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig COMPONENT dev)

# ---- the manual page and the docs ----
install(FILES ${PROJECT_SOURCE_DIR}/docs/cohort.1 DESTINATION ${CMAKE_INSTALL_MANDIR}/man1 COMPONENT runtime)
install(FILES ${PROJECT_SOURCE_DIR}/README.md DESTINATION ${CMAKE_INSTALL_DOCDIR} COMPONENT runtime)
install(DIRECTORY ${PROJECT_SOURCE_DIR}/docs/ DESTINATION ${CMAKE_INSTALL_DOCDIR} COMPONENT runtime
  FILES_MATCHING PATTERN "*.md")

# ---- cpack -G DEB: one package, cohort_<version>_<arch>.deb ----
# Its dependencies are Debian's package names: dpkg-shlibdeps finds the libraries' packages (libfmt9,
# libssl3, libtorch2.0, ...); the Python modules need python3-torch, which no ELF dependency names.
set(CPACK_PACKAGE_NAME cohort)
set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY "distributed training runtime: launcher, rendezvous store, collectives, DDP")
set(CPACK_PACKAGE_DESCRIPTION "cohort takes a training program from one process to many processes and hosts:
`cohort run` launches the workers (torchrun and mpirun compatible), a rendezvous store introduces them,
TCP and shared-memory collectives move their gradients, and a C++ data-parallel layer and a PyTorch
backend (backend='cohort') keep the models in step.")
set(CPACK_PACKAGE_CONTACT "cohort developers <cohort@localhost>")
set(CPACK_GENERATOR DEB)
set(CPACK_PACKAGING_INSTALL_PREFIX /usr)
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)
set(CPACK_DEBIAN_PACKAGE_SECTION devel)
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)
set(cohort_deb_depends "")
if(TARGET cohort_torch)
  set(cohort_deb_depends "python3, python3-torch")
endif()
set(CPACK_DEBIAN_PACKAGE_DEPENDS "${cohort_deb_depends}")
# ssh: the launcher's fan-out to other hosts; the data set: the main job's training data.
set(CPACK_DEBIAN_PACKAGE_RECOMMENDS "openssh-client, dataset-fashion-mnist")
set(CPACK_DEBIAN_PACKAGE_SUGGESTS "slurm-client, openmpi-bin")
set(CPACK_STRIP_FILES OFF)
include(CPack)
