"""Every command in the README runs as written (issue 43), checked cheaply: train.py's,
evaluate.py's and export.py's flags are parsed by their own parsers (train.py's resolved as
`--check` does), study.py's `--dry-run` runs whole, and the other scripts' flags are ones their
--help lists."""
import json
import re
import shlex

import pytest

import evaluate
import export
import objectives
import train
from conftest import REPO, run_script, shared_data
from studies import first_screen


def readme_commands(blocks=None) -> list[tuple[dict, list[str]]]:
    """(environment, argv) of each `python SCRIPT.py ...` line of the README's bash blocks (the
    first `blocks` of them, or all), with their continuation lines joined, comments cut and
    shell variables (E=...; C=...) put in."""
    text = (REPO / "README.md").read_text()
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S)[:blocks]:
        variables = {}
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].split("   #")[0].strip()
            if re.fullmatch(r"(export )?\w+=\S+(; ?\w+=\S+)*", line):
                for k, v in re.findall(r"(\w+)=([^;\s]+)", line):
                    variables[k] = v
                continue
            line = re.sub(r"\$\((.*?)\)", "", line)  # $(...): the cluster example's optional flag
            line = re.sub(r"\$(\w+)", lambda m: variables.get(m.group(1), m.group(0)), line)
            words = shlex.split(line)
            env = {}
            while words and re.fullmatch(r"\w+=\S*", words[0]):
                k, v = words.pop(0).split("=", 1)
                env[k] = v
            if len(words) > 1 and words[0] == "python" and words[1].endswith(".py"):
                out.append(({**{k: v for k, v in variables.items() if k.isupper()}, **env},
                            words[1:]))
    return out


COMMANDS = readme_commands()


def test_the_readme_has_commands_of_every_script():
    assert {argv[0] for _, argv in COMMANDS} >= {"train.py", "evaluate.py", "study.py",
                                                 "export.py", "synth.py", "meta.py", "plot.py"}


@pytest.mark.parametrize("env, argv", COMMANDS, ids=[" ".join(a)[:60] for _, a in COMMANDS])
def test_each_readme_command_runs_as_written(env, argv, capsys):
    script, args = argv[0], argv[1:]
    if script == "train.py":
        resolved = train.get_args(args)  # as --check resolves them: the defaults applied
        assert resolved.objective in objectives.OBJECTIVES
    elif script == "evaluate.py" and args[0] == "compare":  # on committed results: runs whole
        evaluate.main(args)
        assert "verdict, B against A" in capsys.readouterr().out
    elif script == "evaluate.py":
        evaluate.build_parser().parse_args(args)
    elif script == "export.py":
        export.build_parser().parse_args(args)
    elif script == "study.py" and "--dry-run" in args:
        shared_data()  # one clear failure if ../shared is not beside the repository
        if "NANOMLM_RAW" in env:
            env["NANOMLM_RAW"] = str((REPO / env["NANOMLM_RAW"]).resolve())
        p = run_script(*argv, env=env, timeout=300)
        assert p.returncode == 0, p.stderr[-2000:]
    else:  # the rest would train or sample for long: their flags are ones they have
        said = run_script(script, "--help", timeout=120).stdout
        assert said, f"{script} --help printed nothing"
        for flag in (a.split("=")[0] for a in args if a.startswith("--")):
            assert flag in said, f"{script} has no {flag}"


