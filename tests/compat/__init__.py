"""Compatibility matrix: real client code run plain and under tensorscope, compared bit for bit.

Modes (``_models.Run``): "plain" (the reference), "scope" (a ``with ts.scope():`` around each
step or call), "flow"/"genoa" (the model managed under a budget below its parameters' size with
that policy, plus a scope around each step; peak device bytes must stay within the budget).

| item | file |
|---|---|
| transformers: training, checkpointing, generate() | test_hf_training.py, test_hf_generation.py |
| inference_mode / no_grad forwards | test_inference_modes.py |
| torch.compile (eager, aot_eager, counting backend, inductor) | test_compile.py |
| autocast inside scopes and around a loop of scopes | test_autocast.py |
| GradScaler first used inside a scope | test_gradscaler.py |
| multi-worker DataLoader with next() inside scopes | test_dataloader.py |
| torch.func transforms | test_func.py |
| sparse (COO, CSR) and complex tensors, ts.stats() | test_sparse_complex.py |
| deepcopy, torch.save/load, pickle | test_copy_serialize.py |
| threads and asyncio tasks | test_threads_async.py |
| module.to(dtype) / half / float, BatchNorm running stats | test_module_to.py |
| a dropped ts.manage() handle, then reset() | test_residency_lifecycle.py |
"""
