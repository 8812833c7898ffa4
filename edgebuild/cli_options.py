"""Command-line options shared by ``edgebuild run`` and ``edgellm-serve``: one definition, so
both commands take the same choices with the same help."""

from __future__ import annotations

import click

from edgebuild.ops.linear import QUANT_MODES

QUANT_HELP = (
    "torch backend: weight-only int8 (per channel) or int4 (groups of 32) CPU linears "
    "(opt-in; faster, outputs are the quantized model's)."
)


def quant_option():
    """The ``--quant int8|int4`` option (default None: the checkpoint's weights as stored)."""
    return click.option("--quant", type=click.Choice(QUANT_MODES), default=None, help=QUANT_HELP)
