// Runs first in the page's <head>, before Gradio's modules (page.FirstInHead, an ASGI middleware, puts it there).
// Gradio 6.31's status tracker keeps a requestAnimationFrame loop for its elapsed-time counter running
// at 60 frames a second for as long as the page is open, even on an empty Blocks with no event ever run
// (its loop never sees the flag that ends it). Each frame is a script call, a commit and a paint: about
// 6 % of a core on an idle page, taken from the decoding when the browser shares its cores. The counter
// shows tenths of a second, so its frames are asked for 4 times a second instead; every other
// animation frame is untouched.
(() => {
  const nativeFrame = window.requestAnimationFrame.bind(window);
  const nativeCancel = window.cancelAnimationFrame.bind(window);
  const TIMER_FRAME_MS = 250;
  const delayed = new Map();  // our id -> the timeout, then the frame it asked for
  let nextId = -1;  // negative: never one of the browser's own frame ids
  const fromStatusTracker = () => (new Error().stack || '').includes('statustracker');
  window.requestAnimationFrame = (callback) => {
    if (!fromStatusTracker()) { return nativeFrame(callback); }
    const id = nextId--;
    const timeout = setTimeout(() => {
      delayed.set(id, { frame: nativeFrame((time) => { delayed.delete(id); callback(time); }) });
    }, TIMER_FRAME_MS);
    delayed.set(id, { timeout });
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
