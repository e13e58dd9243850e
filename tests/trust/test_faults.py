"""#4, #13, #15: offload files changed behind the manager's back, a full disk during an optimizer
step, and the number of file descriptors. Each runs in a fresh interpreter: today #4 kills the
process (SIGBUS), and #13/#15 need process limits (RLIMIT_FSIZE, RLIMIT_NOFILE)."""

from __future__ import annotations

import os

import pytest

from . import _models as M

# The file behind a tensor's memory is found from /proc/self/maps (the inode of the mapping that
# holds its data) and an open descriptor of that inode: no tensorscope internals are used.
TRUNCATE_A_RESIDENT_WEIGHTS_FILE = r"""
import os, sys, torch, tensorscope as ts
from torch import nn

def descriptor_of_mapping(address):
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            low, high = (int(v, 16) for v in fields[0].split("-"))
            if low <= address < high:
                inode = int(fields[4])
                break
        else:
            raise SystemExit("test setup: the weight is not in a mapping")
    if inode == 0:
        raise SystemExit("test setup: the weight is not file-backed")
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.fstat(int(name)).st_ino == inode:
                return int(name)
        except OSError:
            pass
    raise SystemExit("test setup: no open descriptor for the weight's file")

offload_dir, how = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
x = torch.randn(4, 64)
ts.residency.configure(device="cpu", policy="flow", budget="1MiB", offload_dir=offload_dir)
handle = ts.manage(model)  # under a budget every weight moves into its offload file
weight = model[0].weight
print("tier", weight.tier, flush=True)
fd = descriptor_of_mapping(weight.data_ptr())
size = os.fstat(fd).st_size
os.ftruncate(fd, 0)
if how == "re-extended":
    os.ftruncate(fd, size)  # the same size again, but the bytes are gone (zeros)
try:
    with ts.scope():
        model(x).sum().item()
    print("no error", flush=True)
except ts.ResidencyError as error:
    print("ResidencyError", error, flush=True)
print("survived", flush=True)
"""


@pytest.mark.parametrize("how", ["truncated", "re-extended"])
def test_a_resident_weights_offload_file_changed_behind_the_managers_back_raises_residency_error(
    how: str, tmp_path: os.PathLike[str]
) -> None:
    """#4: a resident weight's truncated offload file: ResidencyError, never SIGBUS or zeros."""
    done = M.run_child(TRUNCATE_A_RESIDENT_WEIGHTS_FILE, str(tmp_path), how)
    assert done.returncode == 0, M.describe(done)
    assert "tier device" in done.stdout, M.describe(done)
    assert "ResidencyError tensorscope.residency:" in done.stdout, M.describe(done)
    assert "survived" in done.stdout, M.describe(done)


# Adam's first step() under a budget with the offload files capped at 0 bytes (a full disk):
# when it fails it must be a ResidencyError; once the limit is lifted, retrying that step() on
# the same gradients and training on must give exactly the plain run's losses and weights.
DISK_FULL_DURING_FIRST_ADAM_STEP = r"""
import resource, signal, sys, torch, tensorscope as ts
from torch import nn
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG

def mlp():
    torch.manual_seed(0)
    layers = [nn.Linear(16, 32)]
    for _ in range(6):
        layers += [nn.Linear(32, 32), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(32, 4))

data = [
    (torch.randn(8, 16, generator=torch.Generator().manual_seed(i)),
     torch.randn(8, 4, generator=torch.Generator().manual_seed(100 + i)))
    for i in range(3)
]
plain = mlp()
plain_opt = torch.optim.Adam(plain.parameters(), lr=1e-2)
expected = []
for x, y in data:
    loss = nn.functional.mse_loss(plain(x), y)
    plain_opt.zero_grad(); loss.backward(); plain_opt.step(); expected.append(loss.item())

model = mlp()
total = sum(p.numel() * 4 for p in model.parameters())
ts.residency.configure(device="cpu", policy="flow", budget=max(total * 2 // 5, 5 * 4096),
                       offload_dir=sys.argv[1])
handle = ts.manage(model)
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
losses = []
for i, (x, y) in enumerate(data):
    with ts.scope():
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad(); loss.backward(); losses.append(loss.item())
        if i == 0:
            resource.setrlimit(resource.RLIMIT_FSIZE, (0, hard))  # the disk is full
            try:
                opt.step()
                print("first step did not fail", flush=True)
                done = True
            except ts.ResidencyError as error:
                print("first step: ResidencyError", str(error)[:100], flush=True)
                done = False
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))  # space freed
            if done:
                continue
        opt.step()  # the retry of step 0, then steps 1 and 2
print("losses equal", losses == expected, flush=True)
print("weights equal", all(torch.equal(p.detach(), q.detach())
                           for p, q in zip(model.parameters(), plain.parameters())), flush=True)
"""


