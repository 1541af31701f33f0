"""The command line's help: plain text (no reST markup from the docstrings it reuses), and every
argument of every subcommand described."""
import argparse
import subprocess

from hpcsync.cli import build_parser
from launch import PY, ROOT, clean_env


def _subcommands(parser: argparse.ArgumentParser):
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices


def test_help_is_plain_text_and_every_argument_is_described():
    parser = build_parser()
    subs = _subcommands(parser)
    assert set(subs) == {"info", "merge", "stage", "doctor", "run"}
    for name, p in [("hpcsync", parser), *subs.items()]:
        text = p.format_help()
        assert "``" not in text and ":func:" not in text and ":class:" not in text, (name, text)
        undescribed = [a.dest for a in p._actions if not isinstance(a, argparse._HelpAction)
                       and not isinstance(a, argparse._SubParsersAction) and not (a.help or "").strip()]
        assert not undescribed, f"hpcsync {name}: arguments without help: {undescribed}"
        assert name == "hpcsync" or (p.description or "").strip(), f"hpcsync {name} --help says what it does"


def test_merge_offers_every_method_of_the_file_sync():
    from hpcsync.cli import MERGE_METHODS
    from hpcsync.data.filesync import METHODS

    assert tuple(MERGE_METHODS) == METHODS


def test_help_from_the_command():
    for args in ([], ["merge"], ["run"]):
        p = subprocess.run([PY, "-m", "hpcsync", *args, "--help"], cwd=ROOT, env=clean_env(), capture_output=True,
                           text=True, timeout=60)
        assert p.returncode == 0 and "usage: hpcsync" in p.stdout and "``" not in p.stdout, p.stdout + p.stderr
