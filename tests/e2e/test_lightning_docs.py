"""The Lightning snippet of the framework page (docs/integrations/frameworks.md) run as it is
written, under a real ``torchrun --nproc_per_node=2`` on this CPU machine: only what the page
leaves to the user (``module``, ``train_ds``, ``ckpt_dir``, ``N``) is defined around it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.e2e.torchrun import REPO, TORCHRUN, worker_env

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

PAGE = REPO / "docs" / "integrations" / "frameworks.md"

# What the snippet leaves to the user.
BEFORE = '''\
import sys

import lightning as L
import torch

ckpt_dir, N = sys.argv[1], 60


class Module(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


torch.set_num_threads(1)
torch.manual_seed(0)
module = Module()
g = torch.Generator().manual_seed(0)
train_ds = torch.utils.data.TensorDataset(torch.randn(512, 4, generator=g),
                                          torch.randn(512, 1, generator=g))
# ---- the page's snippet, as written ----
'''

AFTER = '''
# ---- what the run did ----
import json
import torch.distributed as dist

with open(f"{sys.argv[2]}.rank{dist.get_rank()}.json", "w") as f:
    json.dump({"world_size": trainer.world_size, "global_step": trainer.global_step,
               "num_nodes": trainer.num_nodes, "devices": trainer.num_devices}, f)
'''


def lightning_snippet() -> str:
    """The first Python block after the page's "## PyTorch Lightning" heading."""
    text = PAGE.read_text()
    section = text[text.index("## PyTorch Lightning"):]
    block = section[section.index("```python\n") + len("```python\n"):]
    return block[:block.index("```")]


def test_the_lightning_snippet_runs_as_written_under_torchrun_with_two_ranks(
        tmp_path: Path) -> None:
    snippet = lightning_snippet()
    assert "trainer.fit(" in snippet and "tw.ckpt_path()" in snippet
    script = tmp_path / "train.py"
    script.write_text(BEFORE + snippet + AFTER)
    out = tmp_path / "result"
    proc = subprocess.run(
        [TORCHRUN, "--nproc_per_node=2", "--standalone", "--monitor-interval=0.1", str(script),
         str(tmp_path / "ck"), str(out)],
        cwd=tmp_path, env=worker_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    for rank in (0, 1):
        result = json.loads(Path(f"{out}.rank{rank}.json").read_text())
        assert result == {"world_size": 2, "global_step": 60, "num_nodes": 1, "devices": 2}
    # The snippet's checkpoint (every 50 steps) was written and completed by both ranks.
    assert (tmp_path / "ck" / "step_50" / "trainwarden.json").is_file()
