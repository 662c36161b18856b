#include "output_dir.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
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

// One writer at a time in a directory: an flock on DIR/.cpattn.lock, held until the outputs are in place, so
// that runs saving into one directory leave one run's whole set (the later one), never a mix. The holder
// removes the file when it is done (the directory is left as it was): a waiter that then holds a lock on the
// removed file sees that its path names another file, or none, and takes the lock anew. The holder's pid is
// in the file; one that keeps it past kLockWaitSeconds (a stopped process) is named in the refusal.
class DirLock {
 public:
  static constexpr int kLockWaitSeconds = 60;
  explicit DirLock(const fs::path& dir) : path_(dir / ".cpattn.lock") {
    for (int waited = 0;; ++waited) {
      fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0644);
      if (fd_ < 0) refuse(path_.string(), std::string("cannot be opened (") + std::strerror(errno) + ")");
      if (::flock(fd_, LOCK_EX | LOCK_NB) == 0) {
        struct stat held {
        }, named{};
        if (::fstat(fd_, &held) == 0 && ::stat(path_.c_str(), &named) == 0 && held.st_ino == named.st_ino &&
            held.st_dev == named.st_dev) {
          break;  // the lock of the file the path names
        }
      } else if (errno != EWOULDBLOCK || waited >= kLockWaitSeconds * 10) {
        const std::string holder = holder_pid();
        ::close(fd_);
        throw Error(ErrorKind::resource, "--save", dir.string(),
                    "--save: " + quoted(dir.string()) + ": another cpattn run" +
                        (holder.empty() ? "" : " (pid " + holder + ")") + " has been saving into it for " +
                        std::to_string(kLockWaitSeconds) + " s; save elsewhere or end that run");
      }
      ::close(fd_);
      ::usleep(100'000);
    }
    const std::string pid = std::to_string(::getpid()) + "\n";
    if (::ftruncate(fd_, 0) != 0 || ::pwrite(fd_, pid.data(), pid.size(), 0) < 0) {
      // The pid is only for the message of a run that waits; the lock holds without it.
    }
  }
  ~DirLock() { release(); }
  void release() {
    if (fd_ < 0) return;
    ::unlink(path_.c_str());  // still holding it: a waiter finds its file gone and starts again
    ::close(fd_);
    fd_ = -1;
  }
  DirLock(const DirLock&) = delete;
  DirLock& operator=(const DirLock&) = delete;

 private:
  std::string holder_pid() const {
    char buf[32] = {};
    const ssize_t n = ::pread(fd_, buf, sizeof buf - 1, 0);
    std::string text(buf, n > 0 ? static_cast<std::size_t>(n) : 0);
    while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.pop_back();
    return text.find_first_not_of("0123456789") == std::string::npos ? text : std::string();
  }
  fs::path path_;
  int fd_ = -1;
};

// The journal of the renames (DIR/.cpattn.journal), written before the first of them and removed after the
// last: a run killed between the two left its new outputs half in place, and the journal says how to put the
// earlier ones back. One line per output: NAME, its temporary, and where the earlier file was kept ("-": the
// output did not exist before).
struct JournalEntry {
  std::string name, temp, aside;
};

fs::path journal_path(const fs::path& dir) {
  return dir / ".cpattn.journal";
}

void write_journal(const fs::path& dir, const std::vector<JournalEntry>& entries) {
  std::string text = "cpattn save journal " + std::to_string(::getpid()) + "\n";
  for (const auto& e : entries)
    text += e.name + "\t" + e.temp + "\t" + (e.aside.empty() ? "-" : e.aside) + "\n";
  const fs::path tmp = dir / ".cpattn.journal.tmp";
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  const bool ok = f != nullptr && std::fwrite(text.data(), 1, text.size(), f) == text.size();
  if ((f != nullptr && std::fclose(f) != 0) || !ok) {
    std::error_code e;
    fs::remove(tmp, e);
    throw Error(ErrorKind::resource, "--save", tmp.string(),
                "--save: " + quoted(tmp.string()) + ": cannot write the journal of the renames (" +
                    std::strerror(errno) + "); nothing was replaced");
  }
  std::error_code ec;
  fs::rename(tmp, journal_path(dir), ec);
  if (ec) {
    fs::remove(tmp, ec);
    throw Error(ErrorKind::resource, "--save", dir.string(),
                "--save: " + quoted(dir.string()) +
                    ": cannot place the journal of the renames; nothing was replaced");
  }
}

// Under the lock, what an earlier run that was killed left behind: with a journal, its renames undone (each
// earlier output put back, each output that did not exist before removed); then every temporary and kept
// earlier file of an output name removed (no live run has any: they exist only under the lock). Says what it
// did on stderr.
// A name the writer below gives: ".NAME.KIND.PID" or ".NAME.KIND.PID.N", NAME an output.
bool written_name(const std::string& file, const std::string& name, const char* kind) {
  const std::string prefix = "." + name + "." + kind + ".";
  if (file.rfind(prefix, 0) != 0 || file.size() == prefix.size()) return false;
  const std::string rest = file.substr(prefix.size());
  return rest.find_first_not_of("0123456789.") == std::string::npos && rest.front() != '.' &&
         rest.back() != '.';
}

[[noreturn]] void refuse_journal(const fs::path& dir, const std::string& why) {
  throw Error(
      ErrorKind::resource, "--save", journal_path(dir).string(),
      "--save: " + quoted(journal_path(dir).string()) + ": " + why +
          "; the earlier outputs may be the .NAME.old.PID files beside it: put them back by hand, then "
          "remove the journal");
}

