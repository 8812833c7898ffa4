// plugins/tests/emulation_include/cuda_runtime_api.h
//
// Owns: the stand-in for the CUDA runtime header in -DEB_KERNEL_EMULATION builds of the
// TensorRT-facing code (the TensorRT headers and attention_plugin.cpp include
// <cuda_runtime_api.h>). Put this folder on the include path ahead of the CUDA toolkit; the
// types and functions come from cuda_emulation.h (host memory stands in for device memory).
#pragma once
#include "../cuda_emulation.h"
