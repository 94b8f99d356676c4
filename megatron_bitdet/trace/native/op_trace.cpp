// Op-level tracing as a C++ dispatcher fallback: the per-op work of the Python TorchDispatchMode
// (ops.py) without a Python frame per op. Below it, the module hooks (hooks.py's logic, levels module
// and op): scopes and module records kept here, so the records of both join one ordered buffer.
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
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/python/pybind_utils.h>

#include <dlfcn.h>

#include <algorithm>
#include <array>
#include <charconv>
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

// Module hooks' per-step state (hooks.py _ModuleHooks / _GradHook, field for field).
struct GradEntry {
  bool out;                   // the gradient reached the module's output (else: left through its input)
  size_t module;              // index into Hooks::names
  std::string parent, parent_js;  // "in" entries: the scope the gradient goes back to
  bool moves;                 // sets the backward scope
};

struct GradState {
  std::optional<c10::weak_intrusive_ptr<c10::TensorImpl>> tensor;  // held: the address is not reused while mapped
  std::shared_ptr<std::vector<GradEntry>> entries;  // those of the tensor hook this step put on it last
  py::object handle_id;                             // that hook's, when it is a Python one
  const torch::autograd::FunctionPreHook* node_hook = nullptr;  // that hook, when it is a NodeHook
  uint32_t version = 0;
  bool out_claimed = false, in_claimed = false;
};

struct Hooks {
  bool on = false, record = false;
  std::vector<std::string> names, names_js;
  std::vector<std::vector<std::vector<std::string>>> inputs;  // per module: a stack of input digests
  std::unordered_map<c10::TensorImpl*, GradState> grads;
  // grad_output digests awaiting the grad_input, in the insertion order of a Python dict
  std::vector<std::pair<size_t, std::vector<std::string>>> grad_out;
  std::unordered_map<size_t, size_t> grad_out_at;
  py::object trace_tensors, nodes, tensor_type;
  py::list handles;  // the Python tensor hooks' handles, removed with the step
  // the NodeHooks, removed with the step from their nodes (where those still exist)
  std::vector<std::pair<c10::weak_intrusive_ptr<torch::autograd::Node>, const torch::autograd::FunctionPreHook*>>
      node_hooks;
};

