"""What the command lines (``python -m dflash_core``, its bench and train commands, ``python -m
app``) share: progress on stderr, and quiet libraries.

Its own module, imported by each command line, so that none of them imports another for these
(``cli`` imports ``bench.cli`` and ``training.cli`` to build its parser; they must not import it
back). It imports nothing of the project's.
"""

from __future__ import annotations

import os
import sys


def log(message: str) -> None:
    """One line of progress or a warning on stderr: stdout carries only results (``--json``)."""
    print(message, file=sys.stderr, flush=True)


def quiet_libraries() -> None:
    """Silence transformers' and tokenizers' chatter; call before they are imported, as both
    read their environment variables once."""
    # Library chatter (deprecations, progress bars of weight loading) would bury our own messages.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import warnings

    warnings.filterwarnings("ignore")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:
        pass
