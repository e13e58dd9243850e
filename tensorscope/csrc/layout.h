// What the C++ engine and Python share: the layout tensorscope/_layout.py declares (LAYOUT).
//
// Every name and position the engine relies on when it reads or writes Python objects, or is
// handed a tuple, is written here once and used from here; `layout()` (optable.cpp) exports
// these arrays, and tensorscope/_engine.py refuses an engine whose layout is not the declared
// one (an extension built from other sources).
#pragma once

#include <Python.h>

#include <ATen/core/dispatch/Dispatcher.h>

#include <cstdint>

namespace tensorscope {

// A placement in the native table: res_set(key, (uid, fast, on_device, fd), create).
inline constexpr const char* kPlacementFields[] = {"uid", "fast", "on_device", "fd"};

// The process-wide counters, by index: res_counter(index, delta).
enum Counter : int { kPending, kScopes, kInflight, kFastOps, kSlowOps, kCounterCount };
inline constexpr const char* kCounterNames[] = {"pending", "scopes", "inflight", "fast", "slow"};

// The slots adopt_in_c writes: RefState's, then (after the bar) Counters'.
enum RefSlot : int { kSlotKey, kSlotOwner, kSlotSite, kSlotCounters, kSlotDisposal, kSlotBar,
                     kSlotCreated, kRefSlotCount };
inline constexpr const char* kRefState[] = {"key",      "owner", "site",           "counters",
                                            "disposal", "|",     "created_in_scope"};

// Attributes read by name: ThreadState's, DisposeScope's, the Interceptor's, ThreadState's.
enum Attribute : int { kAttrPending, kAttrCounters, kAttrClosed, kAttrOwned, kAttrState,
                       kAttrAlive, kAttributeCount };
inline constexpr const char* kAttributes[] = {"pending", "counters", "_closed",
                                              "_owned",  "state",    "alive"};

// res_drain()'s tuple.
inline constexpr const char* kLog[] = {"ops", "uids", "clocks", "last"};

// The op table's flags the engine computes (tensorscope/_optable.py), lowest bit first.
enum OpFlag : uint32_t {
  kWritesResult = 1u << 0,
  kBareAlias = 1u << 1,
  kGradMaker = 1u << 2,
  kRegionStart = 1u << 3,
  kRegionEnd = 1u << 4,
  kFreshInput = 1u << 5,
};
inline constexpr const char* kOpFlagNames[] = {"writes_result", "bare_alias",  "grad_maker",
                                               "region_start",  "region_end", "fresh_input"};

// How an op path routes an op (_optable.kind_of).
enum OpKind : uint8_t { kPlain, kMutating, kGradCandidate, kAlias, kDetach, kEnter, kExit };
inline constexpr const char* kKindNames[] = {"plain",  "mutating", "grad_candidate", "alias",
                                             "detach", "enter",    "exit"};

struct OpClass {
  uint32_t flags = 0;
  uint8_t kind = kPlain;
};

// The op's flags and kind, cached per thread (optable.cpp; never takes the GIL).
OpClass classify(const c10::OperatorHandle& op);

}  // namespace tensorscope

// Adds layout(), set_op_names() and op_class() to the extension module (optable.cpp).
bool tensorscope_add_optable(PyObject* module);
