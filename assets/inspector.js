// The speculation inspector: a click on a token (or Enter / Space on a focused one) opens its
// step's card under the reply; again, or Escape, closes it. A reply is one tab stop; the left
// and right arrows move the focus to the previous or next step's first token. The open card survives the page's
// repaints (gradio replaces a message's HTML while replies stream). Steps and turns are named
// by classes (sc-step-N, sc-card-N, sc-turn-KEY): gradio's sanitizer keeps classes only.
(() => {
  let open = null; // {turn, step}

  const named = (el, prefix) => {
    const found = [...el.classList].find((c) => c.startsWith(prefix));
    return found ? found.slice(prefix.length) : null;
  };

  function apply() {
    document.querySelectorAll(".sc-card:not([hidden])").forEach((card) => (card.hidden = true));
    document.querySelectorAll(".tk.sc-open-step").forEach((t) => t.classList.remove("sc-open-step"));
    if (!open) return;
    document.querySelectorAll(`.sc-turn-${open.turn}`).forEach((turn) => {
      turn.querySelectorAll(`.sc-card-${open.step}`).forEach((card) => (card.hidden = false));
      turn.querySelectorAll(`.sc-step-${open.step}`).forEach((t) => t.classList.add("sc-open-step"));
    });
  }

  function toggle(token) {
    const turn = token.closest(".sc-turn");
    if (!turn) return;
    const next = { turn: named(turn, "sc-turn-"), step: named(token, "sc-step-") };
    open = open && open.turn === next.turn && open.step === next.step ? null : next;
    apply();
  }

  document.addEventListener("click", (event) => {
    const token = event.target.closest && event.target.closest(".tk.sc-step");
    if (token) toggle(token);
  });
  document.addEventListener("keydown", (event) => {
    const token = event.target.closest && event.target.closest(".tk.sc-step");
    if (token && (event.key === "Enter" || event.key === " ")) {
      event.preventDefault();
      toggle(token);
    } else if (token && (event.key === "ArrowRight" || event.key === "ArrowLeft")) {
      const reply = token.closest(".sc-reply");
      const step = named(token, "sc-step-");
      // each step's first token, in reading order
      const firsts = [...(reply || document).querySelectorAll(".tk.sc-step")].filter(
        (t, i, all) => i === 0 || named(all[i - 1], "sc-step-") !== named(t, "sc-step-"));
      const at = firsts.findIndex((t) => named(t, "sc-step-") === step);
      const next = firsts[at + (event.key === "ArrowRight" ? 1 : -1)];
      if (next) {
        event.preventDefault();
        next.focus();
      }
    } else if (event.key === "Escape" && open) {
      open = null;
      apply();
    }
  });
  new MutationObserver(() => open && apply()).observe(document.documentElement, {
    childList: true,
    subtree: true,
  });
})();
