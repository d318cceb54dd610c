"""bench.py --quick: every bench produces rows of the documented shape, and the table and
bench.json agree. Speeds are measured by bench.py, never asserted here."""
import json

import bench
from conftest import shared_data


def test_quick_bench_writes_its_table(prepared, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("NANOMLM_RAW", str(shared_data()))  # the sampler reads UD treebanks there
    out = tmp_path / "bench.json"
    rows = bench.main(["--quick", "--device", "cpu", "--data", str(prepared), "--objectives",
                       "mlm,kd+mlm,mlsm+mlm", "--profile", "--out", str(out)])
    text = capsys.readouterr().out
    saved = json.loads(out.read_text())
    assert saved["rows"] == json.loads(json.dumps(rows)) and saved["device"] == "cpu"
    benches = [r["bench"] for r in rows]
    for name in ("step", "ltg", "attn", "ema", "pll", "sparse", "sampler", "compile"):
        assert name in benches
    assert [r["case"].split()[0] for r in rows if r["bench"] == "step"] == ["mlm", "kd+mlm",
                                                                           "mlsm+mlm"]
    table = [line for line in text.splitlines() if line.startswith("| ")]
    assert len(table) == 1 + len(rows)                                   # header + one line per row
    for r, line in zip(rows, table[1:]):
        assert line.count("|") == 9 and r["case"] in line
        assert r["min"] <= r["ours"] <= r["max"] and r["ours"] > 0
        if r["ref"] is not None:
            assert r["ratio"] == r["ours"] / r["ref"]
    kd = next(r for r in rows if r["case"].startswith("kd"))
    assert kd["reference"] == "mlm" and kd["peak_mem_gb"] > 0 and kd["recompiles"] == 0  # eager
    mlsm = next(r for r in rows if r["case"].startswith("mlsm"))
    assert mlsm["coder_ms"] > 0 and mlsm["code_share"] > 0 and "code_share" not in kd
    pll = next(r for r in rows if r["bench"] == "pll")
    assert pll["max_abs_diff"] < 1e-3                                    # batched and naive agree
    for ops in [o for models in saved["profiles"].values() for o in models.values()]:
        assert ops and sum(o["share"] for o in ops) <= 1 + 1e-9 and "ms" in ops[0]
    assert any(k.startswith("ltg") for k in saved["profiles"])
    ltg = next(r for r in rows if r["bench"] == "ltg")
    assert ltg["max_abs_diff"] < 1e-4                # the same function as LTG-BERT's own code
    compiled = next(r for r in rows if r["bench"] == "compile")
    assert compiled["max_abs_diff"] < 1e-6     # tensor and float momentum: the same codes
    attn = [r for r in rows if r["bench"] == "attn"]  # the CPU's variants compute the same thing
    assert attn and all(r.get("max_abs_diff", 1) < 1e-4 for r in attn)


def test_docs_tables_are_generated_from_their_json():
    """docs/bench.md (today's) and docs/bench_log.md (earlier) paste `bench.py --table` of each
    docs/bench/*.json: edit one, regenerate."""
    doc = "".join((bench.REPO / "docs" / name).read_text() for name in ("bench.md", "bench_log.md"))
    saved = sorted((bench.REPO / "docs" / "bench").glob("*.json"))
    assert saved
    for path in saved:
        assert bench.table(json.loads(path.read_text())) in doc, f"regenerate from {path.name}"


def test_every_row_is_written_as_it_is_measured(tmp_path, monkeypatch):
    """A bench cut off midway (a device call's time limit, a crash) leaves the rows measured
    before it in bench.json."""
    def breaks(args, device, tmp):
        yield bench.row("broken", "first", "things/s", [1.0, 2.0, 3.0])
        raise KeyboardInterrupt  # what a time limit's signal would do
    monkeypatch.setitem(bench.BENCHES, "broken", breaks)
    out = tmp_path / "bench.json"
    try:
        bench.main(["--quick", "--device", "cpu", "--only", "ema,broken", "--out", str(out)])
    except KeyboardInterrupt:
        pass
    rows = json.loads(out.read_text())["rows"]
    assert [r["bench"] for r in rows] == ["ema", "broken"] and rows[1]["ours"] == 2.0
