() => {
  /* DecodeLab playground: each column keeps its newest drawing. Two handlers draw a column: Run (every column)
     and a branch's stream (its own), and Gradio sends a stream's last frame again when the stream completes, so
     a frame made earlier can reach the page after one made later (seen in CI: a finished branch drawn as
     "running" again; the root drawn over a branch forked a moment before). web/render.py stamps every drawing
     with an increasing data-seq, and Gradio morphs the column's element in place: when an older stamp lands on
     it, the newer drawing is put back. */
  if (window.dlNewest) return;
  window.dlNewest = true;
  const newest = new Map();  // the column's place (#out-<mode>) -> {seq, html, attrs} of its newest drawing
  const keep = (col) => {
    const where = col.closest("[id^='out-']")?.id || col.dataset.mode;
    const seq = Number(col.dataset.seq || 0);
    const best = newest.get(where);
    if (best && seq < best.seq) {
      for (const a of [...col.attributes]) if (!(a.name in best.attrs)) col.removeAttribute(a.name);
      for (const [name, value] of Object.entries(best.attrs)) col.setAttribute(name, value);
      col.innerHTML = best.html;
    } else if (!best || seq > best.seq) {
      const attrs = Object.fromEntries([...col.attributes].map((a) => [a.name, a.value]));
      newest.set(where, { seq, html: col.innerHTML, attrs });
    }
  };
  // the callback runs once the whole morph is done, so the element holds the complete drawing by then
  new MutationObserver((records) => {
    const cols = new Set(records.map((r) => r.target).filter((t) => t.classList?.contains("dl-col")));
    cols.forEach(keep);
  }).observe(document.body, { subtree: true, attributes: true, attributeFilter: ["data-seq"] });
}