struct State {
  std::mutex mu;
  Xxh3 xxh3 = nullptr;
  std::array<std::string, static_cast<size_t>(c10::ScalarType::NumOptions)> dtypes;
  std::unordered_map<const c10::FunctionSchema*, OpInfo> infos;
  bool active = false, ops = false;  // a traced step; its ops reach the fallback (level op)
  int64_t step = 0;
  std::string phase = "forward", phase_js = "\"forward\"";
  std::string scope, scope_js = "\"\"", bwd_scope, bwd_scope_js = "\"\"";
  std::vector<size_t> scopes;  // the module scope stack (indexes into hooks.names); scope is its top
  std::unordered_map<std::string, int64_t> counts;
  std::vector<std::string> lines;
  std::unordered_set<uintptr_t> uninit, inflight;
  std::string armed;  // event id of the op to capture ("" none)
  py::object before, after;
  Hooks hooks;
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

// "dtype[shape]:", with room for the layout tag and hex the digest appends (every record's every
// tensor passes here: no temporary strings)
std::string prefix(const at::Tensor& t) {
  const std::string& name = S().dtypes[static_cast<size_t>(t.scalar_type())];
  TORCH_CHECK(!name.empty(), "bitdet native op tracer: no name registered for dtype ", t.scalar_type());
  std::string p;
  p.reserve(name.size() + 24 + 12 * t.dim());
  p += name;
  p += '[';
  char buf[24];
  bool first = true;
  for (int64_t d : t.sizes()) {
    if (!first) p += ',';
    p.append(buf, std::to_chars(buf, buf + sizeof buf, d).ptr);
    first = false;
  }
  p += "]:";
  return p;
}

// "s<strides>:" when the dims of size > 1, ordered by stride, tile memory without gaps; "" otherwise
std::string permuted_tag(c10::IntArrayRef shape, c10::IntArrayRef stride) {
  c10::SmallVector<std::pair<int64_t, int64_t>, 8> dims;
  for (size_t i = 0; i < shape.size(); ++i)
    if (shape[i] != 1) dims.emplace_back(stride[i], shape[i]);
  std::sort(dims.begin(), dims.end());
  int64_t expected = 1;
  for (const auto& [st, sz] : dims) {
    if (st != expected) return "";
    expected *= sz;
  }
  std::string tag = "s";
  char buf[24];
  for (size_t i = 0; i < stride.size(); ++i) {
    if (i) tag += ',';
    tag.append(buf, std::to_chars(buf, buf + sizeof buf, stride[i]).ptr);
  }
  tag += ':';
  return tag;
}

// digest.span_tag: the tag when the tensor's own memory span is hashed in memory order, else nullopt
// (made each time: a sort of a few dims, cheaper than looking a layout up in a cache keyed by it)
std::optional<std::string> span_tag(const at::Tensor& t) {
  if (!t.is_cpu() || t.is_conj() || t.is_neg()) return std::nullopt;
  if (t.is_contiguous()) return std::string();
  auto strides = t.strides();
  if (std::find(strides.begin(), strides.end(), 0) != strides.end()) return std::nullopt;
  std::string tag = permuted_tag(t.sizes(), strides);
  if (tag.empty()) return std::nullopt;
  return tag;
}

// h as 16 lowercase hex digits appended to `out` ("%016x", without printf's format parsing)
void append_hex(std::string& out, uint64_t h) {
  static constexpr char kDigits[] = "0123456789abcdef";
  char buf[16];
  for (int i = 15; i >= 0; --i, h >>= 4) buf[i] = kDigits[h & 15];
  out.append(buf, 16);
}

// digest.fast for a CPU tensor
std::string digest(const at::Tensor& t0) {
  std::string p = prefix(t0);
  size_t n = t0.nbytes();
  if (!n) return p + "empty";
  TORCH_CHECK(t0.is_cpu(), "bitdet native op tracer: tensor on ", t0.device(), " (CPU only)");
  if (auto tag = span_tag(t0)) {
    p += *tag;
    append_hex(p, S().xxh3(t0.const_data_ptr(), n));
    return p;
  }
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
  p += layout;
  append_hex(p, S().xxh3(t.const_data_ptr(), t.numel() * t.element_size()));
  return p;
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

// The key of State::counts, built in a buffer kept per thread (a lookup allocates nothing; an insert copies it)
const std::string& count_key(const std::string& phase_js, const std::string& scope_js, const std::string& name) {
  static thread_local std::string key;
  key.assign(phase_js);
  key += '\x1f';
  key += scope_js;
  key += '\x1f';
  key += name;
  return key;
}

// format.record_line without extra fields but flags; names need no escaping (op names, "forward"...)
void write_record(State& s, const std::string& phase_js, const std::string& scope_js, const std::string& name,
                  const char* kind, const std::vector<std::string>& ins, const std::vector<std::string>& outs,
                  const std::vector<const char*>& flags = {}) {
  int64_t n = s.counts[count_key(phase_js, scope_js, name)]++;
  std::string line;
  line.reserve(96 + phase_js.size() + scope_js.size() + name.size() + 48 * (ins.size() + outs.size()));
  char buf[24];
  line += "{\"step\":";
  line.append(buf, std::to_chars(buf, buf + sizeof buf, s.step).ptr);
  line += ",\"phase\":";
  line += phase_js;
  line += ",\"scope\":";
  line += scope_js;
  line += ",\"name\":\"";
  line += name;
  line += "\",\"n\":";
  line.append(buf, std::to_chars(buf, buf + sizeof buf, n).ptr);
  line += ",\"k\":\"";
  line += kind;
  line += "\",\"in\":";
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
    auto it = s.counts.find(count_key(*w.phase_js, *w.scope_js, info.name));
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
  write_record(s, *w.phase_js, *w.scope_js, info.name, "op", ins, outs, flags);
}

void set_included(bool on) { c10::impl::tls_set_dispatch_key_included(c10::DispatchKey::Fake, on); }

// ---- module hooks (hooks.py, level module and op): scopes, and at level module the records ----

void set_bwd_scope(State& s, const std::string& raw, const std::string& js) { s.bwd_scope = raw, s.bwd_scope_js = js; }

void set_scope_top(State& s) {
  if (s.scopes.empty()) {
    s.scope.clear(), s.scope_js = "\"\"";
  } else {
    s.scope = s.hooks.names[s.scopes.back()], s.scope_js = s.hooks.names_js[s.scopes.back()];
  }
}

at::Tensor unpack(py::handle t) { return THPVariable_Unpack(t.ptr()); }
const at::Tensor& unpack(const at::Tensor& t) { return t; }

void push_strided(py::handle x, std::vector<py::object>& out) {
  const at::Tensor& t = THPVariable_Unpack(x.ptr());
  if (t.layout() == c10::kStrided && !t.is_meta()) out.push_back(py::reinterpret_borrow<py::object>(x));
}

bool pytree_node(const Hooks& h, py::handle x) {
  return PyList_Check(x.ptr()) || PyTuple_Check(x.ptr()) || PyDict_Check(x.ptr()) ||
         PyDict_Contains(h.nodes.ptr(), reinterpret_cast<PyObject*>(Py_TYPE(x.ptr()))) == 1;
}

void pytree(const Hooks& h, py::handle x, std::vector<py::object>& out) {
  for (py::handle t : h.trace_tensors(x)) out.push_back(py::reinterpret_borrow<py::object>(t));
}

// digest.flat_tensors for one argument
void flat_arg(const Hooks& h, py::handle a, std::vector<py::object>& out) {
  if (THPVariable_Check(a.ptr())) {
    push_strided(a, out);
  } else if (PyList_CheckExact(a.ptr()) || PyTuple_CheckExact(a.ptr())) {
    for (py::handle x : a) {
      if (THPVariable_Check(x.ptr()))
        push_strided(x, out);
      else if (pytree_node(h, x))
        pytree(h, x, out);
    }
  } else if (pytree_node(h, a)) {
    pytree(h, a, out);
  }
}

// digest.flat_tensors(args, kwargs): the kwargs dict's values read in place (no values() view made)
void flat_call(const Hooks& h, py::handle args, py::handle kwargs, std::vector<py::object>& out) {
  for (py::handle a : args) flat_arg(h, a, out);
  if (kwargs.is_none()) return;
  if (!PyDict_Check(kwargs.ptr())) {
    for (py::handle a : kwargs.attr("values")()) flat_arg(h, a, out);
    return;
  }
  PyObject *key, *value;
  Py_ssize_t pos = 0;
  while (PyDict_Next(kwargs.ptr(), &pos, &key, &value)) flat_arg(h, value, out);
}

// digest.fast of each tensor (Python tensors or at::Tensor)
template <typename T>
std::vector<std::string> digests(const std::vector<T>& tensors) {
  c10::impl::ExcludeDispatchKeyGuard guard(c10::DispatchKey::Fake);  // a gapped view's copy is not traced
  std::vector<std::string> out;
  out.reserve(tensors.size());
  for (const auto& t : tensors) out.push_back(digest(unpack(t)));
  return out;
}

// A tensor hook's entries for gradient `grad` (undefined: None).
void grad_hook(const std::vector<GradEntry>& entries, const at::Tensor& grad) {
  State& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  Hooks& h = s.hooks;
  if (!s.active || !h.on) return;
  std::optional<std::string> fp;
  if (h.record && grad.defined()) {
    c10::impl::ExcludeDispatchKeyGuard guard(c10::DispatchKey::Fake);
    fp = digest(grad);
  }
  for (const auto& e : entries) {
    if (e.out) {
      if (e.moves) set_bwd_scope(s, h.names[e.module], h.names_js[e.module]);
      if (!fp) continue;
      auto it = h.grad_out_at.find(e.module);
      if (it == h.grad_out_at.end()) {
        it = h.grad_out_at.emplace(e.module, h.grad_out.size()).first;
        h.grad_out.emplace_back(e.module, std::vector<std::string>());
      }
      h.grad_out[it->second].second.push_back(*fp);
    } else {
      if (e.moves) set_bwd_scope(s, e.parent, e.parent_js);
      if (!fp) continue;
      std::vector<std::string> outs;
      auto it = h.grad_out_at.find(e.module);
      if (it != h.grad_out_at.end()) {  // dict.pop: a later setdefault appends a new slot
        outs.swap(h.grad_out[it->second].second);
        h.grad_out_at.erase(it);
      }
      write_record(s, kBackwardJs, h.names_js[e.module], kBackward, "module", outs, {*fp});
    }
  }
}

// The tensor hook `register_hook` would add, without Python: put on the tensor's grad_fn where
// Tensor.register_hook puts the one that runs its Python hooks (grad_fn._register_hook_dict), it
// receives the gradient of output `output_nr` there, and runs where that one would run.
struct NodeHook : torch::autograd::FunctionPreHook {
  NodeHook(std::shared_ptr<std::vector<GradEntry>> entries, size_t output_nr)
      : entries(std::move(entries)), output_nr(output_nr) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    grad_hook(*entries, grads.at(output_nr));
    return grads;
  }
  std::shared_ptr<std::vector<GradEntry>> entries;
  size_t output_nr;
};

// Whether the hook `g` holds is still the last of the tensor's hooks, so that an entry added to it
// runs where a hook of its own would (a Python hook: the last of its Python hooks; a NodeHook: the
// last tensor hook on its grad_fn, which a Python hook added since would follow).
bool last_hook(const GradState& g, const at::Tensor& t, py::handle obj) {
  if (g.node_hook) {
    const auto& fn = t.grad_fn();
    return fn && !fn->tensor_pre_hooks().empty() && fn->tensor_pre_hooks().back().get() == g.node_hook;
  }
  py::object hooks = obj.attr("_backward_hooks");
  return !hooks.is_none() && py::len(hooks) && hooks.attr("__reversed__")().attr("__next__")().equal(g.handle_id);
}

// hooks._attach: an entry per tensor, merged into the tensor hook this step put on it last while ours
// is still its last hook and it is unmodified in place; otherwise a new tensor hook: a NodeHook
// where the tensor has a grad_fn and no Python hooks (their order against ours is then the one
// Python hooks would have), else Tensor.register_hook. Runs without the lock (that is Python).
void attach(const std::vector<py::object>& tensors, bool out, size_t module, const std::string& parent,
            const std::string& parent_js) {
  State& s = S();
  Hooks& h = s.hooks;
  for (const auto& obj : tensors) {
    at::Tensor t = unpack(obj);
    if (!t.requires_grad()) continue;
    GradState* g;
    bool moves;
    {
      std::lock_guard<std::mutex> lock(s.mu);
      auto [it, fresh] = h.grads.try_emplace(t.unsafeGetTensorImpl());
      g = &it->second;
      if (fresh) g->tensor.emplace(t.getIntrusivePtr());
      bool& claimed = out ? g->out_claimed : g->in_claimed;
      moves = !claimed;
      claimed = true;
    }
    if (!(moves || h.record)) continue;
    GradEntry entry{out, module, parent, parent_js, moves};
    bool plain = Py_TYPE(obj.ptr()) == reinterpret_cast<PyTypeObject*>(h.tensor_type.ptr());
    if (g->entries && t._version() == g->version && plain && last_hook(*g, t, obj)) {
      std::lock_guard<std::mutex> lock(s.mu);
      g->entries->push_back(std::move(entry));
      continue;
    }
    auto entries = std::make_shared<std::vector<GradEntry>>();
    entries->push_back(std::move(entry));
    const auto& fn = t.grad_fn();
    const torch::autograd::FunctionPreHook* node_hook = nullptr;
    py::object handle_id;
    if (plain && fn && reinterpret_cast<THPVariable*>(obj.ptr())->backward_hooks == nullptr) {
      auto hook = std::make_unique<NodeHook>(entries, t.output_nr());
      node_hook = hook.get();
      fn->add_tensor_pre_hook(std::move(hook));
    } else {
      py::object handle = obj.attr("register_hook")(py::cpp_function([entries](py::object grad) {
        grad_hook(*entries, grad.is_none() ? at::Tensor() : unpack(grad));
      }));
      h.handles.append(handle);
      handle_id = handle.attr("id");
    }
    std::lock_guard<std::mutex> lock(s.mu);
    if (node_hook) h.node_hooks.emplace_back(c10::weak_intrusive_ptr<torch::autograd::Node>(fn), node_hook);
    g->entries = std::move(entries);
    g->node_hook = node_hook;
    g->handle_id = std::move(handle_id);
    g->version = t._version();
  }
}

void on_pre(size_t module, py::handle args, py::handle kwargs) {
  State& s = S();
  Hooks& h = s.hooks;
  if (!h.on) return;
  std::vector<py::object> tensors;
  flat_call(h, args, kwargs, tensors);
  bool any_grad = false;
  if (c10::GradMode::is_enabled())
    for (const auto& t : tensors) any_grad = any_grad || unpack(t).requires_grad();
  std::string parent, parent_js;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    if (any_grad) {
      Where w = where(s);
      parent = *w.scope, parent_js = *w.scope_js;
    }
    s.scopes.push_back(module);
    set_scope_top(s);
    if (h.record) h.inputs[module].push_back(digests(tensors));
  }
  if (any_grad) attach(tensors, false, module, parent, parent_js);
}

