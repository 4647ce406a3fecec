"""`python -m crucible_cli` = `crucible`."""

from crucible_cli.app import main

main()
