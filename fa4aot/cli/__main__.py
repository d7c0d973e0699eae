from . import main

main(prog_name="fa4aot")