void on_post(size_t module, py::handle output) {
  State& s = S();
  Hooks& h = s.hooks;
  if (!h.on) return;
  std::vector<py::object> tensors;
  flat_arg(h, output, tensors);
  {
    std::lock_guard<std::mutex> lock(s.mu);
    if (!s.scopes.empty()) s.scopes.pop_back();
    set_scope_top(s);
    if (h.record) {
      auto& stack = h.inputs[module];
      std::vector<std::string> ins;
      if (!stack.empty()) ins.swap(stack.back()), stack.pop_back();
      Where w = where(s);
      write_record(s, *w.phase_js, h.names_js[module], "forward", "module", ins, digests(tensors));
    }
  }
  if (!tensors.empty() && c10::GradMode::is_enabled()) attach(tensors, true, module, "", "\"\"");
}

// A module's forward with its hooks around it, as hooks._wrap_forward's closure runs them (pre, the
// forward, post also when the forward raises), without a Python frame and two pybind calls per
// module call: the per-call cost of the module level, paid by every module in every micro-batch.
struct Forward {
  PyObject_HEAD
  size_t module;
  PyObject* orig;  // the forward it shadows (a bound method: holds the module, a cycle the GC breaks)
};

// Runs `f` (a hook), turning what it throws into the pending Python exception; false if it threw.
template <typename F>
bool run_hook(F&& f) {
  try {
    f();
    return true;
  } catch (py::error_already_set& e) {
    e.restore();
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
  return false;
}

PyObject* forward_call(PyObject* self, PyObject* args, PyObject* kwargs) {
  auto* f = reinterpret_cast<Forward*>(self);
  py::handle kw = kwargs ? py::handle(kwargs) : py::none();
  if (!run_hook([&] { on_pre(f->module, args, kw); })) return nullptr;
  PyObject* out = PyObject_Call(f->orig, args, kwargs);
  PyObject *type = nullptr, *value = nullptr, *tb = nullptr;
  if (!out) PyErr_Fetch(&type, &value, &tb);  // post runs with None, then the forward's error goes on
  bool ok = run_hook([&] { on_post(f->module, out ? py::handle(out) : py::none()); });
  if (!ok) {  // post's own error replaces the forward's (as an exception raised in a finally block)
    Py_XDECREF(out), Py_XDECREF(type), Py_XDECREF(value), Py_XDECREF(tb);
    return nullptr;
  }
  if (!out) PyErr_Restore(type, value, tb);
  return out;
}

int forward_traverse(PyObject* self, visitproc visit, void* arg) {
  Py_VISIT(reinterpret_cast<Forward*>(self)->orig);
  return 0;
}

int forward_clear(PyObject* self) {
  Py_CLEAR(reinterpret_cast<Forward*>(self)->orig);
  return 0;
}

void forward_dealloc(PyObject* self) {
  PyTypeObject* type = Py_TYPE(self);
  PyObject_GC_UnTrack(self);
  forward_clear(self);
  type->tp_free(self);
  Py_DECREF(type);  // a heap type's instances hold a reference to it
}

PyTypeObject* forward_type() {
  static PyTypeObject* type = [] {
    static PyType_Slot slots[] = {{Py_tp_call, reinterpret_cast<void*>(&forward_call)},
                                  {Py_tp_traverse, reinterpret_cast<void*>(&forward_traverse)},
                                  {Py_tp_clear, reinterpret_cast<void*>(&forward_clear)},
                                  {Py_tp_dealloc, reinterpret_cast<void*>(&forward_dealloc)},
                                  {0, nullptr}};
    static PyType_Spec spec = {"bitdet_op_trace.Forward", sizeof(Forward), 0, Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
                               slots};
    auto* t = reinterpret_cast<PyTypeObject*>(PyType_FromSpec(&spec));
    if (!t) throw py::error_already_set();
    return t;
  }();
  return type;
}

}  // namespace

