"""Every benchmark the docs name still starts: its imports resolve against today's code and
its command line parses (the benchmarks themselves take minutes and run by hand); every dated
result file says its command, commit and machine, and the docs' benchmark page links it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
# The scripts (a module the scripts import, such as goodput_scaled.py, has no main of its own).
SCRIPTS = sorted(p.name for p in BENCHMARKS.glob("*.py")
                 if 'if __name__ == "__main__":' in p.read_text())


REPO = BENCHMARKS.parent
RESULTS = BENCHMARKS / "results"
BENCHMARK_PAGE = REPO / "docs" / "benchmarks" / "index.md"
# What the docs name: the benchmark page, the dated result files, and every other docs page.
DOCS = sorted({*(REPO / "docs").rglob("*.md"), *RESULTS.glob("*.md"), REPO / "README.md"})


def test_the_benchmarks_are_found() -> None:
    assert "ingest.py" in SCRIPTS and "goodput.py" in SCRIPTS, SCRIPTS


def test_every_benchmark_the_docs_name_is_a_script_that_is_checked() -> None:
    """A ``benchmarks/NAME.py`` in the docs or a result file exists and is one of the scripts
    ``test_benchmark_starts`` runs (or a module one of them imports, as goodput_scaled.py)."""
    named = {(doc, m) for doc in DOCS
             for m in re.findall(r"benchmarks/([A-Za-z0-9_]+\.py)", doc.read_text())}
    assert {m for _, m in named} >= {"ingest.py", "goodput.py", "detection.py", "storage.py",
                                      "failover.py", "worker_overhead.py"}, named
    for doc, m in sorted(named):
        assert (BENCHMARKS / m).exists(), f"{doc.relative_to(REPO)} names benchmarks/{m}"
        imported = any(f"import {m[:-3]}" in (BENCHMARKS / s).read_text() for s in SCRIPTS)
        assert m in SCRIPTS or imported, f"{doc.relative_to(REPO)}: {m} is not a script"


RESULT_NAME = re.compile(r"^(\d{4})-(\d{2})-(\d{2})-[a-z0-9-]+\.md$")


def test_the_result_files_are_dated_and_say_their_command_commit_and_machine() -> None:
    files = sorted(RESULTS.glob("*"))
    assert files, "no result files in benchmarks/results"
    page = BENCHMARK_PAGE.read_text()
    for f in files:
        assert RESULT_NAME.match(f.name), f"{f.name}: not YYYY-MM-DD-name.md"
        text = f.read_text()
        y, mo, d = RESULT_NAME.match(f.name).groups()  # type: ignore[union-attr]
        assert f"- **Date**: {y}-{mo}-{d}" in text, f"{f.name}: no date matching its name"
        assert re.search(r"^- \*\*Command\*\*:\s*\n+\s*```sh\n\s*\S", text, re.M), (
            f"{f.name}: no command")
        assert re.search(r"^- \*\*Commit\*\*: `[0-9a-f]{7,40}`", text, re.M), (
            f"{f.name}: no commit")
        assert re.search(r"^- \*\*Machine\*\*: \S", text, re.M), f"{f.name}: no machine"
        assert f"(results/{f.name})" in page, f"the benchmark page does not link {f.name}"


@pytest.mark.parametrize("script", SCRIPTS)
def test_benchmark_starts(script: str) -> None:
    proc = subprocess.run([sys.executable, str(BENCHMARKS / script), "--help"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage:" in proc.stdout, proc.stdout[-2000:]


def test_storage_benchmark_smoke() -> None:
    """The storage benchmark end to end on a tiny slice (a real supervisor for the RSS)."""
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "storage.py"), "--smoke"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "GB/day with" in proc.stdout, proc.stdout[-2000:]
    assert "supervisor RSS after 2,000 steps" in proc.stdout, proc.stdout[-2000:]


def test_ingest_load_generator_sends_what_step_items_describe() -> None:
    """The load generator's pre-formatted bodies are the batches ``step_items`` and
    ``heartbeat`` describe (same keys and fixed values, random ones in range), and the
    supervisor's schema accepts them."""
    import json

    bench = _ingest_bench()
    from trainwarden.supervisor.contract import wire

    body = bench.encode_batch(7, 3, 1000.5, 999.25, range(4, 6), node=2, world=64)
    got = json.loads(body)
    want_items = [*bench.step_items(4, 999.25, node=2, world=64),
                  *bench.step_items(5, 999.25, node=2, world=64), bench.heartbeat(999.25, 2)]
    assert {k: got[k] for k in ("agent_id", "seq", "sent_at", "attempt", "dropped")} == {
        "agent_id": 7, "seq": 3, "sent_at": 1000.5, "attempt": 0, "dropped": 0}
    assert len(got["items"]) == len(want_items) == 17
    random_keys = {"loss", "grad_norm", "data_s", "compute_s", "step_s", "cpu_percent"}
    for g, w in zip(got["items"], want_items, strict=True):
        assert g.keys() == w.keys()
        assert {k: v for k, v in g.items() if k not in random_keys | {"workers"}} == {
            k: v for k, v in w.items() if k not in random_keys | {"workers"}}
    steps = got["items"][:-1]
    assert all(0.002 <= s["data_s"] <= 0.005 and 0.95 <= s["step_s"] <= 0.98 for s in steps)
    assert all(2.4 < s["loss"] < 2.6 for s in steps)
    assert [w["rank"] for w in got["items"][-1]["workers"]] == list(range(16, 24))
    assert len({s["loss"] for s in steps}) > 1  # the values vary
    wire.IngestBatch.model_validate_json(body)


