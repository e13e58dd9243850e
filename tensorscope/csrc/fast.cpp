// tensorscope._fast: the scope engine in C++ (see tensorscope/_engine.py and docs/design.md §9).
//
// While a scope is open on a thread, the DeferredInit dispatch key is in that thread's included
// key set, and this boxed fallback runs around every *top-level* op: DeferredInit sits above
// Autograd and Autocast, so it sees the op the user called (``linear``), not its decomposition,
// and the ops that op runs inside are dispatched with the key excluded. An op whose results are
// all inputs (in-place ops, no-op conversions) or wrapped/subclass tensors costs no Python.
// For the fresh plain results of the others, it finds the creation site (the innermost user
// frame, as _sites.capture_site does) and, in the common case, makes each result a TensorRef
// owned by the current scope exactly as _adopt.adopt_at() does (adopt_in_c). The cases with
// more rules go to the Python hook (_adopt.adopt_result): gradients made inside autograd's
// engine, memory left to release after a cross-thread close, a closed current scope.
//
// DeferredInit is a key PyTorch reserves for out-of-tree deferred initialisation (torchdistx);
// tensorscope registers a fallback only there and only includes the key while scopes are open.

#include <Python.h>
#include <frameobject.h>
#include <structmember.h>  // PyMember_GetOne / PyMember_SetOne
#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030C0000
#define Py_BUILD_CORE 1
#include <internal/pycore_frame.h>  // _PyInterpreterFrame: see user_site()
#undef Py_BUILD_CORE
#endif

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/SmallVector.h>

#include <unordered_map>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/jit/frontend/tracer.h>
#include <torch/library.h>

#include "layout.h"

namespace {

using namespace tensorscope;  // the layout and the op table (layout.h)

constexpr auto kKey = c10::DispatchKey::DeferredInit;

// Tensors that are not plain: subclasses (FakeTensor, user subclasses), functorch wrappers,
// functionalization. Scopes own plain tensors only.
const c10::DispatchKeySet kWrapperKeys({
    c10::DispatchKey::Python,
    c10::DispatchKey::PythonTLSSnapshot,
    c10::DispatchKey::Functionalize,
    c10::DispatchKey::FuncTorchBatched,
    c10::DispatchKey::FuncTorchGradWrapper,
    c10::DispatchKey::BatchedNestedTensor,
    c10::DispatchKey::Batched,
});

PyObject* g_hook = nullptr;      // the Python callable each fresh result is given to
PyObject* g_verdicts = nullptr;  // _sites._verdicts: code object -> USER / LIBRARY / STATE_MAKER
PyObject* g_classify = nullptr;  // _sites._classify(code): the verdict of a code object not seen yet

constexpr long kUser = 0;
constexpr long kStateMaker = 2;  // (kPackage = 3: see user_site)

void collect_inputs(const torch::jit::Stack& stack, size_t begin,
                    c10::SmallVector<const c10::TensorImpl*, 8>& inputs) {
  for (size_t i = begin; i < stack.size(); ++i) {
    const auto& value = stack[i];
    if (value.isTensor()) {
      inputs.push_back(value.toTensor().unsafeGetTensorImpl());
    } else if (value.isTensorList()) {
      for (const at::Tensor& t : value.toTensorList()) {
        inputs.push_back(t.unsafeGetTensorImpl());
      }
    }
  }
}

bool is_fresh(const at::Tensor& t, const c10::SmallVector<const c10::TensorImpl*, 8>& inputs,
              bool input_may_be_fresh) {
  if (!t.defined()) return false;
  const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  if (impl->key_set().has_any(kWrapperKeys)) return false;
  if (!input_may_be_fresh) {
    for (const c10::TensorImpl* input : inputs) {
      if (input == impl) return false;  // in place, out=, or a no-op conversion
    }
  }
  return true;
}

[[noreturn]] void throw_python_error() {
  python_error error;
  error.persist();
  throw error;
}

PyObject* checked(PyObject* object) {
  if (object == nullptr) throw_python_error();
  return object;
}

// An owned reference, released at the end of its block (exceptions included).
class Ref {
 public:
  explicit Ref(PyObject* object = nullptr) : object_(object) {}
  ~Ref() { Py_XDECREF(object_); }
  Ref(const Ref&) = delete;
  Ref& operator=(const Ref&) = delete;
  PyObject* get() const { return object_; }

