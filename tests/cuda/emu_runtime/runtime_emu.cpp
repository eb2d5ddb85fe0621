// cuda/runtime.cu compiled by the host compiler against the emulated cuda_runtime.h of this
// directory (it holds no kernel), for the *_emulated test builds.
#include "runtime.cu"
