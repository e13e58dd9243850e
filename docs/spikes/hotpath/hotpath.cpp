// Spike: a C++ boxed fallback that owns op results for dispose scopes.
//
// The fallback is registered (at run time, not at load time: see install()) on a dispatch key
// above Autograd that nothing in torch uses (DeferredInit or TESTING_ONLY_GenericMode). While a
// scope is open on a thread, that key is in the thread's *included* key set, so every op called
// from outside the dispatcher reaches the fallback first. The fallback excludes its own key for
// the redispatch (ExcludeDispatchKeyGuard), so it sees only top-level ops: what user code (or
// Python library code) calls, before Autograd, Autocast and CompositeImplicitAutograd
// decompositions run. Every returned tensor that is not one of the op's input TensorImpls is
// "fresh" and is recorded for the innermost scope frame of the thread.
//
// Modes (global, for the benchmark):
//   0 PASS       redispatch only (the floor of this design)
//   1 RECORD     (a) remember a weak_intrusive_ptr<TensorImpl> per fresh result; no GIL
//   2 WRAP       (b) + take the GIL, THPVariable_Wrap the result and switch its type to the
//                    configured class (TensorRef)
//   3 WRAP_SITE  (b) + the creation site (first user frame: code object + lasti, verdicts
//                    cached in a Python dict, misses classified by a Python callable)
//   4 CALLBACK   (b') take the GIL and call a Python callable(tensor) per fresh result (what
//                    keeping today's Python RefState bookkeeping per tensor would cost)
//
// Not handled here (see docs/design.md §9): ops run by the autograd engine are passed through (the
// current graph task id is checked); results that carry the Python key (FakeTensor and other
// __torch_dispatch__ subclasses) are never recorded.

#include <Python.h>
#include <frameobject.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/SmallVector.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <atomic>
#include <optional>
#include <memory>
#include <string>
#include <vector>

namespace torch::autograd {
TORCH_API int get_current_graph_task_id();
}
#include <torch/csrc/autograd/function.h>  // get_current_node()

