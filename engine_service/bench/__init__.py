"""`decodelab bench ...`: benchmarks that write JSON + a PNG plot. Each one is a module with add_parser(), registered
in engine_service/cli.py."""
