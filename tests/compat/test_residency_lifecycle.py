"""Client code that drops the ``ts.manage()`` handle (API.md §4: manage works in place).

Found while building this matrix: ``ts.manage(model)`` as a bare statement (or a handle kept
only in a local that goes away), then ``ts.residency.reset()``, leaves tensorscope's dispatch mode
pushed on the thread: torch no longer runs untouched although nothing is managed any more. The
check runs in a subprocess, so that a failure cannot leave the mode pushed for later tests.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import gc
    import torch
    import tensorscope as ts

    def manage_and_train():
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(12)])
        ts.residency.configure(device="cpu", policy="flow", budget=20_000)
        ts.manage(model)  # the handle is not kept
        optimizer = torch.optim.AdamW(model.parameters())
        for _ in range(2):
            with ts.scope():
                model(torch.ones(2, 32)).sum().backward()
                optimizer.step()
        return model

    model = manage_and_train()
    gc.collect()
    assert ts.residency.managed_count() > 0
    ts.residency.reset()
    assert ts.residency.managed_count() == 0
    pushed = torch._C._len_torch_dispatch_stack()
    assert pushed == 0, f"{pushed} dispatch mode(s) still pushed after reset()"
    assert type(model[0].weight) is torch.nn.Parameter
    assert type(model(torch.ones(2, 32))) is torch.Tensor
    print("ok")
    """
)


def test_reset_after_a_dropped_handle_leaves_torch_untouched() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
