"""plot.py: the curves it reads from a log, and a picture of two real tiny runs."""
import sys

import pytest

import plot
from conftest import TINY, run_trains


def test_curves_split_training_and_validation_records():
    records = [{"step": 5, "loss": 7.0, "acc": 0.1, "lr": 1e-3, "tok_per_s": 9e3},
               {"step": 5, "val_loss": 6.5, "val_acc": 0.2},
               {"step": 10, "loss": 6.0, "kd": 0.4, "grad_norm": 1.5},
               {"step": 7, "error": "non-finite loss or gradient"}]
    assert plot.curves(records) == {
        "loss": {"train": [(5, 7.0), (10, 6.0)], "val": [(5, 6.5)]},
        "acc": {"train": [(5, 0.1)], "val": [(5, 0.2)]},
        "kd": {"train": [(10, 0.4)], "val": []},
        "grad_norm": {"train": [(10, 1.5)], "val": []}}


def test_two_runs_make_one_png(prepared, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.axes import Axes
    ylabels = []
    draw = Axes.set_ylabel
    monkeypatch.setattr(Axes, "set_ylabel", lambda ax, text, **k: (ylabels.append(text),
                                                                   draw(ax, text, **k))[1])
    runs = [tmp_path / "mlm", tmp_path / "boot"]
    done = run_trains(*[("--objective", r.name, "--data", prepared, "--out-dir", r,
                         "--max-steps", 10, *TINY, "--eval-every", 5) for r in runs])
    assert all(p.returncode == 0 for p in done), [p.stderr for p in done]
    out = tmp_path / "figures" / "curves.png"
    plot.main([*map(str, runs), "--x", "tokens", "--out", str(out)])
    data = out.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000
    # every figure the two objectives log has a y-axis label saying what it is
    logged = {name for r in runs for name in plot.curves(plot.read_run(r)[0])}
    assert {"loss", "acc", "lb", "target_std"} <= logged and logged <= set(plot.LABELS)
    assert sorted(ylabels) == sorted(plot.LABELS[name] for name in logged)  # on the panels
    # an --out that cannot be written: one line naming it, no traceback
    with pytest.raises(SystemExit, match=r"^error: cannot write /proc/nanomlm/x.png: "):
        plot.main([*map(str, runs), "--out", "/proc/nanomlm/x.png"])


def test_without_matplotlib_it_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ImportError
    with pytest.raises(SystemExit, match="pip install -r requirements-figures.txt"):
        plot.plot([tmp_path], tmp_path / "x.png")
    with pytest.raises(SystemExit, match="is not a run folder"):
        plot.read_run(tmp_path)
    with pytest.raises(SystemExit, match=f"no run folder at {tmp_path / 'mistyped'}"):
        plot.read_run(tmp_path / "mistyped")


def test_lines_that_are_not_log_records_are_counted_and_said(tmp_path, capsys):
    """Issue 84: a garbled line (here a torn one, a bare number and a record without a step)
    was skipped without a word; it is still left out, and said."""
    (tmp_path / "args.json").write_text("{}")
    (tmp_path / "log.jsonl").write_text('{"step": 1, "loss": 7.0}\n{"step": 2, "lo\n5\n'
                                        '{"loss": 6.0}\n{"step": 3, "loss": 6.5}\n')
    records, _ = plot.read_run(tmp_path)
    assert [r["step"] for r in records] == [1, 3]
    assert capsys.readouterr().out == (f"note: {tmp_path / 'log.jsonl'}: 3 lines not a log record "
                                       f"(torn by a kill, or edited?) left out\n")


def test_an_out_without_its_kind_is_one_line(tmp_path, capsys):
    """--out curves (no extension): refused, where matplotlib wrote curves.png and plot.py said
    "wrote curves"."""
    with pytest.raises(SystemExit) as e:
        plot.main([str(tmp_path), "--out", str(tmp_path / "curves")])
    assert e.value.code == 2 and "name the file with its kind" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
