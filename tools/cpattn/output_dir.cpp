#include "output_dir.hpp"

#include <fcntl.h>
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
  const fs::path base(dir);
  const bool made_dir = !fs::exists(fs::status(base, ec));
  fs::create_directories(base, ec);
  if (ec) refuse(dir, "cannot be made (" + ec.message() + ")");
  const std::string pid = std::to_string(::getpid());
  // A name in DIR that nothing holds: ".NAME.KIND.PID", with ".N" added until one is free. `take` claims it
  // (an O_EXCL create, or a hard link) and fails with EEXIST where the name is taken: no other process's file
  // or stale leftover is overwritten, no symbolic link followed.
  auto claim = [&](const std::string& name, const char* kind, const auto& take) {
    for (int n = 0;; ++n) {
      const fs::path p =
          base / ("." + name + "." + kind + "." + pid + (n > 0 ? "." + std::to_string(n) : ""));
      if (take(p)) return p;
      if (errno != EEXIST || n == 1000) {
        refuse(p.string(), std::string("cannot be created (") + std::strerror(errno) + ")");
      }
    }
  };
  std::vector<fs::path> temps, targets, asides;  // asides[i] empty: targets[i] did not exist
  std::size_t placed = 0;
  // Undoes whatever was done: the new files that reached their names replaced by the earlier ones again (or
  // removed where there were none), the links aside and the temporaries removed, DIR removed if this made it.
  // Returns what could not be put back.
  auto undo = [&] {
    std::string left;
    std::error_code e;
    for (std::size_t i = 0; i < placed; ++i) {
      if (asides[i].empty()) {
        fs::remove(targets[i], e);
      } else {
        fs::rename(asides[i], targets[i], e);
        if (e) left += " the earlier " + files[i].name + " is at " + quoted(asides[i].string()) + ";";
      }
    }
    for (std::size_t i = placed; i < asides.size(); ++i) {
      if (!asides[i].empty()) fs::remove(asides[i], e);
    }
    for (const auto& t : temps) fs::remove(t, e);
    if (made_dir) fs::remove(base, e);  // only if empty
    return left;
  };
  auto fail = [&](const fs::path& target, const std::string& why) {
    const std::string left = undo();
    throw Error(ErrorKind::invalid_input, "--save", target.string(),
                "--save: " + quoted(target.string()) + ": " + why +
                    (left.empty() ? "; nothing was replaced" : "; not everything could be put back:" + left));
  };
  for (const auto& f : files) targets.push_back(base / f.name);
  std::size_t writing = 0;
  try {
    for (std::size_t i = 0; i < files.size(); ++i) {
      writing = i;
      temps.push_back(claim(files[i].name, "tmp", [](const fs::path& p) {
        const int fd = ::open(p.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
        if (fd >= 0) ::close(fd);
        return fd >= 0;
      }));
      write_npy(temps[i].string(), files[i].shape, files[i].values);
    }
  } catch (const Error& e) {
    fail(targets[writing], std::string("writing it failed (") + e.what() + ")");
  }
  // Every file is written. Each earlier output gets a second name (a hard link: the output's own name keeps
  // it meanwhile), then each new file replaces it in one rename: at every moment NAME holds the earlier
  // output or the new one. A failure puts the earlier ones back.
  for (std::size_t i = 0; i < files.size(); ++i) {
    const auto st = fs::symlink_status(targets[i], ec);
    if (ec && st.type() != fs::file_type::not_found)
      fail(targets[i], "cannot be examined (" + ec.message() + ")");
    if (!fs::exists(st)) {
      asides.emplace_back();
      continue;
    }
    if (!fs::is_regular_file(st) && !fs::is_symlink(st)) {
      asides.emplace_back();
      fail(targets[i], std::string("is ") + kind_of(st.type()) + " now; valid: a regular file or nothing");
    }
    try {
      asides.push_back(claim(files[i].name, "old",
                             [&](const fs::path& p) { return ::link(targets[i].c_str(), p.c_str()) == 0; }));
    } catch (const Error& e) {
      asides.emplace_back();
      fail(targets[i], std::string("cannot keep the earlier file (") + e.what() + ")");
    }
  }
  for (; placed < files.size(); ++placed) {
    fs::rename(temps[placed], targets[placed], ec);
    if (ec) fail(targets[placed], "cannot rename into it (" + ec.message() + ")");
  }
  for (const auto& a : asides) {
    if (!a.empty()) fs::remove(a, ec);
  }
}

}  // namespace cpattn::cli
