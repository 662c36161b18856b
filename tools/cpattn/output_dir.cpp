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
  const auto st = fs::status(path, ec);
  if (fs::exists(st)) {
    if (!fs::is_directory(st)) refuse(dir, std::string("is ") + kind_of(st.type()) + "; valid: a directory");
    if (::access(dir.c_str(), W_OK | X_OK) != 0) {
      refuse(dir, std::string("cannot be written (") + std::strerror(errno) + ")");
    }
  } else {
    // Made at the end, under the nearest parent that exists: that parent must be a writable directory.
    fs::path parent = fs::absolute(path, ec).parent_path();
    while (!parent.empty() && !fs::exists(fs::status(parent, ec)) && parent != parent.root_path()) {
      parent = parent.parent_path();
    }
    const auto pst = fs::status(parent, ec);
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
    const auto fst = fs::symlink_status(file, ec);
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
  const std::string tag = ".tmp." + std::to_string(::getpid());
  std::vector<fs::path> written;
  auto remove_written = [&] {
    for (const auto& t : written) fs::remove(t, ec);
  };
  try {
    for (const auto& f : files) {
      const fs::path temp = fs::path(dir) / ("." + f.name + tag);
      written.push_back(temp);
      write_npy(temp.string(), f.shape, f.values);
    }
  } catch (...) {
    remove_written();
    throw;
  }
  for (std::size_t i = 0; i < files.size(); ++i) {
    const fs::path target = fs::path(dir) / files[i].name;
    fs::rename(written[i], target, ec);
    if (ec) {
      const std::string why = ec.message();
      remove_written();
      throw Error(ErrorKind::invalid_input, "--save", target.string(),
                  "--save: cannot rename into " + quoted(target.string()) + " (" + why + "); " +
                      std::to_string(i) + " of " + std::to_string(files.size()) + " outputs were replaced");
    }
  }
}

}  // namespace cpattn::cli
