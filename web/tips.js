() => {
  /* DecodeLab playground: a token's hover card, made when the pointer first reaches the token. render.py puts the
     card's HTML in the token's data-tip attribute instead of in the page: a streaming column re-renders all its
     tokens every frame, and the cards' elements (~10 per token) were most of the browser's work per frame. The
     stylesheet shows `.tk:hover .tip` as before; a re-render drops the cards with the tokens. */
  if (window.dlTips) return;
  window.dlTips = true;
  document.addEventListener("mouseover", (e) => {
    const tk = e.target instanceof Element ? e.target.closest(".tk[data-tip]") : null;
    if (tk && !tk.querySelector(":scope > .tip")) tk.insertAdjacentHTML("beforeend", tk.dataset.tip);
  });
}
