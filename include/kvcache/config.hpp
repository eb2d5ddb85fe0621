#pragma once
/// @file config.hpp
/// Version numbers and the one portability macro shared by host and CUDA code.

/// Marks functions usable from both host code and CUDA device code. Expands to nothing under a
/// plain C++ compiler, so view and index headers compile unchanged under g++, clang and nvcc.
#if defined(__CUDACC__)
#define KVCACHE_HOST_DEVICE __host__ __device__
#else
#define KVCACHE_HOST_DEVICE
#endif

#define KVCACHE_VERSION_MAJOR 0
#define KVCACHE_VERSION_MINOR 1
#define KVCACHE_VERSION_PATCH 0

/// True when the translation unit is compiled with C++ exceptions enabled.
#if defined(__cpp_exceptions) || defined(__EXCEPTIONS)
#define KVCACHE_HAS_EXCEPTIONS 1
#else
#define KVCACHE_HAS_EXCEPTIONS 0
#endif
