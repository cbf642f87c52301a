"""The ``kvbridge`` command. Each subcommand is a module in this package that
defines ``register(subparsers)``; ``main`` discovers them, so adding a command
is adding a file."""
