() => {
  /* DecodeLab playground: a clicked token's sampler pipeline, drawn at the top of the branch popup (web/branching.js
     calls window.dlPipeline(pop, tk)) from the token's data-s (web/pipeline.py: the engine's stages, computed from
     the logits it sampled from). One block per stage: the tokens kept, the probability it removed, the chosen
     token's rank and probability, bars for its most likely tokens.
     "What if" reshapes the token's last stage before temperature (raw, or after the grammar / penalties) under other
     temperature, top-k, top-p and min-p, here in the page: no request. It knows the engine's top-N tokens; the rest
     of the kept tokens count as one bucket of equally likely tokens, so it is exact where only the top-N matter
     (temperature 1, cuts within them) and approximate otherwise (the normaliser after a temperature sums the tail). */
  if (window.dlPipeline) return;
  const NAMES = { raw: "raw", grammar: "after the grammar mask", penalties: "after penalties / logit bias",
                  temperature: "after temperature", top_k: "after top-k", top_p: "after top-p", min_p: "after min-p" };
  const SHOWN = 5;  // bars per stage
  const visible = (s) => (s || "").replace(/\n/g, "↵").replace(/\t/g, "⇥") || "∅";
  const pct = (x) => (x == null || !isFinite(x) ? "–" : `${(x * 100).toFixed(1)}%`);
  const el = (tag, cls, text) => {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text != null) e.textContent = text;
    return e;
  };
  const bar = (text, p, me) => {
    const row = el("div", me ? "bar me" : "bar");
    const fill = el("i");
    fill.style.width = `${Math.round((p || 0) * 100)}%`;
    row.append(el("code", null, visible(text)), fill, el("span", null, pct(p)));
    return row;
  };

  function stageBlock([name, kept, removed, , rank, prob, top], me) {
    const box = el("div", "stage");
    Object.assign(box.dataset, { stage: name, kept, removed, rank, p: prob });
    box.append(el("div", "sh", `${NAMES[name] || name} · ${kept.toLocaleString()} kept` +
      (name === "raw" ? "" : ` · removed ${pct(removed)}`) + ` · chosen #${rank + 1}, ${pct(prob)}`));
    for (const [id, text, p] of top.slice(0, SHOWN)) box.append(bar(text, p, id === me));
    return box;
  }

  // items: the top-N tokens, then the other kept tokens as one bucket of `n` tokens of probability `p` each
  function items([, kept, , other, , , top]) {
    const out = top.map(([id, text, p]) => ({ id, text, p, n: 1 }));
    const rest = kept - top.length;
    if (rest > 0 && other > 0) {
      out.push({ id: null, text: `${rest.toLocaleString()} others`, p: other / rest, n: rest });
    }
    return out;
  }

  const normalise = (xs) => {
    const total = xs.reduce((s, x) => s + x.p * x.n, 0);
    return xs.filter((x) => x.n > 0 && x.p > 0).map((x) => ({ ...x, p: x.p / total }));
  };

  // HF's order on the base distribution (best first): temperature, top-k, top-p, min-p
  function whatIf(base, { t, k, p, minP }) {
    let xs = items(base);
    xs = t < 1e-5 ? xs.map((x, i) => ({ ...x, p: i === 0 ? 1 : 0, n: i === 0 ? 1 : x.n }))
                  : normalise(xs.map((x) => ({ ...x, p: Math.pow(x.p, 1 / t) })));
    if (k > 0) {
      let left = k;
      xs = normalise(xs.map((x) => { const n = Math.min(x.n, left); left -= n; return { ...x, n }; }));
    }
    if (p < 1) {  // the fewest tokens, best first, whose probability reaches p (at least one)
      let mass = 0;
      xs = normalise(xs.map((x) => {
        if (mass >= p) return { ...x, n: 0 };
        const n = Math.max(1, Math.min(x.n, Math.ceil((p - mass) / x.p - 1e-9)));
        mass += n * x.p;
        return { ...x, n };
      }));
    }
    if (minP > 0) xs = normalise(xs.filter((x) => x.p >= minP * xs[0].p));
    return xs;
  }

  function knob(label, attrs, value) {
    const wrap = el("label", "knob", label);
    const input = el("input");
    Object.assign(input, attrs, { value });
    const out = el("output", null, String(value));
    input.addEventListener("input", () => { out.textContent = input.value; });
    wrap.append(input, out);
    return [wrap, input];
  }

  // a sampled token starts at the Sampling column's controls as they are now (the run's, unless changed since),
  // a greedy one at neutral settings
  function settingsOf(mode) {
    const num = (id, fallback) => {
      const v = Number(document.querySelector(`#${id} input[type=number], #${id} input`)?.value);
      return isFinite(v) ? v : fallback;
    };
    if (mode !== "sample") return { t: 1, k: -1, p: 1, minP: 0 };
    return { t: num("temperature", 1), k: num("top-k", -1), p: num("top-p", 1), minP: num("min-p", 0) };
  }

  function whatIfBlock(stages, me, mode) {
    const base = [...stages].reverse().find((s) => ["raw", "grammar", "penalties"].includes(s[0]));
    const box = el("div", "whatif");
    const s = settingsOf(mode);
    const [tWrap, t] = knob("temperature", { type: "range", min: 0, max: 2, step: 0.05, name: "t" }, s.t);
    const [kWrap, k] = knob("top-k", { type: "number", min: -1, step: 1, name: "k" }, s.k);
    const [pWrap, p] = knob("top-p", { type: "range", min: 0.05, max: 1, step: 0.05, name: "p" }, s.p);
    const [mWrap, m] = knob("min-p", { type: "range", min: 0, max: 0.5, step: 0.01, name: "min_p" }, s.minP);
    const result = el("div", "wr");
    const draw = () => {
      const xs = whatIf(base, { t: Number(t.value), k: Number(k.value), p: Number(p.value), minP: Number(m.value) });
      const at = xs.findIndex((x) => x.id === me);
      const chosen = at < 0 ? 0 : xs[at].p;
      const kept = xs.reduce((n, x) => n + x.n, 0);
      Object.assign(result.dataset, { p: chosen, kept });
      result.replaceChildren(el("div", "sh", `${kept.toLocaleString()} kept · chosen ` +
        (at < 0 ? "not among them (or beyond the top tokens)" : `#${at + 1}, ${pct(chosen)}`)));
      for (const x of xs.slice(0, SHOWN)) result.append(bar(x.text, x.p, x.id === me));
    };
    for (const input of [t, k, p, m]) input.addEventListener("input", draw);
    box.append(el("div", "ph", `What if: ${NAMES[base[0]]} reshaped here, no new request`), tWrap, kWrap, pWrap,
               mWrap, result, el("small", "dim", `the engine sent its top ${base[6].length} tokens; the rest ` +
                                                 "count as equally likely, so a temperature other than 1 or a cut " +
                                                 "beyond them is approximate"));
    draw();
    return box;
  }

  window.dlPipeline = (pop, tk) => {
    let stages = null;
    try { stages = JSON.parse(tk.dataset.s || "null"); } catch (e) { stages = null; }
    if (!stages || !stages.length) return;
    const me = tk.dataset.id === undefined ? null : Number(tk.dataset.id);
    const box = el("div", "dl-pipe");
    box.append(el("div", "ph", "Sampler pipeline (computed by the engine)"));
    for (const s of stages) box.append(stageBlock(s, me));
    box.append(whatIfBlock(stages, me, pop.dataset.mode));
    pop.classList.add("with-pipe");
    pop.insertBefore(box, pop.firstChild);
  };
}
