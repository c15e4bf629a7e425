// Finished replies as documents (specchat/ui/markdown.py): each code block's Copy button and
// each reply's Formatted / Tokens switch. Handled by delegation on the document: gradio's
// sanitizer keeps classes but strips onclick, data- and aria- attributes, and the chat replaces
// a message's HTML when it repaints. So which replies show their tokens is kept here, by turn
// (sc-turn-KEY), and put back (with the buttons' aria-pressed) whenever the chat repaints.
(() => {
  const REL = "nofollow noopener noreferrer";
  const tokensShown = new Set(); // keys of the turns showing their tokens view

  const keyOf = (turn) => {
    const found = [...turn.classList].find((c) => c.startsWith("sc-turn-"));
    return found ? found.slice("sc-turn-".length) : null;
  };

  function apply() {
    document.querySelectorAll(".sc-turn.sc-has-views").forEach((turn) => {
      const tokens = tokensShown.has(keyOf(turn));
      turn.classList.toggle("sc-view-tokens", tokens);
      turn.querySelectorAll("button.sc-view").forEach((button) => {
        const pressed = String(button.classList.contains("sc-view-tk") === tokens);
        if (button.getAttribute("aria-pressed") !== pressed) button.setAttribute("aria-pressed", pressed);
      });
      // (the sanitizer writes its own rel on every link)
      turn.querySelectorAll(".sc-md a[href]").forEach((a) => {
        if (a.rel !== REL) a.rel = REL;
      });
    });
  }

  function choose(button) {
    const turn = button.closest(".sc-turn");
    const key = turn && keyOf(turn);
    if (!key) return;
    if (button.classList.contains("sc-view-tk")) tokensShown.add(key);
    else tokensShown.delete(key);
    apply();
  }

  // The code as text: the clipboard where the page may write it (a secure context), else the
  // browser's copy command on a hidden text box; failing both, the code is selected for the
  // reader's own Ctrl+C.
  async function copy(button) {
    const block = button.closest(".sc-md-code");
    const code = block && block.querySelector("pre code");
    if (!code) return;
    const text = code.textContent;
    let done = false;
    if (navigator.clipboard && window.isSecureContext) {
      try {
        await navigator.clipboard.writeText(text);
        done = true;
      } catch (e) {
        done = false;
      }
    }
    if (!done) {
      const box = document.createElement("textarea");
      box.value = text;
      box.setAttribute("readonly", "");
      box.style.position = "fixed";
      box.style.opacity = "0";
      document.body.appendChild(box);
      box.select();
      try {
        done = document.execCommand("copy");
      } catch (e) {
        done = false;
      }
      box.remove();
      button.focus();
    }
    if (!done) {
      const range = document.createRange();
      range.selectNodeContents(code);
      const selection = window.getSelection();
      selection.removeAllRanges();
      selection.addRange(range);
    }
    say(button, done ? "Copied" : "Selected: press Ctrl+C");
  }

  function say(button, words) {
    const said = button.parentElement.querySelector(".sc-md-said");
    button.textContent = words;
    button.classList.toggle("sc-md-copied", words === "Copied");
    if (said) said.textContent = words;
    clearTimeout(button.scTimer);
    button.scTimer = setTimeout(() => {
      button.textContent = "Copy";
      button.classList.remove("sc-md-copied");
      if (said) said.textContent = "";
    }, 2000);
  }

  document.addEventListener("click", (event) => {
    const target = event.target.closest && event.target.closest("button.sc-view, button.sc-md-copy, .sc-md a[href]");
    if (!target) return;
    if (target.matches("button.sc-view")) choose(target);
    else if (target.matches("button.sc-md-copy")) copy(target);
    else target.rel = REL;
  });

  // After a repaint: the views the reader chose, again. Only additions that hold a reply with
  // views are looked at (a streaming reply adds token spans several times a second).
  new MutationObserver((mutations) => {
    const touched = mutations.some((m) =>
      [...m.addedNodes].some((n) => n.nodeType === 1 &&
        (n.matches(".sc-has-views") || n.querySelector(".sc-has-views"))));
    if (touched) apply();
  }).observe(document.documentElement, { childList: true, subtree: true });
})();
