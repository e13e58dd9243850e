// The residency manager's op path in C++: the resident fast path (docs/design.md §14).
//
// While ts.manage() routes a thread's ops, the Fake dispatch key is in that thread's included
// key set (instead of the manager's Python dispatch mode being pushed), and this boxed fallback
// runs around every op there. Fake sits directly below Python and above BackendSelect, so it sees
// the ops a TorchDispatchMode sees (below Autograd: `addmm`, not `linear`); nothing else in torch
// registers a kernel on it (it is reserved for a C++ FakeTensor mode that torch 2.13 does not
// ship; `tensor.is_fake()` looks at a tensor's own keys, never at the thread's).
//
// For each op the fallback finds the managed operands in a native table of placements (keyed by
// StorageImpl address, kept in step by tensorscope/residency/native.py). Then, in this order:
// - no managed operand: the op runs at once (the Python mode did nothing else for it either);
// - the fast path: every managed operand on the device tier (no prefetch pending, its file
//   intact), no placement of the manager off the device (Flow then decides nothing after an
//   op) or the op before Flow's next decision point (`res_quiet`: residency/cadence.py), Flow
//   the policy, the op not mutating, its results not due to be managed (no scope open,
//   no optimizer region): operands pinned natively, the op runs, the op is appended to this
//   thread's log (op, placement uids, clock), replayed into the Python ledger/recorder at the
//   next point Python looks (residency/native.py: `sync`). No Python frame, no GIL;
// - otherwise the slow path: the thread's Interceptor is pushed for this one op and the op is
//   redispatched to the Python key: exactly what the Python engine does for every op.
//
// NOTE [threads that inherit the key]
// torch copies a thread's dispatch key set to the threads that run work on its behalf:
// autograd's device threads (a CUDA backward runs on one), TorchScript's fork, at::launch. There
// the Fake key is included but res_attach never ran, so the thread has no Interceptor of its
// own; the Python engine's mode is inherited with the key set, and so the op path must act
// there too (an op reading a demoted CUDA storage would read freed memory). Such a thread takes
// the Interceptor of the most recently attached thread that is still attached (with one thread
// managing, the one whose work it runs: what the inherited Python mode would be).

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/SmallVector.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/function.h>  // Node (torch 2.13 moved it to node.h, included here)
#include <torch/csrc/autograd/graph_task.h>
#include <torch/library.h>

#include "layout.h"

#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

using namespace tensorscope;  // the layout and the op table (layout.h)

constexpr auto kKey = c10::DispatchKey::Fake;

// ------------------------------------------------------------------------------ the table
struct Entry {
  int64_t uid = 0;
  int pins = 0;           // fast ops in flight that use it
  bool fast = false;      // on the device, nothing pending, bytes checkable here
  bool on_device = true;  // tier == "device" (Flow's condition counts the others)
  int fd = -1;            // the offload arena its memory lies in (canary checked per op)
};

struct Arena {
  int64_t high = 0;
  char canary[16] = {};
  bool ok = false;
};

std::mutex g_mu;  // the table, the arenas
std::unordered_map<const void*, Entry> g_entries;
std::unordered_map<int, Arena> g_arenas;
std::atomic<long> g_off_device{0};   // entries not on the device tier
std::atomic<bool> g_policy_ok{false};  // the policy decides nothing after a resident op (Flow)
// By layout.h's Counter: threads with memory to release (cross-thread close), scopes open in
// the process, fast ops running (all threads), fast and slow ops so far (tests, the benchmark).
std::atomic<long> g_counters[kCounterCount] = {};
std::atomic<long>& g_pending = g_counters[kPending];
std::atomic<long>& g_scopes = g_counters[kScopes];
std::atomic<long>& g_inflight = g_counters[kInflight];
std::atomic<long>& g_fast_ops = g_counters[kFastOps];
std::atomic<long>& g_slow_ops = g_counters[kSlowOps];
std::atomic<bool> g_disabled{false};   // fast path off (tests compare both paths)
// Ops on managed tensors that may still run before Flow's next decision with placements off the
// device (residency/cadence.py); guarded by g_mu, one less per fast op.
long g_quiet = 0;

// ----------------------------------------------------------------------------- per thread
struct LogEntry {
  const c10::OperatorName* name;  // stable: owned by the operator's entry
  c10::SmallVector<int64_t, 4> uids;
  double at;
};

struct ThreadLog {
  std::vector<LogEntry> entries;
};

