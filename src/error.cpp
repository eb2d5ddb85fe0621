// Error message formatting (the only place the library uses {fmt}).
#include <kvcache/error.hpp>

#include <fmt/format.h>

#include <iterator>

namespace kvcache {

error make_error(errc code, std::string_view what, std::initializer_list<error_arg> args) {
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
  return error{code, std::move(msg)};
}

}  // namespace kvcache
