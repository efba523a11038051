() => {
  /* DecodeLab playground: click a token to branch from it (loaded once by demo.launch(js=...)).
     Columns are re-rendered HTML (web/render.py): tokens carry data-pos and data-alts, columns data-mode and
     data-branch. One delegated listener on the document survives every re-render; the popup lives in <body>,
     outside the columns, and keeps its fork point in a closure, so a column streaming under it cannot break it.
     A pick becomes a JSON command in window.dlBranchCmd, read by the hidden buttons' js (web/app.py). */
  if (window.dlBranching) return;
  window.dlBranching = true;
  const visible = (s) => (s || "").replace(/\n/g, "↵").replace(/\t/g, "⇥") || "∅";
  const send = (cmd, button) => {
    window.dlBranchCmd = JSON.stringify(cmd);
    const el = document.querySelector("#" + button);
    (el && (el.tagName === "BUTTON" ? el : el.querySelector("button")) || el)?.click();
  };
  const close = () => {
    document.getElementById("dl-pop")?.remove();
    document.documentElement.classList.remove("dl-popping");
  };

  function popup(tk, col) {
    const at = { mode: col.dataset.mode, branch: Number(col.dataset.branch || 0), pos: Number(tk.dataset.pos) };
    const pop = document.createElement("div");
    pop.id = "dl-pop";
    pop.className = "dl-pop";
    pop.dataset.mode = at.mode;
    const head = document.createElement("div");
    head.className = "ph";
    head.textContent = `Branch ${at.mode} at token ${at.pos}: continue with`;
    pop.append(head);
    let alts = [];
    try { alts = JSON.parse(tk.dataset.alts || "[]"); } catch (e) { alts = []; }
    for (const [id, text, p] of alts) {
      const b = document.createElement("button");
      b.type = "button";
      b.className = "alt";
      b.dataset.tid = id;
      const code = document.createElement("code");
      code.textContent = visible(text);
      const bar = document.createElement("i");
      bar.style.width = `${Math.round((p || 0) * 100)}%`;
      const pct = document.createElement("span");
      pct.textContent = p == null ? "–" : `${(p * 100).toFixed(1)}%`;
      b.append(code, bar, pct);
      b.addEventListener("click", () => { close(); send({ op: "fork", ...at, token_id: id, text }, "branch-fork"); });
      pop.append(b);
    }
    const form = document.createElement("form");
    form.className = "typed";
    const input = document.createElement("input");
    input.placeholder = "or type text…";
    input.maxLength = 200;
    const go = document.createElement("button");
    go.type = "submit";
    go.textContent = "Branch";
    form.append(input, go);
    form.addEventListener("submit", (e) => {
      e.preventDefault();
      if (!input.value) return;
      close();
      send({ op: "fork", ...at, token_id: null, text: input.value }, "branch-fork");
    });
    pop.append(form);
    window.dlPipeline?.(pop, tk);  // its sampler pipeline above the choices, when its request asked (pipeline.js)
    const r = tk.getBoundingClientRect();
    pop.style.left = `${window.scrollX + Math.max(4, Math.min(r.left, window.innerWidth - 280))}px`;
    pop.style.top = `${window.scrollY + r.bottom + 6}px`;
    document.body.append(pop);
    document.documentElement.classList.add("dl-popping");
  }

  document.addEventListener("click", (e) => {
    const pop = document.getElementById("dl-pop");
    if (pop && pop.contains(e.target)) return;
    close();
    const tb = e.target.closest(".dl-tree .tb[data-branch]");
    if (tb) {
      send({ op: "switch", mode: tb.closest(".dl-col").dataset.mode, branch: Number(tb.dataset.branch) },
           "branch-switch");
      return;
    }
    const tk = e.target.closest(".dl-col > .txt .tk[data-pos]");
    if (tk) popup(tk, tk.closest(".dl-col"));
  });
  document.addEventListener("keydown", (e) => { if (e.key === "Escape") close(); });
}
