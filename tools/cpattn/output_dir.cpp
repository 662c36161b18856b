#include "output_dir.hpp"

#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <system_error>

#include "cpattn/error.hpp"
#include "cpattn/npy.hpp"
#include "cpattn/parse.hpp"

namespace cpattn::cli {
namespace {

namespace fs = std::filesystem;

[[noreturn]] void refuse(const std::string& path, const std::string& why) {
  throw Error(ErrorKind::invalid_input, "--save", path, "--save: " + quoted(path) + ": " + why);
}

const char* kind_of(fs::file_type t) {
  switch (t) {
    case fs::file_type::regular:
      return "a regular file";
    case fs::file_type::directory:
      return "a directory";
    case fs::file_type::symlink:
      return "a symbolic link";
    case fs::file_type::fifo:
      return "a FIFO";
    case fs::file_type::socket:
      return "a socket";
    case fs::file_type::block:
    case fs::file_type::character:
      return "a device";
    case fs::file_type::not_found:
      return "absent";
    default:
      return "not a regular file";
  }
}

}  // namespace

std::vector<std::string> output_names(bool forward_only) {
  if (forward_only) return {"o.npy", "lse.npy"};
  return {"o.npy", "lse.npy", "dq.npy", "dk.npy", "dv.npy"};
}

void check_output_dir(const std::string& dir, bool forward_only) {
  std::error_code ec;
  const fs::path path(dir);
  // A missing path (or one under a non-directory) comes back as not_found, with an error code set; any other
  // error (no permission to look) is the answer.
  auto status_of = [&](const fs::path& p, bool follow) {
    const auto st = follow ? fs::status(p, ec) : fs::symlink_status(p, ec);
    if (ec && st.type() != fs::file_type::not_found) {
      refuse(p.string(), "cannot be examined (" + ec.message() + ")");
    }
    return st;
  };
  const auto st = status_of(path, true);
  if (fs::exists(st)) {
    if (!fs::is_directory(st)) refuse(dir, std::string("is ") + kind_of(st.type()) + "; valid: a directory");
    if (::access(dir.c_str(), W_OK | X_OK) != 0) {
      refuse(dir, std::string("cannot be written (") + std::strerror(errno) + ")");
    }
  } else {
    // Made at the end, under the nearest parent that exists: that parent must be a writable directory.
    fs::path parent = fs::absolute(path, ec).parent_path();
    if (ec) refuse(dir, "cannot be made absolute (" + ec.message() + ")");
    while (!parent.empty() && !fs::exists(status_of(parent, true)) && parent != parent.root_path()) {
      parent = parent.parent_path();
    }
    const auto pst = status_of(parent, true);
    if (!fs::is_directory(pst)) {
      refuse(dir, "cannot be made: " + quoted(parent.string()) + " is " + kind_of(pst.type()));
    }
    if (::access(parent.c_str(), W_OK | X_OK) != 0) {
      refuse(dir, "cannot be made in " + quoted(parent.string()) + " (" + std::strerror(errno) + ")");
    }
    return;  // a new directory holds nothing stale
  }
  for (const auto& name : output_names(false)) {
    const fs::path file = path / name;
    const auto fst = status_of(file, false);
    if (!fs::exists(fst)) continue;
    if (!fs::is_regular_file(fst)) {
      refuse(file.string(), std::string("is ") + kind_of(fst.type()) +
                                "; valid: a regular file (replaced) or nothing, where an output goes");
    }
    if (forward_only && name.rfind("d", 0) == 0) {
      refuse(file.string(),
             "holds gradients of an earlier run, which a --forward-only run does not replace; remove "
             "dq.npy, dk.npy and dv.npy or save elsewhere");
    }
  }
}

void write_outputs(const std::string& dir, const std::vector<OutputFile>& files) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) refuse(dir, "cannot be made (" + ec.message() + ")");
  const std::string tag = "." + std::to_string(::getpid());
  const fs::path base(dir);
  std::vector<fs::path> temps, targets, backups;  // backups[i] empty: targets[i] did not exist
  for (const auto& f : files) {
    temps.push_back(base / ("." + f.name + ".tmp" + tag));
    targets.push_back(base / f.name);
    backups.emplace_back();
  }
  // Undoes whatever was done: the new files that reached their names removed, the earlier ones put back, the
  // temporaries removed. Returns what could not be undone (nothing, in any case seen).
  std::size_t placed = 0;
  auto undo = [&] {
    std::string left;
    std::error_code e;
    for (std::size_t i = 0; i < placed; ++i) fs::remove(targets[i], e);
    for (std::size_t i = 0; i < files.size(); ++i) {
      if (backups[i].empty()) continue;
      fs::rename(backups[i], targets[i], e);
      if (e) left += " " + quoted(backups[i].string()) + " (the earlier " + files[i].name + ")";
    }
    for (const auto& t : temps) fs::remove(t, e);
    return left;
  };
  auto fail = [&](const std::string& target, const std::string& why) {
    const std::string left = undo();
    throw Error(ErrorKind::invalid_input, "--save", target,
                "--save: " + why + "; nothing was replaced" +
                    (left.empty() ? std::string() : "; could not be restored:" + left));
  };
  try {
    for (std::size_t i = 0; i < files.size(); ++i)
      write_npy(temps[i].string(), files[i].shape, files[i].values);
  } catch (...) {
    undo();
    throw;
  }
  // Every file is written: move the earlier outputs aside, then the new ones into place. A failure in either
  // step puts the directory back as it was.
  for (std::size_t i = 0; i < files.size(); ++i) {
    if (!fs::exists(fs::symlink_status(targets[i], ec))) continue;
    const fs::path aside = base / ("." + files[i].name + ".old" + tag);
    fs::rename(targets[i], aside, ec);
    if (ec)
      fail(targets[i].string(),
           "cannot move " + quoted(targets[i].string()) + " aside (" + ec.message() + ")");
    backups[i] = aside;
  }
  for (; placed < files.size(); ++placed) {
    fs::rename(temps[placed], targets[placed], ec);
    if (ec) {
      fail(targets[placed].string(),
           "cannot rename into " + quoted(targets[placed].string()) + " (" + ec.message() + ")");
    }
  }
  for (const auto& b : backups) {
    if (!b.empty()) fs::remove(b, ec);
  }
}

}  // namespace cpattn::cli