thread_local ThreadLog tl_log;
thread_local PyObject* tl_mode = nullptr;  // this thread's Interceptor (strong), or null
std::vector<PyObject*> g_attached;           // GIL: attached threads' Interceptors, oldest first
thread_local bool tl_due = true;           // results may be due here (optimizer region)

PyObject* g_push = nullptr;      // torch._C._push_on_torch_dispatch_stack
PyObject* g_pop = nullptr;       // torch._C._pop_torch_dispatch_stack
PyObject* g_resolve = nullptr;   // (qualified name, overload) -> OpOverload
PyObject* g_flush = nullptr;     // called (GIL held) when this thread's log is long
std::unordered_map<const c10::OperatorName*, PyObject*> g_ops;  // GIL: resolved OpOverloads

constexpr size_t kFlushAt = 16384;

double now_s() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);  // time.perf_counter()'s clock on Linux
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

void add_storage(const at::Tensor& t, c10::SmallVector<const void*, 8>& keys) {
  if (!t.defined() || t.layout() != c10::kStrided || !t.has_storage()) return;
  if (t.device().type() == c10::DeviceType::Meta) return;
  const void* key = t.storage().unsafeGetStorageImpl();
  for (const void* seen : keys) {
    if (seen == key) return;
  }
  keys.push_back(key);
}

// The storages of the op's tensor arguments, in argument order (the Python op path's order).
void operand_storages(const torch::jit::Stack& stack, size_t begin,
                      c10::SmallVector<const void*, 8>& keys) {
  for (size_t i = begin; i < stack.size(); ++i) {
    const auto& value = stack[i];
    if (value.isTensor()) {
      add_storage(value.toTensor(), keys);
    } else if (value.isTensorList()) {
      for (const at::Tensor& t : value.toTensorList()) add_storage(t, keys);
    } else if (value.isList()) {
      for (const c10::IValue& item : value.toListRef()) {
        if (item.isTensor()) add_storage(item.toTensor(), keys);
      }
    }
  }
}

void run_plain(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  c10::impl::ExcludeDispatchKeyGuard guard(kKey);  // what the op runs inside is not seen
  op.redispatchBoxed(keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kKey), stack);
}

[[noreturn]] void throw_python_error() {
  python_error error;
  error.persist();
  throw error;
}

// NOTE [threads that inherit the key]: the Interceptor of the most recently attached thread
// that is alive (``Interceptor.state.alive``), or null. GIL held.
PyObject* inherited_mode() {
  for (auto it = g_attached.rbegin(); it != g_attached.rend(); ++it) {
    PyObject* state = PyObject_GetAttrString(*it, kAttributes[kAttrState]);
    PyObject* flag = state != nullptr ? PyObject_GetAttrString(state, kAttributes[kAttrAlive])
                                      : nullptr;
    const int alive = flag != nullptr ? PyObject_IsTrue(flag) : -1;
    Py_XDECREF(flag);
    Py_XDECREF(state);
    if (alive < 0) PyErr_Clear();
    if (alive == 1) return *it;
  }
  return nullptr;
}

// The slow path: this thread's Interceptor handles the op, as in the Python engine.
void run_slow(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  g_slow_ops.fetch_add(1, std::memory_order_relaxed);
  PyGILState_STATE gil = PyGILState_Ensure();
  PyObject* mode = tl_mode != nullptr ? tl_mode : inherited_mode();
  if (mode == nullptr || g_push == nullptr) {
    PyGILState_Release(gil);
    run_plain(op, keys, stack);
    return;
  }
  Py_INCREF(mode);
  PyObject* pushed = PyObject_CallOneArg(g_push, mode);
  if (pushed == nullptr) {
    Py_DECREF(mode);
    PyGILState_Release(gil);
    throw_python_error();
  }
  Py_DECREF(pushed);
  auto pop = [&]() {
    PyObject *type, *value, *trace;
    PyErr_Fetch(&type, &value, &trace);
    PyObject* popped = PyObject_CallOneArg(g_pop, Py_None);
    Py_XDECREF(popped);
    if (popped == nullptr) PyErr_Clear();
    PyErr_Restore(type, value, trace);
    Py_DECREF(mode);
  };
  try {
    c10::impl::ExcludeDispatchKeyGuard guard(kKey);
    const auto below = keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kKey);
    op.redispatchBoxed(below | c10::DispatchKeySet(c10::DispatchKey::Python) |
                           c10::DispatchKeySet(c10::DispatchKey::PythonTLSSnapshot),
                       stack);
  } catch (...) {
    pop();
    PyGILState_Release(gil);
    throw;
  }
  pop();
  PyGILState_Release(gil);
}

