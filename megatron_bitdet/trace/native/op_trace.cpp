// Op-level tracing as a C++ dispatcher fallback: the per-op work of the Python TorchDispatchMode
// (ops.py) without a Python frame per op.
//
// The fallback sits on the `Fake` functionality key, directly below `Python`: it sees the same
// post-autograd ATen ops a TorchDispatchMode sees, and no kernel is registered there in stock torch.
// The key is added to the calling thread's included set while a traced step runs and the tracer is
// not quiet; inside the fallback it is excluded, so ops run by kernels, by digests or by a capture
// callback are not traced (as a mode is popped while its handler runs). Unlike a Python mode it does
// not make torch take its "a dispatch mode is active" paths (AccumulateGrad steals gradients as in an
// untraced step instead of cloning them), so op streams differ in a few `detach` records between
// the two tracers: the trace header names the tracer and traces of different tracers are refused.
//
// Lines are byte-identical in format to format.op_line; digests to digest.fast (xxh3_64 over the
// bytes, the symbol taken from the xxhash module the Python side uses). CPU tensors only: the Python
// side never installs this where an accelerator is present.
#include <torch/extension.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/jit/python/pybind_utils.h>

#include <dlfcn.h>

#include <array>
#include <cinttypes>
#include <cstdio>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace py = pybind11;

namespace {

using Xxh3 = uint64_t (*)(const void*, size_t);

struct OpInfo {
  c10::OperatorName op{"", ""};  // what the entry was made for (a schema's address can be reused)
  std::string name;      // "aten.add.Tensor", as str(OpOverload)
  bool skip = false, uninit = false, view = false;
  std::vector<size_t> write_pos;
  std::vector<bool> kwarg_only;
  std::vector<std::string> arg_names;
  int non_blocking = -1;  // index of a `non_blocking` argument
};

struct State {
  std::mutex mu;
  Xxh3 xxh3 = nullptr;
  std::array<std::string, static_cast<size_t>(c10::ScalarType::NumOptions)> dtypes;
  std::unordered_map<const c10::FunctionSchema*, OpInfo> infos;
  std::map<std::pair<std::vector<int64_t>, std::vector<int64_t>>, std::string> layouts;
  bool active = false;
  int64_t step = 0;
  std::string phase = "forward", phase_js = "\"forward\"";
  std::string scope, scope_js = "\"\"", bwd_scope, bwd_scope_js = "\"\"";
  std::unordered_map<std::string, int64_t> counts;
  std::vector<std::string> lines;
  std::unordered_set<uintptr_t> uninit, inflight;
  std::string armed;  // event id of the op to capture ("" none)
  py::object before, after;
};

State& S() {
  static State* s = new State();  // never destroyed: the fallback may run during interpreter exit
  return *s;
}

const c10::DispatchKeySet kAfterFake(c10::DispatchKeySet::FULL_AFTER, c10::DispatchKey::Fake);

const OpInfo& info_of(const c10::OperatorHandle& op) {
  State& s = S();
  const c10::FunctionSchema* key = &op.schema();
  auto it = s.infos.find(key);
  if (it != s.infos.end() && it->second.op == op.operator_name()) return it->second;
  const auto& schema = op.schema();
  OpInfo info;
  info.op = op.operator_name();
  std::string full = schema.name();  // "aten::add"
  auto sep = full.find("::");
  std::string ns = full.substr(0, sep), base = full.substr(sep + 2);
  info.name = ns + "." + base + "." + (schema.overload_name().empty() ? "default" : schema.overload_name());
  info.skip = ns == "c10d" || ns == "_c10d_functional" || ns == "c10d_functional" || ns == "profiler";
  info.uninit = base == "empty" || base == "empty_like" || base == "empty_strided" || base == "new_empty" ||
                base == "new_empty_strided";
  const auto& args = schema.arguments();
  for (size_t i = 0; i < args.size(); ++i) {
    const auto* alias = args[i].alias_info();
    if (alias && alias->isWrite()) info.write_pos.push_back(i);
    info.kwarg_only.push_back(args[i].kwarg_only());
    info.arg_names.push_back(args[i].name());
    if (args[i].name() == "non_blocking") info.non_blocking = static_cast<int>(i);
  }
  const auto& rets = schema.returns();
  bool all_alias = !rets.empty();
  for (const auto& r : rets) all_alias = all_alias && r.alias_info() && !r.alias_info()->isWrite();
  info.view = ns == "aten" && info.write_pos.empty() && !rets.empty() && (base == "_unsafe_view" || all_alias);
  return s.infos.insert_or_assign(key, std::move(info)).first->second;
}

// ops.py flat_tensors; a wrapped number (a Python scalar argument, 0-d) is a scalar there too
void flat(const c10::IValue& v, std::vector<at::Tensor>& out) {
  if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    if (t.defined() && t.layout() == c10::kStrided && !t.is_meta() && !t.unsafeGetTensorImpl()->is_wrapped_number())
      out.push_back(t);
  } else if (v.isTensorList()) {
    for (const at::Tensor& t : v.toTensorList()) {
      if (t.defined() && t.layout() == c10::kStrided && !t.is_meta()) out.push_back(t);
    }
  } else if (v.isList()) {
    for (const c10::IValue& x : v.toListRef()) flat(x, out);
  } else if (v.isTuple()) {
    for (const c10::IValue& x : v.toTupleRef().elements()) flat(x, out);
  } else if (v.isGenericDict()) {
    for (const auto& kv : v.toGenericDict()) flat(kv.value(), out);
  }
}

