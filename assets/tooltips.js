// The Stats tab's conversations table: a cell whose text is cut off (it ends with an ellipsis,
// specchat.css) shows its whole text as a tooltip. The title is set as the pointer enters the
// cell: gradio redraws the table's cells whenever it scrolls or refreshes.
document.addEventListener("mouseover", (event) => {
  const cell = event.target.closest && event.target.closest(
    "#sc-stats-conversations :is(td, [role=gridcell]) .cell-wrap");
  if (!cell) return;
  const text = cell.querySelector(":scope > span") || cell; // gradio's text box, if any
  cell.title = text.scrollWidth > text.clientWidth ? cell.textContent.trim() : "";
});
