"""`python -m edgebuild` = the `edgebuild` command."""

from edgebuild.cli import main

main(prog_name="edgebuild")