void flush_from_fast_path() {
  PyGILState_STATE gil = PyGILState_Ensure();
  if (g_flush != nullptr) {
    PyObject* result = PyObject_CallNoArgs(g_flush);
    if (result == nullptr) {
      PyGILState_Release(gil);
      throw_python_error();
    }
    Py_DECREF(result);
  }
  PyGILState_Release(gil);
}

bool arena_intact(int fd) {
  Arena arena;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    const auto found = g_arenas.find(fd);
    if (found == g_arenas.end()) return false;
    arena = found->second;
  }
  if (!arena.ok) return false;
  char read_back[16];
  const ssize_t got = pread(fd, read_back, sizeof(read_back), arena.high);
  return got == static_cast<ssize_t>(sizeof(read_back)) &&
         std::memcmp(read_back, arena.canary, sizeof(read_back)) == 0;
}

void fallback(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  // The op table's kind (optable.cpp): torch.optim's regions always go to Python.
  uint8_t kind = classify(op).kind;
  if (kind >= kEnter || g_pending.load(std::memory_order_relaxed) > 0) {
    return run_slow(op, keys, stack);
  }
  const bool in_backward = torch::autograd::get_current_graph_task_id() != -1;
  if (kind == kDetach || kind == kAlias) {
    // Unseen outside autograd's engine, as in the Interceptor (_intercept.py's _ALIASES).
    if (!in_backward) return run_plain(op, keys, stack);
    kind = kind == kDetach ? kGradCandidate : kPlain;
  }
  const size_t num_arguments = op.schema().arguments().size();
  c10::SmallVector<const void*, 8> storages;
  operand_storages(*stack, stack->size() - num_arguments, storages);
  c10::SmallVector<Entry*, 4> managed;
  bool fast = !g_disabled.load(std::memory_order_relaxed);
  {
    std::lock_guard<std::mutex> lock(g_mu);
    if (!g_entries.empty()) {
      for (const void* key : storages) {
        const auto found = g_entries.find(key);
        if (found != g_entries.end()) managed.push_back(&found->second);
      }
    }
    if (managed.empty()) {
      fast = true;
      if (kind == kGradCandidate && in_backward) {  // a managed parameter's .grad in the making?
        const auto node = torch::autograd::get_current_node();
        const auto* accumulate = dynamic_cast<const torch::autograd::AccumulateGrad*>(node.get());
        if (accumulate != nullptr && accumulate->variable.defined() &&
            accumulate->variable.has_storage()) {
          const void* key = accumulate->variable.storage().unsafeGetStorageImpl();
          fast = g_entries.find(key) == g_entries.end();
        }
      }
    } else {
      fast = fast && kind != kMutating && !(kind == kGradCandidate && in_backward) && !tl_due &&
             g_policy_ok.load(std::memory_order_relaxed) &&
             (g_off_device.load(std::memory_order_relaxed) == 0 || g_quiet > 0) &&
             g_scopes.load(std::memory_order_relaxed) == 0;
      for (Entry* entry : managed) fast = fast && entry->fast;
      if (fast) {
        for (Entry* entry : managed) ++entry->pins;
        if (g_quiet > 0) --g_quiet;  // this op's clock tick (the Python clock counts it on replay)
      }
    }
  }
  if (!fast) return run_slow(op, keys, stack);
  if (managed.empty()) return run_plain(op, keys, stack);
  // Entry pointers stay valid while pinned: a pinned entry is never dropped (native.py).
  LogEntry logged{&op.operator_name(), {}, 0.0};
  c10::SmallVector<int, 2> fds;
  for (Entry* entry : managed) {
    logged.uids.push_back(entry->uid);
    if (entry->fd >= 0) {
      bool seen = false;
      for (int fd : fds) seen = seen || fd == entry->fd;
      if (!seen) fds.push_back(entry->fd);
    }
  }
  auto unpin = [&]() {
    std::lock_guard<std::mutex> lock(g_mu);
    for (Entry* entry : managed) --entry->pins;
  };
  for (int fd : fds) {
    if (!arena_intact(fd)) {  // the Python path raises ResidencyError with the reason
      unpin();
      return run_slow(op, keys, stack);
    }
  }
  logged.at = now_s();
  g_inflight.fetch_add(1);
  try {
    run_plain(op, keys, stack);
  } catch (...) {
    g_inflight.fetch_sub(1);
    unpin();
    throw;
  }
  unpin();
  g_inflight.fetch_sub(1);
  g_fast_ops.fetch_add(1, std::memory_order_relaxed);
  tl_log.entries.push_back(std::move(logged));
  if (tl_log.entries.size() >= kFlushAt) flush_from_fast_path();
}

