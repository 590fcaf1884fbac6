"""``python -m app``: launch DFlash Studio.

Binds 127.0.0.1:7860 unless GRADIO_SERVER_NAME / GRADIO_SERVER_PORT say otherwise; never creates a
public share link unless DFLASH_SHARE=1. The default pair starts loading at once, in the
background, while the page is already usable. The OpenAI-compatible API is served under ``/v1``
on the same port (``DFLASH_API_KEY``, when set, is required there).
"""

from __future__ import annotations

import os
import sys


def main() -> None:
    from dflash_core.console import quiet_libraries

    quiet_libraries()
    from .service import StudioService
    from .studio import build_app, css, queue_app

    host = os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1")
    port = int(os.environ.get("GRADIO_SERVER_PORT", "7860"))
    service = StudioService(os.environ.get("DFLASH_MODELS_TOML"))
    service.preload()
    demo = build_app(service)
    print(f"DFlash Studio on http://{host}:{port} (loading {service.registry.default} in the background)", file=sys.stderr)
    if not queue_app(demo, max_size=int(os.environ.get("DFLASH_QUEUE_SIZE", "64"))):
        print("note: this Gradio's queue has no sleep_when_free; it polls at its own rate", file=sys.stderr)
    server_app, _, _ = demo.launch(server_name=host, server_port=port, share=os.environ.get("DFLASH_SHARE") == "1",
                                   css=css(), footer_links=["api"], show_error=True, prevent_thread_lock=True)
    # The page's animation frames budgeted while nobody touches it (app/frame_budget.py).
    from .frame_budget import IDLE_FRAMES_PER_S, serve_page_with_frame_budget

    if IDLE_FRAMES_PER_S > 0 and not serve_page_with_frame_budget(server_app):
        print("note: this Gradio serves its page elsewhere; its animation frames run unbudgeted", file=sys.stderr)
    # The OpenAI-compatible API on the same port, sharing the UI's engines (dflash_core.serving).
    from dflash_core.serving import build_router

    server_app.include_router(build_router(service))
    # The live pages' update streams (app/channel.py), beside Gradio's own routes.
    from .channel import build_router as build_live_router

    server_app.include_router(build_live_router())
    print(f"OpenAI-compatible API on http://{host}:{port}/v1", file=sys.stderr)
    demo.block_thread()


if __name__ == "__main__":
    main()
