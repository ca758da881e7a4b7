// Runs first in the page's <head>, before Gradio's modules (page.FirstInHead, an ASGI middleware, puts it there).
// Gradio 6.31's status tracker keeps a requestAnimationFrame loop for its elapsed-time counter running
// at 60 frames a second for as long as the page is open, even on an empty Blocks with no event ever run
// (its loop never sees the flag that ends it). Each frame is a script call, a commit and a paint in the
// renderer, the compositor and the GPU process, taken from a decoding that shares the browser's cores.
// So the tracker's frames are given only while a tracker is shown (a "processing | 1.2s" counter), 4
// times a second (it shows tenths). While every tracker is hidden, its callback is called every 2 s
// without a frame (the loop ends there if the tracker has stopped it; a stuck loop idles), and a
// tracker shown meanwhile gets its frame within a quarter of a second. Measured
// (2-core EPYC, a run decoded through the API beside an idle page): the tracker's frames at 4 a second
// cost the decoding ~9 %, none ~0. Every other animation frame is untouched.
(() => {
  const nativeFrame = window.requestAnimationFrame.bind(window);
  const nativeCancel = window.cancelAnimationFrame.bind(window);
  const SHOWN_FRAME_MS = 250;  // a shown counter's frames
  const HIDDEN_CALL_MS = 2000;  // a hidden counter's callbacks, without a frame
  const delayed = new Map();  // our id -> the timeout, then the frame it asked for
  let nextId = -1;  // negative: never one of the browser's own frame ids
  const fromStatusTracker = () => (new Error().stack || '').includes('statustracker');
  const trackerShown = () => document.querySelector('[data-testid="status-tracker"]:not(.hide)') !== null;
  const later = (id, callback, asked = performance.now()) => {
    delayed.set(id, { timeout: setTimeout(() => {
      if (trackerShown()) {
        delayed.set(id, { frame: nativeFrame((time) => { delayed.delete(id); callback(time); }) });
      } else if (performance.now() - asked >= HIDDEN_CALL_MS) {
        delayed.delete(id);
        callback(performance.now());
      } else {
        later(id, callback, asked);
      }
    }, SHOWN_FRAME_MS) });
  };
  window.requestAnimationFrame = (callback) => {
    if (!fromStatusTracker()) { return nativeFrame(callback); }
    const id = nextId--;
    later(id, callback);
    return id;
  };
  window.cancelAnimationFrame = (id) => {
    const entry = delayed.get(id);
    if (!entry) { nativeCancel(id); return; }
    delayed.delete(id);
    if (entry.timeout !== undefined) { clearTimeout(entry.timeout); }
    if (entry.frame !== undefined) { nativeCancel(entry.frame); }
  };
})();
