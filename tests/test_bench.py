"""bench.py --quick: every bench produces rows of the documented shape, and the table and
bench.json agree. Speeds are measured by bench.py, never asserted here."""
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import bench
from benchmarks import timing
from conftest import shared_data


def test_quick_bench_writes_its_table(prepared, tmp_path, capsys, monkeypatch, warm_executable):
    monkeypatch.setenv("NANOMLM_RAW", str(shared_data()))  # the sampler reads UD treebanks there
    out = tmp_path / "bench.json"
    rows = bench.main(["--quick", "--device", "cpu", "--data", str(prepared), "--objectives",
                       "mlm,kd+mlm,mlsm+mlm,gpt-bert", "--profile", "--out", str(out)])
    text = capsys.readouterr().out
    saved = json.loads(out.read_text())
    assert saved["rows"] == json.loads(json.dumps(rows)) and saved["device"] == "cpu"
    benches = [r["bench"] for r in rows]
    for name in ("step", "side", "ltg", "attn", "ema", "pll", "sparse", "sampler", "compile"):
        assert name in benches
    side = [r for r in rows if r["bench"] == "side"]  # 1 run, then 2 side by side
    assert [r["case"].split(" x ")[0] for r in side] == ["1", "2"] and side[1]["ref"] == side[0][
        "ours"] and all(0 < r["overhead_s"] <= r["wall_s"] for r in side)
    steps = [r for r in rows if r["bench"] == "step"]
    assert [r["case"].split()[0] for r in steps] == ["mlm", "kd+mlm", "mlsm+mlm", "gpt-bert"]
    assert all(r["wall_s"] > 0 for r in steps)
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
    bert = [r for r in rows if r["bench"] == "bert"]  # ours against BERT, profiled with it
    # (rows only where transformers is installed: requirements-export.txt)
    assert bool(bert) == bool(importlib.util.find_spec("transformers"))
    assert all(r["reference"] == "BertForMaskedLM" for r in bert)
    assert all(set(saved["profiles"][f"bert: {r['case']}"]) == {"ours", "BertForMaskedLM"}
               for r in bert)
    attn = [r for r in rows if r["bench"] == "attn"]  # the CPU's variants compute the same thing
    assert attn and all(r.get("max_abs_diff", 1) < 1e-4 for r in attn)


def test_docs_tables_are_generated_from_their_json():
    """docs/bench.md (today's) and docs/bench_log.md (earlier) paste `bench.py --table` of each
    docs/bench/*.json: edit one, regenerate."""
    doc = "".join((bench.REPO / "docs" / name).read_text() for name in ("bench.md", "bench_log.md"))
    saved = sorted((bench.REPO / "docs" / "bench").glob("*.json"))
    assert saved
    for path in saved:
        assert timing.table(json.loads(path.read_text())) in doc, f"regenerate from {path.name}"


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


def test_a_failing_row_is_recorded_and_the_other_rows_go_on(prepared, tmp_path, monkeypatch,
                                                            warm_executable):
    """A train.py run that fails is a row with its error's last lines, and the next objective
    runs; a bench that raises is a row too, and the next bench runs; bench.py exits non-zero
    only after writing them all."""
    def breaks(args, device, tmp):
        yield bench.row("broken", "first", "things/s", [1.0, 2.0, 3.0])
        raise RuntimeError("the second row broke")
    monkeypatch.setitem(bench.BENCHES, "broken", breaks)
    out = tmp_path / "bench.json"
    with pytest.raises(SystemExit, match="2 of 6 rows failed: step nonsense"):
        bench.main(["--quick", "--device", "cpu", "--data", str(prepared), "--only",
                    "step,broken,ema", "--objectives", "mlm,nonsense,kd+mlm", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["bench"], r["case"].split()[0]) for r in rows] == [
        ("step", "mlm"), ("step", "nonsense"), ("step", "kd+mlm"), ("broken", "first"),
        ("broken", "after"), ("ema", rows[-1]["case"].split()[0])]
    assert "invalid choice: 'nonsense'" in rows[1]["failed"] and rows[1]["ours"] is None
    assert rows[2]["ratio"] > 0 and "failed" not in rows[2]      # kd+mlm ran, against mlm
    assert rows[4]["failed"].startswith("RuntimeError: the second row broke")
    assert "| step | nonsense tiny 4x32 | failed |" in timing.table(json.loads(out.read_text()))


@pytest.mark.parametrize("size", ["tiny", "small"])
def test_flops_per_token_counts_what_torch_counts(size):
    """MFU's numerators against torch's own count of one training step's matrix FLOPs
    (FlopCounterMode: matmuls, attention): ours with the head on C predicted slots, and
    BertForMaskedLM, exactly (both count 2 per multiply-add and a backward of twice the
    forward)."""
    from torch.utils.flop_counter import FlopCounterMode
    from data.masking import predicted_slots
    from benchmarks.models import bert_flops_per_token, flops_per_token, mlm_batch
    from model import PRESETS, Encoder, ModelConfig
    B, T, V = 2, 64, 1000
    cfg = ModelConfig(**PRESETS[size], vocab_size=V)
    ids, masked, inp, att = mlm_batch(B, T, torch.device("cpu"))
    ids, inp = ids % V, inp % V
    labels = torch.where(masked, ids, -100)
    slots = predicted_slots(labels, int(masked.sum()) + 7)                     # 7 padding slots
    with FlopCounterMode(display=False) as counted:
        _, logits = Encoder(cfg)(inp, att, predict=slots)
        F.cross_entropy(logits, labels.flatten()[slots], ignore_index=-100).backward()
    assert counted.get_total_flops() == flops_per_token(cfg, T, len(slots) / (B * T), B * T) * B * T
    transformers = pytest.importorskip("transformers")
    bert = transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=V, hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head, intermediate_size=cfg.d_ff))
    with FlopCounterMode(display=False) as counted:
        bert(input_ids=inp, attention_mask=att, labels=labels).loss.backward()
    assert counted.get_total_flops() == bert_flops_per_token(cfg, T) * B * T


