"""`python -m fa4aot`: the `fa4aot` command."""

from .cli import main

main(prog_name="fa4aot")
