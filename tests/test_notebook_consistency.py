"""The committed notebooks agree with each other: a timing shown in one notebook is the timing the same
configuration shows in another, and no notebook shows a speed-up that lesson 7's sweep contradicts.

Notebooks record every run in a machine-readable output (nbhelpers.RECORD_MIME: what ran, how long, how many
cores other programs used meanwhile, and the throughput read from the run's metrics), so nothing here parses
prose.  A notebook built on a busy machine shows timings that say nothing about the lessons (a 2-thread
process waits for a descheduled thread in every parallel region: lesson 2's quick run took 18 s instead of
0.3 s once); these checks catch it.  Fast: reads JSON, imports no torch.

The limits:
- THROUGHPUT_FACTOR: the same configuration (model, batch per rank, world size, device, and how gradients
  are synchronized: lesson 4's per-parameter all_reduce moves the same bytes in 4 messages where DDP sends 1)
  differs by at most 2x in samples/s between notebooks 2, 3, 4, 6 and 7;
- SPEEDUP_FACTOR: a notebook that runs 1 and 2 ranks of the same model on the same device (notebook 4:
  lesson 2 on the global batch against lesson 4) shows a speed-up of 2 ranks at most 2x lesson 7's for that
  model.  One-sided: lesson 4 syncs per parameter and lesson 2 runs a larger batch, so on an idle machine
  notebook 4's ratio is lower than lesson 7's (0.11x against 0.56x, measured on the 2-core VM, 2026-11-24);
  a busy machine slows the 2-thread single process most and makes 2 ranks look faster (9.5x once);
- BUSY_CORES: no run started or ended while other programs kept more than half a core busy.
"""
import json
import sys
from itertools import combinations
from pathlib import Path

import nbformat
import pytest

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = REPO / "notebooks"
sys.path.insert(0, str(NOTEBOOKS))
from nbhelpers import RECORD_MIME  # noqa: E402  (nbhelpers imports matplotlib, not torch)

THROUGHPUT_FACTOR = 2.0
SPEEDUP_FACTOR = 2.0
BUSY_CORES = 0.5
TIMED = ["2_mnist_training", "3_mnist_distributed", "4_mnist_manual_ddp", "6_mnist_ddp_pt",
         "7_mnist_ddp_pt_timing"]


def records(nb) -> list:
    """Every record a notebook's outputs hold, in order."""
    return [o["data"][RECORD_MIME] for c in nb["cells"] if c["cell_type"] == "code"
            for o in c.get("outputs", []) if RECORD_MIME in o.get("data", {})]


def load(names=None, where=NOTEBOOKS) -> dict:
    names = names or sorted(p.stem for p in where.glob("*.ipynb"))
    return {n: records(nbformat.read(where / f"{n}.ipynb", as_version=4)) for n in names}


def config(result) -> tuple:
    sync = result.get("sync") or ("none" if result["world_size"] == 1 else "ddp")  # lessons 6 and 7: DDP
    return (result["model"], result["batch_per_rank"], result["world_size"], result["device"], sync)


def results(recs: dict) -> list:
    """[(notebook, result)] of every recorded throughput."""
    return [(name, r["result"]) for name, rs in recs.items() for r in rs
            if r.get("result", {}).get("samples_per_second")]


def throughput_mismatches(recs: dict, factor=THROUGHPUT_FACTOR) -> list:
    """Pairs of runs of one configuration, in different notebooks, whose samples/s differ by more than factor."""
    found = results({n: recs[n] for n in recs if n in TIMED})
    bad = []
    for (n1, a), (n2, b) in combinations(found, 2):
        if n1 != n2 and config(a) == config(b):
            ratio = max(a["samples_per_second"], b["samples_per_second"]) / min(a["samples_per_second"],
                                                                                  b["samples_per_second"])
            if ratio > factor:
                bad.append(f"{config(a)}: {n1} {a['samples_per_second']:.0f} samples/s ({a['lesson']}) vs "
                           f"{n2} {b['samples_per_second']:.0f} ({b['lesson']}): {ratio:.1f}x")
    return bad


def compared_configs(recs: dict) -> set:
    found = results({n: recs[n] for n in recs if n in TIMED})
    return {config(a) for (n1, a), (n2, b) in combinations(found, 2) if n1 != n2 and config(a) == config(b)}


def sweep_speedups(recs: dict) -> dict:
    """{(model, device): speed-up of 2 ranks over 1} from lesson 7's recorded table."""
    return {(r["model"], r["device"]): r["speedup"] for _, r in results({"7": recs.get("7_mnist_ddp_pt_timing", [])})
            if r["world_size"] == 2 and r.get("speedup")}


def speedup_contradictions(recs: dict, factor=SPEEDUP_FACTOR) -> list:
    """Notebooks (other than 7) with a 1-rank and a 2-rank run of one model on one device whose speed-up
    exceeds lesson 7's by more than factor."""
    sweep, bad = sweep_speedups(recs), []
    for name in recs:
        if name == "7_mnist_ddp_pt_timing":
            continue
        mine = results({name: recs[name]})
        for _, two in mine:
            if two["world_size"] != 2 or (two["model"], two["device"]) not in sweep:
                continue
            for _, one in mine:
                if (one["world_size"], one["model"], one["device"]) == (1, two["model"], two["device"]):
                    shown = two["samples_per_second"] / one["samples_per_second"]
                    expected = sweep[(two["model"], two["device"])]
                    if shown > expected * factor:
                        bad.append(f"{name}: 2 ranks of {two['lesson']} run {shown:.2f}x as fast as 1 process of "
                                   f"{one['lesson']} ({two['model']}, {two['device']}), lesson 7's sweep: "
                                   f"{expected:.2f}x")
    return bad