 private:
  PyObject* object_;
};

// What the common case of adopt_result needs, given by set_hook (strong references).
struct Adoption {
  PyObject* ref_class = nullptr;      // TensorRef
  PyObject* state_class = nullptr;    // RefState (a weakref.ref subclass)
  PyObject* on_death = nullptr;       // its callback, on_ref_death
  PyObject* states = nullptr;         // STATES: id(tensor) -> RefState
  PyObject* current_scope = nullptr;  // the CURRENT_SCOPE ContextVar
} g_adoption;

// The slots of RefState and Counters, written through their member descriptors (what
// ``state.key = ...`` ends in, without looking the name up in the class each time).
struct Slots {
  PyMemberDef* key = nullptr;
  PyMemberDef* owner = nullptr;
  PyMemberDef* site = nullptr;
  PyMemberDef* counters = nullptr;
  PyMemberDef* disposal = nullptr;
  PyMemberDef* created = nullptr;  // Counters.created_in_scope
} g_slots;

PyMemberDef* slot_of(PyObject* cls, const char* name) {
  if (!PyType_Check(cls)) {
    PyErr_Format(PyExc_TypeError, "expected a class with a slot %s", name);
    return nullptr;
  }
  PyObject* descriptor = _PyType_Lookup(reinterpret_cast<PyTypeObject*>(cls),
                                        Ref(PyUnicode_FromString(name)).get());  // borrowed
  if (descriptor == nullptr || Py_TYPE(descriptor) != &PyMemberDescr_Type) {
    PyErr_Format(PyExc_TypeError, "%R has no slot %s", cls, name);
    return nullptr;
  }
  return reinterpret_cast<PyMemberDescrObject*>(descriptor)->d_member;
}

void set_slot(PyObject* object, PyMemberDef* slot, PyObject* value) {
  if (PyMember_SetOne(reinterpret_cast<char*>(object), slot, value) < 0) throw_python_error();
}

// Site tuples (code, lasti) or (code, lasti, user_code, user_lasti), made once per place in
// the code: code objects with a verdict stay alive (see g_verdict_cache), so the key's
// addresses are theirs.
struct SiteKey {
  const PyObject* code;
  int lasti;
  const PyObject* user_code;
  int user_lasti;
  bool operator==(const SiteKey& other) const {
    return code == other.code && lasti == other.lasti && user_code == other.user_code &&
           user_lasti == other.user_lasti;
  }
};
struct SiteKeyHash {
  size_t operator()(const SiteKey& key) const {
    return std::hash<const void*>()(key.code) ^ (static_cast<size_t>(key.lasti) << 20) ^
           (std::hash<const void*>()(key.user_code) << 1) ^
           (static_cast<size_t>(key.user_lasti) << 40);
  }
};
std::unordered_map<SiteKey, PyObject*, SiteKeyHash> g_site_tuples;  // strong references

PyObject* site_tuple(PyObject* code, int lasti, PyObject* user_code, int user_lasti) {  // borrowed
  if (code == nullptr) return Py_None;
  const SiteKey key{code, lasti, user_code, user_lasti};
  const auto found = g_site_tuples.find(key);
  if (found != g_site_tuples.end()) return found->second;
  Ref offset(checked(PyLong_FromLong(lasti)));
  PyObject* site;
  if (user_code == nullptr) {
    site = checked(PyTuple_Pack(2, code, offset.get()));
  } else {
    Ref user_offset(checked(PyLong_FromLong(user_lasti)));
    site = checked(PyTuple_Pack(4, code, offset.get(), user_code, user_offset.get()));
  }
  g_site_tuples.emplace(key, site);
  return site;
}

// This thread's ThreadState (borrowed: it lives as long as the thread; bind_thread).
thread_local PyObject* tl_thread_state = nullptr;

// Attribute names read per op (interned once), and the integer 1.
struct Names {
  PyObject* pending;   // ThreadState.pending
  PyObject* counters;  // ThreadState.counters
  PyObject* closed;    // DisposeScope._closed
  PyObject* owned;     // DisposeScope._owned
  PyObject* klass;     // __class__
  PyObject* one;
} g_names;

bool make_names() {
  g_names = {PyUnicode_InternFromString(kAttributes[kAttrPending]),
             PyUnicode_InternFromString(kAttributes[kAttrCounters]),
             PyUnicode_InternFromString(kAttributes[kAttrClosed]),
             PyUnicode_InternFromString(kAttributes[kAttrOwned]),
             PyUnicode_InternFromString("__class__"), PyLong_FromLong(1)};
  return !PyErr_Occurred();
}

bool attribute_is_true(PyObject* object, PyObject* name) {
  Ref value(checked(PyObject_GetAttr(object, name)));
  const int truth = PyObject_IsTrue(value.get());
  if (truth < 0) throw_python_error();
  return truth != 0;
}

void set_attribute(PyObject* object, PyObject* name, PyObject* value) {
  if (PyObject_SetAttr(object, name, value) < 0) throw_python_error();
}

// Verdicts by code object address. Hashing a code object hashes its constants, names and
// bytecode (CPython does not cache it): per frame walked, that was most of a walk's cost. Every
// code object with a verdict stays alive in _sites._verdicts, so an address is never reused.
std::unordered_map<const PyObject*, long> g_verdict_cache;

long verdict_of(PyObject* code) {
  const auto cached = g_verdict_cache.find(code);
  if (cached != g_verdict_cache.end()) return cached->second;
  long verdict;
  PyObject* known = PyDict_GetItemWithError(g_verdicts, code);  // borrowed
  if (known != nullptr) {
    verdict = PyLong_AsLong(known);
  } else {
    // An unhashable constant (torch.compile's resume functions): classify keeps it by id.
    if (PyErr_Occurred() && !PyErr_ExceptionMatches(PyExc_TypeError)) throw_python_error();
    PyErr_Clear();
    Ref computed(checked(PyObject_CallOneArg(g_classify, code)));  // also kept in _verdicts
    verdict = PyLong_AsLong(computed.get());
  }
  if (verdict == -1 && PyErr_Occurred()) throw_python_error();
  g_verdict_cache.emplace(code, verdict);
  return verdict;
}

// Where user code made the op's results (_sites.capture_site, in C): the site tuple (borrowed)
// of the innermost user or package frame — for a package frame, with the user's own frame
// further out (kUser) when there is one — or None when no Python frame is either (torch
// internals, a thread without Python frames); *state_maker when a state maker called the op
// (the results are not owned).
constexpr long kPackage = 3;

#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030C0000
// CPython 3.11: the interpreter's own frames are walked, as PyFrame_GetBack does, without
// making a frame object for each (that allocation was most of a walk's cost).
int lasti_of(_PyInterpreterFrame* frame) {
  return _PyInterpreterFrame_LASTI(frame) * static_cast<int>(sizeof(_Py_CODEUNIT));
}

PyObject* user_site(bool* state_maker) {
  *state_maker = false;
  _PyInterpreterFrame* frame = PyThreadState_Get()->cframe->current_frame;
  for (; frame != nullptr; frame = frame->previous) {
    if (_PyFrame_IsIncomplete(frame)) continue;
    PyObject* code = reinterpret_cast<PyObject*>(frame->f_code);
    const long verdict = verdict_of(code);
    if (verdict == kUser) return site_tuple(code, lasti_of(frame), nullptr, 0);
    if (verdict == kPackage) {
      for (_PyInterpreterFrame* outer = frame->previous; outer != nullptr;
           outer = outer->previous) {
        if (_PyFrame_IsIncomplete(outer)) continue;
        PyObject* user_code = reinterpret_cast<PyObject*>(outer->f_code);
        if (verdict_of(user_code) == kUser) {
          return site_tuple(code, lasti_of(frame), user_code, lasti_of(outer));
        }
      }
      return site_tuple(code, lasti_of(frame), nullptr, 0);
    }
    if (verdict == kStateMaker) {
      *state_maker = true;
      return Py_None;
    }
  }
  return Py_None;
}
#else
int lasti_of(PyFrameObject* frame) {
#if PY_VERSION_HEX >= 0x030B0000
  return PyFrame_GetLasti(frame);
#else
  return frame->f_lasti * static_cast<int>(sizeof(_Py_CODEUNIT));
#endif
}

// Each step of the walk: the next frame outward (new reference), the current one released.
PyFrameObject* step_out(PyFrameObject* frame) {
  PyFrameObject* back = PyFrame_GetBack(frame);
  Py_DECREF(frame);
  return back;
}

long verdict_of_frame(PyFrameObject* frame, PyObject** code_out) {
  PyCodeObject* code = PyFrame_GetCode(frame);  // new reference; code objects with a verdict
  Py_DECREF(code);                              // stay alive in _sites._verdicts
  *code_out = reinterpret_cast<PyObject*>(code);
  return verdict_of(*code_out);
}

PyObject* user_site(bool* state_maker) {
  *state_maker = false;
  PyFrameObject* frame = PyEval_GetFrame();  // borrowed
  Py_XINCREF(frame);
  while (frame != nullptr) {
    PyObject* code = nullptr;
    long verdict;
    try {
      verdict = verdict_of_frame(frame, &code);
    } catch (...) {
      Py_DECREF(frame);
      throw;
    }
    if (verdict == kUser || verdict == kPackage) {
      const int lasti = lasti_of(frame);
      PyObject* user_code = nullptr;
      int user_lasti = 0;
      PyFrameObject* outer = verdict == kPackage ? step_out(frame) : (Py_DECREF(frame), nullptr);
      while (outer != nullptr) {
        PyObject* candidate = nullptr;
        long outer_verdict;
        try {
          outer_verdict = verdict_of_frame(outer, &candidate);
        } catch (...) {
          Py_DECREF(outer);
          throw;
        }
        if (outer_verdict == kUser) {
          user_code = candidate;
          user_lasti = lasti_of(outer);
          Py_DECREF(outer);
          break;
        }
        outer = step_out(outer);
      }
      return site_tuple(code, lasti, user_code, user_lasti);
    }
    if (verdict == kStateMaker) {
      Py_DECREF(frame);
      *state_maker = true;
      return Py_None;
    }
    frame = step_out(frame);
  }
  return Py_None;
}
#endif

void give_to_hook(const at::Tensor& t, PyObject* site, bool state_maker) {
  PyObject* obj = THPVariable_Wrap(t);
  if (obj == nullptr) throw python_error();
  if (Py_TYPE(obj) != reinterpret_cast<PyTypeObject*>(THPVariableClass)) {
    Py_DECREF(obj);  // already a Python object of another class: not a new plain result
    return;
  }
  PyObject* args[] = {obj, site, state_maker ? Py_True : Py_False};
  PyObject* result = PyObject_Vectorcall(g_hook, args, 3, nullptr);
  Py_DECREF(obj);
  if (result == nullptr) throw_python_error();
  Py_DECREF(result);
}

// The common case of _adopt.adopt_result, in C: each fresh result becomes a TensorRef owned
// by the current scope, registered exactly as adopt_at() does. Returns false, having changed
// nothing, where the Python hook must decide: inside autograd's engine (a .grad's owner), with
// memory left to release for a cross-thread close, or with the current scope closed.
bool adopt_in_c(const c10::SmallVector<at::Tensor, 4>& fresh, PyObject* site, bool state_maker) {
  PyObject* thread = tl_thread_state;
  if (g_adoption.ref_class == nullptr || thread == nullptr) return false;
  if (torch::autograd::get_current_graph_task_id() != -1) return false;
  if (attribute_is_true(thread, g_names.pending)) return false;
  PyObject* current = nullptr;
  if (PyContextVar_Get(g_adoption.current_scope, Py_None, &current) < 0) throw_python_error();
  Ref scope(current);
  if (scope.get() == Py_None || state_maker) return true;  // no scope here; a state maker's
  if (attribute_is_true(scope.get(), g_names.closed)) return false;
  Ref owned(checked(PyObject_GetAttr(scope.get(), g_names.owned)));
  Ref counters(checked(PyObject_GetAttr(thread, g_names.counters)));
  for (const at::Tensor& t : fresh) {
    Ref tensor(checked(THPVariable_Wrap(t)));
    if (Py_TYPE(tensor.get()) != reinterpret_cast<PyTypeObject*>(THPVariableClass)) continue;
    set_attribute(tensor.get(), g_names.klass, g_adoption.ref_class);
    PyObject* args[] = {tensor.get(), g_adoption.on_death};
    Ref state(checked(PyObject_Vectorcall(g_adoption.state_class, args, 2, nullptr)));
    Ref key(checked(PyLong_FromVoidPtr(tensor.get())));  // id(tensor)
    set_slot(state.get(), g_slots.key, key.get());
    set_slot(state.get(), g_slots.owner, scope.get());
    set_slot(state.get(), g_slots.site, site);
    set_slot(state.get(), g_slots.counters, counters.get());
    set_slot(state.get(), g_slots.disposal, Py_None);
    if (PyDict_SetItem(g_adoption.states, key.get(), state.get()) < 0) throw_python_error();
    if (PyDict_SetItem(owned.get(), key.get(), state.get()) < 0) throw_python_error();
    Ref created(checked(PyMember_GetOne(reinterpret_cast<char*>(counters.get()), g_slots.created)));
    Ref more(checked(PyNumber_Add(created.get(), g_names.one)));
    set_slot(counters.get(), g_slots.created, more.get());
  }
  return true;
}

void give_all_to_hook(const c10::SmallVector<at::Tensor, 4>& fresh) {
  bool state_maker = false;
  PyObject* site = user_site(&state_maker);  // borrowed
  if (adopt_in_c(fresh, site, state_maker)) return;
  for (const at::Tensor& t : fresh) give_to_hook(t, site, state_maker);
}

void fallback(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const size_t num_arguments = schema.arguments().size();
  c10::SmallVector<const c10::TensorImpl*, 8> inputs;
  collect_inputs(*stack, stack->size() - num_arguments, inputs);
  {
    c10::impl::ExcludeDispatchKeyGuard nested(kKey);  // only top-level ops are seen
    op.redispatchBoxed(keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kKey),
                       stack);
  }
  if (g_hook == nullptr) return;
  const size_t num_returns = schema.returns().size();
  const size_t first = stack->size() - num_returns;
  // torch.tensor(data) hands its own new tensor to lift_fresh, which returns it (the op
  // table's fresh_input: optable.cpp).
  const bool input_may_be_fresh = (classify(op).flags & kFreshInput) != 0;
  c10::SmallVector<at::Tensor, 4> fresh;
  for (size_t i = first; i < stack->size(); ++i) {
    const auto& value = (*stack)[i];
    if (value.isTensor()) {
      const at::Tensor& t = value.toTensor();
      if (is_fresh(t, inputs, input_may_be_fresh)) fresh.push_back(t);
    } else if (value.isTensorList()) {
      for (const at::Tensor& t : value.toTensorList()) {
        if (is_fresh(t, inputs, input_may_be_fresh)) fresh.push_back(t);
      }
    }
  }
  if (fresh.empty()) return;
  // torch.jit.trace keeps what it records as constants of the trace: never owned. (detach and
  // alias never get here: they fall through the key, tensorscope/_adopt.py.)
  if (torch::jit::tracer::isTracing()) return;
  PyGILState_STATE gil = PyGILState_Ensure();
  try {
    give_all_to_hook(fresh);
  } catch (...) {
    PyGILState_Release(gil);
    throw;
  }
  PyGILState_Release(gil);
}