namespace {

using c10::DispatchKey;
using c10::TensorImpl;
using WeakImpl = c10::weak_intrusive_ptr<TensorImpl, c10::UndefinedTensorImpl>;

enum Mode : int { PASS = 0, RECORD = 1, WRAP = 2, WRAP_SITE = 3, CALLBACK = 4 };

std::atomic<int> g_mode{RECORD};
DispatchKey g_key = DispatchKey::Undefined;  // the key install() registered on
PyObject* g_ref_class = nullptr;             // TensorRef (a heap type)
PyObject* g_verdicts = nullptr;              // dict: code object -> int (0 user, 1 lib, 2 state maker)
PyObject* g_classify = nullptr;              // callable(code) -> int, for misses
PyObject* g_callback = nullptr;              // mode CALLBACK: callable(tensor)
std::vector<std::unique_ptr<torch::Library>> g_libraries;
// Ops compared by handle (set by install()).
std::optional<c10::OperatorHandle> g_detach, g_alias, g_lift_fresh;

struct Entry {
  WeakImpl impl;
  PyObject* code;  // strong reference (mode WRAP_SITE) or nullptr
  int lasti;
};

struct Frame {
  std::vector<Entry> entries;
  size_t sweep_at = 4096;  // compact dead entries when the list reaches this size
  int64_t recorded = 0;
  int64_t freed = 0;       // entries found dead by a sweep
};

struct ThreadData {
  std::vector<Frame> frames;  // scope frames of this thread, innermost last
  int64_t ops = 0;            // ops that reached the fallback with a frame open
  int64_t fresh = 0;          // fresh results recorded
  int64_t backward_ops = 0;   // ops passed through because a graph task runs
  int64_t skipped_python = 0; // results with the Python key (fake tensors, subclasses)
  int64_t not_owned = 0;      // state maker on the stack (mode WRAP_SITE)
  int64_t gil_held = 0;       // ops that arrived with this thread holding the GIL
  int64_t subclass_alias = 0; // detach/alias results skipped (torch C code making a subclass)
  int64_t grads = 0;          // ops run by AccumulateGrad (a .grad in the making)
};

thread_local ThreadData t_data;

inline bool is_input(const TensorImpl* impl, const c10::SmallVector<const TensorImpl*, 8>& inputs) {
  for (const TensorImpl* in : inputs) {
    if (in == impl) return true;
  }
  return false;
}

void sweep(Frame& frame) {
  // Drop entries whose tensor died (amortised: the threshold doubles with the live count).
  // Codes are decref'd only with the GIL; callers hold it (mode >= WRAP) or codes are null.
  auto& e = frame.entries;
  size_t kept = 0;
  for (size_t i = 0; i < e.size(); ++i) {
    if (e[i].impl.expired()) {
      frame.freed += 1;
      Py_XDECREF(e[i].code);
      continue;
    }
    if (kept != i) e[kept] = std::move(e[i]);
    ++kept;
  }
  e.erase(e.begin() + kept, e.end());
  frame.sweep_at = std::max<size_t>(4096, 2 * kept);
}

// The creation site: the first frame outward whose code is "user" code. Returns 2 when a
// state maker is on the stack (not owned), 0 with *code set (new reference) otherwise.
int capture_site(PyObject** code_out, int* lasti_out) {
  *code_out = nullptr;
  *lasti_out = -1;
  PyFrameObject* frame = PyEval_GetFrame();  // borrowed
  Py_XINCREF(frame);
  while (frame != nullptr) {
    PyCodeObject* code = PyFrame_GetCode(frame);  // new reference
    PyObject* verdict_obj = PyDict_GetItem(g_verdicts, (PyObject*)code);  // borrowed
    long verdict;
    if (verdict_obj != nullptr) {
      verdict = PyLong_AsLong(verdict_obj);
    } else {
      PyObject* v = PyObject_CallOneArg(g_classify, (PyObject*)code);
      verdict = v ? PyLong_AsLong(v) : 1;
      Py_XDECREF(v);
      PyErr_Clear();
    }
    if (verdict == 0) {
      *code_out = (PyObject*)code;  // keep the reference
      *lasti_out = PyFrame_GetLasti(frame);
      Py_DECREF(frame);
      return 0;
    }
    Py_DECREF(code);
    if (verdict == 2) {
      Py_DECREF(frame);
      return 2;
    }
    PyFrameObject* back = PyFrame_GetBack(frame);  // new reference
    Py_DECREF(frame);
    frame = back;
  }
  return 0;
}

void record(const at::Tensor& out, const c10::SmallVector<const TensorImpl*, 8>& inputs,
            int mode, bool& gil_taken, PyGILState_STATE& gil, bool input_may_be_fresh) {
  if (!out.defined()) return;
  TensorImpl* impl = out.unsafeGetTensorImpl();
  if (!input_may_be_fresh && is_input(impl, inputs)) return;  // in-place, out=, no-op .to()
  ThreadData& td = t_data;
  if (impl->key_set().has(DispatchKey::Python)) {  // FakeTensor, wrapper subclasses
    td.skipped_python += 1;
    return;
  }
  Frame& frame = td.frames.back();
  if (!frame.entries.empty() && frame.entries.back().impl._unsafe_get_target() == impl) {
    return;  // already recorded by a nested pass (a Python mode re-entered with our key on)
  }
  PyObject* code = nullptr;
  int lasti = -1;
  if (mode >= WRAP) {
    if (!gil_taken) {
      gil = PyGILState_Ensure();
      gil_taken = true;
    }
    if (mode == CALLBACK) {
      PyObject* obj = THPVariable_Wrap(out);
      PyObject* r = obj ? PyObject_CallOneArg(g_callback, obj) : nullptr;
      if (r == nullptr) PyErr_Clear();
      Py_XDECREF(r);
      Py_XDECREF(obj);
      td.fresh += 1;
      frame.recorded += 1;
      return;
    }
    if (mode == WRAP_SITE) {
      if (capture_site(&code, &lasti) == 2) {
        td.not_owned += 1;
        return;
      }
    }
    PyObject* obj = THPVariable_Wrap(out);  // new reference; torch keeps the object alive
    if (obj != nullptr) {                   // while C++ holds the tensor (PyObject preservation)
      PyTypeObject* old = Py_TYPE(obj);
      if (old == (PyTypeObject*)THPVariableClass && g_ref_class != nullptr) {
        Py_INCREF(g_ref_class);
        Py_SET_TYPE(obj, (PyTypeObject*)g_ref_class);
        Py_DECREF(old);
      }
      Py_DECREF(obj);
    } else {
      PyErr_Clear();
    }
  }
  frame.entries.push_back(Entry{WeakImpl(out.getIntrusivePtr()), code, lasti});
  frame.recorded += 1;
  td.fresh += 1;
  if (frame.entries.size() >= frame.sweep_at) {
    sweep(frame);
  }
}

void fallback(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  const DispatchKey key = g_key;
  c10::impl::ExcludeDispatchKeyGuard guard(key);  // nested ops: not ours
  const auto after = ks & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, key);
  ThreadData& td = t_data;
  const int mode = g_mode.load(std::memory_order_relaxed);
  if (mode == PASS || td.frames.empty()) {
    op.redispatchBoxed(after, stack);
    return;
  }
  if (torch::autograd::get_current_graph_task_id() != -1) {  // the engine runs backward ops
    td.backward_ops += 1;
    // A .grad in the making runs inside AccumulateGrad (the only backward results a scope may
    // own: they would go to the leaf's owner). Detected here, handled in Python by a real
    // implementation; the spike only counts them.
    auto node = torch::autograd::get_current_node();
    if (node && node->name() == "torch::autograd::AccumulateGrad") td.grads += 1;
    op.redispatchBoxed(after, stack);
    return;
  }
  td.ops += 1;
  const bool gil_held = PyGILState_Check();
  td.gil_held += gil_held;
  const auto& schema = op.schema();
  const size_t num_args = schema.arguments().size();
  c10::SmallVector<const TensorImpl*, 8> inputs;
  {
    auto args = torch::jit::last(*stack, num_args);
    for (const c10::IValue& v : args) {
      if (v.isTensor()) {
        inputs.push_back(v.toTensor().unsafeGetTensorImpl());
      } else if (v.isTensorList()) {
        for (const at::Tensor& t : v.toTensorList().vec()) inputs.push_back(t.unsafeGetTensorImpl());
      } else if (v.isList()) {  // Tensor?[]
        for (const c10::IValue& item : v.toListRef()) {
          if (item.isTensor()) inputs.push_back(item.toTensor().unsafeGetTensorImpl());
        }
      }
    }
  }
  op.redispatchBoxed(after, stack);
  // torch's C code that makes a subclass from a detached alias while holding the GIL
  // (nn.Parameter's _make_subclass, FakeTensor, as_subclass): that alias becomes the subclass
  // object, it must not be given a Python object (or be owned) here.
  if (gil_held && (op == *g_detach || op == *g_alias)) {
    td.subclass_alias += 1;
    return;
  }
  // torch.tensor(data) hands its own new tensor to lift_fresh, which returns it.
  const bool input_may_be_fresh = op == *g_lift_fresh;
  const size_t num_returns = schema.returns().size();
  bool gil_taken = false;
  PyGILState_STATE gil{};
  auto outs = torch::jit::last(*stack, num_returns);
  for (const c10::IValue& v : outs) {
    if (v.isTensor()) {
      record(v.toTensor(), inputs, mode, gil_taken, gil, input_may_be_fresh);
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorList().vec()) record(t, inputs, mode, gil_taken, gil, input_may_be_fresh);
    }
  }
  if (gil_taken) PyGILState_Release(gil);
}

