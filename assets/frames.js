// gradio's status trackers tick their elapsed-time display by requestAnimationFrame for as long
// as a component's status is "pending", shown or hidden, and an idle page keeps one pending:
// 60 frames a second of renderer and compositor work, on cores the engine decodes on where the
// browser shares the machine. Their ticks go to a 10 Hz timer instead (the display shows
// tenths of a second), which wakes no frame unless the display changes; every other caller's
// frames are the browser's own.
(() => {
  const frame = window.requestAnimationFrame.bind(window);
  const cancel = window.cancelAnimationFrame.bind(window);
  const TRACKER = /\/statustracker-[\w-]*\.js/;
  window.requestAnimationFrame = (callback) => {
    if (!TRACKER.test(new Error().stack || "")) return frame(callback);
    return -setTimeout(() => callback(performance.now()), 100); // negative: a timer's id
  };
  window.cancelAnimationFrame = (id) => (id < 0 ? clearTimeout(-id) : cancel(id));
})();
