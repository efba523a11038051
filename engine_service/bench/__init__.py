"""`decodelab bench ...`: benchmarks that write JSON + a PNG plot. Each one is a module with add_parser()."""
import importlib

BENCHMARKS = ("throughput", "modes", "serve", "soak", "gpu")


def add_bench_parser(sub, add_engine_args) -> None:
    bench = sub.add_parser("bench", help="benchmarks (JSON + PNG plots)")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    for name in BENCHMARKS:
        try:
            mod = importlib.import_module(f"engine_service.bench.{name}")
        except ModuleNotFoundError as e:
            if e.name == f"engine_service.bench.{name}":
                continue
            raise
        mod.add_parser(bench_sub, add_engine_args)
