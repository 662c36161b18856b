// cpattn's Python extension (cpattn._cpattn): numpy arrays in and out of the flash kernels, the
// context-parallel strategies on an MPI communicator that mpi4py made or on a torch.distributed process group
// (through cpattn.torch's transport object), and the validate and plan documents.
// cpattn/__init__.py and cpattn/torch.py are the public faces; this file only converts and calls the library.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "cpattn/agreement.hpp"
#include "cpattn/communicators.hpp"
#include "cpattn/config.hpp"
#include "cpattn/context_parallel.hpp"
#include "cpattn/documents.hpp"
#include "cpattn/error.hpp"
#include "cpattn/flash.hpp"
#include "cpattn/interrupt.hpp"
#include "cpattn/parse.hpp"
#include "cpattn/sequence_layout.hpp"
#include "cpattn/transport.hpp"

namespace py = pybind11;

namespace cpattn::python {
namespace {

// float32 arrays, or uint16 arrays holding bfloat16 words (how torch's bfloat16 crosses: numpy has none).
std::optional<DType> dtype_of(const py::array& a) {
  if (py::array_t<float>::check_(a)) return DType::f32;
  if (py::array_t<std::uint16_t>::check_(a)) return DType::bf16;
  return std::nullopt;
}

std::string shape_text(const py::array& a) {
  std::string s = "[";
  for (py::ssize_t i = 0; i < a.ndim(); ++i) s += (i ? ", " : "") + std::to_string(a.shape(i));
  return s + "]";
}

std::string dtype_text(const py::array& a) {
  return py::str(a.dtype()).cast<std::string>();
}

// Problems found while reading the arguments, all reported at once (Error(invalid_input)).
// An allocation that failed joins them as the first problem and makes raise() an Error(out_of_memory) (a
// MemoryError): under MPI a rank that could not copy its input must still take part in the agreement that
// tells the others, rather than leave them waiting.
struct Problems : ErrorList {
  void add(const std::string& field, const std::string& value, const std::string& message) {
    ErrorList::add({field}, value, message);
  }
  void out_of_memory(std::size_t bytes, const std::string& what) {
    try {
      fail_allocation(bytes, what);
    } catch (const Error& e) {
      memory = true;
      append(e.items());
    }
  }
  void raise() const { ErrorList::raise(memory ? ErrorKind::out_of_memory : ErrorKind::invalid_input); }
  bool memory = false;
};

// Ctrl-C while a call runs with the GIL released: Python's own handler would only act once the call returned
// (minutes, for a long sequence). Meanwhile SIGINT requests an interrupt instead (cpattn/interrupt.hpp): the
// kernels stop before their next task and the call raises KeyboardInterrupt. Python's handler is back in
// place after the call, and a SIGINT that came after the last task is passed on to it. Where Python ignores
// SIGINT, so does the call.
class InterruptScope {
 public:
  InterruptScope() {
    std::lock_guard<std::mutex> lock(mutex());
    if (depth()++ > 0) return;  // another thread's call holds the handler
    clear_interrupt();
    struct sigaction ours {};
    ours.sa_handler = [](int) { request_interrupt(); };
    sigemptyset(&ours.sa_mask);
    installed() = ::sigaction(SIGINT, nullptr, &previous()) == 0 && previous().sa_handler != SIG_IGN &&
                  ::sigaction(SIGINT, &ours, nullptr) == 0;
  }
  ~InterruptScope() {
    std::lock_guard<std::mutex> lock(mutex());
    if (--depth() > 0 || !installed()) return;
    ::sigaction(SIGINT, &previous(), nullptr);
    if (interrupt_requested()) {  // not seen by a kernel: Python's handler gets it now
      clear_interrupt();
      ::raise(SIGINT);
    }
  }
  InterruptScope(const InterruptScope&) = delete;
  InterruptScope& operator=(const InterruptScope&) = delete;