// Under the lock, what an earlier run that was killed left behind: with a journal, its renames undone (each
// earlier output put back, each output that did not exist before removed); then every temporary and kept
// earlier file of an output name removed (no live run has any: they exist only under the lock). Says what it
// did on stderr. A journal this program did not write, or a file it cannot put back, is refused with the
// journal kept: the kept earlier outputs may be the only copies.
void recover_killed_run(const fs::path& dir) {
  std::error_code ec;
  std::string done;
  std::ifstream journal(journal_path(dir));
  if (journal) {
    std::string line, pid;
    std::getline(journal, line);
    if (line.rfind("cpattn save journal ", 0) != 0) refuse_journal(dir, "is not a journal cpattn wrote");
    pid = line.substr(line.rfind(' ') + 1);
    std::vector<JournalEntry> entries;
    while (std::getline(journal, line)) {
      std::istringstream fields(line);
      JournalEntry e;
      std::getline(fields, e.name, '\t');
      std::getline(fields, e.temp, '\t');
      std::getline(fields, e.aside, '\t');
      const auto names = output_names(false);
      const bool known = std::find(names.begin(), names.end(), e.name) != names.end();
      if (!known || !written_name(e.temp, e.name, "tmp") ||
          (e.aside != "-" && !written_name(e.aside, e.name, "old"))) {
        refuse_journal(dir, "holds a line cpattn did not write ('" + cpattn::quoted(line) + "')");
      }
      entries.push_back(e);
    }
    journal.close();
    for (const JournalEntry& e : entries) {
      const fs::path target = dir / e.name;
      if (e.aside == "-") {
        fs::remove(target, ec);  // did not exist before that run
      } else if (fs::exists(fs::symlink_status(dir / e.aside, ec))) {
        fs::rename(dir / e.aside, target, ec);
      } else {
        continue;  // its renames had not reached it: the earlier file is still in place
      }
      if (ec) refuse_journal(dir, "cannot put back " + e.name + " (" + ec.message() + ")");
    }
    fs::remove(journal_path(dir), ec);
    done = "put back the outputs that a run killed while renaming its own (pid " + pid + ") had replaced";
  }
  std::size_t removed = 0;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string file = entry.path().filename().string();
    for (const auto& name : output_names(false)) {
      if (written_name(file, name, "tmp") || written_name(file, name, "old")) {
        if (fs::remove(entry.path(), ec)) ++removed;
      }
    }
  }
  fs::remove(dir / ".cpattn.journal.tmp", ec);
  if (removed > 0) {
    done += std::string(done.empty() ? "" : "; ") + "removed " + std::to_string(removed) +
            " temporary or kept file(s) of a run that was killed";
  }
  if (!done.empty()) std::cerr << "cpattn: --save " << quoted(dir.string()) << ": " << done << "\n";
}

}  // namespace

std::vector<std::string> output_names(bool forward_only) {
  if (forward_only) return {"o.npy", "lse.npy"};
  return {"o.npy", "lse.npy", "dq.npy", "dk.npy", "dv.npy", "dsinks.npy"};
}

void check_output_dir(const std::string& dir, bool forward_only, bool sinks) {
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
             "dq.npy, dk.npy, dv.npy and dsinks.npy or save elsewhere");
    }
    if (!sinks && name == "dsinks.npy") {
      refuse(file.string(),
             "holds the sinks' gradient of an earlier run, which a run without --sinks does not replace; "
             "remove dsinks.npy or save elsewhere");
    }
  }
}

void write_outputs(const std::string& dir, const std::vector<OutputFile>& files) {
  std::error_code ec;
  const fs::path base(dir);
  const bool made_dir = !fs::exists(fs::status(base, ec));
  fs::create_directories(base, ec);
  if (ec) refuse(dir, "cannot be made (" + ec.message() + ")");
  DirLock lock(base);
  recover_killed_run(base);
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
    if (made_dir) {  // only if empty, the lock's file too
      lock.release();
      fs::remove(base, e);
    }
    return left;
  };
  // Past the checks, what fails is the machine's (a full disk, a file size limit): exit 1, not bad input.
  bool journalled = false;  // the journal is in place: removed only once undo() has put everything back
  auto fail = [&](const fs::path& target, const std::string& why) {
    const std::string left = undo();
    if (journalled && left.empty()) fs::remove(journal_path(base), ec);
    throw Error(ErrorKind::resource, "--save", target.string(),
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
  std::vector<JournalEntry> journal;
  for (std::size_t i = 0; i < files.size(); ++i) {
    journal.push_back({files[i].name, temps[i].filename().string(),
                       asides[i].empty() ? std::string() : asides[i].filename().string()});
  }
  try {
    write_journal(base, journal);
  } catch (const Error& e) {
    fail(journal_path(base), e.items().front().message);
  }
  journalled = true;
  for (; placed < files.size(); ++placed) {
    fs::rename(temps[placed], targets[placed], ec);
    if (ec) fail(targets[placed], "cannot rename into it (" + ec.message() + ")");
  }
  fs::remove(journal_path(base), ec);  // every new output in place: nothing to undo from here on
  for (const auto& a : asides) {
    if (!a.empty()) fs::remove(a, ec);
  }
}

void check_writable_file(const std::string& path, const std::string& flag) {
  const bool existed = std::filesystem::exists(path);
  const bool writable = static_cast<bool>(std::ofstream(path, std::ios::app));
  const int error = errno;
  if (writable && !existed) std::filesystem::remove(path);
  if (!writable) {
    throw Error(ErrorKind::invalid_input, flag, path,
                flag + " '" + quoted(path) + "' cannot be written (" + std::strerror(error) + ")");
  }
}

}  // namespace cpattn::cli
