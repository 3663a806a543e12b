"""One module per ``mlxspec`` subcommand, each with ``setup_arg_parser()`` and ``main(argv)``."""