 private:
  static std::mutex& mutex() {
    static std::mutex m;
    return m;
  }
  static int& depth() {
    static int d = 0;
    return d;
  }
  static bool& installed() {
    static bool i = false;
    return i;
  }
  static struct sigaction& previous() {
    static struct sigaction p {};
    return p;
  }
};

// A call into the kernels or the strategies: Ctrl-C an interrupt (InterruptScope), the GIL released; the GIL
// is taken back before the handler is restored.
struct KernelCall {
  InterruptScope interrupt;
  py::gil_scoped_release release;
};

// Options read as the program reads its flags (cpattn/parse.hpp's parsers, the library's ranges), so that a
// keyword takes what its flag takes: True or False for a switch (None too where the default is meant), an
// int for a count (not a bool, not 4.0), a number for a real (not a str). A bad one joins `problems`.
std::string repr_of(const py::handle& obj) {
  std::string text = py::repr(obj).cast<std::string>();
  if (text.size() <= 60) return text;
  std::size_t cut = 57;
  while (cut > 0 && (static_cast<unsigned char>(text[cut]) & 0xC0) == 0x80) --cut;  // a whole character
  return text.substr(0, cut) + "...";
}

std::string type_of(const py::handle& obj) {
  return py::type::of(obj).attr("__name__").cast<std::string>();
}

bool is_bool(const py::handle& obj) {
  if (py::isinstance<py::bool_>(obj)) return true;
  static const py::object numpy_bool = py::module_::import("numpy").attr("bool_");  // numpy 1 and 2 alike
  return py::isinstance(obj, numpy_bool);
}

std::optional<bool> read_switch(const py::handle& obj, const std::string& field, Problems& problems) {
  if (is_bool(obj)) return obj.cast<bool>();
  problems.add(field, repr_of(obj),
               field + ": expected True or False, got " + type_of(obj) + " " + repr_of(obj) +
                   (obj.is_none() ? " (None is not a value of " + field + ")" : std::string()));
  return std::nullopt;
}

std::optional<std::int64_t> read_count(const py::handle& obj, const std::string& field, std::int64_t min,
                                       std::int64_t max, Problems& problems) {
  if (obj.is_none()) return std::nullopt;
  if (is_bool(obj) || !PyIndex_Check(obj.ptr())) {
    problems.add(field, repr_of(obj),
                 field + ": expected an int in " + std::to_string(min) + ".." + std::to_string(max) +
                     ", got " + type_of(obj) + " " + repr_of(obj));
    return std::nullopt;
  }
  const py::object index = py::reinterpret_steal<py::object>(PyNumber_Index(obj.ptr()));
  if (!index) {  // its __index__ raised
    PyErr_Clear();
    problems.add(field, repr_of(obj), field + ": " + repr_of(obj) + " cannot be read as an int");
    return std::nullopt;
  }
  try {
    return parse_integer(py::str(index), field, min, max);
  } catch (const Error& e) {
    problems.append(e.items());
  }
  return std::nullopt;
}

// window=: None, an int LEFT, or a pair (LEFT, RIGHT) whose sides are ints or None (unbounded); the sides'
// ranges are validation's (window_left, window_right).
struct WindowSides {
  std::optional<std::int64_t> left, right;
};

WindowSides read_window(const py::handle& obj, Problems& problems) {
  constexpr std::int64_t lo = std::numeric_limits<std::int64_t>::min(),
                         hi = std::numeric_limits<std::int64_t>::max();
  WindowSides w;
  if (obj.is_none()) return w;
  if (py::isinstance<py::tuple>(obj) || py::isinstance<py::list>(obj)) {
    const auto items = py::reinterpret_borrow<py::sequence>(obj);
    if (py::len(items) != 2) {
      problems.add("window", repr_of(obj),
                   "window: expected an int LEFT or a pair (LEFT, RIGHT), got a " + type_of(obj) + " of " +
                       std::to_string(py::len(items)) + " items");
      return w;
    }
    w.left = read_count(items[0], "window_left", lo, hi, problems);
    w.right = read_count(items[1], "window_right", lo, hi, problems);
    return w;
  }
  w.left = read_count(obj, "window", lo, hi, problems);
  return w;
}

// documents=: None or a sequence of document lengths (ints >= 1; their sum is validation's).
std::vector<std::int64_t> read_documents(const py::handle& obj, Problems& problems) {
  std::vector<std::int64_t> lengths;
  if (obj.is_none()) return lengths;
  if (py::isinstance<py::str>(obj) || py::isinstance<py::bytes>(obj) || !py::isinstance<py::sequence>(obj)) {
    problems.add("documents", repr_of(obj),
                 "documents: expected a sequence of document lengths (ints >= 1), got " + type_of(obj) + " " +
                     repr_of(obj));
    return lengths;
  }
  const auto items = py::reinterpret_borrow<py::sequence>(obj);
  for (std::size_t i = 0; i < py::len(items); ++i) {
    const std::string field = "documents[" + std::to_string(i) + "]";
    if (items[i].is_none()) {
      problems.add(field, "None", field + ": None is not a document length; valid: an int >= 1");
      return {};
    }
    const auto n = read_count(items[i], field, 1, std::numeric_limits<std::int32_t>::max(), problems);
    if (!n) return {};
    lengths.push_back(*n);
  }
  return lengths;
}

// The positions of rank `rank` in a layout cut by documents (per_document, solver: make_layout with the
// band of `causal` and `window`), after the rules that bear on it (an Error(invalid_config) naming them).
std::vector<std::int64_t> document_layout_positions(std::int64_t seq_len, const ParallelSpec& parallel,
                                                    std::int64_t rank, bool causal,
                                                    const WindowSides& window) {
  AttentionSpec a;
  a.seq_len = seq_len;
  a.num_q_heads = a.num_kv_heads = a.head_dim = 1;
  a.causal = causal;
  a.window_left = window.left;
  a.window_right = window.right;
  std::vector<ErrorItem> errors;
  for (const ErrorItem& e : validation_errors(a, parallel)) {
    const std::string& f = e.fields.front();
    if (f == "documents" || f == "seq_len" || f == "layout" || f == "window_left" || f == "window_right" ||
        f == "causal") {
      errors.push_back(e);
    }
  }
  if (!errors.empty()) throw Error(ErrorKind::invalid_config, std::move(errors));
  return layout_of(a, parallel).positions(rank);
}

std::optional<double> read_number(const py::handle& obj, const std::string& field, double min, double max,
                                  Problems& problems) {
  if (obj.is_none()) return std::nullopt;
  const bool text = py::isinstance<py::str>(obj) || py::isinstance<py::bytes>(obj);
  double x = 0;
  bool ok = !text && !is_bool(obj);
  if (ok) {
    try {
      x = obj.cast<double>();
    } catch (const py::cast_error&) {
      ok = false;
    }
  }
  if (!ok) {
    problems.add(field, repr_of(obj),
                 field + ": expected a number, got " + type_of(obj) + " " + repr_of(obj));
    return std::nullopt;
  }
  if (!(x >= min && x <= max)) {  // NaN too
    problems.add(field, repr_of(obj),
                 field + ": " + repr_of(obj) + " is out of range; valid: a finite number in " +
                     py::repr(py::float_(min)).cast<std::string>() + ".." +
                     py::repr(py::float_(max)).cast<std::string>());
    return std::nullopt;
  }
  return x;
}

// A [B, S, H, D] array as a view the kernels take: zero-copy when the last axis is contiguous and the strides
// are whole elements, else a C-contiguous copy (kept alive in `keep`).
struct ArrayRef {
  py::array keep;
  ConstTensorRef ref;
};

std::optional<ArrayRef> read_tensor(const py::handle& obj, const std::string& name, Problems& problems) {
  if (!py::isinstance<py::array>(obj)) {
    problems.add(name, py::str(py::type::of(obj)).cast<std::string>(),
                 name +
                     ": expected a numpy array [B, S, H, D] of float32 (or uint16 holding bfloat16), got " +
                     py::str(py::type::of(obj)).cast<std::string>());
    return std::nullopt;
  }
  py::array a = py::reinterpret_borrow<py::array>(obj);
  const auto dtype = dtype_of(a);
  if (!dtype) {
    problems.add(
        name, dtype_text(a),
        name + ": dtype " + dtype_text(a) + " is not supported; valid: float32, or uint16 holding bfloat16");
  }
  if (a.ndim() != 4) {
    problems.add(name, shape_text(a),
                 name + ": shape " + shape_text(a) + " has " + std::to_string(a.ndim()) +
                     " dimensions; expected 4: [batch, seq, heads, head_dim]");
  }
  if (!dtype || a.ndim() != 4) return std::nullopt;
  const auto item = static_cast<py::ssize_t>(dtype_size(*dtype));
  bool direct = a.shape(3) <= 1 || a.strides(3) == item;
  for (int i = 0; i < 4; ++i) direct = direct && a.strides(i) >= 0 && a.strides(i) % item == 0;
  if (!direct) {
    // A copy numpy cannot make (ensure returns null, whatever numpy's reason, and clears it): out of memory
    // for the copy, named.
    a = py::array::ensure(a, py::array::c_style);
    if (!a) {
      PyErr_Clear();
      problems.out_of_memory(static_cast<std::size_t>(py::reinterpret_borrow<py::array>(obj).nbytes()),
                             name + " (a C-order copy of a strided array)");
      return std::nullopt;
    }
  }
  ArrayRef out{a, {}};
  out.ref.ptr = a.data();
  out.ref.dtype = *dtype;
  out.ref.shape = {a.shape(0), a.shape(1), a.shape(2), a.shape(3)};
  for (int i = 0; i < 4; ++i) out.ref.stride[static_cast<std::size_t>(i)] = a.strides(i) / item;
  out.ref.stride[3] = 1;
  return out;
}

// segment_ids [B, S] of int32 or int64 as int32 (values outside int32 refused).
// sinks=: None, or a float32 array [Hq] (one logit per q head); copied.
std::vector<float> read_sinks(const py::handle& obj, std::int64_t q_heads, Problems& problems) {
  if (obj.is_none()) return {};
  py::array a;
  try {
    a = py::array::ensure(obj);
  } catch (const py::error_already_set&) {
  }
  if (!a) PyErr_Clear();
  if (!a || !a.dtype().is(py::dtype::of<float>())) {
    problems.add("sinks", a ? dtype_text(a) : py::str(py::type::of(obj)).cast<std::string>(),
                 "sinks: expected a float32 array [" + std::to_string(q_heads) + "] (one logit per q head)");
    return {};
  }
  if (a.ndim() != 1 || a.shape(0) != q_heads) {
    problems.add("sinks", shape_text(a),
                 "sinks: shape " + shape_text(a) + "; expected [" + std::to_string(q_heads) +
                     "] (one logit per q head)");
    return {};
  }
  auto v = a.cast<py::array_t<float, py::array::forcecast>>().unchecked<1>();
  std::vector<float> out(static_cast<std::size_t>(q_heads));
  for (std::int64_t h = 0; h < q_heads; ++h) {
    out[static_cast<std::size_t>(h)] = v(h);
    if (std::isnan(v(h)) || v(h) == std::numeric_limits<float>::infinity()) {
      problems.add("sinks", std::to_string(v(h)),
                   "sinks[" + std::to_string(h) + "] is " + (std::isnan(v(h)) ? "NaN" : "+inf") +
                       "; valid: a finite logit, or -inf for no sink");
      return {};
    }
  }
  return out;
}

std::vector<std::int32_t> read_segments(const py::handle& obj, std::int64_t batch, std::int64_t seq,
                                        Problems& problems) {
  if (obj.is_none()) return {};
  py::array a;
  try {
    a = py::array::ensure(obj);
  } catch (const py::error_already_set&) {
  }
  if (!a) PyErr_Clear();  // not an array numpy can make: refused below
  if (!a || !(a.dtype().is(py::dtype::of<std::int32_t>()) || a.dtype().is(py::dtype::of<std::int64_t>()))) {
    problems.add("segment_ids", a ? dtype_text(a) : py::str(py::type::of(obj)).cast<std::string>(),
                 "segment_ids: expected an int32 or int64 array [batch, seq]");
    return {};
  }
  if (a.ndim() != 2 || a.shape(0) != batch || a.shape(1) != seq) {
    problems.add("segment_ids", shape_text(a),
                 "segment_ids: shape " + shape_text(a) + "; expected [" + std::to_string(batch) + ", " +
                     std::to_string(seq) + "] (batch and seq of q)");
    return {};
  }
  std::vector<std::int32_t> out(static_cast<std::size_t>(batch * seq));
  if (a.dtype().is(py::dtype::of<std::int32_t>())) {
    auto v = a.cast<py::array_t<std::int32_t, py::array::forcecast>>().unchecked<2>();
    for (std::int64_t b = 0; b < batch; ++b)
      for (std::int64_t s = 0; s < seq; ++s) out[static_cast<std::size_t>(b * seq + s)] = v(b, s);
    return out;
  }
  auto v = a.cast<py::array_t<std::int64_t, py::array::forcecast>>().unchecked<2>();
  for (std::int64_t b = 0; b < batch; ++b) {
    for (std::int64_t s = 0; s < seq; ++s) {
      const std::int64_t x = v(b, s);
      if (x < INT32_MIN || x > INT32_MAX) {
        problems.add("segment_ids", std::to_string(x),
                     "segment_ids: value " + std::to_string(x) + " at [" + std::to_string(b) + ", " +
                         std::to_string(s) + "] is outside int32");
        return {};
      }
      out[static_cast<std::size_t>(b * seq + s)] = static_cast<std::int32_t>(x);
    }
  }
  return out;
}

// The attention problem q, k, v describe (one process: cp = 1, S = the arrays' seq), every broken rule
// collected in `problems`.
AttentionSpec spec_of(const std::optional<ArrayRef>& q, const std::optional<ArrayRef>& k,
                      const std::optional<ArrayRef>& v, bool causal, std::optional<double> scale,
                      const WindowSides& window, std::optional<double> softcap, Problems& problems) {
  AttentionSpec a;
  a.causal = causal;
  a.softmax_scale = scale;
  a.softcap = softcap;
  a.window_left = window.left;
  a.window_right = window.right;
  if (!q || !k || !v) return a;
  const Shape4 &sq = q->ref.shape, &sk = k->ref.shape, &sv = v->ref.shape;
  if (!(sk == sv)) {
    problems.add("v", to_string(sv), "v: shape " + to_string(sv) + " differs from k's " + to_string(sk));
  }
  if (k->ref.dtype != q->ref.dtype || v->ref.dtype != q->ref.dtype) {
    problems.add("k", to_string(k->ref.dtype),
                 std::string("q, k, v: dtypes ") + to_string(q->ref.dtype) + ", " + to_string(k->ref.dtype) +
                     ", " + to_string(v->ref.dtype) + " differ; all three must be one dtype");
  }
  if (sk.b != sq.b || sk.s != sq.s) {
    problems.add("k", to_string(sk),
                 "k: shape " + to_string(sk) + " has batch and seq " + std::to_string(sk.b) + ", " +
                     std::to_string(sk.s) + "; q's are " + std::to_string(sq.b) + ", " +
                     std::to_string(sq.s) + " (self-attention: the same tokens)");
  }
  if (sk.d != sq.d) {
    problems.add("k", std::to_string(sk.d),
                 "k: head_dim " + std::to_string(sk.d) + " differs from q's " + std::to_string(sq.d));
  }
  if (sq.b < 1 || sq.s < 1) {
    problems.add("q", to_string(sq), "q: shape " + to_string(sq) + " is empty; batch and seq must be >= 1");
  }
  a.batch = sq.b;
  a.seq_len = sq.s;
  a.num_q_heads = sq.h;
  a.num_kv_heads = sk.h;
  a.head_dim = sq.d;
  a.dtype = q->ref.dtype;
  return a;
}

void add_rule_errors(const AttentionSpec& a, const ParallelSpec& p, Problems& problems) {
  problems.append(validation_errors(a, p));
}

// An owning numpy array over a Tensor's storage (no copy: the Tensor lives in the array's capsule).
py::array to_numpy(Tensor&& t) {
  auto* owner = new Tensor(std::move(t));
  py::capsule free(owner, [](void* p) { delete static_cast<Tensor*>(p); });
  const Shape4 s = owner->shape();
  const auto item = static_cast<py::ssize_t>(dtype_size(owner->dtype()));
  const std::vector<py::ssize_t> shape = {s.b, s.s, s.h, s.d};
  const std::vector<py::ssize_t> strides = {s.s * s.h * s.d * item, s.h * s.d * item, s.d * item, item};
  const py::dtype dt = owner->dtype() == DType::f32 ? py::dtype::of<float>() : py::dtype::of<std::uint16_t>();
  return py::array(dt, shape, strides, owner->raw(), free);
}

py::array lse_to_numpy(std::vector<float>&& lse, std::int64_t b, std::int64_t h, std::int64_t s) {
  auto* owner = new std::vector<float>(std::move(lse));
  py::capsule free(owner, [](void* p) { delete static_cast<std::vector<float>*>(p); });
  return py::array_t<float>({b, h, s}, owner->data(), free);
}

std::vector<std::int32_t> natural_positions(std::int64_t batch, std::int64_t seq) {
  std::vector<std::int32_t> pos(static_cast<std::size_t>(batch * seq));
  for (std::int64_t b = 0; b < batch; ++b)
    for (std::int64_t s = 0; s < seq; ++s)
      pos[static_cast<std::size_t>(b * seq + s)] = static_cast<std::int32_t>(s);
  return pos;
}

// The one-process functions' options: causal, window, scale and threads, read as their flags are.
struct KernelOptions {
  bool causal = true;
  WindowSides window;
  std::optional<double> softcap;
  std::optional<double> scale;
  FlashConfig config;
};

KernelOptions kernel_options(const py::object& causal, const py::object& window, const py::object& softcap,
                             const py::object& scale, const py::object& threads, Problems& problems) {
  KernelOptions out;
  out.causal = read_switch(causal, "causal", problems).value_or(true);
  out.window = read_window(window, problems);
  out.softcap = read_number(softcap, "softcap", kMinSoftcap, kMaxSoftcap, problems);
  out.scale = read_number(scale, "scale", kMinScale, kMaxScale, problems);
  const auto t = read_count(threads, "threads", 1, kMaxThreads, problems);
  out.config.threads =
      threads_per_rank(static_cast<int>(t.value_or(0)), 1);  // default: every hardware thread
  return out;
}

py::tuple attention(const py::object& q_obj, const py::object& k_obj, const py::object& v_obj,
                    const py::object& causal_obj, const py::object& segment_ids, const py::object& scale,
                    const py::object& threads, const py::object& window_obj, const py::object& softcap_obj,
                    const py::object& sinks_obj) {
  Problems problems;
  const auto [causal, window, softcap, scale_value, config] =
      kernel_options(causal_obj, window_obj, softcap_obj, scale, threads, problems);
  auto q = read_tensor(q_obj, "q", problems), k = read_tensor(k_obj, "k", problems),
       v = read_tensor(v_obj, "v", problems);
  const AttentionSpec a = spec_of(q, k, v, causal, scale_value, window, softcap, problems);
  if (problems.empty()) add_rule_errors(a, ParallelSpec{}, problems);
  problems.raise();
  const auto seg = read_segments(segment_ids, a.batch, a.seq_len, problems);
  const auto sinks = read_sinks(sinks_obj, a.num_q_heads, problems);
  problems.raise();
  const auto pos = natural_positions(a.batch, a.seq_len);
  Tensor o(a.dtype, {a.batch, a.seq_len, a.num_q_heads, a.head_dim});
  std::vector<float> lse(static_cast<std::size_t>(a.batch * a.num_q_heads * a.seq_len));
  {
    const KernelCall call;  // the GIL released, Ctrl-C an interrupt
    AttentionMask mask = a.mask(pos, pos, seg, seg);
    mask.sinks = sinks;
    flash_forward(q->ref, k->ref, v->ref, mask, a.scale(), config, ref(o), lse.data());
  }
  return py::make_tuple(to_numpy(std::move(o)),
                        lse_to_numpy(std::move(lse), a.batch, a.num_q_heads, a.seq_len));
}

py::tuple attention_backward(const py::object& q_obj, const py::object& k_obj, const py::object& v_obj,
                             const py::object& o_obj, const py::object& lse_obj, const py::object& do_obj,
                             const py::object& causal_obj, const py::object& segment_ids,
                             const py::object& scale, const py::object& threads, const py::object& window_obj,
                             const py::object& softcap_obj, const py::object& sinks_obj) {
  Problems problems;
  const auto [causal, window, softcap, scale_value, config] =
      kernel_options(causal_obj, window_obj, softcap_obj, scale, threads, problems);
  auto q = read_tensor(q_obj, "q", problems), k = read_tensor(k_obj, "k", problems),
       v = read_tensor(v_obj, "v", problems), o = read_tensor(o_obj, "o", problems),
       d_out = read_tensor(do_obj, "do", problems);
  const AttentionSpec a = spec_of(q, k, v, causal, scale_value, window, softcap, problems);
  if (problems.empty()) add_rule_errors(a, ParallelSpec{}, problems);
  if (q) {
    for (const auto& [x, name] : {std::pair{&o, "o"}, std::pair{&d_out, "do"}}) {
      if (*x && !((*x)->ref.shape == q->ref.shape && (*x)->ref.dtype == q->ref.dtype)) {
        problems.add(name, to_string((*x)->ref.shape),
                     std::string(name) + ": shape " + to_string((*x)->ref.shape) + " " +
                         to_string((*x)->ref.dtype) + " differs from q's " + to_string(q->ref.shape) + " " +
                         to_string(q->ref.dtype));
      }
    }
  }
  py::array lse;
  if (!py::isinstance<py::array>(lse_obj) ||
      !py::reinterpret_borrow<py::array>(lse_obj).dtype().is(py::dtype::of<float>())) {
    problems.add("lse", "", "lse: expected the float32 array [B, Hq, S] that attention returned");
  } else {
    lse = py::array::ensure(lse_obj, py::array::c_style);
    if (!lse) {
      PyErr_Clear();
      problems.out_of_memory(static_cast<std::size_t>(py::reinterpret_borrow<py::array>(lse_obj).nbytes()),
                             "lse (a C-order copy)");
    }
    if (q && !(lse.ndim() == 3 && lse.shape(0) == a.batch && lse.shape(1) == a.num_q_heads &&
               lse.shape(2) == a.seq_len)) {
      problems.add("lse", shape_text(lse),
                   "lse: shape " + shape_text(lse) + "; expected [" + std::to_string(a.batch) + ", " +
                       std::to_string(a.num_q_heads) + ", " + std::to_string(a.seq_len) + "]");
    }
  }
  problems.raise();
  const auto seg = read_segments(segment_ids, a.batch, a.seq_len, problems);
  const auto sinks = read_sinks(sinks_obj, a.num_q_heads, problems);
  problems.raise();
  const auto pos = natural_positions(a.batch, a.seq_len);
  Tensor dq(a.dtype, q->ref.shape), dk(a.dtype, k->ref.shape), dv(a.dtype, v->ref.shape);
  std::vector<float> dsinks(sinks.size());
  {
    const KernelCall call;  // the GIL released, Ctrl-C an interrupt
    AttentionMask mask = a.mask(pos, pos, seg, seg);
    mask.sinks = sinks;
    flash_backward(q->ref, k->ref, v->ref, o->ref, static_cast<const float*>(lse.data()), d_out->ref, mask,
                   a.scale(), config, ref(dq), ref(dk), ref(dv), nullptr,
                   sinks.empty() ? nullptr : dsinks.data());
  }
  if (sinks.empty())
    return py::make_tuple(to_numpy(std::move(dq)), to_numpy(std::move(dk)), to_numpy(std::move(dv)));
  return py::make_tuple(to_numpy(std::move(dq)), to_numpy(std::move(dk)), to_numpy(std::move(dv)),
                        py::array_t<float>(static_cast<py::ssize_t>(dsinks.size()), dsinks.data()));
}

// The most positions local_positions returns (1 GiB of int64): a rank's share of any real row is far less,
// and the answer stays within seconds.
constexpr std::int64_t kMaxLocalPositions = std::int64_t{1} << 27;

py::array local_positions_of(const py::object& seq_obj, const py::object& cp_obj, const py::object& rank_obj,
                             const py::object& layout_obj, const py::object& documents_obj,
                             const py::object& causal_obj, const py::object& window_obj) {
  Problems problems;
  const auto seq = read_count(seq_obj, "seq_len", 1, std::numeric_limits<std::int32_t>::max(), problems);
  const auto cp_read = read_count(cp_obj, "cp", 1, kMaxRanks, problems);
  const auto rank_read = read_count(rank_obj, "rank", 0, kMaxRanks - 1, problems);
  if (!py::isinstance<py::str>(layout_obj)) {
    problems.add("layout", repr_of(layout_obj),
                 "layout: expected 'contiguous', 'dual_chunk_swap', 'per_document' or 'solver', got " +
                     type_of(layout_obj) + " " + repr_of(layout_obj));
  }
  for (const auto& [obj, field] :
       {std::pair{&seq_obj, "seq_len"}, std::pair{&cp_obj, "cp"}, std::pair{&rank_obj, "rank"}}) {
    if (obj->is_none())
      problems.add(field, "None", std::string(field) + ": None is not a value; valid: an int");
  }
  problems.raise();
  const std::int64_t seq_len = *seq, cp = *cp_read, rank = *rank_read;
  if (rank >= cp) {
    problems.add("rank", std::to_string(rank),
                 "rank: " + std::to_string(rank) + " must be in [0, cp) = [0, " + std::to_string(cp) + ")");
  }
  ShardLayout l = ShardLayout::contiguous;
  try {
    l = parse_layout(layout_obj.cast<std::string>(), "layout");
  } catch (const Error& e) {
    problems.append(e.items());
    problems.raise();  // with the rank's problem, if any
  }
  const std::int64_t chunks = layout_chunks(l, cp);
  if (seq_len / cp > kMaxLocalPositions) {
    problems.add("seq_len", std::to_string(seq_len),
                 "seq_len / cp (" + std::to_string(seq_len / cp) +
                     ") is more positions than local_positions "
                     "returns; valid: at most " +
                     std::to_string(kMaxLocalPositions) + " per rank");
  }
  if (seq_len < chunks || seq_len % chunks != 0) {
    problems.add("seq_len", std::to_string(seq_len),
                 "seq_len: " + std::to_string(seq_len) + " must be a positive multiple of " +
                     std::to_string(chunks) + " (" + to_string(l) + " at cp " + std::to_string(cp) + ")");
  }
  const std::vector<std::int64_t> documents = read_documents(documents_obj, problems);
  const bool causal = read_switch(causal_obj, "causal", problems).value_or(true);
  const WindowSides window = read_window(window_obj, problems);
  problems.raise();
  std::vector<std::int64_t> pos;
  if (layout_reads_documents(l)) {
    ParallelSpec p;
    p.cp = cp;
    p.strategy = Strategy::ring;
    p.layout = l;
    p.documents = documents;
    pos = document_layout_positions(seq_len, p, rank, causal, window);
  } else {
    pos = local_positions(l, seq_len, cp, rank);
  }
  py::array_t<std::int64_t> out(static_cast<py::ssize_t>(pos.size()));
  std::copy(pos.begin(), pos.end(), out.mutable_data());
  return out;
}

py::tuple run_document(const std::string& command,
                       const std::vector<std::pair<std::string, py::object>>& kwargs) {
  // Typed as Python has them (bool before int: a bool is an int); anything else as its str().
  std::vector<std::pair<std::string, KeywordValue>> keywords;
  for (const auto& [name, value] : kwargs) {
    if (py::isinstance<py::bool_>(value)) {
      keywords.emplace_back(name, value.cast<bool>());
    } else if (py::isinstance<py::int_>(value)) {
      keywords.emplace_back(name, py::str(value).cast<std::string>());  // any size: the parser bounds it
    } else {  // a float as Python writes it: 4.0 is no integer, as "--cp 4.0" is not
      keywords.emplace_back(name, py::str(value).cast<std::string>());
    }
  }
  const DocumentAnswer answer = keyword_answer(command, keywords);
  return py::make_tuple(answer.exit_code, answer.document);
}

// The messages of a Python object (cpattn.torch's _GroupTransport over a torch.distributed process group):
// rank, size, name() and start(sends, recvs, tag) -> an object with wait(timeout_seconds); sends and receives
// are lists of (peer, memoryview). Called from the rank's thread with the GIL released elsewhere: each call
// takes it. A Python exception becomes Error(communication) with its text.
class PyTransport final : public Transport {
 public:
  explicit PyTransport(py::object transport) : transport_(std::move(transport)) {
    rank_ = transport_.attr("rank").cast<int>();
    size_ = transport_.attr("size").cast<int>();
    name_ = transport_.attr("name").cast<std::string>();
  }
  ~PyTransport() override {
    py::gil_scoped_acquire gil;
    transport_ = py::object();
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override { return name_; }

  std::unique_ptr<Pending> start(const std::vector<Message>& sends, const std::vector<Message>& recvs,
                                 std::int64_t tag) override {
    py::gil_scoped_acquire gil;
    try {
      py::list out, in;
      for (const Message& m : sends) out.append(py::make_tuple(m.peer, view(m)));
      for (const Message& m : recvs) in.append(py::make_tuple(m.peer, view(m)));
      return std::make_unique<PyPending>(transport_.attr("start")(out, in, tag), name_);
    } catch (py::error_already_set& e) {
      throw failure(e, name_);
    }
  }

 private:
  static py::memoryview view(const Message& m) {
    return py::memoryview::from_memory(m.data, static_cast<py::ssize_t>(m.bytes), false);
  }
  static Error failure(py::error_already_set& e, const std::string& name) {
    const std::string what = e.what();
    e.restore();
    PyErr_Clear();
    return Error(ErrorKind::communication, "group", name, name + ": " + what);
  }
  struct PyPending final : Pending {
    PyPending(py::object p, std::string n) : pending(std::move(p)), name(std::move(n)) {}
    ~PyPending() override {
      py::gil_scoped_acquire gil;
      pending = py::object();  // the transport's copies stay with its own pending work
    }
    void wait(std::chrono::milliseconds timeout) override {
      py::gil_scoped_acquire gil;
      try {
        pending.attr("wait")(static_cast<double>(timeout.count()) / 1000.0);
      } catch (py::error_already_set& e) {
        throw failure(e, name);
      }
    }
    py::object pending;
    std::string name;
  };
  py::object transport_;
  int rank_ = 0, size_ = 1;
  std::string name_;
};

// What one rank passes in a forward, agreed on by every rank before anything else: a rank whose arguments are
// wrong, or that disagrees with the others, makes every rank raise.
struct ForwardFields {
  enum Field { bad_rank, batch, seq, q_heads, kv_heads, head_dim, dtype, segments, sinks, count };
  static constexpr const char* names[count] = {"rank",       "batch",    "seq (local)", "q heads",
                                               "kv heads",   "head_dim", "dtype",       "segment_ids given",
                                               "sinks given"};
};

// The strategies over an MPI communicator (mpi4py's, by its Fortran handle: an int) or a transport object
// (cpattn.torch's over a torch.distributed process group), one C++ object per problem shape, created on first
// use (every rank creates it at the same call: shapes are agreed on first); the objects of the 8 most
// recently used shapes are kept.
class ContextParallel {
 public:
  // Every option is read on every rank as its flag is, and the ranks agree on the options and on whether any
  // rank's were bad after the collective that makes the communicator: a bad option on one rank, or options
  // that differ, raise on all of them instead of leaving the others waiting or computing other numbers.
  ContextParallel(const py::object& comm, const py::dict& kwargs) {
    Problems problems;
    const auto get = [&](const char* name) {
      return kwargs.contains(name) ? kwargs[name] : py::object(py::none());
    };
    const auto parse = [&](const auto& read) {
      try {
        read();
      } catch (const Error& e) {
        problems.append(e.items());
      }
    };
    const py::object strategy = get("strategy"), layout = get("layout");
    std::string strategy_text = "ulysses", layout_text;
    if (py::isinstance<py::str>(strategy)) {
      strategy_text = strategy.cast<std::string>();
      parse([&] { parallel_.strategy = parse_strategy(strategy_text, "strategy"); });
    } else {
      problems.add("strategy", repr_of(strategy),
                   std::string("strategy: expected one of ") + strategy_names() + ", got " +
                       type_of(strategy) + " " + repr_of(strategy));
    }
    if (py::isinstance<py::str>(layout)) {
      layout_text = layout.cast<std::string>();
      parse([&] { parallel_.layout = parse_layout(layout_text, "layout"); });
    } else if (!layout.is_none()) {
      problems.add("layout", repr_of(layout),
                   "layout: expected 'contiguous', 'dual_chunk_swap', 'per_document' or 'solver', got " +
                       type_of(layout) + " " + repr_of(layout));
    }
    parallel_.load_balance = read_switch(get("load_balance"), "load_balance", problems).value_or(false);
    parallel_.documents = read_documents(get("documents"), problems);
    parallel_.ulysses_degree =
        read_count(get("ulysses_degree"), "ulysses_degree", 1, kMaxRanks, problems).value_or(0);
    causal_ = read_switch(get("causal"), "causal", problems).value_or(true);
    window_ = read_window(get("window"), problems);
    softcap_ = read_number(get("softcap"), "softcap", kMinSoftcap, kMaxSoftcap, problems);
    scale_ = read_number(get("scale"), "scale", kMinScale, kMaxScale, problems);
    options_.remat = read_switch(get("remat"), "remat", problems).value_or(false);
    options_.threads =
        static_cast<int>(read_count(get("threads"), "threads", 1, kMaxThreads, problems).value_or(0));
    const auto timeout = read_number(get("timeout"), "timeout", 0.001, 86400, problems);
    std::chrono::milliseconds deadline = std::chrono::seconds(600);
    if (timeout) deadline = std::chrono::milliseconds(static_cast<std::int64_t>(*timeout * 1000));
    CommunicatorOptions options;
    options.timeout = deadline;
    Backend backend = Backend::mpi;
    if (py::isinstance<py::int_>(comm)) {
      options.fortran_handle = comm.cast<std::int64_t>();  // mpi4py's: MPI initialised by it (else an error)
    } else {
      options.transport = std::make_shared<PyTransport>(comm);
      backend = Backend::transport;
    }
    {
      py::gil_scoped_release release;
      comm_ = make_communicator(backend, options);
    }
    cpattn::Agreement agreement;
    agreement.add_text("strategy", strategy_text)
        .add("causal", causal_)
        .add("window_left", window_.left.value_or(-1))
        .add("window_right", window_.right.value_or(-1))
        .add("softcap", softcap_.value_or(0.0))
        .add("load_balance", parallel_.load_balance)
        .add_text("layout", layout_text)
        .add("documents", static_cast<std::int64_t>(parallel_.documents.size()))
        .add("ulysses_degree", parallel_.ulysses_degree)
        .add("scale", scale_.value_or(0.0))
        .add("remat", options_.remat)
        .add("threads", static_cast<std::int64_t>(options_.threads))
        .add("timeout", static_cast<std::int64_t>(deadline.count()));
    // First whether any rank's options are bad (its own error names them), then whether the good ones agree.
    std::int64_t bad = problems.empty() ? -1 : comm_->rank();
    {
      py::gil_scoped_release release;
      comm_->all_reduce(&bad, 1, ReduceOp::max);
    }
    problems.raise();
    if (bad >= 0) {
      throw Error(ErrorKind::invalid_config, "rank", std::to_string(bad),
                  "rank " + std::to_string(bad) +
                      " passed options that are not valid (its error names them); nothing was made");
    }
    {
      py::gil_scoped_release release;
      cpattn::agree(*comm_, agreement);
    }
    parallel_.cp = comm_->size();
  }

