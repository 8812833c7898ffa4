"""Options that `edgebuild run` and `edgellm-serve` share are one definition
(:mod:`edgebuild.cli_options`): the same choices and help on both commands."""

from __future__ import annotations

import click

from edgebuild import cli
from edgebuild.ops.linear import QUANT_MODES
from edgebuild.serve import cli as serve_cli


def _param(command: click.Command, name: str) -> click.Parameter:
    return next(p for p in command.params if p.name == name)


def test_quant_is_one_option_on_run_and_serve():
    run_quant, serve_quant = _param(cli.run, "quant"), _param(serve_cli.main, "quant")
    assert run_quant.opts == serve_quant.opts == ["--quant"]
    assert list(run_quant.type.choices) == list(serve_quant.type.choices) == list(QUANT_MODES)
    assert run_quant.default is None and serve_quant.default is None
    assert run_quant.help == serve_quant.help
    assert "torch backend" in run_quant.help and "int4 (groups of 32)" in run_quant.help
