"""The "Running under Slurm" page's local cluster is the one the tests start (tests/slurm.py):
its slurm.conf, its daemons' command lines, and shell that parses."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from tests.slurm import config

PAGE = Path(__file__).resolve().parents[2] / "docs" / "operations" / "slurm.md"


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", PAGE.read_text(), re.S)


def test_the_pages_slurm_conf_is_the_test_clusters() -> None:
    (conf,) = _blocks("ini")
    assert conf == config(Path("/tmp/tw-slurm"))


def test_the_pages_commands_are_the_fixtures_and_parse() -> None:
    shell = "\n".join(_blocks("sh"))
    for line in ("mungekey --create --keyfile $D/munge.key",
                 "slurmctld -i -f $SLURM_CONF",
                 "for n in tw0 tw1 tw2; do slurmd -N $n -f $SLURM_CONF; done",
                 "apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge"):
        assert line in shell, line
    assert "sbatch --nodes=3 --gpus-per-node=0 --cpus-per-task=1" in shell
    for block in _blocks("sh"):
        r = subprocess.run(["bash", "-n"], input=block, capture_output=True, text=True)
        assert r.returncode == 0, (block, r.stderr)