  int rank() const { return comm_->rank(); }
  int size() const { return comm_->size(); }
  // The ring's (ring, hybrid) seconds waiting on its shifts, of the object that ran last, since that object's
  // last forward began.
  double comm_wait_seconds() const { return last_wait_; }

  // (o, lse, saved): saved goes back to backward.
  py::tuple forward(const py::object& q_obj, const py::object& k_obj, const py::object& v_obj,
                    const py::object& segment_ids, const std::string& caller_problem, bool forward_only,
                    const py::object& sinks_obj) {
    Problems problems;
    std::optional<ArrayRef> q, k, v;
    if (!caller_problem.empty()) {
      problems.add("input", "", caller_problem);
    } else {
      q = read_tensor(q_obj, "q", problems);
      k = read_tensor(k_obj, "k", problems);
      v = read_tensor(v_obj, "v", problems);
    }
    AttentionSpec a = spec_of(q, k, v, causal_, scale_, window_, softcap_, problems);
    a.sinks = !sinks_obj.is_none();
    std::vector<std::int32_t> seg;
    std::vector<float> sinks;
    if (problems.empty()) seg = read_segments(segment_ids, a.batch, a.seq_len, problems);
    if (problems.empty()) sinks = read_sinks(sinks_obj, a.num_q_heads, problems);
    const std::int64_t local_seq = a.seq_len;
    a.seq_len = local_seq * parallel_.cp;
    agree(a, local_seq, !segment_ids.is_none(), problems);
    // Every rank holds the same spec now: the rules are the same everywhere, and so is the error.
    const std::shared_ptr<ContextParallelAttention> cp = object_for(a);
    // A copy that cannot be made on this rank alone: empty tensors go in, which the object's own check
    // refuses on every rank; this rank then raises the allocation's error.
    Tensor qt, kt, vt;
    std::optional<Error> copy_failed;
    try {
      qt = copy_in(q->ref);
      kt = copy_in(k->ref);
      vt = copy_in(v->ref);
    } catch (const Error& e) {
      copy_failed = e;
      qt = kt = vt = Tensor();
    }
    AttentionOutput out;
    std::shared_ptr<ContextParallelAttention::Saved> saved;
    try {
      const KernelCall call;  // the GIL released, Ctrl-C an interrupt
      out = cp->forward(qt, kt, vt, seg, forward_only, sinks);
      last_wait_ = cp->comm_wait_seconds();
      if (!forward_only) saved = cp->take_saved();
    } catch (const Error&) {
      if (copy_failed) throw *copy_failed;
      throw;
    }
    const Shape4 os = out.o.shape();
    py::array o = to_numpy(std::move(out.o));
    py::array lse = lse_to_numpy(std::move(out.lse), os.b, os.h, os.s);
    py::object handle = py::none();
    if (saved) handle = py::cast(SavedForward{cp, std::move(saved)});
    return py::make_tuple(o, lse, handle);
  }

