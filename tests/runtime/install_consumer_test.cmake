# Installs asmem (component runtime) into a temporary prefix, then configures, builds and
# runs examples/consumer against it, as an outside project would.
#   cmake -DBUILD_DIR= -DSOURCE_DIR= -DWORK_DIR= -DSYNTH= -DGENERATOR= -DCXX= [-DLAUNCHER=]
#         [-DCUDA_COMPILER=] -P install_consumer_test.cmake
foreach(v BUILD_DIR SOURCE_DIR WORK_DIR SYNTH GENERATOR CXX)
  if(NOT DEFINED ${v})
    message(FATAL_ERROR "install_consumer_test: -D${v}= is required")
  endif()
endforeach()

function(run what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${what} failed (${rc}):\n${out}\n${err}")
  endif()
  set(last_output "${out}" PARENT_SCOPE)
endfunction()

file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")
set(prefix "${WORK_DIR}/prefix")
run("install" ${CMAKE_COMMAND} --install "${BUILD_DIR}" --prefix "${prefix}" --component runtime)
if(NOT DEFINED LIBDIR)
  set(LIBDIR lib)
endif()
foreach(f ${LIBDIR}/cmake/asmem/asmemConfig.cmake ${LIBDIR}/cmake/asmem/asmemConfigVersion.cmake
          ${LIBDIR}/cmake/asmem/asmemTargets.cmake include/asmem/runtime.h include/asmem/decode.h include/asmem/reuse.h
          ${LIBDIR}/libasmem_runtime.a)
  if(NOT EXISTS "${prefix}/${f}")
    message(FATAL_ERROR "not installed: ${prefix}/${f}")
  endif()
endforeach()
# Fails naming the first file of the glob `pattern` whose text matches `regex`.
function(refuse_matching pattern regex what)
  file(GLOB files "${pattern}")
  foreach(f ${files})
    file(READ "${f}" text)
    if(text MATCHES "${regex}")
      message(FATAL_ERROR "${f} ${what}: ${CMAKE_MATCH_0}")
    endif()
  endforeach()
endfunction()
# The exported targets name no library file of the build host (a consumer elsewhere has
# its own): only the prefix's own files, and other packages' targets.
refuse_matching("${prefix}/${LIBDIR}/cmake/asmem/asmemTargets*.cmake" "\"/[^\"$]*\\.(so|a)(\\.[0-9]+)*\""
                "names a library file of the build host")
# Installed public headers must not need torch, protobuf or device code.
refuse_matching("${prefix}/include/asmem/*.h"
                "#include [<\"](torch|ATen|c10|google/protobuf)|__global__ +void|\\.pb\\.h"
                "exposes torch / protobuf / device code")

run("synthetic dictionary" "${SYNTH}" "${WORK_DIR}/test.asmd" 3 6 2 8 11 3 7 1)

set(cfg -S "${SOURCE_DIR}/examples/consumer" -B "${WORK_DIR}/build" -G "${GENERATOR}"
    -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH=${prefix} -DCMAKE_CXX_COMPILER=${CXX})
if(LAUNCHER)
  list(APPEND cfg -DCMAKE_CXX_COMPILER_LAUNCHER=${LAUNCHER})
endif()
if(CUDA_COMPILER)
  get_filename_component(cuda_bin "${CUDA_COMPILER}" DIRECTORY)
  get_filename_component(cuda_root "${cuda_bin}" DIRECTORY)
  list(APPEND cfg -DCUDAToolkit_ROOT=${cuda_root})
endif()
run("configure consumer" ${CMAKE_COMMAND} ${cfg})
run("build consumer" ${CMAKE_COMMAND} --build "${WORK_DIR}/build")
run("run consumer" "${WORK_DIR}/build/asmem_consumer" "${WORK_DIR}/test.asmd")
message(STATUS "${last_output}")
if(NOT last_output MATCHES "decode ok" OR NOT last_output MATCHES "mac ok")
  message(FATAL_ERROR "consumer did not print 'decode ok' and 'mac ok':\n${last_output}")
endif()
file(REMOVE_RECURSE "${WORK_DIR}")
