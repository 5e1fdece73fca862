// The message of the cpattn::Error a test's call throws, for tests that check what it says.
#pragma once

#include <cpattn/error.hpp>

#include <gtest/gtest.h>

#include <string>

namespace cpattn::testing {

// Runs `f`, expects cpattn::Error, and returns its message (a test failure and "" when `f`
// throws none).
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.message();
  }
  ADD_FAILURE() << "no cpattn::Error thrown";
  return {};
}

}  // namespace cpattn::testing
