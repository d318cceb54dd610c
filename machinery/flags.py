"""The command line as every script builds it: errors in one line, help that shows each flag's
default, flags made from a config dataclass's fields (their help is the field's comment, so the
two never drift apart), the range of every numeric flag declared with the flag and checked as
the command line is parsed, and comma-separated integer lists.

    p = flags.Parser(description=__doc__)
    p.add_argument("--lr", type=float, default=1e-3, range=flags.above(0))
    p.add_argument("--seeds", type=flags.integers, default="0,1", range=flags.at_least(0))
    flags.add_fields(p.add_argument, ModelConfig, preset=True,     # --n-layer, --d-model, ...
                     ranges={"n_layer": flags.at_least(1)})
    args = p.parse_args()                                          # ranges checked
"""
import argparse
import inspect
import re
from dataclasses import dataclass, fields
from typing import NamedTuple


class Parser(argparse.ArgumentParser):
    """argparse's parser, but an error is one line naming what is wrong and pointing at --help
    (argparse prints its whole usage block first, 35 lines for train.py), and `--lr -1e-3` is a
    negative number (argparse's own pattern knows -1 and -.5 but takes -1e-3 for a flag, and
    says "expected one argument" where the range check would say why)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", Help)  # subcommands' parsers too
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)(e[-+]?\d+)?$", re.I)

    def add_argument(self, *args, range=None, **kwargs):
        """argparse's, plus `range`: the Range its values must fall in (check_ranges)."""
        return with_range(super().add_argument(*args, **kwargs), range)

    def add_argument_group(self, *args, **kwargs):
        group = super().add_argument_group(*args, **kwargs)
        add = group.add_argument
        group.add_argument = lambda *a, range=None, **kw: with_range(add(*a, **kw), range)
        return group

    def parse_args(self, args=None, namespace=None):
        """argparse's, then every value checked against its flag's range (check_ranges)."""
        parsed = super().parse_args(args, namespace)
        check_ranges(self, parsed)
        return parsed

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
        return {int: "N", float: "X"}.get(action.type, "VALUE")

    def _get_help_string(self, action):
        default = action.default
        if "default" in action.help or default is None or default is False or default == "" \
                or default == argparse.SUPPRESS:
            return action.help
        return f"{action.help} (default {default:g})" if isinstance(default, float) else \
            f"{action.help} (default {default})"


def field_help(cls) -> dict[str, str]:
    """{field: its comment} of a config dataclass."""
    src = inspect.getsource(cls)
    return dict(re.findall(r"^\s+(\w+): .*?#\s*(.+)$", src, flags=re.M))


class Flag(NamedTuple):
    """A flag declared away from any parser (an objective's, beside its loss): its option and
    add_argument's keywords, `range` included; `add(flag.option, **flag.spec)` adds it."""
    option: str
    spec: dict

    @property
    def dest(self) -> str:
        return self.option[2:].replace("-", "_")


def flag(option: str, **spec) -> Flag:
    return Flag(option, spec)


def field_flags(cls, dests: dict[str, str] | None = None, preset: bool = False,
                choices: dict | None = None, prefix: str = "",
                ranges: dict | None = None) -> list[Flag]:
    """A flag for each field of the dataclass `cls`: `dests` {flag destination: field} picks and
    renames them (default: every field under its own name). With `preset`, a flag's default is
    None, the preset deciding, and a boolean field gets --x/--no-x; otherwise the field's default
    is the flag's. `ranges` {field: Range} and `choices` {field: values}: what a field's flag
    accepts."""
    helps, defaults = field_help(cls), {f.name: f.default for f in fields(cls)}
    made = []
    for dest, name in (dests or {f: f for f in defaults}).items():
        default = defaults[name]
        kind = (dict(action=argparse.BooleanOptionalAction) if preset and isinstance(default, bool)
                else dict(type=type(default), choices=(choices or {}).get(name)))
        made.append(flag("--" + dest.replace("_", "-"), default=None if preset else default,
                         help=prefix + helps[name], range=(ranges or {}).get(name), **kind))
    return made


def add_fields(add, cls, dests: dict[str, str] | None = None, **kwargs) -> None:
    """field_flags' flags, each added by `add` (a Parser's or a group's add_argument)."""
    for f in field_flags(cls, dests, **kwargs):
        add(f.option, **f.spec)


@dataclass(frozen=True)
class Range:
    """The values a numeric flag may take: low and high bounds (None: none), each closed unless
    said open."""
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def __contains__(self, v) -> bool:
        return ((self.low is None or v > self.low or (v == self.low and not self.low_open))
                and (self.high is None or v < self.high or (v == self.high and not self.high_open)))

    def __str__(self) -> str:
        if self.high is None:
            return f"{'>' if self.low_open else '>='} {self.low:g}"
        return (f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}"
                f"{')' if self.high_open else ']'}")

    def refusal(self, flag: str, value) -> str:
        """The line that refuses `value` for `flag`."""
        return f"{flag} must be {self}, not {value:g}"


def at_least(low: float) -> Range:
    return Range(low)


def above(low: float) -> Range:
    return Range(low, low_open=True)


def with_range(action: argparse.Action, allowed: Range | None) -> argparse.Action:
    action.range = allowed
    return action


def actions(parser) -> list[argparse.Action]:
    """Every flag of a parser and of its subcommands' parsers."""
    subs = [p for a in parser._actions if isinstance(a, argparse._SubParsersAction)
            for p in a.choices.values()]
    return [a for p in [parser, *subs] for a in p._actions]


def check_ranges(parser, args) -> None:
    """Refuse a value outside its flag's range, in one line that names the flag, its range and
    the value. What is not a number passes: None (not given), train.py's mark of a flag not typed,
    a flag of another subcommand. A list (a comma-separated flag, of type integers) is checked
    value by value."""
    for action in actions(parser):
        allowed, given = getattr(action, "range", None), getattr(args, action.dest, None)
        for value in given if isinstance(given, list) else [given]:
            number = isinstance(value, (int, float))
            if allowed is not None and number and value not in allowed:
                parser.error(allowed.refusal(f"--{action.dest.replace('_', '-')}", value))


def fill_unset(args, values: dict) -> None:
    """Each flag named in `values` (a preset's, a protocol's) takes its value there where the
    user left it unset (None)."""
    for k, v in values.items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)


def integers(text: str) -> list[int]:
    """A comma-separated list flag's type: its integers (argparse names the flag where not)."""
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text}: give comma-separated integers") from None
