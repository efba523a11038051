"""The text summary and the 2x2 figure of `decodelab bench gpu` (reads only the results dict)."""
from engine_service.bench.common import pyplot


def summary(res: dict) -> str:
    tp, ss, sp, kn = res["throughput"], res["single_stream"], res["speculative"], res["kernels"]
    lines = [f"== bench gpu: {res['target']} (draft {res['draft']}), {res['dtype']}, random weights, "
             f"on {res['device']} =="]
    a = f"(a) throughput: ours {tp['ours']['tok_per_s']:.0f} tok/s"
    for key, label in (("hf_static", "HF static batches"), ("hf_continuous", "HF generate_batch")):
        if key in tp:
            ok = "tok_per_s" in tp[key]
            a += (f" | {label} {tp[key]['tok_per_s']:.0f} (ours {tp[f'ours_over_{key}']:.2f}x)" if ok
                  else f" | {label} failed: {tp[key]['error']}")
    lines.append(a)
    lines.append(f"(b) single stream at context {ss['context']}+: engine step {ss['engine_step_ms']:.2f} ms, "
                 f"model forward {ss['forward_ms']:.2f} ms ({'CUDA graph' if ss['cuda_graphs'] else 'no graph'}; eager "
                 f"{ss['forward_eager_ms']:.2f} ms); reads {ss['weight_bytes'] / 1e9:.2f} GB weights + "
                 f"{ss['kv_bytes'] / 1e6:.1f} MB KV per step")
    for name in ("spec_peak", "measured_copy"):
        if f"bound_ms_{name}" in ss:
            lines.append(f"    bound at {name} {res['bandwidth_gbs'][name]:.0f} GB/s: {ss[f'bound_ms_{name}']:.2f} ms"
                         f" -> engine {ss[f'engine_over_bound_{name}']:.2f}x, forward "
                         f"{ss[f'forward_over_bound_{name}']:.2f}x (goal <= {res['goal_step_over_bound']}x)")
    if "skipped" in kn:
        lines.append(f"(c) kernels: skipped ({kn['skipped']})")
    else:
        best = max(kn["decode"], key=lambda r: r["gbs"])
        frac = f", {best['fraction_of_peak']:.0%} of spec peak" if best["fraction_of_peak"] else ""
        lines.append(f"(c) kernels: {kn['num_checks'] - len(kn['failed_checks'])}/{kn['num_checks']} checks ok; best "
                     f"paged decode {best['gbs']:.0f} GB/s (B={best['batch']}, ctx={best['context']}{frac})")
    k0 = sp["measured_at_k"]
    lines.append(f"(d) speculative, batch 1 (costs measured on {res['device']}): target decode "
                 f"{sp['target_decode_ms']:.2f} ms, verify of {k0}+1 tokens {sp['target_verify_ms'][str(k0)]:.2f} ms, "
                 f"draft step {sp['draft_decode_ms']:.2f} ms, host overhead {sp['host_overhead_ms']:.2f} ms/step;"
                 f" acceptance: {sp['acceptance_rate_source']}")
    for rate in dict.fromkeys(r["acceptance_rate"] for r in sp["rows"]):
        rows = [r for r in sp["rows"] if r["acceptance_rate"] == rate]
        at, best = next(r for r in rows if r["k"] == k0), max(rows, key=lambda r: r["speedup_with_host_overhead"])
        lines.append(f"    rate {rate:.2f}: predicted speed-up at k={k0} {at['speedup_with_host_overhead']:.2f}x "
                     f"({at['speedup_forward_only']:.2f}x forward only); best k={best['k']}: "
                     f"{best['speedup_with_host_overhead']:.2f}x")
    lines.append("where measured: " + "; ".join(f"{k}: {v}" for k, v in res["where_measured"].items()))
    return "\n".join(lines)


def plot(res: dict, path) -> None:
    plt = pyplot()

    fig, ((a, b), (c, d)) = plt.subplots(2, 2, figsize=(13, 9))
    tp = res["throughput"]
    names = [("ours", "DecodeLab"), ("hf_static", "HF generate\n(static)"), ("hf_continuous", "HF generate_batch")]
    names = [(k, label) for k, label in names if "tok_per_s" in tp.get(k, {})]
    a.bar([label for _, label in names], [tp[k]["tok_per_s"] for k, _ in names],
          color=["tab:green", "tab:gray", "tab:blue"][:len(names)])
    a.set_ylabel("generated tok/s")
    a.set_title(f"(a) offline throughput, {tp['workload']['requests']} requests")

    ss = res["single_stream"]
    bars = {"engine step": ss["engine_step_ms"], "forward": ss["forward_ms"], "forward eager": ss["forward_eager_ms"]}
    bars.update({f"bound\n{n}": ss[f"bound_ms_{n}"] for n in ("spec_peak", "measured_copy") if f"bound_ms_{n}" in ss})
    b.bar(list(bars), list(bars.values()), color=["tab:green", "tab:olive", "tab:gray"] + ["tab:red"] * (len(bars) - 3))
    bound = ss.get("bound_ms_spec_peak") or ss.get("bound_ms_measured_copy")
    goal = res["goal_step_over_bound"]
    b.axhline(goal * bound, ls="--", color="tab:red", label=f"goal {goal}x bound")
    b.set_ylabel("ms per decode step")
    b.set_title(f"(b) single stream at context {ss['context']}")
    b.legend()

    kn = res["kernels"]
    if "decode" in kn:
        for batch in sorted({r["batch"] for r in kn["decode"]}):
            rows = [r for r in kn["decode"] if r["batch"] == batch]
            c.plot([r["context"] for r in rows], [r["gbs"] for r in rows], marker="o", label=f"B={batch}")
        for n, style in (("spec_peak", "-"), ("measured_copy", "--")):
            if res["bandwidth_gbs"][n]:
                c.axhline(res["bandwidth_gbs"][n], ls=style, color="black", lw=0.8, label=n)
        c.set_xscale("log", base=2)
        c.legend(fontsize=8)
    c.set_xlabel("context")
    c.set_ylabel("GB/s")
    c.set_title("(c) Triton paged decode bandwidth" + (" (skipped)" if "skipped" in kn else ""))

    sp = res["speculative"]
    for rate in dict.fromkeys(r["acceptance_rate"] for r in sp["rows"]):
        rows = [r for r in sp["rows"] if r["acceptance_rate"] == rate]
        line, = d.plot([r["k"] for r in rows], [r["speedup_with_host_overhead"] for r in rows], marker="o",
                       label=f"rate {rate:.2f}")
        d.plot([r["k"] for r in rows], [r["speedup_forward_only"] for r in rows], ls=":", color=line.get_color())
    d.axhline(1, color="black", lw=0.8)
    d.set_xlabel("draft tokens k")
    d.set_ylabel("predicted speed-up (dotted: forward only)")
    measured = "CPU" in sp["acceptance_rate_source"]
    d.set_title("(d) speculative, batch 1: " + ("measured rate" if measured else "ASSUMED rates"))
    d.legend(fontsize=8)
    fig.suptitle(f"{res['target']} {res['dtype']}, random weights, on {res['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