// The module hooks of one traced step: names / names_js per module index (Tracer.modules; None: those
// of the last step, kept), digest's trace_tensors and pytree nodes for arguments flat_tensors does not
// walk itself, torch.Tensor.
void hooks_begin(std::optional<std::vector<std::string>> names, std::optional<std::vector<std::string>> names_js,
                 bool record, py::object trace_tensors, py::object nodes, py::object tensor_type) {
  State& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  Hooks& h = s.hooks;
  h.on = true, h.record = record;
  if (names) h.names = std::move(*names);
  if (names_js) h.names_js = std::move(*names_js);
  h.inputs.assign(h.names.size(), {});
  h.trace_tensors = std::move(trace_tensors), h.nodes = std::move(nodes), h.tensor_type = std::move(tensor_type);
}

// The step's end: tensor hooks removed (a tensor living across steps would call them again), then a
// "backward" record for each module whose gradient arrived but never left (its inputs need no grad).
void hooks_end() {
  State& s = S();
  Hooks& h = s.hooks;
  py::list handles;
  std::swap(handles, h.handles);
  for (py::handle handle : handles) handle.attr("remove")();
  std::lock_guard<std::mutex> lock(s.mu);
  for (auto& [node, hook] : h.node_hooks) {
    if (auto fn = node.lock()) {
      auto& hooks = fn->tensor_pre_hooks();
      hooks.erase(std::remove_if(hooks.begin(), hooks.end(), [hook = hook](const auto& x) { return x.get() == hook; }),
                  hooks.end());
    }
  }
  h.node_hooks.clear();
  if (h.on && h.record)
    for (const auto& [module, fps] : h.grad_out)
      if (!fps.empty()) write_record(s, kBackwardJs, h.names_js[module], kBackward, "module", fps, {});
  h.on = false;
  h.grads.clear();
  h.grad_out.clear();
  h.grad_out_at.clear();
  h.inputs.clear();
  h.trace_tensors = h.nodes = h.tensor_type = py::object();
}