std::string prefix(const at::Tensor& t) {
  std::string p = S().dtypes[static_cast<size_t>(t.scalar_type())];
  TORCH_CHECK(!p.empty(), "bitdet native op tracer: no name registered for dtype ", t.scalar_type());
  p += '[';
  bool first = true;
  for (int64_t d : t.sizes()) {
    if (!first) p += ',';
    p += std::to_string(d);
    first = false;
  }
  p += "]:";
  return p;
}

// "s<strides>:" when the dims of size > 1, ordered by stride, tile memory without gaps; "" otherwise
std::string permuted_tag(c10::IntArrayRef shape, c10::IntArrayRef stride) {
  std::vector<std::pair<int64_t, int64_t>> dims;
  for (size_t i = 0; i < shape.size(); ++i)
    if (shape[i] != 1) dims.emplace_back(stride[i], shape[i]);
  std::sort(dims.begin(), dims.end());
  int64_t expected = 1;
  for (const auto& [st, sz] : dims) {
    if (st != expected) return "";
    expected *= sz;
  }
  std::string tag = "s";
  for (size_t i = 0; i < stride.size(); ++i) {
    if (i) tag += ',';
    tag += std::to_string(stride[i]);
  }
  return tag + ":";
}

// digest.span_tag: the tag when the tensor's own memory span is hashed in memory order, else nullopt
std::optional<std::string> span_tag(const at::Tensor& t) {
  if (!t.is_cpu() || t.is_conj() || t.is_neg()) return std::nullopt;
  if (t.is_contiguous()) return std::string();
  auto key = std::make_pair(t.sizes().vec(), t.strides().vec());
  auto& layouts = S().layouts;
  auto it = layouts.find(key);
  if (it == layouts.end()) {
    if (layouts.size() > 65536) layouts.clear();
    bool zero = std::find(key.second.begin(), key.second.end(), 0) != key.second.end();
    it = layouts.emplace(key, zero ? std::string() : permuted_tag(t.sizes(), t.strides())).first;
  }
  if (it->second.empty()) return std::nullopt;
  return it->second;
}

std::string hex(uint64_t h) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016" PRIx64, h);
  return std::string(buf, 16);
}