// ------------------------------------------------------------------------- Python functions
void replace(PyObject** slot, PyObject* value) {
  PyObject* old = *slot;
  Py_XINCREF(value);
  *slot = value;
  Py_XDECREF(old);
}

// res_setup(push, pop, resolve, flush)
PyObject* res_setup(PyObject*, PyObject* args) {
  PyObject *push, *pop, *resolve, *flush;
  if (!PyArg_ParseTuple(args, "OOOO", &push, &pop, &resolve, &flush)) return nullptr;
  replace(&g_push, push);
  replace(&g_pop, pop);
  replace(&g_resolve, resolve);
  replace(&g_flush, flush);
  Py_RETURN_NONE;
}

// res_set(key, (uid, fast, on_device, fd), create=True): layout.h's kPlacementFields
// (tensorscope._layout.PlacementFields).
PyObject* res_set(PyObject*, PyObject* args) {
  unsigned long long key;
  long long uid;
  int fast, on_device, fd, create = 1;
  if (!PyArg_ParseTuple(args, "K(Lppi)|p", &key, &uid, &fast, &on_device, &fd, &create)) {
    return nullptr;
  }
  std::lock_guard<std::mutex> lock(g_mu);
  if (!create) {
    const auto found = g_entries.find(reinterpret_cast<const void*>(key));
    if (found == g_entries.end() || found->second.uid != uid) Py_RETURN_NONE;
  }
  auto [it, added] = g_entries.try_emplace(reinterpret_cast<const void*>(key));
  Entry& entry = it->second;
  if (!added && !entry.on_device) g_off_device.fetch_sub(1);
  entry.uid = uid;
  entry.fast = fast != 0;
  entry.on_device = on_device != 0;
  entry.fd = fd;
  if (!entry.on_device) g_off_device.fetch_add(1);
  Py_RETURN_NONE;
}

// Runs `act` on the entry of key `arg` unless a fast op pins it: True when done (or there is
// no entry), False while pinned.
template <typename Act>
PyObject* unless_pinned(PyObject* arg, Act act) {
  const unsigned long long key = PyLong_AsUnsignedLongLong(arg);
  if (PyErr_Occurred()) return nullptr;
  std::lock_guard<std::mutex> lock(g_mu);
  const auto found = g_entries.find(reinterpret_cast<const void*>(key));
  if (found == g_entries.end()) Py_RETURN_TRUE;
  if (found->second.pins > 0) Py_RETURN_FALSE;
  act(found);
  Py_RETURN_TRUE;
}

// res_drop(key) -> bool: False (nothing dropped) while a fast op pins it.
PyObject* res_drop(PyObject*, PyObject* arg) {
  return unless_pinned(arg, [](decltype(g_entries)::iterator found) {
    if (!found->second.on_device) g_off_device.fetch_sub(1);
    g_entries.erase(found);
  });
}

// res_claim(key) -> bool: the placement leaves the fast path (about to move); False while a
// fast op uses it.
PyObject* res_claim(PyObject*, PyObject* arg) {
  return unless_pinned(arg, [](decltype(g_entries)::iterator found) {
    found->second.fast = false;
  });
}

// res_arena(fd, high, canary, ok) / res_arena(fd) to forget it
PyObject* res_arena(PyObject*, PyObject* args) {
  int fd;
  long long high = 0;
  const char* canary = nullptr;
  Py_ssize_t length = 0;
  int ok = 0;
  if (!PyArg_ParseTuple(args, "i|Ly#p", &fd, &high, &canary, &length, &ok)) return nullptr;
  std::lock_guard<std::mutex> lock(g_mu);
  if (canary == nullptr) {
    g_arenas.erase(fd);
    Py_RETURN_NONE;
  }
  if (length != 16) {
    PyErr_SetString(PyExc_ValueError, "res_arena: a 16-byte canary");
    return nullptr;
  }
  Arena& arena = g_arenas[fd];
  arena.high = high;
  std::memcpy(arena.canary, canary, 16);
  arena.ok = ok != 0;
  Py_RETURN_NONE;
}