  // A forward's state for its backward, with the object that made it (kept alive by it, even after the object
  // left the cache of recent shapes).
  struct SavedForward {
    std::shared_ptr<ContextParallelAttention> object;
    std::shared_ptr<ContextParallelAttention::Saved> saved;
  };

  py::tuple backward(SavedForward& saved, const py::object& do_obj, const std::string& caller_problem) {
    Problems problems;
    std::optional<ArrayRef> d_out;
    if (!caller_problem.empty()) {
      problems.add("input", "", caller_problem);
    } else {
      d_out = read_tensor(do_obj, "do", problems);
    }
    // The object checks d_out against its spec on every rank (and agrees on the outcome) before data moves;
    // a rank whose argument could not even be read passes an empty tensor, which fails that check.
    Tensor dt = d_out && problems.empty() ? copy_in(d_out->ref) : Tensor();
    AttentionGradients g;
    try {
      const KernelCall call;  // the GIL released, Ctrl-C an interrupt
      g = saved.object->backward(dt, *saved.saved);
      last_wait_ = saved.object->comm_wait_seconds();
    } catch (const Error&) {
      problems.raise();  // this rank's own reason first
      throw;
    }
    py::object dsinks = py::none();
    if (!g.dsinks.empty())
      dsinks = py::array_t<float>(static_cast<py::ssize_t>(g.dsinks.size()), g.dsinks.data());
    return py::make_tuple(to_numpy(std::move(g.dq)), to_numpy(std::move(g.dk)), to_numpy(std::move(g.dv)),
                          dsinks);
  }