// digest.fast for a CPU tensor
std::string digest(const at::Tensor& t0) {
  std::string p = prefix(t0);
  size_t n = t0.nbytes();
  if (!n) return p + "empty";
  TORCH_CHECK(t0.is_cpu(), "bitdet native op tracer: tensor on ", t0.device(), " (CPU only)");
  if (auto tag = span_tag(t0)) return p + *tag + hex(S().xxh3(t0.const_data_ptr(), n));
  at::Tensor t = t0;
  if (t.is_conj() || t.is_neg()) t = t.resolve_conj().resolve_neg();
  std::string layout;
  if (!t.is_contiguous()) {
    auto sizes = t.sizes().vec();
    bool zero = false;
    for (size_t i = 0; i < sizes.size(); ++i)
      if (t.stride(i) == 0) sizes[i] = 1, zero = true;
    if (zero) t = t.as_strided(sizes, t.strides());
    layout = permuted_tag(t.sizes(), t.strides());
    if (layout.empty()) t = t.contiguous();
  }
  return p + layout + hex(S().xxh3(t.const_data_ptr(), t.numel() * t.element_size()));
}

// ops.py _same_span: a view over exactly an input's hashed span reuses that input's hex
std::optional<std::string> same_span(const at::Tensor& t, const std::vector<at::Tensor>& in_t,
                                     const std::vector<std::string>& ins) {
  size_t n = t.nbytes();
  if (!n) return std::nullopt;
  auto tag = span_tag(t);
  if (!tag) return std::nullopt;
  const void* ptr = t.const_data_ptr();
  for (size_t i = 0; i < in_t.size(); ++i) {
    if (in_t[i].const_data_ptr() == ptr && in_t[i].nbytes() == n && span_tag(in_t[i]))
      return prefix(t) + *tag + ins[i].substr(ins[i].size() - 16);
  }
  return std::nullopt;
}

uintptr_t addr(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.const_data_ptr()); }

// format._digest_list: the strings need no escaping (digests, flag names)
template <typename Strings>
void append_list(std::string& line, const Strings& xs) {
  line += '[';
  for (size_t i = 0; i < xs.size(); ++i) {
    if (i) line += ',';
    line += '"';
    line += xs[i];
    line += '"';
  }
  line += ']';
}

const std::string kBackward = "backward", kBackwardJs = "\"backward\"";

// Tracer.current(): autograd's engine running a node means backward, scoped by the tensor hooks
struct Where {
  const std::string *phase, *phase_js, *scope, *scope_js;
};

Where where(const State& s) {
  if (torch::autograd::get_current_node()) {
    bool fwd = s.phase == "forward";
    return {fwd ? &kBackward : &s.phase, fwd ? &kBackwardJs : &s.phase_js, &s.bwd_scope, &s.bwd_scope_js};
  }
  return {&s.phase, &s.phase_js, &s.scope, &s.scope_js};
}

std::string count_key(const Where& w, const std::string& name) { return *w.phase_js + '\x1f' + *w.scope_js + '\x1f' + name; }

py::object arguments(const OpInfo& info, torch::jit::Stack* stack, size_t base, py::dict& kwargs) {
  py::list args;
  for (size_t i = 0; i < info.kwarg_only.size(); ++i) {
    py::object v = torch::jit::toPyObject((*stack)[base + i]);
    if (info.kwarg_only[i])
      kwargs[py::str(info.arg_names[i])] = v;
    else
      args.append(v);
  }
  return std::move(args);
}