void replace(PyObject** slot, PyObject* value) {
  PyObject* old = *slot;
  Py_XINCREF(value);
  *slot = value;
  Py_XDECREF(old);
}

// set_hook(hook, verdicts, classify, adoption=None), or set_hook(None): see the globals above;
// adoption = (TensorRef, RefState, Counters, on_ref_death, STATES, CURRENT_SCOPE) turns on
// adopt_in_c.
PyObject* set_hook(PyObject*, PyObject* args) {
  PyObject* hook = nullptr;
  PyObject* verdicts = Py_None;
  PyObject* classify = Py_None;
  PyObject* adoption = Py_None;
  if (!PyArg_ParseTuple(args, "O|OOO", &hook, &verdicts, &classify, &adoption)) return nullptr;
  Adoption parts;
  PyObject* counters_class = nullptr;
  if (adoption != Py_None &&
      !PyArg_ParseTuple(adoption, "OOOOO!O!", &parts.ref_class, &parts.state_class,
                        &counters_class, &parts.on_death, &PyDict_Type, &parts.states,
                        &PyContextVar_Type, &parts.current_scope)) {
    return nullptr;
  }
  if (hook == Py_None) {
    replace(&g_hook, nullptr);
    Py_RETURN_NONE;
  }
  if (!PyCallable_Check(hook) || !PyDict_Check(verdicts) || !PyCallable_Check(classify)) {
    PyErr_SetString(PyExc_TypeError,
                    "set_hook(hook, verdicts: dict, classify, adoption=None) or set_hook(None)");
    return nullptr;
  }
  Slots slots;
  if (adoption != Py_None) {
    if (!(slots.key = slot_of(parts.state_class, kRefState[kSlotKey])) ||
        !(slots.owner = slot_of(parts.state_class, kRefState[kSlotOwner])) ||
        !(slots.site = slot_of(parts.state_class, kRefState[kSlotSite])) ||
        !(slots.counters = slot_of(parts.state_class, kRefState[kSlotCounters])) ||
        !(slots.disposal = slot_of(parts.state_class, kRefState[kSlotDisposal])) ||
        !(slots.created = slot_of(counters_class, kRefState[kSlotCreated]))) {
      return nullptr;
    }
  }
  g_slots = slots;
  replace(&g_verdicts, verdicts);
  replace(&g_classify, classify);
  g_verdict_cache.clear();
  replace(&g_hook, hook);
  replace(&g_adoption.ref_class, parts.ref_class);
  replace(&g_adoption.state_class, parts.state_class);
  replace(&g_adoption.on_death, parts.on_death);
  replace(&g_adoption.states, parts.states);
  replace(&g_adoption.current_scope, parts.current_scope);
  Py_RETURN_NONE;
}

