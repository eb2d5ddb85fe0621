#pragma once
/// @file detail/id_table.hpp
/// Not public API. Maps seq_id <-> dense slot index for the caches. An id is (generation << 32 |
/// slot); releasing a slot bumps its generation, so a released id is rejected forever after
/// (until 2^32 reuses of the same slot), and a lookup is O(1) with no allocation.

#include <kvcache/error.hpp>
#include <kvcache/geometry.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

namespace kvcache::detail {

class id_table {
 public:
  /// max_slots: most live sequences at once (0: unbounded, slots grow on demand).
  explicit id_table(std::size_t max_slots = 0) : max_(max_slots) {
    generation_.reserve(max_slots);
    live_.reserve(max_slots);
    free_.reserve(max_slots);
  }

  /// A fresh id and its slot; errc::capacity_exceeded when max_slots sequences are live.
  /// Allocates only when an unbounded table grows (sequence creation, not the per-token path).
  [[nodiscard]] result<seq_id> acquire() {
    std::uint32_t slot;
    if (!free_.empty()) {
      slot = free_.back();
      free_.pop_back();
    } else {
      if ((max_ != 0 && generation_.size() >= max_) ||
          generation_.size() >= std::numeric_limits<std::uint32_t>::max())
        return fail(errc::capacity_exceeded, "create: every sequence slot is in use",
                    {{"max_sequences", static_cast<long long>(max_)}});
      slot = static_cast<std::uint32_t>(generation_.size());
      // Every allocation first (geometric growth), so that a refused one (std::bad_alloc) leaves
      // the table as it was; then release() never allocates either.
      const std::size_t n = generation_.size() + 1;
      if (!try_allocate([&] {
            if (generation_.capacity() < n) generation_.reserve(std::max(n, 2 * generation_.capacity()));
            if (live_.capacity() < n) live_.reserve(std::max(n, 2 * live_.capacity()));
            if (free_.capacity() < n) free_.reserve(std::max(n, 2 * free_.capacity()));
          }))
        return fail(errc::out_of_memory, "create: sequence table", {{"sequences", static_cast<long long>(n)}});
      generation_.push_back(0);
      live_.push_back(false);
    }
    live_[slot] = true;
    ++count_;
    return make_id(slot);
  }

  /// The slot of a live id, or errc::unknown_sequence naming it (`what` is the calling operation).
  [[nodiscard]] result<std::uint32_t> slot(seq_id id, std::string_view what) const {
    const auto slot = static_cast<std::uint32_t>(id.value & 0xffffffffu);
    const auto gen = static_cast<std::uint32_t>(id.value >> 32);
    if (slot >= generation_.size() || !live_[slot] || generation_[slot] != gen)
      return fail(errc::unknown_sequence, what, {{"seq", static_cast<long long>(id.value)}});
    return slot;
  }

  /// Releases a live id's slot (the caller checked it with slot()).
  void release(std::uint32_t slot) noexcept {
    live_[slot] = false;
    ++generation_[slot];
    free_.push_back(slot);  // capacity reserved: free_ never exceeds generation_.size()
    --count_;
  }

  [[nodiscard]] std::size_t live() const noexcept { return count_; }
  [[nodiscard]] std::size_t slots() const noexcept { return generation_.size(); }
  [[nodiscard]] bool is_live(std::uint32_t slot) const noexcept { return slot < live_.size() && live_[slot]; }
  [[nodiscard]] seq_id make_id(std::uint32_t slot) const noexcept {
    return seq_id{(static_cast<std::uint64_t>(generation_[slot]) << 32) | slot};
  }

 private:
  std::size_t max_;
  std::size_t count_ = 0;
  std::vector<std::uint32_t> generation_;
  std::vector<bool> live_;
  std::vector<std::uint32_t> free_;
};

}  // namespace kvcache::detail
