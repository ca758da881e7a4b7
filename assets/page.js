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
  // a plot Gradio takes out of the page is purged: Plotly's window-level resize handler would
  // otherwise keep every replaced plot (its SVG and listeners) alive, some 1,250 nodes a step
  const purgeRemoved = (records) => {
    if (!window.Plotly) { return; }
    for (const record of records) {
      for (const node of record.removedNodes) {
        if (!(node instanceof Element) || node.isConnected) { continue; }
        const plots = node.classList.contains('js-plotly-plot') ? [node] : node.querySelectorAll('.js-plotly-plot');
        plots.forEach((plot) => window.Plotly.purge(plot));
      }
    }
  };
  // the generated text keeps to a few lines (the tree stays in view) and shows its newest tokens,
  // or the step being revisited, inside its own scroll box
  const followText = () => {
    const body = document.querySelector('#gen-text .gen-body');
    if (!body || body.scrollHeight <= body.clientHeight) { return; }
    const selected = body.querySelector('.tok.sel');
    body.scrollTop = selected ? selected.offsetTop - body.offsetTop - body.clientHeight / 2 : body.scrollHeight;
  };
  // DOM changes inside `selector`, and `fn` run once in the next frame however often it is asked for (one
  // layout read a frame, however many mutations a redraw makes)
  const touches = (records, selector) => records.some((r) => r.target instanceof Element && r.target.closest(selector));
  const oncePerFrame = (fn) => {
    let queued = false;
    return () => {
      if (queued) { return; }
      queued = true;
      requestAnimationFrame(() => { queued = false; fn(); });
    };
  };
  // a newly drawn tree whose top is in the window but whose bottom is not: the page scrolls just enough to
  // show it whole (keeping its top in view), so a Step shows its tree without the user scrolling; a user
  // who scrolled past the tree's top (to the tables below) is left where they are
  const treeIntoView = () => {
    const plot = document.querySelector('#tree-plot .js-plotly-plot');
    if (!plot) { return; }
    const box = plot.getBoundingClientRect();
    const below = box.bottom - window.innerHeight + 4;
    if (box.top >= 0 && below > 0) { window.scrollBy({ top: Math.min(box.top, below), behavior: 'instant' }); }
  };
  const followSoon = oncePerFrame(followText), placeSoon = oncePerFrame(treeIntoView);
  // Run to end with the browser on the serving machine: the server waits until the page has drawn a
  // redraw whose cards carry a number (#stats [data-draw]) before it decodes on, as drawing and decoding
  // share the cores. Drawn: two frames painted and the main thread idle (a hidden tab draws nothing).
  // (Looked for after every DOM change: a redraw's records do not always name #stats as their target.)
  let saidDrawn = 0, drawing = 0;
  const redrawNumber = () => Number(document.querySelector('#stats [data-draw]')?.dataset.draw || 0);
  const sayDrawn = () => {
    const number = redrawNumber(), button = document.querySelector('#drawn-btn');
    if (!number || number === saidDrawn || !button) { return; }
    saidDrawn = number;
    button.click();
  };
  const afterDrawing = () => {
    const number = redrawNumber();
    if (!number || number === saidDrawn || number === drawing) { return; }
    drawing = number;
    if (document.hidden) { sayDrawn(); return; }
    requestAnimationFrame(() => requestAnimationFrame(() => requestIdleCallback(sayDrawn, { timeout: 200 })));
  };
  new MutationObserver((records) => {
    purgeRemoved(records);
    if (touches(records, '#gen-text')) { followSoon(); }
    if (touches(records, '#tree-plot')) { placeSoon(); }
    afterDrawing();
  }).observe(document.body, { childList: true, subtree: true });
  // a typed value outside a slider's range: Gradio clamps it on blur without a word, so the page says so
  // under the slider (read in the capture phase, before the clamp), and drops the note once in range
  const sliderBox = (el) => el instanceof HTMLInputElement && el.type === 'number' &&
    el.closest('.block') && el.closest('.block').querySelector('input[type=range]') ? el : null;
  const inRange = (box) => parseFloat(box.value) >= parseFloat(box.min) && parseFloat(box.value) <= parseFloat(box.max);
  const sayClamped = (box) => {
    const block = box.closest('.block');
    const value = parseFloat(box.value), high = parseFloat(box.max);
    let note = block.querySelector('.clamp-note');
    if (Number.isNaN(value) || inRange(box)) { if (note) { note.remove(); } return; }
    const used = value > high ? high : parseFloat(box.min);
    if (!note) { note = document.createElement('div'); note.className = 'clamp-note'; block.appendChild(note); }
    note.textContent = `${box.value} is ${value > high ? 'above the largest' : 'below the smallest'} value ` +
      `this setting takes: ${used} is used.`;
  };
  document.addEventListener('blur', (event) => { const box = sliderBox(event.target); if (box) { sayClamped(box); } }, true);
  document.addEventListener('input', (event) => {
    const block = event.target instanceof Element && event.target.closest('.block');
    const note = block && block.querySelector('.clamp-note');
    const box = note && block.querySelector('input[type=number]');
    if (box && inRange(box)) { note.remove(); }
  }, true);
  // larger type for a projector
  document.addEventListener('change', (event) => {
    if (event.target instanceof HTMLInputElement && event.target.closest('#presenter-toggle')) {
      document.body.classList.toggle('presenter', event.target.checked);
    }
  });
}
