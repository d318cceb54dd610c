"""The command line as every script builds it: argparse, with errors in one line, help that
shows each flag's default, numeric flags whose type is their range (refused in one line as the
command line is parsed), and comma-separated integer lists.

    p = flags.Parser(description=__doc__)
    p.add_argument("--lr", type=flags.above(float, 0), default=1e-3, help="learning rate")
    p.add_argument("--seeds", type=flags.numbers(flags.at_least(int, 0)), default="0,1")
    args = p.parse_args()       # --lr 0: "error: argument --lr: must be > 0, not 0; see --help"
"""
import argparse
import re
from dataclasses import dataclass


class Parser(argparse.ArgumentParser):
    """argparse's parser, but an error is one line naming what is wrong and pointing at --help
    (argparse prints its whole usage block first, 35 lines for train.py), and `--lr -1e-3` is a
    negative number (argparse's own pattern knows -1 and -.5 but takes -1e-3 for a flag, and
    says "expected one argument" where the range would say why)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", Help)  # subcommands' parsers too
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)(e[-+]?\d+)?$", re.I)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


class Help(argparse.RawDescriptionHelpFormatter):
    """--help: the description as written, and each flag's default after its help, unless the
    help gives it (where an objective or a size changes it) or there is none; 100 columns wide,
    the repository's lines, whatever the terminal (argparse's own width follows it)."""

    def __init__(self, prog, **kwargs):
        super().__init__(prog, **{"width": 100, "max_help_position": 26, **kwargs})

    def _format_action_invocation(self, action):
        """--[no-]bf16 for an on/off flag: one name, so that its help starts on its line."""
        if isinstance(action, argparse.BooleanOptionalAction):
            return action.option_strings[0].replace("--", "--[no-]", 1)
        return super()._format_action_invocation(action)

    def _get_default_metavar_for_optional(self, action):
        """A value's kind, not the flag's name again: --lr X, --seed N, --data VALUE."""
        return {int: "N", float: "X"}.get(getattr(action.type, "kind", action.type), "VALUE")

    def _get_help_string(self, action):
        default = action.default
        if "default" in action.help or default is None or default is False or default == "" \
                or default == argparse.SUPPRESS:
            return action.help
        return f"{action.help} (default {default:g})" if isinstance(default, float) else \
            f"{action.help} (default {default})"


@dataclass(frozen=True)
class Range:
    """A numeric flag's type (argparse's `type=`): the text read as `kind` (int or float), then
    refused in one line unless it lies between the low and high bounds (None: none), each closed
    unless said open; `value in range` checks a value that did not come from the command line."""
    kind: type
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def __call__(self, text: str):
        try:
            value = self.kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not {'an integer' if self.kind is int else 'a number'}") from None
        if value not in self:
            raise argparse.ArgumentTypeError(f"must be {self}, not {value:g}")
        return value

    def __contains__(self, v) -> bool:
        return ((self.low is None or v > self.low or (v == self.low and not self.low_open))
                and (self.high is None or v < self.high or (v == self.high and not self.high_open)))

    def __str__(self) -> str:
        if self.high is None:
            return f"{'>' if self.low_open else '>='} {self.low:g}"
        return (f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}"
                f"{')' if self.high_open else ']'}")

    def refusal(self, flag: str, value) -> str:
        """The line that refuses `value` for `flag`, where the value was not parsed (a config's)."""
        return f"{flag}: must be {self}, not {value:g}"


def at_least(kind: type, low: float) -> Range:
    return Range(kind, low)


def above(kind: type, low: float) -> Range:
    return Range(kind, low, low_open=True)


def fill_unset(args, values: dict) -> None:
    """Each flag named in `values` (a preset's, a protocol's) takes its value there where the
    user left it unset (None)."""
    for k, v in values.items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)


def numbers(allowed: Range):
    """The type of a comma-separated list flag: its values, each read and checked by `allowed`
    (a Range: its kind, and its bounds if any)."""
    def read(text: str) -> list:
        try:
            values = [allowed.kind(x) for x in text.split(",")]
        except ValueError:
            kind = "integers" if allowed.kind is int else "numbers"
            raise argparse.ArgumentTypeError(f"{text}: give comma-separated {kind}") from None
        bad = [v for v in values if v not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"must be {allowed}, not {bad[0]:g}")
        return values
    return read
