// The chained prefix hash of paged_cache's blocks: XXH3-64 (Debian's libxxhash-dev, inlined here
// so no library is linked and no public header includes xxhash.h).
#include <kvcache/block_pool.hpp>

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace kvcache {

std::uint64_t prefix_hash(std::uint64_t parent, std::span<const std::int32_t> tokens) noexcept {
  // Seeding with the parent hash chains the blocks: equal hashes imply (with 64-bit probability)
  // equal token ids in every block from the start of the sequence.
  return XXH3_64bits_withSeed(tokens.data(), tokens.size_bytes(), parent);
}

}  // namespace kvcache