DispatchKey key_named(const std::string& name) {
  if (name == "DeferredInit") return DispatchKey::DeferredInit;
  if (name == "TESTING_ONLY_GenericMode") return DispatchKey::TESTING_ONLY_GenericMode;
  if (name == "TESTING_ONLY_GenericWrapper") return DispatchKey::TESTING_ONLY_GenericWrapper;
  throw std::invalid_argument("unknown key " + name);
}

bool has_fallback(const std::string& name) {
  return c10::Dispatcher::singleton().hasBackendFallbackForDispatchKey(key_named(name));
}

// Register the fallback on `name`. Refuses (returns false) when the key already has a fallback
// (another copy of this extension, torchdistx, a test), instead of failing at import time as a
// static TORCH_LIBRARY_IMPL would.
bool install(const std::string& name) {
  DispatchKey key = key_named(name);
  if (g_key == key) return true;
  if (g_key != DispatchKey::Undefined) throw std::runtime_error("installed on another key already");
  if (c10::Dispatcher::singleton().hasBackendFallbackForDispatchKey(key)) return false;
  auto& dispatcher = c10::Dispatcher::singleton();
  g_detach = dispatcher.findSchemaOrThrow("aten::detach", "");
  g_alias = dispatcher.findSchemaOrThrow("aten::alias", "");
  g_lift_fresh = dispatcher.findSchemaOrThrow("aten::lift_fresh", "");
  auto lib = std::make_unique<torch::Library>(torch::Library::IMPL, "_", key, __FILE__, __LINE__);
  lib->fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>());
  g_libraries.push_back(std::move(lib));
  g_key = key;
  return true;
}

