"""The `k3stream` subcommands: one module per command exposing `add_arguments(parser)` and
`run(args) -> int`, with the flags and reports they share. Library modules never import these."""
