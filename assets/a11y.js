// gradio draws an empty File (the Stats tab's CSV export before any export, the sidebar's) as a
// div with aria-label="Empty value" and no role, a label ARIA does not allow there (axe:
// aria-prohibited-attr). Such a placeholder gets role="img": an icon named "Empty value".
// Only the elements a change adds are looked at, so a streaming reply's tokens cost a check
// each and no search of the page.
(() => {
  const EMPTY = '[aria-label="Empty value"]:not([role])';
  const name = (el) => el.setAttribute("role", "img");
  new MutationObserver((records) => {
    for (const record of records) {
      for (const node of record.addedNodes) {
        if (node.nodeType !== 1) continue;
        if (node.matches(EMPTY)) name(node);
        else if (node.firstElementChild) node.querySelectorAll(EMPTY).forEach(name);
      }
    }
  }).observe(document.documentElement, {childList: true, subtree: true});
  document.querySelectorAll(EMPTY).forEach(name); // those drawn before this script ran
})();