void uninstall() {
  g_libraries.clear();
  g_key = DispatchKey::Undefined;
}

void configure(int mode, py::object ref_class, py::object verdicts, py::object classify,
               py::object callback) {
  g_mode.store(mode);
  auto keep = [](PyObject*& slot, const py::object& o) {
    Py_XDECREF(slot);
    slot = o.is_none() ? nullptr : o.inc_ref().ptr();
  };
  keep(g_ref_class, ref_class);
  keep(g_verdicts, verdicts);
  keep(g_classify, classify);
  keep(g_callback, callback);
}

void set_included(bool on) { c10::impl::tls_set_dispatch_key_included(g_key, on); }

bool is_included() { return c10::impl::tls_is_dispatch_key_included(g_key); }

void push() {
  if (g_key == DispatchKey::Undefined) throw std::runtime_error("not installed");
  t_data.frames.emplace_back();
  c10::impl::tls_set_dispatch_key_included(g_key, true);
}

// Close the innermost frame: returns (alive tensors, recorded, freed). Called with the GIL.
py::tuple pop() {
  ThreadData& td = t_data;
  if (td.frames.empty()) throw std::runtime_error("no frame");
  Frame frame = std::move(td.frames.back());
  td.frames.pop_back();
  if (td.frames.empty()) c10::impl::tls_set_dispatch_key_included(g_key, false);
  py::list alive;
  int64_t freed = frame.freed;
  for (Entry& e : frame.entries) {
    auto strong = e.impl.lock();
    Py_XDECREF(e.code);
    if (!strong) {
      freed += 1;
      continue;
    }
    at::Tensor t = at::Tensor(std::move(strong));
    alive.append(py::reinterpret_steal<py::object>(THPVariable_Wrap(t)));
  }
  return py::make_tuple(alive, frame.recorded, freed);
}

py::dict counters() {
  py::dict d;
  d["ops"] = t_data.ops;
  d["fresh"] = t_data.fresh;
  d["backward_ops"] = t_data.backward_ops;
  d["skipped_python"] = t_data.skipped_python;
  d["not_owned"] = t_data.not_owned;
  d["depth"] = t_data.frames.size();
  d["gil_held"] = t_data.gil_held;
  d["subclass_alias"] = t_data.subclass_alias;
  d["grads"] = t_data.grads;
  return d;
}

void reset_counters() {
  t_data.ops = t_data.fresh = t_data.backward_ops = t_data.skipped_python = t_data.not_owned = 0;
  t_data.gil_held = t_data.subclass_alias = t_data.grads = 0;
}

// Sites of the live entries of the innermost frame, for checks: [(tensor, code, lasti)].
py::list sites() {
  py::list out;
  if (t_data.frames.empty()) return out;
  for (Entry& e : t_data.frames.back().entries) {
    auto strong = e.impl.lock();
    if (!strong) continue;
    at::Tensor t = at::Tensor(std::move(strong));
    py::object code = e.code ? py::reinterpret_borrow<py::object>(e.code) : py::none();
    out.append(py::make_tuple(py::reinterpret_steal<py::object>(THPVariable_Wrap(t)), code, e.lasti));
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("has_fallback", &has_fallback);
  m.def("install", &install);
  m.def("uninstall", &uninstall);
  m.def("configure", &configure, py::arg("mode"), py::arg("ref_class") = py::none(),
        py::arg("verdicts") = py::none(), py::arg("classify") = py::none(),
        py::arg("callback") = py::none());
  m.def("set_included", &set_included);
  m.def("is_included", &is_included);
  m.def("push", &push);
  m.def("pop", &pop);
  m.def("counters", &counters);
  m.def("reset_counters", &reset_counters);
  m.def("sites", &sites);
}
