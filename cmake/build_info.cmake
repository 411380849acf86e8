# Run at every build (the `cohort_build_info` target): writes OUT, a C++ source that defines the
# commit this build was made from, and rewrites it only when the commit changed, so an unchanged tree
# rebuilds nothing. The commit comes from -DCOMMIT=... when the packager gives one, else from
# `git describe` of SRC (a tag, or the abbreviated hash; "-dirty" when the tree had changes), else
# "unknown" (a source tree without git).
#   cmake -DSRC=<source dir> -DOUT=<file> [-DCOMMIT=<text>] -P build_info.cmake
if(NOT COMMIT)
  execute_process(COMMAND git -C "${SRC}" describe --always --dirty --tags --abbrev=12
                  OUTPUT_VARIABLE COMMIT RESULT_VARIABLE rc ERROR_QUIET OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(NOT rc EQUAL 0 OR COMMIT STREQUAL "")
    set(COMMIT "unknown")
  endif()
endif()
set(text "// Generated at build time by cmake/build_info.cmake; do not edit.\n#include \"common/build_info.h\"\n\nnamespace cohort::build {\nconst char* commit() { return \"${COMMIT}\"; }\n}  // namespace cohort::build\n")
if(EXISTS "${OUT}")
  file(READ "${OUT}" old)
else()
  set(old "")
endif()
if(NOT old STREQUAL text)
  file(WRITE "${OUT}" "${text}")
endif()
