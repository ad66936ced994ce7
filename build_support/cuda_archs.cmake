# The GPU architectures mixprec's CUDA kernels are compiled for ([Note: CUDA archs]).
#
# Used two ways, so the build and the CI compile check agree:
#   include(build_support/cuda_archs.cmake)   CMakeLists.txt calls mixprec_cuda_archs()
#   cmake -DNVCC=/path/to/nvcc [-DMIXPREC_CUDA_ARCHS=AUTO] -P build_support/cuda_archs.cmake
#                                             prints the resolved list (.ci/cuda_compile_check.sh)
#
# [Note: CUDA archs]
# MIXPREC_CUDA_ARCHS=AUTO (the default) asks for machine code (SASS) for every current
# generation, MIXPREC_CUDA_GENERATIONS below: Turing 7.5 (T4), Ampere 8.0 (A100) and 8.6
# (A10, RTX 30xx), Ada 8.9 (L4, L40, RTX 40xx), Hopper 9.0 (H100, H200), Blackwell 10.0
# (B200) and 12.0 (RTX 50xx, RTX PRO), keeps those the installed nvcc can generate
# (`nvcc --list-gpu-code`: CUDA 12.0-12.7 stop at 9.0, CUDA 12.8 adds 10.0 and 12.0, CUDA 13
# drops everything before 7.5), and adds PTX for the newest kept one, which the driver
# compiles for any later GPU. A cubin for X.y runs on X.z with z >= y (8.0 code runs on an
# 8.7 Orin, 10.0 code on a 10.3 B300, 12.0 on a 12.1 GB10); a GPU of another major needs
# its own entry or PTX from an older arch. src/mixprec/cuda_arch.py applies the same rules
# when an engine is built for a GPU, to the list the extension reports (mixprec.build_info()["cuda_archs"]).
#
# The result is in CMake's CUDA_ARCHITECTURES form: "75-real" is SASS only, "120-virtual"
# PTX only, "120" both. An explicit MIXPREC_CUDA_ARCHS (e.g. "89" for one RTX 4090 box,
# which also builds faster) is used as given, after checking each entry against nvcc.

if(CMAKE_SCRIPT_MODE_FILE STREQUAL CMAKE_CURRENT_LIST_FILE)
  cmake_minimum_required(VERSION 3.18)  # IN_LIST; a project's include keeps its own policies
endif()

set(MIXPREC_CUDA_GENERATIONS 75 80 86 89 90 100 120)

# mixprec_cuda_archs(<out_var> <nvcc> <requested>): <requested> is AUTO or a list of
# CUDA_ARCHITECTURES entries; stops with an error naming the bad entry and the fix.
function(mixprec_cuda_archs out_var nvcc requested)
  execute_process(COMMAND "${nvcc}" --list-gpu-code
    OUTPUT_VARIABLE _codes ERROR_VARIABLE _err RESULT_VARIABLE _rc
    OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(NOT _rc EQUAL 0 OR NOT _codes MATCHES "sm_")
    message(FATAL_ERROR "mixprec: '${nvcc} --list-gpu-code' failed (${_rc}: ${_err}); "
      "mixprec needs nvcc >= 11 to pick the GPU architectures, or build without CUDA "
      "(MIXPREC_CUDA=OFF).")
  endif()
  string(REGEX MATCHALL "sm_[0-9]+[a-z]?" _codes "${_codes}")
  string(REPLACE "sm_" "" _supported "${_codes}")
  if(requested STREQUAL "" OR requested STREQUAL "AUTO")
    set(_kept "")
    foreach(_a IN LISTS MIXPREC_CUDA_GENERATIONS)
      if(_a IN_LIST _supported)
        list(APPEND _kept ${_a})
      endif()
    endforeach()
    if(NOT _kept)
      message(FATAL_ERROR "mixprec: ${nvcc} generates none of ${MIXPREC_CUDA_GENERATIONS} "
        "(it lists: ${_supported}); set MIXPREC_CUDA_ARCHS to archs it supports.")
    endif()
    list(LENGTH _kept _n)
    math(EXPR _last "${_n} - 1")
    set(_out "")
    foreach(_i RANGE ${_last})
      list(GET _kept ${_i} _a)
      if(_i EQUAL _last)
        list(APPEND _out "${_a}")        # SASS and PTX: forward compatibility
      else()
        list(APPEND _out "${_a}-real")
      endif()
    endforeach()
  else()
    set(_out "")
    foreach(_e IN LISTS requested)
      if(NOT _e MATCHES "^([0-9]+)([af]?)(-real|-virtual)?$")
        message(FATAL_ERROR "mixprec: MIXPREC_CUDA_ARCHS entry '${_e}' is not a compute "
          "capability: give numbers such as 75;86;89 (7.5, 8.6, 8.9; 'NN-real' for SASS "
          "only, 'NN-virtual' for PTX only), or AUTO. 'native'/'all' are refused: the "
          "extension must know which archs it holds (docs/building.md).")
      endif()
      # (--list-gpu-code leaves out the 90a/100f variants: the base arch stands for them)
      if(NOT "${CMAKE_MATCH_1}" IN_LIST _supported)
        message(FATAL_ERROR "mixprec: MIXPREC_CUDA_ARCHS entry '${_e}': ${nvcc} cannot "
          "generate sm_${CMAKE_MATCH_1} (it lists: ${_supported}). Drop it, "
          "or use a CUDA toolkit that has it.")
      endif()
      list(APPEND _out "${_e}")
    endforeach()
    if(NOT _out)
      message(FATAL_ERROR "mixprec: MIXPREC_CUDA_ARCHS is empty; give AUTO or a list such as 80;90")
    endif()
  endif()
  set(${out_var} "${_out}" PARENT_SCOPE)
endfunction()

# The same list in TORCH_CUDA_ARCH_LIST's form ("7.5;8.0;12.0+PTX"), so that torch's CMake
# config (Caffe2/public/cuda.cmake) asks for these archs instead of probing the GPUs.
function(mixprec_torch_arch_list out_var archs)
  set(_out "")
  foreach(_e IN LISTS archs)
    string(REGEX MATCH "^([0-9]+)([0-9])([af]?)(-real|-virtual)?$" _m "${_e}")
    set(_v "${CMAKE_MATCH_1}.${CMAKE_MATCH_2}${CMAKE_MATCH_3}")
    if(CMAKE_MATCH_4 STREQUAL "-real")
      list(APPEND _out "${_v}")
    else()
      list(APPEND _out "${_v}+PTX")  # torch's list has no PTX-only form; PTX is what counts
    endif()
  endforeach()
  set(${out_var} "${_out}" PARENT_SCOPE)
endfunction()

if(CMAKE_SCRIPT_MODE_FILE STREQUAL CMAKE_CURRENT_LIST_FILE)
  if(NOT NVCC)
    message(FATAL_ERROR "usage: cmake -DNVCC=/path/to/nvcc [-DMIXPREC_CUDA_ARCHS=AUTO] -P ${CMAKE_CURRENT_LIST_FILE}")
  endif()
  if(NOT DEFINED MIXPREC_CUDA_ARCHS)
    set(MIXPREC_CUDA_ARCHS AUTO)
  endif()
  mixprec_cuda_archs(_archs "${NVCC}" "${MIXPREC_CUDA_ARCHS}")
  execute_process(COMMAND "${CMAKE_COMMAND}" -E echo "${_archs}")
endif()
