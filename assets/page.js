() => {
  // light theme always
  document.body.classList.remove('dark');
  const typing = (el) => el instanceof HTMLElement && (el.isContentEditable ||
    ['INPUT', 'TEXTAREA', 'SELECT'].includes(el.tagName));
  document.addEventListener('keydown', (event) => {
    const box = event.target;
    // Enter in the Revisit number box commits it (Gradio's slider only commits on blur)
    if (event.key === 'Enter' && box instanceof HTMLInputElement && box.type === 'number'
        && box.closest('#step-slider')) { box.blur(); return; }
    if (typing(box) || event.altKey || event.ctrlKey || event.metaKey) { return; }
    // arrow keys step a replay (or, without one on screen, the live run forward)
    const replayOpen = document.querySelector('#replay-step-btn') &&
      document.querySelector('#replay-step-btn').offsetParent !== null;
    const target = event.key === 'ArrowRight' ? (replayOpen ? '#replay-step-btn' : '#step-btn')
      : event.key === 'ArrowLeft' && replayOpen ? '#replay-back-btn' : null;
    const button = target && document.querySelector(target);
    if (button) { event.preventDefault(); button.click(); }
  });
  // Gradio's plot draws every figure twice per update: Plotly.react, then Plots.resize (a 100 ms
  // timer, then a full relayout). A plot that still has its box's size once the layout settled
  // (the same 100 ms) gains nothing from the second pass: skip it there (a plot whose box changed
  // size, one shown late, or a window resize still resizes)
  const skipNeedlessResize = (plotly) => {
    if (!plotly || !plotly.Plots || plotly.Plots.labSkipsNeedlessResize) { return; }
    const resize = plotly.Plots.resize;
    const fits = (gd) => {
      const drawn = gd && gd._fullLayout;
      const box = gd && typeof gd.getBoundingClientRect === 'function' ? gd.getBoundingClientRect() : null;
      return Boolean(drawn && box && box.width > 0 && Math.abs(drawn.width - box.width) < 2
        && Math.abs(drawn.height - box.height) < 2);
    };
    plotly.Plots.resize = function (gd) {
      const self = this;
      const args = arguments;
      return new Promise((resolve, reject) => {
        setTimeout(() => {
          if (fits(gd)) { resolve(gd); return; }
          resize.apply(self, args).then(resolve, reject);
        }, 100);
      });
    };
    plotly.Plots.labSkipsNeedlessResize = true;
  };
  if (window.Plotly) {
    skipNeedlessResize(window.Plotly);
  } else {  // Gradio loads plotly.js with the first plot and publishes it as window.Plotly
    let plotly;
    Object.defineProperty(window, 'Plotly', {
      configurable: true,
      get: () => plotly,
      set: (value) => { plotly = value; skipNeedlessResize(value); },
    });
  }
  // larger type for a projector
  document.addEventListener('change', (event) => {
    if (event.target instanceof HTMLInputElement && event.target.closest('#presenter-toggle')) {
      document.body.classList.toggle('presenter', event.target.checked);
    }
  });
}
