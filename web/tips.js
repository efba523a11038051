() => {
  /* DecodeLab playground: a token's hover card, drawn when the pointer first reaches the token, from the facts
     render.py puts on it (data-alts [[id, text, p], ...] and data-id, data-lp log-prob, data-h entropy, data-k
     the probability a grammar masked, data-d a speculative draft check, the m- class). A streaming column
     re-sends all its tokens every frame, so a token carries its facts only (the card's HTML was ~60% of a
     frame's bytes and ~10 elements per token). The stylesheet shows `.tk:hover .tip`; a re-render drops the
     cards with the tokens. */
  if (window.dlTips) return;
  window.dlTips = true;
  const MARKS = {
    accepted: "proposed by the draft, accepted by the target",
    resampled: "draft rejected: resampled by the target",
    bonus: "bonus token: all k drafts accepted",
    target: "decoded by the target alone (no proposal)",
  };
  const esc = (s) => String(s).replace(/[&<>"']/g, (c) => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;",
                                                            "'": "&#x27;"})[c]);
  const visible = (s) => (s || "").replace(/\n/g, "↵").replace(/\t/g, "⇥") || "∅";
  const pct = (x) => (x == null || !isFinite(x) ? "–" : `${(x * 100).toFixed(1)}%`);
  const json = (s) => { try { return JSON.parse(s || "[]"); } catch (e) { return []; } };
  const row = (text, p, me) => `<div class="alt${me ? " me" : ""}"><code>${esc(visible(text))}</code>` +
    `<i style="width:${Math.round((p || 0) * 100)}%"></i><span>${pct(p || 0)}</span></div>`;

  function draft(d) {
    const [token, position, accepted, q, p, accept, residualId, residual, top] = d;
    let html = `<div class="dh">draft <code>${esc(visible(token))}</code> · position ${position + 1} · ` +
      (accepted ? '<span class="ok">accepted</span>' : '<span class="no">rejected</span>') + "</div>" +
      `<div class="dv"><span>p_draft q(x)</span><span>${q == null ? "1 (n-gram)" : pct(q)}</span></div>` +
      `<div class="dv"><span>p_target p(x)</span><span>${pct(p)}</span></div>` +
      `<div class="dv"><span>accept min(1, p/q)</span><span>${pct(accept)}</span></div>`;
    if (residualId != null) {
      html += `<div class="dh">target drew <code>${esc(visible(residual || ""))}</code> · residual max(0, p − q):</div>`;
      for (const [id, text, prob] of top || []) html += row(text, prob, id === residualId);
    }
    return `<div class="dc">${html}</div>`;
  }

  function card(tk) {
    const ds = tk.dataset;
    const lp = ds.lp === undefined ? null : Number(ds.lp);
    let head = `<b>${esc(visible(tk.textContent))}</b> p = ${lp == null ? "–" : pct(Math.exp(lp))}`;
    if (lp != null) head += ` <small>(logprob ${lp.toFixed(2)})</small>`;
    if (ds.h !== undefined) head += `<div class="ent">entropy ${Number(ds.h).toFixed(2)} nats</div>`;
    if (ds.k !== undefined) {
      head += '<div class="msk" title="probability of the raw distribution on tokens the grammar forbade here">' +
        `grammar removed ${pct(Number(ds.k))} of the probability</div>`;
    }
    const mark = [...tk.classList].find((c) => c.startsWith("m-"));
    if (mark) head += `<div class="mk">${esc(MARKS[mark.slice(2)] || mark.slice(2))}</div>`;
    if (ds.d) head += draft(json(ds.d));
    const me = ds.id === undefined ? null : Number(ds.id);
    const rows = json(ds.alts).slice(0, 5).map(([id, text, p]) => row(text, p, id === me)).join("");
    return `<span class="tip">${head}${rows}</span>`;
  }

  document.addEventListener("mouseover", (e) => {
    const tk = e.target instanceof Element ? e.target.closest('.tk[data-alts], .tk[data-lp], .tk[class*=" m-"]') : null;
    if (tk && !tk.querySelector(":scope > .tip")) tk.insertAdjacentHTML("beforeend", card(tk));
  });
}