def test_a_bench_stopped_by_sigterm_stops_its_train_run(prepared, tmp_path):
    """A time limit's SIGTERM reaches bench.py alone (its train.py runs in a session of their
    own, with their compile workers); bench.py takes its running train.py down with it, so no
    run outlives the part of gpu_check.sh that started it."""
    p = subprocess.Popen([sys.executable, "bench.py", "--device", "cpu", "--only", "step",
                          "--sizes", "tiny", "--batch-size", "4", "--seq-len", "32", "--steps",
                          "100000", "--data", str(prepared), "--out", str(tmp_path / "b.json")],
                         cwd=bench.REPO, env={**os.environ, "TMPDIR": str(tmp_path)},
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t0 = time.time()
    while not list(tmp_path.glob("*/mlm_tiny/args.json")):  # train.py has begun its run
        assert p.poll() is None and time.time() - t0 < 120
        time.sleep(0.2)
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=60) == 128 + signal.SIGTERM
    running = [c for c in Path("/proc").glob("[0-9]*/cmdline") if str(tmp_path) in
               c.read_bytes().decode(errors="replace")] if Path("/proc").is_dir() else []
    assert not running


def test_an_out_that_cannot_be_written_is_one_line_before_any_bench(tmp_path, capsys):
    """Issue 83's sibling: an --out under a file failed at the first row's write, after that
    bench had run (a failed row, then a traceback); a folder, the same. Both one line now."""
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as stopped:
        bench.main(["--out", str(tmp_path / "file" / "b.json"), "--device", "cpu"])
    assert str(stopped.value).startswith(f"error: cannot write {tmp_path / 'file' / 'b.json'}: ")
    with pytest.raises(SystemExit) as stopped:
        bench.main(["--out", str(tmp_path), "--device", "cpu"])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and err.count("\n") == 1, err
    assert f"--out {tmp_path} is a folder; give the rows' file path" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_bert_rows_are_one_per_form_and_bert_is_built_once(tmp_path, monkeypatch):
    """bench.py --only bert with several --attention forms (the speed tier's forms part): a row
    per form in the order given, each against BertForMaskedLM, BERT built once for all of them
    (its first step on the first row alone) and each form profiled with it. The timings are
    stood in (alternate, profile_ops: measured, not asserted, here)."""
    pytest.importorskip("transformers")
    from benchmarks import models
    built = []
    real_bert = __import__("transformers").BertForMaskedLM
    monkeypatch.setattr("transformers.BertForMaskedLM",
                        lambda cfg: built.append(cfg) or real_bert(cfg))
    monkeypatch.setattr(models, "alternate", lambda a, b, *rest: ([2.0] * 3, [1.0] * 3))
    monkeypatch.setattr(models, "profile_ops", lambda fn, device, steps: [
        {"op": "stood in", "ms": 1.0, "calls": 1, "share": 1.0}])
    out = tmp_path / "forms.json"
    rows = bench.main(["--quick", "--device", "cpu", "--only", "bert", "--attention",
                       "gather,gather-fp32,onehot", "--profile", "2", "--out", str(out)])
    assert [r["form"] for r in rows] == ["gather", "gather-fp32", "onehot"] and len(built) == 1
    assert all(r["reference"] == "BertForMaskedLM" and r["ratio"] == 2.0 for r in rows)
    assert rows[0]["ref_first_step_s"] > 0 and rows[1]["ref_first_step_s"] is None
    assert all(r["first_step_s"] > 0 for r in rows)
    profiles = json.loads(out.read_text())["profiles"]
    assert list(profiles) == [f"bert: {r['case']}" for r in rows]
    assert all(set(p) == {"ours", "BertForMaskedLM"} for p in profiles.values())


@pytest.mark.parametrize("graphs,scope,form,name", [
    (None, "model", "gather", ""), (True, "model", "gather", " cuda-graphs"),
    (None, "layers", "onehot", " onehot compiled by layer")])
def test_a_timed_run_is_named_by_what_it_changes(graphs, scope, form, name):
    """The step rows' names (the speed tier's step, graphs and layers runs) and the train.py
    flags they time."""
    args = bench.get_args(["--device", "cpu", "--only", "step", "--compile-scope", scope,
                           "--attention", form] + ["--cuda-graphs"] * bool(graphs))
    assert bench.run_variant(args, form) == name
    flags = bench.train_flags(args, torch.device("cpu"), "mlm", "tiny", "out")
    assert flags[flags.index("--attention") + 1] == form
    assert flags[flags.index("--compile-scope") + 1] == scope
    assert ("--cuda-graphs" in flags) == bool(graphs)


@pytest.mark.parametrize("text,says", [("not json", "not a bench.py result"),
                                       ('{"rows": 3}', "not a bench.py result"), (None, "No such")])
def test_a_table_that_is_not_a_result_is_one_line(tmp_path, text, says):
    f = tmp_path / "t.json"
    if text is not None:
        f.write_text(text)
    with pytest.raises(SystemExit) as e:
        bench.main(["--table", str(f)])
    assert str(e.value).startswith(f"error: --table {f}: {says}")
