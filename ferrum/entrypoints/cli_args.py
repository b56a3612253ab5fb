"""vLLM's command-line conveniences: every flag also in underscore spelling (`--max_model_len`),
and `--config FILE.yaml`, whose keys are flag names (either spelling; `model` is the positional
MODEL) and whose values become those flags' defaults, so flags on the command line win."""

from __future__ import annotations

import argparse
import json
from typing import Any


def normalize_flag_spellings(argv: list[str]) -> list[str]:
    """`--max_model_len=4` -> `--max-model-len=4`: underscores in a long flag's name (never in
    its value, nor after `--`)."""
    normalized = []
    for i, arg in enumerate(argv):
        if arg == "--":
            return normalized + argv[i:]
        if arg.startswith("--"):
            name, eq, value = arg.partition("=")
            arg = name.replace("_", "-") + eq + value
        normalized.append(arg)
    return normalized


def add_config_file_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        default=None,
        help="a YAML file of flag values (keys: flag names, e.g. max-model-len: 4096); flags on "
        "the command line override it",
    )


def apply_config_file(parser: argparse.ArgumentParser, path: str) -> None:
    """Makes the values in the YAML file at `path` the defaults of `parser`'s flags (validated
    as flags: a bad value is the flag's usual error). ValueError naming the file and the key for
    an unreadable file or an unknown key."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            values = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"config: cannot read {path!r}: {e}") from None
    if values is None:
        return
    if not isinstance(values, dict):
        raise ValueError(f"config: {path!r} must hold a mapping of flag names to values")
    actions = {flag: a for a in parser._actions for flag in a.option_strings}
    tokens: list[str] = []
    dests: list[str] = []
    for key, value in values.items():
        flag = "--" + str(key).replace("_", "-")
        if key == "model":
            tokens.insert(0, str(value))
            dests.append("model")
            continue
        action = actions.get(flag)
        if action is None or flag == "--config":
            raise ValueError(f"config: {path!r}: {key!r} {_unknown_key_reason(str(key))}")
        dests.append(action.dest)
        tokens += _flag_tokens(flag, action, value)
    parser.exit_on_error = False  # a bad value raises, to be reported with the file's name
    try:
        file_args = parser.parse_args(tokens)
    except argparse.ArgumentError as e:
        raise ValueError(f"config: {path!r}: {e}") from None
    finally:
        parser.exit_on_error = True
    parser.set_defaults(**{dest: getattr(file_args, dest) for dest in dests})


def _flag_tokens(flag: str, action: argparse.Action, value: Any) -> list[str]:
    """The command-line tokens that give `flag` the YAML `value`."""
    if isinstance(action, argparse.BooleanOptionalAction):
        return [flag if value else "--no-" + flag.removeprefix("--")]
    if action.nargs == 0:  # store_true
        return [flag] if value else []
    if isinstance(value, dict):
        return [flag, json.dumps(value)]
    if isinstance(value, list):
        if isinstance(action, argparse._AppendAction):
            return [token for item in value for token in (flag, str(item))]
        if action.nargs in ("+", "*"):
            return [flag, *(str(item) for item in value)]
        return [flag, json.dumps(value)]
    return [flag, str(value)]


def _unknown_key_reason(key: str) -> str:
    from ferrum.engine.arg_utils import NOT_SUPPORTED_YET

    if key.replace("-", "_") in NOT_SUPPORTED_YET:
        return "is not supported yet by ferrum (see the README)"
    return "is not a flag of this command"
