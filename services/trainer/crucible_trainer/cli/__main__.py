"""`python -m crucible_trainer.cli` = `crucible`."""

from crucible_trainer.cli import main

main()
