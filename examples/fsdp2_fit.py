"""Train a sharded model under a per-rank memory budget: FSDP2 (``fully_shard``) and ``ts.fit``.

Run with two processes on the CPU (gloo) or on two GPUs (NCCL, chosen when CUDA is present)::

    torchrun --nproc-per-node 2 examples/fsdp2_fit.py --budget 80MiB

The loop is the user's own: ``fully_shard`` on every block and then on the model (torchtitan's
order), the optimizer over the sharded parameters, then ``ts.fit(model, optimizer, budget)`` on
every rank -- nothing else changes. The budget is per rank and counts that rank's bytes (its
parameter shards, the parameters gathered for a block, reduce-scatter buffers, gradient and
optimizer-state shards, activations); ts.fit decides once, the same on every rank, which blocks
to keep, recompute or keep selectively, whether each parameter is updated inside backward on its
reduced shard and whether the sharded optimizer state waits in the next tier (docs/fit.md,
"Across processes"). Rank 0 prints the decision; every rank's losses are printed at the end.
A GPT-2 built from a small config with random weights (transformers); no download.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import tensorscope as ts


def _model() -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(0)  # the same weights on every rank before sharding
    cfg = tf.GPT2Config(
        n_layer=6, n_embd=128, n_head=4, vocab_size=2048, n_positions=128, use_cache=False
    )
    return tf.GPT2LMHeadModel(cfg).train()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget", default="80MiB", help="per rank, e.g. 80MiB")
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, local = dist.get_rank(), int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    try:
        from torch.distributed.fsdp import fully_shard

        model = _model().to(device)
        for block in model.transformer.h:  # each block its own group, then the root
            fully_shard(block)
        fully_shard(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        fit = ts.fit(model, optimizer, budget=args.budget)  # on every rank
        g = torch.Generator().manual_seed(1 + rank)  # each rank its own batches
        losses = []
        for step in range(args.steps):
            ids = torch.randint(0, 2048, (8, 128), generator=g).to(device)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(round(loss.item(), 4))
            if rank == 0 and step == 3:  # decided after step 1, checked in step 3
                print(fit.explain(), flush=True)
        print(f"rank {rank}: losses {losses}", flush=True)
        fit.remove()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