// poison(tensors, versions, alone): set each disposed tensor's autograd version counter to its
// poison value (see ref.py's NOTE on disposal and _torch.poison_versions). alone[i]: no tensor
// outside the batch holds its storage, so none shares its counter: the shared counter is set.
// Otherwise the tensor gets a new poisoned counter of its own, and live aliases (a view moved
// out of the scope, the h of d = h.detach()) keep theirs.
PyObject* poison(PyObject*, PyObject* args) {
  PyObject* tensors = nullptr;
  PyObject* versions = nullptr;
  PyObject* alone = nullptr;
  if (!PyArg_ParseTuple(args, "OOO", &tensors, &versions, &alone)) return nullptr;
  HANDLE_TH_ERRORS
  Ref tensor_items(checked(PySequence_Fast(tensors, "poison() takes a sequence of tensors")));
  Ref version_items(checked(PySequence_Fast(versions, "poison() takes a sequence of ints")));
  Ref alone_items(checked(PySequence_Fast(alone, "poison() takes a sequence of bools")));
  const Py_ssize_t count = PySequence_Fast_GET_SIZE(tensor_items.get());
  if (PySequence_Fast_GET_SIZE(version_items.get()) != count ||
      PySequence_Fast_GET_SIZE(alone_items.get()) != count) {
    PyErr_SetString(PyExc_ValueError, "poison(): as many versions and flags as tensors");
    return nullptr;
  }
  for (Py_ssize_t i = 0; i < count; ++i) {
    PyObject* item = PySequence_Fast_GET_ITEM(tensor_items.get(), i);
    if (!THPVariable_Check(item)) {
      PyErr_SetString(PyExc_TypeError, "poison() takes tensors");
      return nullptr;
    }
    const long long version = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(version_items.get(), i));
    if (version == -1 && PyErr_Occurred()) return nullptr;
    const int shared_counter_only_here = PyObject_IsTrue(PySequence_Fast_GET_ITEM(alone_items.get(), i));
    if (shared_counter_only_here < 0) return nullptr;
    const at::Tensor& tensor = THPVariable_Unpack(item);
    if (shared_counter_only_here) {
      auto counter = torch::autograd::impl::version_counter(tensor);
      counter.set_version(version);
    } else {
      torch::autograd::impl::set_version_counter(
          tensor, c10::VariableVersion(static_cast<uint32_t>(version)));
    }
  }
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