// res_attach(mode or None): this thread's ops go through the fallback (mode: its Interceptor).
PyObject* res_attach(PyObject*, PyObject* mode) {
  if (tl_mode != nullptr) {  // this thread's previous one leaves the list
    for (auto it = g_attached.begin(); it != g_attached.end(); ++it) {
      if (*it == tl_mode) {
        Py_DECREF(*it);
        g_attached.erase(it);
        break;
      }
    }
  }
  if (mode == Py_None) {
    c10::impl::tls_set_dispatch_key_included(kKey, false);
    Py_CLEAR(tl_mode);
  } else {
    Py_INCREF(mode);
    Py_XSETREF(tl_mode, mode);
    Py_INCREF(mode);
    g_attached.push_back(mode);
    c10::impl::tls_set_dispatch_key_included(kKey, true);
  }
  Py_RETURN_NONE;
}

// res_forget_threads(): only this thread stays attached (a forked child: the parent's other
// threads do not exist there).
PyObject* res_forget_threads(PyObject*, PyObject*) {
  for (PyObject* mode : g_attached) Py_DECREF(mode);
  g_attached.clear();
  if (tl_mode != nullptr) {
    Py_INCREF(tl_mode);
    g_attached.push_back(tl_mode);
  }
  Py_RETURN_NONE;
}

PyObject* res_due(PyObject*, PyObject* flag) {
  const int truth = PyObject_IsTrue(flag);
  if (truth < 0) return nullptr;
  tl_due = truth != 0;
  Py_RETURN_NONE;
}

// res_excluded(on) -> previous: the key excluded on this thread (tensorscope's own tensor work).
PyObject* res_excluded(PyObject*, PyObject* flag) {
  const int truth = PyObject_IsTrue(flag);
  if (truth < 0) return nullptr;
  const bool before = c10::impl::tls_is_dispatch_key_excluded(kKey);
  c10::impl::tls_set_dispatch_key_excluded(kKey, truth != 0);
  return PyBool_FromLong(before);
}

// res_counter(index, delta) -> new value: layout.h's Counter (tensorscope._layout.COUNTERS).
PyObject* res_counter(PyObject*, PyObject* args) {
  int which;
  long delta;
  if (!PyArg_ParseTuple(args, "il", &which, &delta)) return nullptr;
  if (which < 0 || which >= kCounterCount) {
    PyErr_Format(PyExc_ValueError, "res_counter: no counter %d", which);
    return nullptr;
  }
  return PyLong_FromLong(g_counters[which].fetch_add(delta) + delta);
}

PyObject* res_flags(PyObject*, PyObject* args) {
  int policy_ok, disabled;
  if (!PyArg_ParseTuple(args, "pp", &policy_ok, &disabled)) return nullptr;
  g_policy_ok.store(policy_ok != 0);
  g_disabled.store(disabled != 0);
  Py_RETURN_NONE;
}

// res_quiet(n): the next n ops on managed tensors need no decision by the policy (cadence.py).
PyObject* res_quiet(PyObject*, PyObject* arg) {
  const long n = PyLong_AsLong(arg);
  if (n == -1 && PyErr_Occurred()) return nullptr;
  std::lock_guard<std::mutex> lock(g_mu);
  g_quiet = n > 0 ? n : 0;
  Py_RETURN_NONE;
}

PyObject* op_object(const LogEntry& entry) {  // borrowed
  const auto found = g_ops.find(entry.name);
  if (found != g_ops.end()) return found->second;
  PyObject* result = PyObject_CallFunction(g_resolve, "ss", entry.name->name.c_str(),
                                           entry.name->overload_name.c_str());
  if (result == nullptr) return nullptr;
  g_ops.emplace(entry.name, result);
  return result;
}

