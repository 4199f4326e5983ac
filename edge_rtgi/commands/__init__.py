"""CLI subcommand groups; see edge_rtgi.cli."""
