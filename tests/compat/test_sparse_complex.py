"""Sparse (COO, CSR) and complex tensors made and used inside scopes (item 8).

Results equal the plain ones bit for bit; scope exit works; ``ts.stats()`` after the scope is
consistent (``live`` back to its value before the scope, ``live`` = created - disposed), and a
scope opened afterwards still disposes what it owns.
"""

from __future__ import annotations

import gc
from collections.abc import Callable

import pytest
import torch

import tensorscope as ts

from . import _models as M


def _dense() -> torch.Tensor:
    return torch.randn(6, 5, generator=torch.Generator().manual_seed(0))


def _coo() -> torch.Tensor:
    indices = torch.tensor([[0, 1, 1, 4, 5, 1], [2, 0, 3, 4, 1, 0]])
    values = torch.tensor([1.0, -2.0, 3.0, 0.5, 4.0, 1.5])
    return torch.sparse_coo_tensor(indices, values, (6, 5))


def coo_ops() -> list[torch.Tensor]:
    sp = _coo().coalesce()
    dense = _dense()
    return [
        sp.indices(),
        sp.values(),
        sp.to_dense(),
        torch.sparse.mm(sp, dense.T),
        (sp @ dense.T),
        (sp * 2.0).to_dense(),
        (sp + sp).coalesce().values(),
        sp.t().coalesce().to_dense(),
        torch.sparse.sum(sp, dim=1).to_dense(),
        torch.sparse.softmax(sp, dim=1).to_dense(),
        torch.addmm(torch.ones(6, 6), sp, dense.T),
        dense.to_sparse().coalesce().values(),
    ]


def csr_ops() -> list[torch.Tensor]:
    csr = _coo().to_sparse_csr()
    dense = _dense()
    made = torch.sparse_csr_tensor(
        torch.tensor([0, 2, 3]), torch.tensor([0, 2, 1]), torch.tensor([1.0, 2.0, 3.0]), (2, 3)
    )
    return [
        csr.crow_indices(),
        csr.col_indices(),
        csr.values(),
        csr.to_dense(),
        csr @ dense.T,
        torch.mv(csr, torch.ones(5)),
        (csr * 3.0).to_dense(),
        made.to_dense(),
        made.to_sparse_coo().coalesce().indices(),
        dense.to_sparse_csr().values(),
    ]


def complex_ops() -> list[torch.Tensor]:
    z = torch.complex(_dense(), _dense().flip(0))
    spectrum = torch.fft.fft(z, dim=0)
    return [
        z,
        z.abs(),
        z.angle(),
        z.conj(),
        z.conj().resolve_conj(),
        z @ z.mT,
        torch.view_as_real(z),
        torch.view_as_complex(torch.view_as_real(z).contiguous()),
        spectrum,
        torch.fft.ifft(spectrum, dim=0),
        torch.fft.rfft(_dense(), dim=1),
        torch.polar(_dense().abs(), _dense()),
        z.real * z.imag,
        torch.linalg.eigvals(torch.randn(4, 4, generator=torch.Generator().manual_seed(1))),
    ]


OPS: dict[str, Callable[[], list[torch.Tensor]]] = {
    "coo": coo_ops,
    "csr": csr_ops,
    "complex": complex_ops,
}


def _assert_same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.layout == want.layout and got.dtype == want.dtype, what
    if got.layout != torch.strided:
        got, want = got.to_dense(), want.to_dense()
    assert torch.equal(got, want), what


@pytest.mark.parametrize("kind", list(OPS))
def test_made_and_used_inside_a_scope(kind: str) -> None:
    expected = OPS[kind]()
    gc.collect()
    before = ts.stats()
    with ts.scope():
        got = OPS[kind]()  # still referenced when the scope closes: the scope disposes them
        for i, (a, b) in enumerate(zip(got, expected, strict=True)):
            _assert_same(a, b, f"result {i}")
    for i, t in enumerate(got):
        assert getattr(t, "is_disposed", False), f"result {i} outlived its scope"
        with pytest.raises(ts.DisposedTensorError):
            t.sum()
    del got, a, b, t
    gc.collect()
    after = ts.stats()
    assert after.live == before.live, f"live {before.live} -> {after.live}"
    created = after.created_in_scope + after.created_outside_scope
    disposed = after.disposed_in_scope + after.disposed_outside_scope
    assert after.live == created - disposed
    # the next scope still works and disposes what it owns
    with ts.scope():
        probe = torch.ones(3) * 2
    assert probe.is_disposed
    gc.collect()
    assert ts.stats().live == before.live


@pytest.mark.parametrize("kind", ["coo", "csr"])
def test_sparse_tensor_made_outside_used_inside(kind: str) -> None:
    sp = _coo().coalesce() if kind == "coo" else _coo().to_sparse_csr()
    expected = (sp @ _dense().T).clone()
    for _ in range(2):
        with ts.scope():
            assert torch.equal(sp @ _dense().T, expected)
    M.assert_alive(sp.to_dense(), "the sparse tensor")
    assert torch.equal(sp @ _dense().T, expected)


def _sparse_embedding_training(scoped: bool) -> tuple[list[float], torch.Tensor]:
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(20, 8, sparse=True)
    head = torch.nn.Linear(8, 1)
    sparse_opt = torch.optim.SparseAdam(list(embedding.parameters()), lr=0.05)
    dense_opt = torch.optim.Adam(head.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(2)
    losses = []
    for _ in range(3):
        ids = torch.randint(0, 20, (4, 3), generator=generator)
        target = torch.randn(4, 1, generator=generator)
        with M.Run("scope" if scoped else "plain").step():
            sparse_opt.zero_grad()
            dense_opt.zero_grad()
            out = head(embedding(ids).mean(1))
            loss = torch.nn.functional.mse_loss(out, target)
            loss.backward()
            assert embedding.weight.grad is not None and embedding.weight.grad.is_sparse
            sparse_opt.step()
            dense_opt.step()
            losses.append(loss.item())
    M.assert_module_alive(embedding)
    return losses, embedding.weight.detach().clone()


def test_sparse_gradients_and_sparse_adam_in_scopes_match_plain() -> None:
    """``nn.Embedding(sparse=True)``: its gradient is a sparse COO tensor made by backward."""
    expected_losses, expected_weight = _sparse_embedding_training(scoped=False)
    losses, weight = _sparse_embedding_training(scoped=True)
    assert losses == expected_losses
    assert torch.equal(weight, expected_weight)


def test_complex_parameter_training_in_scopes_matches_plain() -> None:
    def train(scoped: bool) -> tuple[list[float], torch.Tensor]:
        torch.manual_seed(0)
        weight = torch.nn.Parameter(torch.randn(4, 4, dtype=torch.complex64))
        optimizer = torch.optim.Adam([weight], lr=0.05)
        x = torch.randn(8, 4, dtype=torch.complex64, generator=torch.Generator().manual_seed(1))
        losses = []
        for _ in range(3):
            with M.Run("scope" if scoped else "plain").step():
                optimizer.zero_grad()
                loss = (x @ weight).abs().square().mean()
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
        return losses, weight.detach().clone()

    expected_losses, expected_weight = train(False)
    losses, weight = train(True)
    assert losses == expected_losses
    assert torch.equal(weight, expected_weight)