  py::array local_positions(const py::object& seq_len) const {
    const ShardLayout l = parallel_.effective_layout();
    if (!layout_reads_documents(l)) {
      return local_positions_of(seq_len, py::int_(parallel_.cp), py::int_(comm_->rank()),
                                py::str(to_string(l)), py::none(), py::bool_(true), py::none());
    }
    Problems problems;
    const auto seq = read_count(seq_len, "seq_len", 1, std::numeric_limits<std::int32_t>::max(), problems);
    problems.raise();
    const auto pos = document_layout_positions(*seq, parallel_, comm_->rank(), causal_, window_);
    py::array_t<std::int64_t> out(static_cast<py::ssize_t>(pos.size()));
    std::copy(pos.begin(), pos.end(), out.mutable_data());
    return out;
  }

 private:
  static std::string key_of(const AttentionSpec& a) {
    return std::to_string(a.batch) + "," + std::to_string(a.seq_len) + "," + std::to_string(a.num_q_heads) +
           "," + std::to_string(a.num_kv_heads) + "," + std::to_string(a.head_dim) + "," +
           to_string(a.dtype) + (a.sinks ? ",sinks" : "");
  }

  void agree(const AttentionSpec& a, std::int64_t local_seq, bool has_segments, const Problems& problems) {
    const int rank = comm_->rank();
    std::int64_t mine[ForwardFields::count] = {problems.empty() ? -1 : rank,
                                               a.batch,
                                               local_seq,
                                               a.num_q_heads,
                                               a.num_kv_heads,
                                               a.head_dim,
                                               static_cast<std::int64_t>(a.dtype),
                                               has_segments ? 1 : 0,
                                               a.sinks ? 1 : 0};
    // max of each field, then max of its negation (the min), in one call
    std::int64_t both[2 * ForwardFields::count];
    for (int i = 0; i < ForwardFields::count; ++i) {
      both[i] = mine[i];
      both[ForwardFields::count + i] = -mine[i];
    }
    {
      py::gil_scoped_release release;
      comm_->all_reduce(both, 2 * ForwardFields::count, ReduceOp::max);
    }
    problems.raise();
    const std::string me = "rank " + std::to_string(rank) + ": ";
    if (both[ForwardFields::bad_rank] >= 0) {
      throw Error(ErrorKind::invalid_input, "rank", std::to_string(both[ForwardFields::bad_rank]),
                  me + "rank " + std::to_string(both[ForwardFields::bad_rank]) +
                      " passed arguments that cannot run (its error names them); nothing was computed");
    }
    std::vector<ErrorItem> items;
    for (int i = ForwardFields::batch; i < ForwardFields::count; ++i) {
      const std::int64_t hi = both[i], lo = -both[ForwardFields::count + i];
      if (hi != lo) {
        items.push_back({{ForwardFields::names[i]},
                         std::to_string(mine[i]),
                         me + std::string(ForwardFields::names[i]) + " differs between ranks (from " +
                             std::to_string(lo) + " to " + std::to_string(hi) + "; this rank's: " +
                             std::to_string(mine[i]) + "); every rank must pass the same shapes"});
      }
    }
    if (!items.empty()) throw Error(ErrorKind::invalid_input, items);
  }

