// run --save DIR: the outputs written whole or not at all. Checked before anything is computed (a bad path is
// bad input, exit 2, not a failure after minutes of work); written to temporary names in DIR and renamed
// only once every file is written, each earlier output kept under a second name until its replacement is in
// place, so that any failure leaves DIR as it was (docs/errors.md, "What is on disk").
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace cpattn::cli {

struct OutputFile {
  std::string name;                 // "o.npy"
  std::vector<std::int64_t> shape;  // float32, C order
  const float* values = nullptr;
};

// The names a run writes: o.npy, lse.npy and, unless forward-only, dq.npy, dk.npy, dv.npy (and dsinks.npy
// with sinks).
std::vector<std::string> output_names(bool forward_only);

// Refuses (Error invalid_input, naming the path) a --save DIR that is not a directory, or does not exist and
// cannot be made under its nearest existing parent, or cannot be written; an output name taken by anything
// but a regular file; and, for a forward-only run, gradient files of an earlier run (dq.npy, dk.npy,
// dv.npy, dsinks.npy), and for a run without sinks an earlier dsinks.npy, which would otherwise sit beside
// the new outputs as if they were theirs.
void check_output_dir(const std::string& dir, bool forward_only, bool sinks);

// Refuses (Error invalid_input naming `flag` and the path) a file this process cannot write, before a run
// that would write it at its end; a file the check had to make is removed again.
void check_writable_file(const std::string& path, const std::string& flag);

// Makes DIR if needed, writes every file to a temporary name in it (.NAME.tmp.PID), moves the existing
// outputs aside (.NAME.old.PID), renames each new one into place and removes the old. On any failure the new
// files and temporaries are removed and the earlier ones put back; the error names the file.
void write_outputs(const std::string& dir, const std::vector<OutputFile>& files);

}  // namespace cpattn::cli