// The hooks for module `i`, as register_forward_pre_hook(with_kwargs=True) / register_forward_hook take them.
py::cpp_function pre_hook(size_t i) {
  return py::cpp_function([i](py::handle, py::handle args, py::handle kwargs) { on_pre(i, args, kwargs); });
}

py::cpp_function post_hook(size_t i) {
  return py::cpp_function([i](py::handle, py::handle, py::handle output) { on_post(i, output); });
}

// Module `i`'s forward wrapper around `orig` (hooks._NativeModuleHooks installs it as the
// module's instance `forward`).
py::object forward_wrapper(size_t i, py::object orig) {
  PyTypeObject* type = forward_type();
  auto* f = PyObject_GC_New(Forward, type);
  if (!f) throw py::error_already_set();
  f->module = i;
  f->orig = orig.release().ptr();
  PyObject_GC_Track(f);
  return py::reinterpret_steal<py::object>(reinterpret_cast<PyObject*>(f));
}

TORCH_LIBRARY_IMPL(_, Fake, m) { m.fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>()); }

void init(const std::string& xxhash_so, const std::vector<std::pair<py::object, std::string>>& dtypes) {
  void* lib = dlopen(xxhash_so.c_str(), RTLD_NOW | RTLD_LOCAL);
  TORCH_CHECK(lib, "bitdet native op tracer: cannot open ", xxhash_so, ": ", dlerror());
  // the module's runtime-dispatched entry (AVX2 / AVX-512 where the CPU has them: what its Python
  // functions call, 2-3x faster on cache-resident tensors) before the portable one; the same hash
  auto fn = reinterpret_cast<Xxh3>(dlsym(lib, "XXH3_64bits_dispatch"));
  if (!fn) fn = reinterpret_cast<Xxh3>(dlsym(lib, "XXH3_64bits"));
  TORCH_CHECK(fn, "bitdet native op tracer: no XXH3_64bits in ", xxhash_so);
  State& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  s.xxh3 = fn;
  for (const auto& [dtype, name] : dtypes) {
    TORCH_CHECK(THPDtype_Check(dtype.ptr()), "bitdet native op tracer: not a torch.dtype");
    s.dtypes[static_cast<size_t>(reinterpret_cast<THPDtype*>(dtype.ptr())->scalar_type)] = name;
  }
}