def _ingest_bench():  # type: ignore[no-untyped-def]
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import ingest as bench
    finally:
        sys.path.remove(str(BENCHMARKS))
    return bench


def test_ingest_load_generator_batches_at_each_nodes_phase_of_the_interval() -> None:
    """Nodes that read a longer interval in the same second keep spread over all of it (as
    the agent does): their next batches land at their phases, not one interval after the
    last one, all in the same second."""
    bench = _ingest_bench()
    n, interval = 400, 4.0
    nxt = [bench.next_slot(100.0 + i / n, interval, (i * 0.6180339887) % 1.0)
           for i in range(n)]
    assert all(100.0 < t <= 101.0 + interval for t in nxt)
    per_second = [sum(1 for t in nxt if s <= t - 100.0 < s + 1) for s in range(5)]
    assert max(per_second) <= 1.5 * n / interval, per_second
    assert bench.next_slot(103.0, interval, 0.25) == 107.0  # boundaries (k - 0.25) x 4
    # from a boundary, the next one: never the same time again (a node that sent at a
    # boundary which rounds to the slot before it would send again at once, forever)
    import random
    rng = random.Random(7)
    for _ in range(20_000):
        every, phase = rng.choice([1.0, 2.1, 4.0, 4.1]), rng.random()
        t = bench.next_slot(rng.uniform(1e5, 1e6), every, phase)
        assert bench.next_slot(t, every, phase) == pytest.approx(t + every), (t, every, phase)


def test_ingest_benchmark_checks_every_acknowledged_row_against_the_store(
        tmp_path: Path) -> None:
    """``check_stored`` counts an acknowledged row missing from the store and a row stored
    twice (a level with either has not met its target)."""
    bench = _ingest_bench()
    from trainwarden.supervisor.contract.wire import RegisterRequest
    from trainwarden.supervisor.store import migrate, registry
    from trainwarden.supervisor.store.db import make_database

    url = f"sqlite:///{tmp_path}/b.db"
    migrate.upgrade(url)
    db = make_database(url, pool_size=1)
    try:
        with db.write() as conn:
            reg = registry.register_agent(conn, req=RegisterRequest(run="r", node="n"),
                                          now=1000.0)
            rows = [{"run_id": reg["run_id"], "attempt": 0, "step": st, "rank": rank,
                     "t": 1000.0 + st} for rank in range(bench.RANKS) for st in range(3)]
            bench.bulk_insert_rank_steps(conn, rows=rows)
    finally:
        db.dispose()
    assert bench.check_stored(url, "r", {0: 3}) == (0, 0)
    assert bench.check_stored(url, "r", {0: 4}) == (bench.RANKS, 0)  # step 3 never stored
    db = make_database(url, pool_size=1)
    try:
        with db.write() as conn:
            bench.bulk_insert_rank_steps(conn, rows=rows[:1])
    finally:
        db.dispose()
    assert bench.check_stored(url, "r", {0: 3}) == (0, 1)


def test_ingest_benchmark_smoke() -> None:
    """A tiny level end to end: a real supervisor, every acknowledged row stored once."""
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "ingest.py"), "--db", "sqlite",
                           "--agents", "8", "--seconds", "3", "--warmup", "1"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    row = [ln for ln in proc.stdout.splitlines() if ln.startswith("sqlite ")][-1].split()
    assert row[-1] == "0/0", proc.stdout[-2000:]  # lost / doubled
    # The latency figure is reported (what it is depends on the machine and its load: it is
    # the benchmark's result, not something a smoke run can hold a machine to).
    assert "largest cluster with p99 < 100 ms:" in proc.stdout, proc.stdout[-2000:]


def test_spares_benchmark_smoke() -> None:
    """Two simulated days of the spares benchmark: every spare share has its row, and with
    no spare the node losses wait (ETTR below the run with a node always at hand)."""
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "spares.py"), "--days", "2",
                           "--seeds", "1", "--replace-h-also", "24", "--repair-days-also", ""],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows: dict[str, list[str]] = {}
    for ln in proc.stdout.splitlines():  # the first row of each: the default times
        if ln.startswith("| ") and "%" in ln:
            rows.setdefault(ln.split(" | ")[0].lstrip("| "), ln.split(" | "))
    assert {"a node always at hand", "0% (0)", "1% (20)", "2% (41)"} <= rows.keys(), rows
    ettr = {k: float(v[-2].rstrip("%")) for k, v in rows.items()}
    assert ettr["0% (0)"] < ettr["2% (41)"] <= ettr["a node always at hand"], ettr


def test_shrink_benchmark_smoke() -> None:
    """Two simulated days of the shrink benchmark: with the node back after 10 minutes and
    the measured restart, the run that shrinks keeps more of its time than the one that
    waits, and its slower steps show as capacity."""
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "shrink.py"), "--days", "2",
                           "--seeds", "1", "--return-min", "10"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    measured = proc.stdout.split("Restart measured:")[1].split("Restart 5 min:")[0]
    rows = {ln.split(" | ")[1]: ln.split(" | ") for ln in measured.splitlines()
            if ln.startswith("| ") and "%" in ln}
    assert {"node at hand", "wait", "shrink"} <= rows.keys(), proc.stdout[-2000:]
    ettr = {k: float(v[2].rstrip("%")) for k, v in rows.items()}
    assert ettr["wait"] < ettr["shrink"] <= ettr["node at hand"], ettr
    assert float(rows["shrink"][3].rstrip("%")) > 0.0 == float(rows["wait"][3].rstrip("%"))
    assert rows["shrink"][-1].startswith("shrink ("), rows["shrink"]
