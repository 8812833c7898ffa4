"""`python -m edgebuild.serve` = `edgellm-serve`."""

from edgebuild.serve.cli import main

main()
