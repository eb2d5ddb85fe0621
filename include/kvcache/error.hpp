#pragma once
/// @file error.hpp
/// Typed errors and the expected-like `result<T>` returned by every call an engine must handle.

#include <kvcache/config.hpp>

#include <cassert>
#include <cstdint>
#include <initializer_list>
#include <new>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>

namespace kvcache {

/// Error category. Each failing call reports one of these plus a message naming the offending value.
enum class errc : std::uint8_t {
  invalid_argument = 1,  ///< a parameter outside its documented domain (zero geometry, bad option)
  bad_shape,             ///< K/V/query sizes do not match the geometry and reserved token count
  layer_out_of_range,    ///< layer index >= geometry.layers
  unknown_sequence,      ///< sequence id never created, or already released
  capacity_exceeded,     ///< reserve past a sequence's or cache's token capacity
  pool_exhausted,        ///< the block pool has no free (or evictable) block left
  not_reserved,          ///< write or commit without a pending reservation
  reservation_pending,   ///< reserve/truncate/fork while a reservation is still open
  incomplete_write,      ///< commit before every layer of the reservation was written
  out_of_range,          ///< a token count or index past the sequence's length
  overflow,              ///< a byte count that does not fit in size_t
  unsupported,           ///< the requested ISA/device/format is not available here
  out_of_memory,         ///< the allocator refused the request
  device_error,          ///< the CUDA runtime reported an error
};

/// The enumerator's name, e.g. "pool_exhausted".
[[nodiscard]] constexpr std::string_view to_string(errc e) noexcept {
  switch (e) {
    case errc::invalid_argument: return "invalid_argument";
    case errc::bad_shape: return "bad_shape";
    case errc::layer_out_of_range: return "layer_out_of_range";
    case errc::unknown_sequence: return "unknown_sequence";
    case errc::capacity_exceeded: return "capacity_exceeded";
    case errc::pool_exhausted: return "pool_exhausted";
    case errc::not_reserved: return "not_reserved";
    case errc::reservation_pending: return "reservation_pending";
    case errc::incomplete_write: return "incomplete_write";
    case errc::out_of_range: return "out_of_range";
    case errc::overflow: return "overflow";
    case errc::unsupported: return "unsupported";
    case errc::out_of_memory: return "out_of_memory";
    case errc::device_error: return "device_error";
  }
  return "unknown";
}

/// An error: a category and a human-readable message naming the offending value(s).
struct error {
  errc code{};
  std::string message;
};

/// One named integer shown in an error message, e.g. {"layer", 40}.
struct error_arg {
  std::string_view name;
  long long value;
};

/// Builds an error whose message reads "<what> (name=value, ...)". Compiled in kvcache::cpu
/// (formatted with {fmt}); the only allocation it does is the message itself.
[[nodiscard]] error make_error(errc code, std::string_view what,
                               std::initializer_list<error_arg> args = {});

/// Tag wrapper used to construct a failed result, as std::unexpected does.
struct unexpected {
  error err;
  explicit unexpected(error e) : err(std::move(e)) {}
  unexpected(errc code, std::string message) : err{code, std::move(message)} {}
};

/// Expected-like result: holds a T or an error. Names follow std::expected (has_value, value,
/// error). Accessing value() of a failed result (or error() of a successful one) is a programming
/// error, checked by assert; the library never throws, so it works for -fno-exceptions consumers.
template <class T>
class [[nodiscard]] result {
 public:
  using value_type = T;

  template <class U = T>
    requires std::is_constructible_v<T, U&&> && (!std::is_same_v<std::remove_cvref_t<U>, result>) &&
             (!std::is_same_v<std::remove_cvref_t<U>, unexpected>)
  result(U&& v) : state_(std::in_place_index<0>, std::forward<U>(v)) {}  // NOLINT: implicit like expected
  result(unexpected u) : state_(std::in_place_index<1>, std::move(u.err)) {}  // NOLINT

  [[nodiscard]] bool has_value() const noexcept { return state_.index() == 0; }
  explicit operator bool() const noexcept { return has_value(); }

