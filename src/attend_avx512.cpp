// attend() pieces compiled with avx512 flags: the online-softmax step (attend_softmax.inl).
#include "attend_internal.hpp"

#include <cstddef>
#include <cstdint>

namespace kvcache::detail::attend_avx512 {
#include "attend_softmax.inl"
}  // namespace kvcache::detail::attend_avx512