  // The object for a shape: the most recently used shapes keep theirs (every rank makes the same calls in the
  // same order, so every rank keeps and evicts the same ones; creating one is collective).
  std::shared_ptr<ContextParallelAttention> object_for(const AttentionSpec& a) {
    const std::string key = key_of(a);
    auto it = std::find_if(objects_.begin(), objects_.end(), [&](const auto& o) { return o.first == key; });
    if (it != objects_.end()) {
      std::rotate(objects_.begin(), it, it + 1);  // most recent first
      return objects_.front().second;
    }
    std::shared_ptr<ContextParallelAttention> made;
    {
      py::gil_scoped_release release;
      made = std::make_shared<ContextParallelAttention>(a, parallel_, *comm_, options_);
    }
    objects_.insert(objects_.begin(), {key, made});
    if (objects_.size() > kept_shapes) objects_.pop_back();
    return made;
  }

  static Tensor copy_in(const ConstTensorRef& r) {
    Tensor t(r.dtype, r.shape);
    const std::size_t row = static_cast<std::size_t>(r.shape.d) * dtype_size(r.dtype);
    auto* dst = static_cast<char*>(t.raw());
    const auto* src = static_cast<const char*>(r.ptr);
    const auto item = static_cast<std::int64_t>(dtype_size(r.dtype));
    for (std::int64_t b = 0; b < r.shape.b; ++b)
      for (std::int64_t s = 0; s < r.shape.s; ++s)
        for (std::int64_t h = 0; h < r.shape.h; ++h, dst += row)
          std::memcpy(dst, src + r.offset(b, s, h) * item, row);
    return t;
  }

