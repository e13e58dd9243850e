// tensorscope._storage: exchange the memory of two storages, for torch without
// UntypedStorage._swap_data_ptr_ (before 2.13; see tensorscope/_torch.py's swap_data_ptr).
//
// The residency manager moves a managed tensor's bytes by giving its StorageImpl other memory:
// every tensor, view and saved copy sharing the storage follows (docs/design.md, residency).
// torch 2.13 exposes that as c10::StorageImpl::swap_data_ptr; torch 2.11 has no such method, but
// its public setters do the same: the DataPtrs are exchanged through set_data_ptr (which first
// materializes a copy-on-write DataPtr, as swap_data_ptr does), then the sizes, the allocators
// and the resizable flags. The data-pointer access guards (set only on FakeTensor-style storages,
// which are never managed) stay with each storage. A separate module with no dispatch kernels:
// it loads beside either scope engine (TENSORSCOPE_ENGINE=python included).

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <c10/core/Storage.h>
#include <c10/core/StorageImpl.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/Storage.h>

#include <utility>

namespace {

PyObject* swap(PyObject*, PyObject* args) {
  PyObject* first = nullptr;
  PyObject* second = nullptr;
  if (!PyArg_ParseTuple(args, "OO", &first, &second)) return nullptr;
  HANDLE_TH_ERRORS
  if (!THPStorage_Check(first) || !THPStorage_Check(second)) {
    PyErr_SetString(PyExc_TypeError, "swap(storage, storage) takes two UntypedStorages");
    return nullptr;
  }
  c10::StorageImpl* a = THPStorage_Unpack(first).unsafeGetStorageImpl();
  c10::StorageImpl* b = THPStorage_Unpack(second).unsafeGetStorageImpl();
  if (a == b) Py_RETURN_NONE;
  if (a->sym_nbytes().is_heap_allocated() || b->sym_nbytes().is_heap_allocated()) {
    PyErr_SetString(PyExc_ValueError, "swap(): a storage of symbolic size");
    return nullptr;
  }
  const size_t a_bytes = a->nbytes();
  const size_t b_bytes = b->nbytes();
  at::DataPtr a_data = a->set_data_ptr(at::DataPtr(nullptr, a->device()));
  at::DataPtr b_data = b->set_data_ptr(std::move(a_data));
  a->set_data_ptr_noswap(std::move(b_data));
  a->set_nbytes(b_bytes);
  b->set_nbytes(a_bytes);
  at::Allocator* a_allocator = a->allocator();
  const bool a_resizable = a->resizable();
  a->set_allocator(b->allocator());
  b->set_allocator(a_allocator);
  a->set_resizable(b->resizable());
  b->set_resizable(a_resizable);
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

PyMethodDef methods[] = {
    {"swap", swap, METH_VARARGS,
     "swap(a, b): exchange the memory (data pointer, size, allocator) of two UntypedStorages"},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_storage",
                      "tensorscope's storage door for torch without _swap_data_ptr_", -1,
                      methods};

}  // namespace

PyMODINIT_FUNC PyInit__storage() { return PyModule_Create(&module); }