void fallback(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  c10::impl::ExcludeDispatchKeyGuard guard(c10::DispatchKey::Fake);
  State& s = S();
  std::unique_lock<std::mutex> lock(s.mu);
  const OpInfo& info = info_of(op);
  if (!s.active || info.skip) {
    lock.unlock();
    op.redispatchBoxed(ks & kAfterFake, stack);
    return;
  }
  const size_t nargs = op.schema().arguments().size();
  const size_t base = stack->size() - nargs;
  std::vector<at::Tensor> in_t;
  for (size_t i = base; i < stack->size(); ++i) flat((*stack)[i], in_t);
  std::vector<std::string> ins;
  ins.reserve(in_t.size());
  for (const auto& t : in_t) ins.push_back(digest(t));
  std::vector<const char*> flags;
  std::vector<at::Tensor> written;
  for (size_t i : info.write_pos) flat((*stack)[base + i], written);
  if (!s.uninit.empty()) {
    for (const auto& t : in_t) {
      if (!s.uninit.count(addr(t))) continue;
      bool own = false;
      for (const auto& w : written) own = own || w.unsafeGetTensorImpl() == t.unsafeGetTensorImpl();
      if (!own) {
        flags.push_back("reads_uninit");
        break;
      }
    }
  }
  if (!s.inflight.empty()) {
    for (const auto& t : in_t) {
      if (s.inflight.count(addr(t))) {
        flags.push_back("reads_inflight");
        break;
      }
    }
  }
  bool non_blocking = info.non_blocking >= 0 && (*stack)[base + info.non_blocking].isBool() &&
                      (*stack)[base + info.non_blocking].toBool();
  py::object pending;
  bool armed = false;
  if (!s.armed.empty()) {
    Where w = where(s);
    auto it = s.counts.find(count_key(w, info.name));
    std::string id = std::to_string(s.step) + "/" + *w.phase + "/" + *w.scope + "/" + info.name + "#" +
                     std::to_string(it == s.counts.end() ? 0 : it->second);
    armed = id == s.armed;
  }
  lock.unlock();
  if (armed) {
    py::gil_scoped_acquire gil;
    py::dict kwargs;
    py::object args = arguments(info, stack, base, kwargs);
    pending = s.before(info.name, args, kwargs);
  }
  try {
    op.redispatchBoxed(ks & kAfterFake, stack);
  } catch (...) {
    if (armed) {  // the capture's pending record is a Python object: released under the GIL
      py::gil_scoped_acquire gil;
      pending = py::object();
    }
    throw;
  }
  const size_t nrets = op.schema().returns().size();
  const size_t rbase = stack->size() - nrets;
  if (armed) {
    py::gil_scoped_acquire gil;
    py::object out;
    if (nrets == 1) {
      out = torch::jit::toPyObject((*stack)[rbase]);
    } else {
      py::tuple tup(nrets);
      for (size_t i = 0; i < nrets; ++i) tup[i] = torch::jit::toPyObject((*stack)[rbase + i]);
      out = std::move(tup);
    }
    py::object rec = std::move(pending);  // released in this GIL scope, also when after() raises
    s.after(rec, out);
  }
  lock.lock();
  if (armed) s.armed.clear();  // one occurrence
  if (!s.active) return;
  std::vector<at::Tensor> out_t;
  for (size_t i = rbase; i < stack->size(); ++i) flat((*stack)[i], out_t);
  std::vector<std::string> outs;
  outs.reserve(out_t.size());
  if (info.uninit) {
    flags.push_back("uninit");
    for (const auto& t : out_t) {
      outs.push_back(prefix(t) + "uninit");
      s.uninit.insert(addr(t));
    }
  } else {
    const bool view = info.view && s.inflight.empty();
    for (const auto& t : out_t) {
      std::optional<std::string> d;
      if (view) d = same_span(t, in_t, ins);
      outs.push_back(d ? std::move(*d) : digest(t));
    }
    if (!s.uninit.empty()) {
      for (const auto& t : out_t) s.uninit.erase(addr(t));
      for (const auto& t : written) s.uninit.erase(addr(t));
    }
  }
  if (non_blocking) flags.push_back("nonblocking");
  Where w = where(s);
  int64_t n = s.counts[count_key(w, info.name)]++;
  std::string line = "{\"step\":" + std::to_string(s.step) + ",\"phase\":" + *w.phase_js + ",\"scope\":" + *w.scope_js +
                     ",\"name\":\"" + info.name + "\",\"n\":" + std::to_string(n) + ",\"k\":\"op\",\"in\":";
  append_list(line, ins);
  line += ",\"out\":";
  append_list(line, outs);
  if (!flags.empty()) {
    line += ",\"flags\":";
    append_list(line, flags);
  }
  line += '}';
  s.lines.push_back(std::move(line));
}

void set_included(bool on) { c10::impl::tls_set_dispatch_key_included(c10::DispatchKey::Fake, on); }

}  // namespace

TORCH_LIBRARY_IMPL(_, Fake, m) { m.fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>()); }

