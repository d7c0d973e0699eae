"""`python -m fa4aot`: the `fa4aot` command."""

from fa4aot.cli import main

main(prog_name="fa4aot")