def test_the_cpu_demo_runs_end_to_end(small_raw, tmp_path):
    """The first screen's CPU demo, every command of its first block, run in order in a fresh
    folder, reduced: --max-steps 1100 -> 30 and the tests' small corpus as babylm_10m (under a
    2000-piece tokenizer). Each must exit 0; then the run, its fill-in, its evaluation, its
    curves and its export are where the README says."""
    demo = [argv for _, argv in readme_commands(blocks=1)]
    assert [a[0] for a in demo] == ["train.py", "evaluate.py", "evaluate.py", "plot.py",
                                    "export.py"], demo
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "babylm_10m").symlink_to(small_raw)
    env = {"NANOMLM_RAW": str(tmp_path / "raw"),
           "NANOMLM_DATA": str(tmp_path / "prepared"), "OMP_NUM_THREADS": "1"}
    for argv in demo:
        argv = [a.replace("runs/", f"{tmp_path}/runs/").replace("hf/", f"{tmp_path}/hf/")
                for a in argv]
        if argv[0] == "train.py":
            argv = [*argv, "--vocab-size", "2000", "--out-dir",
                    f"{tmp_path}/runs/mlm_babylm_10m_tiny", "--eval-every", "30"]
            argv[argv.index("--max-steps") + 1] = "30"
        if argv[0] == "plot.py":
            pytest.importorskip("matplotlib")
            argv += ["--out", str(tmp_path / "curves.png")]
        if argv[0] == "export.py":
            pytest.importorskip("transformers")
        p = run_script(*argv, env=env, timeout=600)
        assert p.returncode == 0, (argv, p.stderr[-2000:])
        if argv[1:2] == ["fill"]:
            assert p.stdout.splitlines()[1].startswith("  [MASK] 1: ")
        if argv[0] == "train.py":  # a tiny model: no word of wanting a GPU
            assert "wants a GPU" not in p.stdout
    run = tmp_path / "runs" / "mlm_babylm_10m_tiny"
    assert (run / "ckpt.pt").is_file() and (run / "eval" / "mlm.json").is_file()
    assert (tmp_path / "curves.png").stat().st_size > 10_000
    assert (tmp_path / "hf" / "mlm_tiny" / "config.json").is_file()


def test_the_first_screens_quote_is_made_from_its_record():
    """Issue 84: the README's figures for its first block (times, losses, accuracies, fill's
    output) and for BLiMP and RTE on that block's checkpoint are `studies.first_screen`'s quotes
    of docs/studies/first_screen.json, not typed; the record was made by running today's blocks
    (the same commands, in the same order). A change in training is re-measured by running
    `python -m studies.first_screen`."""
    readme = (REPO / "README.md").read_text()
    record = json.loads(first_screen.RECORD.read_text())
    others = first_screen.variants()  # the same lines at another thread count, on another CPU
    assert any(o["machine"] == record["machine"] and o.get("threads") != record["threads"]
               for o in others)
    runs = [record, *others]  # the sentence's loss spread, read off the records by hand
    losses = [[r["val"][-1]["val_loss"], *(r["mlm"]["maskings"][m]["loss"] for m in
                                           ("uniform", "span"))] for r in runs]
    far = max(max(col) - min(col) for col in zip(*losses))
    assert f"losses moved by at most {far:.3f} nats" in first_screen.spread(record, others)
    assert first_screen.quoted(readme) == first_screen.quote(record, others)
    assert first_screen.quoted(readme, first_screen.EVAL_BEGIN, first_screen.EVAL_END) == \
        first_screen.quote_evaluation(record)
    block = [argv for _, argv in readme_commands(blocks=1)]
    evaluations = first_screen.evaluation_commands(readme)
    assert [a[1] for a in evaluations] == ["blimp", "finetune"]
    assert all(a[a.index("--ckpt") + 1] == f"{block[1][block[1].index('--ckpt') + 1]}/ckpt.pt"
               for a in evaluations)  # the first screen's checkpoint
    assert first_screen.demo_commands(readme) == block
    assert [c["argv"] for c in record["commands"]] == block + first_screen.evaluation_commands(
        readme)
    assert record["val"][-1]["step"] == int(block[0][block[0].index("--max-steps") + 1])


def test_the_readme_is_short_and_shows_one_result_made_from_committed_files():
    """Issue 82: a newcomer's page, at most 200 lines, with one result figure: one a study's
    report drew (studies/report.py's figures) from result files committed beside it, which
    `python study.py STUDY --report --out FOLDER` draws again."""
    import subprocess
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    figures = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    assert len(figures) == 1, figures
    figure = REPO / figures[0]
    folder = figure.parent
    tracked = subprocess.run(["git", "ls-files", str(folder.relative_to(REPO))], cwd=REPO,
                             capture_output=True, text=True, check=True).stdout.split()
    assert str(figure.relative_to(REPO)) in tracked
    assert (folder / "report.json").is_file() and any(t.endswith(".json.gz") and "/results/" in t
                                                       for t in tracked)
    assert f"]({figure.name})" in (folder / "REPORT.md").read_text()  # the report drew it
