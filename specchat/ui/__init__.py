"""The Gradio page: state, rendering, handlers, the page itself, the Stats tab."""