// res_drain() -> None or (ops, uids, clocks, last): this thread's fast ops since the last drain,
// oldest first: their OpOverloads, their placement uids (one tuple per distinct operand list),
// their time.perf_counter() clocks, and for each uid the index of its last use.
PyObject* res_drain(PyObject*, PyObject*) {
  if (tl_log.entries.empty()) Py_RETURN_NONE;
  std::vector<LogEntry> entries;
  entries.swap(tl_log.entries);
  const auto count = static_cast<Py_ssize_t>(entries.size());
  PyObject* ops = PyList_New(count);
  PyObject* uids = PyList_New(count);
  PyObject* clocks = PyList_New(count);
  PyObject* last = PyDict_New();
  auto fail = [&]() -> PyObject* {
    Py_XDECREF(ops);
    Py_XDECREF(uids);
    Py_XDECREF(clocks);
    Py_XDECREF(last);
    return nullptr;
  };
  if (ops == nullptr || uids == nullptr || clocks == nullptr || last == nullptr) return fail();
  std::unordered_map<std::string, PyObject*> tuples;  // borrowed: each is in `uids`
  for (Py_ssize_t i = 0; i < count; ++i) {
    const LogEntry& entry = entries[static_cast<size_t>(i)];
    PyObject* op = g_resolve != nullptr ? op_object(entry) : Py_None;
    if (op == nullptr) return fail();
    Py_INCREF(op);
    PyList_SET_ITEM(ops, i, op);
    const std::string bytes(reinterpret_cast<const char*>(entry.uids.data()),
                            entry.uids.size() * sizeof(int64_t));
    auto found = tuples.find(bytes);
    PyObject* tuple;
    if (found != tuples.end()) {
      tuple = found->second;
      Py_INCREF(tuple);
    } else {
      tuple = PyTuple_New(static_cast<Py_ssize_t>(entry.uids.size()));
      if (tuple == nullptr) return fail();
      for (size_t j = 0; j < entry.uids.size(); ++j) {
        PyObject* uid = PyLong_FromLongLong(entry.uids[j]);
        if (uid == nullptr) {
          Py_DECREF(tuple);
          return fail();
        }
        PyTuple_SET_ITEM(tuple, j, uid);
      }
      tuples.emplace(bytes, tuple);
    }
    PyList_SET_ITEM(uids, i, tuple);
    PyObject* clock = PyFloat_FromDouble(entry.at);
    if (clock == nullptr) return fail();
    PyList_SET_ITEM(clocks, i, clock);
  }
  for (Py_ssize_t i = count - 1; i >= 0; --i) {
    PyObject* tuple = PyList_GET_ITEM(uids, i);
    for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(tuple); ++j) {
      PyObject* uid = PyTuple_GET_ITEM(tuple, j);
      const int has = PyDict_Contains(last, uid);
      if (has < 0) return fail();
      if (has == 0) {
        PyObject* index = PyLong_FromSsize_t(i);
        if (index == nullptr || PyDict_SetItem(last, uid, index) < 0) {
          Py_XDECREF(index);
          return fail();
        }
        Py_DECREF(index);
      }
    }
  }
  return Py_BuildValue("(NNNN)", ops, uids, clocks, last);
}

PyMethodDef residency_methods[] = {
    {"res_setup", res_setup, METH_VARARGS, "res_setup(push, pop, resolve, flush)"},
    {"res_set", res_set, METH_VARARGS,
     "res_set(key, (uid, fast, on_device, fd), create=True): a placement's state"},
    {"res_drop", res_drop, METH_O, "res_drop(key) -> bool: forget a placement unless pinned"},
    {"res_claim", res_claim, METH_O, "res_claim(key) -> bool: off the fast path unless pinned"},
    {"res_arena", res_arena, METH_VARARGS, "res_arena(fd, high, canary, ok) or res_arena(fd)"},
    {"res_attach", res_attach, METH_O, "res_attach(interceptor or None) for this thread"},
    {"res_due", res_due, METH_O, "res_due(flag): results may be due on this thread"},
    {"res_forget_threads", res_forget_threads, METH_NOARGS,
     "res_forget_threads(): the other threads' Interceptors are dropped (after fork)"},
    {"res_excluded", res_excluded, METH_O, "res_excluded(on) -> previous"},
    {"res_counter", res_counter, METH_VARARGS, "res_counter(index, delta) -> new value"},
    {"res_flags", res_flags, METH_VARARGS, "res_flags(policy_ok, disabled)"},
    {"res_quiet", res_quiet, METH_O, "res_quiet(n): n ops before the policy's next decision"},
    {"res_drain", res_drain, METH_NOARGS,
     "res_drain() -> None or (ops, uids, clocks, last): this thread's fast ops"},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

TORCH_LIBRARY_IMPL(_, Fake, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>());
}

bool tensorscope_add_residency(PyObject* module) {
  return PyModule_AddFunctions(module, residency_methods) == 0;
}