  [[nodiscard]] T& value() & { assert(has_value()); return *std::get_if<0>(&state_); }
  [[nodiscard]] const T& value() const& { assert(has_value()); return *std::get_if<0>(&state_); }
  [[nodiscard]] T&& value() && { assert(has_value()); return std::move(*std::get_if<0>(&state_)); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

  [[nodiscard]] const kvcache::error& error() const& { assert(!has_value()); return *std::get_if<1>(&state_); }
  [[nodiscard]] kvcache::error&& error() && { assert(!has_value()); return std::move(*std::get_if<1>(&state_)); }

  template <class U>
  [[nodiscard]] T value_or(U&& fallback) const& {
    return has_value() ? value() : static_cast<T>(std::forward<U>(fallback));
  }

 private:
  std::variant<T, kvcache::error> state_;
};

/// result<void>: success or an error.
template <>
class [[nodiscard]] result<void> {
 public:
  using value_type = void;
  result() = default;
  result(unexpected u) : err_(std::move(u.err)), ok_(false) {}  // NOLINT

  [[nodiscard]] bool has_value() const noexcept { return ok_; }
  explicit operator bool() const noexcept { return ok_; }
  void value() const { assert(ok_); }
  [[nodiscard]] const kvcache::error& error() const& { assert(!ok_); return err_; }
  [[nodiscard]] kvcache::error&& error() && { assert(!ok_); return std::move(err_); }

 private:
  kvcache::error err_{};
  bool ok_ = true;
};

/// Shorthand: a failed result of any type, `return fail(errc::bad_shape, "write: K", {{"size", n}});`.
[[nodiscard]] inline unexpected fail(errc code, std::string_view what,
                                     std::initializer_list<error_arg> args = {}) {
  return unexpected(make_error(code, what, args));
}

namespace detail {
/// Calls make() and returns what it returns; where the standard allocator refuses memory inside it
/// (std::bad_alloc, in a program with exceptions), errc::out_of_memory naming `what` instead. The
/// caches' create() builds their bookkeeping (sequence and block tables: standard containers
/// sized by the configuration) through it, so that a configuration too large for memory is an
/// error, not an exception. Without exceptions a refused allocation ends the program, as in any
/// standard container.
template <class F>
auto allocation_guard(std::string_view what, F&& make) -> decltype(make()) {
#if KVCACHE_HAS_EXCEPTIONS
  try {
    return make();
  } catch (const std::bad_alloc&) {
    return fail(errc::out_of_memory, what);
  }
#else
  (void)what;
  return make();
#endif
}

/// Runs grow(), which only allocates (a table's capacity) and changes nothing else a caller can
/// see; whether it could: false where the standard allocator refused (std::bad_alloc, in a program
/// with exceptions), so that the call can fail with errc::out_of_memory, nothing changed.
template <class F>
[[nodiscard]] bool try_allocate(F&& grow) {
#if KVCACHE_HAS_EXCEPTIONS
  try {
    grow();
    return true;
  } catch (const std::bad_alloc&) {
    return false;
  }
#else
  grow();
  return true;
#endif
}

/// fail() whose message is `parts` joined (make_error's "(name=value, ...)" follows); where the
/// joined string cannot be allocated, the first part alone, cut short by make_error as needed.
[[nodiscard]] inline unexpected fail_joined(errc code, std::initializer_list<std::string_view> parts,
                                            std::initializer_list<error_arg> args = {}) {
  std::string joined;
  if (!try_allocate([&] {
        for (std::string_view p : parts) joined += p;
      }))
    return fail(code, parts.size() != 0 ? *parts.begin() : std::string_view(), args);
  return fail(code, joined, args);
}
}  // namespace detail

}  // namespace kvcache

/// Propagates a failed result<...> out of the enclosing function returning result<...>.
#define KVCACHE_TRY(expr)                                                   \
  do {                                                                      \
    auto&& kvcache_try_r_ = (expr);                                         \
    if (!kvcache_try_r_.has_value())                                        \
      return ::kvcache::unexpected(std::move(kvcache_try_r_).error());      \
  } while (false)
