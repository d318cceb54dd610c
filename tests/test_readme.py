"""Every command in the README runs as written (issue 43), checked cheaply: train.py's,
evaluate.py's and export.py's flags are parsed by their own parsers (train.py's resolved as
`--check` does), study.py's `--dry-run` runs whole, and the other scripts' flags are ones their
--help lists."""
import os
import re
import shlex
import subprocess
import sys

import pytest

import evaluate
import export
import train
from conftest import REPO, shared_data


def readme_commands() -> list[tuple[dict, list[str]]]:
    """(environment, argv) of each `python SCRIPT.py ...` line of the README's bash blocks, with
    their continuation lines joined, comments cut and shell variables (E=...; C=...) put in."""
    text = (REPO / "README.md").read_text()
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
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
        assert resolved.objective in train.OBJECTIVES
    elif script == "evaluate.py":
        evaluate.build_parser().parse_args(args)
    elif script == "export.py":
        export.build_parser().parse_args(args)
    elif script == "study.py" and "--dry-run" in args:
        shared_data()  # one clear failure if ../shared is not beside the repository
        if "NANOMLM_RAW" in env:
            env["NANOMLM_RAW"] = str((REPO / env["NANOMLM_RAW"]).resolve())
        p = subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, text=True,
                           env={**os.environ, **env}, timeout=300)
        assert p.returncode == 0, p.stderr[-2000:]
    else:  # the rest would train or sample for long: their flags are ones they have
        said = subprocess.run([sys.executable, script, "--help"], cwd=REPO, capture_output=True,
                              text=True, timeout=120).stdout
        assert said, f"{script} --help printed nothing"
        for flag in (a.split("=")[0] for a in args if a.startswith("--")):
            assert flag in said, f"{script} has no {flag}"
