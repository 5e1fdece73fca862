// A folder of its own under the system's temporary folder (mkdtemp), removed with its contents
// at the end of the scope: tests of two build trees on one host never meet.
#pragma once

#include <stdlib.h>

#include <filesystem>
#include <string>

namespace cpattn::testing {

struct TempDir {
  std::filesystem::path dir;
  TempDir() {
    std::string t = (std::filesystem::temp_directory_path() / "cpattn-io-test-XXXXXX").string();
    dir = ::mkdtemp(t.data());
  }
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(dir, ignored);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string operator/(const std::string& n) const { return (dir / n).string(); }
};

}  // namespace cpattn::testing