  ParallelSpec parallel_;
  bool causal_ = true;
  WindowSides window_;
  std::optional<double> softcap_;
  std::optional<double> scale_;
  ContextParallelOptions options_;
  std::unique_ptr<Communicator> comm_;
  static constexpr std::size_t kept_shapes = 8;
  std::vector<std::pair<std::string, std::shared_ptr<ContextParallelAttention>>>
      objects_;  // most recent first
  double last_wait_ = 0;
};

}  // namespace
}  // namespace cpattn::python

PYBIND11_MODULE(_cpattn, m) {
  using namespace cpattn;
  using namespace cpattn::python;
  m.doc() = "cpattn's extension; use the cpattn and cpattn.torch modules";

  static py::exception<Error> config_error(m, "ConfigError", PyExc_ValueError);
  static py::exception<Error> communication_error(m, "CommunicationError", PyExc_RuntimeError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error& e) {
      if (e.kind() == ErrorKind::interrupted) {
        PyErr_SetString(PyExc_KeyboardInterrupt, e.what());
        return;
      }
      py::list items;
      for (const ErrorItem& i : e.items()) {
        py::dict d;
        d["field"] = i.fields.empty() ? std::string() : i.fields.front();
        d["fields"] = i.fields;
        d["value"] = i.value;
        d["message"] = i.message;
        items.append(d);
      }
      const bool config = e.kind() == ErrorKind::invalid_config || e.kind() == ErrorKind::invalid_input;
      py::object type = config ? py::object(config_error) : py::object(communication_error);
      if (e.kind() == ErrorKind::internal) type = py::reinterpret_borrow<py::object>(PyExc_RuntimeError);
      if (e.kind() == ErrorKind::out_of_memory) type = py::reinterpret_borrow<py::object>(PyExc_MemoryError);
      if (e.kind() == ErrorKind::resource) type = py::reinterpret_borrow<py::object>(PyExc_OSError);
      py::object instance = type(std::string(e.what()));
      if (e.kind() != ErrorKind::internal) instance.attr("errors") = items;
      PyErr_SetObject(type.ptr(), instance.ptr());
    }
  });

  m.def("attention", &attention, py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("causal") = py::bool_(true), py::arg("segment_ids") = py::none(),
        py::arg("scale") = py::none(), py::arg("threads") = py::none(), py::arg("window") = py::none(),
        py::arg("softcap") = py::none(), py::arg("sinks") = py::none());
  m.def("attention_backward", &attention_backward, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("o"),
        py::arg("lse"), py::arg("do"), py::arg("causal") = py::bool_(true),
        py::arg("segment_ids") = py::none(), py::arg("scale") = py::none(), py::arg("threads") = py::none(),
        py::arg("window") = py::none(), py::arg("softcap") = py::none(), py::arg("sinks") = py::none());
  m.def("local_positions", &local_positions_of, py::arg("seq_len"), py::arg("cp"), py::arg("rank"),
        py::arg("layout") = py::str("contiguous"), py::arg("documents") = py::none(),
        py::arg("causal") = py::bool_(true), py::arg("window") = py::none());
  m.def("_run_document", &run_document);
  m.def("simd_target", [] { return flash_vector_target(); });
  m.attr("with_mpi") = available(Backend::mpi);
  py::class_<ContextParallel::SavedForward>(m, "_SavedForward");
  py::class_<ContextParallel>(m, "_ContextParallel")
      .def(py::init<const py::object&, const py::dict&>(), py::arg("comm"), py::arg("options"))
      .def_property_readonly("rank", &ContextParallel::rank)
      .def_property_readonly("size", &ContextParallel::size)
      .def_property_readonly("comm_wait_seconds", &ContextParallel::comm_wait_seconds)
      .def("forward", &ContextParallel::forward)
      .def("backward", &ContextParallel::backward)
      .def("local_positions", &ContextParallel::local_positions);
}
