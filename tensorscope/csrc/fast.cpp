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

PyObject* g_hook = nullptr;  // the Python callable each fresh result is given to

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

void give_to_hook(const at::Tensor& t) {
  PyObject* obj = THPVariable_Wrap(t);
  if (obj == nullptr) throw python_error();
  if (Py_TYPE(obj) != reinterpret_cast<PyTypeObject*>(THPVariableClass)) {
    Py_DECREF(obj);  // already a Python object of another class: not a new plain result
    return;
  }
  PyObject* result = PyObject_CallOneArg(g_hook, obj);
  Py_DECREF(obj);
  if (result == nullptr) {
    python_error error;
    error.persist();
    throw error;
  }
  Py_DECREF(result);
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
    for (const at::Tensor& t : fresh) give_to_hook(t);
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

PyObject* set_hook(PyObject*, PyObject* hook) {
  PyObject* old = g_hook;
  if (hook == Py_None) {
    g_hook = nullptr;
  } else {
    Py_INCREF(hook);
    g_hook = hook;
  }
  Py_XDECREF(old);
  Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"set_enabled", set_enabled, METH_O, "Include (True) or exclude the key on this thread."},
    {"is_enabled", is_enabled, METH_NOARGS, "Whether the key is included on this thread."},
    {"set_hook", set_hook, METH_O, "The callable each fresh result is given to (or None)."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fast", "tensorscope's C++ scope engine", -1,
                      methods};

}  // namespace

TORCH_LIBRARY_IMPL(_, DeferredInit, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>());
}

PyMODINIT_FUNC PyInit__fast() { return PyModule_Create(&module); }
