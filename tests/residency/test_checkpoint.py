"""ts.empty_init() and ts.manage(module, checkpoint=...): checkpoints straight into the tiers."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import save_file
from torch import nn

import tensorscope as ts

MiB = 1 << 20


def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))


def _saved_mlp(path: Path, dtype: torch.dtype = torch.float32) -> nn.Sequential:
    torch.manual_seed(0)
    model = _mlp()
    save_file({k: v.to(dtype).contiguous() for k, v in model.state_dict().items()}, str(path))
    return model


def _digest(directory: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in directory.iterdir()
        if p.suffix == ".safetensors"
    }


# ----------------------------------------------------------------------------- empty_init
def test_empty_init_puts_parameters_on_meta_and_keeps_buffers_real() -> None:
    with ts.empty_init():
        model = nn.Sequential(nn.Linear(4096, 4096), nn.BatchNorm1d(4096))
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert {b.device.type for b in model.buffers()} == {"cpu"}
    assert type(model[0].weight) is nn.Parameter and model[0].weight.requires_grad
    with ts.empty_init(include_buffers=True):
        bn = nn.BatchNorm1d(8)
    assert {b.device.type for b in bn.buffers()} == {"meta"}
    real = nn.Linear(2, 2)  # outside the block: untouched
    assert real.weight.device.type == "cpu"


def test_empty_init_nests_and_is_per_thread() -> None:
    seen: list[str] = []
    inside = threading.Event()
    done = threading.Event()

    def other_thread() -> None:
        inside.wait()
        seen.append(nn.Linear(2, 2).weight.device.type)
        done.set()

    worker = threading.Thread(target=other_thread)
    worker.start()
    with ts.empty_init():
        with ts.empty_init():
            inner = nn.Linear(2, 2)
        outer = nn.Linear(2, 2)
        inside.set()
        done.wait(10)
    worker.join()
    assert inner.weight.device.type == outer.weight.device.type == "meta"
    assert seen == ["cpu"]  # another thread builds real modules meanwhile


def test_manage_without_a_checkpoint_refuses_meta_parameters() -> None:
    with ts.empty_init():
        model = _mlp()
    with pytest.raises(ts.ResidencyError, match=r"meta.*checkpoint="):
        ts.manage(model)


# ------------------------------------------------------------------------ loading, no copy
@pytest.mark.strict
def test_a_single_file_is_placed_in_place_without_reading_it(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    reference = _saved_mlp(path)
    with ts.empty_init():
        model = _mlp()
    ts.residency.configure(policy="flow", budget="64KiB")
    handle = ts.manage(model, checkpoint=path)
    report = ts.residency.report()
    assert report.checkpoint_placements == 4 and report.transfers.count == 0
    for param in model.parameters():
        assert param.tier == "disk" and type(param) is ts.ManagedParameter
        placement = ts.residency.placement_of(param)
        assert placement is not None and placement.region is not None
        assert placement.region.readonly  # its memory is the checkpoint file's mapping
    x = torch.randn(3, 64)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    assert ts.residency.report().peak_bytes <= 64 * 1024
    handle.remove()
    assert all(type(p) is nn.Parameter for p in model.parameters())
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))  # plain parameters in RAM, same values


def test_a_sharded_directory_with_an_index_loads(tmp_path: Path) -> None:
    torch.manual_seed(0)
    reference = _mlp()
    state = reference.state_dict()
    shards = {"a.safetensors": ["0.weight", "0.bias"], "b.safetensors": ["2.weight", "2.bias"]}
    for name, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(tmp_path / name))
    index = {"metadata": {}, "weight_map": {k: n for n, ks in shards.items() for k in ks}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with ts.empty_init():
        model = _mlp()
    handle = ts.manage(model, checkpoint=tmp_path)
    x = torch.randn(2, 64)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    handle.remove()


@pytest.mark.strict
def test_another_stored_dtype_is_converted_once_into_an_offload_file(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    reference = _saved_mlp(path, dtype=torch.bfloat16)
    with ts.empty_init():
        model = _mlp()  # float32 parameters
    handle = ts.manage(model, checkpoint=path)
    report = ts.residency.report()
    assert report.converted == 4 and report.checkpoint_placements == 0
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert ours.dtype == torch.float32
        assert torch.equal(ours, theirs.to(torch.bfloat16).float())
    assert "converted" in str(report)
    handle.remove()


def test_missing_and_unexpected_keys_are_named(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    torch.manual_seed(0)
    state = _mlp().state_dict()
    del state["2.bias"]
    state["extra.weight"] = torch.zeros(2)
    save_file(state, str(path))
    with ts.empty_init():
        model = _mlp()
    with pytest.raises(ts.ResidencyError, match=r"match no parameter.*extra\.weight.*strict"):
        ts.manage(model, checkpoint=path)
    with pytest.raises(ts.ResidencyError, match=r"1 meta tensor.*2\.bias"):
        ts.manage(model, checkpoint=path, strict=False)
    assert ts.residency.managed_count() == 0  # nothing was placed before the checks
    assert all(p.device.type == "meta" for p in model.parameters())


def test_more_than_ten_missing_keys_are_counted(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    save_file({"unused": torch.zeros(1)}, str(path))
    with ts.empty_init():
        model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(8)])  # 16 parameters
    with pytest.raises(ts.ResidencyError, match=r"16 meta tensor.*and 6 more"):
        ts.manage(model, checkpoint=path, strict=False)


def test_a_truncated_or_corrupt_file_fails_at_manage(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    _saved_mlp(path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    with ts.empty_init():
        model = _mlp()
    with pytest.raises(ts.ResidencyError, match="truncated or corrupt"):
        ts.manage(model, checkpoint=path)
    path.write_bytes(b"\xff" * 64)
    with pytest.raises(ts.ResidencyError, match="truncated or corrupt"):
        ts.manage(model, checkpoint=path)
    with pytest.raises(ts.ResidencyError, match="no such file"):
        ts.manage(model, checkpoint=tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ts.ResidencyError, match=r"neither model\.safetensors"):
        ts.manage(model, checkpoint=tmp_path / "empty")


def test_a_checkpoint_changed_on_disk_while_mapped_raises_at_the_next_op(tmp_path: Path) -> None:
    """Truncating or rewriting the file behind the manager's back never crashes (SIGBUS):
    the next op that needs one of its tensors raises ResidencyError."""
    path = tmp_path / "model.safetensors"
    _saved_mlp(path)
    with ts.empty_init():
        model = _mlp()
    handle = ts.manage(model, checkpoint=path)
    os.truncate(path, 1000)
    with torch.no_grad(), pytest.raises(ts.ResidencyError, match=r"cannot be read.*truncated"):
        model(torch.randn(1, 64))
    with pytest.raises(ts.ResidencyError, match="bytes are lost"):
        handle.remove()  # never zeros: see test_checkpoint_integrity.py
    with pytest.warns(ts.ResidencyWarning, match="NaN"):
        ts.residency.reset()


@pytest.mark.strict
def test_a_training_step_never_writes_the_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    reference = _saved_mlp(path)
    before = _digest(tmp_path)
    with ts.empty_init():
        model = _mlp()
    ts.residency.configure(policy="flow", budget="64KiB")  # weights 17 KiB, with Adam ~70
    handle = ts.manage(model, checkpoint=path)
    opt = torch.optim.AdamW(model.parameters())
    ref_opt = torch.optim.AdamW(reference.parameters())
    x = torch.randn(4, 64)
    for _ in range(2):
        with ts.scope():
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        ref_opt.zero_grad()
        reference(x).square().mean().backward()
        ref_opt.step()
    assert _digest(tmp_path) == before
    assert ts.residency.report().checkpoint_placements == 0  # written: own offload files now
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(ours, theirs)
    assert ts.residency.report().peak_bytes <= 64 * 1024
    handle.remove()


# ------------------------------------------------------------------------- transformers
def _tiny(kind: str) -> object:
    if kind == "llama":
        return transformers.LlamaConfig(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    if kind == "gpt2":  # ties lm_head to the token embedding: one tensor under two names
        return transformers.GPT2Config(
            vocab_size=128, n_positions=64, n_embd=64, n_layer=2, n_head=4
        )
    return transformers.BertConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
    )


@pytest.mark.strict
@pytest.mark.parametrize("guess", [False, True], ids=["recorded", "module-order-guess"])
@pytest.mark.parametrize("kind", ["llama", "gpt2", "bert"])
def test_transformers_models_match_from_pretrained(
    kind: str, guess: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The tiny weights are below the size the first-iteration guess reads ahead; with the
    # threshold at 0 every weight takes part, so the guess runs on these models' real code.
    monkeypatch.setattr(ts.residency.order, "min_bytes", 0 if guess else 1 << 62)
    config = _tiny(kind)
    auto = transformers.AutoModel if kind == "bert" else transformers.AutoModelForCausalLM
    torch.manual_seed(0)
    auto.from_config(config).save_pretrained(tmp_path, max_shard_size="60KB")
    plain = auto.from_pretrained(tmp_path).eval()
    with ts.empty_init():
        model = auto.from_config(config).eval()
    params = sum(p.numel() * 4 for p in plain.parameters())
    ts.residency.configure(policy="flow", budget=params // 3)
    handle = ts.manage(model, checkpoint=tmp_path)
    ids = torch.randint(0, 128, (1, 10))
    with torch.no_grad():
        if kind == "bert":
            assert torch.equal(model(ids).last_hidden_state, plain(ids).last_hidden_state)
        else:
            assert torch.equal(model(ids).logits, plain(ids).logits)
        # Nothing was recorded before this first forward: only the guess prefetches in it.
        assert (ts.residency.report().prefetches > 0) == guess
        if kind != "bert":
            ours = model.generate(ids, max_new_tokens=6, do_sample=False)
            assert torch.equal(ours, plain.generate(ids, max_new_tokens=6, do_sample=False))
    if kind == "gpt2":
        assert model.lm_head.weight is model.transformer.wte.weight  # tied: loaded once
    assert ts.residency.report().peak_bytes <= params // 3
    handle.remove()
