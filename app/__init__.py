"""DFlash Studio, the Gradio app (``python -m app``)."""
