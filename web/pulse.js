/* DecodeLab playground: the page's pulse (run by Gradio as the hidden #dl-pulse output's js_on_load, with
   `element`, `props` and `watch`). Once a second it asks the web server for the service pill and the KV panel
   (GET dl/pulse, web/app.py) and draws them through web/draw.js, which leaves a drawing that did not change as it
   is. A gr.Timer did this before through Gradio's events, and each tick walked every component's loading status
   and cloned their state: ~5% of a core of an idle page's Chromium on the 2-core AMD EPYC. The session comes from
   the page's load (this output's value); a hidden tab does not ask; the KV panel is left to a run that draws it. */
const PERIOD_MS = 1000;
let session = "";
let busy = false;
const drawer = (id) => {
  const host = document.getElementById(id);
  return host && [...host.querySelectorAll("*")].find((e) => e.dlDraw);
};
const base = () => location.origin + location.pathname.replace(/[^/]*$/, "");
const running = () => document.querySelector(
  '.dl-col[data-status="running"], .dl-col[data-status="queued"], .dl-col[data-status="waiting"]');
const beat = async () => {
  if (busy || !session || document.hidden) return;
  busy = true;
  try {
    const r = await fetch(new URL("dl/pulse?session=" + encodeURIComponent(session), base()), {cache: "no-store"});
    if (r.ok) {
      const d = await r.json();
      drawer("dl-service")?.dlDraw(d.service);
      if (d.kv != null && !running()) drawer("kv")?.dlDraw(d.kv);
    }
  } catch (e) {
    // the web server is away (restarting, or the network): the next beat asks again
  } finally {
    busy = false;
  }
};
const start = () => {
  session = String(props.value || "");
  if (session && !element.dlPulse) {
    element.dlPulse = setInterval(beat, PERIOD_MS);
    document.addEventListener("visibilitychange", beat);
  }
};
start();
watch("value", start);
