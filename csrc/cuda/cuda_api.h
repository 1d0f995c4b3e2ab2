// The CUDA runtime functions the prefetch engine calls, declared from their documented C ABI, so
// the build needs only the libcudart that every CUDA build of PyTorch ships, not the toolkit's
// headers: CUDA 13's pip wheels carry cuda_runtime_api.h without the crt/ headers it includes, and
// most users have no toolkit at all. These signatures and values are unchanged since CUDA 4;
// tests/native/test_native_copier.py checks each against the real header where one is present.
#pragma once
#include <cstddef>

#ifndef MOECHAT_CHECK_AGAINST_TOOLKIT  // the test brings the real header's types and values instead
typedef int cudaError_t;  // enum cudaError: 0 is success
typedef struct CUstream_st* cudaStream_t;
typedef struct CUevent_st* cudaEvent_t;
typedef int cudaMemcpyKind;  // enum cudaMemcpyKind
#endif

extern "C" {  // redeclared beside the real header, a signature that differs fails to compile

cudaError_t cudaSetDevice(int device);
cudaError_t cudaGetDevice(int* device);
const char* cudaGetErrorString(cudaError_t error);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int flags);
cudaError_t cudaStreamDestroy(cudaStream_t stream);
cudaError_t cudaStreamSynchronize(cudaStream_t stream);
cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int flags);
cudaError_t cudaEventDestroy(cudaEvent_t event);
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream);
cudaError_t cudaEventQuery(cudaEvent_t event);
cudaError_t cudaEventSynchronize(cudaEvent_t event);
cudaError_t cudaHostAlloc(void** ptr, size_t bytes, unsigned int flags);
cudaError_t cudaFreeHost(void* ptr);
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, cudaStream_t stream);
}

#ifndef MOECHAT_CHECK_AGAINST_TOOLKIT
constexpr cudaError_t cudaSuccess = 0;
constexpr cudaError_t cudaErrorNotReady = 600;
constexpr unsigned int cudaStreamNonBlocking = 0x01;
constexpr unsigned int cudaEventBlockingSync = 0x01;
constexpr unsigned int cudaEventDisableTiming = 0x02;
constexpr unsigned int cudaHostAllocDefault = 0x00;
constexpr cudaMemcpyKind cudaMemcpyHostToDevice = 1;
#endif
