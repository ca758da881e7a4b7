// Runs first in the page's <head>, before Gradio's modules (page.FirstInHead, an ASGI middleware, puts it there).
// Gradio 6.31's status tracker keeps a requestAnimationFrame loop for its elapsed-time counter running
// at 60 frames a second for as long as the page is open, even on an empty Blocks with no event ever run
// (its loop never sees the flag that ends it). Each frame is a script call, a commit and a paint in the
// renderer, the compositor and the GPU process, taken from a decoding that shares the browser's cores;
// each call also moves the tracker's tweened stores (a second of 60-frame ticks). So the tracker's
// loops get frames only while a tracker is shown (a "processing | 1.2s" counter), 4 times a second (it
// shows tenths). While every tracker is hidden their callbacks wait, parked, and one timer looks for a
// shown tracker 4 times a second (no frame, no callback); the first one shown releases them all (a loop
// its tracker has stopped then ends). Measured on a 2-core EPYC, a run decoded beside an idle page: the
// tracker's frames at 4 a second cost the decoding ~9 %, none ~0. Every other animation frame is untouched.
(() => {
  const nativeFrame = window.requestAnimationFrame.bind(window);
  const nativeCancel = window.cancelAnimationFrame.bind(window);
  const FRAME_MS = 250;  // a shown counter's frames; also how often a hidden one is looked for
  const waiting = new Map();  // our id -> { timeout } | { frame } | { parked: callback }
  let nextId = -1;  // negative: never one of the browser's own frame ids
  let looking = null;  // the one timer that looks for a shown tracker while callbacks are parked
  const fromStatusTracker = () => (new Error().stack || '').includes('statustracker');
  const trackerShown = () => document.querySelector('[data-testid="status-tracker"]:not(.hide)') !== null;
  const frameFor = (id, callback) => {
    waiting.set(id, { frame: nativeFrame((time) => { waiting.delete(id); callback(time); }) });
  };
  const look = () => {
    looking = null;
    const parked = [...waiting].filter(([, entry]) => entry.parked);
    if (parked.length === 0) { return; }
    if (!trackerShown()) { looking = setTimeout(look, FRAME_MS); return; }
    for (const [id, entry] of parked) { frameFor(id, entry.parked); }
  };
  window.requestAnimationFrame = (callback) => {
    if (!fromStatusTracker()) { return nativeFrame(callback); }
    const id = nextId--;
    waiting.set(id, { timeout: setTimeout(() => {
      if (trackerShown()) { frameFor(id, callback); return; }
      waiting.set(id, { parked: callback });
      if (looking === null) { looking = setTimeout(look, FRAME_MS); }
    }, FRAME_MS) });
    return id;
  };
  window.cancelAnimationFrame = (id) => {
    const entry = waiting.get(id);
    if (!entry) { nativeCancel(id); return; }
    waiting.delete(id);
    if (entry.timeout !== undefined) { clearTimeout(entry.timeout); }
    if (entry.frame !== undefined) { nativeCancel(entry.frame); }
  };
})();
