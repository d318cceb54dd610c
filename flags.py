"""The command line as every script builds it: help that shows each flag's default, flags made
from a config dataclass's fields (their help is the field's comment, so the two never drift
apart), lower bounds checked in one place, and which flags a user typed.

    p = argparse.ArgumentParser(description=__doc__, formatter_class=flags.Help)
    flags.add_fields(p.add_argument, ModelConfig, preset=True)    # --n-layer, --d-model, ...
"""
import argparse
import inspect
import re
import sys
from dataclasses import fields


class Help(argparse.RawDescriptionHelpFormatter):
    """--help: the description as written, and each flag's default after its help, unless the
    help gives it (where an objective or a size changes it) or there is none."""

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


def add_fields(add, cls, dests: dict[str, str] | None = None, preset: bool = False,
               choices: dict | None = None, prefix: str = "") -> None:
    """A flag for each field of the dataclass `cls`, added by `add` (a parser's or a group's
    add_argument): `dests` {flag destination: field} picks and renames them (default: every field
    under its own name). With `preset`, a flag's default is None, the preset deciding, and a
    boolean field gets --x/--no-x; otherwise the field's default is the flag's."""
    helps, defaults = field_help(cls), {f.name: f.default for f in fields(cls)}
    for dest, name in (dests or {f: f for f in defaults}).items():
        default, flag = defaults[name], "--" + dest.replace("_", "-")
        kind = (dict(action=argparse.BooleanOptionalAction) if preset and isinstance(default, bool)
                else dict(type=type(default), choices=(choices or {}).get(name)))
        add(flag, default=None if preset else default, help=prefix + helps[name], **kind)


def check_at_least(parser, args, least: dict[str, int]) -> None:
    """Refuse a value below its bound ({destination: least value}; None passes: not given)."""
    for name, bound in least.items():
        if getattr(args, name) is not None and getattr(args, name) < bound:
            parser.error(f"--{name.replace('_', '-')} must be at least {bound}")


def typed(parser, argv) -> list[str]:
    """The destinations of the flags typed on the command line (argv, or sys.argv's): a resumed
    run keeps its saved settings and refuses new ones. argparse has no public map from option
    string to destination, hence the private one."""
    words = [t.split("=")[0] for t in (sys.argv[1:] if argv is None else argv)]
    options = parser._option_string_actions
    return sorted({options[t].dest for t in words if t in options})
