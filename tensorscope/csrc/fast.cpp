// tensorscope._fast: the scope engine in C++ (see tensorscope/_engine.py and docs/design.md §1).
//
// While a scope is open on a thread, the DeferredInit dispatch key is in that thread's included
// key set, and this boxed fallback runs around every *top-level* op: DeferredInit sits above
// Autograd and Autocast, so it sees the op the user called (``linear``), not its decomposition,
// and the ops that op runs inside are dispatched with the key excluded. For each result that is
// a fresh plain tensor, it calls the Python hook (``_intercept.adopt_result``), which decides
// ownership and makes the result a TensorRef. Everything else stays in C++: an op whose results
// are all inputs (in-place ops, no-op conversions) or wrapped/subclass tensors costs no Python.
//
// DeferredInit is a key PyTorch reserves for out-of-tree deferred initialisation (torchdistx);
// tensorscope registers a fallback only there and only includes the key while scopes are open.

#include <Python.h>
#include <frameobject.h>
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
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/library.h>

namespace {

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
constexpr long kStateMaker = 2;

bool is_named(const c10::OperatorHandle& op, const char* name) {
  return op.operator_name().name == name;
}

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

long verdict_of(PyObject* code) {
  PyObject* known = PyDict_GetItemWithError(g_verdicts, code);  // borrowed
  if (known == nullptr) {
    if (PyErr_Occurred()) throw_python_error();
    PyObject* computed = PyObject_CallOneArg(g_classify, code);
    if (computed == nullptr) throw_python_error();
    const long verdict = PyLong_AsLong(computed);
    Py_DECREF(computed);
    return verdict;
  }
  return PyLong_AsLong(known);
}

// Where user code made the op's results (_sites.capture_site, in C): the innermost user frame's
// code object (new reference), with *lasti its instruction offset; or nullptr with *lasti = -1
// when a state maker called the op (the results are not owned), *lasti = 0 when no Python frame
// is a user frame (torch internals, a thread without Python frames).
#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030C0000
// CPython 3.11: the interpreter's own frames are walked, as PyFrame_GetBack does, without
// making a frame object for each (that allocation was most of a walk's cost).
PyObject* user_site(int* lasti) {
  *lasti = 0;
  _PyInterpreterFrame* frame = PyThreadState_Get()->cframe->current_frame;
  for (; frame != nullptr; frame = frame->previous) {
    if (_PyFrame_IsIncomplete(frame)) continue;
    PyObject* code = reinterpret_cast<PyObject*>(frame->f_code);
    const long verdict = verdict_of(code);
    if (verdict == kUser) {
      *lasti = _PyInterpreterFrame_LASTI(frame) * static_cast<int>(sizeof(_Py_CODEUNIT));
      Py_INCREF(code);
      return code;
    }
    if (verdict == kStateMaker) {
      *lasti = -1;
      return nullptr;
    }
  }
  return nullptr;
}
#else
PyObject* user_site(int* lasti) {
  *lasti = 0;
  PyFrameObject* frame = PyEval_GetFrame();  // borrowed
  Py_XINCREF(frame);
  while (frame != nullptr) {
    PyCodeObject* code = PyFrame_GetCode(frame);  // new reference
    long verdict;
    try {
      verdict = verdict_of(reinterpret_cast<PyObject*>(code));
    } catch (...) {
      Py_DECREF(code);
      Py_DECREF(frame);
      throw;
    }
    if (verdict == kUser) {
#if PY_VERSION_HEX >= 0x030B0000
      *lasti = PyFrame_GetLasti(frame);
#else
      *lasti = frame->f_lasti * static_cast<int>(sizeof(_Py_CODEUNIT));
#endif
      Py_DECREF(frame);
      return reinterpret_cast<PyObject*>(code);
    }
    Py_DECREF(code);
    if (verdict == kStateMaker) {
      Py_DECREF(frame);
      *lasti = -1;
      return nullptr;
    }
    PyFrameObject* back = PyFrame_GetBack(frame);  // new reference
    Py_DECREF(frame);
    frame = back;
  }
  return nullptr;
}
#endif

void give_to_hook(const at::Tensor& t, PyObject* code, int lasti) {
  PyObject* obj = THPVariable_Wrap(t);
  if (obj == nullptr) throw python_error();
  if (Py_TYPE(obj) != reinterpret_cast<PyTypeObject*>(THPVariableClass)) {
    Py_DECREF(obj);  // already a Python object of another class: not a new plain result
    return;
  }
  PyObject* offset = PyLong_FromLong(lasti);
  if (offset == nullptr) {
    Py_DECREF(obj);
    throw_python_error();
  }
  PyObject* args[] = {obj, code != nullptr ? code : Py_None, offset};
  PyObject* result = PyObject_Vectorcall(g_hook, args, 3, nullptr);
  Py_DECREF(offset);
  Py_DECREF(obj);
  if (result == nullptr) throw_python_error();
  Py_DECREF(result);
}

void give_all_to_hook(const c10::SmallVector<at::Tensor, 4>& fresh) {
  int lasti = 0;
  PyObject* code = user_site(&lasti);
  try {
    for (const at::Tensor& t : fresh) give_to_hook(t, code, lasti);
  } catch (...) {
    Py_XDECREF(code);
    throw;
  }
  Py_XDECREF(code);
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
  // torch.tensor(data) hands its own new tensor to lift_fresh, which returns it.
  const bool input_may_be_fresh = is_named(op, "aten::lift_fresh");
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
  // C functions of torch that hold the GIL while they make a subclass from a detached alias
  // (nn.Parameter's _make_subclass, as_subclass) must get a tensor without a Python object.
  if ((is_named(op, "aten::detach") || is_named(op, "aten::alias")) && PyGILState_Check()) {
    return;
  }
  PyGILState_STATE gil = PyGILState_Ensure();
  try {
    give_all_to_hook(fresh);
  } catch (...) {
    PyGILState_Release(gil);
    throw;
  }
  PyGILState_Release(gil);
}

PyObject* set_enabled(PyObject*, PyObject* arg) {
  const int on = PyObject_IsTrue(arg);
  if (on < 0) return nullptr;
  c10::impl::tls_set_dispatch_key_included(kKey, on != 0);
  Py_RETURN_NONE;
}

PyObject* is_enabled(PyObject*, PyObject*) {
  return PyBool_FromLong(c10::impl::tls_is_dispatch_key_included(kKey));
}

void replace(PyObject** slot, PyObject* value) {
  PyObject* old = *slot;
  Py_XINCREF(value);
  *slot = value;
  Py_XDECREF(old);
}

// set_hook(hook, verdicts, classify), or set_hook(None): see the globals above.
PyObject* set_hook(PyObject*, PyObject* args) {
  PyObject* hook = nullptr;
  PyObject* verdicts = Py_None;
  PyObject* classify = Py_None;
  if (!PyArg_ParseTuple(args, "O|OO", &hook, &verdicts, &classify)) return nullptr;
  if (hook == Py_None) {
    replace(&g_hook, nullptr);
    Py_RETURN_NONE;
  }
  if (!PyCallable_Check(hook) || !PyDict_Check(verdicts) || !PyCallable_Check(classify)) {
    PyErr_SetString(PyExc_TypeError, "set_hook(hook, verdicts: dict, classify) or set_hook(None)");
    return nullptr;
  }
  replace(&g_verdicts, verdicts);
  replace(&g_classify, classify);
  replace(&g_hook, hook);
  Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"set_enabled", set_enabled, METH_O, "Include (True) or exclude the key on this thread."},
    {"is_enabled", is_enabled, METH_NOARGS, "Whether the key is included on this thread."},
    {"set_hook", set_hook, METH_VARARGS,
     "set_hook(hook, verdicts, classify): hook(tensor, code, lasti) gets each fresh result."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fast", "tensorscope's C++ scope engine", -1,
                      methods};

}  // namespace

TORCH_LIBRARY_IMPL(_, DeferredInit, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>());
}

PyMODINIT_FUNC PyInit__fast() { return PyModule_Create(&module); }
