// cpattn's one error type and its checks.
//
// CPATTN_CHECK(cond, msg...) is always on: when `cond` is false it throws cpattn::Error whose
// message is "file:line: " followed by the streamed message parts, which should name the
// argument, the rule it broke and the values that broke it:
//
//   CPATTN_CHECK(cp >= 1, "cp must be >= 1, got ", cp);
//
// CPATTN_DASSERT(cond) checks internal invariants in debug builds only. Neither may have side
// effects in its condition.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace cpattn {

// what() is "file:line: message"; message() is the message alone, for a command line that
// prints one line to its user.
class Error : public std::runtime_error {
 public:
  Error(const std::string& location, const std::string& msg)
      : std::runtime_error(location.empty() ? msg : location + ": " + msg),
        message_(msg) {}
  explicit Error(const std::string& msg) : Error(std::string(), msg) {}
  const std::string& message() const noexcept { return message_; }

 private:
  std::string message_;
};

// Runs `f` and returns what it returns; a cpattn::Error it throws is thrown again with its
// message passed through `rewrite` (a caller that knows which of its own arguments or flags
// set the failing ones puts their names in front).
template <class F, class R>
decltype(auto) rewrite_errors(F&& f, R&& rewrite) {
  try {
    return f();
  } catch (const Error& e) {
    throw Error(rewrite(e.message()));
  }
}

namespace detail {
template <class... Parts>
[[noreturn]] void fail(const char* file, int line, const Parts&... parts) {
  std::ostringstream os;
  (os << ... << parts);
  throw Error(std::string(file) + ':' + std::to_string(line), os.str());
}
}  // namespace detail

}  // namespace cpattn

#define CPATTN_CHECK(cond, ...)                                       \
  do {                                                                \
    if (!(cond)) ::cpattn::detail::fail(__FILE__, __LINE__, __VA_ARGS__); \
  } while (0)

#ifndef NDEBUG
#define CPATTN_DASSERT(cond)                                                       \
  do {                                                                             \
    if (!(cond)) ::cpattn::detail::fail(__FILE__, __LINE__, "internal check failed: " #cond); \
  } while (0)
#else
#define CPATTN_DASSERT(cond) \
  do {                       \
  } while (0)
#endif
