# Configures asmem against a torch whose CMake config behaves as a CUDA build of torch does
# (it sets CMAKE_CUDA_ARCHITECTURES to OFF and appends -gencode flags for its own list to
# CMAKE_CUDA_FLAGS), then checks that the kernels' nvcc command still builds for the
# architectures asmem was asked for and for no architecture of torch's list.
#   cmake -DSOURCE_DIR= -DWORK_DIR= -DTORCH_DIR= -DGENERATOR= -DCUDA_COMPILER= -DARCHS=90a[,..]
#         -P torch_cuda_arch_test.cmake
foreach(v SOURCE_DIR WORK_DIR TORCH_DIR GENERATOR CUDA_COMPILER ARCHS)
  if(NOT DEFINED ${v})
    message(FATAL_ERROR "torch_cuda_arch_test: -D${v}= is required")
  endif()
endforeach()

string(REPLACE "," ";" ARCHS "${ARCHS}")  # comma-separated on the command line
file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}/torch")
# compute_35: an architecture no nvcc of CUDA 12 or 13 builds for, so it cannot be ours.
file(WRITE "${WORK_DIR}/torch/TorchConfig.cmake" "
include(\"${TORCH_DIR}/TorchConfig.cmake\")
set(CMAKE_CUDA_ARCHITECTURES OFF)
string(APPEND CMAKE_CUDA_FLAGS \" -gencode arch=compute_35,code=sm_35\")
")
file(WRITE "${WORK_DIR}/torch/TorchConfigVersion.cmake" "
include(\"${TORCH_DIR}/TorchConfigVersion.cmake\")
")
set(args -S "${SOURCE_DIR}" -B "${WORK_DIR}/build" -G "${GENERATOR}" -DASMEM_BUILD_TESTS=OFF
    -DASMEM_INSTALL=OFF -DASMEM_CUDA=ON "-DCMAKE_CUDA_COMPILER=${CUDA_COMPILER}" "-DTorch_DIR=${WORK_DIR}/torch")
# The architectures as one quoted argument: a list of several stays whole.
execute_process(COMMAND ${CMAKE_COMMAND} ${args} "-DCMAKE_CUDA_ARCHITECTURES=${ARCHS}"
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "configure failed (${rc}):\n${out}\n${err}")
endif()
# A dry run that prints the commands: ninja -n -v; make -n prints them as it is.
if(GENERATOR MATCHES "Ninja")
  set(dry -n -v)
else()
  set(dry -n)
endif()
execute_process(COMMAND ${CMAKE_COMMAND} --build "${WORK_DIR}/build" --target asmem_kernels -- ${dry}
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "listing the kernels' commands failed (${rc}):\n${out}\n${err}")
endif()
string(REGEX MATCH "[^\n]*nvcc[^\n]*merge_cuda\\.cu[^\n]*" line "${out}")
if(line STREQUAL "")
  message(FATAL_ERROR "no nvcc command for merge_cuda.cu in:\n${out}")
endif()
if(line MATCHES "compute_35")
  message(FATAL_ERROR "the kernels build for torch's architecture list: ${line}")
endif()
# Each architecture named by number (90a, 90a-real, 90-virtual) appears as compute_<number>;
# all, all-major and native name none.
foreach(arch ${ARCHS})
  string(REGEX REPLACE "-(real|virtual)$" "" number "${arch}")
  if(number MATCHES "^[0-9]+[a-z]?$" AND NOT line MATCHES "compute_${number}")
    message(FATAL_ERROR "the kernels do not build for ${arch}: ${line}")
  endif()
endforeach()
file(REMOVE_RECURSE "${WORK_DIR}")
message(STATUS "the kernels build for ${ARCHS} beside a torch that sets its own architectures")
