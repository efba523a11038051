"""`decodelab bench pipeline` (engine_service/bench/pipeline.py) runs end to end on the tiny model: both variants
timed over four-mode steps, and only the 'on' variant's greedy and sampling requests ask for the pipeline."""
import json

from engine_service.cli import main


def test_the_pipeline_bench_times_four_mode_steps_with_and_without(tiny_llama_dir, tmp_path):
    assert main(["bench", "pipeline", "--model", str(tiny_llama_dir), "--max-tokens", "6", "--repeats", "1",
                 "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "pipeline.json").read_text())
    assert (tmp_path / "pipeline.png").stat().st_size > 0
    assert all(res["variants"][v]["steps"] > 0 and res["variants"][v]["step_ms"] > 0 for v in ("off", "on"))
    assert res["step_ratio"] > 0
    asked = {v: {m: p["sampler_stages"] for m, p in res["params"][v].items()} for v in ("off", "on")}
    assert asked["off"] == dict.fromkeys(asked["off"], 0)
    assert [m for m, n in asked["on"].items() if n] == ["sample"]  # greedy's pipeline is its raw stage alone