def test_optimizer_step_retried_after_a_disk_full_trains_exactly_like_plain(
    tmp_path: os.PathLike[str],
) -> None:
    """#13: after a disk-full in Adam's first step, a retry once space is freed trains like plain.

    Assumed meaning of "retry": ``opt.step()`` called again on the same gradients (the failed
    step must therefore leave no partial update). The failure itself must be a ResidencyError.
    """
    done = M.run_child(DISK_FULL_DURING_FIRST_ADAM_STEP, str(tmp_path))
    assert done.returncode == 0, M.describe(done)
    assert "losses equal True" in done.stdout, M.describe(done)
    assert "weights equal True" in done.stdout, M.describe(done)


# A 400-parameter model (200 tiny Linear layers) managed under a budget, trained one Adam step
# with the common soft limit of 1024 open files; the number of descriptors must not grow with
# the number of managed tensors.
MANY_TENSORS_UNDER_ULIMIT_1024 = r"""
import os, resource, sys, torch, tensorscope as ts
from torch import nn
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard), hard))

def model():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(4, 4) for _ in range(200)])

x = torch.randn(2, 4)
plain = model()
plain_opt = torch.optim.Adam(plain.parameters(), lr=1e-2)
plain(x).square().mean().backward(); plain_opt.step()

managed = model()
assert len(list(managed.parameters())) == 400
before = len(os.listdir("/proc/self/fd"))
total = sum(p.numel() * 4 for p in managed.parameters())
ts.residency.configure(device="cpu", policy="flow", budget=total // 2, offload_dir=sys.argv[1])
handle = ts.manage(managed)
opt = torch.optim.Adam(managed.parameters(), lr=1e-2)
try:
    with ts.scope():
        managed(x).square().mean().backward()
        opt.step()
    print("step ok", flush=True)
except Exception as error:
    print("step failed:", type(error).__name__, str(error)[:120], flush=True)
grown = len(os.listdir("/proc/self/fd")) - before
print("descriptors grown", grown, flush=True)
print("weights equal", all(torch.equal(p.detach(), q.detach())
                           for p, q in zip(managed.parameters(), plain.parameters())), flush=True)
"""


@pytest.mark.slow  # a subprocess trains a 400-parameter model
def test_a_400_parameter_model_trains_under_ulimit_1024_with_few_descriptors(
    tmp_path: os.PathLike[str],
) -> None:
    """#15: 400 managed parameters + Adam train under ulimit -n 1024 with few descriptors.

    "Few": at most 64 descriptors more than before ``manage()`` for 1200 managed tensors.
    """
    done = M.run_child(MANY_TENSORS_UNDER_ULIMIT_1024, str(tmp_path))
    assert done.returncode == 0, M.describe(done)
    assert "step ok" in done.stdout, M.describe(done)
    assert "weights equal True" in done.stdout, M.describe(done)
    grown = int(done.stdout.split("descriptors grown")[1].split()[0])
    assert grown <= 64, f"{grown} descriptors for 1200 managed tensors\n{M.describe(done)}"
