"""Every option of every sub-command says what it does in `--help` (argparse prints an option
without help text as its bare name)."""
from __future__ import annotations

import argparse

from agent.cli import build_parser


def _walk(parser: argparse.ArgumentParser, path: str):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _walk(sub, f"{path} {name}")
        elif isinstance(action, argparse._HelpAction):
            continue
        else:
            yield path, action


def test_every_option_of_every_sub_command_has_help():
    missing = [f"{path}: {'/'.join(a.option_strings) or a.dest}" for path, a in _walk(build_parser(), "ssp-agent")
               if a.help != argparse.SUPPRESS and not (a.help and a.help.strip())]  # SUPPRESS: hidden on purpose
    assert not missing, "options without --help text:\n" + "\n".join(missing)
