/* DecodeLab playground: an HTML output drawn by its own code, only what changed (run by Gradio as the component's
   js_on_load, with `element`, `props` and `watch`; the component's html_template is empty, so Gradio draws nothing).
   Gradio 6's HTML component redraws its whole value on every update: it parses it and walks the DOM comparing every
   node's attributes, removing what the new value lacks (a hover card web/tips.js put in a token went every frame of
   a streaming column, which re-sends all its tokens). Here a column's HTML comes in parts split at SEP
   (web/render.py): a part equal to the one drawn stays as it is; a part that only grew (the token text,
   `<div ...>...</div>` with more tokens before its end) gets the new tokens appended; any other changed part is
   parsed and replaced alone. A value without SEP (the trace, the KV panel) is drawn whole, and only when it changed.
   A column's drawing carries a stamp, data-seq, larger on every drawing: a frame older than the one drawn (two
   handlers draw a column, and Gradio sends a stream's last frame again when it completes) is dropped, so a column
   keeps its newest drawing. (The page's CPU a run did not measurably change: docs/benchmarks.md, session 41.) */
const SEP = "<!--s-->";
const END = "</div>";
let drawn = null;  // the value drawn, in its parts
let last = null;
const fragment = (html) => {
  const t = document.createElement("template");
  t.innerHTML = html;
  return t.content;
};
const stamp = (head) => Number((/ data-seq="(\d+)"/.exec(head) || [0, 0])[1]);

const parts = (ps) => {  // false where the drawing's shape changed: then it is drawn whole
  const col = element.firstElementChild;
  if (!drawn || drawn.length !== ps.length || ps.length < 3 || !col) return false;
  const anchors = [...col.childNodes].filter((n) => n.nodeType === Node.COMMENT_NODE && n.data === "s");
  const fresh = fragment(ps[0] + ps[ps.length - 1]).firstElementChild;
  if (anchors.length !== ps.length - 1 || !fresh || fresh.tagName !== col.tagName) return false;
  for (const a of [...col.attributes]) if (!fresh.hasAttribute(a.name)) col.removeAttribute(a.name);
  for (const a of fresh.attributes) if (col.getAttribute(a.name) !== a.value) col.setAttribute(a.name, a.value);
  for (let i = 1; i < ps.length - 1; i++) {
    const now = ps[i], was = drawn[i];
    if (now === was) continue;
    const start = anchors[i - 1], end = anchors[i], only = start.nextSibling;
    if (was.endsWith(END) && now.endsWith(END) && only && only.nodeType === Node.ELEMENT_NODE &&
        only.nextSibling === end && now.startsWith(was.slice(0, -END.length))) {
      const grown = now.slice(was.length - END.length, -END.length);  // whole tokens: the old text ended with one
      if (grown.startsWith("<")) {
        only.insertAdjacentHTML("beforeend", grown);
        continue;
      }
    }
    while (start.nextSibling && start.nextSibling !== end) start.nextSibling.remove();
    end.before(fragment(now));
  }
  return true;
};

const draw = (value) => {
  const v = value == null ? "" : String(value);
  if (v === last) return;
  const ps = v.split(SEP);
  if (drawn && ps.length > 1 && stamp(ps[0]) < stamp(drawn[0])) return;  // an older frame, arriving late
  if (!parts(ps)) element.innerHTML = v;
  drawn = ps;
  last = v;
};
element.dlDraw = draw;  // the tests feed frames through it,
element.dlDrawn = () => last;  // starting from the value drawn
draw(props.value);
watch("value", () => draw(props.value));
