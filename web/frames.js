// The first script of the page (web/head_first.py puts it before Gradio's modules, which capture
// requestAnimationFrame when they load).
//
// Gradio 6's status trackers (one per component) time an event in a requestAnimationFrame loop that stops only
// when the tracker itself sees its status leave "pending". The page's "Loading..." tracker is unmounted while
// pending at every page load, so its loop never stops, and every frame it asks for is one the browser draws:
// Chromium spent 13% of a core on an idle playground page on a 2-core AMD EPYC (docs/benchmarks.md, session 43),
// on the cores the engine computes on. Here their callbacks run on a 100 ms timer (a tracker shows tenths of a
// second), which draws nothing unless something changed; every other caller gets its frames as before.
(() => {
  const frame = window.requestAnimationFrame.bind(window);
  window.requestAnimationFrame = function (callback) {
    if (!(new Error().stack || "").includes("/statustracker-")) return frame(callback);
    return window.setTimeout(() => callback(performance.now()), 100);
  };
})();