// A traced step begins on this thread: counts and scopes reset; with `ops` (level op) the fallback
// key included.
void start(int64_t step, bool ops) {
  State& s = S();
  {
    std::lock_guard<std::mutex> lock(s.mu);
    s.active = true, s.ops = ops;
    s.step = step;
    s.counts.clear();
    s.scopes.clear();
    s.scope.clear(), s.scope_js = "\"\"", s.bwd_scope.clear(), s.bwd_scope_js = "\"\"";
  }
  set_included(ops);
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
    active = s.active && s.ops;
  }
  set_included(active && !quiet);
}

void set_phase(const std::string& raw, const std::string& js) {
  std::lock_guard<std::mutex> lock(S().mu);
  S().phase = raw, S().phase_js = js;
}

// Tracer.current() while this tracer runs the step: (phase, scope).
std::pair<std::string, std::string> current() {
  std::lock_guard<std::mutex> lock(S().mu);
  Where w = where(S());
  return {*w.phase, *w.scope};
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

// Tracer.fps at every level where the native tracer applies: one call for the list
std::vector<std::string> tensor_digests(const std::vector<at::Tensor>& ts) {
  std::lock_guard<std::mutex> lock(S().mu);
  return digests(ts);
}

// Whether this thread's ops reach the fallback now (nothing is installed outside a traced step).
bool installed() { return c10::impl::tls_is_dispatch_key_included(c10::DispatchKey::Fake); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("init", &init);
  m.def("start", &start);
  m.def("stop", &stop);
  m.def("set_quiet", &set_quiet);
  m.def("set_phase", &set_phase);
  m.def("current", &current);
  m.def("hooks_begin", &hooks_begin);
  m.def("hooks_end", &hooks_end);
  m.def("pre_hook", &pre_hook);
  m.def("post_hook", &post_hook);
  m.def("forward_wrapper", &forward_wrapper);
  m.def("arm", &arm);
  m.def("ptrs_add", &ptrs_add);
  m.def("ptrs_discard", &ptrs_discard);
  m.def("take", &take);
  m.def("digest", &tensor_digest);
  m.def("digests", &tensor_digests);
  m.def("installed", &installed);
}