def busy_runs(recs: dict, cores=BUSY_CORES) -> list:
    return [f"{name}: {' '.join([r['script'], *r['args']])}: other programs used {r['other_cores_around']} cores"
            for name, rs in recs.items() for r in rs if r.get("other_cores_around", 0) > cores]


# ------------------------------------------------------------------------------------------ the committed notebooks

@pytest.fixture(scope="module")
def committed():
    return load()


def test_the_timed_notebooks_record_their_runs(committed):
    missing = [n for n in TIMED if not results({n: committed[n]})]
    assert not missing, (f"no recorded throughput in {missing}: rebuild them on an idle machine "
                         f"(python notebooks/build_notebooks.py {' '.join(m.split('_')[0] for m in missing)})")
    assert {("mlp", 64, 1, "cpu", "none"), ("mlp", 64, 2, "cpu", "ddp"), ("mlp", 64, 2, "cpu", "per-param")} \
        <= compared_configs(committed) or any(c[3] == "cuda" for c in compared_configs(committed)), \
        "the MLP at batch 64 with 1 and 2 ranks appears in at least two notebooks each"


def test_the_same_configuration_shows_the_same_throughput_in_every_notebook(committed):
    assert throughput_mismatches(committed) == []


def test_no_notebook_shows_a_speed_up_that_lesson_7_contradicts(committed):
    assert sweep_speedups(committed), "notebook 7 records its sweep"
    assert speedup_contradictions(committed) == []


def test_the_notebooks_were_built_on_an_idle_machine(committed):
    assert busy_runs(committed) == []


# ------------------------------------------------------------------------------------------ the checks can fail

def _record(lesson, model, batch, world, sps, speedup=None, other=0.0, sync=None):
    result = {"lesson": lesson, "model": model, "batch_per_rank": batch, "world_size": world, "device": "cpu",
              "samples_per_second": sps, "speedup": speedup, "sync": sync}
    return {"script": f"day1/{lesson}.py", "args": [], "other_cores_around": other, "result": result}


def busy_build() -> dict:
    """The results the notebooks showed when they were built next to other work (samples/s from their
    outputs): lesson 2's 1-process run 60x slower than lesson 3's, and a 10x speed-up in notebook 4."""
    return {
        "2_mnist_training": [_record("2_mnist_training", "mlp", 64, 1, 697, other=1.6)],
        "3_mnist_distributed": [_record("3_mnist_distributed", "mlp", 64, 1, 64000)],
        "4_mnist_manual_ddp": [_record("4_mnist_manual_ddp", "mlp", 64, 2, 9846, sync="per-param"),
                               _record("2_mnist_training", "mlp", 128, 1, 1034)],
        "6_mnist_ddp_pt": [_record("6_mnist_ddp_pt", "mlp", 64, 2, 9540),
                           _record("4_mnist_manual_ddp", "mlp", 64, 2, 8420, sync="per-param")],
        "7_mnist_ddp_pt_timing": [_record("7_mnist_ddp_pt_timing", "mlp", 64, 1, 41830, 1.0),
                                  _record("7_mnist_ddp_pt_timing", "mlp", 64, 2, 23306, 0.557)],
    }


def test_a_busy_build_is_caught():
    recs = busy_build()
    mismatches = throughput_mismatches(recs)
    assert any("2_mnist_training 697" in m for m in mismatches)
    assert any("6_mnist_ddp_pt" in m and "7_mnist_ddp_pt_timing" in m for m in mismatches)  # 2.4x
    contradictions = speedup_contradictions(recs)
    assert len(contradictions) == 1 and contradictions[0].startswith("4_mnist_manual_ddp: 2 ranks")
    assert busy_runs(recs) == ["2_mnist_training: day1/2_mnist_training.py: other programs used 1.6 cores"]


def test_an_idle_build_passes():
    recs = busy_build()
    recs["2_mnist_training"] = [_record("2_mnist_training", "mlp", 64, 1, 52000)]
    recs["4_mnist_manual_ddp"] = [_record("4_mnist_manual_ddp", "mlp", 64, 2, 14000, sync="per-param"),
                                  _record("2_mnist_training", "mlp", 128, 1, 64000)]
    recs["6_mnist_ddp_pt"] = [_record("6_mnist_ddp_pt", "mlp", 64, 2, 25000),
                              _record("4_mnist_manual_ddp", "mlp", 64, 2, 12000, sync="per-param")]
    assert throughput_mismatches(recs) == [] and speedup_contradictions(recs) == [] and busy_runs(recs) == []
    assert {("mlp", 64, 1, "cpu", "none"), ("mlp", 64, 2, "cpu", "ddp"), ("mlp", 64, 2, "cpu", "per-param")} \
        <= compared_configs(recs)


def test_records_are_read_from_a_notebook_file(tmp_path):
    """The whole path: a record as nbhelpers displays it, written to a notebook file, read back."""
    nb = nbformat.v4.new_notebook()
    record = _record("2_mnist_training", "mlp", 64, 1, 697)
    nb.cells = [nbformat.v4.new_code_cell("run_lesson(...)", outputs=[
        nbformat.v4.new_output("display_data", data={RECORD_MIME: record, "text/plain": ""})])]
    nbformat.write(nb, tmp_path / "2_mnist_training.ipynb")
    assert load(where=tmp_path) == {"2_mnist_training": [record]}
