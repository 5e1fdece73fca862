// Output files written safely (docs/reliability.md): every file cpattn writes (checkpoints,
// .npy, SVGs) goes through write_file_atomically, and the CLI checks its output paths with
// check_output_path before any work.
#pragma once

#include <compare>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace cpattn {

// The file a write to `path` replaces: `path` itself, or, when it is a symbolic link, the
// file it points to (followed through every link, relative links from the link's folder).
std::string resolve_output_path(const std::string& path);

// Throws cpattn::Error ("<what>: '<path>' is not a regular file (a FIFO)", "... folder '<dir>'
// is not writable") when `path` (after its links) exists but is not a regular file, or its
// folder is missing or not writable. `what` names the flag or the role, e.g. "--save".
void check_output_path(const std::string& path, std::string_view what);

// Writes `bytes` to `path` so that `path` is either its old file or the whole new one: into a
// unique temporary file in the target's folder (mkstemp), every write checked (a short write,
// ENOSPC, EFBIG: an error naming the path), fsync, then renamed over the target (and the folder
// fsynced). A symbolic link is followed and its target replaced; the link stays. A target that
// exists but is not a regular file is refused before any work. On any error the temporary
// file is removed, the previous file is intact, and cpattn::Error names `path`. The new file
// keeps the old one's permission bits (new files: 0666 less the umask).
void write_file_atomically(const std::string& path, std::span<const std::byte> bytes);

// A set of files that belong together (a run's outputs): each written and fsynced in full as
// write_file_atomically does, beside its target, before any target is replaced; then renamed
// into place one after the other. An error while writing (a full disk, a refused path) removes
// every temporary file and leaves every target as it was, so the set is never part old, part
// new (only a rename failing after others succeeded could leave that: it names its path).
struct FileBytes {
  std::string path;
  std::span<const std::byte> bytes;
};
void write_files_atomically(std::span<const FileBytes> files);

// A file's or folder's identity: the device and inode its name leads to, after its symbolic
// links. Two names with one identity are one file: a hard link, a symbolic link, a bind mount.
// (A filesystem whose inode numbers are not unique, as some FUSE ones and overlayfs without
// xino, can give two files one identity.)
struct FileId {
  std::uint64_t device = 0, inode = 0;
  friend auto operator<=>(const FileId&, const FileId&) = default;
};

// `path`'s identity (stat: links followed), or none where it cannot be read (missing, a link
// loop, a component not searchable).
std::optional<FileId> file_id(const std::string& path);

// Whether `a` and `b` name the same file (after their symbolic links): the same inode when
// either exists, else the same name in the same folder. For refusing two outputs, or an output
// and an input, that would overwrite each other.
bool same_file(const std::string& a, const std::string& b);

// Whether a write to `path` would land in `input`: the same file (same_file), or a file
// anywhere below the folder `input` (after the links of both; `path` need not exist). For
// refusing an output that would replace an input file or add a file to an input folder (a
// checkpoint saved into the training data's folder becomes a document of the next run).
bool writes_into(const std::string& path, const std::string& input);

// Where a write to `path` lands, absolute: its links followed (resolve_output_path, which
// throws cpattn::Error on a link loop), the part that exists canonical, the rest normalized (a
// relative `path` from the working folder); empty when the working folder or a component cannot
// be read. For comparing one output with many canonical folders (lies_below).
std::string output_location(const std::string& path);

// Whether `path` is `folder` or lies below it, component by component (/data2/x is not below
// /data), both absolute and canonical (no links, no . or ..; a trailing separator on either is
// ignored): writes_into's last test.
bool lies_below(const std::string& path, const std::string& folder);

// The whole of the regular file `path` (its size when opened). A FIFO, a device or a folder is
// refused without blocking or reading; throws cpattn::Error naming `path` on any error.
std::vector<std::byte> read_regular_file(const std::string& path);
// Its first min(max_bytes, size) bytes, and its whole size in `size` (a header read before the
// data, for a budget); the same checks.
std::vector<std::byte> read_file_prefix(const std::string& path, std::size_t max_bytes, std::uint64_t& size);

// Writes all of `bytes` to the open descriptor `fd`, retrying short writes and EINTR; throws
// cpattn::Error naming `path` on any error.
void write_all(int fd, std::span<const std::byte> bytes, const std::string& path);

}  // namespace cpattn
