// Error message formatting (the only place the library uses {fmt}).
#include <kvcache/error.hpp>

#include <fmt/format.h>

#include <iterator>
#include <new>
#include <string>

namespace kvcache {

namespace {
std::string format_message(std::string_view what, std::initializer_list<error_arg> args) {
  std::string msg;
  fmt::format_to(std::back_inserter(msg), "{}", what);
  if (args.size() != 0) {
    msg += " (";
    bool first = true;
    for (const error_arg& a : args) {
      fmt::format_to(std::back_inserter(msg), "{}{}={}", first ? "" : ", ", a.name, a.value);
      first = false;
    }
    msg += ')';
  }
  return msg;
}
}  // namespace

error make_error(errc code, std::string_view what, std::initializer_list<error_arg> args) {
#if KVCACHE_HAS_EXCEPTIONS
  // Out of memory, the message may not fit: the error keeps its code, with as much of `what` as
  // a string holds without allocating (its small-string buffer), else no message. A failing call
  // still returns its typed error rather than throwing.
  try {
    return error{code, format_message(what, args)};
  } catch (const std::bad_alloc&) {
    try {
      return error{code, std::string(what.substr(0, std::string().capacity()))};
    } catch (const std::bad_alloc&) {
      return error{code, std::string()};
    }
  }
#else
  return error{code, format_message(what, args)};
#endif
}

}  // namespace kvcache
