// The op table's engine side (tensorscope/_optable.py's NOTE [the engine's copy]), and the
// engine's layout (layout.h).
//
// The engine classifies the ops it sees by the table's rules: the flags given by name come
// from Python (set_op_names, when tensorscope._optable is imported), the one schema rule
// (writes_result) is computed here, and the kind is derived from the flags as _optable.kind_of
// does. tests/core/test_optable.py compares op_class() with the Python table on every op with
// a schema. Lookups are per thread and never take the GIL (the fast paths run without it): a
// small direct-mapped cache in front of a map, both keyed by the operator's name object (owned
// by its entry in the dispatcher: its address is stable).

#include "layout.h"

#include <atomic>
#include <mutex>
#include <string>
#include <unordered_map>

namespace tensorscope {
namespace {

std::mutex g_names_mu;  // g_names
std::unordered_map<std::string, uint32_t> g_names;  // "aten::detach" or "aten::fill_.Scalar"
std::atomic<uint32_t> g_generation{1};  // bumped by set_op_names: every cache starts over

struct Front {
  const void* key = nullptr;
  uint32_t generation = 0;
  OpClass value;
};
constexpr size_t kFrontSize = 256;
thread_local Front tl_front[kFrontSize];
thread_local std::unordered_map<const void*, OpClass> tl_back;
thread_local uint32_t tl_back_generation = 0;

uint8_t kind_of(uint32_t flags) {
  if (flags & kWritesResult) return kMutating;
  if (flags & kBareAlias) return (flags & kGradMaker) ? kDetach : kAlias;
  if (flags & kGradMaker) return kGradCandidate;
  if (flags & kRegionStart) return kEnter;
  if (flags & kRegionEnd) return kExit;
  return kPlain;
}

OpClass compute(const c10::OperatorHandle& op) {
  const c10::OperatorName& name = op.operator_name();
  uint32_t flags = 0;
  {
    std::lock_guard<std::mutex> lock(g_names_mu);
    const auto whole = g_names.find(name.name);
    if (whole != g_names.end()) flags |= whole->second;
    const std::string overload =
        name.name + "." + (name.overload_name.empty() ? "default" : name.overload_name);
    const auto one = g_names.find(overload);
    if (one != g_names.end()) flags |= one->second;
  }
  for (const auto& ret : op.schema().returns()) {
    if (ret.alias_info() != nullptr && ret.alias_info()->isWrite()) flags |= kWritesResult;
  }
  OpClass result;
  result.flags = flags;
  result.kind = kind_of(flags);
  return result;
}

PyObject* names_tuple(const char* const* names, size_t count) {
  PyObject* tuple = PyTuple_New(static_cast<Py_ssize_t>(count));
  if (tuple == nullptr) return nullptr;
  for (size_t i = 0; i < count; ++i) {
    PyObject* name = PyUnicode_FromString(names[i]);
    if (name == nullptr) {
      Py_DECREF(tuple);
      return nullptr;
    }
    PyTuple_SET_ITEM(tuple, static_cast<Py_ssize_t>(i), name);
  }
  return tuple;
}

template <size_t N>
bool add_names(PyObject* dict, const char* key, const char* const (&names)[N]) {
  PyObject* tuple = names_tuple(names, N);
  if (tuple == nullptr) return false;
  const int failed = PyDict_SetItemString(dict, key, tuple);
  Py_DECREF(tuple);
  return failed == 0;
}

// layout() -> {part: names}: the layout this engine was compiled with (_layout.LAYOUT).
PyObject* layout(PyObject*, PyObject*) {
  static_assert(sizeof(kCounterNames) / sizeof(kCounterNames[0]) == kCounterCount);
  static_assert(sizeof(kRefState) / sizeof(kRefState[0]) == kRefSlotCount);
  static_assert(sizeof(kAttributes) / sizeof(kAttributes[0]) == kAttributeCount);
  static_assert(sizeof(kKindNames) / sizeof(kKindNames[0]) == kExit + 1);
  static_assert(1u << (sizeof(kOpFlagNames) / sizeof(kOpFlagNames[0]) - 1) == kFreshInput);
  PyObject* dict = PyDict_New();
  if (dict == nullptr) return nullptr;
  if (!add_names(dict, "placement", kPlacementFields) ||
      !add_names(dict, "counters", kCounterNames) || !add_names(dict, "ref_state", kRefState) ||
      !add_names(dict, "attributes", kAttributes) || !add_names(dict, "log", kLog) ||
      !add_names(dict, "op_flags", kOpFlagNames) || !add_names(dict, "kinds", kKindNames)) {
    Py_DECREF(dict);
    return nullptr;
  }
  return dict;
}

// set_op_names({name: flags}): the flags given by name (_optable.NAMED, the engine's bits).
PyObject* set_op_names(PyObject*, PyObject* names) {
  if (!PyDict_Check(names)) {
    PyErr_SetString(PyExc_TypeError, "set_op_names({name: flags})");
    return nullptr;
  }
  std::unordered_map<std::string, uint32_t> parsed;
  PyObject *key, *value;
  Py_ssize_t position = 0;
  while (PyDict_Next(names, &position, &key, &value)) {
    const char* text = PyUnicode_AsUTF8(key);
    if (text == nullptr) return nullptr;
    const unsigned long flags = PyLong_AsUnsignedLong(value);
    if (PyErr_Occurred()) return nullptr;
    parsed.emplace(text, static_cast<uint32_t>(flags));
  }
  {
    std::lock_guard<std::mutex> lock(g_names_mu);
    g_names.swap(parsed);
  }
  g_generation.fetch_add(1);
  Py_RETURN_NONE;
}

// op_class(name, overload) -> (flags, kind), or None for an op the dispatcher does not know.
PyObject* op_class(PyObject*, PyObject* args) {
  const char* name;
  const char* overload;
  if (!PyArg_ParseTuple(args, "ss", &name, &overload)) return nullptr;
  const auto handle = c10::Dispatcher::singleton().findSchema({name, overload});
  if (!handle.has_value()) Py_RETURN_NONE;
  const OpClass found = classify(*handle);
  return Py_BuildValue("(kI)", static_cast<unsigned long>(found.flags),
                       static_cast<unsigned int>(found.kind));
}

PyMethodDef optable_methods[] = {
    {"layout", layout, METH_NOARGS, "layout() -> the layout compiled in (tensorscope._layout)"},
    {"set_op_names", set_op_names, METH_O, "set_op_names({name: flags}): the named op flags"},
    {"op_class", op_class, METH_VARARGS,
     "op_class(name, overload) -> (flags, kind) as the engine classifies the op, or None"},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

OpClass classify(const c10::OperatorHandle& op) {
  const void* key = &op.operator_name();
  const uint32_t generation = g_generation.load(std::memory_order_relaxed);
  Front& front = tl_front[(reinterpret_cast<uintptr_t>(key) >> 4) % kFrontSize];
  if (front.key == key && front.generation == generation) return front.value;
  if (tl_back_generation != generation) {
    tl_back.clear();
    tl_back_generation = generation;
  }
  auto found = tl_back.find(key);
  if (found == tl_back.end()) found = tl_back.emplace(key, compute(op)).first;
  front.key = key;
  front.generation = generation;
  front.value = found->second;
  return found->second;
}

}  // namespace tensorscope

bool tensorscope_add_optable(PyObject* module) {
  return PyModule_AddFunctions(module, tensorscope::optable_methods) == 0;
}