void init(const std::string& xxhash_so, const std::vector<std::pair<py::object, std::string>>& dtypes) {
  void* lib = dlopen(xxhash_so.c_str(), RTLD_NOW | RTLD_LOCAL);
  TORCH_CHECK(lib, "bitdet native op tracer: cannot open ", xxhash_so, ": ", dlerror());
  auto fn = reinterpret_cast<Xxh3>(dlsym(lib, "XXH3_64bits"));
  TORCH_CHECK(fn, "bitdet native op tracer: no XXH3_64bits in ", xxhash_so);
  State& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  s.xxh3 = fn;
  for (const auto& [dtype, name] : dtypes) {
    TORCH_CHECK(THPDtype_Check(dtype.ptr()), "bitdet native op tracer: not a torch.dtype");
    s.dtypes[static_cast<size_t>(reinterpret_cast<THPDtype*>(dtype.ptr())->scalar_type)] = name;
  }
}

// A traced step begins on this thread: counts reset, the fallback key included.
void start(int64_t step) {
  State& s = S();
  {
    std::lock_guard<std::mutex> lock(s.mu);
    s.active = true;
    s.step = step;
    s.counts.clear();
  }
  set_included(true);
}

void stop() {
  set_included(false);
  State& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  s.active = false;
  s.uninit.clear();
  s.inflight.clear();
  s.armed.clear();
  s.before = py::object();
  s.after = py::object();
}

// The tracer runs its own torch ops (digests, bookkeeping): not traced while quiet.
void set_quiet(bool quiet) {
  State& s = S();
  bool active;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    active = s.active;
  }
  set_included(active && !quiet);
}

void set_phase(const std::string& raw, const std::string& js) {
  std::lock_guard<std::mutex> lock(S().mu);
  S().phase = raw, S().phase_js = js;
}

void set_scope(const std::string& raw, const std::string& js) {
  std::lock_guard<std::mutex> lock(S().mu);
  S().scope = raw, S().scope_js = js;
}

void set_bwd_scope(const std::string& raw, const std::string& js) {
  std::lock_guard<std::mutex> lock(S().mu);
  S().bwd_scope = raw, S().bwd_scope_js = js;
}

// Arm a capture: before(name, args, kwargs) -> pending, after(pending, out), on that event id only.
void arm(const std::string& event_id, py::object before, py::object after) {
  std::lock_guard<std::mutex> lock(S().mu);
  S().armed = event_id, S().before = std::move(before), S().after = std::move(after);
}

// Address sets the Python side updates (Tracer.mark_uninit / in_flight / landed): "uninit" or "inflight".
std::unordered_set<uintptr_t>& ptrs(const std::string& which) {
  return which == "uninit" ? S().uninit : S().inflight;
}

void ptrs_add(const std::string& which, uintptr_t p) {
  std::lock_guard<std::mutex> lock(S().mu);
  ptrs(which).insert(p);
}

void ptrs_discard(const std::string& which, uintptr_t p) {
  std::lock_guard<std::mutex> lock(S().mu);
  ptrs(which).erase(p);
}

// The op records written since the last call, in order.
std::vector<std::string> take() {
  std::lock_guard<std::mutex> lock(S().mu);
  std::vector<std::string> out;
  out.swap(S().lines);
  return out;
}

std::string tensor_digest(const at::Tensor& t) {
  c10::impl::ExcludeDispatchKeyGuard guard(c10::DispatchKey::Fake);
  std::lock_guard<std::mutex> lock(S().mu);
  return digest(t);
}

// Whether this thread's ops reach the fallback now (nothing is installed outside a traced step).
bool installed() { return c10::impl::tls_is_dispatch_key_included(c10::DispatchKey::Fake); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("init", &init);
  m.def("start", &start);
  m.def("stop", &stop);
  m.def("set_quiet", &set_quiet);
  m.def("set_phase", &set_phase);
  m.def("set_scope", &set_scope);
  m.def("set_bwd_scope", &set_bwd_scope);
  m.def("arm", &arm);
  m.def("ptrs_add", &ptrs_add);
  m.def("ptrs_discard", &ptrs_discard);
  m.def("take", &take);
  m.def("digest", &tensor_digest);
  m.def("installed", &installed);
}
