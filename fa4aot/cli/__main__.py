from fa4aot.cli import main

main(prog_name="fa4aot")