// guard_disposed(tensor): a released, disposed tensor's TensorImpl gets the Python dispatch
// key, so an op that reaches it from C++ without Python's attribute lookup (torch.tensor(t),
// t.as_subclass(...), autograd's engine) calls DisposedTensor.__torch_dispatch__, which raises,
// instead of computing with its empty data.
PyObject* guard_disposed(PyObject*, PyObject* tensor) {
  if (!THPVariable_Check(tensor)) {
    PyErr_SetString(PyExc_TypeError, "guard_disposed() takes a tensor");
    return nullptr;
  }
  HANDLE_TH_ERRORS
  THPVariable_Unpack(tensor).unsafeGetTensorImpl()->set_python_dispatch(true);
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

PyObject* forget_verdicts(PyObject*, PyObject*) {
  g_verdict_cache.clear();
  Py_RETURN_NONE;
}

PyObject* bind_thread(PyObject*, PyObject* state) {
  tl_thread_state = state == Py_None ? nullptr : state;
  Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"set_hook", set_hook, METH_VARARGS,
     "set_hook(hook, verdicts, classify, adoption=None): hook(tensor, site, state_maker) gets "
     "each fresh result the C adoption leaves to Python."},
    {"poison", poison, METH_VARARGS,
     "poison(tensors, versions, alone): the disposed tensors' version counters (their own "
     "where a tensor outside the batch holds their storage)."},
    {"guard_disposed", guard_disposed, METH_O,
     "guard_disposed(tensor): ops reaching the disposed tensor from C++ raise too."},
    {"forget_verdicts", forget_verdicts, METH_NOARGS,
     "Drop the cached verdicts (a code object's verdict changed: _sites.mark_state_maker)."},
    {"bind_thread", bind_thread, METH_O,
     "This thread's ThreadState (borrowed: it must live as long as the thread), or None."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fast", "tensorscope's C++ scope engine", -1,
                      methods};

}  // namespace

TORCH_LIBRARY_IMPL(_, DeferredInit, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>());
}

bool tensorscope_add_residency(PyObject* module);  // csrc/managed.cpp

PyMODINIT_FUNC PyInit__fast() {
  if (!make_names()) return nullptr;
  PyObject* created = PyModule_Create(&module);
  if (created != nullptr &&
      (!tensorscope_add_residency(created) || !tensorscope_add_optable(created))) {
    Py_DECREF(created);
    return nullptr;
  }
  return created;
}
