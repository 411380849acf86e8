#pragma once
// Files cohort writes in folders that others may reach (a shared $TMPDIR, a user's --trace-dir): opened
// so that nothing planted there beforehand redirects the write (docs/security.md, "Files and secrets").
//
//  * A new file is created with O_CREAT | O_EXCL | O_NOFOLLOW: a symbolic link (or any file) planted at
//    its name is never followed or written through. An entry left there is removed first (unlink(2)
//    removes a link, never its target), and when another one appears between the two calls the open
//    fails instead of using it.
//  * A file is appended to with O_NOFOLLOW and only when it is still a regular file of this user's.
//  * A private folder is this user's, a real folder (not a link), and closed to everyone else (0700).

#include <sys/types.h>

#include <memory>
#include <ostream>
#include <string>

#include "common/fd.h"

namespace cohort::files {

// Creates `path` afresh for writing (mode `mode`, as the umask allows). Throws Error naming the path and
// the cause when it cannot.
UniqueFd create_new(const std::string& path, mode_t mode = 0644);

// Opens the existing regular file `path`, owned by this user, for appending. Throws Error otherwise.
UniqueFd open_append(const std::string& path);

// An output stream over a descriptor (it closes the descriptor when destroyed).
std::unique_ptr<std::ostream> ostream_of(UniqueFd fd);

// Makes `dir` (whose parent must exist) this user's private folder: creates it with mode 0700, or checks
// the one there: it must be a folder (not a link to one) owned by this user; its mode is narrowed to
// 0700 if it was wider. Throws Error naming the folder, its owner and what was expected otherwise.
// With `create` false a missing folder is not created: returns false.
bool ensure_private_dir(const std::string& dir, bool create = true);

}  // namespace cohort::files
