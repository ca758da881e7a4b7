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
  // larger type for a projector
  document.addEventListener('change', (event) => {
    if (event.target instanceof HTMLInputElement && event.target.closest('#presenter-toggle')) {
      document.body.classList.toggle('presenter', event.target.checked);
    }
  });
}
